"""Top-K store v2 end to end: the teacher pass writes it, the data loader and validate read it, codec settings
are in the metadata, `_store.json`, the tag and every commit record, and a store made with other settings than
the config asks for is a one-line error naming both. (The codec itself: test_codec.py.)"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from support.runs import precomputed_run, store_of

from kdflow.commands.validate import validate_run_root
from kdflow.schemas.codec import CODEC_NAME, TopkCodec, decode, encode
from kdflow.schemas.commits import CommitRecord, list_commits, read_commit, stage_dir, write_commit
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import RENUMBERING_FILE, commit_file_name
from kdflow.schemas.shards import TopkShard, read_token_shard
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings, training_settings
from kdflow.schemas.storage import RunRoot, sha256_of
from kdflow.schemas.store_info import read_store_info, store_format
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.student.data import open_distill_data
from kdflow.tasks.teacher.precompute import precompute_shards


def test_v2_store_records_its_codec_everywhere(make_config: Callable[..., Any]) -> None:
    config, summary = precomputed_run(make_config)
    run_root, store = store_of(config, summary["tag"])
    info = read_store_info(run_root, store)
    assert info.format == "v2" and info.store == store_format(config.precompute)
    assert info.store == {"format": "v2", "codec": CODEC_NAME, "values": "sqrt", "levels": 400, "tail": "float16",
                          "keep_mass": None, "zstd_level": 1, "renumbering": "unigram"}
    assert info.codec["codec"] == CODEC_NAME and info.codec["renumbering"].startswith("sha256:")
    assert run_root.exists(f"{store}/{RENUMBERING_FILE}")
    for shard_id, record in list_commits(run_root, store, "topk", summary["tag"]).items():
        shard = TopkShard(run_root, f"{store}/{record.data_file}")
        assert shard.format == 2 and shard.codec.settings() == info.codec == record.extra.codec
        assert shard.table.schema.metadata[b"kdflow.format"] == b"2"
        assert shard.table.schema.metadata[b"kdflow.targets"] == b"topk"
        decoded = shard.read()
        assert decoded.tail.dtype == np.float32 and (decoded.tail <= 0).all() and np.isfinite(decoded.tail).all()
        # one documented decode function and plain pyarrow are all a reader needs
        with open(run_root.local_path(f"{store}/{record.data_file}"), "rb") as handle:
            plain = decode(ipc.open_stream(handle).read_all())
        assert all(np.array_equal(a, b) for a, b in zip(plain, decoded))
    # Bytes per position: compact, and the tags differ with any codec setting (they are other stores).
    positions = sum(r.tokens for r in list_commits(run_root, store, "topk").values())
    v1_bytes = positions * config.precompute.top_k * 6
    assert sum(r.bytes for r in list_commits(run_root, store, "topk").values()) < v1_bytes


def test_tags_name_the_format_and_v1_keeps_its_tag(make_config: Callable[..., Any]) -> None:
    from kdflow.schemas.config_hash import section_hash
    from kdflow.schemas.fingerprints import topk_fingerprint

    tags = {topk_fingerprint("t", "k", make_config(**{f"precompute__store__{key}": value}))
            for key, value in [("levels", 400), ("levels", 320), ("values", "float16"), ("tail", "float32"),
                               ("keep_mass", 0.99), ("zstd_level", 3), ("renumbering", "none"), ("format", "v1")]}
    assert len(tags) == 8
    v1 = make_config(precompute__store__format="v1")
    assert topk_fingerprint("t", "k", v1) == section_hash("topk", "t", "k", 8, "float16", length=12)  # as before v2


def test_loader_yields_the_stored_tail_and_trains(make_config: Callable[..., Any]) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config, summary = precomputed_run(make_config, precompute__store__keep_mass=0.5)  # near-uniform tiny teacher
    run_root, store = store_of(config, summary["tag"])
    data = open_distill_data(open_run_root(config), training_settings(config),
                             load_tokenizer(config.teacher, config.tokenizer))
    assert data.stores.codec == read_store_info(run_root, store).codec
    rows = np.array([0, data.train_rows - 1, 5])
    batch = data.train_batch(rows)
    assert batch.tail_logprob.shape == batch.input_ids.shape and batch.tail_logprob.dtype.is_floating_point
    for i, (pair, row) in enumerate(data.locate(rows)):
        decoded = TopkShard(run_root, pair.topk_path).read([row])
        assert np.array_equal(batch.topk_ids[i].numpy(), decoded.ids[0])
        assert np.array_equal(batch.tail_logprob[i].numpy(), decoded.tail[0])
    assert (batch.topk_ids < 0).any()  # adaptive K: padding reaches the loss, which ignores it
    result = train(open_run_root(config), training_settings(config))
    assert result["steps"] == config.student.steps and np.isfinite(result["eval_after"]["kl"])


def test_training_on_a_store_of_other_codec_settings_is_a_one_line_error(make_config: Callable[..., Any]) -> None:
    config, summary = precomputed_run(make_config)
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    for change, asked in (({"precompute__store__levels": 256}, "v2 sqrt/256"),
                          ({"precompute__store__format": "v1"}, "v1 float16")):
        other = make_config(dataset__max_documents=24, **change)
        with pytest.raises(StoreError) as caught:
            open_distill_data(open_run_root(other), training_settings(other), tokenizer)
        message = str(caught.value)
        assert "\n" not in message and "was made as v2 sqrt/400" in message and f"asks for {asked}" in message
        # naming the store explicitly does not mix settings either
        explicit = make_config(dataset__max_documents=24, student__topk_tag=summary["tag"], **change)
        with pytest.raises(StoreError, match=f"was made as v2 sqrt/400.*asks for {asked}"):
            open_distill_data(open_run_root(explicit), training_settings(explicit), tokenizer)


def test_v1_store_keeps_reading(make_config: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    config, summary = precomputed_run(make_config, precompute__store__format="v1")
    run_root, store = store_of(config, summary["tag"])
    info = read_store_info(run_root, store)
    assert info.format == "v1" and info.store is None and info.codec is None  # _store.json as before v2
    record = read_commit(run_root, store, "topk", 0)
    assert TopkShard(run_root, f"{store}/{record.data_file}").format == 1 and record.extra.format is None
    data = open_distill_data(open_run_root(config), training_settings(config),
                             load_tokenizer(config.teacher, config.tokenizer))
    batch = data.train_batch(np.array([0, 1]))
    mass = batch.topk_logprobs.double().exp().sum(-1) + batch.tail_logprob.double().exp()
    assert ((mass - 1).abs() < 1e-2).all()  # v1: the tail is derived as 1 - sum
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out


def _rewrite_record(run_root: RunRoot, store: str, shard_id: int) -> None:
    """Make the commit record match the (edited) data file: only decoding can catch what follows."""
    record = CommitRecord.model_validate_json(run_root.read_bytes(f"{store}/{commit_file_name('topk', shard_id)}"))
    data = f"{store}/{record.data_file}"
    write_commit(run_root, store,
                 record.model_copy(update={"bytes": run_root.size(data), "sha256": sha256_of(run_root, data)}))


def test_validate_catches_corrupt_and_truncated_v2_shards_and_fix_repairs(
        make_config: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    config, summary = precomputed_run(make_config)
    run_root, store = store_of(config, summary["tag"])
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out
    capsys.readouterr()
    records = list_commits(run_root, store, "topk")
    paths = {i: Path(run_root.local_path(f"{store}/{r.data_file}")) for i, r in records.items()}
    originals = {i: p.read_bytes() for i, p in paths.items()}

    data = bytearray(originals[0])  # 1: one byte flipped inside a row's zstd frame: the hash sees it
    data[-60] ^= 0x10
    paths[0].write_bytes(bytes(data))
    paths[1].write_bytes(originals[1][:-100])  # 2: truncated: the size sees it
    data = bytearray(originals[2])  # 3: flipped and its record rewritten to match: only decoding sees it
    data[-60] ^= 0x10
    paths[2].write_bytes(bytes(data))
    _rewrite_record(run_root, store, 2)
    batches = list(ipc.open_stream(pa.BufferReader(originals[3])))  # 4: cut between record batches, record rewritten
    assert len(batches) >= 2
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, batches[0].schema) as writer:
        writer.write_batch(batches[0])
    paths[3].write_bytes(sink.getvalue().to_pybytes())
    _rewrite_record(run_root, store, 3)

    assert validate_run_root(config.run_root) == 1
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if "PROBLEM" in line]
    label = f"topk/{summary['tag']}"
    assert any(f"{label} shard 0: shard-00000.arrow has sha256" in line for line in problems), out
    assert any(f"{label} shard 1: invalid commit record: data file has" in line for line in problems), out
    assert any(f"{label} shard 2:" in line and "crc32 mismatch" in line and "row " in line for line in problems), out
    assert any(f"{label} shard 3:" in line and "rows, its record says" in line for line in problems), out

    assert validate_run_root(config.run_root, fix=True) == 1
    capsys.readouterr()
    again = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert again["written"] == 4
    assert {i: p.read_bytes() for i, p in paths.items()} == originals  # recomputed byte for byte
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out


def test_validate_names_a_shard_of_another_codec_and_a_wrong_mass(
        make_config: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    config, summary = precomputed_run(make_config)
    run_root, store = store_of(config, summary["tag"])
    records = list_commits(run_root, store, "topk")
    shard = TopkShard(run_root, f"{store}/{records[1].data_file}")
    decoded = shard.read()
    other = TopkCodec(shard.codec.seq_len, shard.codec.top_k, shard.codec.vocab_size, levels=300)
    for shard_id, codec, tail in ((1, other, decoded.tail), (2, shard.codec, np.full_like(decoded.tail, -0.01))):
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, codec.schema()) as writer:
            writer.write_batch(encode(codec, decoded.ids, decoded.logprobs, tail))
        Path(run_root.local_path(f"{store}/{records[shard_id].data_file}")).write_bytes(sink.getvalue().to_pybytes())
        _rewrite_record(run_root, store, shard_id)
    assert validate_run_root(config.run_root) == 1
    out = capsys.readouterr().out
    assert f"shard 1: written as {other.settings()}" in out
    assert "shard 2: stored ids and tail hold mass" in out and "not 1" in out
    assert os.path.exists(run_root.local_path(f"{store}/{commit_file_name('topk', 2)}"))


# --- the store report --------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_bucket_kl_against_a_hand_computed_partition() -> None:
    from kdflow.schemas.codec import DecodedTopk
    from kdflow.tasks.teacher.store_fidelity import bucket_kl
    from kdflow.tasks.teacher.store_quality import kept_histogram, tail_histogram

    def topk(ids, probs, tail, kept=None):
        ids, probs = np.array([[ids]], np.int32), np.array([[probs]], np.float64)
        kept = np.array([[kept if kept is not None else ids.shape[-1]]], np.int32)
        return DecodedTopk(ids, np.log(probs).astype(np.float32), np.log(np.array([[tail]])).astype(np.float32), kept)

    exact = topk([4, 7, 1], [0.5, 0.3, 0.1], 0.1)
    kl, agree = bucket_kl(exact, exact)
    assert abs(kl[0, 0]) < 1e-7 and agree.all()
    stored = topk([7, 4, 1], [0.25, 0.5, 0.125], 0.125)  # same ids, other order; q normalised: total 1
    p, q = np.array([0.5, 0.3, 0.1, 0.1]), np.array([0.5, 0.25, 0.125, 0.125])
    kl, _ = bucket_kl(exact, stored)
    np.testing.assert_allclose(kl[0, 0], (p * np.log(p / q)).sum(), rtol=1e-5)
    other = topk([4, 9, -1], [0.6, 0.2, 0.0], 0.2, kept=2)  # id 9 is not in the exact top-K; one padding entry
    kl, agree = bucket_kl(exact, other)  # buckets {4}, rest: p = (0.5, 0.5), q = (0.6, 0.4)
    np.testing.assert_allclose(kl[0, 0], 0.5 * np.log(0.5 / 0.6) + 0.5 * np.log(0.5 / 0.4), rtol=1e-5)
    assert not agree.any()
    assert tail_histogram(np.log(np.array([0.0, 5e-7, 2e-3, 0.5]))) == {
        "0": 1, "<1e-06": 1, "<1e-05": 0, "<0.0001": 0, "<0.001": 0, "<0.01": 1, "<0.1": 0, ">=0.1": 1}
    assert kept_histogram(np.array([1, 2, 3, 4, 5, 8, 9, 12]), 12) == {"1": 1, "2": 1, "3-4": 2, "5-8": 2, "9-12": 2}


def test_store_report_cli(make_config: Callable[..., Any], capsys: pytest.CaptureFixture[str],
                          tmp_path: Path) -> None:
    from kdflow.cli import main as cli_main

    config, summary = precomputed_run(make_config, precompute__store__keep_mass=0.5)
    assert summary["fidelity"]["kl_rows"] == config.precompute.report_rows  # measured by the pass itself
    lossless = make_config(dataset__max_documents=24, precompute__store__values="float32",
                           precompute__store__tail="float32")
    lossless_tag = precompute_shards(open_run_root(lossless), teacher_pass_settings(lossless))["tag"]
    capsys.readouterr()
    assert cli_main(["store", "report", config.run_root, "--json", "--kl-rows", "6", "--device", "cpu"]) == 0
    reports = {r["tag"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(reports) == {summary["tag"], lossless_tag}
    quantised, exact = reports[summary["tag"]], reports[lossless_tag]
    assert exact["kl_buckets_lower_bound_mean"] < 1e-9 and exact["positions_with_other_ids"] == 0  # the re-run
    assert 1e-6 < quantised["kl_buckets_lower_bound_mean"] < 2e-4 and quantised["kl_positions"] == 6 * config.seq_len
    # the store metric: the adaptive store (keep_mass 0.5) holds fewer ids, so it is further from the teacher
    assert 0 < exact["kl_teacher_store_mean"] < quantised["kl_teacher_store_mean"]
    assert exact["kl_teacher_store_infinite_positions"] == 0
    assert quantised["bytes_per_position"] < exact["bytes_per_position"] < quantised["v1_bytes_per_position"] * 2
    assert quantised["mean_kept"] < config.precompute.top_k == exact["mean_kept"]
    assert sum(quantised["kept_histogram"].values()) == quantised["sampled_positions"]
    assert sum(exact["tail_mass_histogram"].values()) == exact["sampled_positions"] and exact["invalid_tails"] == 0
    assert cli_main(["store", "report", config.run_root, "--tag", lossless_tag, "--kl-rows", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"### top-K store {lossless_tag}: v2 float32") and "tail mass |" in out
    sampled = f"{exact['sampled_positions']:,} positions of {exact['sampled_rows']:,} rows sampled"
    assert out.count(sampled) == 2  # the histograms say what they count
    assert cli_main(["store", "report", config.run_root, "--tag", "nosuchstore"]) == 2
    topk_dir = RunRoot(config.run_root).display(RunRoot(config.run_root).path('topk'))
    assert capsys.readouterr().err.strip() == (f"kdflow: error: no top-K store nosuchstore under "
                                               f"{topk_dir}")
    assert cli_main(["store", "report", str(tmp_path / "typo")]) == 1
    assert capsys.readouterr().out.strip() == f"run root {tmp_path / 'typo'} does not exist"

    # Tokenised again into other shards: the stores are stale, and re-running the teacher on today's token shards
    # would compare it with targets of other text. The report says so instead of a KL (or an IndexError).
    from support.runs import make_tokens

    make_tokens(make_config(dataset__max_documents=24, precompute__sequences_per_shard=5))
    assert cli_main(["store", "report", config.run_root, "--kl-rows", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("| KL to the teacher | made from token shards that tokenise has since replaced") == 2
    assert "full-vocabulary KL" not in out
    # and export refuses them in one line, before it writes anything
    assert cli_main(["store", "export", config.run_root, str(tmp_path / "out"), "--tag", lossless_tag]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"kdflow: error: top-K shard 0 of ") and "was made from another token shard" in error
    assert not (tmp_path / "out").exists()


def test_bench_store_prints_one_json_line_per_setting(capsys: pytest.CaptureFixture[str]) -> None:
    """The synthetic mode end to end on a small vocabulary (the numbers are its output, not asserted here)."""
    from kdflow.bench.store import SETTINGS, main

    assert main(["--synthetic", "--vocab", "3000", "--rows", "1", "--repeats", "1"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[0]["vocab"] == 3000 and records[1]["setting"].startswith("v1")
    assert [r["setting"] for r in records[2:]] == [label for label, _ in SETTINGS]
    by_label = {r["setting"]: r for r in records[2:]}
    default, lossless = by_label["sqrt400/unigram (default)"], by_label["float32/unigram/tail32 (lossless)"]
    sizes = [r["bytes_per_position"] for r in (default, lossless, records[1])]
    assert default["invalid_positions"] == 0 and sizes == sorted(sizes)
    assert lossless["kl_buckets_lower_bound_mean"] < 1e-9 < default["kl_buckets_lower_bound_mean"]
    adaptive = by_label["sqrt400/unigram/keep0.99"]
    assert adaptive["mean_kept"] < 128
    assert adaptive["kl_teacher_store_mean"] > default["kl_teacher_store_mean"] > lossless["kl_teacher_store_mean"]
    # every byte of the store: the renumbering table (in the shard's schema and _renumbering.bin) included
    payload = default["ids_B"] + default["values_B"] + default["tail_B"]
    assert default["bytes_per_position"] > default["data_B"] > payload


def test_bench_store_training_comparison_runs(make_config: Callable[..., Any]) -> None:
    """The real bench's training half on the tiny teacher: same student on a v2 and a lossless store."""
    from kdflow.bench.store_train import RealStores, train_comparison

    config, summary = precomputed_run(make_config)
    lossless = make_config(dataset__max_documents=24, precompute__store__values="float32",
                           precompute__store__tail="float32")
    lossless_tag = precompute_shards(open_run_root(lossless), teacher_pass_settings(lossless))["tag"]
    stores = RealStores(config, lossless, summary["tag"], lossless_tag, 384, {})
    records = train_comparison(stores, steps=3)
    assert [r.get("student") for r in records[:2]] == ["v2 default", "lossless"]
    assert all(r["steps"] == 3 and r["heldout_sequences"] == config.precompute.sequences_per_shard for r in records[:2])
    comparison = records[2]
    assert comparison["heldout_kl_lossless"] > 0 and abs(comparison["relative_difference"]) < 0.05
    assert comparison["decode_to_train_ratio"] > 0
    # the store metric's dense pass: the tail's sum of p log p against a plain full forward of the teacher
    import torch

    from kdflow.bench.store_train import default_store_files, dense_tail_plogp, lossless_shards
    from kdflow.tasks.common.teacher_loading import load_teacher

    shards, _ = lossless_shards(stores)
    got = dense_tail_plogp(stores, shards)
    run_root = RunRoot(config.run_root)
    model = load_teacher(lossless.teacher, device="cpu")
    for shard_id, (ids, _, _) in enumerate(shards):
        rows = read_token_shard(run_root, f"{stage_dir(run_root, 'tokens')}/shard-{shard_id:05d}.arrow")
        with torch.no_grad():
            log_p = torch.log_softmax(model(torch.from_numpy(rows.astype(np.int64))).logits.double(), -1).numpy()
        terms = np.exp(log_p) * log_p
        np.put_along_axis(terms, ids.astype(np.int64), 0.0, -1)
        np.testing.assert_allclose(got[shard_id], terms.sum(-1), rtol=1e-4, atol=1e-6)
    assert set(default_store_files(stores)) == {"_store.json", "config.yaml"}
