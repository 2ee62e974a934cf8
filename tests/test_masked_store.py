"""Top-K stores with a per-position target mask and with top_k normalisation (codec kdflow.topk.v3): the codec
round trip, the settings and fingerprints of unmasked stores unchanged, the store-level checks, and a tiny student
trained on a masked store whose KD ignores the positions without a target."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from support.runs import precomputed_run, store_of
import torch

from kdflow.commands.validate import validate_run_root
from kdflow.schemas.codec import CODEC_NAME, CODEC_NAME_V3, TopkCodec, decode, encode
from kdflow.schemas.commits import CommitRecord, list_commits, write_commit
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.layout import commit_file_name
from kdflow.schemas.shards import TopkShard
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings, training_settings
from kdflow.schemas.storage import RunRoot, sha256_of
from kdflow.schemas.store_info import format_mismatch, read_store_info, write_store_info
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.student.data import open_distill_data
from kdflow.tasks.student.losses import fused_topk_kl
from kdflow.tasks.teacher.store_codec import store_codec


def teacher_rows(rows: int, seq_len: int, top_k: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, seq_len, vocab)) * 2
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-log_p, -1)[..., :top_k].astype(np.int32)
    top = np.take_along_axis(log_p, ids, -1)
    rest = np.log(np.exp(log_p).sum(-1) - np.exp(top).sum(-1))
    return ids, top.astype(np.float32), rest.astype(np.float32)


@pytest.mark.parametrize("settings", [{"values": "float32"}, {"values": "sqrt", "keep_mass": 0.9},
                                      {"values": "float16", "tail": "float32"}])
def test_masked_round_trip_with_an_all_false_row(settings: dict[str, Any]) -> None:
    ids, logprobs, tail = teacher_rows(4, 11, 5, 300)
    target = np.random.default_rng(1).random((4, 11)) < 0.5
    target[2] = False
    target[3] = True
    codec = TopkCodec(11, 5, 300, masked=True, **settings)
    garbage = ids.copy()
    garbage[~target] = -7  # positions without a target may hold anything
    decoded = decode(encode(codec, garbage, np.where(target[..., None], logprobs, np.nan), tail, target))
    plain = decode(encode(TopkCodec(11, 5, 300, **settings), ids, logprobs, tail))
    assert decoded.target.dtype == bool and np.array_equal(decoded.target, target)
    assert (decoded.ids[~target] == -1).all() and np.isneginf(decoded.logprobs[~target]).all()
    assert np.isneginf(decoded.tail[~target]).all() and (decoded.kept[~target] == 0).all()
    for mine, theirs in zip(decoded[:4], plain[:4], strict=True):  # the targeted positions as an unmasked store's
        assert np.array_equal(mine[target], theirs[target])
    assert plain.target is None


def test_top_k_normalisation_stores_no_tail_and_decodes_it_as_nan() -> None:
    ids, logprobs, _ = teacher_rows(3, 7, 4, 90)
    renormalised = logprobs - np.log(np.exp(logprobs.astype(np.float64)).sum(-1, keepdims=True)).astype(np.float32)
    codec = TopkCodec(7, 4, 90, values="float32", normalisation="top_k")
    batch = encode(codec, ids, renormalised, None)
    assert "tail" not in batch.schema.names and codec.settings()["codec"] == CODEC_NAME_V3
    decoded = decode(batch)
    assert np.isnan(decoded.tail).all() and np.array_equal(decoded.logprobs, renormalised)
    with pytest.raises(ValueError, match="keep_mass"):
        TopkCodec(7, 4, 90, normalisation="top_k", keep_mass=0.9)
    with pytest.raises(ValueError, match="stores no mask"):
        encode(TopkCodec(7, 4, 90), ids, logprobs, np.zeros((3, 7)), np.zeros((3, 7), bool))


@pytest.mark.parametrize("normalisation", ["full", "top_k"])
def test_keep_mass_1_keeps_every_entry_but_the_padding_of_a_position_that_held_fewer(normalisation: str) -> None:
    ids, logprobs, tail = teacher_rows(3, 7, 5, 90, seed=2)
    kept = np.random.default_rng(3).integers(1, 6, (3, 7))
    pad = np.arange(5) >= kept[..., None]
    logprobs[..., 1:] = -800.0 - np.arange(4)  # no float64 mass: kept all the same
    ids, logprobs = np.where(pad, -1, ids), np.where(pad, -np.inf, logprobs).astype(np.float32)
    codec = TopkCodec(7, 5, 90, values="float32", keep_mass=1.0, normalisation=normalisation)
    decoded = decode(encode(codec, ids, logprobs, None if normalisation == "top_k" else tail))
    assert np.array_equal(decoded.kept, kept) and np.array_equal(decoded.ids, ids)
    assert np.array_equal(decoded.logprobs, logprobs)
    if normalisation == "full":  # nothing was dropped, so nothing joined the tail
        assert np.array_equal(decoded.tail, tail.astype(np.float16).astype(np.float32))
    with pytest.raises(ValueError, match="fewer than top_k entries"):  # without per-position counts: refused
        encode(TopkCodec(7, 5, 90, values="float32"), ids, logprobs, tail)


def test_unmasked_full_settings_are_exactly_v2_and_v3_names_what_it_holds() -> None:
    assert TopkCodec(16, 8, 1000).settings() == {
        "codec": CODEC_NAME, "seq_len": 16, "top_k": 8, "vocab_size": 1000, "values": "sqrt", "levels": 400,
        "tail": "float16", "keep_mass": None, "zstd_level": 1, "renumbering": None}
    assert TopkCodec(16, 8, 1000).settings_json() == (
        '{"codec":"kdflow.topk.v2","keep_mass":null,"levels":400,"renumbering":null,"seq_len":16,"tail":"float16",'
        '"top_k":8,"values":"sqrt","vocab_size":1000,"zstd_level":1}')
    masked = TopkCodec(16, 8, 1000, masked=True)
    assert masked.settings()["codec"] == CODEC_NAME_V3 and masked.settings()["masked"] is True
    assert TopkCodec.from_schema(masked.schema()) == masked  # the shard's metadata names the v3 codec
    assert masked.schema().metadata[b"kdflow.format"] == b"2"  # same container: v2 readers refuse it by its codec
    assert TopkCodec.from_schema(TopkCodec(16, 8, 1000).schema()).settings() == TopkCodec(16, 8, 1000).settings()


def rewrite_masked(run_root: RunRoot, store: str, tag: str, normalisation: str = "full") -> np.ndarray:
    """The store's shards re-encoded with a target mask (the first 3 positions of each row and the whole of one
    row without a target), records and _store.json updated -> the mask of shard 0, (rows, T). `top_k`: the
    log-probs renormalised over the K, as such a source holds them."""
    info = read_store_info(run_root, store)
    masks = {}
    for shard_id, record in list_commits(run_root, store, "topk", tag).items():
        path = f"{store}/{record.data_file}"
        shard = TopkShard(run_root, path)
        codec = TopkCodec(**{**shard.codec.__dict__, "masked": True, "normalisation": normalisation})
        full = shard.read()
        if normalisation == "top_k":
            norm = np.log(np.exp(full.logprobs.astype(np.float64)).sum(-1, keepdims=True))
            full = full._replace(logprobs=(full.logprobs - norm).astype(np.float32))
        target = np.ones(full.ids.shape[:2], bool)
        target[:, :3] = False
        target[0] = False
        masks[shard_id] = target
        with open(run_root.local_path(path), "rb") as handle:
            sizes = [batch.num_rows for batch in ipc.open_stream(handle)]
        with pa.OSFile(run_root.local_path(path), "wb") as sink, ipc.new_stream(sink, codec.schema()) as writer:
            for start, size in zip(np.cumsum([0] + sizes[:-1]).tolist(), sizes, strict=True):
                part = slice(start, start + size)  # the same record batches (precompute's micro-batches)
                writer.write_batch(encode(codec, full.ids[part], full.logprobs[part], full.tail[part], target[part]))
        record = CommitRecord.model_validate_json(run_root.read_bytes(f"{store}/{commit_file_name('topk', shard_id)}"))
        extra = record.extra.model_copy(update={"codec": codec.settings()})
        write_commit(run_root, store, record.model_copy(update={"bytes": run_root.size(path), "extra": extra,
                                                                "sha256": sha256_of(run_root, path)}))
    write_store_info(run_root, store, info.model_copy(update={"codec": codec.settings()}))
    return masks[0]


def test_training_on_a_masked_store_skips_positions_without_a_target(make_config: Callable[..., Any],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow.tasks.student.train import train

    config, summary = precomputed_run(make_config, precompute__store__values="float32")
    run_root, store = store_of(config, summary["tag"])
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    before = open_distill_data(open_run_root(config), training_settings(config), tokenizer)
    rows = np.array([0, 1, 2, before.train_rows - 1])
    full = before.train_batch(rows)
    assert full.target is None
    full_eval = [before.load(rows) for rows in before.eval_batches(4)]  # the held-out rows, unmasked
    mask = rewrite_masked(run_root, store, summary["tag"])
    info = read_store_info(run_root, store)
    assert info.masked and info.normalisation == "full" and format_mismatch(info, config.precompute, "s") is None
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out  # no mass is missing where no target
    data = open_distill_data(open_run_root(config), training_settings(config), tokenizer)
    batch = data.train_batch(rows)
    expected = np.stack([mask[row] for _, row in data.locate(rows)]) if all(
        pair.shard_id == 0 for pair, _ in data.locate(rows)) else None
    assert batch.target is not None and not batch.target[:, :3].any() and batch.target[:, 3:].any()
    if expected is not None:
        assert np.array_equal(batch.target.numpy(), expected)
    targeted = batch.target
    assert torch.equal(batch.topk_ids[targeted], full.topk_ids[targeted])
    assert (batch.topk_ids[~targeted] == -1).all()
    # The loss on the masked batch is the unmasked store's loss over the targeted positions only.
    gen = torch.Generator().manual_seed(0)
    vocab = int(info.codec["vocab_size"])
    hidden, weight = torch.randn(targeted.numel(), 8, generator=gen), torch.randn(vocab, 8, generator=gen)
    masked_kd = fused_topk_kl(hidden, weight, batch.topk_ids.flatten(0, 1), batch.topk_logprobs.flatten(0, 1),
                              tail_logprob=batch.tail_logprob.flatten(), target=targeted.flatten())
    reference = fused_topk_kl(hidden, weight, full.topk_ids.flatten(0, 1), full.topk_logprobs.flatten(0, 1),
                              tail_logprob=full.tail_logprob.flatten(), mask=targeted.flatten())
    torch.testing.assert_close(masked_kd, reference)
    check_evaluation_skips_untargeted_positions(config, full_eval, data, tokenizer)
    result = train(open_run_root(config), training_settings(config))
    assert result["steps"] == config.student.steps
    assert np.isfinite(result["eval_after"]["kl"]) and np.isfinite(result["eval_after"]["ce"])


def check_evaluation_skips_untargeted_positions(config: Any, full_eval: list, data: Any, tokenizer: Any) -> None:
    """evaluate() on the masked store = KD and CE of the unmasked store's held-out rows over targeted positions."""
    from kdflow.tasks.common.models import model_body, output_layer
    from kdflow.tasks.student.model import build_student
    from kdflow.tasks.student.steps import DistillLoss, evaluate, next_token_labels

    model = build_student(config.student, config.seq_len, tokenizer)
    got = evaluate(DistillLoss(model), data, config.student, torch.device("cpu"))
    sums = np.zeros(4)  # kd, ce, targeted positions, targeted positions with a label
    with torch.no_grad():
        for rows, full in zip(data.eval_batches(4), full_eval, strict=True):
            target = data.load(rows).target
            hidden = model_body(model)(input_ids=full.input_ids).last_hidden_state.flatten(0, 1)
            _, kd, ce = fused_topk_kl(hidden, output_layer(model).weight, full.topk_ids.flatten(0, 1),
                                      full.topk_logprobs.flatten(0, 1), tail_logprob=full.tail_logprob.flatten(),
                                      mask=target.flatten(), labels=next_token_labels(full.input_ids).flatten(),
                                      global_counts=(1, 1), return_parts=True)
            sums += [float(kd), float(ce), float(target.sum()), float(target[:, :-1].sum())]
    assert got["kl"] == pytest.approx(sums[0] / sums[2], rel=1e-5)
    assert got["ce"] == pytest.approx(sums[1] / sums[3], rel=1e-5)


