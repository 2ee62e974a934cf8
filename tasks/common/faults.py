"""Fault injection for every stage: off unless the environment variable KDFLOW_FAULT asks for it.

Syntax: one or more faults separated by ';', each `KIND@KEY=VALUE,KEY=VALUE` (the `@...` part optional):

    KDFLOW_FAULT=cuda_error@shard=1,micro_batch=2
    KDFLOW_FAULT="kill@shard=1,micro_batch=1;enospc@shard=2"
    KDFLOW_FAULT="pause@at=commit,stage=tokenise,shard=2;pause@at=save,step=4"

Kinds:
- `cuda_error`: raise a RuntimeError with a real-looking "CUDA driver error: device not ready" message
  just after the micro-batch's forward pass (the worker exits with a retryable code).
- `kill`: SIGKILL this process at the micro-batch, after the earlier micro-batches of the shard were
  written to its temporary file (no Python cleanup runs: the temp file and the lease stay behind).
- `enospc`: raise OSError(ENOSPC) while writing that micro-batch's arrays into the shard file.
- `cuda_oom`: raise a RuntimeError with a real-looking "CUDA out of memory" message after the forward.
- `pause`: stop where it fires (sleep) until killed from outside: how tests kill a whole run at a chosen
  moment, without a race against it (`at=` names the site; the marker below says it has arrived).
Keys: `shard` (shard or part id), `micro_batch` (index within a top-K shard; train: of the step's micro-batch
pieces), `step` (optimiser step), `micro_batch_size` (the rows of a micro-batch: the teacher pass's, `kdflow tune
precompute`'s candidates', a training step's pieces'), `stage` (materialise, tokenise, precompute, train, import)
and `at`, the site: `load` (the teacher pass, its weights just loaded), `micro_batch` (teacher, after the forward;
train, after a piece's forward), `write` (teacher, writing a micro-batch), `commit` (materialise and tokenise: the
data file is written, its commit record not yet; import: a staged shard written, its progress record not yet),
`step` (train: after the step, before its checkpoint), `save` (train: the checkpoint folder filled, not yet renamed
into place), `final` (the final model likewise), `eval` (train: after an evaluation batch's forward). `at`
defaults to `micro_batch` for cuda_error, cuda_oom and kill and to `write` for enospc. A key left out matches any
value, so `cuda_error@shard=1` fires at the first micro-batch of shard 1 and `cuda_oom@micro_batch_size=28` in the
pass, the tuning candidate or training, at 28 rows (add `stage=` to choose).

Each fault fires once per run root: before firing it writes the marker `RUN_ROOT/_faults/NAME.fired`
(JSON: pid, host, where), and a marker that exists switches the fault off, so the retry in a new process
proceeds. NAME is the kind and its keys, e.g. `cuda_error.shard-1.micro_batch-2`.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from functools import lru_cache

from kdflow.schemas.errors import ConfigError
from kdflow.schemas.layout import FAULTS_DIR
from kdflow.schemas.storage import RunRoot

ENV_VAR = "KDFLOW_FAULT"
# kind -> default site
_KINDS = {"cuda_error": "micro_batch", "cuda_oom": "micro_batch", "kill": "micro_batch", "enospc": "write",
          "pause": None}
_INT_KEYS = ("shard", "micro_batch", "micro_batch_size", "step")
_WORD_KEYS = {"stage": ("materialise", "tokenise", "precompute", "train", "import"),
              "at": ("load", "micro_batch", "write", "commit", "step", "save", "final", "eval")}
PAUSE_LIMIT_S = 600.0  # a paused process nobody kills ends itself (SIGKILL) after this long


@dataclass(frozen=True)
class Fault:
    kind: str
    where: tuple[tuple[str, int | str], ...]  # (key, value) pairs that must all match; `at` is the site

    @property
    def name(self) -> str:
        return self.kind + "".join(f".{key}-{value}" for key, value in self.where)

    @property
    def site(self) -> str | None:
        return next((value for key, value in self.where if key == "at"), _KINDS[self.kind])

    def matches(self, site: str, position: dict[str, int | str]) -> bool:
        return self.site == site and all(position.get(key) == value for key, value in self.where if key != "at")


def _parse_one(text: str) -> Fault:
    kind, _, params = text.strip().partition("@")
    if kind not in _KINDS:
        raise ConfigError(f"{ENV_VAR}: unknown fault kind {kind!r} (known: {', '.join(_KINDS)})")
    where: list[tuple[str, int | str]] = []
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if sep and key in _INT_KEYS and value.isdigit():
            where.append((key, int(value)))
        elif sep and value in _WORD_KEYS.get(key, ()):
            where.append((key, value))
        else:
            raise ConfigError(f"{ENV_VAR}: bad condition {item!r} in {text!r} (expected shard=N, micro_batch=N, "
                              f"micro_batch_size=N, step=N, stage=NAME or at=SITE)")
    fault = Fault(kind, tuple(sorted(where)))
    if fault.site is None:
        raise ConfigError(f"{ENV_VAR}: {text!r} needs at=SITE (one of {', '.join(_WORD_KEYS['at'])})")
    return fault


@lru_cache(maxsize=8)
def parse_faults(spec: str) -> tuple[Fault, ...]:
    """KDFLOW_FAULT's value -> the faults it asks for (empty when unset)."""
    return tuple(_parse_one(part) for part in spec.split(";") if part.strip())


def active_faults() -> tuple[Fault, ...]:
    return parse_faults(os.environ.get(ENV_VAR, ""))


def _claim(run_root: RunRoot, fault: Fault, position: dict[str, int | str]) -> bool:
    """Record the firing; False if this run root already saw this fault fire."""
    marker = f"{run_root.root}/{FAULTS_DIR}/{fault.name}.fired"  # the name is made of safe characters only
    if run_root.exists(marker):
        return False
    record = {"fault": fault.name, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), **position}
    run_root.write_bytes_atomic(marker, json.dumps(record).encode())
    return True


def maybe_fire(site: str, run_root: RunRoot, **position: int | str) -> None:
    """Fire the first fault that matches this site and position and has not fired in this run root yet."""
    faults = active_faults()
    if not faults:
        return
    for fault in faults:
        if fault.matches(site, position) and _claim(run_root, fault, position):
            _fire(fault, position)


def _fire(fault: Fault, position: dict[str, int | str]) -> None:
    where = ", ".join(f"{key} {value}" for key, value in position.items())
    if fault.kind == "cuda_error":
        raise RuntimeError(
            "CUDA driver error: device not ready\n"
            f"(injected by {ENV_VAR}={fault.name} at {where})"
        )
    if fault.kind == "cuda_oom":
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n"
                           f"(injected by {ENV_VAR}={fault.name} at {where})")
    if fault.kind == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV_VAR} at {where})")
    sys.stdout.flush()
    sys.stderr.flush()
    if fault.kind == "pause":
        time.sleep(PAUSE_LIMIT_S)
    os.kill(os.getpid(), signal.SIGKILL)
