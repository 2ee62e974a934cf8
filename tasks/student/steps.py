"""The pieces of one training step and one evaluation (kdflow.tasks.student.train runs them): the optimiser and
its schedule, the student and its loss as one module, this rank's share of a step, the held-out evaluation, and
the fingerprint a checkpoint must share with the config to be resumed. Pure torch, no Prefect, no files.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from kdflow.schemas.config import KDConfig, StudentConfig
from kdflow.schemas.config_hash import section_hash
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.fingerprints import student_resume_fields
from kdflow.schemas.protocol import EXIT_CUDA_OOM
from kdflow.tasks.common.failures import exit_code_for
from kdflow.tasks.common.models import model_body, output_layer
from kdflow.tasks.student.chunked_loss import IGNORE_INDEX
from kdflow.tasks.student.data import DistillBatch, DistillData, DistillStores
from kdflow.tasks.student.distributed import all_reduce_sum, clip_grad_norm, gradient_sync
from kdflow.tasks.student.heldout_teacher import HeldoutTeacher

Probe = Callable[[torch.Tensor, nn.Module], Any]

def autocast_for(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA devices that support it; on CPU bf16 is slower than fp32, so never there."""
    if enabled and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_factor(step: int, student: StudentConfig) -> float:
    """Multiplier of `lr` for optimiser step `step` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if step < student.warmup_steps:
        return (step + 1) / student.warmup_steps
    decay_steps = max(1, student.steps - student.warmup_steps - 1)
    progress = min(1.0, (step - student.warmup_steps) / decay_steps)
    return student.min_lr_ratio + (1 - student.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, student: StudentConfig) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with decoupled weight decay on matrices only (not on norms, biases or embeddings)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # deduplicated: a tied lm_head appears once, as the embedding
        if param.requires_grad:
            (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": student.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=student.lr, betas=student.betas)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, student))
    return optimizer, scheduler


def training_fingerprint(student: StudentConfig, stores: DistillStores) -> str:
    """What a checkpoint must share with this config to be resumed: data, model and optimisation settings.
    Steps, saving, evaluation and device settings may change between runs, and so may the ones that change
    how the student computes but not what (attn_implementation, gradient_checkpointing, compile: equal up to
    float rounding, like the number of ranks)."""
    return section_hash("student", stores.topk_fingerprint, stores.tokens_fingerprint,
                        student_resume_fields(student))


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """(n, T) -> (n, T): the token after each position; the last position's is unknown (IGNORE_INDEX)."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


