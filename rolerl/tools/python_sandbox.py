"""Run model-written Python safely: one fresh process per call, as a dedicated unprivileged uid, with
rlimits, a wall-clock timeout that kills the whole process tree, a scrubbed environment, a private
working directory, and no network. See docs/SANDBOX.md for what holds where. Without root, construction
fails (SandboxError) unless `SandboxConfig(privilege="unprivileged")` chooses the weaker mode.

    sandbox = PythonSandbox(SandboxConfig(timeout_s=5))
    sandbox.run("print(1 + 1)").stdout            # '2\\n'
    with sandbox.session() as s:                   # interpreter state kept across one episode's calls
        s.run("x = 41"); s.run("print(x + 1)")

Thread-safe: call `run` (or `await arun`) from as many threads or tasks as you like; at most
`max_workers` calls run at once, the rest wait for a worker.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
import weakref
from dataclasses import asdict
from pathlib import Path

from rolerl.tools._sandbox_config import Isolation, SandboxConfig
from rolerl.tools._sandbox_host import SandboxError, UidLeases, Worker, Zygote
from rolerl.tools.base import ToolResult

__all__ = ["Isolation", "PythonSandbox", "SandboxConfig", "SandboxError", "SandboxSession"]

_UNPRIVILEGED_WARNING = (
    "python sandbox in unprivileged mode (SandboxConfig.privilege='unprivileged'): the code runs as your "
    "own uid {uid} in user, mount, pid and IPC namespaces, not as a dedicated uid. It can read every file "
    "your user can read outside your home directory (add hidden_paths for more), the memory cgroup is "
    "usually missing (memory is bounded per process), and a kernel bug in user namespaces is reachable. "
    "Run as root for the full sandbox; see docs/SANDBOX.md."
)


class PythonSandbox:
    """The `python` tool: runs a code string, returns its output as a `ToolResult`."""

    name = "python"
    description = "Runs a Python 3 program in a fresh sandboxed process and returns what it printed."

    def __init__(self, config: SandboxConfig | None = None) -> None:
        """Checks what the sandbox needs before anything runs, so that a run that cannot use it fails at
        start (SandboxError, saying what to do) instead of passing an error to the model as tool output."""
        self.config = config or SandboxConfig()
        _check_preconditions(self.config)
        self._lock = threading.Condition()
        self._idle: list[Worker] = []
        self._live = 0  # workers holding a uid (idle, busy, sessions)
        self._zygote: Zygote | None = None
        self._uids: UidLeases | None = None
        self._base: Path | None = None
        self._isolation: Isolation | None = None
        self._closed = False
        self._counter = 0
        self._refiller: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None
        if self.config.privilege == "unprivileged":
            try:  # starting a worker is the only sure test that this kernel allows user namespaces
                self.isolation  # noqa: B018
            except SandboxError as exc:
                self.close()
                raise SandboxError(
                    f"SandboxConfig(privilege='unprivileged') cannot start here ({exc}). It needs "
                    "unprivileged user namespaces: sysctl user.max_user_namespaces > 0, "
                    "kernel.unprivileged_userns_clone=1 (Debian), kernel.apparmor_restrict_unprivileged_userns=0 "
                    "(Ubuntu >= 23.10), and a container seccomp profile that allows unshare. Or run as root."
                ) from None

    # --- public API -----------------------------------------------------------------------------------
    def run(self, args: str, *, stdin: str = "", timeout_s: float | None = None) -> ToolResult:
        """Run `args` (a program) in a fresh process. Never raises for anything the program does."""
        worker = self._take()
        try:
            return worker.call(
                args, stdin, timeout_s or self.config.timeout_s, self.config.max_output_bytes, True
            )
        finally:
            self._retire(worker)

    async def arun(self, args: str, *, stdin: str = "", timeout_s: float | None = None) -> ToolResult:
        # The call blocks on pipes, so it runs in a thread; the event loop keeps serving other episodes.
        return await asyncio.to_thread(self.run, args, stdin=stdin, timeout_s=timeout_s)

    def session(self) -> SandboxSession:
        return SandboxSession(self)

    @property
    def isolation(self) -> Isolation:
        """What holds on this machine; starts a worker (kept in the pool) if none has reported yet."""
        self._start()
        if self._isolation is None:
            self._reserve()
            self._put_idle(self._spawn_reserved(session=False))
        assert self._isolation is not None
        return self._isolation

    def close(self) -> None:
        """Kill the idle workers and the zygote. Running calls and open sessions finish on their own."""
        with self._lock:
            self._closed = True
            idle = list(self._idle)
            self._idle.clear()  # in place: the finalizer holds this list
            self._lock.notify_all()
        for worker in idle:
            self._retire(worker)
        if self._refiller is not None:  # it may be forking one last worker: let it retire that one
            self._refiller.join(timeout=10.0)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._zygote is not None:
            self._zygote.close()
        self._remove_base_if_unused()

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- workers: every live worker holds one of `max_workers` slots and one leased uid ---------------
    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            if self._zygote is not None and self._zygote.alive():
                return
            cfg = self.config
            if self._base is None:
                self._base = Path(tempfile.mkdtemp(prefix="rolerl-sandbox-"))
                self._base.chmod(0o711)  # workers may traverse to their own dir, not list the others
                if cfg.privilege == "root":  # unprivileged: every worker runs as the caller's own uid
                    lock_dir = Path(cfg.lock_dir or Path(tempfile.gettempdir()) / "rolerl-sandbox-uids")
                    self._uids = UidLeases(cfg.uid_base, cfg.uid_count, lock_dir)
            python = cfg.python or sys.executable
            env = {
                "PATH": f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8",
                "LC_ALL": "C.UTF-8",
                # One BLAS/OpenMP thread: threads count against RLIMIT_NPROC and each reserves address space.
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                **cfg.env,
            }
            worker_cfg = {k: v for k, v in asdict(cfg).items() if k not in ("env", "python")}
            if self._zygote is not None:  # it died (killed from outside?): start another
                self._zygote.close()
            self._zygote = Zygote(python, env, worker_cfg)
            if self._finalizer is not None:
                self._finalizer.detach()
            # If the sandbox is dropped without close(): idle trees, uid leases, zygote, temp dir.
            self._finalizer = weakref.finalize(
                self, _shutdown, self._zygote, self._idle, self._uids, self._base
            )
            if self._refiller is None and cfg.pool_size > 0:
                self._refiller = threading.Thread(
                    target=_refill_loop, args=(weakref.ref(self),), name="sandbox-refill", daemon=True
                )
                self._refiller.start()

    def _reserve(self, block: bool = True) -> bool:
        with self._lock:
            while self._live >= self.config.max_workers and not self._closed and block:
                self._lock.wait()
            if self._closed:
                raise SandboxError("sandbox is closed")
            if self._live >= self.config.max_workers:
                return False
            self._live += 1
            return True

    def _unreserve(self) -> None:
        with self._lock:
            self._live -= 1
            self._lock.notify_all()
        self._remove_base_if_unused()

    def _spawn_reserved(self, session: bool) -> Worker:
        """Fork a worker (a slot is already reserved) and wait until its interpreter is set up."""
        try:
            self._start()
            assert self._base is not None and self._zygote is not None
            uid = self._uids.acquire() if self._uids is not None else os.getuid()
        except BaseException:
            self._unreserve()
            raise
        with self._lock:
            self._counter += 1
            workdir = self._base / f"{uid}-{self._counter}"
        worker = None
        try:
            workdir.mkdir(mode=0o700)
            if self._uids is not None:
                os.chown(workdir, uid, uid)
            worker = Worker(self._zygote, {"uid": uid, "workdir": str(workdir), "session": session})
            self._check_isolation(worker.wait_ready(timeout_s=30.0))
            return worker
        except BaseException:
            clean = worker.kill() if worker is not None else True
            shutil.rmtree(workdir, ignore_errors=True)
            if clean and self._uids is not None:
                self._uids.release(uid)
            self._unreserve()
            raise

    def _check_isolation(self, iso: dict) -> None:
        if self._isolation is not None:
            return
        cfg = self.config
        isolation = Isolation.from_report(iso, cfg.privilege)
        missing = [n for n in cfg.namespaces if not iso[f"{n}ns"]]
        if missing and (cfg.strict or cfg.privilege == "unprivileged"):
            raise SandboxError(
                f"{'strict' if cfg.strict else 'unprivileged'} sandbox: {missing} namespaces unavailable: "
                + "; ".join(isolation.notes)
            )
        if cfg.privilege == "unprivileged":
            warnings.warn(_UNPRIVILEGED_WARNING.format(uid=isolation.uid), RuntimeWarning, stacklevel=2)
        elif missing:
            warnings.warn(
                f"python sandbox runs without {missing} namespaces: {'; '.join(isolation.notes)}",
                RuntimeWarning,
                stacklevel=2,
            )
        self._isolation = isolation

    def _take(self) -> Worker:
        while True:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
                self._lock.notify_all()  # wake the refiller
            if worker is None:
                break
            if worker.alive():
                return worker
            self._retire(worker)  # died while idle (killed from outside, an OOM kill): take another
        self._reserve()
        return self._spawn_reserved(session=False)

    def _put_idle(self, worker: Worker) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.config.pool_size:
                self._idle.append(worker)
                return
        self._retire(worker)

    def _retire(self, worker: Worker) -> None:
        """Kill the worker's tree, remove its directory (never following symlinks), free uid and slot."""
        clean = worker.kill()
        # rmtree works on directory fds (openat/unlinkat), so a symlink the code planted is unlinked,
        # never followed (_start refuses to run where that is not the case).
        shutil.rmtree(worker.workdir, ignore_errors=True)
        if clean and self._uids is not None:
            self._uids.release(worker.uid)  # else the uid stays leased: something of it may still run
        self._unreserve()

    def _remove_base_if_unused(self) -> None:
        with self._lock:
            if not (self._closed and self._live == 0 and self._base is not None):
                return
            base, self._base = self._base, None
        shutil.rmtree(base, ignore_errors=True)

    def _refill_once(self) -> bool:
        """Add one idle worker if the pool is short (waits up to 1 s for that); False once closed."""
        with self._lock:
            if not self._closed and len(self._idle) >= self.config.pool_size:
                self._lock.wait(timeout=1.0)
            if self._closed:
                return False
            if len(self._idle) >= self.config.pool_size:
                return True
        try:
            if not self._reserve(block=False):
                with self._lock:
                    self._lock.wait(timeout=1.0)  # every slot is busy: wait for one to come back
                return True
            self._put_idle(self._spawn_reserved(session=False))
        except SandboxError:
            if self._closed:
                return False
            time.sleep(1.0)  # the next call spawns for itself and reports the error
        return True


