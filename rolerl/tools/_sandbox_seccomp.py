"""The sandboxed interpreter's seccomp filter (standard library only; runs inside the worker).

A small classic-BPF filter. Its jobs, in order:
 1. kill any syscall made through a foreign ABI (i386 `int 0x80` on x86_64 would reach `socketcall`,
    which the table below does not cover) and refuse x32 numbers;
 2. refuse new namespaces (unshare, setns, clone with CLONE_NEW*, clone3): an unprivileged user
    namespace would give the sandbox CAP_SYS_ADMIN over its own mounts (size-unlimited tmpfs, i.e.
    memory outside RLIMIT_AS); clone3 gets ENOSYS because BPF cannot read its flags, and glibc then
    falls back to clone;
 3. refuse io_uring (its SOCKET/CONNECT opcodes never pass through this filter), bpf, perf_event_open,
    userfaultfd and the keyring (shared per uid, i.e. across calls);
 4. when the network namespace is unavailable, refuse socket() for every family, AF_UNIX included, and
    socketpair() except for connected stream/seqpacket pairs. Abstract unix addresses live in the network
    namespace and have no file permissions, so without one an AF_UNIX socket could reach any abstract
    socket of the host (and a datagram socket from socketpair() can still sendto() one). BPF cannot read
    the address behind connect()'s pointer, so the socket itself is refused. The cost: no unix sockets
    with addresses (multiprocessing managers, say); pipes and socketpair() streams (asyncio) still work.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

_libc = ctypes.CDLL(None, use_errno=True)

_CLONE_NS_MASK = (  # every namespace flag: a sandboxed clone()/unshare() with any of these is refused
    0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00020000 | 0x00000080
)
_ARCHES = {
    # machine: (AUDIT_ARCH_*, syscall numbers, x32 bit or 0)
    "x86_64": (
        0xC000003E,
        {
            "socket": 41,
            "socketpair": 53,
            "clone": 56,
            "unshare": 272,
            "setns": 308,
            "clone3": 435,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "bpf": 321,
            "perf_event_open": 298,
            "userfaultfd": 323,
            "keyctl": 250,
            "add_key": 248,
            "request_key": 249,
        },
        0x40000000,
    ),
    "aarch64": (  # the asm-generic table; not exercised by our CI (x86_64)
        0xC00000B7,
        {
            "socket": 198,
            "socketpair": 199,
            "clone": 220,
            "unshare": 97,
            "setns": 268,
            "clone3": 435,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "bpf": 280,
            "perf_event_open": 241,
            "userfaultfd": 282,
            "keyctl": 219,
            "add_key": 217,
            "request_key": 218,
        },
        0,
    ),
}
_REFUSED = (
    "unshare",
    "setns",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
)
_LD_W_ABS, _JEQ_K, _JGE_K, _AND_K, _RET_K = 0x20, 0x15, 0x35, 0x54, 0x06
_RET_ALLOW, _RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
_EPERM, _EACCES, _ENOSYS = 1, 13, 38
_SOCK_STREAM, _SOCK_SEQPACKET, _SOCK_TYPE_MASK = 1, 5, 0xF
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
# seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 i (we load the low 32 bits: little-endian)
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24


def _ret_errno(err: int) -> int:
    return 0x00050000 | err


def supported() -> bool:
    return platform.machine() in _ARCHES


def install(deny_sockets: bool) -> None:
    """Install the filter on this process and its future children (needs no_new_privs first)."""
    arch, nr, x32 = _ARCHES[platform.machine()]
    # (code, jt, jf, k). Jumps are relative: jf=n skips the next n instructions. Each block returns or
    # falls through to the next with the syscall number still in the accumulator.
    prog: list[tuple[int, int, int, int]] = []

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        prog.append((code, jt, jf, k))

    ins(_LD_W_ABS, _ARCH)
    ins(_JEQ_K, arch, 1, 0)
    ins(_RET_K, _RET_KILL_PROCESS)
    ins(_LD_W_ABS, _NR)
    if x32:
        ins(_JGE_K, x32, 0, 1)
        ins(_RET_K, _ret_errno(_EPERM))
    for name in _REFUSED:
        ins(_JEQ_K, nr[name], 0, 1)
        ins(_RET_K, _ret_errno(_EPERM))
    ins(_JEQ_K, nr["clone3"], 0, 1)
    ins(_RET_K, _ret_errno(_ENOSYS))
    ins(_JEQ_K, nr["clone"], 0, 5)  # clone(flags, ...): refuse any namespace flag
    ins(_LD_W_ABS, _ARG0)
    ins(_AND_K, _CLONE_NS_MASK)
    ins(_JEQ_K, 0, 0, 1)
    ins(_RET_K, _RET_ALLOW)
    ins(_RET_K, _ret_errno(_EPERM))
    if deny_sockets:
        ins(_JEQ_K, nr["socket"], 0, 1)
        ins(_RET_K, _ret_errno(_EACCES))
        ins(_JEQ_K, nr["socketpair"], 0, 6)  # socketpair(domain, type, ...): connected streams only
        ins(_LD_W_ABS, _ARG1)
        ins(_AND_K, _SOCK_TYPE_MASK)  # without SOCK_NONBLOCK / SOCK_CLOEXEC
        ins(_JEQ_K, _SOCK_STREAM, 2, 0)
        ins(_JEQ_K, _SOCK_SEQPACKET, 1, 0)
        ins(_RET_K, _ret_errno(_EACCES))
        ins(_RET_K, _RET_ALLOW)
    ins(_RET_K, _RET_ALLOW)
    raw = b"".join(struct.pack("HBBI", code, jt, jf, k) for code, jt, jf, k in prog)
    filt = ctypes.create_string_buffer(raw)
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxP", len(prog), ctypes.addressof(filt)))
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog, 0, 0) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp: {os.strerror(err)}")
