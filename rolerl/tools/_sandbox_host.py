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
from pathlib import Path

from rolerl.tools._sandbox_channel import Capture, ControlChannel, ControlError, write_some
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


class Worker:
    """The host's handle on one worker tree: pipes in, pipes out, and the kill pipe.

    Every read and write here is non-blocking and bounded (see `_sandbox_channel`): the code on the far
    side may flood or forge the control channel, or stall the loop that reads its requests.
    """

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
        for fd in (self._out_r, self._err_r, self._ctl_r, self._req_w):
            os.set_blocking(fd, False)
        self.ctl = ControlChannel(self._ctl_r)
        self.closed = False  # our fds are closed: their numbers may belong to other files by now
        self.dead = False  # the interpreter exited or the tree was killed; no more calls
        self.isolation: dict = {}

    def _close_fds(self) -> None:
        self.closed = True
        for fd in (self._req_w, self._out_r, self._err_r, self._ctl_r, self._kill_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def alive(self) -> bool:
        """False if the tree reported its interpreter's death (or vanished, or broke the protocol) since
        the last call. EOF on the control pipe means the whole tree is gone: every process of it holds the
        pipe until it dies, the supervisor until the very end."""
        try:
            msgs = self.ctl.read()
        except ControlError:
            self.dead = True
        else:
            self.dead = self.dead or self.ctl.eof or any("exit" in m for m in msgs)
        return not self.dead

    def wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        self.ctl.new_budget()
        with selectors.DefaultSelector() as sel:
            sel.register(self._ctl_r, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                sel.select(deadline - time.monotonic())
                try:  # no model code has run yet: a bad message here is a bug of ours
                    msgs = self.ctl.read()
                except ControlError as exc:
                    raise SandboxError(f"sandbox worker sent a bad message during setup: {exc}") from None
                for msg in msgs:
                    if "ready" in msg:
                        self.isolation = msg["ready"]
                        return self.isolation
                    if "error" in msg:
                        raise SandboxError(f"sandbox worker failed to start: {msg['error']}")
                    raise SandboxError(f"sandbox worker exited during setup ({msg})")
                if self.ctl.eof:
                    raise SandboxError("sandbox worker exited during setup")
        raise SandboxError(f"sandbox worker not ready after {timeout_s} s")

    def call(self, code: str, stdin: str, timeout_s: float, budget: int, last: bool) -> ToolResult:
        """Run one cell; on a timeout or a violation (then `dead`) the caller must `kill()` this worker."""
        pending = memoryview((json.dumps({"code": code, "stdin": stdin, "last": last}) + "\n").encode())
        out, err = Capture(budget), Capture(budget)
        start = time.monotonic()
        deadline = start + timeout_s
        status: int | None = None
        violation = ""
        self.ctl.new_budget()
        with selectors.DefaultSelector() as sel:
            for fd, data in ((self._out_r, out), (self._err_r, err), (self._ctl_r, self.ctl)):
                sel.register(fd, selectors.EVENT_READ, data)
            sel.register(self._req_w, selectors.EVENT_WRITE, None)
            try:
                while status is None and not self.dead:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    for key, _ in sel.select(left):
                        if key.data is None:
                            pending = self._send(pending, sel)
                        elif key.data is self.ctl:
                            status = self._on_ctl(sel)
                        elif not key.data.pump(key.fd):
                            sel.unregister(key.fd)
            except ControlError as exc:
                violation, self.dead = str(exc), True
            wall = time.monotonic() - start
            for fd, cap in ((self._out_r, out), (self._err_r, err)):  # what it wrote before it reported
                if fd in sel.get_map():
                    cap.drain(fd)
        timed_out = status is None and not self.dead
        if pending:  # the interpreter never got its whole request: the stream is out of step now
            self.dead = True
        stderr = err.text()
        if violation:
            stderr += f"[sandbox] the code broke the sandbox's control channel ({violation}); its processes were killed\n"
        return ToolResult(
            stdout=out.text(),
            stderr=stderr,
            exit_code=-9 if status is None else status,  # killed: by us, or SIGKILL from outside
            timed_out=timed_out,
            truncated=out.total > budget or err.total > budget,
            wall_s=wall,
        )

    def _send(self, pending: memoryview, sel: selectors.BaseSelector) -> memoryview:
        try:
            pending = write_some(self._req_w, pending)
        except BrokenPipeError:  # the interpreter is gone: its exit status comes on the control pipe
            sel.unregister(self._req_w)
            return pending
        if not pending:
            sel.unregister(self._req_w)
        return pending

    def _on_ctl(self, sel: selectors.BaseSelector) -> int | None:
        msgs = self.ctl.read()
        if self.ctl.eof:
            sel.unregister(self._ctl_r)
            self.dead = True
        status = None
        for msg in msgs:
            if "done" in msg:
                status = msg["done"]
            elif "exit" in msg:  # the interpreter itself died (os._exit, a signal): the worker is over
                self.dead = True
                status = msg["exit"] if status is None else status
            else:
                raise ControlError("a setup message during a call")
        return status

    def kill(self, grace_s: float = 10.0) -> bool:
        """Tear the tree down; True once the supervisor confirmed that no process of it is left."""
        if self.closed:
            return True
        with contextlib.suppress(OSError):
            os.write(self._kill_w, b"k")
        deadline = time.monotonic() + grace_s
        with selectors.DefaultSelector() as sel:
            sel.register(self._ctl_r, selectors.EVENT_READ)
            while not self.ctl.eof and time.monotonic() < deadline:
                sel.select(deadline - time.monotonic())
                self.ctl.discard_until_eof()  # one chunk per wakeup: a flood ends with its writer
        eof = self.ctl.eof
        self.dead = True
        self._close_fds()
        if not eof:
            print(f"rolerl sandbox: worker {self.pid} (uid {self.uid}) did not exit", file=sys.stderr)
        return eof
