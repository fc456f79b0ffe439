"""Run model-written Python safely: one fresh process per call, as a dedicated unprivileged uid, with
rlimits, a wall-clock timeout that kills the whole process tree, a scrubbed environment, a private
working directory, and no network. See docs/SANDBOX.md for what holds where.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from rolerl.tools._sandbox_host import SandboxError, UidLeases, Worker, Zygote
from rolerl.tools.base import ToolResult

__all__ = ["Isolation", "PythonSandbox", "SandboxConfig", "SandboxError", "SandboxSession"]

_NAMESPACES = ("mount", "net", "pid")


@dataclass
class SandboxConfig:
    timeout_s: float = 10.0  # wall clock per call, from the moment the code reaches the interpreter
    cpu_s: int = 10  # RLIMIT_CPU per process and call: SIGXCPU at this, SIGKILL one second later
    session_cpu_s: int = 300  # RLIMIT_CPU hard limit of a whole session (a session is one process)
    memory_mb: int = 1024  # RLIMIT_AS per process (address space, so a bit above what is touched)
    tree_memory_mb: int = 2048  # memory cgroup limit of a worker's whole process tree (where allowed); 0: off
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file the code can write
    disk_mb: int = 64  # size of the working dir's tmpfs (with a mount namespace; else the host disk)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # RLIMIT_NPROC of the call's dedicated uid (processes and threads)
    max_output_bytes: int = 64 * 1024  # per stream; the head is kept, the rest read and dropped
    pool_size: int = 2  # idle workers kept forked and set up, so a call does not wait for one
    max_workers: int = 64  # live workers (idle + busy + sessions) at once; further calls wait
    uid_base: int = 60000  # dedicated uids uid_base .. uid_base + uid_count - 1 (no account may use them)
    uid_count: int = 1000  # shared by every sandbox on the machine through lock files
    namespaces: tuple[str, ...] = _NAMESPACES  # which of mount/net/pid to use where the kernel allows
    strict: bool = False  # True: refuse to run unless every namespace above is available
    network: Literal["isolated", "allow"] = "isolated"  # allow: no net namespace, no socket filter
    hidden_paths: tuple[str, ...] = ()  # dirs replaced by an empty read-only dir (mount namespace only)
    preload: tuple[str, ...] = ()  # modules imported once in the zygote (thread-free ones only)
    echo_last_expr: bool = False  # print repr() of a trailing expression, like a notebook cell
    python: str = ""  # interpreter for the sandbox; "" = this one (sys.executable)
    env: dict[str, str] = field(default_factory=dict)  # extra variables (the parent's are never passed)
    lock_dir: str = ""  # where the uid lock files live; "" = <tempdir>/rolerl-sandbox-uids

    def __post_init__(self) -> None:
        for name in (
            "timeout_s",
            "cpu_s",
            "memory_mb",
            "file_size_mb",
            "disk_mb",
            "open_files",
            "processes",
            "max_output_bytes",
            "max_workers",
            "uid_count",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.pool_size <= self.max_workers:
            raise ValueError(f"SandboxConfig.pool_size must be in [0, max_workers], got {self.pool_size}")
        if self.tree_memory_mb < 0:
            raise ValueError(f"SandboxConfig.tree_memory_mb must be >= 0 (0: off), got {self.tree_memory_mb}")
        if self.session_cpu_s < self.cpu_s:
            raise ValueError("SandboxConfig.session_cpu_s must be >= cpu_s")
        if self.uid_base < 1000:
            raise ValueError(
                f"SandboxConfig.uid_base must be >= 1000 (a dedicated range), got {self.uid_base}"
            )
        if bad := set(self.namespaces) - set(_NAMESPACES):
            raise ValueError(f"SandboxConfig.namespaces: unknown {sorted(bad)}; allowed: {_NAMESPACES}")
        if self.network not in ("isolated", "allow"):
            raise ValueError(f"SandboxConfig.network must be 'isolated' or 'allow', got {self.network!r}")
        if self.open_files < 16:
            raise ValueError("SandboxConfig.open_files must be >= 16 (the interpreter itself needs some)")


@dataclass(frozen=True)
class Isolation:
    """What actually holds for this sandbox on this kernel (reported by its first worker)."""

    uid: int
    gid: int
    mount_namespace: bool  # read-only filesystem except a private tmpfs working dir; fresh /proc
    network_namespace: bool  # no interfaces at all, not even loopback
    pid_namespace: bool  # the sandbox sees only itself; killing its init kills everything in it
    seccomp: bool  # no new namespaces, io_uring, bpf, keyrings; no AF_INET sockets without a net namespace
    memory_cgroup: bool  # tree_memory_mb bounds the whole process tree, not just each process
    notes: tuple[str, ...]

    @property
    def kill_method(self) -> str:
        return "pid namespace" if self.pid_namespace else "kill(-1) as the dedicated uid"


class PythonSandbox:
    """The `python` tool: runs a code string, returns its output as a `ToolResult`."""

    name = "python"
    description = "Runs a Python 3 program in a fresh sandboxed process and returns what it printed."

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
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
            if os.geteuid() != 0:
                raise SandboxError(
                    "PythonSandbox must run as root: it drops each call to a dedicated unprivileged uid "
                    "(root would ignore RLIMIT_NPROC and could raise its own limits)"
                )
            if not shutil.rmtree.avoids_symlink_attacks:  # see _retire
                raise SandboxError("shutil.rmtree cannot avoid symlink attacks on this platform")
            cfg = self.config
            if self._base is None:
                self._base = Path(tempfile.mkdtemp(prefix="rolerl-sandbox-"))
                self._base.chmod(0o711)  # workers may traverse to their own dir, not list the others
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
            assert self._uids is not None and self._base is not None and self._zygote is not None
            uid = self._uids.acquire()
        except BaseException:
            self._unreserve()
            raise
        with self._lock:
            self._counter += 1
            workdir = self._base / f"{uid}-{self._counter}"
        worker = None
        try:
            workdir.mkdir(mode=0o700)
            os.chown(workdir, uid, uid)
            worker = Worker(self._zygote, {"uid": uid, "workdir": str(workdir), "session": session})
            self._check_isolation(worker.wait_ready(timeout_s=30.0))
            return worker
        except BaseException:
            clean = worker.kill() if worker is not None else True
            shutil.rmtree(workdir, ignore_errors=True)
            if clean:
                self._uids.release(uid)
            self._unreserve()
            raise

    def _check_isolation(self, iso: dict) -> None:
        if self._isolation is not None:
            return
        isolation = Isolation(
            uid=iso["uid"],
            gid=iso["gid"],
            mount_namespace=iso["mountns"],
            network_namespace=iso["netns"],
            pid_namespace=iso["pidns"],
            seccomp=iso["seccomp"],
            memory_cgroup=iso["memory_cgroup"],
            notes=tuple(iso["notes"]),
        )
        missing = [n for n in self.config.namespaces if not iso[f"{n}ns"]]
        if missing and self.config.strict:
            raise SandboxError(
                f"strict sandbox: {missing} namespaces unavailable: {'; '.join(isolation.notes)}"
            )
        if missing:
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
