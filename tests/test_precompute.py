"""The teacher pass without Prefect: top-K shards against a dense reference, commits, reruns, leases, errors,
the worker process. (Exit-code classification, fault specs and shard id lists: test_precompute_codes.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.children import run
from support.runs import prepare

from kdflow.schemas.commits import list_commits, read_complete, stage_dir
from kdflow.schemas.errors import ConfigError, FingerprintMismatch, KDFlowError
from kdflow.schemas.layout import commit_file_name
from kdflow.schemas.manifests import load_manifest
from kdflow.schemas.protocol import EXIT_NO_SPACE, RETRYABLE_EXIT_CODES, normalise_returncode
from kdflow.schemas.shards import TopkShard, read_token_shard
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.schemas.storage import RunRoot, sha256_of
from kdflow.schemas.store_info import find_topk_stores
from kdflow.tasks.common.failures import exit_code_for
from kdflow.tasks.common.models import teacher_fingerprint
from kdflow.tasks.common.teacher_loading import TeacherPlacementError, check_placement, load_teacher
from kdflow.tasks.teacher.leases import ShardLeases
from kdflow.tasks.teacher.precompute import precompute_shards

REPO = Path(__file__).resolve().parents[1]


def store_files(config: Any, tag: str) -> dict[str, bytes]:
    run_root = RunRoot(config.run_root)
    store = stage_dir(run_root, "topk", tag)
    return {name: run_root.read_bytes(f"{store}/{name}") for name in run_root.listdir(store)}


def dense_logprobs(model: torch.nn.Module, input_ids: np.ndarray) -> torch.Tensor:
    """Reference: the full logits of the whole model -> log_softmax over the vocabulary, float64. (rows, T, V)"""
    with torch.no_grad():
        logits = model(torch.tensor(input_ids, dtype=torch.long)).logits
    return torch.log_softmax(logits.double(), dim=-1)


def assert_matches_dense(config: Any, tag: str, model: torch.nn.Module) -> None:
    run_root = RunRoot(config.run_root)
    tokens, store = stage_dir(run_root, "tokens"), stage_dir(run_root, "topk", tag)
    token_records = list_commits(run_root, tokens, "tokens")
    topk_records = list_commits(run_root, store, "topk", tag)
    assert sorted(topk_records) == sorted(token_records)
    k, seq_len, settings = config.precompute.top_k, config.seq_len, config.precompute.store
    for shard_id, token_record in token_records.items():
        input_ids = read_token_shard(run_root, f"{tokens}/{token_record.data_file}", seq_len)  # (rows, T)
        shard = TopkShard(run_root, f"{store}/{topk_records[shard_id].data_file}", seq_len, k)
        decoded = shard.read()
        assert decoded.ids.shape == decoded.logprobs.shape == (len(input_ids), seq_len, k)
        assert topk_records[shard_id].input_sha256 == token_record.sha256
        reference = dense_logprobs(model, input_ids)  # (rows, T, V)
        kept = np.arange(k) < decoded.kept[..., None]  # (rows, T, K): all True unless adaptive K
        ids = torch.tensor(np.where(kept, decoded.ids, 0), dtype=torch.long)
        stored = torch.from_numpy(np.where(kept, decoded.logprobs, -np.inf).astype(np.float64))
        at_ids = torch.where(torch.from_numpy(kept), reference.gather(-1, ids), -torch.inf)
        # (rows, T) log of the mass outside the kept ids
        exact_tail = reference.scatter(-1, ids, -torch.inf).logsumexp(-1)
        # The kept ids are the teacher's largest (ties may swap ids), stored in descending order of their values.
        assert (np.diff(np.where(kept, decoded.logprobs, -np.inf), axis=-1) <= 0).all()
        largest = torch.where(torch.from_numpy(kept), reference.topk(k, dim=-1).values, -torch.inf)
        torch.testing.assert_close(at_ids.sort(-1, descending=True).values, largest, rtol=0, atol=1e-6)
        if shard.format == 1:
            assert settings.format == "v1" and decoded.logprobs.dtype == np.float16
            torch.testing.assert_close(stored, at_ids, rtol=1e-3, atol=1e-4)  # float16 storage: 2^-11 relative
            continue
        assert settings.format == "v2" and shard.codec.settings()["values"] == settings.values
        assert np.isfinite(decoded.tail).all() and (decoded.tail <= 0).all()
        if settings.values == "sqrt":  # the documented bound: |sqrt(p) - sqrt(p_exact)| <= 1 / (2 levels)
            error = (stored / 2).exp().nan_to_num(0.0) - (at_ids / 2).exp().nan_to_num(0.0)
            assert error.abs().max() <= 0.5 / settings.levels + 1e-6
        else:
            torch.testing.assert_close(stored, at_ids, rtol=1e-3 if settings.values == "float16" else 1e-6, atol=1e-5)
        tail = torch.from_numpy(decoded.tail.astype(np.float64))  # stored at capture, never 1 - sum
        torch.testing.assert_close(tail, exact_tail, rtol=1e-3 if settings.tail == "float16" else 1e-5, atol=1e-5)


@pytest.mark.parametrize(("teacher", "store"), [
    ("tiny_teacher_dir", {}), ("tiny_moe_teacher_dir", {}), ("tiny_teacher_dir", {"format": "v1"}),
    ("tiny_teacher_dir", {"values": "float32", "tail": "float32", "keep_mass": 0.9, "renumbering": "none"}),
])
def test_every_token_shard_gets_an_aligned_topk_shard_equal_to_dense(make_config, request, teacher, store) -> None:
    # micro_batch 3 over 8-row shards: the last micro-batch of each shard is padded and its padding dropped.
    config = prepare(make_config(teacher__model=str(request.getfixturevalue(teacher)), precompute__micro_batch=3,
                                 dataset__max_documents=24, precompute__store=store))
    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    run_root = RunRoot(config.run_root)
    tokens_done = read_complete(run_root, stage_dir(run_root, "tokens"))
    assert summary["written"] == summary["shards"] == tokens_done.shards >= 3
    assert summary["tokens"] == tokens_done.tokens and summary["complete"]
    assert_matches_dense(config, summary["tag"], load_teacher(config.teacher))
    manifest = load_manifest(run_root, stage_dir(run_root, "topk", summary["tag"]), "topk", summary["tag"],
                             config.seq_len)
    assert len(manifest) == tokens_done.shards
    done = read_complete(run_root, stage_dir(run_root, "topk", summary["tag"]))
    assert done.shards == tokens_done.shards and done.fingerprint == summary["tag"]
    assert find_topk_stores(RunRoot(config.run_root), config.teacher, config.precompute) == [summary["tag"]]


def test_the_tiled_head_writes_the_same_store_and_each_shard_says_so(make_config) -> None:
    config = prepare(make_config(precompute__head="tiled", dataset__max_documents=16))
    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert_matches_dense(config, summary["tag"], load_teacher(config.teacher))
    run_root = RunRoot(config.run_root)
    records = list_commits(run_root, stage_dir(run_root, "topk", summary["tag"]), "topk", summary["tag"])
    assert records and {record.extra.head for record in records.values()} == {"tiled"}


def test_the_compiled_body_writes_the_same_store_and_each_shard_says_so(make_config, monkeypatch) -> None:
    """precompute.compile_body: the body under torch.compile (inductor; on CUDA with CUDA graphs) at the pass's one
    padded micro-batch shape (3 rows over 8-row shards: the padded last micro-batch compiles nothing new)."""
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)  # a second shape would raise
    torch._dynamo.reset()  # what other tests in this process compiled (the same transformers code) is not this pass's
    config = prepare(make_config(precompute__compile_body=True, precompute__micro_batch=3, dataset__max_documents=16))
    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert_matches_dense(config, summary["tag"], load_teacher(config.teacher))
    run_root = RunRoot(config.run_root)
    records = list_commits(run_root, stage_dir(run_root, "topk", summary["tag"]), "topk", summary["tag"])
    assert records and {record.extra.compiled_body for record in records.values()} == {True}
    assert summary["computed_with"] == {"head": "slab", "experts": None, "compiled_body": True}  # dense: no experts


def test_the_tune_builds_the_top_k_step_the_pass_runs(make_config) -> None:
    """One home for the top-K step (topk.topk_step), the pass's and `kdflow tune precompute`'s: the config's head and
    chunk size, and its body compiled where precompute.compile_body says (the tune timed it uncompiled before)."""
    from kdflow.tasks.teacher.loading import output_rows
    from kdflow.tasks.teacher.topk import topk_step

    for compiled in (False, True):
        config = make_config(precompute__compile_body=compiled, precompute__head="tiled")
        model = load_teacher(config.teacher)
        step = topk_step(model, config.precompute, output_rows(model))
        assert (step.compiled_body, step.head, step.k) == (compiled, "tiled", config.precompute.top_k)


def test_rerun_does_no_work_and_a_lost_commit_recomputes_that_shard_only(make_config, caplog) -> None:
    config = prepare(make_config(dataset__max_documents=24))
    with caplog.at_level("INFO", logger="kdflow.precompute"):
        first = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    # where the pass's time went on the host: the writer's busy seconds, and the pass's seconds waiting for it
    assert first["writer"]["busy_s"] > 0 and first["writer"]["waited_for_s"] >= 0
    assert any(f"the background writer encoded and wrote for {first['writer']['busy_s']:.1f} s" in r.getMessage()
               for r in caplog.records), caplog.text
    before = store_files(config, first["tag"])
    again = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert (again["written"], again["skipped"]) == (0, first["shards"]) and again["writer"] is None
    assert again["computed_with"] == first["computed_with"] == {"head": "slab", "experts": None, "compiled_body": False}
    assert store_files(config, first["tag"]) == before  # not even _complete.json or config.yaml rewritten

    run_root = RunRoot(config.run_root)
    store = stage_dir(run_root, "topk", first["tag"])
    run_root.remove(f"{store}/{commit_file_name('topk', 1)}")
    third = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert third["written"] == 1
    after = store_files(config, first["tag"])
    assert after["shard-00001.arrow"] == before["shard-00001.arrow"]
    assert (json.loads(after["shard-00001.commit.json"])["sha256"]
            == json.loads(before["shard-00001.commit.json"])["sha256"])
    assert {n for n in after if n.endswith(".lease") or ".tmp-" in n} == set()


def test_two_run_roots_give_identical_shards(make_config, tmp_path) -> None:
    configs = [prepare(make_config(run_root=str(tmp_path / name), dataset__max_documents=16)) for name in ("a", "b")]
    tags = [precompute_shards(open_run_root(c), teacher_pass_settings(c))["tag"] for c in configs]
    assert tags[0] == tags[1]  # the teacher's fingerprint does not depend on where a run root lies
    hashes = [{i: r.sha256
               for i, r in list_commits(RunRoot(c.run_root), stage_dir(RunRoot(c.run_root), "topk", t), "topk").items()}
              for c, t in zip(configs, tags)]
    assert hashes[0] == hashes[1] and len(hashes[0]) >= 2


def test_shard_subset_and_a_live_foreign_lease(make_config) -> None:
    config = prepare(make_config(dataset__max_documents=24))
    subset = precompute_shards(open_run_root(config), teacher_pass_settings(config), [0, 2])
    run_root = RunRoot(config.run_root)
    store = stage_dir(run_root, "topk", subset["tag"])
    assert sorted(list_commits(run_root, store, "topk")) == [0, 2] and not subset["complete"]

    # A live lease held by another owner (this very process stands in for it): shard 1 is left to it.
    other = ShardLeases(run_root, store, ttl_s=600, owner="someone-else")
    assert other.acquire(1)
    skipping = precompute_shards(open_run_root(config), teacher_pass_settings(config), wait_for_others=False)
    assert skipping["leased_elsewhere"] == [1] and 1 not in list_commits(run_root, store, "topk")
    assert read_complete(run_root, store) is None
    # Its owner dies: an expired lease is taken over and the store completes.
    lease = json.loads(run_root.read_bytes(other.path(1))) | {"expires_at": 0}
    run_root.write_bytes_atomic(other.path(1), json.dumps(lease).encode())
    finished = precompute_shards(open_run_root(config), teacher_pass_settings(config), wait_for_others=False)
    assert finished["written"] == 1 and finished["complete"] and not run_root.exists(other.path(1))


def test_a_failed_write_leaves_no_half_shard_and_a_rerun_finishes(make_config, monkeypatch) -> None:
    config = prepare(make_config(dataset__max_documents=16))
    monkeypatch.setenv("KDFLOW_FAULT", "enospc@shard=1,micro_batch=1")
    with pytest.raises(OSError) as caught:
        precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert exit_code_for(caught.value) == EXIT_NO_SPACE
    [store] = Path(config.run_root).glob("topk/*")
    names = sorted(p.name for p in store.iterdir())
    assert "shard-00000.commit.json" in names and "shard-00001.arrow" not in names
    assert not [n for n in names if ".tmp-" in n or n.endswith(".lease")]  # temp file and lease cleaned up
    # the fault fired once in this run root
    rerun = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert rerun["complete"] and rerun["written"] == rerun["shards"] - 1


def _other_tokenizer(tiny_tokenizer_dir: Path, folder: Path) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_tokens(["<extra-token>"])  # one id past the teacher's 384-row embedding
    tokenizer.save_pretrained(folder)
    return folder


def test_bad_inputs_give_one_line_errors_and_commit_nothing(make_config, tmp_path, tiny_tokenizer_dir) -> None:
    other = str(_other_tokenizer(tiny_tokenizer_dir, tmp_path / "other-tokenizer"))
    empty = tmp_path / "empty-folder"
    empty.mkdir()
    cases: list[tuple[dict[str, Any], bool, type, str]] = [
        ({}, False, KDFlowError, "is not complete; run tokenise first"),
        ({"precompute__top_k": 500}, False, ConfigError,
         "top_k=500 must be between 1 and the teacher's vocabulary size 384"),
        ({"teacher__model": str(tmp_path / "missing")}, False, ConfigError,
         f"teacher.model={str(tmp_path / 'missing')!r}: model path does not exist"),
        ({"teacher__model": str(empty)}, False, ConfigError, "not a model folder (no config.json)"),
        ({"seq_len": 300}, False, ConfigError,
         "seq_len=300 exceeds the teacher's context length (max_position_embeddings=256)"),
        # Another vocabulary than the teacher's (here one token more): refused before any weight loads.
        ({"tokenizer": other}, True, ConfigError,
         "is not the teacher's own: 1 of its 385 tokens have another id (or none)"),
    ]
    for number, (overrides, tokenise_first, error_type, message) in enumerate(cases):
        config = make_config(run_root=str(tmp_path / f"case-{number}"), dataset__max_documents=8, **overrides)
        if tokenise_first:
            prepare(config)
        with pytest.raises(error_type, match=re.escape(message)) as caught:
            precompute_shards(open_run_root(config), teacher_pass_settings(config))
        assert "\n" not in str(caught.value)
        assert not list(Path(config.run_root).glob("topk/*/*.commit.json")), overrides

    # A token store made with another tokenizer than this config's (the teacher's).
    made_with_other = prepare(make_config(tokenizer=other, dataset__max_documents=8))
    config = make_config(dataset__max_documents=8)
    assert config.run_root == made_with_other.run_root
    with pytest.raises(FingerprintMismatch,
                       match="was made with tokenizer .* but this config's tokenizer is") as caught:
        precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert "\n" not in str(caught.value) and not list(Path(config.run_root).glob("topk/*/*.commit.json"))


def test_teacher_fingerprint_ignores_the_folder_location_but_not_dtype(tiny_teacher_dir, tmp_path, make_config) -> None:
    copy = shutil.copytree(tiny_teacher_dir, tmp_path / "moved-teacher")
    here, there = make_config().teacher, make_config(teacher__model=str(copy)).teacher
    assert teacher_fingerprint(here) == teacher_fingerprint(there)
    assert teacher_fingerprint(here) != teacher_fingerprint(make_config(teacher__dtype="bfloat16").teacher)
    assert teacher_fingerprint(here) != teacher_fingerprint(make_config(teacher__load_in_4bit=True).teacher)
    # GGUF: name, size and the first MiB identify the file (hashing all of a 20 GB file would take minutes).
    (tmp_path / "gguf").mkdir()
    gguf = tmp_path / "gguf" / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(3 << 20))
    gguf_teacher = make_config(teacher__model=str(gguf.parent), teacher__gguf_file="model.gguf").teacher
    first = teacher_fingerprint(gguf_teacher)
    gguf.write_bytes(b"GGUF" + bytes(2 << 20) + b"x" + bytes((1 << 20) - 1))  # same size, change past the first MiB
    assert teacher_fingerprint(gguf_teacher) == first
    gguf.write_bytes(b"GGUF" + b"x" + bytes((3 << 20) - 1))  # same size, change in the first MiB
    assert teacher_fingerprint(gguf_teacher) != first


def test_placement_check_names_the_modules_left_behind(make_config) -> None:
    model = load_teacher(make_config().teacher)
    check_placement(model, torch.device("cpu"))
    with pytest.raises(TeacherPlacementError,
                       match=r"not wholly on cuda:0: \d+ module\(s\) left elsewhere: lm_head \(cpu\)"):
        check_placement(model, torch.device("cuda", 0))  # a pure check of tensor devices: no GPU needed
    model.model.layers[1].mlp.to("meta")  # never loaded (what an offload to disk leaves on the model)
    with pytest.raises(TeacherPlacementError, match=r"model\.layers\.1\.mlp\.down_proj \(meta\)"):
        check_placement(model, torch.device("cpu"))


@pytest.mark.parametrize("device,teacher", [("cpu", "tiny_teacher_dir"), ("cpu", "tiny_moe_teacher_dir"),
                                            ("cuda", "tiny_moe_teacher_dir")])
def test_four_bit_teacher_runs(make_config, device: str, teacher: str, request: pytest.FixtureRequest) -> None:
    """Skipped only where bitsandbytes is not installed, or for CUDA where no CUDA device is: a 4-bit load
    that raises is a failure, never a skip. The MoE's fused experts are 4-bit too (tests/test_fused_experts.py)."""
    pytest.importorskip("bitsandbytes")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    config = prepare(make_config(teacher__load_in_4bit=True, teacher__device=device, dataset__max_documents=8,
                                 teacher__model=str(request.getfixturevalue(teacher))))
    model = load_teacher(config.teacher)
    assert any("4bit" in type(m).__name__ for m in model.modules())
    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config), model=model)
    assert summary["complete"] and summary["written"] >= 1
    assert_matches_dense(config, summary["tag"], model)  # against the same quantised model's full logits


