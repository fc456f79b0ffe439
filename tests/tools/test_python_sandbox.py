"""The Python sandbox against adversarial code: every case is contained, gives a clear result, and leaves
the machine as it was. Runs as root (as CI does); each test needs well under a second except the ones
that wait for a timeout on purpose.

Fixtures: `sandbox` is the pooled, all-namespaces configuration rollouts use. `bare` has no idle workers
(so after a call no process of its uid range may exist) and runs twice: "full" (every namespace the
kernel allows) and "fallback" (none: what holds in a container that forbids unshare()).
"""

from __future__ import annotations

import ast
import asyncio
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rolerl.tools import PythonSandbox, SandboxConfig, Tool, ToolResult
from tests.tools.helpers import make_sandbox

if os.geteuid() != 0:  # the sandbox drops root to a dedicated uid and refuses to start without root
    pytest.skip("the Python sandbox needs root (CI runs as root)", allow_module_level=True)

BUDGET = SandboxConfig().max_output_bytes  # make_sandbox keeps the default output budget


@pytest.fixture(scope="module")
def sandbox() -> Iterator[PythonSandbox]:
    sb = make_sandbox("full", 61000, pool_size=2)
    yield sb
    sb.close()


@pytest.fixture(scope="module", params=["full", "fallback"])
def bare(request: pytest.FixtureRequest) -> Iterator[PythonSandbox]:
    sb = make_sandbox(request.param, {"full": 62000, "fallback": 62100}[request.param], pool_size=0)
    yield sb
    sb.close()


def leftovers(sb: PythonSandbox) -> list[str]:
    """Host processes (in any pid namespace) whose real uid is in this sandbox's uid range."""
    lo, hi = sb.config.uid_base, sb.config.uid_base + sb.config.uid_count
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if lo <= int(fields["Uid"].split()[0]) < hi:
            found.append(f"{pid} {fields['Name'].strip()} {fields['State'].strip()}")
    return found


def full(sb: PythonSandbox) -> bool:
    return bool(sb.config.namespaces)


# --- normal code ----------------------------------------------------------------------------------------
def test_stdout_of_normal_code(sandbox: PythonSandbox) -> None:
    r = sandbox.run("import math\nfor i in range(3):\n    print(i, math.factorial(i + 3))")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.truncated) == (
        "0 6\n1 24\n2 120\n",
        "",
        0,
        False,
        False,
    )
    assert r.ok and 0 < r.wall_s < 1.0


def test_exception_returns_traceback(sandbox: PythonSandbox) -> None:
    r = sandbox.run("def f(x):\n    return 1 / x\n\nprint('before')\nf(0)")
    assert r.stdout == "before\n" and r.exit_code == 1
    # The model sees its own frames with source lines, and none of the sandbox's.
    assert r.stderr.startswith("Traceback (most recent call last):\n")
    assert 'File "<code>", line 5, in <module>' in r.stderr and "return 1 / x" in r.stderr
    assert r.stderr.endswith("ZeroDivisionError: division by zero\n") and "_sandbox_worker" not in r.stderr


def test_syntax_error_and_exit_codes(sandbox: PythonSandbox) -> None:
    r = sandbox.run("print(")
    assert r.exit_code == 1 and "SyntaxError" in r.stderr and "Traceback" not in r.stderr
    assert sandbox.run("import sys; sys.exit(3)").exit_code == 3
    assert sandbox.run("import os; os._exit(4)").exit_code == 4
    assert sandbox.run("import os; os.kill(os.getpid(), 9)").exit_code == -9


def test_stdin_and_input(sandbox: PythonSandbox) -> None:
    assert sandbox.run("print(input() * 2)", stdin="ab\n").stdout == "abab\n"
    r = sandbox.run("input()")  # no stdin: EOF at once rather than a hang until the timeout
    assert "EOFError" in r.stderr and not r.timed_out


def test_tool_protocol_and_text() -> None:
    assert isinstance(PythonSandbox(), Tool)
    r = ToolResult(stdout="a", stderr="b\n", exit_code=-9, timed_out=True, truncated=True, wall_s=2.0)
    assert r.text() == "a\nb\n[output truncated]\n[timed out after 2.0 s]\n" and not r.ok
    assert ToolResult(exit_code=-24).text() == "[killed by SIGXCPU]\n"


