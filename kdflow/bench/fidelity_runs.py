"""The parts of `kdflow bench fidelity` that the pipeline does not have: the teacher (loaded only when a result
is missing) and its hidden states for the benchmark's rows, online full-vocabulary KD with the teacher run
alongside the student, and the dense held-out evaluation (next-token CE and full-vocabulary KL to the teacher).

Online KD runs the teacher body once per row (`TeacherStates`), keeps its final hidden states, and applies
the teacher's lm_head live at every step: the teacher's full distribution exactly as a live forward gives
it (the teacher is deterministic), without paying its 30 layers again for every epoch and every seed. The
student side is the training loop's own: `StudentRun` (same initial weights, data order, AdamW and
schedule as `train`), `clip_grad_norm`, one optimiser step per global batch. `train_with_curve` runs either
kind of student and evaluates it at several steps of the one run.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import Tensor, nn

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.stage_settings import open_run_root, training_settings
from kdflow.tasks.common.models import body_hidden_states, model_body, output_layer
from kdflow.tasks.student.data import DistillData, ShardPair, open_distill_data
from kdflow.tasks.student.distributed import clip_grad_norm
from kdflow.tasks.student.steps import next_token_labels
from kdflow.tasks.student.train import StudentRun


class TeacherStates:
    """Final hidden states of the teacher (float32) for rows of the benchmark's token shards, computed once."""

    def __init__(self, teacher: nn.Module, batch_rows: int = 8) -> None:
        self.teacher, self.batch_rows = teacher, batch_rows
        self.head = output_layer(teacher)
        self.states: dict[tuple[int, int], Tensor] = {}  # (shard id, row) -> (T, D)
        self.seconds = 0.0

    def fill(self, data: DistillData, rows: list[tuple[ShardPair, int]]) -> None:
        todo = [(pair, row) for pair, row in rows if (pair.shard_id, row) not in self.states]
        started = time.perf_counter()
        for start in range(0, len(todo), self.batch_rows):
            part = todo[start:start + self.batch_rows]
            hidden = body_hidden_states(self.teacher, data.load(part).input_ids)  # (n, T, D)
            for (pair, row), states in zip(part, hidden, strict=True):
                self.states[pair.shard_id, row] = states.clone()
        self.seconds += time.perf_counter() - started

    def logits(self, rows: list[tuple[ShardPair, int]], start: int, stop: int) -> Tensor:
        """Teacher logits (stop - start, V) float32 for flattened positions start..stop of `rows`."""
        hidden = torch.cat([self.states[pair.shard_id, row] for pair, row in rows])  # (n * T, D)
        with torch.inference_mode():
            return self.head(hidden[start:stop]).float()


class LazyTeacher:
    """The teacher, its hidden states for the benchmark's rows and the held-out rows, loaded on first use (a
    rerun whose results are all stored loads nothing)."""

    def __init__(self, config: Any) -> None:
        self.config, self._states, self._heldout = config, None, None

    def states(self) -> Any:
        if self._states is None:
            from kdflow.tasks.common.teacher_loading import load_teacher  # at call time: tests replace it

            self._states = TeacherStates(load_teacher(self.config.teacher).eval())
        return self._states

    def heldout(self) -> Any:
        """Every held-out row (not only `student.eval_sequences` of them)."""
        if self._heldout is None:
            from kdflow.tasks.common.tokenizer import load_tokenizer

            student = self.config.student.model_copy(update={"eval_sequences": 10**9})
            every_row = self.config.model_copy(update={"student": student})
            self._heldout = open_distill_data(open_run_root(every_row), training_settings(every_row),
                                              load_tokenizer(every_row.teacher, every_row.tokenizer))
        return self._heldout


def _chunked_full_kl(hidden: Tensor, weight: Tensor, teacher: TeacherStates, rows: list[tuple[ShardPair, int]],
                     chunk: int, count: int) -> float:
    """sum KL(p_teacher || q_student) / count over every position of `rows`, backpropagated chunk by chunk into
    hidden (N, D) (a leaf) and weight: logits exist for `chunk` positions at a time."""
    total = 0.0
    for start in range(0, hidden.shape[0], chunk):
        stop = min(start + chunk, hidden.shape[0])
        log_p = torch.log_softmax(teacher.logits(rows, start, stop), dim=-1)  # (c, V), no grad
        log_q = torch.log_softmax(hidden[start:stop] @ weight.t(), dim=-1)  # (c, V)
        loss = (log_p.exp() * (log_p - log_q)).sum() / count
        loss.backward()
        total += loss.item()
    return total


