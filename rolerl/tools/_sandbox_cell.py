"""The sandboxed interpreter: drops privileges, then runs the host's code strings one cell at a time.

Part of the worker (see `_sandbox_worker.py`); standard library only. Everything from here on runs as the
dedicated uid, so nothing below needs to be trusted: it only has to report honestly to the host.
"""

import ast
import contextlib
import json
import linecache
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
import types

import _sandbox_os as sos
import _sandbox_seccomp as seccomp

FD_CTL, FD_REQ, FD_KILL = sos.FD_CTL, sos.FD_REQ, sos.FD_KILL


def send(msg: dict) -> None:
    # One write of < PIPE_BUF bytes is atomic, so messages from several processes never interleave.
    with contextlib.suppress(OSError):  # the host went away; the kill pipe's EOF tears us down
        os.write(FD_CTL, (json.dumps(msg) + "\n").encode())


def _drop_privileges(req: dict, cfg: dict, iso: dict) -> None:
    cpu_hard = cfg["session_cpu_s"] if req["session"] else cfg["cpu_s"] + 1
    mb = 1 << 20
    limits = {
        resource.RLIMIT_CPU: (cfg["cpu_s"], cpu_hard),  # soft: SIGXCPU; hard: SIGKILL
        resource.RLIMIT_AS: (cfg["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (cfg["file_size_mb"] * mb,) * 2,
        resource.RLIMIT_NOFILE: (cfg["open_files"],) * 2,
        resource.RLIMIT_NPROC: (cfg["processes"],) * 2,  # counted per uid (and user namespace)
        resource.RLIMIT_CORE: (0, 0),
    }
    if not iso["ipcns"]:  # POSIX message queues would outlive the call on the host and cannot be listed
        limits[resource.RLIMIT_MSGQUEUE] = (0, 0)  # without an mqueue mount: creating one fails (EMFILE)
    for res, lim in limits.items():
        resource.setrlimit(res, lim)
    with open("/proc/self/oom_score_adj", "w") as f:  # the OOM killer's first choice, before any host process
        f.write("1000")
    uid = req["uid"]
    if cfg["privilege"] == "root":
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # after this no capability is left, so no hard limit can be raised
    else:  # already the caller's uid, with capabilities in the worker's user namespace: drop them all
        sos.drop_capabilities()
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid) or uid == 0:
        raise RuntimeError("could not drop privileges")
    if cfg["privilege"] == "root" and os.getgroups():
        raise RuntimeError("could not drop supplementary groups")
    sos.prctl(sos.PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries (su, sudo) cannot give root back
    sos.prctl(sos.PR_SET_DUMPABLE, 1)  # /proc/self stays ours (the uid change reset it to root)
    sos.prctl(sos.PR_SET_PDEATHSIG, signal.SIGKILL)
    if seccomp.supported():
        seccomp.install(deny_sockets=not iso["netns"] and cfg["network"] == "isolated")
        iso["seccomp"] = True
    else:
        iso["seccomp"] = False
        iso["notes"].append("seccomp filter unavailable on this architecture")


def interpreter(req: dict, cfg: dict, iso: dict) -> None:
    os.closerange(FD_KILL, 1 << 20)  # the kill pipe and the supervisor's cgroup fds
    _drop_privileges(req, cfg, iso)
    workdir = req["workdir"]
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir, PWD=workdir)
    if not os.access(os.path.dirname(os.__file__), os.R_OK | os.X_OK):
        iso["notes"].append(
            "the interpreter's files are not readable by the sandbox uid: only preloaded modules import"
        )
    tempfile.tempdir = None
    sys.argv = [""]
    sys.path.insert(0, workdir)  # like `python script.py`: modules the code writes are importable
    if "numpy.random" in sys.modules:  # preloaded in the zygote: every fork would share its RNG state
        sys.modules["numpy.random"].seed()
    sys.stdout.reconfigure(line_buffering=True)  # output before a hang still reaches the host
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    send({"ready": {**iso, "uid": os.getuid(), "gid": os.getgid()}})
    _serve(req, cfg, iso, main)


def _read_line(buf: bytearray) -> bytes:
    while b"\n" not in buf:
        chunk = os.read(FD_REQ, 1 << 16)
        if not chunk:
            return b""
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line


def _serve(req: dict, cfg: dict, iso: dict, main: types.ModuleType) -> None:
    me, buf, cell = os.getpid(), bytearray(), 0
    # kill(-1) then reaches only this sandbox (a dedicated uid, or a pid namespace of its own).
    may_kill_all = iso["pidns"] or (cfg["privilege"] == "root" and os.getuid() != 0)
    while True:
        line = _read_line(buf)
        if not line:
            os._exit(0)
        msg = json.loads(line)
        cell += 1
        if req["session"]:
            used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            resource.setrlimit(resource.RLIMIT_CPU, (min(int(used) + cfg["cpu_s"], hard), hard))
        _set_stdin(msg.get("stdin", ""))
        name = f"<cell-{cell}>" if req["session"] else "<code>"
        # As a process reports it: sys.exit(-1) is 255, sys.exit(256) is 0, sys.exit(True) is 1.
        code = int(_run_cell(msg["code"], main.__dict__, name, cfg["echo_last_expr"])) & 0xFF
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        if os.getpid() != me:  # a child the code forked fell through to here: it is not the cell
            os._exit(code)
        if msg.get("last"):
            send({"done": code})
            os._exit(code)
        if may_kill_all:  # session mode: a cell's background processes do not outlive the cell
            # (Not reaped here: the code may still wait() on its own children, e.g. Popen.poll.)
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
                _wait_until_gone(me)
        send({"done": code})


def _wait_until_gone(me: int, limit_s: float = 2.0) -> None:
    """kill() only queues SIGKILL: wait until no other process of our uid is still running (zombies are
    dead), so the next cell starts with its processes, memory and RLIMIT_NPROC budget back."""
    uid, end = os.getuid(), time.monotonic() + limit_s
    while time.monotonic() < end:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                owner = os.stat(f"/proc/{pid}").st_uid
            except (OSError, IndexError):
                continue
            if owner == uid and state not in (b"Z", b"X"):
                break  # still exiting
        else:
            return
        time.sleep(0.001)


def _set_stdin(data: str) -> None:
    if data:  # a memfd: no file name, and no dependence on a cwd the code may have changed
        fd = os.memfd_create("stdin")
        os.write(fd, data.encode())
        os.lseek(fd, 0, os.SEEK_SET)
        os.dup2(fd, 0)
        os.close(fd)
    else:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - a fresh reader, no stale buffer


def _run_cell(src: str, ns: dict, filename: str, echo: bool) -> int:
    """exec `src` like a script (or a notebook cell: `echo` prints the last expression's repr)."""
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # source in tracebacks
    try:
        tree = ast.parse(src, filename)
    except Exception as exc:  # noqa: BLE001 - SyntaxError, or null bytes / nesting too deep to parse
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        return 1
    last = None
    if echo and tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    try:
        exec(compile(tree, filename, "exec", dont_inherit=True), ns)
        if last is not None:
            value = eval(compile(last, filename, "eval", dont_inherit=True), ns)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - the model's exception is the tool's output
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop this frame
        traceback.print_exception(type(exc), exc, tb)
        return 1
