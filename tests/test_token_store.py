"""`open_token_store`: one answer to "is this token store complete and made for this config and tokenizer"."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdflow.schemas.commits import StageComplete, TokensCompleteInfo, stage_dir, write_complete
from kdflow.schemas.config import KDFlowConfig, config_from_dict
from kdflow.schemas.errors import FingerprintMismatch, StoreError
from kdflow.schemas.fingerprints import corpus_fingerprint, tokens_fingerprint, tokens_fingerprint_of
from kdflow.schemas.stage_settings import open_run_root, student_data_settings, tokenise_settings
from kdflow.schemas.token_store import open_token_store


def tiny_config(tmp_path: Path, **sections: dict) -> KDFlowConfig:
    return config_from_dict({"run_root": str(tmp_path / "run"), "teacher": {"model": "some/teacher"},
                             "dataset": {"path": "some/data"}, "student": {"name": "s"}, **sections}, source="test")


def complete_store(config: KDFlowConfig, tokenizer_fp: str | None, fingerprint: str) -> None:
    run_root = open_run_root(config)
    store = stage_dir(run_root, "tokens")
    run_root.makedirs(store)
    write_complete(run_root, store, StageComplete(stage="tokens", shards=3, rows=6, tokens=6 * config.seq_len,
                                                  fingerprint=fingerprint,
                                                  extra=TokensCompleteInfo(tokenizer_fingerprint=tokenizer_fp)))


def test_a_store_made_for_this_config_and_tokenizer_opens(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    complete_store(config, "tok", tokens_fingerprint(corpus_fingerprint(config), "tok", config))
    expected = tokens_fingerprint(corpus_fingerprint(config), "tok", config)
    opened = open_token_store(open_run_root(config), "tok", expected)
    assert (opened.shards, opened.tokenizer_fingerprint) == (3, "tok")
    assert opened.path == stage_dir(open_run_root(config), "tokens")


def test_missing_foreign_tokenizer_and_other_inputs_are_one_line_each(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    with pytest.raises(StoreError, match="is not complete; run tokenise first"):
        open_token_store(open_run_root(config), "tok", tokens_fingerprint(corpus_fingerprint(config), "tok", config))
    complete_store(config, "other", tokens_fingerprint(corpus_fingerprint(config), "other", config))
    with pytest.raises(FingerprintMismatch, match="tokenizer fingerprint other, but this config's tokenizer is tok"):
        open_token_store(open_run_root(config), "tok", tokens_fingerprint(corpus_fingerprint(config), "tok", config))
    complete_store(config, None, "whatever")
    with pytest.raises(FingerprintMismatch, match="does not record its tokenizer fingerprint"):
        open_token_store(open_run_root(config), "tok", tokens_fingerprint(corpus_fingerprint(config), "tok", config))
    complete_store(config, "tok", "made-from-other-inputs")
    with pytest.raises(StoreError, match="run tokenise first"):
        open_token_store(open_run_root(config), "tok", tokens_fingerprint(corpus_fingerprint(config), "tok", config))


def test_stage_views_resolve_reads_across_sections(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, seq_len=64, precompute={"sequences_per_shard": 8, "top_k": 16})
    tokenise = tokenise_settings(config)
    assert (tokenise.seq_len, tokenise.sequences_per_shard) == (64, 8)
    fingerprint = tokens_fingerprint_of(tokenise.corpus_fingerprint, "tok", tokenise.seq_len,
                                        tokenise.sequences_per_shard)
    assert fingerprint == tokens_fingerprint(corpus_fingerprint(config), "tok", config)  # stores keep their names
    data = student_data_settings(config)
    assert (data.top_k, data.seq_len, data.eval_shards) == (16, 64, config.student.eval_shards)
