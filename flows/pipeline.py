"""Flow `pipeline`: every stage in order, each one a subflow that skips what is already committed."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger

from kdflow.flows.artifacts import artifact_key, publish_markdown, ui_link
from kdflow.flows.common import as_config, preflight_when_deployed
from kdflow.flows.materialise import materialise_flow
from kdflow.flows.tokenise import tokenise_flow
from kdflow.schemas.config import STAGES, KDFlowConfig
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.stage_settings import held_out_problem, open_run_root
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.progress import count_of


def stage_summary(stage: str, result: dict[str, Any]) -> tuple[str, str]:
    """What a stage's store holds and what this run wrote, in words: the pipeline's log line and report row."""
    if stage == "materialise":
        holds = f"{count_of(result['parts'], 'corpus part')}, {count_of(result['documents'], 'document')}"
        return holds, f"{result['parts_written']}"
    if stage == "tokenise":
        holds = f"{count_of(result['shards'], 'token shard')}, {count_of(result['tokens'], 'token')}"
        return holds, f"{result['shards_written']}"
    if stage == "precompute":
        written, ran, configured = result.get("written") or 0, result.get("micro_batch"), result.get(
            "micro_batch_configured")
        if ran != configured:  # halved after running out of the GPU's memory
            written = f"{written} at micro-batch {ran} (the config's {configured} ran out of memory)"
        return f"{count_of(result['shards'], 'top-K shard')} in {result['store']}", f"{written}"
    loss, parts = result.get("final_loss"), result.get("micro_batch_parts") or 1  # loss None: no step ran now
    return (f"student {result['student']}: step {result['start_step']} -> {result['steps']}"
            + (f", final loss {loss:.4f}" if loss is not None else ""),
            count_of(result["steps"] - result["start_step"], "step")
            + (f" (micro-batches in {parts} pieces: out of memory)" if parts > 1 else ""))


def _stage_line(stage: str, result: dict[str, Any]) -> str:
    holds, written = stage_summary(stage, result)
    if stage == "precompute":
        holds += f" (manifest: {ui_link('topk-manifest-' + result['tag'])})"
    return f"| {stage} | {holds} | {written} |"


def pipeline_report(run_root: RunRoot, config: KDFlowConfig, results: dict[str, Any]) -> str:
    """Markdown for the parent run: what each stage holds and did, links to the stages' own artifacts, and the
    student's report repeated (it is what a person opening the pipeline run wants to see)."""
    lines = [f"# Pipeline on `{config.run_root}`", "", "| stage | holds | written now |", "|---|---|---:|"]
    lines += [_stage_line(stage, result) for stage, result in results.items() if isinstance(result, dict)]
    train = results.get("train")
    if isinstance(train, dict) and "start_step" in train:
        from kdflow.flows.train import report_key, student_report

        lines += ["", f"Training curve and evaluation: {ui_link(report_key(config.student.name))}", "", "---", "",
                  student_report(run_root, config.student.name, train)]
    return "\n".join(lines) + "\n"


def _stage_flow(stage: str) -> Any:
    if stage == "materialise":
        return materialise_flow
    if stage == "tokenise":
        return tokenise_flow
    if stage == "precompute":  # the teacher's and the student's modules load only when their stage runs
        from kdflow.flows.precompute import precompute_flow

        return precompute_flow
    from kdflow.flows.train import train_student_flow

    return train_student_flow


@flow(name="pipeline", log_prints=True)
def pipeline_flow(config: KDFlowConfig, stages: list[str] | None = None) -> dict[str, Any]:
    """materialise, tokenise, precompute and train-student in order, in this one flow run.

    Args:
        config: The run's settings, section by section in pipeline order. The teacher pass and training
            want a GPU worker; a model or data set named by a hub id needs hub access (local paths do not).
        stages: Stages to run, in pipeline order: materialise, tokenise, precompute, train (default: all).
    """
    config = as_config(config)
    chosen = list(stages or STAGES)
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown stage {unknown[0]!r}; stages are {', '.join(STAGES)}")
    chosen = [stage for stage in STAGES if stage in chosen]  # always in pipeline order
    preflight_when_deployed(config, chosen)
    logger = get_run_logger()
    results: dict[str, Any] = {}
    for number, stage in enumerate(chosen, 1):
        # Each stage is a subflow run with a log of its own; this run's log says where the pipeline stands.
        stage_flow = _stage_flow(stage)
        logger.info("pipeline: stage %d/%d, %s (its own log is in the subflow run of flow '%s')", number,
                    len(chosen), stage, stage_flow.name)
        started = time.perf_counter()
        results[stage] = stage_flow(config)
        holds, written = stage_summary(stage, results[stage])
        logger.info("pipeline: %s done in %.1f s: %s; written now: %s", stage, time.perf_counter() - started,
                    holds, written)
        if stage == "tokenise" and "train" in chosen:  # found now, not after the teacher pass
            problem = held_out_problem(config.student.eval_shards, results[stage]["shards"],
                                       results[stage]["sequences"])
            if problem:
                raise ConfigError(problem)
    report = pipeline_report(open_run_root(config), config, results)
    publish_markdown(artifact_key("pipeline", config.student.name), report,
                     f"every stage of the pipeline on {config.run_root}")
    return results
