"""Flow `tokenise`: corpus parts into packed fixed-length token shards."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from kdflow.flows.common import as_config, preflight_when_deployed
from kdflow.schemas.commits import stage_dir
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import write_stage_config
from kdflow.schemas.stage_settings import open_run_root, tokenise_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.progress import Progress, count_of
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.corpus.tokenise import tokenise


@task(name="tokenise-corpus", cache_policy=NONE)
def tokenise_corpus(run_root: RunRoot, config: KDFlowConfig) -> dict[str, Any]:
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    write_stage_config(run_root, config, stage_dir(run_root, "tokens"))
    progress = Progress("tokenise", None, unit="shard")
    try:
        summary = tokenise(run_root, tokenise_settings(config), tokenizer,
                           on_shard=lambda r: progress.update(1, r.tokens))
    finally:
        progress.close()
    if not summary.sequences:  # training refuses such a store; said here, where it is made
        get_run_logger().warning(
            "tokenise: the corpus's %s tokens make no sequence of seq_len %d: nothing to train on (a longer corpus, "
            "or a smaller seq_len)", f"{summary.dropped_tokens:,}", config.seq_len)
    if summary.shards and not summary.shards_written:
        get_run_logger().info("tokenise: %d/%d shards already committed, nothing to do", summary.shards, summary.shards)
    rate = summary.tokens_written / max(summary.seconds, 1e-9)
    get_run_logger().info(
        "tokenise: %s, %s, %s (%s written now, %s tail tokens dropped), %s tok/s", count_of(summary.shards, "shard"),
        count_of(summary.sequences, "sequence"), count_of(summary.tokens, "token"), f"{summary.shards_written:,}",
        f"{summary.dropped_tokens:,}", f"{rate:,.0f}",
    )
    return asdict(summary)


@flow(name="tokenise", log_prints=True)
def tokenise_flow(config: KDFlowConfig) -> dict[str, Any]:
    """Corpus parts into packed token shards of `seq_len` tokens under RUN_ROOT/tokens.

    Args:
        config: The run's settings, section by section; this stage reads `tokenizer` (the teacher's by default)
            and `seq_len`. Run materialise first.
    """
    config = as_config(config)
    preflight_when_deployed(config, ["tokenise"])
    return tokenise_corpus(open_run_root(config), config)
