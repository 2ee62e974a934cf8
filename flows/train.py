"""Flow `train-student`: train (or resume) a student against the cached teacher top-K.

One process (student.distributed: nproc_per_node * nnodes == 1): the task calls
`kdflow.tasks.student.train.train` in the flow's worker. More: the task launches torchrun for this node
(`python -m torch.distributed.run ... -m kdflow.tasks.student.train_worker --config FILE`) in its own process
group, which dies with the flow, forwards its lines to the run log and fails with its exit code. Several
nodes: the same flow runs on every node, each with its `student.distributed.node_rank`
(kdflow.tasks.student.distributed, README "Training on several GPUs").
"""

from __future__ import annotations

import math
import os
import shlex
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from kdflow.flows.artifacts import KeyedProgress, artifact_key, png_markdown, publish_markdown
from kdflow.flows.common import as_config, preflight_when_deployed
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.layout import METRICS_FILE, STUDENTS_DIR, TRAINING_CURVE_FILE
from kdflow.schemas.stage_settings import open_run_root, training_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.launch import config_file, outcome_error, run_child
from kdflow.tasks.common.progress import format_duration
from kdflow.tasks.student.distributed import torchrun_arguments, torchrun_command, world_size_of
from kdflow.tasks.student.jsonl_log import read_jsonl
from kdflow.tasks.student.monitor import percent, perplexity_text, step_line
from kdflow.tasks.student.steps import check_layout
from kdflow.tasks.student.train import train
from kdflow.tasks.student.train_worker import EXEC_TORCHRUN, MODULE as TRAIN_WORKER_MODULE

_SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60) -> str:
    """A one-line curve of `values` (sampled down to `width` points), readable in any markdown viewer."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    stride = max(1, math.ceil(len(values) / width))
    sampled = values[::stride]
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    return "".join(_SPARKS[round((v - low) / span * (len(_SPARKS) - 1))] if math.isfinite(v) else " " for v in sampled)


def training_report(summary: dict[str, Any], metrics: list[dict[str, Any]], rows: int = 12,
                    png: bytes | None = None) -> str:
    """Markdown: the loss curve, a table of sampled steps and the held-out evaluation before and after."""
    lines = [f"# Student `{summary['student']}`: {summary['steps']} steps", "",
             f"Model: `{summary['final_dir'] or summary['student_dir']}`  ",
             f"Top-K store: `{summary['topk_store']}`", ""]
    if png:
        lines += [png_markdown(png, f"training curve of {summary['student']}"), ""]
    if metrics:
        losses = [float(r["loss"]) for r in metrics]
        lines += [f"Loss {losses[0]:.4g} → {losses[-1]:.4g}: `{sparkline(losses)}`", "",
                  "| step | loss | kd | ce | lr | grad norm | tokens/s |", "|---:|---:|---:|---:|---:|---:|---:|"]
        stride = max(1, math.ceil(len(metrics) / rows))
        for record in metrics[::stride] + ([metrics[-1]] if (len(metrics) - 1) % stride else []):
            lines.append(f"| {record['step']} | {record['loss']:.4f} | {record['kd']:.4f} | {record['ce']:.4f} | "
                         f"{record['lr']:.3g} | {record['grad_norm']:.3g} | {record['tokens_per_s']:.0f} |")
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before or after:
        lines += ["", "| held-out | KL to stored targets | perplexity | top-1 agreement | full KL to teacher |",
                  "|---|---:|---:|---:|---:|"]
        for name, result in (("before", before), ("after", after)):
            if result:
                lines.append(f"| {name} (step {result['step']}) | {result['kl']:.4f} | "
                             f"{perplexity_text(result['perplexity'])} | {percent(result['top1_agreement'])} | "
                             f"{_full_kl(result)} |")
    return "\n".join(lines) + "\n"


def _full_kl(record: dict[str, Any]) -> str:
    """eval.jsonl's kl_full (student.eval_full_kl), or "-" where it was not computed."""
    return f"{record['kl_full']:.4f}" if record.get("kl_full") is not None else "-"


def _figure(value: float | None) -> str:
    """A loss or KL for the log line: four decimals, or "-" where there is none (no evaluation, no step run)."""
    return f"{value:.4f}" if value is not None else "-"


def report_key(student_name: str) -> str:
    """The key of a student's training curve and evaluation: one artifact, a new version after every evaluation."""
    return artifact_key("train", student_name)


def _curve_png(run_root: RunRoot, student_dir: str) -> bytes | None:
    try:
        return run_root.read_bytes(f"{student_dir}/{TRAINING_CURVE_FILE}")
    except FileNotFoundError:
        return None


def student_report(run_root: RunRoot, student_name: str, summary: dict[str, Any]) -> str:
    """The final report of a training run (training_report), with its metrics and curve read from the run root."""
    student_dir = run_root.path(STUDENTS_DIR, student_name)
    metrics = read_jsonl(run_root, f"{student_dir}/{METRICS_FILE}")
    return training_report(summary, metrics, png=_curve_png(run_root, student_dir))


