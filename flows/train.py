"""Flow `train-student`: train (or resume) a student against the cached teacher top-K.

One process for now: the task calls `tasks.train.train` in the flow's worker. Several GPUs will be
launched from here through torchrun (student.distributed), each rank calling the same `train(rank=...)`.
"""

from __future__ import annotations

import math
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from flows.common import as_config, write_stage_config
from kdflow.config import KDFlowConfig, dump_config
from kdflow.errors import ConfigError
from schemas.commits import CONFIG_FILE, STUDENTS_DIR
from schemas.storage import RunRoot
from tasks.train import METRICS_FILE, read_jsonl, train

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


def training_report(summary: dict[str, Any], metrics: list[dict[str, Any]], rows: int = 12) -> str:
    """Markdown: the loss curve, a table of sampled steps and the held-out evaluation before and after."""
    lines = [f"# Student `{summary['student']}`: {summary['steps']} steps", "",
             f"Model: `{summary['final_dir'] or summary['student_dir']}`  ", f"Top-K store: `{summary['topk_store']}`", ""]
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
        lines += ["", "| held-out | KL to teacher top-K | perplexity | top-1 agreement |", "|---|---:|---:|---:|"]
        for name, result in (("before", before), ("after", after)):
            if result:
                lines.append(f"| {name} (step {result['step']}) | {result['kl']:.4f} | {result['perplexity']:.2f} | "
                             f"{result['top1_agreement']:.1%} |")
    return "\n".join(lines) + "\n"


def _publish_report(config: KDFlowConfig, summary: dict[str, Any]) -> None:
    run_root = RunRoot(config.run_root)
    metrics = read_jsonl(run_root, f"{run_root.path(STUDENTS_DIR, config.student.name)}/{METRICS_FILE}")
    key = "train-" + "".join(c if c.isalnum() else "-" for c in config.student.name.lower())
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(key=key, markdown=training_report(summary, metrics),
                                 description=f"training curve and evaluation of student {config.student.name}")
    except Exception as error:  # noqa: BLE001 - a report is a view; it must never fail a finished training run
        get_run_logger().warning("train-student: no training report artifact (%s)", error)


def _write_config_if_changed(config: KDFlowConfig, folder: str) -> None:
    """The resolved config beside the student; left alone when it says the same (reruns touch nothing)."""
    run_root = RunRoot(config.run_root)
    try:
        unchanged = run_root.read_bytes(f"{folder}/{CONFIG_FILE}") == dump_config(config).encode()
    except FileNotFoundError:
        unchanged = False
    if not unchanged:
        write_stage_config(config, folder)


@task(name="train-student", cache_policy=NONE)
def train_student(config: KDFlowConfig) -> dict[str, Any]:
    run_root = RunRoot(config.run_root)
    run_root.ensure_writable()
    _write_config_if_changed(config, run_root.path(STUDENTS_DIR, config.student.name))
    summary = train(config)
    _publish_report(config, summary)
    before, after = summary["eval_before"] or {}, summary["eval_after"] or {}
    get_run_logger().info("train-student %s: steps %d -> %d, final loss %s, held-out KL %s -> %s, model in %s",
                          config.student.name, summary["start_step"], summary["steps"], summary["final_loss"],
                          before.get("kl"), after.get("kl"), summary["final_dir"])
    return summary


@flow(name="train-student", log_prints=True)
def train_student_flow(config: KDFlowConfig) -> dict[str, Any]:
    config = as_config(config)
    distributed = config.student.distributed
    if distributed.nproc_per_node * distributed.nnodes > 1:
        raise ConfigError("student.distributed asks for several processes; multi-process training is not "
                          "available yet: set nproc_per_node and nnodes to 1")
    return train_student(config)
