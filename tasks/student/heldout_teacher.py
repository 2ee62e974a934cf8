"""The full-vocabulary KL to the teacher on the held-out rows: eval.jsonl's `kl_full`, beside `kl_stored`.

The training loss and `kl_stored` see the teacher only through the store: its top-K, quantised, and one bucket for
the rest, which can only lower a KL (merging buckets never raises it). `kl_full` is the KL to the teacher's whole
distribution, per position:

    kl_full = sum_j p_j (log p_j - log q_j)      (p: the teacher's softmax, q: the student's, over every id j)

The teacher is loaded once per run, on the student's device, only when `student.eval_full_kl` asks for it (auto:
a local teacher of at most EVAL_FULL_KL_AUTO_BYTES of weight files) and, on an imported store, only when
`student.imported_is_teacher_model` says the store's teacher is `teacher.model`. Its body runs once over this
rank's held-out rows and is then dropped. What is kept in memory: the final hidden states of those rows and the
output layer, from which every evaluation recomputes the teacher's logits chunk by chunk (the model's own logit
scaling and softcapping applied): the same logits a dense forward gives, without keeping (rows, T, vocab) numbers
and without writing anything to the stores.

When the two vocabularies differ (a teacher whose lm_head has padding rows beyond the tokenizer), the ids both
have are compared one by one and the ids only one side has form one bucket on each side.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from kdflow.schemas.config import EVAL_FULL_KL_AUTO_BYTES, TeacherConfig
from kdflow.schemas.errors import KDFlowError
from kdflow.schemas.store_info import TopkStoreInfo
from kdflow.tasks.common.model_files import WEIGHT_SUFFIXES, check_teacher_files
from kdflow.tasks.common.models import body_hidden_states, final_logit_transform, output_layer
from kdflow.tasks.common.teacher_loading import load_teacher

EVAL_CHUNK = 256  # positions per chunk of teacher and student logits: a few (256, vocab) float32 tensors at a time


def teacher_weight_bytes(teacher: TeacherConfig) -> int | None:
    """Bytes of the teacher's weight files when it is a local folder (its GGUF file alone, if it names one), None
    for a hub id or a folder that is not there."""
    try:
        folder = check_teacher_files(teacher)
    except KDFlowError:  # not a usable model folder: auto leaves the evaluation off
        return None
    if folder is None:
        return None
    names = [teacher.gguf_file] if teacher.gguf_file else \
        [name for name in os.listdir(folder) if name.endswith(WEIGHT_SUFFIXES) and not name.endswith(".index.json")]
    return sum(os.path.getsize(os.path.join(folder, name)) for name in names)


def full_kl_wanted(setting: bool | str, teacher: TeacherConfig) -> bool:
    """student.eval_full_kl (`setting`) resolved: true/false as given; auto: on for a local teacher of at most
    EVAL_FULL_KL_AUTO_BYTES of weight files (never for a hub id: it may not be downloaded, or be large)."""
    if setting != "auto":
        return bool(setting)
    size = teacher_weight_bytes(teacher)
    return size is not None and size <= EVAL_FULL_KL_AUTO_BYTES


def imported_teacher(info: TopkStoreInfo | None) -> str | None:
    """The teacher an imported store names (`_store.json` `imported.teacher`); None for a store kdflow computed."""
    imported = (info.model_extra or {}).get("imported") if info is not None else None
    return str(imported.get("teacher")) if isinstance(imported, dict) and imported.get("teacher") else None


def full_kl_off_reason(info: TopkStoreInfo | None, teacher_model: str, same_teacher: bool) -> str | None:
    """Why kl_full is not computed on this store whatever student.eval_full_kl says, in one line: its targets
    were imported from another teacher, which the config does not say is teacher.model (KL to a model the student
    never learnt from would read as a distance to its teacher). None: nothing stands in the way."""
    name = imported_teacher(info)
    if name is None or same_teacher:
        return None
    return (f"no kl_full: the store's targets were imported from teacher {name!r}, and the config does not say "
            f"that is teacher.model {teacher_model!r} (student.imported_is_teacher_model)")


def full_kl_sum(teacher_logits: Tensor, student_logits: Tensor) -> Tensor:
    """(c, V_t) and (c, V_s) float32 logits -> float64 sum over the c positions of KL(teacher || student), over the
    ids both vocabularies have plus, when they differ, one bucket of the ids only one side has."""
    log_p = torch.log_softmax(teacher_logits.float(), dim=-1)
    log_q = torch.log_softmax(student_logits.float(), dim=-1)
    common = min(log_p.shape[1], log_q.shape[1])
    if common < max(log_p.shape[1], log_q.shape[1]):  # the rest of each side as one bucket (empty: -inf, mass 0)
        rest_p = torch.logsumexp(log_p[:, common:], dim=-1, keepdim=True) if log_p.shape[1] > common else \
            log_p.new_full((log_p.shape[0], 1), -torch.inf)
        rest_q = torch.logsumexp(log_q[:, common:], dim=-1, keepdim=True) if log_q.shape[1] > common else \
            log_q.new_full((log_q.shape[0], 1), -torch.inf)
        log_p = torch.cat([log_p[:, :common], rest_p], dim=1)
        log_q = torch.cat([log_q[:, :common], rest_q], dim=1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))  # 0 log 0 = 0
    return terms.sum(dtype=torch.float64)


class HeldoutTeacher:
    """The teacher's final hidden states on held-out rows and its output layer; `kl_sum` compares a student's
    hidden states on the same rows with it."""

    def __init__(self, teacher: nn.Module, chunk: int = EVAL_CHUNK) -> None:
        self.teacher: nn.Module | None = teacher
        self.head = output_layer(teacher)
        self.transform = final_logit_transform(teacher.config) if hasattr(teacher, "config") else None
        self.chunk = chunk
        self.states: dict[tuple[int, int], Tensor] = {}  # (shard id, row) -> (T, D), in the teacher's dtype

    @classmethod
    def load(cls, teacher: TeacherConfig, device: torch.device) -> HeldoutTeacher:
        return cls(load_teacher(teacher, device=device))

    def fill(self, rows: list[tuple[Any, int]], input_ids: Tensor) -> None:
        """Hidden states of `rows` ((shard pair, row) pairs) from their (n, T) input ids, those not yet held."""
        todo = [i for i, (pair, row) in enumerate(rows) if (pair.shard_id, row) not in self.states]
        if not todo:
            return
        if self.teacher is None:
            raise RuntimeError("the held-out teacher's body was released before every row was filled")
        device = self.head.weight.device
        hidden = body_hidden_states(self.teacher, input_ids[todo].to(device))  # (m, T, D)
        for i, states in zip(todo, hidden, strict=True):
            self.states[rows[i][0].shard_id, rows[i][1]] = states.clone()

    def release_body(self) -> None:
        """Drop the teacher's body once every row is filled; the output layer (and its weight) stays."""
        self.teacher = None

    def logits(self, hidden: Tensor) -> Tensor:
        """(c, D) teacher hidden states -> (c, V_t) float32 logits, as the model's own forward gives them."""
        logits = self.head(hidden).float()
        if self.transform is not None and not self.transform.is_identity:
            self.transform.apply_(logits)
        return logits

    @torch.no_grad()
    def kl_sum(self, rows: list[tuple[Any, int]], student_hidden: Tensor, student_head: nn.Module) -> Tensor:
        """sum over every position of `rows` of KL(teacher || student), float64 (a 0-d tensor): `student_hidden`
        (n * T, H) the student's final hidden states on those rows, in order."""
        teacher_hidden = torch.cat([self.states[pair.shard_id, row] for pair, row in rows])  # (n * T, D)
        if teacher_hidden.shape[0] != student_hidden.shape[0]:
            raise ValueError(f"{student_hidden.shape[0]} student positions for {teacher_hidden.shape[0]} teacher ones")
        weight = student_head.weight.float()  # float32 student logits, whatever the autocast around the caller
        bias = getattr(student_head, "bias", None)
        bias = bias.float() if bias is not None else None
        total = torch.zeros((), dtype=torch.float64, device=student_hidden.device)
        with torch.autocast(student_hidden.device.type, enabled=False):
            for start in range(0, student_hidden.shape[0], self.chunk):
                stop = min(start + self.chunk, student_hidden.shape[0])
                teacher_logits = self.logits(teacher_hidden[start:stop]).to(student_hidden.device)
                student_logits = nn.functional.linear(student_hidden[start:stop].float(), weight, bias)
                total += full_kl_sum(teacher_logits, student_logits)
        return total