def _online_step(run: StudentRun, teacher: TeacherStates, position: int, chunk: int) -> float:
    """One optimiser step of online full-vocabulary KD on the global batch at `position`; -> its loss."""
    student = run.student
    model, data = run.model, run.data
    body, head = model_body(model), output_layer(model)
    rows = data.locate(data.rank_rows(position, student.batch_size, 0, 1))
    teacher.fill(data, rows)
    input_ids = data.load(rows).input_ids  # (n, T)
    hidden = body(input_ids=input_ids, use_cache=False).last_hidden_state.flatten(0, 1)  # (n * T, D)
    leaf = hidden.detach().requires_grad_()
    loss = _chunked_full_kl(leaf, head.weight, teacher, rows, chunk, hidden.shape[0])
    hidden.backward(leaf.grad)
    clip_grad_norm(list(model.parameters()), student.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return loss


Curve = list[dict[str, Any]]


def train_with_curve(config: KDFlowConfig, teacher: TeacherStates, heldout: DistillData, eval_steps: set[int], *,
                     online: bool = False, chunk: int = 512) -> tuple[nn.Module, Curve, dict[str, Any]]:
    """One run of `student.steps` optimiser steps from scratch, the student evaluated (`dense_eval` on `heldout`)
    after each step in `eval_steps` (0: the initial student) and the last; -> (student, the curve, a summary).

    The steps are the training loop's own (`StudentRun.step`: same initial weights, data order, AdamW, schedule,
    loss picked from the store) or, `online`, full-vocabulary KD (kd_weight 1, T = 1) with the teacher run
    alongside. `train_seconds` is the same quantity in both: wall seconds of the optimiser steps only (data,
    forward, loss, backward, optimiser; online: the teacher's lm_head applied live), without the evaluations and
    without the teacher's body passes (computed once per row and shared by every seed; `teacher_body_seconds`).
    Nothing is saved: the caller stores the result; the student's folder is written fresh (no resume).
    """
    student = config.student
    if online and (student.grad_accum != 1 or student.kd.kd_weight != 1.0 or student.kd.temperature != 1.0):
        raise ValueError("online KD here mirrors one process, grad_accum 1, pure KD at temperature 1")
    run = StudentRun(open_run_root(config), training_settings(config), 0, 1)
    if run.start_step:
        raise RuntimeError(f"{run.student_dir} holds a checkpoint: the benchmark's runs start from scratch")
    curve: Curve = []

    def evaluate(step: int) -> None:
        run.model.eval()
        curve.append({"step": step} | dense_eval(run.model, heldout, teacher, chunk))
        run.model.train()

    train_seconds, teacher_body, loss, position = 0.0, teacher.seconds, float("nan"), 0
    try:
        if 0 in eval_steps:
            evaluate(0)
        for step in range(1, student.steps + 1):
            before, started = teacher.seconds, time.perf_counter()
            if online:
                loss = _online_step(run, teacher, position, chunk)
                position += student.batch_size
            else:
                loss = float(run.step()["loss"])
            train_seconds += time.perf_counter() - started - (teacher.seconds - before)
            if step in eval_steps or step == student.steps:
                evaluate(step)
    finally:
        run.loader.close()
    run.model.eval()
    return run.model, curve, {"steps": student.steps, "final_train_loss": loss, "train_seconds": train_seconds,
                   "teacher_body_seconds": teacher.seconds - teacher_body, "train_rows": run.data.train_rows}


@torch.no_grad()
def dense_eval(student: nn.Module, data: DistillData, teacher: TeacherStates, chunk: int = 512) -> dict[str, float]:
    """Over every held-out row of `data`: next-token CE and full-vocabulary KL(teacher || student), per position,
    from a dense teacher pass (its full logits) and the student's full logits, chunk by chunk."""
    rows = data.eval_rows
    teacher.fill(data, rows)
    body, head = model_body(student), output_layer(student)
    ce_sum = kl_sum = 0.0
    ce_count = kl_count = agree = 0
    for start in range(0, len(rows), 8):
        part = rows[start:start + 8]
        input_ids = data.load(part).input_ids
        hidden = body(input_ids=input_ids, use_cache=False).last_hidden_state.flatten(0, 1)  # (n * T, D)
        labels = next_token_labels(input_ids).flatten()
        for first in range(0, hidden.shape[0], chunk):
            last = min(first + chunk, hidden.shape[0])
            log_q = torch.log_softmax(head(hidden[first:last]).float(), -1)
            log_p = torch.log_softmax(teacher.logits(part, first, last), -1)
            kl_sum += float((log_p.exp() * (log_p - log_q)).sum(dtype=torch.float64))
            kl_count += last - first
            agree += int((log_q.argmax(-1) == log_p.argmax(-1)).sum())
            label = labels[first:last]
            known = label >= 0
            ce_sum += float(-log_q[known].gather(1, label[known, None]).sum(dtype=torch.float64))
            ce_count += int(known.sum())
    ce = ce_sum / max(ce_count, 1)
    return {"heldout_ce": ce, "heldout_perplexity": math.exp(min(ce, 700.0)), "heldout_kl": kl_sum / max(kl_count, 1),
            "heldout_top1_agreement": agree / max(kl_count, 1), "heldout_positions": kl_count}


def teacher_heldout_ce(data: DistillData, teacher: TeacherStates, chunk: int = 512) -> float:
    """The teacher's own next-token CE on the held-out rows (the floor a student approaches)."""
    rows = data.eval_rows
    teacher.fill(data, rows)
    total, count = 0.0, 0
    for start in range(0, len(rows), 8):
        part = rows[start:start + 8]
        labels = next_token_labels(data.load(part).input_ids).flatten()
        for first in range(0, labels.shape[0], chunk):
            last = min(first + chunk, labels.shape[0])
            log_p = torch.log_softmax(teacher.logits(part, first, last), -1)
            label = labels[first:last]
            known = label >= 0
            total += float(-log_p[known].gather(1, label[known, None]).sum(dtype=torch.float64))
            count += int(known.sum())
    return total / max(count, 1)


def store_bytes_per_position(run_root: Any, store: str, records: dict[int, Any]) -> float:
    """Every byte of the store (data files, commit records, `_store.json`, `_complete.json`, `config.yaml`,
    `_renumbering.bin`) per stored position: `kdflow.schemas.store_bytes`, as `bench store` and `store report`."""
    from kdflow.schemas.store_bytes import store_bytes

    return store_bytes(run_root, store, records).per_position