def _worker(config_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "kdflow.tasks.teacher.precompute_worker", "--config", str(config_path)],
               what="the teacher worker", timeout=300, cwd=REPO, env=os.environ | env)


@pytest.mark.usefixtures("children")
def test_worker_killed_mid_shard_resumes_in_a_new_process(make_config, tmp_path) -> None:
    from kdflow.schemas.config_io import dump_config

    config = prepare(make_config(dataset__max_documents=16))
    config_path = tmp_path / "resolved.yaml"
    config_path.write_text(dump_config(config))
    killed = _worker(config_path, {"KDFLOW_FAULT": "kill@shard=1,micro_batch=1"})
    assert normalise_returncode(killed.returncode) == 137 and 137 in RETRYABLE_EXIT_CODES
    run_root = RunRoot(config.run_root)
    [tag] = run_root.listdir(run_root.path("topk"))
    store = stage_dir(run_root, "topk", tag)
    names = run_root.listdir(store)
    assert "shard-00000.commit.json" in names and "shard-00001.commit.json" not in names
    [temp] = [n for n in names if n.startswith(".shard-00001.arrow.tmp-")]
    assert os.path.getsize(f"{store}/{temp}") > 0 and "shard-00001.lease" in names  # what a SIGKILL leaves

    resumed = _worker(config_path, {"KDFLOW_FAULT": "kill@shard=1,micro_batch=1"})  # fired once: off now
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    [result] = [json.loads(line.split(" ", 1)[1])
                for line in resumed.stdout.splitlines() if line.startswith("KDFLOW_RESULT ")]
    assert result["complete"] and result["written"] == result["shards"] - 1
    names = run_root.listdir(store)
    assert not [n for n in names if ".tmp-" in n or n.endswith(".lease")]
    reference = prepare(make_config(run_root=str(tmp_path / "reference"), dataset__max_documents=16))
    precompute_shards(open_run_root(reference), teacher_pass_settings(reference))
    reference_root = RunRoot(reference.run_root)
    for shard_id, record in list_commits(run_root, store, "topk", tag).items():
        assert record.sha256 == sha256_of(reference_root,
                                          f"{stage_dir(reference_root, 'topk', tag)}/{record.data_file}")
