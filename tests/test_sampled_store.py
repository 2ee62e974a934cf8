"""Sampled targets in the v2 store: the codec, the teacher pass writing them (byte-identical reruns), the data
loader and the training loop reading them, and the one-line errors of bad input."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from kdflow.schemas.codec import TopkCodec
from kdflow.schemas.codec_meta import Renumbering
from kdflow.schemas.codec_sampled import DecodedSampled, SampledCodec, SampledShard, decode_sampled, encode_sampled
from kdflow.schemas.commits import list_commits, stage_dir
from kdflow.schemas.config_io import config_from_dict
from kdflow.schemas.errors import ConfigError, KDFlowError, StoreError
from kdflow.schemas.layout import commit_file_name
from kdflow.schemas.shards import TopkShard, read_token_shard
from kdflow.schemas.stage_settings import materialise_settings, open_run_root, teacher_pass_settings, tokenise_settings
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import read_store_info
from kdflow.tasks.common.teacher_loading import load_teacher
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.corpus.tokenise import tokenise
from kdflow.tasks.teacher.precompute import precompute_shards
from kdflow.tasks.teacher.sampled_step import TeacherSampledStep
from kdflow.tasks.teacher.sampling import SamplingPlan


def random_targets(rows: int, seq_len: int, head: int, samples: int, vocab: int, seed: int = 0) -> DecodedSampled:
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((rows, seq_len, vocab)), -1)[..., :head + samples].astype(np.int32)
    logprobs = -np.sort(rng.exponential(3.0, (rows, seq_len, head + samples)), -1).astype(np.float32)
    tail = (np.log(rng.uniform(0.01, 0.5, (rows, seq_len))).astype(np.float32) if head
            else np.zeros((rows, seq_len), np.float32))
    threshold = rng.normal(-6.0, 2.0, (rows, seq_len)).astype(np.float32)
    threshold[0, 0], threshold[-1, -1] = -np.inf, 0.75  # the whole tail sampled; a positive log tau
    return DecodedSampled(ids[..., :head], logprobs[..., :head], tail, ids[..., head:], logprobs[..., head:], threshold)


def through_a_stream(codec: SampledCodec, targets: DecodedSampled) -> pa.Table:
    sink = io.BytesIO()
    with ipc.new_stream(sink, codec.schema()) as writer:
        writer.write_batch(encode_sampled(codec, targets))
    return ipc.open_stream(pa.BufferReader(sink.getvalue())).read_all()


def as_sets(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, -1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(values, order, -1)


@pytest.mark.parametrize(("head", "head_values", "sample_values"), [(5, "sqrt", "float16"), (5, "float32", "float32"),
                                                                    (0, "sqrt", "float16")])
@pytest.mark.parametrize("renumber", [False, True])
def test_codec_round_trips_ids_exactly_values_within_their_precision(head, head_values, sample_values,
                                                                     renumber) -> None:
    rows, seq_len, samples, vocab = 3, 7, 9, 70_000  # ids need escapes beyond 255 and a third byte plane
    targets = random_targets(rows, seq_len, head, samples, vocab)
    table = Renumbering(np.random.default_rng(1).permutation(vocab)) if renumber else None
    codec = SampledCodec(seq_len, head, samples, vocab, head_values=head_values, sample_values=sample_values,
                         tail="float32", renumbering=table)
    decoded = decode_sampled(through_a_stream(codec, targets))
    assert np.array_equal(decoded.head_ids, targets.head_ids)  # the head keeps its descending order
    got, want = (as_sets(decoded.sample_ids, decoded.sample_logprobs),
                 as_sets(targets.sample_ids, targets.sample_logprobs))
    assert np.array_equal(got[0], want[0])
    assert np.allclose(got[1], want[1], rtol=1e-3 if sample_values == "float16" else 0, atol=0)
    assert np.array_equal(decoded.log_threshold, targets.log_threshold)  # float32 bit for bit, -inf and > 0 too
    assert np.allclose(decoded.tail_logprob, targets.tail_logprob, rtol=1e-6, atol=0)
    if head and head_values == "float32":
        assert np.array_equal(decoded.head_logprobs, targets.head_logprobs)
    reloaded = SampledCodec.from_schema(codec.schema())
    assert reloaded == codec and reloaded.settings()["targets"] == ("hybrid" if head else "sampled")


def test_a_corrupt_row_is_named_and_the_top_k_reader_refuses_sampled_shards() -> None:
    codec = SampledCodec(4, 3, 5, 300)
    table = through_a_stream(codec, random_targets(3, 4, 3, 5, 300))
    column = table.column("sample_gap_token").to_pylist()
    column[1] = column[1][:-1] + bytes([column[1][-1] ^ 0xFF])
    broken = table.set_column(table.schema.get_field_index("sample_gap_token"), "sample_gap_token",
                              pa.array(column, pa.binary()))
    with pytest.raises(ValueError, match="^row 1: crc32 mismatch"):
        decode_sampled(broken)
    with pytest.raises(ValueError, match="holds 'hybrid' targets"):
        TopkCodec.from_schema(table.schema)
    with pytest.raises(ValueError, match="sample_ids must lie outside the head"):
        bad = random_targets(1, 4, 3, 5, 300)
        bad.sample_ids[0, 0, 0] = bad.head_ids[0, 0, 1]
        encode_sampled(codec, bad)


# --- the teacher pass, the loader, training -----------------------------------------------------------------


def prepare(config: Any) -> Any:
    materialise(open_run_root(config), materialise_settings(config), None)
    tokenise(open_run_root(config), tokenise_settings(config), load_tokenizer(config.teacher, config.tokenizer))
    return config


def sampled_config(make_config, targets: str = "hybrid", **overrides: Any) -> Any:
    sampling = {"head": 4, "samples": 6, "seed": 5} | overrides.pop("precompute__sampling", {})
    return make_config(**{"dataset__max_documents": 24, "precompute__targets": targets, "precompute__micro_batch": 3,
                          "precompute__sampling": sampling} | overrides)


@pytest.mark.parametrize("targets", ["hybrid", "sampled"])
def test_the_pass_writes_what_the_sampler_draws_and_a_rerun_writes_the_same_bytes(make_config, targets) -> None:
    config = prepare(sampled_config(make_config, targets))
    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    run_root = RunRoot(config.run_root)
    store = stage_dir(run_root, "topk", summary["tag"])
    info = read_store_info(run_root, store)
    assert info.targets == targets and info.store_format()["sampling"]["head"] == (4 if targets == "hybrid" else 0)
    assert info.codec["codec"] == "kdflow.sampled.v2" and summary["complete"]
    model = load_teacher(config.teacher)
    step = TeacherSampledStep(model, SamplingPlan.from_config(config.precompute), chunk_tokens=50)
    records = list_commits(run_root, store, "topk", summary["tag"])
    for shard_id, record in records.items():
        input_ids = read_token_shard(run_root, f"{stage_dir(run_root, 'tokens')}/shard-{shard_id:05d}.arrow",
                                     config.seq_len)
        stored = SampledShard(run_root, f"{store}/{record.data_file}", config.seq_len).read()
        for start in range(0, len(input_ids), 3):  # the pass's micro-batches: 3 rows, the last one padded
            batch = np.zeros((3, config.seq_len), np.int64)
            batch[:len(input_ids[start:start + 3])] = input_ids[start:start + 3]
            drawn = step(torch.from_numpy(batch), shard=shard_id, first_row=start)
            rows = slice(start, min(start + 3, len(input_ids)))
            n = rows.stop - rows.start
            head, exact_head = (as_sets(t.head_ids[rows] if t is stored else t.head_ids[:n].numpy(),
                                        t.head_logprobs[rows] if t is stored else t.head_logprobs[:n].numpy())
                                for t in (stored, drawn))  # sqrt-quantised values: equal levels may swap order
            assert np.array_equal(head[0], exact_head[0])
            root_error = np.abs(np.exp(head[1] / 2) - np.exp(exact_head[1] / 2))  # the documented sqrt bound
            assert root_error.max(initial=0.0) <= 0.5 / config.precompute.store.levels + 1e-6
            assert np.array_equal(stored.log_threshold[rows], drawn.log_threshold[:n].numpy())
            got = as_sets(stored.sample_ids[rows], stored.sample_logprobs[rows])
            want = as_sets(drawn.sample_ids[:n].numpy(), drawn.sample_logprobs[:n].numpy())
            assert np.array_equal(got[0], want[0]) and np.allclose(got[1], want[1], rtol=1e-3, atol=0)
            assert np.allclose(stored.tail_logprob[rows], drawn.tail_logprob[:n].numpy(), rtol=1e-3, atol=1e-6)
    before = run_root.read_bytes(f"{store}/shard-00001.arrow")
    run_root.remove(f"{store}/{commit_file_name('topk', 1)}")  # as after a crash: the shard is computed again
    assert precompute_shards(open_run_root(config), teacher_pass_settings(config))["written"] == 1
    assert run_root.read_bytes(f"{store}/shard-00001.arrow") == before


def test_the_fingerprint_names_the_kind_and_its_parameters(make_config) -> None:
    from kdflow.schemas.fingerprints import topk_fingerprint

    tags = {topk_fingerprint("teacher", "tokens", sampled_config(make_config, kind, precompute__sampling=sampling))
            for kind in ("hybrid", "sampled") for sampling in ({"seed": 1}, {"seed": 2}, {"samples": 7},
                                                               {"scheme": "gumbel"})}
    assert len(tags | {topk_fingerprint("teacher", "tokens", make_config())}) == 9


def test_training_reads_sampled_targets_and_a_top_k_config_on_them_is_an_error(make_config) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.data import open_distill_data
    from kdflow.tasks.student.train import train

    config = prepare(sampled_config(make_config, student__steps=2, student__eval_shards=1))
    tag = precompute_shards(open_run_root(config), teacher_pass_settings(config))["tag"]
    data = open_distill_data(open_run_root(config), training_settings(config),
                             load_tokenizer(config.teacher, config.tokenizer))
    batch = data.train_batch(np.arange(2))
    assert batch.topk_ids.shape == (2, 32, 4) and [t.shape for t in batch.samples] == [(2, 32, 6), (2, 32, 6), (2, 32)]
    summary = train(open_run_root(config), training_settings(config))
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    assert 0.0 <= summary["eval_after"]["top1_agreement"] <= 1.0 and summary["eval_after"]["kl"] > 0
    as_top_k = config.model_copy(update={"precompute": config.precompute.model_copy(update={"targets": "topk"}),
                                         "student": config.student.model_copy(
                                             update={"topk_tag": tag, "name": "other"})})
    with pytest.raises(StoreError) as error:
        train(open_run_root(as_top_k), training_settings(as_top_k))
    message = str(error.value)
    assert ("\n" not in message and "holds hybrid H4+S6 (priority, seed 5)" in message
            and "precompute.targets" in message)


def test_training_on_sampled_only_targets_reports_top1_as_not_available(make_config) -> None:
    """Sampled-only targets have no teacher argmax: top-1 agreement is None, and every place that shows it says n/a."""
    import logging

    from kdflow.flows.train import training_report
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config = prepare(sampled_config(make_config, "sampled", student__steps=2, student__eval_shards=1))
    precompute_shards(open_run_root(config), teacher_pass_settings(config))
    # The monitor's own logger, whatever an earlier test's logging set-up did to its handlers, level or state.
    logger, lines = logging.getLogger("kdflow.train"), []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    saved = logger.level, logger.disabled
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.disabled = False
    try:
        summary = train(open_run_root(config), training_settings(config))
    finally:
        logger.removeHandler(handler)
        logger.level, logger.disabled = saved
    assert summary["steps"] == 2 and summary["eval_after"]["top1_agreement"] is None and summary["eval_after"]["kl"] > 0
    log = "\n".join(lines)
    assert "held-out at step 2: KL" in log and "top-1 agreement n/a" in log
    report = training_report(summary, [])
    assert "| after (step 2) |" in report and "| n/a |" in report


def test_bad_settings_fail_before_any_work_with_one_line(make_config, tmp_path) -> None:
    config = prepare(make_config(dataset__max_documents=8, precompute__targets="hybrid",
                                 precompute__sampling={"head": 300, "samples": 100}))  # the tiny teacher has 384 ids
    with pytest.raises(ConfigError,
                       match=r"^precompute.sampling.head \+ samples = 300 \+ 100 must be <= the teacher's"):
        precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert not (tmp_path / "run" / "topk").exists() or not any((tmp_path / "run" / "topk").iterdir())
    base = json.loads(make_config().model_dump_json())
    for change, phrase in [({"precompute": {"targets": "sampled"}, "student": {"kd": {"temperature": 2.0}}},
                            "student.kd.temperature=2.0 needs precompute.targets: topk"),
                           ({"precompute": {"targets": "hybrid", "store": {"format": "v1"}}},
                            "precompute.targets=hybrid needs precompute.store.format: v2"),
                           ({"precompute": {"sampling": {"samples": 0}}}, "'precompute.sampling.samples'")]:
        data = json.loads(json.dumps(base))
        for section, values in change.items():
            for key, value in values.items():
                data[section][key] = value if not isinstance(value, dict) else {**data[section].get(key, {}), **value}
        with pytest.raises(KDFlowError) as error:
            config_from_dict(data)
        assert phrase in str(error.value) and "\n" not in str(error.value)


def test_top_k_reader_and_sampled_reader_reject_each_others_shards(make_config) -> None:
    config = prepare(sampled_config(make_config, "sampled", dataset__max_documents=8))
    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    run_root = RunRoot(config.run_root)
    path = f"{stage_dir(run_root, 'topk', summary['tag'])}/shard-00000.arrow"
    with pytest.raises(StoreError, match="holds 'sampled' targets"):
        TopkShard(run_root, path, config.seq_len)
    decoded = SampledShard(run_root, path, config.seq_len).read([1, 0])
    assert decoded.head_ids.shape == (2, 32, 0) and (decoded.tail_logprob == 0).all()


def test_validate_checks_sampled_stores_by_their_own_contract(make_config, capsys) -> None:
    from kdflow.commands.validate import validate_run_root
    from kdflow.schemas.codec_sampled import sampled_problems

    config = prepare(sampled_config(make_config, dataset__max_documents=8))
    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out
    # The store report: the pass re-ran a few rows (same micro-batches, same seed) and drew the same samples.
    fidelity = summary["fidelity"]
    assert fidelity["positions_with_other_samples"] == 0 and fidelity["kl_buckets_lower_bound_mean"] < 1e-3
    # the store metric
    assert fidelity["kl_teacher_store_mean"] > 0 and fidelity["kl_teacher_store_infinite_positions"] == 0
    from kdflow.commands.store_report import store_report
    from kdflow.tasks.teacher.store_quality import report_markdown

    (report,) = store_report(config.run_root, kl_rows=2)
    assert report["targets"] == "hybrid" and report["head"] == 4 and report["samples"] == 6
    assert report["positions_with_other_samples"] == 0 and 0.5 < report["weight_sum_over_tail_mean"] < 1.5
    assert "hybrid H4+S6 (priority, seed 5)" in report_markdown(report)
    good = random_targets(2, 4, 3, 5, 300)
    head = good.head_logprobs.astype(np.float64) - 3.0  # p = exp(-3 - ...): the head holds < 15% of the mass
    good = good._replace(head_logprobs=head.astype(np.float32),
                         tail_logprob=np.log1p(-np.exp(head).sum(-1)).astype(np.float32))
    assert sampled_problems(good, 300) == []
    twice = good._replace(sample_ids=good.sample_ids.copy())
    twice.sample_ids[1, 2, 0] = twice.head_ids[1, 2, 0]
    assert sampled_problems(twice, 300) == ["an id appears twice among head and samples at row 1, position 2"]
    assert "not 1, at row 0, position 0" in sampled_problems(good._replace(tail_logprob=good.tail_logprob - 1), 300)[0]


def test_a_store_drawn_with_kdflow_1_keeps_its_tag_and_trains_under_the_new_default(make_config, caplog) -> None:
    """kdflow.2 became the default draw: a kdflow.1 store keeps the tag it was made under (to finish it, set
    hash_version: kdflow.1), precompute under the default makes another store and says how to finish the old one,
    and training reads either."""
    from kdflow.schemas.config import PrecomputeConfig
    from kdflow.schemas.fingerprints import topk_fingerprint_of
    from kdflow.schemas.stage_settings import training_settings
    from kdflow.tasks.student.train import train

    # the tags of the default hybrid and sampled configs before kdflow.2 existed
    old = {"hybrid": "0793e72b2dfb", "sampled": "f3646e3f657c"}
    for kind, tag in old.items():
        pre = PrecomputeConfig(targets=kind, sampling={"hash_version": "kdflow.1"})
        assert topk_fingerprint_of("teacherfp", "tokensfp", pre) == tag
        assert topk_fingerprint_of("teacherfp", "tokensfp", PrecomputeConfig(targets=kind)) != tag

    first = prepare(sampled_config(make_config, precompute__sampling={"hash_version": "kdflow.1"},
                                   student__steps=1, student__eval_shards=1))
    old_tag = precompute_shards(open_run_root(first), teacher_pass_settings(first))["tag"]
    now = first.model_copy(update={"precompute": first.precompute.model_copy(update={
        "sampling": first.precompute.sampling.model_copy(update={"hash_version": "kdflow.2"})})})
    summary = train(open_run_root(now), training_settings(now))  # the only store: drawn with kdflow.1
    assert summary["steps"] == 1
    with caplog.at_level("WARNING", logger="kdflow.precompute"):
        new_tag = precompute_shards(open_run_root(now), teacher_pass_settings(now))["tag"]
    said = [r.getMessage() for r in caplog.records if "drawn with kdflow.1 noise" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("set precompute.sampling.hash_version: kdflow.1"), said
    run_root = RunRoot(first.run_root)
    infos = {tag: read_store_info(run_root, stage_dir(run_root, "topk", tag)) for tag in (old_tag, new_tag)}
    assert old_tag != new_tag
    assert [infos[tag].store_format()["sampling"]["hash_version"] for tag in (old_tag, new_tag)] == [
        "kdflow.1", "kdflow.2"]
    assert [infos[tag].codec["hash_version"] for tag in (old_tag, new_tag)] == ["kdflow.1", "kdflow.2"]
