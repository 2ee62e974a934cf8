"""Checkpoints of a student: HF model + tokenizer + training state, whole or not at all.

`students/NAME/checkpoint-STEP/` holds `save_pretrained` output (safetensors), the tokenizer,
`training_state.pt` (optimiser, scheduler, RNG states; loadable with `weights_only=True`) and
`checkpoint.json` (step, global data position, fingerprint), written last. On local disk the folder is
filled under a hidden temporary name and renamed into place; on object stores the files are uploaded
and `checkpoint.json` goes last. Either way a checkpoint without `checkpoint.json` is never resumed from.
`students/NAME/final/` holds the final model and tokenizer, what `kdflow chat` loads, and the model card
(kdflow.tasks.student.model_card).

Several ranks (kdflow.tasks.student.distributed): rank 0 alone writes, from full states (gathered first under FSDP),
so a checkpoint is the same whatever the number of ranks and resumes on any number. The optimizer state is always
an unsharded optimizer's `state_dict()`. The RNG states are rank 0's (CPU and its current GPU); on resume
every rank restores them. The student has no dropout and the data order is a function of (seed, epoch,
position), so nothing else in a checkpoint depends on the number of ranks.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from kdflow.schemas.disk_space import DiskFull, free_bytes, is_no_space
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import (CHECKPOINT_MARKER, FINAL_DIR, TRAINING_STATE_FILE, checkpoint_name, checkpoint_step,
                                   temp_prefix)
from kdflow.schemas.owners import owner_tag
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common import faults
from kdflow.tasks.common.model_files import MODEL_CONFIG
from kdflow.tasks.common.scratch import local_copy, scratch_dir
from kdflow.tasks.student.model import StudentError, load_causal_lm


@dataclass(frozen=True)
class TrainingState:
    """Where training stands after `step` optimiser steps."""

    step: int
    position: int  # global data position: training rows consumed by all ranks together
    elapsed_s: float  # training seconds over all runs so far
    fingerprint: str  # what must not change for a resume to continue the same run (kdflow.tasks.student.train)


@dataclass(frozen=True)
class Checkpoint:
    path: str
    state: TrainingState
    model_config_sha256: str | None = None  # its config.json as written (checkpoints of older kdflow: None)


# --- RNG states -------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """RNG states as plain containers and tensors, so `torch.load(weights_only=True)` accepts them."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # The current device's only: another run may have another number of GPUs (or ranks per GPU).
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_device"])


# --- writing folders whole --------------------------------------------------------------------------------


def _remove_tree(run_root: RunRoot, path: str) -> None:
    if run_root.is_local:
        shutil.rmtree(path, ignore_errors=True)
    elif run_root.exists(path):
        run_root.fs.rm(path, recursive=True)


def _seal(folder: str) -> None:
    """Before the rename: files on disk (a crash after it must not find empty files), and the modes of
    any new file (mkdtemp and safetensors create owner-only ones)."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        os.chmod(path, 0o666 & ~umask)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    os.chmod(folder, 0o777 & ~umask)


def _tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state: about what writing it takes on disk."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(value) for value in state)
    return 0


def _full_disk(error: BaseException, folder: str) -> bool:
    """Whether a failed save ran out of space. torch.save reports a full disk as a RuntimeError of its zip
    writer ("unexpected pos ..."), not as an OSError: then the free space left (before cleaning up) decides."""
    if is_no_space(error):
        return True
    free = free_bytes(folder)
    return isinstance(error, Exception) and free is not None and free < (1 << 20)  # safetensors: its own error type


@contextmanager
def _folder_writer(run_root: RunRoot, path: str, *, needed_bytes: int = 0, hint: str = "",
                   site: str = "save", step: int | None = None) -> Iterator[str]:
    """Yields a local folder to fill; afterwards its files appear at `path` (replacing it), CHECKPOINT_MARKER last.
    A full disk raises DiskFull naming `path` and about what the folder needs (`needed_bytes`), the staging
    folder removed. `site` and `step` place the fault-injection point (kdflow.tasks.common.faults)."""
    position = {"stage": "train"} | ({"step": step} if step is not None else {})
    try:
        with _staged(run_root, path, site, position) as staging:
            yield staging
    except DiskFull as error:
        raise error.needing(needed_bytes, hint) from error.__cause__
    except BaseException as error:
        if not is_no_space(error):
            raise
        raise DiskFull(run_root.display(path), needed_bytes or None, None, hint) from error


@contextmanager
def _staged(run_root: RunRoot, path: str, site: str, position: dict[str, Any]) -> Iterator[str]:
    if run_root.is_local:
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        # Named with this process's owner tag: the next run removes it if this one is killed while it fills.
        staging = tempfile.mkdtemp(prefix=f"{temp_prefix(os.path.basename(path))}{owner_tag()}-", dir=parent)
        try:
            yield staging
            _seal(staging)
            faults.maybe_fire(site, run_root, **position)
            if os.path.exists(path):  # same step written again: move the old one aside first
                aside = os.path.join(parent, f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:8]}")
                os.replace(path, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.replace(staging, path)
        except BaseException as error:
            if _full_disk(error, staging):  # measured before the staging folder goes
                shutil.rmtree(staging, ignore_errors=True)
                raise DiskFull(path, None, free_bytes(parent)) from error
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return
    with scratch_dir("kdflow-upload") as staging:
        yield staging
        faults.maybe_fire(site, run_root, **position)
        _remove_tree(run_root, path)
        names = sorted(os.listdir(staging), key=lambda name: name == CHECKPOINT_MARKER)  # the marker last
        run_root.makedirs(path)
        for name in names:
            run_root.fs.put_file(os.path.join(staging, name), f"{path}/{name}")


# --- checkpoints ------------------------------------------------------------------------------------------


def _copy(model_state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """A new dict of the same tensors: the caller's gathered state is saved again (checkpoint, then final/)."""
    return None if model_state is None else dict(model_state)


