"""The sandbox's own processes. Run as a script by `python_sandbox.py`; standard library only.

Process tree of one worker (one call, or one session of calls):

    zygote (root, long-lived; forks a clean copy of itself per worker, so a worker costs a fork, not an
     |      interpreter start, and preloaded modules come for free)
     +- supervisor (root, host pid namespace; new mount/net/pid/ipc namespaces; the host's only handle on the
         |          tree: a byte on fd 5 (or the host dying) tears everything down, then it exits)
         +- init (root, pid 1 of the new pid namespace; reaps orphans; when it exits the kernel kills
             |    every process of the namespace, setsid daemons included)
             +- interpreter (dedicated uid, rlimits, no_new_privs, seccomp; runs the model's code)

Without a pid namespace the supervisor itself is the interpreter's parent and a child subreaper, and it
kills the tree by its dedicated uid (see `_kill_all`). File descriptors in every call process:
0 /dev/null (or the call's stdin), 1/2 stdout/stderr pipes, 3 messages to the host (JSON lines),
4 requests from the host (JSON lines), 5 kill pipe (supervisor only).
"""

import contextlib
import gc
import glob
import importlib
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Sibling files, not the rolerl package: this runs as a script, in processes that must stay small.
import _sandbox_cell as cell  # noqa: E402
import _sandbox_os as sos  # noqa: E402
import _sandbox_seccomp as seccomp  # noqa: E402

sys.path.pop(0)

FD_CTL, FD_REQ, FD_KILL = sos.FD_CTL, sos.FD_REQ, sos.FD_KILL
# Imported once in the zygote: every call gets them for free (a fork shares them), and they keep working
# where the interpreter's files are not readable by the sandbox uid and no mount namespace can fix that.
STDLIB_PRELOAD = (
    "ast bisect collections copy dataclasses datetime decimal enum fractions functools glob heapq itertools "
    "json math operator pathlib random re shutil socket statistics string subprocess tempfile textwrap "
    "threading time typing encodings.idna"
)


def _exit_code(status: int) -> int:
    """A wait status as subprocess reports it: the exit code, or minus the signal number."""
    return os.waitstatus_to_exitcode(status)


# --- zygote -------------------------------------------------------------------------------------------
MEMORY_CGROUP: tuple[str, int] | None = None  # (our memory cgroup dir, version), set by the zygote


def zygote(sock: socket.socket, cfg: dict) -> None:
    global MEMORY_CGROUP
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps supervisors; the host reads fd 3
    if cfg["tree_memory_mb"] > 0:
        try:
            MEMORY_CGROUP = sos.memory_cgroup_root()
        except (OSError, ValueError):
            MEMORY_CGROUP = None
        for stale in glob.glob(os.path.join(MEMORY_CGROUP[0], "rolerl-sandbox-*")) if MEMORY_CGROUP else ():
            with contextlib.suppress(OSError):  # left by a SIGKILLed supervisor; live ones are busy
                os.rmdir(stale)
    for name in STDLIB_PRELOAD.split() + list(cfg["preload"]):
        importlib.import_module(name)
    # Forked copies share the zygote's pages until written; a GC pass in a child would write to every
    # object (copying most pages). Frozen objects are never collected, so they stay shared.
    gc.freeze()
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 5)
        if not msg:
            return  # the host closed its end (or died): no more workers
        req = json.loads(msg)
        if not isinstance(req.get("uid"), int) or req["uid"] <= 0 or len(fds) != 5:
            for fd in fds:
                os.close(fd)
            sock.send(b'{"pid": 0}')
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()  # the sandbox must never reach the zygote, which forks root processes
                _supervisor(req, cfg, fds)
            except BaseException as exc:  # noqa: BLE001 - report any setup failure to the host
                cell.send({"error": f"{type(exc).__name__}: {exc}"})
            os._exit(70)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


# --- supervisor ---------------------------------------------------------------------------------------
def _install_fds(fds: list[int]) -> None:
    req_r, out_w, err_w, ctl_w, kill_r = fds
    # Move the received fds above the targets first: they may already sit on 0..5.
    high = [os.dup(fd) for fd in (out_w, err_w, ctl_w, req_r, kill_r)]
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    for target, fd in zip((1, 2, FD_CTL, FD_REQ, FD_KILL), high, strict=True):
        os.dup2(fd, target, inheritable=target < 3)
    os.closerange(FD_KILL + 1, 1 << 20)


_NS_FLAGS = {
    "mount": sos.CLONE_NEWNS,
    "net": sos.CLONE_NEWNET,
    "pid": sos.CLONE_NEWPID,
    "ipc": sos.CLONE_NEWIPC,
}