def test_knobs_echo_hidden_paths_preload(tmp_path: Path) -> None:
    hidden = Path("/var/tmp") / f"rolerl-hidden-{uuid.uuid4().hex}"
    hidden.mkdir(mode=0o755)
    (hidden / "secret.txt").write_text("x")
    hidden.chmod(0o755)
    try:
        with make_sandbox(
            "full", 62600, pool_size=0, echo_last_expr=True, hidden_paths=(str(hidden),), preload=("numpy",)
        ) as sb:
            assert sb.run("x = 6\nx * 7").stdout == "42\n"  # a notebook-style trailing expression
            assert sb.run(f"import os\nos.listdir({str(hidden)!r})").stdout == "[]\n"
            # Preloaded in the zygote, yet each call draws its own random numbers.
            draws = {sb.run("import numpy\nfloat(numpy.random.rand())").stdout for _ in range(3)}
            assert len(draws) == 3, draws
    finally:
        (hidden / "secret.txt").unlink()
        hidden.rmdir()


def test_a_pooled_worker_that_died_while_idle_is_replaced(sandbox: PythonSandbox) -> None:
    sandbox.run("pass")
    time.sleep(0.3)  # let the pool refill
    idle = leftovers(sandbox)
    assert idle
    for line in idle:  # kill the idle interpreters from outside (an OOM kill, say)
        os.kill(int(line.split()[0]), 9)
    time.sleep(0.1)
    assert sandbox.run("print('fine')").stdout == "fine\n"


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="SandboxConfig.namespaces"):
        SandboxConfig(namespaces=("net", "user"))
    with pytest.raises(ValueError, match="SandboxConfig.timeout_s"):
        SandboxConfig(timeout_s=0)


# --- privileges and limits -------------------------------------------------------------------------------
def test_runs_unprivileged(sandbox: PythonSandbox) -> None:
    """The gate for the kill(-1) test: not root, not the host's uid, no groups, no way back to root."""
    r = sandbox.run(
        "import os\nprint((os.getresuid(), os.getresgid(), os.getgroups()))\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('NoNewPrivs', 'Seccomp:', 'CapEff'))])"
    )
    ids, status = r.stdout.splitlines()
    resuid, resgid, groups = ast.literal_eval(ids)
    assert 0 not in resuid + resgid and os.getuid() not in resuid and groups == []
    assert len(set(resuid)) == 1 and sandbox.config.uid_base <= resuid[0] < sandbox.config.uid_base + 50
    # No capabilities, no_new_privs set, a seccomp filter installed.
    assert ast.literal_eval(status) == ["0000000000000000", "1", "2"]


def test_cannot_raise_own_rlimits(sandbox: PythonSandbox) -> None:
    r = sandbox.run(
        "import os, resource\n"
        "for name in ['RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE', 'RLIMIT_NPROC']:\n"
        "    res = getattr(resource, name)\n"
        "    soft, hard = resource.getrlimit(res)\n"
        "    try:\n"
        "        resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
        "        print(name, 'RAISED')\n"
        "    except (ValueError, OSError):\n"
        "        print(name, 'refused', hard, resource.getrlimit(res)[1])\n"
        "for attempt in (lambda: os.setuid(0), lambda: os.setresuid(0, 0, 0)):\n"
        "    try:\n"
        "        attempt(); print('ROOT')\n"
        "    except PermissionError:\n"
        "        print('setuid refused')"
    )
    mb = 1 << 20
    cfg = sandbox.config
    expected = {
        "RLIMIT_CPU": cfg.cpu_s + 1,
        "RLIMIT_AS": cfg.memory_mb * mb,
        "RLIMIT_FSIZE": cfg.file_size_mb * mb,
        "RLIMIT_NOFILE": cfg.open_files,
        "RLIMIT_NPROC": cfg.processes,
    }
    lines = r.stdout.splitlines()
    assert lines[:5] == [f"{k} refused {v} {v}" for k, v in expected.items()]
    assert lines[5:] == ["setuid refused", "setuid refused"]


def test_infinite_loop_times_out(sandbox: PythonSandbox) -> None:
    t0 = time.monotonic()
    r = sandbox.run("print('spinning', flush=True)\nwhile True:\n    pass", timeout_s=1.0)
    assert r.timed_out and r.exit_code == -9 and r.stdout == "spinning\n"
    assert 1.0 <= r.wall_s < 2.0 and time.monotonic() - t0 < 2.5  # within a second, teardown included


def test_timeout_accurate_within_a_second(sandbox: PythonSandbox) -> None:
    r = sandbox.run("import time\ntime.sleep(0.6)\nprint('done')", timeout_s=1.5)
    assert r.stdout == "done\n" and not r.timed_out and 0.6 <= r.wall_s < 1.0
    t0 = time.monotonic()
    r = sandbox.run("import time\ntime.sleep(30)", timeout_s=1.5)
    assert r.timed_out and 1.5 <= r.wall_s < 2.5 and time.monotonic() - t0 < 3.0


