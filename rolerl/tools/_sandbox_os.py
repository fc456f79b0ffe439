"""Linux primitives the sandbox worker needs and the standard library lacks (Python 3.10/3.11).

Imported only by `_sandbox_worker.py`, inside the sandbox processes, so it uses the standard library only.
Every function raises `OSError` with the real errno, so the worker can tell "the kernel refused" (EPERM in
a locked-down container) from a bug.
"""

from __future__ import annotations

import ctypes
import os
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# File descriptors of every process of a worker tree (the host's `Worker` hands them over in this order):
# 0 /dev/null (or the call's stdin), 1/2 stdout/stderr pipes, then these.
FD_CTL = 3  # JSON lines to the host (the code can write here too: the host validates every line)
FD_REQ = 4  # JSON lines from the host: one request per call (interpreter only)
FD_KILL = 5  # a byte (or EOF) from the host tears the tree down (supervisor only)

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

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


def enter_user_namespace(uid: int, gid: int) -> None:
    """A new user namespace mapping just our own uid and gid to themselves (all an unprivileged process
    may map), as bubblewrap does: we keep our ids and gain capabilities over namespaces created from now
    on, which the interpreter drops again (`drop_capabilities`)."""
    unshare(CLONE_NEWUSER)
    for name, text in (
        ("uid_map", f"{uid} {uid} 1\n"),
        ("setgroups", "deny"),
        ("gid_map", f"{gid} {gid} 1\n"),
    ):
        with open(f"/proc/self/{name}", "w") as f:  # setgroups must be denied before an unprivileged gid_map
            f.write(text)


_CAP_VERSION_3 = 0x20080522
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4


def drop_capabilities() -> None:
    """Empty every capability set. Needed where the uid stays the same (a user namespace): a uid change
    from 0 clears them by itself, this does not."""
    for cap in range(64):  # the bounding set: no file capability can give any back
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            break  # EINVAL: past the last capability this kernel knows
    _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    header = ctypes.create_string_buffer(struct.pack("Ii", _CAP_VERSION_3, 0))
    data = ctypes.create_string_buffer(bytes(24))  # effective, permitted, inheritable; two 32-bit halves
    _check(_libc.capset(header, data), "capset")


_IPC_RMID = 0


def remove_sysv_ipc(uid: int) -> None:
    """Remove the SysV shared memory segments, message queues and semaphore sets that `uid` created or
    owns (the owner can be changed with IPC_SET, the creator cannot). Run as that uid, which may remove
    exactly those; used where there is no IPC namespace to take them away."""
    removers = {
        "shm": lambda i: _libc.shmctl(i, _IPC_RMID, None),
        "msg": lambda i: _libc.msgctl(i, _IPC_RMID, None),
        "sem": lambda i: _libc.semctl(i, 0, _IPC_RMID),
    }
    for kind, remove in removers.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                head, *rows = [line.split() for line in f]
        except (OSError, ValueError):
            continue
        at_id, at_uid, at_cuid = 1, head.index("uid"), head.index("cuid")
        for row in rows:
            if uid in (int(row[at_uid]), int(row[at_cuid])):
                remove(int(row[at_id]))


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
