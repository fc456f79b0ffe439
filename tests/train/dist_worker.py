"""One rank of a data-parallel test run (tests/train/test_distributed.py): `python -m torch.distributed.run
--nproc_per_node N tests/train/dist_worker.py RUN_DIR [--resume] KEY=VALUE ...` trains the echo task on the
tiny model with the settings of `test_distributed.run_config`; torchrun's environment makes it a rank."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `tests.*`

from rolerl.train.rl import train  # noqa: E402
from rolerl.workflows import SingleTurn  # noqa: E402
from tests.train.test_distributed import run_config  # noqa: E402
from tests.workflows.test_single_turn import EchoTask  # noqa: E402


def main(argv: list[str]) -> None:
    run_dir, rest = argv[0], argv[1:]
    resume = "--resume" in rest
    cfg = run_config(run_dir, *[a for a in rest if a != "--resume"])
    task = EchoTask()
    train(cfg, task=task, workflow=SingleTurn(task), resume=resume)


if __name__ == "__main__":
    main(sys.argv[1:])
