"""The run root's layout: every folder and file name a stage writes and another stage reads, in one place.

```
RUN_ROOT/
  corpus/          part-NNNNN.parquet + part-NNNNN.commit.json, _complete.json, config.yaml, _sources.json
  tokens/          shard-NNNNN.arrow + shard-NNNNN.commit.json, _complete.json, config.yaml
  topk/TAG/        shard-NNNNN.arrow + .commit.json (+ .lease while computed), _complete.json, _store.json, config.yaml,
                   _renumbering.bin (v2 with renumbering: unigram)
  students/NAME/   checkpoint-STEP/ (checkpoint.json last), final/, metrics.jsonl, eval.jsonl, config.yaml,
                   training_curve.png (tensorboard/), trainer.lease (while trained)
  _faults/         markers of injected faults that fired (KDFLOW_FAULT)
  _imports/KEY/    `kdflow store import`'s staged packed shards while it checks its source (removed when done)
```
Temporary files are `.NAME.tmp-PID-HOSTTAG-TOKEN` beside NAME (`temp_name`); the next run of the stage
that writes a folder removes those whose writer is gone. Names only (no I/O): `kdflow.schemas.commits` and
`kdflow.schemas.storage` do the reading and writing.
"""

from __future__ import annotations

import re
from typing import Literal

Stage = Literal["corpus", "tokens", "topk"]

CORPUS_DIR, TOKENS_DIR, TOPK_DIR, STUDENTS_DIR, FAULTS_DIR = "corpus", "tokens", "topk", "students", "_faults"
IMPORTS_DIR = "_imports"  # an import's staged work: no reader looks there, and a killed import resumes from it

# In every store folder.
COMMIT_SUFFIX = ".commit.json"
COMPLETE_FILE = "_complete.json"  # written once a stage has committed every shard it will ever have
CONFIG_FILE = "config.yaml"  # the resolved config that made the folder's files
STORE_FILE = "_store.json"  # topk/TAG only: what made the store (teacher, K, token store), for readers
LEASE_SUFFIX = ".lease"  # topk/TAG only: a process's claim on a shard it is computing
TRAINER_LEASE = "trainer.lease"  # students/NAME: the claim of the one process (rank 0) training this student
RENUMBERING_FILE = "_renumbering.bin"  # topk/TAG, v2: the frequency renumbering of ids (each shard also carries it)
SOURCES_FILE = "_sources.json"  # corpus/ only: the dataset's files as materialise found them (not for a hub dataset)

# In students/NAME.
CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_MARKER = "checkpoint.json"  # written last: a checkpoint without it is never resumed from
TRAINING_STATE_FILE = "training_state.pt"
FINAL_DIR = "final"  # the final model and tokenizer: what `kdflow chat` loads
METRICS_FILE, EVAL_FILE = "metrics.jsonl", "eval.jsonl"
TRAINING_CURVE_FILE = "training_curve.png"  # the loss curve, redrawn after every evaluation
TENSORBOARD_DIR = "tensorboard"  # event files, with student.tensorboard

_DATA_NAMES: dict[str, tuple[str, str]] = {"corpus": ("part-", ".parquet"), "tokens": ("shard-", ".arrow"),
                                           "topk": ("shard-", ".arrow")}
COMMIT_PATTERN = re.compile(r"^(?:part|shard)-(\d{5,})\.commit\.json$")
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")


def data_file_name(stage: Stage, shard_id: int) -> str:
    prefix, suffix = _DATA_NAMES[stage]
    return f"{prefix}{shard_id:05d}{suffix}"


def commit_file_name(stage: Stage, shard_id: int) -> str:
    prefix, _ = _DATA_NAMES[stage]
    return f"{prefix}{shard_id:05d}{COMMIT_SUFFIX}"


def lease_file_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}{LEASE_SUFFIX}"


def commit_shard_id(name: str) -> int | None:
    """The shard id of a commit record's file name, None for any other name."""
    match = COMMIT_PATTERN.match(name)
    return int(match.group(1)) if match else None


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


def checkpoint_step(name: str) -> int | None:
    """The step of a `checkpoint-STEP` folder name, None for any other name."""
    match = CHECKPOINT_PATTERN.match(name)
    return int(match.group(1)) if match else None


def temp_prefix(name: str) -> str:
    """The prefix of the temporary files `RunRoot.atomic_writer` fills before they become `name`."""
    return f".{name}.tmp-"


def temp_name(name: str, owner: str, token: str) -> str:
    """`.NAME.tmp-OWNER-TOKEN`: a temporary file (or folder) that becomes `name`; OWNER is the writer's
    `PID-HOSTTAG` (kdflow.schemas.owners), so that a leftover of a dead writer can be told from a live one."""
    return f"{temp_prefix(name)}{owner}-{token}"


def temp_owner(name: str) -> str | None:
    """The text after `.tmp-` of a temporary name (it starts with the owner tag), None for other names."""
    if not name.startswith(".") or ".tmp-" not in name:
        return None
    return name.split(".tmp-", 1)[1]


def is_store_name(name: str) -> bool:
    """A folder under topk/ or students/ that is a store or a student, not hidden or bookkeeping."""
    return not name.startswith((".", "_"))