def test_memory_bomb(sandbox: PythonSandbox) -> None:
    r = sandbox.run("hog = []\nwhile True:\n    hog.append(bytearray(1 << 24))")
    assert r.exit_code == 1 and r.stderr.rstrip().endswith("MemoryError") and not r.timed_out


@pytest.mark.parametrize("mode", ["full", "fallback"])
def test_memory_bomb_across_processes(mode: str) -> None:
    # 6 children x 200 MB stays under each one's RLIMIT_AS; only the tree's memory cgroup stops them.
    with make_sandbox(mode, 62400, pool_size=0, tree_memory_mb=400) as sb:
        if not sb.isolation.memory_cgroup:
            pytest.skip(f"no memory cgroup here: {sb.isolation.notes}")
        r = sb.run(
            "import os, time\npids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
            "        hog = b'x' * (200 << 20)\n        time.sleep(1)\n        os._exit(0)\n    pids.append(pid)\n"
            "print(sorted(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids))"
        )
        statuses = ast.literal_eval(r.stdout)
        assert statuses.count(-9) >= 4 and set(statuses) <= {0, -9}, r  # the cgroup's OOM killer at work
        assert leftovers(sb) == []


def test_fork_bomb(bare: PythonSandbox) -> None:
    # Every child forks again and ignores failures: without RLIMIT_NPROC (root ignores it) this would
    # fill the process table. Contained by the limit, stopped by the timeout, all reaped afterwards.
    r = bare.run(
        "import os\nprint('bomb', flush=True)\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        timeout_s=1.0,
    )
    assert r.timed_out and r.stdout.startswith("bomb\n")
    assert leftovers(bare) == []


def test_nproc_caps_the_process_count(bare: PythonSandbox) -> None:
    r = bare.run(
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)"
    )
    n, errno = map(int, r.stdout.split())
    assert n == bare.config.processes - 1 and errno == 11  # EAGAIN: the cap, counting the interpreter
    assert leftovers(bare) == []


# --- the process tree ----------------------------------------------------------------------------------
def test_setsid_daemon_does_not_outlive_the_call(bare: PythonSandbox) -> None:
    r = bare.run(
        "import os, signal, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):\n"
        "            signal.signal(s, signal.SIG_IGN)\n"
        "        os.write(w, b'daemon %d' % os.getpid())\n"
        "        for fd in (0, 1, 2, 3, 4):\n"
        "            os.close(fd)\n"
        "        time.sleep(300)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print(os.read(r, 100).decode())"
    )
    assert r.stdout.startswith("daemon ") and r.exit_code == 0
    assert leftovers(bare) == []


def test_background_processes_are_killed(bare: PythonSandbox) -> None:
    r = bare.run(
        "import subprocess, threading, time\n"
        "procs = [subprocess.Popen(['sleep', '300']), subprocess.Popen(['sleep', '300'], start_new_session=True)]\n"
        "threading.Thread(target=time.sleep, args=(300,), daemon=False).start()\n"
        "print('left', len(procs))"
    )
    assert r.stdout == "left 2\n" and not r.timed_out
    assert leftovers(bare) == []


def test_killing_its_parent(sandbox: PythonSandbox) -> None:
    zygote = sandbox._zygote.proc.pid  # type: ignore[union-attr]
    r = sandbox.run(
        "import os, signal\n"
        f"for pid in (os.getppid(), 1, {os.getpid()}, {zygote}):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        print(pid, 'KILLED')\n"
        "    except (PermissionError, ProcessLookupError) as e:\n"
        "        print(type(e).__name__)"
    )
    assert "KILLED" not in r.stdout and len(r.stdout.splitlines()) == 4, r
    assert sandbox._zygote.alive() and sandbox.run("print('still here')").stdout == "still here\n"  # type: ignore[union-attr]


