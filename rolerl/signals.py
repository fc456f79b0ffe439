"""SIGTERM stopping a run the way Ctrl-C does: `sigterm_raises` turns the first SIGTERM into `Terminated` (a
KeyboardInterrupt) in the main thread, so a trainer checkpoints its last completed step and an evaluation
keeps its finished chunks before they exit, whether a scheduler preempts the job, `kill` stops it, or
torchrun stops the ranks left after one failed (rolerl.train.distributed). `stopping` then absorbs later
SIGTERMs while the checkpoint and the report are written."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


class Terminated(KeyboardInterrupt):
    """SIGTERM (torchrun stopping the job after another rank failed, or a scheduler preempting it): stops
    the run the way Ctrl-C does (the last completed step is checkpointed first)."""


_stopping = False  # the run is on its error path (`stopping`): SIGTERM no longer interrupts it


def stopping() -> None:
    """The run is on its way out after an error: from now on SIGTERM (which torchrun sends the other ranks
    as soon as one fails) is only logged, so that the checkpoint of the last completed step and the error
    report complete (torchrun sends SIGKILL 30 s later, should a rank linger)."""
    global _stopping
    _stopping = True


@contextlib.contextmanager
def sigterm_raises(keep_after_error: bool = False) -> Iterator[None]:
    """While inside, the first SIGTERM raises `Terminated` in the main thread, as Ctrl-C raises
    KeyboardInterrupt (elsewhere, or outside, SIGTERM keeps its handler): torchrun's agent stops the ranks
    left after one failed with SIGTERM, and without this a rank busy computing would vanish without a word
    or a checkpoint. `keep_after_error` (a torchrun rank, about to exit): when the block raises, SIGTERM
    stays absorbed, so a late one cannot cut the error report short."""
    global _stopping
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if _stopping:
            log.warning("SIGTERM while stopping: the checkpoint and the error report finish first")
            return
        stopping()
        raise Terminated("SIGTERM")

    _stopping = False
    previous = signal.signal(signal.SIGTERM, handler)
    failed = True
    try:
        yield
        failed = False
    finally:
        if not (failed and keep_after_error):
            signal.signal(signal.SIGTERM, previous)
