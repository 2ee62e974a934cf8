"""Flow `materialise`: documents from the hub or files into committed Parquet parts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from kdflow.flows.common import as_config, preflight_when_deployed
from kdflow.schemas.commits import stage_dir
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import write_stage_config
from kdflow.schemas.stage_settings import materialise_settings, open_run_root
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.progress import Progress, count_of
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.corpus.dataset_changes import replaced_store_warning
from kdflow.tasks.corpus.materialise import materialise


@task(name="materialise-corpus", cache_policy=NONE)
def materialise_corpus(run_root: RunRoot, config: KDFlowConfig) -> dict[str, Any]:
    count_tokens = None
    if config.dataset.max_tokens is not None:
        loaded: list[Any] = []  # the tokenizer, loaded at the first count: a finished store never needs it (~4 s)

        def count_tokens(texts: list[str]) -> list[int]:
            if not loaded:
                loaded.append(load_tokenizer(config.teacher, config.tokenizer))
            encoded = loaded[0](texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            return [len(ids) + 1 for ids in encoded]  # + the EOS that joins documents

    run_root.ensure_writable()
    settings = materialise_settings(config)
    replacing = replaced_store_warning(run_root, stage_dir(run_root, "corpus"), settings.corpus_fingerprint,
                                       config.dataset)
    if replacing is not None:
        get_run_logger().warning("%s", replacing)
    write_stage_config(run_root, config, stage_dir(run_root, "corpus"))
    progress = Progress("materialise", None, unit="part")
    try:
        summary = materialise(run_root, settings, count_tokens,
                              on_part=lambda r: progress.update(1, r.tokens))
    finally:
        progress.close()
    result = asdict(summary) | {"seconds": progress.elapsed}
    if summary.parts and not summary.parts_written:
        get_run_logger().info("materialise: %d/%d parts already committed, nothing to do", summary.parts, summary.parts)
    get_run_logger().info("materialise: %s, %s (%s written now; %s without text (empty, or no text field) skipped%s) "
                          "in %.1f s", count_of(summary.parts, "part"), count_of(summary.documents, "document"),
                          count_of(summary.parts_written, "part"), count_of(summary.skipped_empty, "record"),
                          _which(summary.skipped_first, summary.skipped_empty), progress.elapsed)
    return result


def _which(first: list[int], skipped: int) -> str:
    """The records this run skipped, named as errors name them (counted from 1): `: records 2, 5 of the dataset`,
    `, the first: records ...` when it skipped more than it names; "" when it named none."""
    if not first:
        return ""
    named = f"record{'s' * (len(first) > 1)} {', '.join(str(index + 1) for index in first)} of the dataset"
    return f", the first: {named}" if skipped > len(first) else f": {named}"


@flow(name="materialise", log_prints=True)
def materialise_flow(config: KDFlowConfig) -> dict[str, Any]:
    """Documents from the dataset into committed corpus parts under RUN_ROOT/corpus.

    Args:
        config: The run's settings, section by section; this stage reads `dataset` (a hub dataset id needs hub
            access; local files do not). The first stage: nothing runs before it.
    """
    config = as_config(config)
    preflight_when_deployed(config, ["materialise"])
    return materialise_corpus(open_run_root(config), config)
