"""Train a student against the cached teacher top-K: a pure-torch loop (no Prefect here).

One optimiser step: the global batch at the current data position (kdflow.tasks.student.data), this rank's rows of
it, `grad_accum` micro-batches; per micro-batch the student body's final hidden states go into the fused
top-K loss with the lm_head weight (logits never exist beyond one chunk). Every micro-batch loss is
divided by the GLOBAL count of counted positions of the whole optimiser step, so accumulation and ranks
sum to exactly the gradient of one big batch. Then clipping, AdamW, the LR schedule (linear warmup,
cosine to min_lr_ratio * lr). Metrics per step go to metrics.jsonl, evaluations to eval.jsonl.

Data parallel (kdflow.tasks.student.distributed, processes started by torchrun through kdflow.tasks.student.train_worker): `rank` and
`world_size` pick the rows of each global batch, counts and logged sums are all-reduced, the student and its
loss run as ONE module (DistillLoss) wrapped by FSDP or DDP, and only rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kdflow.schemas.config import KDConfig, KDFlowConfig, StudentConfig, section_hash
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.layout import EVAL_FILE, FINAL_DIR, METRICS_FILE, STUDENTS_DIR
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.tasks.common import faults
from kdflow.tasks.common.models import model_body, output_layer
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.student.checkpoint import (TrainingState, latest_checkpoint, load_checkpoint_model,
                                             load_training_state, prune_checkpoints, save_checkpoint, save_final)
from kdflow.tasks.student.data import DistillBatch, DistillData, DistillStores, open_distill_data
from kdflow.tasks.student.distributed import (all_reduce_sum, any_rank, barrier, choose_sharding, clip_grad_norm,
                                              full_model_state, full_optimizer_state, gradient_sync,
                                              load_full_optimizer_state, rank_device, torchrun_rank, wrap_for_training)
from kdflow.tasks.student.jsonl_log import JsonlLog
from kdflow.tasks.student.model import build_student, check_student, student_tokenizer
from kdflow.tasks.student.monitor import OnEvent, TrainingMonitor
from kdflow.tasks.student.options import apply_student_options
from kdflow.tasks.student.prefetch import Prefetcher
from kdflow.tasks.student.trainer_lease import hold_student

IGNORE_INDEX = -100
OnStep = Callable[[dict[str, Any]], bool | None]


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


def training_fingerprint(config: KDFlowConfig, stores: DistillStores) -> str:
    """What a checkpoint must share with this config to be resumed: data, model and optimisation settings.
    Steps, saving, evaluation and device settings may change between runs, and so may the ones that change
    how the student computes but not what (attn_implementation, gradient_checkpointing, compile: equal up to
    float rounding, like the number of ranks)."""
    student = config.student
    fields = student.model_dump(mode="json", include={"init_from": True, "architecture": True, "batch_size": True, "lr": True,
                                                      "min_lr_ratio": True, "warmup_steps": True, "weight_decay": True,
                                                      "betas": True, "grad_clip": True, "eval_shards": True, "seed": True,
                                                      "kd": {"kd_weight", "temperature"}})
    return section_hash("student", stores.topk_fingerprint, stores.tokens_fingerprint, fields)


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """(n, T) -> (n, T): the token after each position; the last position's is unknown (IGNORE_INDEX)."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


