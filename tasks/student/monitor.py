"""What a person sees of a training run while it runs (no Prefect here).

`TrainingMonitor` is called by the training loop after every optimiser step and after every evaluation.
Every `student.log_every` steps (and at the last step) it logs one line to the `kdflow` logger: step,
loss with its KD and CE parts, learning rate, gradient norm, tokens/s since the last line and the ETA.
After each evaluation it draws the loss curve (`training_curve.png` beside `metrics.jsonl`, matplotlib)
and, with `student.tensorboard`, writes TensorBoard scalars. Each of these moments is also handed to
`on_event` as a small dict (`event`: "step" or "eval"), which the training flow turns into Prefect
artifacts, in its own process or, through the worker protocol, from torchrun's rank 0.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kdflow.schemas.config import StudentConfig
from kdflow.schemas.layout import TENSORBOARD_DIR, TRAINING_CURVE_FILE
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.progress import format_duration

logger = logging.getLogger("kdflow.train")


def perplexity_text(value: float) -> str:
    """A perplexity as text: two decimals, or three significant digits past a million (an untrained student's is
    ~10^28, printed in full it was 29 digits)."""
    return f"{value:,.2f}" if value < 1e6 else f"{value:.3g}"


def percent(share: float | None) -> str:
    """A held-out share as text; None (top-1 agreement on sampled targets, which have no teacher argmax) as n/a."""
    return "n/a" if share is None else f"{share:.1%}"


OnEvent = Callable[[dict[str, Any]], None]


def step_line(name: str, event: dict[str, Any]) -> str:
    """The log line of a step event: what changes from line to line comes first, units written out."""
    eta = event.get("eta_s")
    return (f"train {name}: step {event['step']}/{event['steps']} loss {event['loss']:.4f} "
            f"(kd {event['kd']:.4f}, ce {event['ce']:.4f}) lr {event['lr']:.3g} grad norm {event['grad_norm']:.3f} "
            f"{event['tokens_per_s']:,.0f} tok/s" + (f" ETA {format_duration(eta)}" if eta is not None else ""))


def plot_training_curve(metrics: list[dict[str, Any]], evals: list[dict[str, Any]], title: str) -> bytes:
    """PNG bytes: training loss (and its KD and CE parts) per step, held-out KL at each evaluation."""
    from matplotlib.figure import Figure  # a figure without pyplot: no display, no global state

    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    steps = [record["step"] for record in metrics]
    if metrics:
        # dashed under the loss (kd = loss at kd_weight 1)
        for part, color in (("kd", "tab:orange"), ("ce", "tab:green")):
            axes.plot(steps, [record[part] for record in metrics], "--", label=part, color=color, linewidth=1.0)
        axes.plot(steps, [record["loss"] for record in metrics], label="loss", color="tab:blue", linewidth=1.2,
                  zorder=3)
    if evals:
        axes.plot([e["step"] for e in evals], [e["kl"] for e in evals], "o--", label="held-out KL to stored targets",
                  color="tab:red")
        full = [e for e in evals if e.get("kl_full") is not None]
        if full:
            axes.plot([e["step"] for e in full], [e["kl_full"] for e in full], "s--", label="held-out full KL",
                      color="tab:purple")
    axes.set_xlabel("step")
    axes.set_ylabel("nats per position")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    if metrics or evals:
        axes.legend(loc="upper right")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


class _TensorBoard:
    """Scalars as TensorBoard event files in students/NAME/tensorboard (the `tensorboard` extra). On an object
    store they are written to a local folder and copied there after each evaluation and at the end."""

    def __init__(self, run_root: RunRoot, student_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            from kdflow.schemas.errors import ConfigError

            raise ConfigError("student.tensorboard needs the tensorboard package: "
                              "pip install 'kdflow[tensorboard]'") from error
        self.run_root, self.target = run_root, f"{student_dir}/{TENSORBOARD_DIR}"
        self.local = run_root.local_path(self.target) or tempfile.mkdtemp(prefix="kdflow-tensorboard-")
        self.writer = SummaryWriter(log_dir=self.local)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()
        if self.run_root.local_path(self.target) is None:  # copy the event files up to the object store
            for name in os.listdir(self.local):
                with open(os.path.join(self.local, name), "rb") as handle:
                    self.run_root.write_bytes_atomic(f"{self.target}/{name}", handle.read())

    def close(self) -> None:
        self.flush()
        self.writer.close()


class TrainingMonitor:
    """Log lines every `log_every` steps, the curve after each evaluation, events for the flow. Only the process
    that writes files (rank 0) is `enabled`; the others do nothing."""

    def __init__(self, student: StudentConfig, run_root: RunRoot, student_dir: str, start_step: int, *,
                 enabled: bool = True, on_event: OnEvent | None = None, last_eval_step: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.name, self.steps, self.log_every = student.name, student.steps, student.log_every
        self.run_root, self.student_dir, self.enabled, self.on_event = run_root, student_dir, enabled, on_event
        self.clock, self.start_step, self.started = clock, start_step, clock()
        # The ETA's clock: restarted after an evaluation before this run's first step (one that does not recur:
        # a teacher loaded for the full KL, the untrained student's scores), which made the first ETAs too long.
        self._eta_since = self.started
        self._window = [0, 0.0]  # tokens and seconds of the optimiser steps since the last log line
        self._last_eval = last_eval_step  # the newest evaluation already drawn (a rerun redraws nothing)
        self.tensorboard = _TensorBoard(run_root, student_dir) if enabled and student.tensorboard else None

    def eta_s(self, step: int) -> float | None:
        done = step - self.start_step
        if done <= 0:
            return None
        return (self.clock() - self._eta_since) / done * max(self.steps - step, 0)

    def step(self, record: dict[str, Any]) -> None:
        """After every optimiser step, with its metrics record (step, loss, kd, ce, lr, grad_norm, tokens, ...)."""
        if not self.enabled:
            return
        step, tokens = record["step"], record.get("tokens", 0)
        self._window[0] += tokens
        self._window[1] += tokens / max(record.get("tokens_per_s", 0.0), 1e-9) if tokens else 0.0
        if self.tensorboard is not None:
            self.tensorboard.scalars(step, {f"train/{k}": float(record[k])
                                            for k in ("loss", "kd", "ce", "lr", "grad_norm")})
        if step % self.log_every and step < self.steps:
            return
        (tokens, seconds), self._window = self._window, [0, 0.0]
        event = {"stage": "train", "event": "step", "student": self.name, "step": step, "steps": self.steps,
                 **{k: float(record[k]) for k in ("loss", "kd", "ce", "lr", "grad_norm")},
                 "tokens_per_s": tokens / max(seconds, 1e-9),  # training speed, evaluations and saving left out
                 "eta_s": self.eta_s(step), "elapsed_s": self.clock() - self.started}
        logger.info("%s", step_line(self.name, event))
        self._emit(event)

    def evaluated(self, metrics: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
        """After an evaluation (or any point where one may have happened): the curve, once per new evaluation."""
        if not self.enabled or not evals or evals[-1]["step"] == self._last_eval:
            return
        latest = evals[-1]
        self._last_eval = latest["step"]
        if latest["step"] == self.start_step:
            self._eta_since = self.clock()
        full = f", full KL {latest['kl_full']:.4f}" if latest.get("kl_full") is not None else ""
        logger.info("train %s: held-out at step %d: KL to stored targets %.4f%s, perplexity %s, top-1 agreement %s",
                    self.name, latest["step"], latest["kl"], full, perplexity_text(latest["perplexity"]),
                    percent(latest["top1_agreement"]))
        curve = f"{self.student_dir}/{TRAINING_CURVE_FILE}"
        self.run_root.write_bytes_atomic(curve, plot_training_curve(metrics, evals, f"student {self.name}"))
        if self.tensorboard is not None:
            self.tensorboard.scalars(latest["step"], {f"eval/{k}": float(latest[k])
                                                      for k in ("kl", "kl_full", "perplexity", "top1_agreement")
                                                      if latest.get(k) is not None})
            self.tensorboard.flush()
        self._emit({"stage": "train", "event": "eval", "student": self.name, "steps": self.steps,
                    "curve": self.run_root.display(curve), **latest})

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _emit(self, event: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(event)