class DistillLoss(nn.Module):
    """The student's body and the fused top-K loss in one forward, so that a data-parallel wrapper sees one
    module: FSDP gathers the root's weights (embeddings, norm, lm_head) for this forward, so the loss reads
    the full `lm_head.weight`, and DDP's gradient hooks fire. Never materialises (n, T, vocab) logits."""

    def __init__(self, student: nn.Module, scheme: str | None = None, normalisation: str = "full") -> None:
        super().__init__()
        self.student, self.scheme = student, scheme  # scheme: a store of sampled targets (its loss: sampled_loss.py)
        self.normalisation = normalisation  # "top_k": the store's log-probs are renormalised over K (no tail)

    def forward(self, input_ids: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                tail_logprob: torch.Tensor | None = None, samples: tuple[torch.Tensor, ...] | None = None,
                target: torch.Tensor | None = None, *, global_counts: tuple[float, float], kd_weight: float,
                temperature: float, chunk_tokens: int, untargeted_ce_weight: float = 0.0,
                only_targeted: bool = False, predict: bool = False, probe: Probe | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """(n, T), (n, T, K), (n, T, K), (n, T), sampled targets' (n, T, S), (n, T, S), (n, T) or None, target
        (n, T) bool or None -> loss, kd, ce, and with `predict` the student's argmax (n*T,), with `probe` what
        `probe(hidden (n*T, H) detached, lm_head)` returns (the evaluation's look at the student's full logits,
        while a wrapper has gathered the weights), else None. `only_targeted`: positions without a target count
        for nothing (evaluation), else their cross-entropy weighs `untargeted_ce_weight`."""
        from kdflow.tasks.student.sampled_loss import distillation_kl

        head = output_layer(self.student)
        outputs = model_body(self.student)(input_ids=input_ids, use_cache=False)
        hidden = outputs.last_hidden_state.flatten(0, 1)  # (n * T, H)
        loss, kd_part, ce_part = distillation_kl(
            hidden, head.weight, topk_ids.flatten(0, 1), topk_logprobs.flatten(0, 1), bias=getattr(head, "bias", None),
            tail_logprob=None if tail_logprob is None else tail_logprob.flatten(), scheme=self.scheme,
            samples=None if samples is None else tuple(t.flatten(0, 1) for t in samples),
            labels=next_token_labels(input_ids).flatten(), kd_weight=kd_weight, temperature=temperature,
            chunk_tokens=chunk_tokens, global_counts=global_counts, return_parts=True,
            **_target_options(target, self.normalisation, untargeted_ce_weight, only_targeted))
        if probe is not None:
            return loss, kd_part, ce_part, probe(hidden.detach(), head)
        predicted = _chunked_argmax(hidden.detach(), head, chunk_tokens) if predict else None
        return loss, kd_part, ce_part, predicted


def _target_options(target: torch.Tensor | None, normalisation: str, untargeted_ce_weight: float,
                    only_targeted: bool) -> dict[str, Any]:
    """The loss's keywords for a store's target mask and normalisation (none for a plain full store, so that
    sampled targets' loss, which knows neither, gets none)."""
    options: dict[str, Any] = {} if normalisation == "full" else {"normalisation": normalisation}
    if target is None:
        return options
    if only_targeted:
        return options | {"mask": target.flatten()}
    return options | {"target": target.flatten(), "untargeted_ce_weight": untargeted_ce_weight}


def distill_loss(module: nn.Module, batch: DistillBatch, kd: KDConfig, global_counts: tuple[float, float],
                 autocast: contextlib.AbstractContextManager, *, kd_weight: float | None = None,
                 temperature: float | None = None, predict: bool = False, probe: Probe | None = None,
                 only_targeted: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """One micro-batch through `module` (a DistillLoss, wrapped or not) -> (loss, kd, ce, predicted | probed | None)."""
    with autocast:
        return module(batch.input_ids, batch.topk_ids, batch.topk_logprobs, batch.tail_logprob, batch.samples,
                      batch.target, global_counts=global_counts, untargeted_ce_weight=kd.untargeted_ce_weight,
                      only_targeted=only_targeted,
                      kd_weight=kd.kd_weight if kd_weight is None else kd_weight,
                      temperature=kd.temperature if temperature is None else temperature,
                      chunk_tokens=kd.chunk_tokens, predict=predict, probe=probe)


def _counts(batches: list[DistillBatch]) -> tuple[int, int]:
    """(KD positions, CE positions): the positions with a teacher target (all, but for a masked store's), and
    every position but a row's last, which has no label."""
    rows = sum(batch.input_ids.shape[0] for batch in batches)
    seq_len = batches[0].input_ids.shape[1]
    targeted = sum(batch.input_ids.numel() if batch.target is None else int(batch.target.sum()) for batch in batches)
    return targeted, rows * (seq_len - 1)


class StepOutOfMemory(RuntimeError):
    """The GPU ran out of memory in a step's forwards or backwards, before the optimiser touched anything, so the
    step can go again (in smaller pieces); its message is the CUDA error's. One in the optimiser's update is not
    this: a half-applied update cannot be taken back."""


@contextlib.contextmanager
def out_of_memory_as_step_error() -> Iterator[None]:
    """Within: a CUDA out-of-memory comes out as StepOutOfMemory (one line, the CUDA error's message)."""
    try:
        yield
    except RuntimeError as error:
        if exit_code_for(error) == EXIT_CUDA_OOM:
            raise StepOutOfMemory(str(error)) from None  # the step's frames go once this is handled
        raise


def split_batch(batch: DistillBatch, parts: int) -> list[DistillBatch]:
    """`batch`'s rows in `parts` consecutive pieces, as even as can be (never an empty one)."""
    rows = batch.input_ids.shape[0]
    if parts == 1:
        return [batch]
    bounds = [rows * k // parts for k in range(parts + 1)]
    return [batch.rows(start, stop) for start, stop in zip(bounds, bounds[1:]) if stop > start]


def optimiser_step(module: nn.Module, optimizer: torch.optim.Optimizer, data: DistillData, position: int,
                   student: StudentConfig, rank: int, world_size: int, device: torch.device,
                   autocast: contextlib.AbstractContextManager,
                   batches: list[DistillBatch] | None = None, *, parts: int = 1,
                   before_backward: Callable[[int, int], None] = lambda index, rows: None) -> dict[str, float]:
    """This rank's share of one optimiser step through `module` (a DistillLoss, wrapped or not); `batches`:
    its micro-batches if already read (by the prefetcher); `parts`: each computed in that many pieces (the same
    step: every loss is divided by the step's global counts, so the gradients sum alike; less memory).
    `before_backward(index, rows)`: called after each piece's forward. -> global loss, kd, ce (sums of normalised
    parts), grad norm."""
    if batches is None:
        batches = data.step_batches(position, student.batch_size, student.grad_accum, rank, world_size)
    global_counts = tuple(all_reduce_sum([float(c) for c in _counts(batches)], device))
    sums = [0.0, 0.0, 0.0]
    pieces = [piece for batch in batches for piece in split_batch(batch, parts)]
    with out_of_memory_as_step_error():
        for i, batch in enumerate(pieces):
            with gradient_sync(module, enabled=i == len(pieces) - 1):
                loss, kd_part, ce_part, _ = distill_loss(module, batch.to(device), student.kd, global_counts,
                                                         autocast)
                before_backward(i, batch.input_ids.shape[0])
                # Data-parallel wrappers average gradients over ranks; the global-count loss wants their sum.
                (loss * world_size).backward()
            for j, value in enumerate((loss.detach(), kd_part, ce_part)):
                sums[j] += float(value)
    grad_norm = clip_grad_norm(list(module.parameters()), student.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss, kd_sum, ce_sum = all_reduce_sum(sums, device)
    return {"loss": loss, "kd": kd_sum, "ce": ce_sum, "grad_norm": grad_norm}


@torch.no_grad()
def _chunked_argmax(hidden: torch.Tensor, head: nn.Module, chunk: int) -> torch.Tensor:
    """(N, H) -> (N,) the student's most likely next token, one chunk of logits at a time."""
    return torch.cat([head(hidden[i:i + chunk]).argmax(-1) for i in range(0, hidden.shape[0], chunk)])


@torch.no_grad()
def evaluate(module: nn.Module, data: DistillData, student: StudentConfig, device: torch.device, *, rank: int = 0,
             world_size: int = 1, autocast: contextlib.AbstractContextManager | None = None,
             teacher: HeldoutTeacher | None = None, parts: int = 1,
             after_batch: Callable[[int, int], None] = lambda index, rows: None) -> dict[str, float] | None:
    """Held-out evaluation through `module` (a DistillLoss, wrapped or not), means per position: `kl_stored`, the KL
    to the stored targets at T = 1 (top-K stores: the K+1-bucket KL to the stored, quantised top-K, which can only
    understate the true KL; `kl` is its old name, kept for readers of older logs), `kl_full` with a `teacher`
    (every rank passes one or none): the KL to the teacher's full distribution, perplexity, top-1 agreement.
    A masked store's positions without a teacher target count in none of them but `kl_full` (over every position).
    `parts`: batches of 1/parts of a training micro-batch's rows (after a step ran out of memory);
    `after_batch(index, rows)`: called after each batch's forward. Out of the GPU's memory: StepOutOfMemory (an
    evaluation changes nothing, so it can go again)."""
    if not data.eval_rows:
        return None
    autocast = autocast if autocast is not None else contextlib.nullcontext()
    seq_len = data.stores.seq_len
    total_rows = len(data.eval_rows)
    micro = -(-max(1, student.batch_size // (world_size * student.grad_accum)) // parts)
    mine = data.eval_batches(micro, rank, world_size)
    # Every rank runs the same number of forwards (FSDP gathers weights in each): rank 0 holds the most rows;
    # a rank out of rows runs a spare batch whose results it drops.
    rounds = math.ceil(math.ceil(total_rows / world_size) / micro)
    was_training = module.training
    module.eval()
    try:
        with out_of_memory_as_step_error():
            sums = _evaluation_sums(module, data, student, device, mine, rounds, autocast, teacher, after_batch)
    finally:
        module.train(was_training)
    if teacher is not None:
        teacher.release_body()  # every row of this rank is held now: the body is not needed again
    kl, ce, matches, kl_full, n_kd, n_ce = all_reduce_sum(sums, device)
    kl, ce = kl / max(n_kd, 1.0), ce / max(n_ce, 1.0)
    top1 = matches / max(n_kd, 1.0) if data.stores.targets != "sampled" else None  # sampled targets: no argmax
    full = {"kl_full": kl_full / (total_rows * seq_len)} if teacher is not None else {}
    return {"kl": kl, "kl_stored": kl, **full, "ce": ce, "perplexity": math.exp(min(ce, 700.0)),
            "top1_agreement": top1, "sequences": total_rows}


def _evaluation_sums(module: nn.Module, data: DistillData, student: StudentConfig, device: torch.device,
                     mine: list[list[tuple[Any, int]]], rounds: int, autocast: contextlib.AbstractContextManager,
                     teacher: HeldoutTeacher | None, after_batch: Callable[[int, int], None]) -> list[float]:
    """This rank's sums over its evaluation batches: kd, ce, top-1 matches, full KL, targeted positions, targeted
    positions with a label."""
    # Sums (global counts of 1: the parts come back as sums), divided by the counted positions at the end: a
    # masked store's positions without a target count for nothing, so the counts are known only once read.
    sums = [0.0] * 6  # kd, ce, top-1 matches, full KL, targeted positions, targeted positions with a label
    chunk = student.kd.chunk_tokens
    for i in range(rounds):
        spare = i >= len(mine)
        rows = data.eval_rows[:1] if spare else mine[i]
        batch = data.load(rows).to(device)
        full = teacher is not None and not spare
        if full:
            teacher.fill(rows, batch.input_ids)

        def probe(hidden: torch.Tensor, head: nn.Module, rows: list = rows, full: bool = full) -> tuple[Any, Any]:
            return _chunked_argmax(hidden, head, chunk), teacher.kl_sum(rows, hidden, head) if full else 0.0

        _, kd_part, ce_part, (predicted, kl_full) = distill_loss(
            module, batch, student.kd, (1.0, 1.0), autocast, kd_weight=1.0, temperature=1.0,
            probe=probe, only_targeted=True)  # predicted (n*T,)
        after_batch(i, batch.input_ids.shape[0])
        if spare:
            continue
        targeted = torch.ones_like(batch.input_ids, dtype=torch.bool) if batch.target is None else batch.target
        matches = 0
        if batch.topk_ids.shape[-1]:
            matches = ((predicted == batch.topk_ids[..., 0].flatten().long()) & targeted.flatten()).sum()
        parts = (kd_part, ce_part, matches, kl_full, targeted.sum(), targeted[:, :-1].sum())
        sums = [total + float(part) for total, part in zip(sums, parts, strict=True)]
    return sums


def check_layout(student: StudentConfig, world_size: int) -> None:
    if student.batch_size % (world_size * student.grad_accum):
        raise ConfigError(f"student.batch_size={student.batch_size} must be divisible by ranks x grad_accum = "
                          f"{world_size} x {student.grad_accum}")
