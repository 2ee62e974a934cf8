"""Train a student against the cached teacher top-K: a pure-torch loop (no Prefect here).

One optimiser step: the global batch at the current data position (kdflow.tasks.student.data), this rank's rows of
it, `grad_accum` micro-batches; per micro-batch the student body's final hidden states go into the fused
top-K loss with the lm_head weight (logits never exist beyond one chunk). Every micro-batch loss is
divided by the GLOBAL count of counted positions of the whole optimiser step, so accumulation and ranks
sum to exactly the gradient of one big batch. Then clipping, AdamW, the LR schedule (linear warmup,
cosine to min_lr_ratio * lr). Metrics per step go to metrics.jsonl, evaluations to eval.jsonl (with
`student.eval_full_kl` on, the full-vocabulary KL too: kdflow.tasks.student.heldout_teacher).

Data parallel (kdflow.tasks.student.distributed, processes started by torchrun through
kdflow.tasks.student.train_worker): `rank` and `world_size` pick the rows of each global batch, counts and
logged sums are all-reduced, the student and its loss run as ONE module (DistillLoss) wrapped by FSDP or DDP,
and only rank 0 writes files. The pieces of a step and of an evaluation are in kdflow.tasks.student.steps.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from kdflow.schemas.config_io import write_resolved_config
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import EVAL_FILE, FINAL_DIR, METRICS_FILE, STUDENTS_DIR
from kdflow.schemas.stage_settings import TrainingSettings
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.schemas.store_info import read_store_info
from kdflow.tasks.common import faults
from kdflow.tasks.common.model_files import final_problems
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.student.checkpoint import (Checkpoint, TrainingState, load_training_state, newest_loadable,
                                             prune_checkpoints, save_checkpoint, save_final)
from kdflow.tasks.student.data import open_distill_data
from kdflow.tasks.student.distributed import (any_rank, barrier, choose_sharding, full_model_state,
                                              full_optimizer_state, load_full_optimizer_state, rank_device,
                                              torchrun_rank, wrap_for_training)
from kdflow.tasks.student.heldout_teacher import HeldoutTeacher, full_kl_off_reason, full_kl_wanted
from kdflow.tasks.student.jsonl_log import JsonlLog
from kdflow.tasks.student.model import build_student, check_student, student_tokenizer
from kdflow.tasks.student.model_card import card_facts, card_files, matplotlib_installed
from kdflow.tasks.student.monitor import OnEvent, TrainingMonitor
from kdflow.tasks.student.options import apply_student_options
from kdflow.tasks.student.prefetch import Prefetcher
from kdflow.tasks.student.prune import pruned_as_configured, width_summary
from kdflow.tasks.student.steps import (DistillLoss, StepOutOfMemory, autocast_for, build_optimizer, check_layout,
                                        evaluate, optimiser_step, training_fingerprint)
from kdflow.tasks.student.trainer_lease import hold_student

logger = logging.getLogger("kdflow.train")

# Re-exported: callers import the pieces of a step from here too.
__all__ = ["StudentRun", "train"]
OnStep = Callable[[dict[str, Any]], bool | None]


class StudentRun:
    """One process's view of a training run: model, optimiser, data, position, logs; resumed if possible."""

    def __init__(self, run_root: RunRoot, settings: TrainingSettings, rank: int, world_size: int) -> None:
        student = settings.student
        check_layout(student, world_size)
        self.settings, self.student, self.rank, self.world_size = settings, student, rank, world_size
        self.is_main, self.run_root = rank == 0, run_root
        self.student_dir = self.run_root.path(STUDENTS_DIR, student.name)
        self.device = rank_device(student.device, torchrun_rank().local_rank if world_size > 1 else 0, world_size)
        self.sharding = choose_sharding(student.distributed.sharding, self.device, world_size)
        self.autocast = autocast_for(self.device, student.autocast_bf16)
        self.tokenizer = student_tokenizer(student, load_tokenizer(settings.teacher, settings.tokenizer))
        self.data = open_distill_data(run_root, settings, self.tokenizer)
        fingerprint = training_fingerprint(student, self.data.stores)
        if self.is_main:
            self.run_root.makedirs(self.student_dir)
            remove_stale_temp_files(self.run_root, self.student_dir)  # of killed runs (this one holds the lease)
            prune_checkpoints(self.run_root, self.student_dir, student.keep_checkpoints)
        barrier()  # nobody looks for a checkpoint while rank 0 prunes
        torch.manual_seed(student.seed)
        def same_settings(checkpoint: Checkpoint) -> None:
            if checkpoint.state.fingerprint != fingerprint:
                raise StoreError(f"{self.run_root.display(checkpoint.path)} was trained with other data or settings "
                                 f"(fingerprint {checkpoint.state.fingerprint}, this config {fingerprint}); "
                                 "choose another student.name or delete that folder")

        self.checkpoint, model, self.damaged = newest_loadable(self.run_root, self.student_dir, self.device,
                                                               same_settings,
                                                               logger.warning if self.is_main else lambda _: None)
        if model is not None:
            self.model = model
            check_student(self.model, self.tokenizer)
        elif student.prune is not None:  # the teacher's own blocks: every rank measures and keeps the same ones
            self.model = self.pruned_from_teacher().to(self.device)
        else:  # seeded: every rank builds the same weights
            self.model = build_student(student, settings.seq_len, self.tokenizer).to(self.device)
        self.pruned = getattr(self.model.config, "kdflow_prune", None)  # what a pruned student kept (its card says)
        done = self.checkpoint is not None and self.checkpoint.state.step >= student.steps  # fewer steps asked
        if self.is_main and not done:  # beside the student: a config it trains and resumes with (not one refused
            self.write_config()  # above, nor one that trains nothing: status would say "step 10 of 4")
        apply_student_options(self.model, student, self.device)  # attention, gradient checkpointing, compile
        self.model.train()
        # self.model stays the HF student (its parameters may be shards); self.module runs it with the loss.
        scheme = (self.data.stores.sampling or {}).get("scheme")  # sampled targets: their loss needs the scheme
        loss = DistillLoss(self.model, scheme, self.data.stores.normalisation)  # top_k stores: the renormalised-K loss
        self.module = wrap_for_training(loss, self.model, self.sharding, self.device)
        self.optimizer, self.scheduler = build_optimizer(self.model, student)  # after wrapping: FSDP swaps parameters
        self.state = TrainingState(0, 0, 0.0, fingerprint)
        if self.checkpoint is not None:  # also restores the RNG states (rank 0's, on every rank)
            self.state = load_training_state(
                self.run_root, self.checkpoint, self.optimizer, self.scheduler,
                load_optimizer=lambda saved: load_full_optimizer_state(self.module, self.optimizer, saved,
                                                                       self.sharding))
        self.start_step = self.state.step
        if self.checkpoint is not None and self.is_main:
            logger.info("train %s: resuming from %s (step %d of %d)", student.name,
                        self.run_root.display(self.checkpoint.path), self.start_step, student.steps)
            if self.start_step > student.steps:  # fewer steps than trained: nothing is undone
                logger.warning("train %s: student.steps=%d, but %d steps are trained already: it stays the step-%d "
                               "model (another student.name trains a shorter run)", student.name, student.steps,
                               self.start_step, self.start_step)
        self.saved_step = self.state.step if self.checkpoint is not None else -1
        self.metrics = JsonlLog(self.run_root, f"{self.student_dir}/{METRICS_FILE}", self.state.step, self.is_main)
        self.evals = JsonlLog(self.run_root, f"{self.student_dir}/{EVAL_FILE}", self.state.step, self.is_main)
        self.tokens_per_step = student.batch_size * self.data.stores.seq_len
        self.loader = Prefetcher(lambda position: self.data.step_batches(
            position, student.batch_size, student.grad_accum, rank, world_size, pin=self.device.type == "cuda"),
            student.prefetch_steps)  # the next steps' batches, read while this one computes
        self._gathered: tuple[int, dict[str, torch.Tensor] | None] = (-1, None)
        self.parts = 1  # pieces each micro-batch is computed in: more after the GPU ran out of memory
        # The held-out kl_full: the teacher loaded at the first evaluation, on every rank or none; never on a store
        # imported from a teacher the config does not say is teacher.model (it would be a KL to another model).
        wanted = full_kl_wanted(student.eval_full_kl, settings.teacher)
        off = full_kl_off_reason(read_store_info(run_root, self.data.stores.topk_store), settings.teacher.model,
                                 student.imported_is_teacher_model)
        if wanted and off is not None:
            wanted = False
            if self.is_main:
                logger.warning(off)
        self.full_kl = bool(self.data.eval_rows) and not any_rank(not wanted, self.device)
        self.heldout_teacher: HeldoutTeacher | None = None

    def step(self) -> dict[str, Any]:
        """One optimiser step at the current data position; -> its metrics record (also logged)."""
        started = time.perf_counter()
        self._gathered = (-1, None)  # a full copy of old weights is no use any more
        lr = self.scheduler.get_last_lr()[0]
        student = self.student
        upcoming = [self.state.position + k * student.batch_size for k in range(1, student.prefetch_steps + 1)
                    if self.state.step + k < student.steps]
        batches, data_wait = self.loader.get(self.state.position, upcoming)
        result = self._in_pieces(f"training step {self.state.step + 1}", lambda: optimiser_step(
            self.module, self.optimizer, self.data, self.state.position, student, self.rank, self.world_size,
            self.device, self.autocast, batches=batches, parts=self.parts, before_backward=self._before_backward))
        self.scheduler.step()
        seconds = time.perf_counter() - started
        state = self.state
        self.state = TrainingState(state.step + 1, state.position + student.batch_size,
                                   state.elapsed_s + seconds, state.fingerprint)
        record = {"step": self.state.step, **result, "lr": lr, "tokens": self.tokens_per_step,
                  "tokens_per_s": self.tokens_per_step / max(seconds, 1e-9), "elapsed": self.state.elapsed_s,
                  "epoch": self.state.position / self.data.train_rows,
                  "data_wait_s": round(data_wait, 6), "data_wait_fraction": round(data_wait / max(seconds, 1e-9), 6)}
        self.metrics.append(record)
        return record

    def _before_backward(self, index: int, rows: int) -> None:
        faults.maybe_fire("micro_batch", self.run_root, stage="train", step=self.state.step + 1, micro_batch=index,
                          micro_batch_size=rows)

    def _after_eval_batch(self, index: int, rows: int) -> None:
        faults.maybe_fire("eval", self.run_root, stage="train", step=self.state.step, micro_batch=index,
                          micro_batch_size=rows)

    def _in_pieces(self, what: str, run: Callable[[], Any]) -> Any:
        """`run()` (a step or an evaluation, reading `self.parts`); when its forwards or backwards run out of the
        GPU's memory, again with each micro-batch in twice as many pieces, as long as that can be: in one process
        (ranks would wait in each other's collectives), a piece still holding more than one row."""
        while True:
            try:
                return run()
            except StepOutOfMemory:
                rows = self.student.batch_size // (self.world_size * self.student.grad_accum)
                if self.world_size > 1 or self.parts >= rows:
                    raise
            self._split_further(what)  # past the except block: the error's frames (and their tensors) are gone

    def _split_further(self, what: str) -> None:
        """Each micro-batch in twice as many pieces from now on: the same step (every piece's loss is divided by
        the step's global counts), less memory. The run keeps them; a new run starts from the config."""
        self.optimizer.zero_grad(set_to_none=True)  # the pieces that ran before the error left gradients
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        student = self.student
        rows = student.batch_size // (self.world_size * student.grad_accum)
        ran, self.parts = -(-rows // self.parts), min(self.parts * 2, rows)
        piece = -(-rows // self.parts)
        fits = next(g for g in range(student.grad_accum, student.batch_size + 1)  # a grad_accum the config allows
                    if student.batch_size % (self.world_size * g) == 0
                    and student.batch_size // (self.world_size * g) <= piece)
        logger.warning("%s: out of the GPU's memory at %d rows a micro-batch; the run goes on with each micro-batch "
                       "in %d pieces of at most %d rows (the same steps; student.grad_accum: %d starts a run there)",
                       what, ran, self.parts, piece, fits)

    def evaluate(self) -> None:
        if self.full_kl and self.heldout_teacher is None:
            self.heldout_teacher = HeldoutTeacher.load(self.settings.teacher, self.device)
        result = self._in_pieces(f"the evaluation at step {self.state.step}", lambda: evaluate(
            self.module, self.data, self.student, self.device, rank=self.rank, world_size=self.world_size,
            autocast=self.autocast, teacher=self.heldout_teacher, parts=self.parts, after_batch=self._after_eval_batch))
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
            keep = self.student.keep_checkpoints
            written = save_checkpoint(
                self.run_root, self.student_dir, self.model, self.tokenizer, self.optimizer, self.scheduler, self.state,
                model_state=model_state, optimizer_state=optimizer_state,
                keep_hint=f"; student.keep_checkpoints={keep} needs room for {keep + 1} checkpoints while the next one "
                          "is written (free space, or lower it)")
            self.damaged = [path for path in self.damaged if path != written]  # written in a damaged one's place
            prune_checkpoints(self.run_root, self.student_dir, keep, self.damaged)
            self.flush_logs()
        self.saved_step = self.state.step

    def finish(self) -> None:
        """The closing evaluation, checkpoint and final/ model; each skipped when already there."""
        if not self.evals.records or self.evals.records[-1]["step"] != self.state.step:
            self.evaluate()
        final = f"{self.student_dir}/{FINAL_DIR}"
        final_missing = not self.run_root.exists(f"{final}/config.json")
        if self.is_main and not final_missing and (cut := final_problems(self.run_root, self.student_dir,
                                                                         self.state.step)):
            logger.warning("train %s: %s: writing it again from step %d", self.student.name, cut[0], self.state.step)
            final_missing = True  # a copy cut short (a full disk, a killed copy), or edited: the same weights again
        final_missing = any_rank(final_missing, self.device)  # the gather below is a collective: all agree
        self.save()
        if self.state.step > self.start_step or final_missing:
            model_state = self.full_model_state()
            if self.is_main:
                save_final(self.run_root, self.student_dir, self.model, self.tokenizer, model_state=model_state,
                           files=self.card_files())

    def card_files(self) -> dict[str, bytes]:
        """The model card (README.md) and its curve, for final/ (kdflow.tasks.student.model_card)."""
        facts = card_facts(self.settings, self.run_root, self.data.stores, step=self.state.step,
                           elapsed_s=self.state.elapsed_s, tokens_per_step=self.tokens_per_step,
                           evals=self.evals.records, device=self.device, world_size=self.world_size,
                           parameters=sum(p.numel() for p in self.model.parameters()), curve=matplotlib_installed(),
                           pruned=self.pruned)
        return card_files(facts, self.metrics.records, self.evals.records)

    def pruned_from_teacher(self) -> torch.nn.Module:
        model, plan, rows = pruned_as_configured(self.settings.teacher, self.student.prune, self.data, self.tokenizer)
        logger.info("student pruned from the teacher: blocks %s of %d kept (importance %s on %d rows)",
                    list(plan.kept), plan.teacher_layers, plan.importance, rows)
        if plan.width is not None:
            logger.info("and narrowed: each block keeps %s", width_summary(model.config.kdflow_prune))
        return model

    def write_config(self) -> None:
        """The resolved config beside the student (a rerun touches no file)."""
        write_resolved_config(self.run_root, self.student_dir, self.settings.resolved_config)

    def flush_logs(self) -> None:
        self.metrics.flush()
        self.evals.flush()

    def summary(self, stopped: bool) -> dict[str, Any]:
        display, records, evals = self.run_root.display, self.metrics.records, self.evals.records
        return {
            "student": self.student.name,
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
            "params": sum(p.numel() for p in self.model.parameters()),  # the student's (whole, if sharded)
            "micro_batch_parts": self.parts,  # more than 1: the GPU ran out of memory at whole micro-batches
        }


def train(run_root: RunRoot, settings: TrainingSettings, *, rank: int = 0, world_size: int = 1,
          on_step: OnStep | None = None, on_event: OnEvent | None = None) -> dict[str, Any]:
    """Train (or resume) students/NAME to `student.steps`; -> a small summary dict.

    `on_step(record)` is called after every optimiser step with its metrics; returning True stops the
    run there after saving a checkpoint (a resumed run continues exactly from it). `on_event` gets rank 0's
    progress and evaluation events (kdflow.tasks.student.monitor).
    """
    student = settings.student
    with hold_student(run_root, student, rank) as lease:  # one trainer per student: a second run waits
        run = StudentRun(run_root, settings, rank, world_size)
        monitor = TrainingMonitor(student, run.run_root, run.student_dir, run.state.step, enabled=run.is_main,
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
