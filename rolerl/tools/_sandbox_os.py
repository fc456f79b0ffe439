"""Linux primitives the sandbox worker needs and the standard library lacks (Python 3.10/3.11).

Imported only by `_sandbox_worker.py`, inside the sandbox processes, so it uses the standard library only.
Every function raises `OSError` with the real errno, so the worker can tell "the kernel refused" (EPERM in
a locked-down container) from a bug.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
# Every namespace flag: a sandboxed clone()/unshare() with any of these is refused (see seccomp below).
_CLONE_NS_MASK = (
    0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00020000 | 0x00000080
)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = (
    0x1,
    0x2,
    0x4,
    0x8,
    0x20,
    0x1000,
    0x4000,
)
_MS_PRIVATE = 1 << 18
_MOUNT_ATTR_RDONLY = 0x1
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_SYS_MOUNT_SETATTR = (
    442  # the same number on every architecture (added in 5.12, after the syscall unification)
)

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def mount(source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()),
        f"mount {target}",
    )


def make_tree_readonly_private() -> None:
    """Make every mount of this (new) mount namespace read-only and private, in one call.

    Private first of all, so that nothing we mount later propagates back to the host's namespace.
    `mount_setattr(AT_RECURSIVE)` (Linux >= 5.12) flips the whole tree atomically; on older kernels it
    raises ENOSYS and the worker treats the mount namespace as unavailable rather than half-applied.
    """
    attr = ctypes.create_string_buffer(struct.pack("QQQQ", _MOUNT_ATTR_RDONLY, 0, _MS_PRIVATE, 0))
    _check(_libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, b"/", _AT_RECURSIVE, attr, 32), "mount_setattr /")


# --- seccomp ------------------------------------------------------------------------------------------
# A small classic-BPF filter. Its jobs, in order:
#  1. kill any syscall made through a foreign ABI (i386 `int 0x80` on x86_64 would reach `socketcall`,
#     which the table below does not cover) and refuse x32 numbers;
#  2. refuse new namespaces (unshare, setns, clone with CLONE_NEW*, clone3): an unprivileged user
#     namespace would give the sandbox CAP_SYS_ADMIN over its own mounts (size-unlimited tmpfs, i.e.
#     memory outside RLIMIT_AS); clone3 gets ENOSYS because BPF cannot read its flags, and glibc then
#     falls back to clone;
#  3. refuse io_uring (its SOCKET/CONNECT opcodes never pass through this filter), bpf, perf_event_open,
#     userfaultfd and the keyring (shared per uid, i.e. across calls);
#  4. when the network namespace is unavailable, refuse socket() for every family but AF_UNIX.
_ARCHES = {
    # machine: (AUDIT_ARCH_*, syscall numbers, x32 bit or 0)
    "x86_64": (
        0xC000003E,
        {
            "socket": 41,
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
_LD_W_ABS, _JEQ_K, _JGE_K, _AND_K, _RET_K = 0x20, 0x15, 0x35, 0x54, 0x06
_RET_ALLOW, _RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
_EPERM, _EACCES, _ENOSYS, _AF_UNIX = 1, 13, 38, 1


def _ret_errno(err: int) -> int:
    return 0x00050000 | err


def seccomp_supported() -> bool:
    return platform.machine() in _ARCHES


def install_seccomp(deny_inet: bool) -> None:
    """Install the filter above on this process and its future children (needs no_new_privs first)."""
    arch, nr, x32 = _ARCHES[platform.machine()]
    # (code, jt, jf, k). Jumps are relative: jf=n skips the next n instructions. Each block returns or
    # falls through to the next with the syscall number still in the accumulator.
    prog: list[tuple[int, int, int, int]] = []

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        prog.append((code, jt, jf, k))

    ins(_LD_W_ABS, 4)  # seccomp_data.arch
    ins(_JEQ_K, arch, 1, 0)
    ins(_RET_K, _RET_KILL_PROCESS)
    ins(_LD_W_ABS, 0)  # seccomp_data.nr
    if x32:
        ins(_JGE_K, x32, 0, 1)
        ins(_RET_K, _ret_errno(_EPERM))
    refused = [
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
    ]
    for name in refused:
        ins(_JEQ_K, nr[name], 0, 1)
        ins(_RET_K, _ret_errno(_EPERM))
    ins(_JEQ_K, nr["clone3"], 0, 1)
    ins(_RET_K, _ret_errno(_ENOSYS))
    # clone: load the low 32 bits of args[0] (flags; little-endian), refuse any namespace flag.
    ins(_JEQ_K, nr["clone"], 0, 5)
    ins(_LD_W_ABS, 16)
    ins(_AND_K, _CLONE_NS_MASK)
    ins(_JEQ_K, 0, 0, 1)
    ins(_RET_K, _RET_ALLOW)
    ins(_RET_K, _ret_errno(_EPERM))
    if deny_inet:
        ins(_JEQ_K, nr["socket"], 0, 4)
        ins(_LD_W_ABS, 16)  # socket(domain, ...): args[0]
        ins(_JEQ_K, _AF_UNIX, 0, 1)
        ins(_RET_K, _RET_ALLOW)
        ins(_RET_K, _ret_errno(_EACCES))
    ins(_RET_K, _RET_ALLOW)
    raw = b"".join(struct.pack("HBBI", code, jt, jf, k) for code, jt, jf, k in prog)
    filt = ctypes.create_string_buffer(raw)
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(filt))
    fprog_buf = ctypes.create_string_buffer(fprog)
    _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog_buf, 0, 0), "seccomp")


# --- memory cgroup ------------------------------------------------------------------------------------
# RLIMIT_AS bounds one process; `processes` of them could still take processes x memory_mb. A memory
# cgroup per worker bounds the whole tree (tmpfs pages it writes included): its OOM killer then picks a
# sandbox process. Created under our own cgroup, so limits the host already lives under still apply.
def memory_cgroup_root() -> tuple[str, int] | None:
    """(dir of this process's memory cgroup, version 1 or 2) if a child with its own limit can be made."""
    v1_path = v2_path = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            hier, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                v1_path = path
            elif hier == "0":
                v2_path = path
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            root, mnt, fstype, opts = fields[3], fields[4], fields[sep + 1], fields[sep + 3]
            for path, version in ((v1_path, 1), (v2_path, 2)):
                want = "cgroup" if version == 1 else "cgroup2"
                if path is None or fstype != want or (version == 1 and "memory" not in opts.split(",")):
                    continue
                if not (path + "/").startswith(root.rstrip("/") + "/"):
                    continue
                cg = os.path.join(mnt, path[len(root.rstrip("/")) :].lstrip("/"))
                if version == 2 and not _has_word(os.path.join(cg, "cgroup.subtree_control"), "memory"):
                    continue  # v2 needs the controller delegated to children (no-internal-process rule)
                if os.access(cg, os.W_OK):
                    return cg.rstrip("/"), version
    return None


def _has_word(path: str, word: str) -> bool:
    try:
        with open(path) as f:
            return word in f.read().split()
    except OSError:
        return False


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def enter_memory_cgroup(root: str, version: int, name: str, limit_bytes: int) -> tuple[int, int]:
    """Create `root/name` with the limit (no swap) and move this process into it.

    Returns fds for `leave_memory_cgroup` (root dir, root's cgroup.procs), opened now: later this process
    sits in a mount namespace whose tree is read-only, and these stay on the host's writable mount.
    """
    cg = os.path.join(root, name)
    os.mkdir(cg)
    if version == 1:
        _write(os.path.join(cg, "memory.limit_in_bytes"), str(limit_bytes))
        if os.path.exists(os.path.join(cg, "memory.memsw.limit_in_bytes")):
            _write(os.path.join(cg, "memory.memsw.limit_in_bytes"), str(limit_bytes))
    else:
        _write(os.path.join(cg, "memory.max"), str(limit_bytes))
        if os.path.exists(os.path.join(cg, "memory.swap.max")):
            _write(os.path.join(cg, "memory.swap.max"), "0")
    fds = (
        os.open(root, os.O_RDONLY | os.O_DIRECTORY),
        os.open(os.path.join(root, "cgroup.procs"), os.O_WRONLY),
    )
    _write(os.path.join(cg, "cgroup.procs"), str(os.getpid()))
    return fds


def leave_memory_cgroup(fds: tuple[int, int], name: str) -> None:
    """Move back to the parent cgroup and remove `name` (no other process may be left in it)."""
    root_fd, procs_fd = fds
    os.write(procs_fd, str(os.getpid()).encode())
    os.rmdir(name, dir_fd=root_fd)