def save_checkpoint(run_root: RunRoot, student_dir: str, model: nn.Module, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, scheduler: Any, state: TrainingState, *,
                    model_state: dict[str, torch.Tensor] | None = None, optimizer_state: dict[str, Any] | None = None,
                    keep_hint: str = "") -> str:
    """checkpoint-STEP. `model_state`/`optimizer_state`: full states gathered from sharded ranks, written
    instead of `model`'s and `optimizer`'s own. `keep_hint`: added to a full disk's message."""
    path = f"{student_dir}/{checkpoint_name(state.step)}"
    training = {"optimizer": optimizer.state_dict() if optimizer_state is None else optimizer_state,
                "scheduler": scheduler.state_dict(), "rng": capture_rng(), "state": asdict(state)}
    needed = _tensor_bytes(model_state if model_state is not None else model.state_dict()) + _tensor_bytes(training)
    with _folder_writer(run_root, path, needed_bytes=needed, hint=keep_hint, step=state.step) as folder:
        # safetensors (transformers 5); it pops what it wrote
        model.save_pretrained(folder, state_dict=_copy(model_state))
        tokenizer.save_pretrained(folder)
        torch.save(training, os.path.join(folder, TRAINING_STATE_FILE))
        written = _sha256(os.path.join(folder, MODEL_CONFIG))
        with open(os.path.join(folder, CHECKPOINT_MARKER), "w", encoding="utf-8") as handle:
            json.dump(asdict(state) | {"created_at": time.time(), "model_config_sha256": written}, handle, indent=1)
    return path


def _read_marker(run_root: RunRoot, path: str, step: int) -> Checkpoint | None:
    try:
        data = json.loads(run_root.read_bytes(f"{path}/{CHECKPOINT_MARKER}"))
        state = TrainingState(step=int(data["step"]), position=int(data["position"]),
                              elapsed_s=float(data["elapsed_s"]), fingerprint=str(data["fingerprint"]))
        recorded = data.get("model_config_sha256")
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Checkpoint(path, state, recorded if isinstance(recorded, str) else None) if state.step == step else None


def list_checkpoints(run_root: RunRoot, student_dir: str) -> list[Checkpoint]:
    """Complete checkpoints (their marker is there and names their step), oldest first."""
    found = []
    for name in run_root.listdir(student_dir):
        step = checkpoint_step(name)
        if step is not None:
            checkpoint = _read_marker(run_root, f"{student_dir}/{name}", step)
            if checkpoint is not None:
                found.append(checkpoint)
    return sorted(found, key=lambda checkpoint: checkpoint.state.step)


def latest_checkpoint(run_root: RunRoot, student_dir: str) -> Checkpoint | None:
    complete = list_checkpoints(run_root, student_dir)
    return complete[-1] if complete else None


