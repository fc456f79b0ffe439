"""Data parallelism on torch.distributed: `torchrun --nproc_per_node N -m rolerl train CONFIG.yaml`.

Each rank rolls out the episodes of its tasks (task i belongs to rank `i % world`), with the global
`(task, sample)` seeds, so 1 or N ranks sample the same tokens. The episodes are then gathered on every rank
(token ids and rewards, small next to the model): rewards, advantage groups, filters and episode metrics
are computed over the whole step exactly as one process would. The update runs over the global plan of
mini-batches: every rank collates the global batch and counts each mini-batch's loss normalisers and role
shares over all of its rows, but runs forward and backward only on the rows of its own episodes; the
adapter gradients are then summed over ranks by hand (the trainer's forward bypasses `model.forward`, which
DDP's wrapper expects; only adapters train), with a gradient that no rank produced left `None` (AdamW then
skips the parameter, as in one process), and every rank takes the same optimizer step. Metric sums are
merged over ranks; rank 0 writes checkpoints and logs. Without torchrun (no `WORLD_SIZE`) this is one
process and every collective here is the identity.

Faults (docs/DISTRIBUTED.md "When a rank fails"): a collective that fails (a peer died: gloo sees its socket
close; or no answer within `train.dist_timeout_s`) raises `RankFailure`, which the loop completes with the
`--resume` command; torchrun, seeing a rank exit, sends SIGTERM to the others, which `sigterm_raises`
(rolerl.signals) turns into an exception so that they, too, stop through the loop's error path instead of
vanishing silently.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

log = logging.getLogger(__name__)
T = TypeVar("T")
FAULT_ENV = "ROLERL_FAULT"


class RankFailure(ConnectionError):
    """A collective failed: another rank died, or did not answer within `train.dist_timeout_s`. An
    OSError (a fault of the machine, not a bug), so `rolerl train` prints it as one line."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: `rank` of `world` (1 = no torch.distributed)."""

    rank: int = 0
    world: int = 1
    joined: bool = False  # this process group was created by `init_from_env` (so `close` ends it)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def owner(self, task: int) -> int:
        """The rank that rolls out task `task` (its index in the step's tasks), all its samples."""
        return task % self.world

    def owns(self, task: int) -> bool:
        return self.owner(task) == self.rank

    def gather(self, obj: T) -> list[T]:
        """`obj` of every rank, in rank order (pickled; for small things: episodes, metric sums)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        self._call("all_gather_object", torch_dist.all_gather_object, out, obj)
        return out

    def interleave(self, mine: Sequence[T], n_tasks: int, per_task: int) -> list[T]:
        """The global list, task by task, of the `per_task` items each rank produced for each of its
        tasks (in task order): what one process would have produced."""
        if not self.active:
            return list(mine)
        lists = [iter(items) for items in self.gather(list(mine))]
        return [next(lists[self.owner(i)]) for i in range(n_tasks) for _ in range(per_task)]

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over ranks (float64 on the CPU: exact for counts, enough for losses)."""
        if not self.active:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=self._device())
        self._call("all_reduce", torch_dist.all_reduce, t)
        return t.cpu().tolist()

    def reduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum `.grad` over ranks in one all-reduce. A parameter whose gradient is `None` on every rank
        stays `None` (the optimizer skips it: an adapter no token reached); one that got a gradient on
        some rank gets the sum (zeros standing in where a rank had none)."""
        if not self.active:
            return
        params = [p for p in params if p.requires_grad]
        if not params:
            return
        device = params[0].device
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        has = torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=device)
        flat = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to(dtype)
            for p in params
        ]
        buffer = torch.cat([has, *flat])
        self._call("all_reduce of the gradients", torch_dist.all_reduce, buffer)
        offset = len(params)
        for i, p in enumerate(params):
            n = p.numel()
            if float(buffer[i]) > 0:
                g = buffer[offset : offset + n].view_as(p).to(p.dtype)
                p.grad = g.clone()
            offset += n

    def broadcast(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Rank 0's values of `params` on every rank (they start, and must stay, identical)."""
        if not self.active:
            return
        with torch.no_grad():
            for p in params:
                self._call("broadcast", torch_dist.broadcast, p.data, src=0)

    def barrier(self) -> None:
        if self.active:
            self._call("barrier", torch_dist.barrier)

    def _call(self, name: str, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one collective; its failure (gloo: `Connection closed by peer`, a timeout; NCCL: a
        `DistBackendError`, all RuntimeErrors) becomes a `RankFailure` that says what it means."""
        try:
            return collective(*args, **kwargs)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RankFailure(
                f"rank {self.rank} of {self.world}: {name} failed ({first}): another rank died or did not "
                "answer within train.dist_timeout_s"
            ) from e

    def _device(self) -> torch.device:
        if self.active and torch_dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


SINGLE = Dist()


def init_from_env(cuda: bool | None = None, timeout_s: float = 1800.0) -> Dist:
    """Join the torchrun job this process belongs to (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`, and the
    rendezvous torchrun sets up), or `SINGLE` outside torchrun. NCCL when the run is on CUDA (`cuda`;
    default: whether torch sees a GPU), each rank on GPU `LOCAL_RANK`; gloo on CPUs. `timeout_s`
    (`train.dist_timeout_s`): how long a collective waits for a rank that neither answers nor dies."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    if not torch_dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world} but this torch build has no torch.distributed")
    if not torch_dist.is_initialized():
        cuda = torch.cuda.is_available() if cuda is None else cuda
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch_dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        joined = True
    else:  # the caller's own process group (a script that set it up itself): used, never destroyed
        joined = False
    dist = Dist(torch_dist.get_rank(), torch_dist.get_world_size(), joined)
    if dist.main:
        log.info("torch.distributed: %d ranks, backend %s", dist.world, torch_dist.get_backend())
    return dist


def close(dist: Dist, ok: bool = True) -> None:
    """Leave the process group `init_from_env` created, once every rank is done (`ok`). After an error no
    rank waits for the others (a failed rank never arrives; torchrun stops the job)."""
    if dist.joined and ok and torch_dist.is_initialized():
        dist.barrier()
        torch_dist.destroy_process_group()


def fault_point(point: str, step: int) -> None:
    """TEST-ONLY fault injection (tests/train/test_faults.py); unset in real runs, where this is one
    environment lookup. `ROLERL_FAULT=ACTION:rankR:stepN:POINT` makes rank R (`RANK`, 0 outside torchrun)
    act when it reaches POINT of step N: `kill` sends itself SIGKILL, `hang` sleeps (alive, silent). The
    points: `update` (a step's update, before its first collective) and `checkpoint` (mid-write: the
    adapters written, `state.pt` not)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    action, rank, at, where = spec.split(":")
    if (where, at, rank) != (point, f"step{step}", f"rank{os.environ.get('RANK', '0')}"):
        return
    log.warning("%s=%s: %s now", FAULT_ENV, spec, action)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        time.sleep(3600)
    else:
        raise ValueError(f"{FAULT_ENV}={spec!r}: the action is kill or hang")
