"""The sandbox's knobs (`SandboxConfig`) and its report of what holds on this machine (`Isolation`).

See docs/SANDBOX.md for what each mechanism guarantees and what is left where the kernel refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

NAMESPACES = ("mount", "net", "pid", "ipc")
# The unprivileged mode's code runs as the caller's own uid: without these it could signal, trace or read
# the host process itself, and no sound way to kill its whole tree would be left (see docs/SANDBOX.md).
UNPRIVILEGED_NEEDS = ("mount", "pid", "ipc")


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
    namespaces: tuple[str, ...] = NAMESPACES  # which of mount/net/pid/ipc to use where the kernel allows
    strict: bool = False  # True: refuse to run unless every namespace above is available
    network: Literal["isolated", "allow"] = "isolated"  # allow: no net namespace, no socket filter
    # root: each call runs as a dedicated uid (needs root). unprivileged: as the calling user, inside
    # user+mount+pid+ipc(+net) namespaces; weaker (docs/SANDBOX.md), chosen explicitly, warns once.
    privilege: Literal["root", "unprivileged"] = "root"
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
        self.namespaces = tuple(self.namespaces)
        if bad := set(self.namespaces) - set(NAMESPACES):
            raise ValueError(f"SandboxConfig.namespaces: unknown {sorted(bad)}; allowed: {NAMESPACES}")
        if self.network not in ("isolated", "allow"):
            raise ValueError(f"SandboxConfig.network must be 'isolated' or 'allow', got {self.network!r}")
        if self.privilege not in ("root", "unprivileged"):
            raise ValueError(
                f"SandboxConfig.privilege must be 'root' or 'unprivileged', got {self.privilege!r}"
            )
        if self.privilege == "unprivileged" and (lack := set(UNPRIVILEGED_NEEDS) - set(self.namespaces)):
            raise ValueError(
                f"SandboxConfig.namespaces must include {sorted(lack)} with privilege='unprivileged' "
                "(the code runs as your own uid: only namespaces keep it away from your processes)"
            )
        if self.open_files < 16:
            raise ValueError("SandboxConfig.open_files must be >= 16 (the interpreter itself needs some)")


@dataclass(frozen=True)
class Isolation:
    """What actually holds for this sandbox on this kernel (reported by its first worker)."""

    uid: int
    gid: int
    mount_namespace: bool  # read-only filesystem except a private tmpfs working dir; fresh /proc
    network_namespace: bool  # no interfaces at all, not even loopback; abstract unix sockets are its own
    pid_namespace: bool  # the sandbox sees only itself; killing its init kills everything in it
    ipc_namespace: bool  # SysV IPC and POSIX message queues are private and die with the worker
    seccomp: bool  # no new namespaces, io_uring, bpf, keyrings; no socket() without a net namespace
    memory_cgroup: bool  # tree_memory_mb bounds the whole process tree, not just each process
    notes: tuple[str, ...]
    privilege: str = "root"  # root: a dedicated uid per call; unprivileged: the caller's uid in a user ns
    user_namespace: bool = False  # the worker runs in its own user namespace (unprivileged mode)

    @property
    def kill_method(self) -> str:
        return "pid namespace" if self.pid_namespace else "kill(-1) as the dedicated uid"

    @classmethod
    def from_report(cls, iso: dict, privilege: str) -> Isolation:
        """From the worker's validated `ready` message (see _sandbox_channel.check_ready)."""
        return cls(
            uid=iso["uid"],
            gid=iso["gid"],
            mount_namespace=iso["mountns"],
            network_namespace=iso["netns"],
            pid_namespace=iso["pidns"],
            ipc_namespace=iso["ipcns"],
            seccomp=iso["seccomp"],
            memory_cgroup=iso["memory_cgroup"],
            notes=tuple(iso["notes"]),
            privilege=privilege,
            user_namespace=iso["userns"],
        )
