"""Host side of the sandbox: uid leases, the zygote, and one worker's pipes (send code, collect output).

`python_sandbox.py` composes these into the public `PythonSandbox`; the processes they talk to live in
`_sandbox_worker.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import selectors
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rolerl.tools.base import ToolResult

WORKER_SCRIPT = Path(__file__).with_name("_sandbox_worker.py")


class SandboxError(RuntimeError):
    """The sandbox could not be set up (not the model's code failing: that is a ToolResult)."""


class UidLeases:
    """Dedicated uids, leased with flock() on a lock file each, so that sandboxes in other processes on
    this machine (other trainer ranks, other test runs) never get the same uid while it is in use. A lock
    dies with its process, so a crashed host frees its uids. Uids that name a real account are skipped."""

    def __init__(self, base: int, count: int, lock_dir: Path) -> None:
        self.base, self.count, self.lock_dir = base, count, lock_dir
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(lock_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
            raise SandboxError(f"{lock_dir} must be a directory owned by root with mode 0700")

    def acquire(self) -> int:
        with self._lock:
            for uid in range(self.base, self.base + self.count):
                if uid in self._held or _is_account(uid):
                    continue
                fd = os.open(self.lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held[uid] = fd
                return uid
        raise SandboxError(f"all {self.count} sandbox uids from {self.base} are in use")

    def release(self, uid: int) -> None:
        with self._lock:
            fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)


def _is_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


class Zygote:
    """A root Python process, started clean (scrubbed env, fresh interpreter), that forks one worker per
    request. Forking it costs ~1 ms where starting an interpreter with site-packages costs ~50 ms."""

    def __init__(self, python: str, env: dict[str, str], config: dict) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [
            python,
            "-I",
            "-X",
            "utf8",
            str(WORKER_SCRIPT),
            "zygote",
            str(theirs.fileno()),
            json.dumps(config),
        ]
        self.proc = subprocess.Popen(
            argv,
            pass_fds=(theirs.fileno(),),
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        ours.settimeout(30.0)
        self.sock = ours
        self._lock = threading.Lock()

    def fork(self, request: dict, fds: list[int]) -> int:
        with self._lock:
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
                reply = self.sock.recv(4096)
            except OSError as exc:
                raise SandboxError(f"sandbox zygote is gone ({exc})") from exc
        pid = json.loads(reply)["pid"] if reply else 0
        if not pid:
            raise SandboxError(f"sandbox zygote refused or died (exit status {self.proc.poll()})")
        return pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.sock.close()  # EOF: the zygote returns and exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class _Capture:
    budget: int
    data: bytearray = field(default_factory=bytearray)
    total: int = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.budget - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


class Worker:
    """The host's handle on one worker tree: pipes in, pipes out, and the kill pipe."""

    def __init__(self, zygote: Zygote, request: dict) -> None:
        self.uid, self.workdir = request["uid"], request["workdir"]
        req_r, self._req_w = os.pipe()
        self._out_r, out_w = os.pipe()
        self._err_r, err_w = os.pipe()
        self._ctl_r, ctl_w = os.pipe()
        kill_r, self._kill_w = os.pipe()
        theirs = [req_r, out_w, err_w, ctl_w, kill_r]  # the order _sandbox_worker._install_fds expects
        try:
            self.pid = zygote.fork(request, theirs)
        except BaseException:
            self._close_fds()
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        for fd in (self._out_r, self._err_r, self._ctl_r):
            os.set_blocking(fd, False)
        self._ctl_buf = b""
        self.closed = False  # our fds are closed: their numbers may belong to other files by now
        self.dead = False  # the interpreter exited or the tree was killed; no more calls
        self.isolation: dict = {}

    def _close_fds(self) -> None:
        self.closed = True
        for fd in (self._req_w, self._out_r, self._err_r, self._ctl_r, self._kill_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read_ctl(self) -> tuple[list[dict], bool]:
        """Messages that arrived on the control pipe, and whether it reached EOF (the whole tree is gone:
        every process of it holds the pipe until it dies, the supervisor until the very end)."""
        msgs, eof = [], False
        while True:
            try:
                chunk = os.read(self._ctl_r, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self._ctl_buf += chunk
        *lines, self._ctl_buf = self._ctl_buf.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):  # forged by the model's code: it only confuses its own call
                msgs.append(json.loads(line))
        return msgs, eof

    def alive(self) -> bool:
        """False if the tree reported its interpreter's death (or vanished) since the last call."""
        msgs, eof = self._read_ctl()
        return not (eof or self.dead or any("exit" in m for m in msgs))

    def wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self._ctl_r, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                sel.select(deadline - time.monotonic())
                msgs, eof = self._read_ctl()
                for msg in msgs:
                    if "ready" in msg:
                        self.isolation = msg["ready"]
                        return self.isolation
                    if "error" in msg:
                        raise SandboxError(f"sandbox worker failed to start: {msg['error']}")
                if eof:
                    raise SandboxError("sandbox worker exited during setup")
        raise SandboxError(f"sandbox worker not ready after {timeout_s} s")

    def call(self, code: str, stdin: str, timeout_s: float, budget: int, last: bool) -> ToolResult:
        """Run one cell; on a timeout the caller must `kill()` this worker."""
        payload = (json.dumps({"code": code, "stdin": stdin, "last": last}) + "\n").encode()
        out, err = _Capture(budget), _Capture(budget)
        start = time.monotonic()
        deadline = start + timeout_s
        status: int | None = None
        with selectors.DefaultSelector() as sel:
            for fd, cap in ((self._out_r, out), (self._err_r, err), (self._ctl_r, None)):
                sel.register(fd, selectors.EVENT_READ, cap)
            self._write_request(payload, deadline)
            while status is None and not self.dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for key, _ in sel.select(left):
                    if key.data is None:
                        status = self._on_ctl(sel)
                    elif not self._pump(key.fd, key.data):
                        sel.unregister(key.fd)
            wall = time.monotonic() - start
            for key in list(sel.get_map().values()):  # whatever the interpreter wrote before it reported
                if key.data is not None:
                    self._pump(key.fd, key.data, drain=True)
        timed_out = status is None and not self.dead
        if status is None:
            status = -9  # killed: by our deadline, or the tree died without a word (SIGKILL from outside)
        return ToolResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=status,
            timed_out=timed_out,
            truncated=out.total > budget or err.total > budget,
            wall_s=wall,
        )

    def _write_request(self, payload: bytes, deadline: float) -> None:
        # The interpreter is blocked reading this pipe, so a blocking write only waits for it to read.
        try:
            view = memoryview(payload)
            while view and time.monotonic() < deadline:
                view = view[os.write(self._req_w, view) :]
        except BrokenPipeError:
            self.dead = True

    def _on_ctl(self, sel: selectors.BaseSelector) -> int | None:
        msgs, eof = self._read_ctl()
        if eof:
            sel.unregister(self._ctl_r)
            self.dead = True
        status = None
        for msg in msgs:
            if "done" in msg:
                status = int(msg["done"])
            elif "exit" in msg:  # the interpreter itself died (os._exit, a signal): the worker is over
                self.dead = True
                status = int(msg["exit"]) if status is None else status
        return status

    @staticmethod
    def _pump(fd: int, cap: _Capture, drain: bool = False) -> bool:
        """Read what is there; False at EOF. Past the budget, output is read and dropped, so the program is
        never blocked on a full pipe (it finishes, or meets its deadline)."""
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            cap.add(chunk)
            if not drain:
                return True

    def kill(self, grace_s: float = 10.0) -> bool:
        """Tear the tree down; True once the supervisor confirmed that no process of it is left."""
        if self.closed:
            return True
        with contextlib.suppress(OSError):
            os.write(self._kill_w, b"k")
        deadline = time.monotonic() + grace_s
        eof = False
        with selectors.DefaultSelector() as sel:
            sel.register(self._ctl_r, selectors.EVENT_READ)
            while not eof and time.monotonic() < deadline:
                sel.select(deadline - time.monotonic())
                eof = self._read_ctl()[1]
        self.dead = True
        self._close_fds()
        if not eof:
            print(f"rolerl sandbox: worker {self.pid} (uid {self.uid}) did not exit", file=sys.stderr)
        return eof
