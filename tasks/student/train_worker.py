"""One rank of a multi-process student training run: what torchrun starts on every rank.

    python -m torch.distributed.run --nproc_per_node N --nnodes M --node_rank R --rdzv_backend c10d \\
        --rdzv_endpoint HOST:PORT --rdzv_id ID -m kdflow.tasks.student.train_worker --config RESOLVED.yaml \\
        [--stop-at-step S]

Each rank joins the process group (backend from `student.distributed.backend`), then calls
`kdflow.tasks.student.train.train(run_root, settings, rank=RANK, world_size=WORLD_SIZE)`, the run root and
the training view (`training_settings`) read from the config file. `--stop-at-step S` ends the run
after step S with a checkpoint (a run handed to another job, or to another number of ranks, resumes from
it). Lines for the flow on stdout follow the worker protocol (`kdflow.schemas.protocol`): the result from
rank 0, an error line from a rank that failed (exit code 2 is a user error). Rank 0 logs at INFO, the
others at WARNING, each line tagged with its rank.

`python -m kdflow.tasks.student.train_worker --exec-torchrun TORCHRUN_ARGS...` is how the flow starts torchrun:
the process asks to die with its parent (the flow) and then becomes torchrun, so killing the flow takes the
whole job down; every rank in turn dies with torchrun.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from kdflow.schemas.protocol import PARENT_PID_ENV, PROGRESS_PREFIX, emit
from kdflow.tasks.common.worker import configure_logging, run_worker, run_worker_main, set_parent_death_signal

MODULE = "kdflow.tasks.student.train_worker"
EXEC_TORCHRUN = "--exec-torchrun"


def exec_torchrun(torchrun_args: list[str]) -> NoReturn:
    """Become `python -m torch.distributed.run ARGS` with the parent-death signal set (it survives exec)."""
    set_parent_death_signal()
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the ranks' parent: this pid, which exec keeps
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *torchrun_args])


def _stop_at(step: int | None) -> Callable[[dict[str, Any]], bool] | None:
    if step is None:
        return None
    return lambda record: record["step"] >= step


def run(argv: list[str] | None = None) -> int:
    """Everything one rank does; -> its exit code (never raises)."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the resolved config (YAML)")
    parser.add_argument("--stop-at-step", type=int, default=None, help="stop after this step, with a checkpoint")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    configure_logging(logging.INFO if rank == "0" else logging.WARNING, tag=f"rank {rank} ")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def body() -> dict[str, Any] | None:
        from transformers.utils import logging as transformers_logging

        from kdflow.schemas.config_io import load_config
        from kdflow.schemas.stage_settings import open_run_root, training_settings
        from kdflow.tasks.student.distributed import barrier, init_process_group, rank_device, shutdown, torchrun_rank
        from kdflow.tasks.student.train import train

        transformers_logging.disable_progress_bar()
        config = load_config(args.config)
        ranks = torchrun_rank()
        device = rank_device(config.student.device, ranks.local_rank, ranks.world_size)
        backend = init_process_group(config.student.distributed, ranks, device)
        logging.getLogger("kdflow").info("rank %d of %d on %s (%s)", ranks.rank, ranks.world_size, device, backend)
        summary = train(open_run_root(config), training_settings(config), rank=ranks.rank, world_size=ranks.world_size,
                        on_step=_stop_at(args.stop_at_step),
                        on_event=lambda event: emit(PROGRESS_PREFIX, event))  # rank 0's steps and evaluations
        barrier()  # rank 0 has written everything when any rank reports success
        shutdown()
        return summary | {"world_size": ranks.world_size, "backend": backend} if ranks.rank == 0 else None

    return run_worker(body, label=f"kdflow train worker rank {rank}", error_fields={"rank": int(rank)})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == EXEC_TORCHRUN:
        exec_torchrun(sys.argv[2:])
    run_worker_main(run)  # torchrun is the parent: a killed launcher leaves no rank behind