class DistillLoss(nn.Module):
    """The student's body and the fused top-K loss in one forward, so that a data-parallel wrapper sees one
    module: FSDP gathers the root's weights (embeddings, norm, lm_head) for this forward, so the loss reads
    the full `lm_head.weight`, and DDP's gradient hooks fire. Never materialises (n, T, vocab) logits."""

    def __init__(self, student: nn.Module, scheme: str | None = None) -> None:
        super().__init__()
        self.student, self.scheme = student, scheme  # scheme: a store of sampled targets (its loss: sampled_loss.py)

    def forward(self, input_ids: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                tail_logprob: torch.Tensor | None = None, samples: tuple[torch.Tensor, ...] | None = None, *,
                global_counts: tuple[float, float], kd_weight: float, temperature: float, chunk_tokens: int,
                predict: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(n, T), (n, T, K), (n, T, K), (n, T), sampled targets' (n, T, S), (n, T, S), (n, T) or None -> loss, kd,
        ce, and with `predict` the student's argmax (n*T,)."""
        from kdflow.tasks.student.sampled_loss import distillation_kl

        head = output_layer(self.student)
        outputs = model_body(self.student)(input_ids=input_ids, use_cache=False)
        hidden = outputs.last_hidden_state.flatten(0, 1)  # (n * T, H)
        loss, kd_part, ce_part = distillation_kl(
            hidden, head.weight, topk_ids.flatten(0, 1), topk_logprobs.flatten(0, 1), bias=getattr(head, "bias", None),
            tail_logprob=None if tail_logprob is None else tail_logprob.flatten(), scheme=self.scheme,
            samples=None if samples is None else tuple(t.flatten(0, 1) for t in samples),
            labels=next_token_labels(input_ids).flatten(), kd_weight=kd_weight, temperature=temperature,
            chunk_tokens=chunk_tokens, global_counts=global_counts, return_parts=True)
        predicted = _chunked_argmax(hidden.detach(), head, chunk_tokens) if predict else None
        return loss, kd_part, ce_part, predicted


def distill_loss(module: nn.Module, batch: DistillBatch, kd: KDConfig, global_counts: tuple[float, float],
                 autocast: contextlib.AbstractContextManager, *, kd_weight: float | None = None,
                 temperature: float | None = None, predict: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One micro-batch through `module` (a DistillLoss, wrapped or not) -> (loss, kd, ce, predicted | None)."""
    with autocast:
        return module(batch.input_ids, batch.topk_ids, batch.topk_logprobs, batch.tail_logprob, batch.samples,
                      global_counts=global_counts,
                      kd_weight=kd.kd_weight if kd_weight is None else kd_weight,
                      temperature=kd.temperature if temperature is None else temperature,
                      chunk_tokens=kd.chunk_tokens, predict=predict)


def _counts(batches: list[DistillBatch]) -> tuple[int, int]:
    """(KD positions, CE positions): every position has a teacher distribution, all but the last a label."""
    rows = sum(batch.input_ids.shape[0] for batch in batches)
    seq_len = batches[0].input_ids.shape[1]
    return rows * seq_len, rows * (seq_len - 1)


def optimiser_step(module: nn.Module, optimizer: torch.optim.Optimizer, data: DistillData, position: int,
                   config: KDFlowConfig, rank: int, world_size: int, device: torch.device,
                   autocast: contextlib.AbstractContextManager, batches: list[DistillBatch] | None = None) -> dict[str, float]:
    """This rank's share of one optimiser step through `module` (a DistillLoss, wrapped or not); `batches`:
    its micro-batches if already read (by the prefetcher). -> global loss, kd, ce (sums of normalised parts),
    grad norm."""
    student = config.student
    if batches is None:
        batches = data.step_batches(position, student.batch_size, student.grad_accum, rank, world_size)
    global_counts = tuple(all_reduce_sum([float(c) for c in _counts(batches)], device))
    sums = [0.0, 0.0, 0.0]
    for i, batch in enumerate(batches):
        with gradient_sync(module, enabled=i == len(batches) - 1):
            loss, kd_part, ce_part, _ = distill_loss(module, batch.to(device), student.kd, global_counts, autocast)
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
def evaluate(module: nn.Module, data: DistillData, config: KDFlowConfig, device: torch.device, *, rank: int = 0,
             world_size: int = 1, autocast: contextlib.AbstractContextManager | None = None) -> dict[str, float] | None:
    """Held-out KL to the teacher's top-K (T = 1, mean per position), perplexity, top-1 agreement, through
    `module` (a DistillLoss, wrapped or not)."""
    if not data.eval_rows:
        return None
    autocast = autocast if autocast is not None else contextlib.nullcontext()
    seq_len = data.stores.seq_len
    total_rows = len(data.eval_rows)
    global_counts = (float(total_rows * seq_len), float(total_rows * (seq_len - 1)))
    micro = max(1, config.student.batch_size // (world_size * config.student.grad_accum))
    mine = data.eval_batches(micro, rank, world_size)
    # Every rank runs the same number of forwards (FSDP gathers weights in each): rank 0 holds the most rows;
    # a rank out of rows runs a spare batch whose results it drops.
    rounds = math.ceil(math.ceil(total_rows / world_size) / micro)
    was_training = module.training
    module.eval()
    sums = [0.0, 0.0, 0.0]  # kd, ce, top-1 matches
    for i in range(rounds):
        spare = i >= len(mine)
        batch = data.load(data.eval_rows[:1] if spare else mine[i]).to(device)
        _, kd_part, ce_part, predicted = distill_loss(module, batch, config.student.kd, global_counts, autocast,
                                                      kd_weight=1.0, temperature=1.0, predict=True)  # predicted (n*T,)
        if spare:
            continue
        matches = (predicted == batch.topk_ids[..., 0].flatten().long()).sum() if batch.topk_ids.shape[-1] else 0
        sums = [sums[0] + float(kd_part), sums[1] + float(ce_part), sums[2] + float(matches)]
    module.train(was_training)
    kl, ce, matches = all_reduce_sum(sums, device)
    top1 = matches / global_counts[0] if data.stores.targets != "sampled" else None  # sampled targets: no argmax
    return {"kl": kl, "ce": ce, "perplexity": math.exp(min(ce, 700.0)), "top1_agreement": top1,
            "sequences": total_rows}


def check_layout(student: StudentConfig, world_size: int) -> None:
    if student.batch_size % (world_size * student.grad_accum):
        raise ConfigError(f"student.batch_size={student.batch_size} must be divisible by ranks x grad_accum = "
                          f"{world_size} x {student.grad_accum}")


class StudentRun:
    """One process's view of a training run: model, optimiser, data, position, logs; resumed if possible."""

    def __init__(self, config: KDFlowConfig, rank: int, world_size: int) -> None:
        student = config.student
        check_layout(student, world_size)
        self.config, self.rank, self.world_size, self.is_main = config, rank, world_size, rank == 0
        self.run_root = RunRoot(config.run_root)
        self.student_dir = self.run_root.path(STUDENTS_DIR, student.name)
        self.device = rank_device(student.device, torchrun_rank().local_rank if world_size > 1 else 0, world_size)
        self.sharding = choose_sharding(student.distributed.sharding, self.device, world_size)
        self.autocast = autocast_for(self.device, student.autocast_bf16)
        self.tokenizer = student_tokenizer(config, load_tokenizer(config))
        self.data = open_distill_data(config, self.tokenizer)
        fingerprint = training_fingerprint(config, self.data.stores)
        if self.is_main:
            self.run_root.makedirs(self.student_dir)
            remove_stale_temp_files(self.run_root, self.student_dir)  # of killed runs (this one holds the lease)
            prune_checkpoints(self.run_root, self.student_dir, student.keep_checkpoints)
        barrier()  # nobody looks for a checkpoint while rank 0 prunes
        torch.manual_seed(student.seed)
        self.checkpoint = latest_checkpoint(self.run_root, self.student_dir)
        if self.checkpoint is not None and self.checkpoint.state.fingerprint != fingerprint:
            raise StoreError(f"{self.run_root.display(self.checkpoint.path)} was trained with other data or settings "
                             f"(fingerprint {self.checkpoint.state.fingerprint}, this config {fingerprint}); "
                             "choose another student.name or delete that folder")
        if self.checkpoint is not None:
            self.model = load_checkpoint_model(self.run_root, self.checkpoint.path, self.device)
            check_student(self.model, self.tokenizer)
        else:  # seeded: every rank builds the same weights
            self.model = build_student(config, self.tokenizer).to(self.device)
        apply_student_options(self.model, student, self.device)  # attention, gradient checkpointing, compile
        self.model.train()
        # self.model stays the HF student (its parameters may be shards); self.module runs it with the loss.
        scheme = (self.data.stores.sampling or {}).get("scheme")  # sampled targets: their loss needs the scheme
        self.module = wrap_for_training(DistillLoss(self.model, scheme), self.model, self.sharding, self.device)
        self.optimizer, self.scheduler = build_optimizer(self.model, student)  # after wrapping: FSDP swaps parameters
        self.state = TrainingState(0, 0, 0.0, fingerprint)
        if self.checkpoint is not None:  # also restores the RNG states (rank 0's, on every rank)
            self.state = load_training_state(
                self.run_root, self.checkpoint, self.optimizer, self.scheduler,
                load_optimizer=lambda saved: load_full_optimizer_state(self.module, self.optimizer, saved, self.sharding))
        self.start_step = self.state.step
        self.saved_step = self.state.step if self.checkpoint is not None else -1
        self.metrics = JsonlLog(self.run_root, f"{self.student_dir}/{METRICS_FILE}", self.state.step, self.is_main)
        self.evals = JsonlLog(self.run_root, f"{self.student_dir}/{EVAL_FILE}", self.state.step, self.is_main)
        self.tokens_per_step = student.batch_size * self.data.stores.seq_len
        self.loader = Prefetcher(lambda position: self.data.step_batches(
            position, student.batch_size, student.grad_accum, rank, world_size, pin=self.device.type == "cuda"),
            student.prefetch_steps)  # the next steps' batches, read while this one computes
        self._gathered: tuple[int, dict[str, torch.Tensor] | None] = (-1, None)

    def step(self) -> dict[str, Any]:
        """One optimiser step at the current data position; -> its metrics record (also logged)."""
        started = time.perf_counter()
        self._gathered = (-1, None)  # a full copy of old weights is no use any more
        lr = self.scheduler.get_last_lr()[0]
        student = self.config.student
        upcoming = [self.state.position + k * student.batch_size for k in range(1, student.prefetch_steps + 1)
                    if self.state.step + k < student.steps]
        batches, data_wait = self.loader.get(self.state.position, upcoming)
        result = optimiser_step(self.module, self.optimizer, self.data, self.state.position, self.config, self.rank,
                                self.world_size, self.device, self.autocast, batches=batches)
        self.scheduler.step()
        seconds = time.perf_counter() - started
        state = self.state
        self.state = TrainingState(state.step + 1, state.position + self.config.student.batch_size,
                                   state.elapsed_s + seconds, state.fingerprint)
        record = {"step": self.state.step, **result, "lr": lr, "tokens": self.tokens_per_step,
                  "tokens_per_s": self.tokens_per_step / max(seconds, 1e-9), "elapsed": self.state.elapsed_s,
                  "epoch": self.state.position / self.data.train_rows,
                  "data_wait_s": round(data_wait, 6), "data_wait_fraction": round(data_wait / max(seconds, 1e-9), 6)}
        self.metrics.append(record)
        return record

    def evaluate(self) -> None:
        result = evaluate(self.module, self.data, self.config, self.device, rank=self.rank, world_size=self.world_size,
                          autocast=self.autocast)
        if result is not None:
            self.evals.append({"step": self.state.step} | result)

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """FSDP: the full weights on rank 0 (every rank takes part; gathered once per step); else None."""
        if self.sharding != "fsdp":
            return None
        if self._gathered[0] != self.state.step:
            self._gathered = (self.state.step, full_model_state(self.model, self.sharding))
        return self._gathered[1]

    def save(self) -> None:
        """checkpoint-STEP (written by rank 0, from full states), unless this step is already saved; older
        checkpoints pruned."""
        if self.saved_step == self.state.step:
            return
        model_state = self.full_model_state()
        optimizer_state = full_optimizer_state(self.module, self.optimizer, self.sharding)
        if self.is_main:
            keep = self.config.student.keep_checkpoints
            save_checkpoint(self.run_root, self.student_dir, self.model, self.tokenizer, self.optimizer, self.scheduler,
                            self.state, model_state=model_state, optimizer_state=optimizer_state,
                            keep_hint=f"; student.keep_checkpoints={keep} needs room for {keep + 1} checkpoints while "
                                      "the next one is written (free space, or lower it)")
            prune_checkpoints(self.run_root, self.student_dir, self.config.student.keep_checkpoints)
            self.flush_logs()
        self.saved_step = self.state.step

    def finish(self) -> None:
        """The closing evaluation, checkpoint and final/ model; each skipped when already there."""
        if not self.evals.records or self.evals.records[-1]["step"] != self.state.step:
            self.evaluate()
        final_missing = not self.run_root.exists(f"{self.student_dir}/{FINAL_DIR}/config.json")
        final_missing = any_rank(final_missing, self.device)  # the gather below is a collective: all agree
        self.save()
        if self.state.step > self.start_step or final_missing:
            model_state = self.full_model_state()
            if self.is_main:
                save_final(self.run_root, self.student_dir, self.model, self.tokenizer, model_state=model_state)

    def flush_logs(self) -> None:
        self.metrics.flush()
        self.evals.flush()

    def summary(self, stopped: bool) -> dict[str, Any]:
        display, records, evals = self.run_root.display, self.metrics.records, self.evals.records
        return {
            "student": self.config.student.name,
            "student_dir": display(self.student_dir),
            "final_dir": None if stopped else display(f"{self.student_dir}/{FINAL_DIR}"),
            "steps": self.state.step,
            "start_step": self.start_step,
            "resumed_from": None if self.checkpoint is None else display(self.checkpoint.path),
            "stopped": stopped,
            "final_loss": records[-1]["loss"] if records else None,
            "eval_before": evals[0] if evals else None,
            "eval_after": evals[-1] if evals and not stopped else None,
            "tokens": (self.state.step - self.start_step) * self.tokens_per_step,
            "seconds": self.state.elapsed_s,
            "topk_store": display(self.data.stores.topk_store),
            "train_rows": self.data.train_rows,
        }


def train(config: KDFlowConfig, *, rank: int = 0, world_size: int = 1, on_step: OnStep | None = None,
          on_event: OnEvent | None = None) -> dict[str, Any]:
    """Train (or resume) students/NAME to `student.steps`; -> a small summary dict.

    `on_step(record)` is called after every optimiser step with its metrics; returning True stops the
    run there after saving a checkpoint (a resumed run continues exactly from it). `on_event` gets rank 0's
    progress and evaluation events (kdflow.tasks.student.monitor).
    """
    with hold_student(config, rank) as lease:  # one trainer per student: a second run waits here, then resumes
        run = StudentRun(config, rank, world_size)
        student = config.student
        monitor = TrainingMonitor(config, run.run_root, run.student_dir, run.state.step, enabled=run.is_main,
                                  on_event=on_event,
                                  last_eval_step=run.evals.records[-1]["step"] if run.evals.records else None)
        stopped = False
        try:
            if run.state.step == 0 and not run.evals.records:
                run.evaluate()
                monitor.evaluated(run.metrics.records, run.evals.records)
            while run.state.step < student.steps and not stopped:
                record = run.step()
                lease.renew()
                monitor.step(record)
                faults.maybe_fire("step", run.run_root, stage="train", step=run.state.step)
                stopped = bool(on_step(record)) if on_step is not None else False
                if student.eval_every and run.state.step % student.eval_every == 0:
                    run.evaluate()
                    monitor.evaluated(run.metrics.records, run.evals.records)
                if run.state.step % student.save_every == 0 or stopped:
                    run.save()
            if not stopped:
                run.finish()
                monitor.evaluated(run.metrics.records, run.evals.records)
        finally:
            run.loader.close()
            monitor.close()
            run.flush_logs()
        return run.summary(stopped)