def test_ctypes_kill_minus_one(bare: PythonSandbox) -> None:
    who = bare.run("import os; print(*os.getresuid(), *os.getresgid())").stdout.split()
    if len(who) != 6 or "0" in who:  # never let a broken sandbox call kill(-1, 9) as root
        pytest.skip("the sandbox does not run unprivileged: see test_runs_unprivileged")
    canary = subprocess.Popen(["sleep", "60"])  # a root process of the host
    try:
        with bare.session() as neighbour:  # another sandbox worker, alive during the kill
            neighbour.run("x = 7")
            r = bare.run(
                "import ctypes, os\n"
                "assert 0 not in os.getresuid() + os.getresgid()  # belt and braces, see the skip above\n"
                "libc = ctypes.CDLL(None, use_errno=True)\n"
                "print('kill', libc.kill(-1, 9), ctypes.get_errno())"
            )
            # kill(-1) spares the caller. In its pid namespace nobody else is there (ESRCH); without one it
            # "succeeds" (the host's processes count, EPERM) and kills only processes of its own uid.
            assert r.stdout == ("kill -1 3\n" if full(bare) else "kill 0 0\n") and r.exit_code == 0
            assert canary.poll() is None
            assert neighbour.run("print(x)").stdout == "7\n"
    finally:
        canary.kill()
        canary.wait()


# --- filesystem ------------------------------------------------------------------------------------------
def test_write_outside_with_absolute_paths(bare: PythonSandbox, tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    targets = [
        f"/tmp/rolerl-escape-{uuid.uuid4().hex}",
        f"/dev/shm/rolerl-escape-{uuid.uuid4().hex}",
        str(tmp_path / "escape"),
        "/etc/rolerl-escape",
    ]
    r = bare.run(
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote')\n"
        "    except OSError as e:\n"
        "        print(e.errno)"
    )
    codes = r.stdout.split()
    if full(bare):  # the whole tree is read-only: EROFS, or EACCES where a parent is not searchable
        assert codes[:2] == ["30", "30"] and set(codes[2:]) <= {"13", "30"}
    else:  # only permissions: world-writable dirs accept the file, the teardown sweeps it away
        assert codes == ["wrote", "wrote", "13", "13"]
    assert not any(os.path.exists(t) for t in targets)


def test_write_outside_with_dotdot(bare: PythonSandbox) -> None:
    name = f"rolerl-dotdot-{uuid.uuid4().hex}"
    r = bare.run(
        "import os\nprint(os.getcwd())\n"
        f"for path in ('../{name}', '../../{name}', '../' * 30 + 'tmp/{name}-2'):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote')\n"
        "    except OSError as e:\n"
        "        print(e.errno)"
    )
    cwd, *codes = r.stdout.split()
    workdir = Path(cwd)
    # Read-only tree: EROFS. Fallback: the sandboxes' parent dir is root's (EACCES), but two levels up is
    # the world-writable /tmp: the write succeeds there and the teardown sweeps it away.
    assert codes == (["30", "30", "30"] if full(bare) else ["13", "wrote", "wrote"])
    for p in (workdir.parent / name, workdir.parent.parent / name, Path(f"/tmp/{name}-2")):
        assert not p.exists()
    assert not workdir.exists()  # and its own directory is gone


def test_cleanup_does_not_follow_planted_symlinks(bare: PythonSandbox, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "keep.txt").write_text("precious")
    (victim / "sub" / "keep2.txt").write_text("precious")
    r = bare.run(
        "import os\n"
        f"os.symlink({str(victim)!r}, 'link')\n"
        "os.makedirs('a/b')\n"
        f"os.symlink({str(victim / 'keep.txt')!r}, 'a/b/file_link')\n"
        f"os.symlink({str(victim / 'sub')!r}, 'a/sub_link')\n"
        "os.symlink('/', 'root_link')\n"
        "print(sorted(os.listdir('.')), os.getcwd())"
    )
    assert r.stdout.startswith("['a', 'link', 'root_link']")
    assert (victim / "keep.txt").read_text() == "precious" and (victim / "sub" / "keep2.txt").exists()
    assert not Path(r.stdout.split()[-1]).exists()


# --- secrets and network -----------------------------------------------------------------------------
def test_parent_environment_is_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("ROLERL_TEST_SECRET", secret)  # in the host's env before the sandbox starts
    for mode, base in (("full", 62200), ("fallback", 62300)):
        with make_sandbox(mode, base, pool_size=0) as sb:
            r = sb.run(
                "import glob, os\n"
                "print(sorted(os.environ))\n"
                "hits = []\n"
                f"for path in ['/proc/%d/environ' % os.getppid(), '/proc/{os.getpid()}/environ', '/proc/1/environ']"
                " + glob.glob('/proc/*/environ'):\n"
                "    try:\n"
                "        hits += [path] if b'ROLERL_TEST_SECRET' in open(path, 'rb').read() else []\n"
                "    except OSError:\n"
                "        pass\n"
                "print(hits)"
            )
            env_keys, hits = r.stdout.splitlines()
            assert secret not in r.stdout and hits == "[]", (mode, r)
            assert set(ast.literal_eval(env_keys)) <= {
                "PATH",
                "LANG",
                "LC_ALL",
                "OMP_NUM_THREADS",
                "OPENBLAS_NUM_THREADS",
                "MKL_NUM_THREADS",
                "HOME",
                "TMPDIR",
                "PWD",
            }


@pytest.fixture
def tcp_server() -> Iterator[tuple[int, list[str]]]:
    srv = socket.create_server(("0.0.0.0", 0))
    srv.settimeout(0.2)
    accepted: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = srv.accept()
            except TimeoutError:
                continue
            accepted.append(addr[0])
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    thread.join()
    srv.close()


def test_no_tcp_to_a_local_server(bare: PythonSandbox, tcp_server: tuple[int, list[str]]) -> None:
    port, accepted = tcp_server
    assert socket.create_connection(("127.0.0.1", port), timeout=1).close() is None  # it does listen
    try:
        host_ips = sorted({"127.0.0.1", socket.gethostbyname(socket.gethostname())})
    except OSError:
        host_ips = ["127.0.0.1"]
    r = bare.run(
        "import socket\n"
        f"for ip in {host_ips!r}:\n"
        "    try:\n"
        "        s = socket.socket()\n"
        "        s.settimeout(2)\n"
        f"        s.connect((ip, {port}))\n"
        "        print('CONNECTED')\n"
        "    except OSError as e:\n"
        "        print(e.errno)"
    )
    # netns: no interface is up (ENETUNREACH); fallback: socket() itself is refused (EACCES)
    assert r.stdout.split() == (["101"] if full(bare) else ["13"]) * len(host_ips), r
    time.sleep(0.3)
    assert accepted == ["127.0.0.1"]  # only our own probe


def test_no_new_user_namespace(sandbox: PythonSandbox) -> None:
    # A user namespace would hand the code CAP_SYS_ADMIN over new mounts (tmpfs outside every limit).
    r = sandbox.run(
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.unshare(0x10000000), ctypes.get_errno())"
    )
    assert r.stdout == "-1 1\n"


