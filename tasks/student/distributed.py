"""Data-parallel student training across the processes torchrun starts: process group, wrapping, collectives,
and the full state dicts a checkpoint holds. No Prefect here.

Sharding (`student.distributed.sharding`):
- fsdp (auto on CUDA): FSDP2 `fully_shard`. Every decoder layer is one unit and the module that runs the
  student AND its loss (kdflow.tasks.student.train.DistillLoss) is the root unit, holding the embeddings, the
  final norm and lm_head. Parameters, gradients and AdamW state live as 1/W shards; a unit's weights are
  all-gathered for its forward and backward only. Because the loss runs inside the root's forward, the
  `lm_head.weight` it reads is the gathered full weight, never a shard, and its
  gradient is reduce-scattered like any other.
- ddp (auto on CPU, the gloo backend): the model is replicated and gradients are all-reduced.
Both average gradients over ranks; the loss is normalised by the global count of positions and multiplied by
the world size before backward (kdflow.tasks.student.train), so the result is the gradient of the one global batch.

On disk a checkpoint looks the same whoever wrote it, so it resumes on any number of ranks with either
strategy: the model is a normal HF folder and the optimizer state is what `state_dict()` of an unsharded
AdamW returns (keyed by parameter index). Under fsdp both are gathered to rank 0 on the CPU before saving
(`torch.distributed.checkpoint.state_dict`, full_state_dict) and on resume every rank reads the full file and
keeps its own shard; under ddp rank 0's own copies are already full.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kdflow.schemas.config import DistributedConfig
from kdflow.schemas.errors import ConfigError
from kdflow.tasks.common.models import no_cuda_error

# Every rank starts by this namespaced module name (`python -m ...`); a name, not an import: the worker imports this.
TRAIN_WORKER_MODULE = "kdflow.tasks.student.train_worker"
NO_SHARDING = "none"  # one process: the module is used as it is
COLLECTIVE_TIMEOUT_MIN = 30


@dataclass(frozen=True)
class RankInfo:
    rank: int  # global rank: 0 .. world_size - 1
    world_size: int
    local_rank: int  # rank on this node: picks the GPU


def torchrun_rank() -> RankInfo:
    """This process's place in the job, from the variables torchrun sets (one process when they are absent)."""
    try:
        return RankInfo(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                        int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun)") from None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_device(name: str, local_rank: int, world_size: int) -> torch.device:
    """`student.device` for this rank: with several ranks every CUDA rank takes GPU `local_rank`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise no_cuda_error("student.device", name, 0)
    if device.type == "cuda" and (world_size > 1 or device.index is None):
        index = local_rank if world_size > 1 else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"rank with LOCAL_RANK {local_rank} needs GPU {index}, this node has "
                              f"{torch.cuda.device_count()}: lower student.distributed.nproc_per_node")
        device = torch.device("cuda", index)
    return device


def choose_backend(requested: str, device: torch.device) -> str:
    """auto: nccl for CUDA ranks, gloo for CPU ones."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError(f"student.distributed.backend=nccl needs CUDA devices, the student trains on {device}: "
                          "use backend gloo (or auto)")
    return requested


def choose_sharding(requested: str, device: torch.device, world_size: int) -> str:
    """fsdp, ddp, or NO_SHARDING for one process; auto: fsdp on CUDA, ddp elsewhere."""
    if world_size == 1:
        return NO_SHARDING
    if requested == "auto":
        return "fsdp" if device.type == "cuda" else "ddp"
    return requested


def init_process_group(distributed: DistributedConfig, ranks: RankInfo, device: torch.device) -> str:
    """Join the job torchrun started (MASTER_ADDR/PORT come from its rendezvous); -> the backend."""
    backend = choose_backend(distributed.backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    # Generous: the other ranks wait in their next collective while rank 0 writes a checkpoint, maybe to
    # remote storage. A rank that dies is noticed by torchrun, which stops the others, long before this.
    dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world_size,
                            timeout=datetime.timedelta(minutes=COLLECTIVE_TIMEOUT_MIN), **kwargs)
    return backend


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --- wrapping ---------------------------------------------------------------------------------------------


