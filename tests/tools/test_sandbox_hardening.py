"""The sandbox against code that attacks its own plumbing (issue 11 §2-4) and its start-up checks (issue 12
item 2): floods and forged lines on the control fd, a session cell that stalls the request loop, IPC
objects and abstract unix sockets, and construction without root. Each test takes at most a few seconds.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rolerl.tools import PythonSandbox, SandboxConfig, SandboxError, ToolResult, build_tools
from rolerl.tools._sandbox_os import FD_CTL, FD_REQ
from tests.tools.helpers import make_sandbox

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the root sandbox needs root (CI runs as root)")
REPO = Path(__file__).resolve().parents[2]
GRACE_S = 1.5  # killing the tree and reaping it, on a loaded 2-core machine


@pytest.fixture(scope="module")
def pooled() -> Iterator[PythonSandbox]:
    if not ROOT:
        pytest.skip("needs root")
    with make_sandbox("full", 62700, pool_size=2) as sb:
        yield sb


@pytest.fixture(scope="module", params=["full", "fallback"])
def bare(request: pytest.FixtureRequest) -> Iterator[PythonSandbox]:
    if not ROOT:
        pytest.skip("needs root")
    with make_sandbox(request.param, {"full": 62800, "fallback": 62900}[request.param], pool_size=0) as sb:
        yield sb


# --- §2: the control channel -------------------------------------------------------------------------
FLOODS = {
    "until_deadline": "import os, time\nend = time.monotonic() + 4\nwhile time.monotonic() < end:\n"
    f"    os.write({FD_CTL}, b'x' * 65536)\nprint('finished')",
    "endless": f"import os\nwhile True:\n    os.write({FD_CTL}, b'x' * 65536)",
    "newlines": f"import os\nwhile True:\n    os.write({FD_CTL}, b'\\n' * 65536)",
}


@needs_root
@pytest.mark.parametrize("flood", FLOODS)
def test_control_flood_returns_in_time_without_burning_the_host(bare: PythonSandbox, flood: str) -> None:
    cpu0, t0 = time.process_time(), time.monotonic()
    r = bare.run(FLOODS[flood], timeout_s=1.0)
    elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert elapsed < 1.0 + GRACE_S, (elapsed, r)  # before the fix: 4 s, or never for an endless loop
    assert (r.timed_out or "control channel" in r.stderr) and not r.ok and "finished" not in r.stdout, r
    assert cpu < 0.5, cpu  # the host read 64 KiB chunks as fast as the code wrote them


FORGED = {
    "deep_nesting": b'{"done": ' + b"[" * 3000 + b"]" * 3000 + b"}\n",
    "huge_int_digits": b'{"done": 1' + b"0" * 5000 + b"}\n",
    "huge_int_value": b'{"done": 1' + b"0" * 4000 + b"}\n",
    "infinity": b'{"done": 1e999}\n',
    "nan": b'{"exit": NaN}\n',
    "str_code": b'{"done": "0"}\n',
    "float_code": b'{"done": 1.5}\n',
    "bool_code": b'{"done": true}\n',
    "list_exit": b'{"exit": [1]}\n',
    "list": b'["done", 0]\n',
    "string": b'"done"\n',
    "two_keys": b'{"done": 0, "exit": 1}\n',
    "ready_mid_call": b'{"ready": {}}\n',
    "not_json": b"hello\n",
    "not_utf8": b"\xff\xfe\n",
    "empty_line": b"\n",
    "enormous_line": b"[" * 200_000,
}


@needs_root
@pytest.mark.parametrize("line", FORGED)
def test_forged_control_line_gives_a_tool_error(pooled: PythonSandbox, line: str) -> None:
    code = f"import os, time\nos.write({FD_CTL}, {FORGED[line]!r})\ntime.sleep(0.2)\nprint('after')"
    r = pooled.run(code, timeout_s=3.0)  # before the fix: ValueError, RecursionError, ... or ignored
    assert isinstance(r, ToolResult) and "control channel" in r.stderr and r.exit_code == -9, r
    assert not r.timed_out and r.wall_s < 1.0


# --- §3: host writes never block ---------------------------------------------------------------------
@needs_root
def test_session_cell_cannot_stall_the_next_request(pooled: PythonSandbox) -> None:
    stall = (
        "import fcntl, os, time\n"
        f"fcntl.fcntl({FD_REQ}, 1031, 4096)  # F_SETPIPE_SZ: one page\n"
        "_read = os.read\n"
        "os.read = lambda fd, n: (time.sleep(2), _read(fd, 1))[1]  # the loop now reads a byte per 2 s"
    )
    with pooled.session() as s:
        assert s.run(stall).ok
        t0 = time.monotonic()
        r = s.run("x = 1\n" + "#" * 100_000, timeout_s=1.0)  # a request 25 pages long
        assert time.monotonic() - t0 < 1.0 + GRACE_S and r.timed_out, r  # before: blocked in os.write
        r = s.run("print('fresh')")
        assert r.stdout == "fresh\n" and "state was lost" in r.stderr


# --- §4: IPC objects and abstract unix sockets ---------------------------------------------------------
_LIBC = (
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "if not hasattr(libc, 'mq_open'):\n    libc = ctypes.CDLL('librt.so.1', use_errno=True)\n"
    "def err(ret):\n    return 'ok' if ret >= 0 else ctypes.get_errno()\n"
)


@needs_root
@pytest.mark.parametrize("mode", ["full", "fallback"])
def test_ipc_objects_do_not_outlive_the_worker(mode: str) -> None:
    key, name = 0x52000000 + (uuid.uuid4().int & 0xFFFFFF), f"/rolerl-test-{uuid.uuid4().hex[:12]}"
    create = (
        _LIBC + f"print(err(libc.shmget({key}, 32 << 20, 0o1666)), err(libc.msgget({key + 1}, 0o1666)),"
        f" err(libc.mq_open({name.encode()!r}, os.O_CREAT | os.O_RDWR, 0o666, None)))"
    )
    look = (
        _LIBC + f"print(err(libc.shmget({key}, 0, 0)), err(libc.msgget({key + 1}, 0)),"
        f" err(libc.mq_open({name.encode()!r}, os.O_RDONLY)))"
    )
    with make_sandbox(mode, 63000 if mode == "full" else 63100, pool_size=1) as sb:
        with sb.session() as s:
            made = s.run(create).stdout.split()
            # Fallback: no IPC namespace, so POSIX queues are refused (RLIMIT_MSGQUEUE 0: EMFILE).
            assert made == (["ok", "ok", "ok"] if mode == "full" else ["ok", "ok", "24"]), made
            assert s.run(look).stdout.split()[:2] == ["ok", "ok"]  # a session keeps them
        assert sb.run(look).stdout.split() == ["2", "2", "2"]  # ENOENT for the next call
        if mode == "fallback":
            assert "IPC namespace" in " ".join(sb.isolation.notes)
    assert not _host_has_sysv_key(key) and not _host_has_sysv_key(key + 1)  # and after close()
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "mq_open"):
        assert libc.mq_open(name.encode(), os.O_RDONLY) == -1 and ctypes.get_errno() == 2


def _host_has_sysv_key(key: int) -> bool:
    for kind in ("shm", "msg"):
        with open(f"/proc/sysvipc/{kind}") as f:
            if any(line.split()[0] == str(key) for line in list(f)[1:]):
                return True
    return False


@needs_root
def test_abstract_unix_socket_on_the_host_is_unreachable(bare: PythonSandbox) -> None:
    tag = uuid.uuid4().hex
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as dgram,
    ):
        srv.bind(f"\0rolerl-test-{tag}")
        srv.listen()
        dgram.bind(f"\0rolerl-test-{tag}-d")
        r = bare.run(
            "import socket\nout = []\n"
            "try:\n    s = socket.socket(socket.AF_UNIX)\n    s.settimeout(2)\n"
            f"    s.connect('\\0rolerl-test-{tag}')\n    out.append('CONNECTED')\n"
            "except OSError as e:\n    out.append(e.errno)\n"
            "try:\n    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            f"    a.sendto(b'hi', '\\0rolerl-test-{tag}-d')\n    out.append('SENT')\n"
            "except OSError as e:\n    out.append(e.errno)\n"
            "a, b = socket.socketpair()\na.send(b'ok')\nout.append(b.recv(2).decode())\nprint(out)"
        )
        # Own network namespace: the names do not exist there (ECONNREFUSED). Fallback: socket() and
        # datagram socketpair() are refused (EACCES); connected stream pairs (asyncio's) still work.
        expected = [111, 111, "ok"] if bare.isolation.network_namespace else [13, 13, "ok"]
        assert ast.literal_eval(r.stdout) == expected, r
        srv.setblocking(False)
        dgram.setblocking(False)
        with pytest.raises(BlockingIOError):
            srv.accept()
        with pytest.raises(BlockingIOError):
            dgram.recv(10)


# --- issue 12 item 2: construction checks, the unprivileged mode, the registry ------------------------
def test_non_root_construction_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("ROLERL_SANDBOX_PRIVILEGE", raising=False)
    for build in (PythonSandbox, lambda: build_tools(["python"])):
        with pytest.raises(SandboxError, match=r"needs root .*privilege='unprivileged'"):
            build()


def test_mode_choices_are_checked() -> None:
    if ROOT:
        with pytest.raises(SandboxError, match="which is root here"):
            PythonSandbox(SandboxConfig(privilege="unprivileged"))
    with pytest.raises(ValueError, match=r"SandboxConfig.namespaces must include \['ipc', 'mount', 'pid'\]"):
        SandboxConfig(privilege="unprivileged", namespaces=("net",))
    with pytest.raises(ValueError, match="SandboxConfig.privilege"):
        SandboxConfig(privilege="user")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown tool\(s\) \['shell'\]"):
        build_tools(["shell"])
    with pytest.raises(ValueError, match="not built"):
        build_tools([], python={"timeout_s": 1})
    assert build_tools([]) == {}


_UNPRIVILEGED_SCRIPT = """
import json, sys, warnings
sys.path.insert(0, {repo!r})
from dataclasses import asdict
from rolerl.tools import PythonSandbox, SandboxConfig, SandboxError
out = {{}}
try:
    PythonSandbox()