def prune_checkpoints(run_root: RunRoot, student_dir: str, keep: int, damaged: Sequence[str] = ()) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints, and leftovers of interrupted writes. `damaged`: those
    a resume passed over as not loading; each goes once a newer checkpoint is written, and counts for none of the
    `keep` (else it would outlive the good one before it)."""
    every = list_checkpoints(run_root, student_dir)
    checkpoints = [checkpoint for checkpoint in every if checkpoint.path not in set(damaged)]
    newest = checkpoints[-1].state.step if checkpoints else -1
    gone = {c.path for c in every if c.path in set(damaged) and c.state.step < newest}
    removed = [checkpoint.path for checkpoint in checkpoints[:-keep]] + sorted(gone)
    complete = {checkpoint.path for checkpoint in every}
    for name in run_root.listdir(student_dir):
        path = f"{student_dir}/{name}"
        interrupted_local = name.startswith(".") and (".tmp-" in name or ".old-" in name)
        interrupted_upload = checkpoint_step(name) is not None and path not in complete
        if interrupted_local or interrupted_upload:
            removed.append(path)
    for path in removed:
        _remove_tree(run_root, path)
    return removed


def load_training_state(run_root: RunRoot, checkpoint: Checkpoint, optimizer: torch.optim.Optimizer, scheduler: Any, *,
                        load_optimizer: Callable[[dict[str, Any]], None] | None = None) -> TrainingState:
    """Restore optimiser, scheduler and RNG states in place; -> the training state. `load_optimizer` takes
    the full optimizer state instead of `optimizer.load_state_dict` (a sharded optimizer keeps its shard)."""
    path = f"{checkpoint.path}/{TRAINING_STATE_FILE}"
    try:
        training = torch.load(io.BytesIO(run_root.read_bytes(path)), map_location="cpu", weights_only=True)
    except (FileNotFoundError, RuntimeError, ValueError, EOFError) as error:
        raise StoreError(f"{run_root.display(path)}: unreadable training state: {str(error).splitlines()[0]}") from None
    (load_optimizer or optimizer.load_state_dict)(training["optimizer"])
    scheduler.load_state_dict(training["scheduler"])
    # student.steps may change between runs, and the schedule with it: the step resumed takes the rate of today's
    # schedule, not the last one the checkpoint's run applied (the same value where the steps did not change)
    rates = [base * factor(scheduler.last_epoch) for factor, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates
    restore_rng(training["rng"])
    return TrainingState(**training["state"])


def load_checkpoint_model(run_root: RunRoot, checkpoint_path: str, device: torch.device | str,
                          model_config_sha256: str | None = None) -> nn.Module:
    """The checkpoint's model; a config.json other than the one written with it (`model_config_sha256`, from its
    marker) is a StudentError: edited by hand, it would build another model around the same weights."""
    shown = run_root.display(checkpoint_path)
    with local_copy(run_root, checkpoint_path) as folder:
        if model_config_sha256 is not None and _sha256(os.path.join(folder, MODEL_CONFIG)) != model_config_sha256:
            raise StudentError(f"{shown}/{MODEL_CONFIG} is not the one written with the checkpoint (edited?)")
        model = load_causal_lm(folder, what="checkpoint", dtype=torch.float32, shown=shown)
    return model.to(device)


def _sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except FileNotFoundError:
        return None


def newest_loadable(run_root: RunRoot, student_dir: str, device: torch.device | str,
                    check: Callable[[Checkpoint], None], warn: Callable[[str], None]
                    ) -> tuple[Checkpoint | None, nn.Module | None, list[str]]:
    """The newest complete checkpoint whose model loads, its model (None, None: no checkpoint), and the newer ones
    passed over. `check` refuses one that may not be resumed (other settings). One whose files are damaged (a disk
    error, a cut copy) is passed over for the one before it, with `warn`: its step is trained again, the same as
    before (prune_checkpoints removes it once a newer one is written); none loading is an error naming the newest."""
    checkpoints = list_checkpoints(run_root, student_dir)
    first_problem, passed_over = None, []
    for checkpoint in reversed(checkpoints):
        check(checkpoint)
        try:
            model = load_checkpoint_model(run_root, checkpoint.path, device, checkpoint.model_config_sha256)
            return checkpoint, model, passed_over
        except StudentError as error:
            first_problem = first_problem or str(error)
            passed_over.append(checkpoint.path)
            warn(f"{error}; resuming from the checkpoint before it, if one loads (this one is removed once a newer "
                 "one is written)")
    if first_problem is not None:
        raise StudentError(f"{first_problem}, nor does any older checkpoint: delete "
                           f"{run_root.display(student_dir)}'s checkpoint-* folders to start this student again")
    return None, None, []


def save_final(run_root: RunRoot, student_dir: str, model: nn.Module, tokenizer: Any, *,
               model_state: dict[str, torch.Tensor] | None = None, files: dict[str, bytes] | None = None) -> str:
    """students/NAME/final/: the model and tokenizer that `kdflow chat` loads (`model_state`: see save_checkpoint),
    with `files` (name -> bytes: the model card and its curve) beside them."""
    path = f"{student_dir}/{FINAL_DIR}"
    needed = _tensor_bytes(model_state if model_state is not None else model.state_dict())
    with _folder_writer(run_root, path, needed_bytes=needed, site="final") as folder:
        model.save_pretrained(folder, state_dict=_copy(model_state))  # it pops the tensors it wrote from the dict
        tokenizer.save_pretrained(folder)
        for name, data in (files or {}).items():
            with open(os.path.join(folder, name), "wb") as handle:
                handle.write(data)
    return path