def sharded_blocks(student: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards as separate units: the classes HF names in `_no_split_modules` (the decoder
    layers), so at most one layer's full weights exist at a time besides the root's."""
    names = set(getattr(student, "_no_split_modules", None) or ())
    return [module for module in student.modules() if type(module).__name__ in names]


def wrap_for_training(module: nn.Module, student: nn.Module, sharding: str, device: torch.device) -> nn.Module:
    """`module` (the student plus its loss, `student` inside it) ready for data-parallel training.

    Build the optimizer AFTER this: fully_shard replaces the parameters by sharded ones."""
    if sharding == NO_SHARDING:
        return module
    if not is_distributed():
        raise ConfigError(f"{sharding} training needs the process group of a torchrun job: start it through "
                          "the train-student flow or `torchrun ... -m kdflow.tasks.student.train_worker`")
    if sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    if sharding == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in sharded_blocks(student):
            fully_shard(block)
        return fully_shard(module)
    raise ConfigError(f"unknown sharding {sharding!r} (fsdp, ddp)")


@contextlib.contextmanager
def gradient_sync(wrapped: nn.Module, enabled: bool) -> Iterator[None]:
    """DDP all-reduces gradients on every backward unless told not to: skip all but the last micro-batch's.
    FSDP reduce-scatters every micro-batch so that only gradient shards accumulate (less memory)."""
    no_sync = getattr(wrapped, "no_sync", None)
    with (no_sync() if no_sync is not None and not enabled else contextlib.nullcontext()):
        yield


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Clip to the global gradient norm; with sharded (DTensor) gradients the norm is reduced over ranks."""
    total = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    full_tensor = getattr(total, "full_tensor", None)
    return float(full_tensor() if full_tensor is not None else total)


# --- collectives ------------------------------------------------------------------------------------------


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums over ranks (float64); the values themselves in one process."""
    if not is_distributed():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is True on one: decisions that lead to collectives must agree."""
    return all_reduce_sum([float(flag)], device)[0] > 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


# --- full state dicts -------------------------------------------------------------------------------------


def full_model_state(student: nn.Module, sharding: str) -> dict[str, torch.Tensor] | None:
    """The student's full state dict (HF names) on rank 0's CPU under fsdp (a collective: every rank calls
    it; the others get {}); None when the student's own parameters are already full (ddp, one process)."""
    if sharding != "fsdp":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Each name was gathered into its own tensor; tied weights (lm_head = embeddings) must be one tensor again,
    # or save_pretrained writes both, unlike a single process.
    first_name: dict[int, str] = {}
    for name, param in student.named_parameters(remove_duplicate=False):
        owner = first_name.setdefault(id(param), name)
        if owner != name and owner in state and name in state:
            state[name] = state[owner]
    return state


def _index_order(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order `optimizer.state_dict()` numbers parameters (group by group)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    named = get_optimizer_state_dict(module, optimizer)  # local shards, names only are used
    return [name for group in named["param_groups"] for name in group["params"]]


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, sharding: str) -> dict[str, Any] | None:
    """Under fsdp: the optimizer state gathered to rank 0's CPU and keyed by parameter index like an unsharded
    optimizer's `state_dict()` (a collective; the other ranks get {}). None otherwise: use `state_dict()`."""
    if sharding != "fsdp":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    named = get_optimizer_state_dict(module, optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not named:
        return {}
    index = {name: i for i, name in enumerate(name for group in named["param_groups"] for name in group["params"])}
    return {"state": {index[name]: value for name, value in named["state"].items()},
            "param_groups": [group | {"params": [index[name] for name in group["params"]]}
                             for group in named["param_groups"]]}


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                              sharding: str) -> None:
    """Load an index-keyed full optimizer state (any writer) into this rank's optimizer, keeping its shard."""
    if sharding != "fsdp":
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _index_order(module, optimizer)
    if len(names) != sum(len(group["params"]) for group in state["param_groups"]):
        raise ValueError(f"the saved optimizer state has {sum(len(g['params']) for g in state['param_groups'])} "
                         f"parameters, the student has {len(names)}")
    named = {"state": {names[i]: value for i, value in state["state"].items()},
             "param_groups": [group | {"params": [names[i] for i in group["params"]]}
                              for group in state["param_groups"]]}
    set_optimizer_state_dict(module, optimizer, named, options=StateDictOptions(full_state_dict=True))


# --- the launcher -----------------------------------------------------------------------------------------


def torchrun_arguments(distributed: DistributedConfig, config_path: str, *worker_args: str,
                       log_dir: str | None = None) -> list[str]:
    """torchrun's arguments for this node: the rendezvous from the config, then every rank runs
    `python -m kdflow.tasks.student.train_worker --config FILE`. `log_dir`: where torchrun keeps its per-rank
    folders (without it, torchrun makes a `torchelastic_*` folder in the system's temp folder and leaves it)."""
    return [*(["--log-dir", log_dir] if log_dir else []),
            "--nproc_per_node", str(distributed.nproc_per_node), "--nnodes", str(distributed.nnodes),
            "--node_rank", str(distributed.node_rank), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", distributed.rdzv_endpoint, "--rdzv_id", distributed.rdzv_id,
            "-m", TRAIN_WORKER_MODULE, "--config", config_path, *worker_args]


def torchrun_command(distributed: DistributedConfig, config_path: str, *worker_args: str,
                     log_dir: str | None = None) -> list[str]:
    """The command a user types on each node (`python -m torch.distributed.run` is `torchrun`)."""
    return [sys.executable, "-m", "torch.distributed.run",
            *torchrun_arguments(distributed, config_path, *worker_args, log_dir=log_dir)]


def world_size_of(distributed: DistributedConfig) -> int:
    return distributed.nproc_per_node * distributed.nnodes