class SandboxSession:
    """One episode's interpreter: variables, imports and files persist from call to call.

    Each call still gets the per-call timeout and output budget, and background processes a call starts
    are killed when it ends. After a timeout or a crash the interpreter is gone: the next call starts a
    fresh one and its stderr begins with a note saying that the earlier state was lost.
    """

    name = PythonSandbox.name
    description = "Runs Python 3 code in a persistent sandboxed interpreter (state is kept between calls)."

    def __init__(self, sandbox: PythonSandbox) -> None:
        self._sandbox = sandbox
        self._worker: Worker | None = None
        self._lock = threading.Lock()
        self._lost = False

    def run(self, args: str, *, stdin: str = "", timeout_s: float | None = None) -> ToolResult:
        cfg = self._sandbox.config
        with self._lock:
            if self._worker is None:
                self._sandbox._reserve()
                self._worker = self._sandbox._spawn_reserved(session=True)
            worker = self._worker
            result = worker.call(args, stdin, timeout_s or cfg.timeout_s, cfg.max_output_bytes, False)
            if self._lost:
                result.stderr = (
                    "[sandbox] the earlier session state was lost; this ran in a fresh interpreter\n"
                    + result.stderr
                )
                self._lost = False
            if result.timed_out or worker.dead:
                self._worker = None
                self._lost = True
                self._sandbox._retire(worker)
            return result

    async def arun(self, args: str, *, stdin: str = "", timeout_s: float | None = None) -> ToolResult:
        return await asyncio.to_thread(self.run, args, stdin=stdin, timeout_s=timeout_s)

    def close(self) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._sandbox._retire(worker)

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_preconditions(cfg: SandboxConfig) -> None:
    """What the chosen mode needs from this process; each error says what to do instead."""
    if not shutil.rmtree.avoids_symlink_attacks:  # see PythonSandbox._retire
        raise SandboxError("shutil.rmtree cannot avoid symlink attacks on this platform")
    euid = os.geteuid()
    if cfg.privilege == "root" and euid != 0:
        raise SandboxError(
            f"the python sandbox needs root (this process runs as uid {euid}): it runs each call as a "
            "dedicated unprivileged uid, and only root can switch to one. Run as root (e.g. in a container, "
            "as its root user), or choose the weaker mode that runs the code as your own user inside user "
            "namespaces: SandboxConfig(privilege='unprivileged'), or ROLERL_SANDBOX_PRIVILEGE=unprivileged "
            "for the rolerl commands (docs/SANDBOX.md says what that mode does not guarantee)"
        )
    if cfg.privilege == "unprivileged" and euid == 0:
        raise SandboxError(
            "SandboxConfig(privilege='unprivileged') runs the code as the calling user, which is root "
            "here: use the default privilege='root' (a dedicated uid per call)"
        )
    python = cfg.python or sys.executable
    if not os.access(python, os.X_OK):
        raise SandboxError(f"SandboxConfig.python: {python!r} is not an executable interpreter")


def _refill_loop(ref: weakref.ref[PythonSandbox]) -> None:
    # A weak reference between rounds, so that a sandbox dropped without close() can still be collected
    # (its finalizer then stops the workers) instead of living as long as this thread.
    while (sandbox := ref()) is not None and sandbox._refill_once():
        del sandbox


def _shutdown(zygote: Zygote, idle: list[Worker], uids: UidLeases | None, base: Path | None) -> None:
    for worker in idle:
        if worker.kill() and uids is not None:
            uids.release(worker.uid)
    zygote.close()
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)
