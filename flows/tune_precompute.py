"""Flow `tune-precompute`: `kdflow tune precompute` as a deployment on the `gpu` pool, so it runs on the GPU
that will run the teacher pass. Each candidate is a task run that starts one tune worker process
(`kdflow.tasks.teacher.tune_search`); at the recommended micro-batch one more task run times both heads and, for a
MoE teacher, another its experts implementations. The table becomes a Prefect artifact and the flow returns the
summary. It never edits a config: copy the recommended `precompute.micro_batch`, `precompute.head` (and
`precompute.experts`) into the deployment's parameters (or run `kdflow tune precompute CONFIG.yaml --write` on that
machine). `random_weights` and `memory_gib` are the command's `--random-weights` and `--memory-gib`: the teacher made
from its config alone, each worker held to a card of that many GiB.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from kdflow.flows.common import as_config
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.tasks.common.launch import config_file
from kdflow.tasks.teacher import tune_search


@task(name="tune-candidate", cache_policy=NONE, task_run_name="micro-batch-{micro_batch}")
def tune_candidate(config_path: str, micro_batch: int, batches: int, warmup: int, timeout_s: float,
                   worker_args: tuple[str, ...] = ()) -> dict[str, Any]:
    logger = get_run_logger()
    candidate = tune_search.run_candidate(config_path, micro_batch, batches=batches, warmup=warmup, timeout_s=timeout_s,
                                          on_log=lambda line: logger.info("worker: %s", line), worker_args=worker_args)
    logger.info("micro-batch %d: %s %s", micro_batch, candidate.status,
                f"{candidate.tokens_per_s:,.0f} tok/s" if candidate.status == "ok" else candidate.message)
    return candidate.as_dict()


@task(name="tune-trial", cache_policy=NONE, task_run_name="{kind}-at-{micro_batch}")
def tune_trial(kind: str, config_path: str, micro_batch: int, repeats: int, timeout_s: float,
               worker_args: tuple[str, ...] = ()) -> dict[str, Any]:
    logger = get_run_logger()
    outcome = tune_search.run_trial(kind, config_path, micro_batch, repeats=repeats, timeout_s=timeout_s,
                                    on_log=lambda line: logger.info("worker: %s", line), worker_args=worker_args)
    chosen = outcome[tune_search.TRIALS[kind].recommended]
    logger.info("%s at micro-batch %d: %s %s", kind, micro_batch, outcome["status"],
                chosen if outcome["status"] == "ok" else outcome["message"])
    return outcome


@flow(name="tune-precompute", log_prints=True)
def tune_precompute_flow(config: KDFlowConfig, micro_batches: list[int] | str | None = None, headroom: float = 0.10,
                         batches: int = 3, warmup: int = 1, timeout_s: float = 1800.0,
                         keep_going: bool = False, random_weights: bool = False,
                         memory_gib: float | None = None) -> dict[str, Any]:
    """Each micro-batch candidate in a fresh teacher process; -> the table's rows and the recommendation."""
    config = as_config(config)
    if not 0.0 <= headroom < 1.0 or batches < 1 or warmup < 0 or timeout_s <= 0:
        raise ConfigError("headroom must be in [0, 1), batches >= 1, warmup >= 0 and timeout_s > 0")
    sizes = (tune_search.parse_micro_batches(micro_batches) if micro_batches is not None
             else tune_search.default_micro_batches(config.precompute))
    weights = not random_weights
    rows_from = tune_search.check_tune_inputs(open_run_root(config), teacher_pass_settings(config), weights=weights)
    worker_args = tune_search.worker_options(config.teacher.device, random_weights, memory_gib, "memory_gib")
    logger = get_run_logger()
    logger.info("candidates %s; rows: %s%s%s", ",".join(map(str, sizes)), rows_from,
                "; random weights" if random_weights else "",
                f"; held to a {memory_gib:g} GiB card" if memory_gib is not None else "")
    with config_file(config, "kdflow-tune-") as path:
        def runner(size: int) -> tune_search.Candidate:
            row = tune_candidate(path, size, batches, warmup, timeout_s, worker_args)
            fields = {k: v for k, v in row.items() if k not in ("micro_batch", "status", "exit_code", "message")}
            return tune_search.Candidate(row["micro_batch"], row["status"], row["exit_code"], row["message"], fields)

        candidates = tune_search.run_candidates(sizes, runner, keep_going=keep_going)
        result = tune_search.summary(candidates, headroom)
        chosen = result["recommended_micro_batch"]
        if chosen is not None:
            result["heads"] = tune_trial("heads", path, chosen, batches, timeout_s, worker_args)
            if tune_search.has_experts(teacher_pass_settings(config), weights=weights):
                result["experts"] = tune_trial("experts", path, chosen, batches, timeout_s, worker_args)
    report = tune_search.table(candidates, headroom, markdown=True)
    if "heads" in result:
        report += "\n\n```\n" + tune_search.heads_report(result["heads"], config.precompute.head) + "\n```"
    if "experts" in result:
        report += "\n\n```\n" + tune_search.experts_report(result["experts"], config.precompute.experts) + "\n```"
    _table_artifact(report, result)
    logger.info("recommended precompute.micro_batch: %s", result["recommended_micro_batch"])
    return result


def _table_artifact(markdown: str, result: dict[str, Any]) -> None:
    try:
        from prefect.artifacts import create_markdown_artifact

        chosen = result["recommended_micro_batch"]
        verdict = (f"**recommended: `precompute.micro_batch: {chosen}`** "
                   f"({result['recommended_tokens_per_s']:,.0f} tok/s)"
                   if chosen is not None else "**no candidate left the required headroom**")
        create_markdown_artifact(f"{markdown}\n\n{verdict}\n", key="tune-precompute",
                                 description="micro-batch candidates of the teacher pass")
    except Exception as error:  # noqa: BLE001 - an artifact is a convenience, the flow's result is the truth
        get_run_logger().debug("tune artifact not created: %s", error)
