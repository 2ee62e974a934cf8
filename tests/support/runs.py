"""Tiny runs for the student's tests: configs, the real corpus stages, dense top-K stores written by the test,
and paths into a student's folder.

The top-K stores are written from a dense `log_softmax(logits).topk(k)` of a tiny teacher with the schema
writers, so tests built on them do not depend on the precompute code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from support.corpus import sample_documents, write_jsonl
from support.tiny import tiny_config

from kdflow.schemas.commits import (CommitRecord, StageComplete, list_commits, read_complete, stage_dir,
                                    write_commit, write_complete)
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.layout import data_file_name
from kdflow.schemas.shards import read_token_shard, topk_batch, topk_shard_writer
from kdflow.schemas.stage_settings import materialise_settings, open_run_root, tokenise_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.corpus.tokenise import tokenise

SHARPEN = 40.0  # lm_head scale of the test teacher: peaked distributions, a clear signal in a few steps
DENSE_TAG = "dense"


def run_config(run_root: Path, teacher_dir: Path, corpus: Path, **overrides: Any) -> KDFlowConfig:
    """A tiny run: seq_len 32, K 8, 8 sequences per shard, a 1-layer student of width 32."""
    base = {"student__steps": 6, "student__eval_sequences": 16, "student__eval_shards": 2, "student__warmup_steps": 2,
            "student__lr": 1e-2, "student__save_every": 2}
    return tiny_config(run_root, teacher_dir, corpus, **base | overrides)


def make_tokens(config: KDFlowConfig) -> None:
    """The real corpus and tokenise stages."""
    materialise(open_run_root(config), materialise_settings(config))
    tokenise(open_run_root(config), tokenise_settings(config), load_tokenizer(config.teacher, config.tokenizer))


def prepare(config: Any) -> Any:
    """materialise + tokenise: the token store the teacher pass reads."""
    materialise(open_run_root(config), materialise_settings(config), None)
    tokenise(open_run_root(config), tokenise_settings(config), load_tokenizer(config.teacher, config.tokenizer))
    return config


def precomputed_run(make_config: Any, **overrides: Any) -> tuple[Any, dict[str, Any]]:
    """A tiny run's corpus, token store and top-K store, made by the real stages (24 documents) -> (config, the
    teacher pass's summary). `make_config`: the conftest fixture; `overrides`: its dotted keys."""
    from kdflow.schemas.stage_settings import teacher_pass_settings
    from kdflow.tasks.teacher.precompute import precompute_shards

    config = prepare(make_config(dataset__max_documents=24, **overrides))
    return config, precompute_shards(open_run_root(config), teacher_pass_settings(config))


def store_of(config: Any, tag: str) -> tuple[RunRoot, str]:
    """The run root of `config` and its top-K store TAG's folder."""
    run_root = RunRoot(config.run_root)
    return run_root, stage_dir(run_root, "topk", tag)


def write_dense_topk(config: KDFlowConfig, teacher_dir: Path, *, tag: str = DENSE_TAG, top_k: int | None = None,
                     seq_len: int | None = None) -> str:
    """topk/TAG from the teacher's dense log-softmax over the full vocabulary, one shard per token shard."""
    from transformers import AutoModelForCausalLM

    run_root = RunRoot(config.run_root)
    tokens_store, store = stage_dir(run_root, "tokens"), stage_dir(run_root, "topk", tag)
    done = read_complete(run_root, tokens_store)
    records = list_commits(run_root, tokens_store, "tokens", done.fingerprint)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    k, length = top_k or config.precompute.top_k, seq_len or config.seq_len
    for shard_id in range(done.shards):
        input_ids = read_token_shard(run_root, f"{tokens_store}/{records[shard_id].data_file}")[:, :length]  # (rows, T)
        with torch.no_grad():
            logits = model(torch.tensor(input_ids, dtype=torch.long)).logits.float()
            logprobs = torch.log_softmax(logits, dim=-1)  # (rows, T, V)
        values, ids = logprobs.topk(k, dim=-1)  # (rows, T, K), sorted descending
        name = data_file_name("topk", shard_id)
        with topk_shard_writer(run_root, f"{store}/{name}", length, k, "float16") as writer:
            writer.write(*topk_batch(ids.numpy(), values.numpy(), "float16"))
        write_commit(run_root, store, CommitRecord(
            stage="topk", shard_id=shard_id, data_file=name, rows=len(input_ids), tokens=input_ids.size,
            bytes=writer.sink.nbytes, sha256=writer.sink.sha256, input_sha256=records[shard_id].sha256,
            fingerprint=tag, extra={"tokens_fingerprint": done.fingerprint}))  # as the teacher pass records it
    write_complete(run_root, store, StageComplete(stage="topk", shards=done.shards, rows=done.rows, tokens=done.tokens,
                                                  fingerprint=tag, extra={"tokens_fingerprint": done.fingerprint}))
    return store


def student_path(config: KDFlowConfig, *parts: str) -> Path:
    return Path(config.run_root, "students", config.student.name, *parts)


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def final_weights(config: KDFlowConfig) -> dict[str, torch.Tensor]:
    return load_file(student_path(config, "final", "model.safetensors"))


def trained_tiny_run(base: Path, teacher_dir: Path) -> KDFlowConfig:
    """A 3-step student under `base/run`: 20 documents tokenised, a dense top-K store, trained to final/."""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    corpus = write_jsonl(base / "docs.jsonl", sample_documents(20))
    config = run_config(base / "run", teacher_dir, corpus, student__steps=3, student__eval_shards=1)
    make_tokens(config)
    write_dense_topk(config, teacher_dir)
    train(open_run_root(config), training_settings(config))
    return config