class TrainingArtifacts:
    """Training as Prefect artifacts while it runs, from the training loop's events (kdflow.tasks.student.monitor),
    in this process or from torchrun's rank 0: a progress bar under `train-NAME-progress`, updated in place, and
    the curve under `train-NAME`, a new version after every evaluation (the final report is its last one)."""

    def __init__(self, run_root: RunRoot, student_name: str, steps: int) -> None:
        self.name, self.steps = student_name, steps
        self.run_root = run_root
        self.student_dir = self.run_root.path(STUDENTS_DIR, self.name)
        self.progress = KeyedProgress(artifact_key("train", self.name, "progress"))
        self.losses: list[float] = []
        self.evals: list[dict[str, Any]] = []
        self.curves = 0

    def update(self, event: dict[str, Any]) -> None:
        if event.get("stage") != "train":
            return
        if event["event"] == "step":
            self.losses.append(event["loss"])
            self.progress.set(100.0 * event["step"] / event["steps"], step_line(self.name, event),
                              force=event["step"] >= event["steps"])
        elif event["event"] == "eval":
            self.evals.append(event)
            self._curve(event)

    def _curve(self, event: dict[str, Any]) -> None:
        png = _curve_png(self.run_root, self.student_dir)
        lines = [f"# Student `{self.name}`: step {event['step']} of {event['steps']} (training)", ""]
        if png:
            lines += [png_markdown(png, f"training curve of {self.name}"), ""]
        if self.losses:
            lines += [f"Loss {self.losses[0]:.4g} → {self.losses[-1]:.4g}: `{sparkline(self.losses)}`", ""]
        lines += ["| held-out at step | KL to stored targets | perplexity | top-1 agreement | full KL to teacher |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {e['step']} | {e['kl']:.4f} | {perplexity_text(e['perplexity'])} | "
                  f"{percent(e['top1_agreement'])} | {_full_kl(e)} |" for e in self.evals]
        if publish_markdown(report_key(self.name), "\n".join(lines) + "\n",
                            f"training curve of student {self.name}, step {event['step']}"):
            self.curves += 1

    def finished(self, summary: dict[str, Any]) -> None:
        """The final report as the curve's last version, and the progress bar at 100 %."""
        loss = summary.get("final_loss")
        self.progress.set(100.0, f"{summary['steps']}/{self.steps} steps done in "
                                 f"{format_duration(summary.get('seconds') or 0.0)}"
                                 + (f", final loss {loss:.4f}" if loss is not None else ""), force=True)
        publish_markdown(report_key(self.name), student_report(self.run_root, self.name, summary),
                         f"training curve and evaluation of student {self.name}")


def run_torchrun(config: KDFlowConfig, on_event: Any = lambda event: None) -> dict[str, Any] | None:
    """torchrun for this node, its lines forwarded to the run log; -> rank 0's summary (None when rank 0
    ran on another node). Raises WorkerUserError / WorkerFailed on a non-zero exit code."""
    logger = get_run_logger()
    distributed = config.student.distributed
    with config_file(config, "kdflow-train") as config_path:
        logger.info("node %d of %d: %s", distributed.node_rank, distributed.nnodes,
                    shlex.join(torchrun_command(distributed, config_path)))
        log_dir = os.path.join(os.path.dirname(config_path), "torchrun")  # removed with the config's folder
        arguments = torchrun_arguments(distributed, config_path, log_dir=log_dir)
        outcome = run_child(TRAIN_WORKER_MODULE, [EXEC_TORCHRUN, *arguments],
                            on_progress=on_event, on_log=lambda pid, line: logger.info("torchrun: %s", line))
    failure = outcome_error(outcome, worker="torchrun", needs_result=False)
    if failure is not None:
        raise failure
    return outcome.result


@task(name="train-student", cache_policy=NONE)
def train_student(run_root: RunRoot, config: KDFlowConfig) -> dict[str, Any]:
    run_root.ensure_writable()
    distributed = config.student.distributed
    world_size = world_size_of(distributed)
    artifacts = TrainingArtifacts(run_root, config.student.name, config.student.steps)
    if world_size == 1:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # as the workers do: loading and saving bars are noise in a log
        summary = train(run_root, training_settings(config), on_event=artifacts.update)
    else:
        check_layout(config.student, world_size)  # a one-line error here, before any process starts
        summary = run_torchrun(config, on_event=artifacts.update)
        if summary is None:
            get_run_logger().info("train-student %s: node %d done; rank 0 ran on another node and reports there",
                                  config.student.name, distributed.node_rank)
            return {"student": config.student.name, "node_rank": distributed.node_rank, "world_size": world_size}
    artifacts.finished(summary)
    if summary["steps"] == summary["start_step"] and not summary["stopped"]:
        get_run_logger().info("train-student %s: %d/%d steps already done, nothing to do", config.student.name,
                              summary["steps"], config.student.steps)
    before, after = summary["eval_before"] or {}, summary["eval_after"] or {}
    full = (f", full KL {_figure(before.get('kl_full'))} -> {_figure(after.get('kl_full'))}"
            if before.get("kl_full") is not None or after.get("kl_full") is not None else "")  # eval_full_kl off
    held_out = (f"held-out KL to stored targets {_figure(before.get('kl'))} -> {_figure(after.get('kl'))}{full}"
                if before or after
                else "no held-out evaluation" + (" (student.eval_shards: 0)" if not config.student.eval_shards else ""))
    get_run_logger().info("train-student %s: steps %d -> %d, final loss %s, %s, model in %s", config.student.name,
                          summary["start_step"], summary["steps"], _figure(summary["final_loss"]), held_out,
                          summary["final_dir"])
    return summary


@flow(name="train-student", log_prints=True)
def train_student_flow(config: KDFlowConfig) -> dict[str, Any]:
    """Train (or resume) the student against the teacher's stored top-K; the model lands in students/NAME/final.

    Args:
        config: The run's settings, section by section; this stage reads `student`. Run precompute first.
            Wants a GPU worker (one per rank with `student.distributed`); CPUs work for small students.
    """
    config = as_config(config)
    preflight_when_deployed(config, ["train"])
    distributed = config.student.distributed
    if distributed.node_rank >= distributed.nnodes:
        raise ConfigError(f"student.distributed.node_rank={distributed.node_rank} must be below "
                          f"nnodes={distributed.nnodes}")
    return train_student(open_run_root(config), config)
