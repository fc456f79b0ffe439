"""Bounded host-side I/O with a worker: every byte the host reads from the sandbox or writes to it.

Everything on the far side of these pipes may be the model's code (it can write to the control fd, shrink
a pipe, stop reading), so each read here takes at most one chunk, every buffer has a byte cap, and the
control channel accepts only the few messages the worker sends, checked field by field. A breach is a
`ControlError`: the caller kills the worker and reports it in the call's `ToolResult`.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

CHUNK = 1 << 16  # one read() at a time; a pipe holds 64 KiB by default
CTL_LINE_MAX = 8192  # the longest real message (the `ready` report with its notes) is < 2 KiB
CTL_BUDGET = 1 << 16  # control bytes per call (or per setup): a real call sends < 100 bytes
CTL_MAX_BRACKETS = 16  # real messages nest 3 deep; this bounds json's recursion long before its limit
DRAIN_MAX = 4 << 20  # after a call: what may still sit in an output pipe (unprivileged max pipe: 1 MiB)
_READY_BOOLS = ("mountns", "netns", "pidns", "ipcns", "userns", "seccomp", "memory_cgroup")


class ControlError(Exception):
    """Something other than the worker wrote to the control channel (the code can: it is fd 3)."""


@dataclass
class Capture:
    """One output stream: keeps the first `budget` bytes, counts the rest."""

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

    def pump(self, fd: int) -> bool:
        """Read one chunk if there is one; False at EOF. Past the budget the bytes are read and dropped,
        so the program never blocks on a full pipe (it finishes or meets its deadline)."""
        try:
            chunk = os.read(fd, CHUNK)
        except BlockingIOError:
            return True
        if chunk:
            self.add(chunk)
        return bool(chunk)

    def drain(self, fd: int) -> None:
        """What was written before the call ended; at most DRAIN_MAX bytes, so a background process that
        keeps writing cannot hold the host here."""
        start = self.total
        while self.total - start < DRAIN_MAX:
            before = self.total
            if not self.pump(fd) or self.total == before:  # EOF, or nothing more there now
                break


class ControlChannel:
    """The worker's JSON-lines messages to the host (fd 3 inside), read without blocking."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.eof = False
        self.used = 0  # bytes since the last `new_budget()`
        self._buf = bytearray()

    def new_budget(self) -> None:
        self.used = 0

    def read(self) -> list[dict]:
        """The complete messages that arrived; raises ControlError past the byte cap or on a bad line."""
        while not self.eof:
            try:
                chunk = os.read(self.fd, CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            self.used += len(chunk)
            if self.used > CTL_BUDGET:
                raise ControlError(f"more than {CTL_BUDGET} bytes on the control channel")
            self._buf += chunk
        msgs = []
        while (end := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            msgs.append(parse_message(line))
        if len(self._buf) > CTL_LINE_MAX:
            raise ControlError(f"a control line longer than {CTL_LINE_MAX} bytes")
        return msgs

    def discard_until_eof(self) -> None:
        """Read and drop one chunk (teardown: the tree is being killed; only its EOF matters)."""
        with contextlib.suppress(BlockingIOError):
            self.eof = not os.read(self.fd, CHUNK)


def parse_message(line: bytes) -> dict:
    """One control line as the worker writes it: `{"done": code}`, `{"exit": code}`, `{"error": text}` or
    `{"ready": {...}}`. Anything else raises ControlError (never ValueError, RecursionError, ...)."""
    if len(line) > CTL_LINE_MAX:
        raise ControlError(f"a control line longer than {CTL_LINE_MAX} bytes")
    if line.count(b"[") + line.count(b"{") > CTL_MAX_BRACKETS:
        raise ControlError("a control line nested too deeply")
    try:
        msg = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # bad JSON, NaN/Infinity, an int of > 4300 digits
        raise ControlError(f"a control line that is not the worker's JSON ({type(exc).__name__})") from None
    if not isinstance(msg, dict) or len(msg) != 1:
        raise ControlError("a control message that is not a one-key object")
    ((key, value),) = msg.items()
    if key == "done" and _is_int(value, 0, 255):  # the interpreter's exit status, as a process reports it
        return msg
    if key == "exit" and _is_int(value, -64, 255):  # waitstatus_to_exitcode: status, or -signal
        return msg
    if key == "error" and isinstance(value, str):
        return msg
    if key == "ready":
        check_ready(value)
        return msg
    raise ControlError(f"an invalid control message {key[:40]!r}")


def check_ready(iso: object) -> None:
    if not isinstance(iso, dict) or set(iso) != {*_READY_BOOLS, "uid", "gid", "notes"}:
        raise ControlError("a malformed ready report")
    if not all(type(iso[k]) is bool for k in _READY_BOOLS):
        raise ControlError("a malformed ready report (flags)")
    if not (_is_int(iso["uid"], 1, 2**32 - 2) and _is_int(iso["gid"], 1, 2**32 - 2)):
        raise ControlError("a malformed ready report (ids)")
    notes = iso["notes"]
    if not isinstance(notes, list) or len(notes) > 32 or not all(isinstance(n, str) for n in notes):
        raise ControlError("a malformed ready report (notes)")


def _is_int(value: object, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi  # not bool, not float


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def write_some(fd: int, pending: memoryview) -> memoryview:
    """One non-blocking write of what is pending; returns the rest. Raises BrokenPipeError if the reader
    is gone. Never blocks: a reader that stalls (a cell shrank the pipe, slowed its loop) costs only the
    deadline of the call that waits for it."""
    try:
        return pending[os.write(fd, pending[:CHUNK]) :]
    except BlockingIOError:
        return pending