# --- output ---------------------------------------------------------------------------------------------
def test_100mb_of_output_is_truncated(sandbox: PythonSandbox) -> None:
    r = sandbox.run(
        "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\nprint('end')"
    )
    assert r.truncated and r.stdout == "x" * BUDGET and r.exit_code == 0 and not r.timed_out
    assert r.wall_s < 4.0


def test_survives_its_zygote_dying() -> None:
    with make_sandbox("full", 62500, pool_size=0) as sb:
        sb._zygote.proc.kill()  # type: ignore[union-attr]
        sb._zygote.proc.wait()  # type: ignore[union-attr]
        assert sb.run("print('again')").stdout == "again\n"


# --- concurrency and sessions ----------------------------------------------------------------------------
def test_concurrent_calls_from_threads(sandbox: PythonSandbox) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda i: sandbox.run(f"import time; time.sleep(0.05); print({i} ** 2)"), range(24))
        )
    assert [r.stdout for r in results] == [f"{i**2}\n" for i in range(24)]


def test_async_calls(sandbox: PythonSandbox) -> None:
    async def main() -> list[ToolResult]:
        return await asyncio.gather(*(sandbox.arun(f"print({i})") for i in range(6)))

    assert [r.stdout for r in asyncio.run(main())] == [f"{i}\n" for i in range(6)]


def test_session_keeps_state_and_recovers(sandbox: PythonSandbox) -> None:
    with sandbox.session() as s:
        assert s.run("x = 41\nimport os\nopen('notes.txt', 'w').write('hi')").ok
        r = s.run("def f():\n    return x + 1\nprint(f(), open('notes.txt').read())")
        assert r.stdout == "42 hi\n"
        assert "<cell-3>" in s.run("f(); 1 / 0").stderr
        assert s.run("import time\ntime.sleep(10)", timeout_s=0.5).timed_out
        r = s.run("print('x' in globals())")
        assert r.stdout == "False\n" and "state was lost" in r.stderr


def test_session_kills_background_processes_between_calls(bare: PythonSandbox) -> None:
    with bare.session() as s:
        assert s.run("import subprocess\np = subprocess.Popen(['sleep', '300'], start_new_session=True)").ok
        running = [p for p in leftovers(bare) if "zombie" not in p]
        assert len(running) == 1  # the session's interpreter only; `sleep` is a zombie it may still wait on
        assert s.run("print(p.poll())").stdout == "-9\n"
    assert leftovers(bare) == []