def _isolate(req: dict, cfg: dict, notes: list[str]) -> dict:
    """Enter the namespaces the config asks for and the kernel allows; return what holds."""
    iso = {"mountns": False, "netns": False, "pidns": False, "ipcns": False, "userns": False, "notes": notes}
    if cfg["privilege"] == "unprivileged":  # the others are then created from (and owned by) this one
        sos.enter_user_namespace(os.getuid(), os.getgid())  # refused: the host reports how to enable it
        iso["userns"] = True
    for name, flag in _NS_FLAGS.items():
        if name not in cfg["namespaces"]:
            continue
        try:
            sos.unshare(flag)
            iso[name + "ns"] = True
        except OSError as exc:
            iso["notes"].append(f"{name} namespace unavailable ({exc.strerror})")
    if not iso["ipcns"]:
        iso["notes"].append(
            "no IPC namespace: the uid's SysV IPC objects are removed after each worker; "
            "POSIX message queues cannot be created (RLIMIT_MSGQUEUE 0)"
        )
    if iso["mountns"]:
        try:
            sos.make_tree_readonly_private()
        except OSError as exc:
            # Nothing was mounted yet, so nothing can propagate to the host: just run without it.
            iso["mountns"] = False
            iso["notes"].append(f"read-only mount tree unavailable ({exc.strerror})")
    if iso["mountns"]:
        uid = req["uid"]
        opts = f"size={cfg['disk_mb']}m,nr_inodes=16384,mode=0700,uid={uid},gid={uid}"
        sos.mount("tmpfs", req["workdir"], "tmpfs", sos.MS_NOSUID | sos.MS_NODEV, opts)
        home = _home_to_hide(req, cfg)
        covered = _expose(_interpreter_paths(), {home} if home else set())
        for path in cfg["hidden_paths"] + ([home] if home and home not in covered else []):
            if os.path.isdir(path):
                sos.mount("tmpfs", path, "tmpfs", sos.MS_RDONLY | sos.MS_NOSUID | sos.MS_NODEV, "size=4k")
    if cfg["network"] == "isolated" and not iso["netns"] and not seccomp.supported():
        raise RuntimeError("no network namespace and no seccomp filter for this architecture")
    return iso


def _interpreter_paths() -> list[str]:
    paths = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(sys.executable),
        os.path.dirname(os.path.realpath(sys.executable)),  # `python` run by the code, past venv symlinks
    ]
    paths += [p for p in sys.path if p]
    dirs = {
        os.path.realpath(p if os.path.isdir(p) else os.path.dirname(p)) for p in paths if os.path.exists(p)
    }
    return sorted(dirs)


def _home_to_hide(req: dict, cfg: dict) -> str:
    """Unprivileged mode: the caller's home dir, which the code (running as the caller) could read."""
    if cfg["privilege"] != "unprivileged":
        return ""
    import pwd

    try:
        home = os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        return ""
    inside = (req["workdir"] + "/").startswith(home + "/")  # never hide the working dir
    return home if home != "/" and os.path.isdir(home) and not inside else ""


def _expose(paths: list[str], closed: set[str]) -> set[str]:
    """Let the sandbox uid reach the interpreter's own files where a parent dir is closed to it (pyenv
    under /root, mode 0700; or a dir in `closed`): cover the outermost closed dir with an empty read-only
    tmpfs and bind-mount just the needed dirs back into it, so everything else in it stays out of sight."""
    blocked: dict[str, list[str]] = {}
    for path in paths:
        parts = path.split("/")
        for i in range(2, len(parts)):
            ancestor = "/".join(parts[:i])
            if ancestor in closed or not os.stat(ancestor).st_mode & 0o001:  # no search for "others"
                blocked.setdefault(ancestor, []).append(path)
                break
    os.umask(0o022)
    for ancestor, inner in blocked.items():  # outermost closed dirs of different paths never nest
        held = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in inner]  # before the tmpfs hides them
        sos.mount("tmpfs", ancestor, "tmpfs", sos.MS_NOSUID | sos.MS_NODEV, "size=64k,mode=0755")
        for path, fd in held:
            os.makedirs(path, exist_ok=True)
            sos.mount(f"/proc/self/fd/{fd}", path, "none", sos.MS_BIND | sos.MS_REC)
            os.close(fd)
        flags = sos.MS_REMOUNT | sos.MS_BIND | sos.MS_RDONLY | sos.MS_NOSUID | sos.MS_NODEV
        sos.mount("none", ancestor, "none", flags)
    return set(blocked)


def _mount_proc() -> None:
    # A fresh procfs: with a pid namespace it shows only the sandbox; hidepid=2 hides other uids' processes
    # (their cmdlines and environments) in any case.
    sos.mount("proc", "/proc", "proc", sos.MS_NOSUID | sos.MS_NODEV | sos.MS_NOEXEC, "hidepid=2")