def test_a_top_k_store_trains_with_the_renormalised_loss_and_warns_once(
        make_config: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    from kdflow.tasks.student.train import train

    config, summary = precomputed_run(make_config, precompute__store__values="float32")
    run_root, store = store_of(config, summary["tag"])
    rewrite_masked(run_root, store, summary["tag"], normalisation="top_k")
    info = read_store_info(run_root, store)
    write_store_info(run_root, store, info.model_copy(update={"imported": {"tail": "computed"}}))  # as an import
    info = read_store_info(run_root, store)
    assert info.normalisation == "top_k" and format_mismatch(info, config.precompute, "s") is None
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    with caplog.at_level("WARNING", logger="kdflow.train"):
        data = open_distill_data(open_run_root(config), training_settings(config), tokenizer)
        open_distill_data(open_run_root(config), training_settings(config), tokenizer)
    warned = [r for r in caplog.records if "renormalised over K: training with the renormalised-K loss" in r.message]
    assert len(warned) == 1 and data.stores.normalisation == "top_k"
    assert not [r for r in caplog.records if "tail is 1 - sum(p)" in r.message]  # it stores no tail at all
    batch = data.train_batch(np.array([1, 2]))
    assert torch.isnan(batch.tail_logprob).all()  # unknown, never a zero tail
    mass = batch.topk_logprobs.double().exp().sum(-1)
    torch.testing.assert_close(mass[batch.target], torch.ones_like(mass[batch.target]), rtol=0, atol=1e-5)
    result = train(open_run_root(config), training_settings(config))
    assert result["steps"] == config.student.steps and np.isfinite(result["eval_after"]["kl"])


def test_v1_stores_cannot_hold_a_mask(make_config: Callable[..., Any]) -> None:
    config = make_config(precompute__store__format="v1")
    with pytest.raises(ConfigError, match="precompute.store.format: v2"):
        store_codec(teacher_pass_settings(config), RunRoot(config.run_root), "topk/x", None, 100, masked=True)
    with pytest.raises(ConfigError, match="keep_mass: null"):
        store_codec(teacher_pass_settings(make_config(precompute__store__keep_mass=0.9)), RunRoot(config.run_root),
                    "topk/x", None, 100, normalisation="top_k")


def test_untargeted_ce_weight_joins_the_resume_fingerprint_only_when_set(make_config: Callable[..., Any]) -> None:
    from kdflow.schemas.fingerprints import student_resume_fields

    default = student_resume_fields(make_config().student)
    assert default["kd"] == {"kd_weight": 1.0, "temperature": 1.0}  # as before the key existed
    assert student_resume_fields(make_config(student__kd__untargeted_ce_weight=0.5).student)["kd"] == {
        "kd_weight": 1.0, "temperature": 1.0, "untargeted_ce_weight": 0.5}


@pytest.mark.parametrize("normalisation", ["full", "top_k"])
def test_the_store_report_counts_positions_with_a_target_and_shows_no_tail_it_does_not_know(
        make_config: Callable[..., Any], normalisation: str) -> None:
    from kdflow.tasks.teacher.store_quality import report_markdown, store_summary

    config, summary = precomputed_run(make_config, precompute__store__values="float32")
    run_root, store = store_of(config, summary["tag"])
    before = store_summary(run_root, summary["tag"], rows=10_000)
    rewrite_masked(run_root, store, summary["tag"], normalisation=normalisation)
    after = store_summary(run_root, summary["tag"], rows=10_000)  # every row
    untargeted = after["positions_without_target"]
    assert untargeted > 0 and after["sampled_positions"] + untargeted == before["sampled_positions"]
    assert sum(after["kept_histogram"].values()) == after["sampled_positions"]
    if normalisation == "full":  # the positions with a target, as they were
        assert after["tail_mass_histogram"]["0"] == before["tail_mass_histogram"]["0"]  # no target is no zero tail
        assert after["invalid_tails"] == 0
        assert sum(after["tail_mass_histogram"].values()) == after["sampled_positions"]
    else:
        assert after["mean_tail_mass"] is None and after["tail_mass_histogram"] is None and after["invalid_tails"] == 0
        assert "unknown: log-probs renormalised over the K" in report_markdown(after)
        assert ", no tail (log-probs renormalised over the K), " in after["format_label"] and "tail float" not in \
            after["format_label"]