except SandboxError as e:
    out["root_mode"] = str(e)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sb = PythonSandbox(SandboxConfig(privilege="unprivileged", pool_size=0, timeout_s=5))
    out["isolation"] = asdict(sb.isolation)
out["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
out["run"] = sb.run({code!r}).stdout
out["timed_out"] = sb.run("while True: pass", timeout_s=0.5).timed_out
sb.close()
print(json.dumps(out))
"""
_PROBE = (
    "import os, socket\nprint(os.getresuid(), os.getpid())\n"
    "print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('NoNewPrivs', 'Seccomp:', 'CapEff'))])\n"
    "for act in (lambda: open('/tmp/rolerl-x', 'w'), lambda: socket.create_connection(('10.0.0.1', 80), 1)):\n"
    "    try:\n        act()\n    except OSError as e:\n        print(e.errno)"
)


@needs_root
def test_unprivileged_mode_for_real() -> None:
    """As uid 65534 (nobody): root mode refuses with the named error, the unprivileged mode runs code in its
    namespaces and says what holds. The venv's python lives under /root (mode 0700), so this uses the
    system interpreter, which can import rolerl.tools (standard library only)."""
    python = shutil.which("python3", path="/usr/bin:/bin") or ""
    who = {"user": 65534, "group": 65534, "extra_groups": [], "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}}
    check = f"import sys; sys.path.insert(0, {str(REPO)!r}); import rolerl.tools"
    if not python or subprocess.run([python, "-I", "-c", check], capture_output=True, **who).returncode:
        pytest.skip(f"no system python >= 3.10 that uid 65534 can run with {REPO} importable")
    script = _UNPRIVILEGED_SCRIPT.format(repo=str(REPO), code=_PROBE)
    proc = subprocess.run([python, "-I", "-c", script], capture_output=True, text=True, timeout=60, **who)
    if "cannot start here" in proc.stderr:
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {proc.stderr.splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert "needs root (this process runs as uid 65534)" in out["root_mode"]
    iso = out["isolation"]
    assert (iso["privilege"], iso["uid"], iso["user_namespace"], iso["seccomp"]) == (
        "unprivileged",
        65534,
        True,
        True,
    )
    assert (
        iso["mount_namespace"] and iso["pid_namespace"] and iso["ipc_namespace"] and iso["network_namespace"]
    )
    assert len(out["warnings"]) == 1 and "unprivileged mode" in out["warnings"][0]
    ids, status, *errnos = out["run"].splitlines()
    assert ids == "(65534, 65534, 65534) 2"  # the caller's uid; pid 2 of its own pid namespace
    assert ast.literal_eval(status) == ["0000000000000000", "1", "2"]  # no capabilities left
    assert errnos == ["30", "101"]  # read-only filesystem; no network
    assert out["timed_out"] is True