def _supervisor(req: dict, cfg: dict, fds: list[int]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # no terminal signals from the host's session
    _install_fds(fds)
    sos.prctl(sos.PR_SET_CHILD_SUBREAPER, 1)  # orphans (double-forked daemons) reparent to us, not init
    iso: dict = {"notes": []}
    cgroup = _enter_cgroup(req, cfg, iso)  # before the mount namespace makes /sys/fs/cgroup read-only
    iso.update(_isolate(req, cfg, iso["notes"]))
    if iso["mountns"] and not iso["pidns"]:
        _mount_proc()
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        if iso["pidns"]:
            _init(req, cfg, iso)
        else:
            cell.interpreter(req, cfg, iso)
        os._exit(70)
    os.close(FD_REQ)  # only the interpreter reads requests: the host gets EPIPE once it is gone
    pidfd = os.pidfd_open(child)
    done = False
    while not done:
        ready, _, _ = select.select([FD_KILL, pidfd], [], [], 1.0)
        done = FD_KILL in ready
        # Reap whatever exited (orphans too, so their zombies do not count against RLIMIT_NPROC).
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid == child:
                done = True
                if not iso["pidns"]:
                    cell.send({"exit": _exit_code(status)})
    _teardown(pidfd, req, iso)
    if cgroup is not None:
        with contextlib.suppress(OSError):  # else removed by the next zygote start
            sos.leave_memory_cgroup(*cgroup)
    os._exit(0)


def _enter_cgroup(req: dict, cfg: dict, iso: dict) -> tuple[tuple[int, int], str] | None:
    iso["memory_cgroup"] = False
    if cfg["tree_memory_mb"] <= 0:
        return None
    if MEMORY_CGROUP is None:
        iso["notes"].append("no writable memory cgroup: memory is bounded per process only (RLIMIT_AS)")
        return None
    name = f"rolerl-sandbox-{req['uid']}-{os.getpid()}"
    try:
        fds = sos.enter_memory_cgroup(*MEMORY_CGROUP, name, cfg["tree_memory_mb"] << 20)
    except OSError as exc:
        iso["notes"].append(f"memory cgroup unavailable ({exc})")
        return None
    os.set_inheritable(fds[0], False)
    iso["memory_cgroup"] = True
    return fds, name


def _teardown(pidfd: int, req: dict, iso: dict) -> None:
    if iso["pidns"]:
        # Killing the namespace's init makes the kernel SIGKILL every process in it; init's wait status
        # is only reported once they are all gone. Through the pidfd: if init was reaped already, its pid
        # number may belong to some other process by now, and we are root.
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    else:
        _as_uid(req["uid"], _kill_all)
    while True:  # every process of the tree is our descendant (subreaper), so ECHILD means all are gone
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    if not (iso["mountns"] and iso["ipcns"]):
        _as_uid(req["uid"], lambda uid: _sweep(uid, iso))


def _sweep(uid: int, iso: dict) -> None:
    if not iso["mountns"]:  # without a read-only mount tree the world-writable dirs were writable
        _sweep_owned(uid)
    if not iso["ipcns"]:  # without an IPC namespace its SysV objects would outlive the call
        sos.remove_sysv_ipc(uid)


def _as_uid(uid: int, fn: Callable[[int], None]) -> None:
    """Run fn(uid) in a child that has become exactly that uid (real, effective and saved), and wait.

    Never with a mixed uid set: a real uid of 0 would let kill(-1) reach root's processes."""
    pid = os.fork()
    if pid == 0:
        try:
            if os.getresuid() != (uid, uid, uid):  # root mode (unprivileged: we are that uid already)
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            if os.getresuid() == (uid, uid, uid) and uid != 0:
                fn(uid)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _kill_all(uid: int) -> None:
    # kill(-1) reaches every process this uid may signal (its own, as the uid is dedicated) but the
    # caller. It walks the task list under the tasklist lock and a fork with a fatal signal pending fails,
    # so after one call no process of the uid can run or appear again; the supervisor reaps them.
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)


def _sweep_owned(uid: int) -> None:
    """Delete the top-level entries of the world-writable dirs that belong to the uid (all dead now)."""
    import shutil

    for root in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


# --- init (pid 1 of the sandbox's pid namespace) ------------------------------------------------------
def _init(req: dict, cfg: dict, iso: dict) -> None:
    sos.prctl(sos.PR_SET_PDEATHSIG, signal.SIGKILL)  # supervisor gone -> namespace gone
    os.closerange(FD_KILL, 1 << 20)  # the kill pipe and the supervisor's cgroup fds
    if iso["mountns"]:
        _mount_proc()
    child = os.fork()
    if child == 0:
        cell.interpreter(req, cfg, iso)
        os._exit(70)
    os.close(FD_REQ)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            cell.send({"exit": _exit_code(status)})
            os._exit(0)


if __name__ == "__main__":
    # argv: zygote <socket fd> <config JSON>
    if len(sys.argv) != 4 or sys.argv[1] != "zygote":
        sys.exit("usage: _sandbox_worker.py zygote FD CONFIG_JSON")
    zygote(socket.socket(fileno=int(sys.argv[2])), json.loads(sys.argv[3]))
