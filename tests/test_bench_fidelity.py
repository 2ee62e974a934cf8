"""`kdflow bench fidelity`: the t interval against hand-computed cases, the verdicts on both sides of a bound, the
summary on literal runs, stored results that a rerun skips, and the dense evaluation against a full forward."""

from __future__ import annotations

import math

import pytest

from kdflow.bench.fidelity_stats import (MET, NOT_MET, NOT_RESOLVED, paired_interval, t_quantile, t_two_sided,
                                         verdict)
from kdflow.bench.fidelity_summary import print_table, summarise


def test_t_quantiles_are_the_tables():
    # Two-sided 95% and 90% points of Student's t from printed tables (e.g. Fisher & Yates).
    for df, t95, t90 in ((1, 12.7062, 6.3138), (2, 4.3027, 2.9200), (3, 3.1824, 2.3534), (4, 2.7764, 2.1318),
                         (9, 2.2622, 1.8331), (30, 2.0423, 1.6973)):
        assert t_quantile(0.95, df) == pytest.approx(t95, abs=1e-4)
        assert t_quantile(0.90, df) == pytest.approx(t90, abs=1e-4)
    assert t_two_sided(1.0, 1) == pytest.approx(0.5)  # Cauchy: P(|T| < 1) = 2 atan(1) / pi
    assert t_two_sided(math.sqrt(2.0), 2) == pytest.approx(1 / math.sqrt(2.0))  # df 2: t / sqrt(2 + t^2)


def test_paired_interval_by_hand():
    # d = 0.1, 0.2, 0.3: mean 0.2, sd 0.1, se 0.1 / sqrt(3) = 0.0577350; t(0.975, 2) = 4.302653; half 0.248414.
    interval = paired_interval([0.1, 0.2, 0.3])
    assert interval["mean"] == pytest.approx(0.2) and interval["sd"] == pytest.approx(0.1)
    assert interval["half_width"] == pytest.approx(0.248414, abs=1e-6)
    assert (interval["low"], interval["high"]) == pytest.approx((-0.048414, 0.448414), abs=1e-6)
    # d = -0.02, -0.01: mean -0.015, sd 0.00707107, se 0.005; t(0.975, 1) = 12.706205; half 0.0635310.
    assert paired_interval([-0.02, -0.01])["high"] == pytest.approx(0.0485310, abs=1e-6)
    one = paired_interval([0.5])
    assert one["mean"] == 0.5 and one["low"] is None and verdict(one, at_most=1.0) == NOT_RESOLVED


def test_a_target_is_met_only_beyond_the_interval():
    at_most = [([0.001, 0.002, 0.003], MET), ([0.005, 0.01, 0.02], NOT_RESOLVED), ([0.02, 0.021, 0.022], NOT_MET)]
    for differences, expected in at_most:
        assert verdict(paired_interval(differences), at_most=0.01) == expected, differences
    at_least = [([0.3, 0.35, 0.4], MET), ([-0.1, 0.2, 0.5], NOT_RESOLVED), ([-0.3, -0.35, -0.4], NOT_MET)]
    for differences, expected in at_least:
        assert verdict(paired_interval(differences), at_least=0.0) == expected, differences
    # Two-sided: inside both bounds, or wholly outside one of them.
    assert verdict(paired_interval([0.001, -0.001, 0.0]), at_most=0.01, at_least=-0.01) == MET
    assert verdict(paired_interval([-0.05, -0.04, -0.045]), at_most=0.01, at_least=-0.01) == NOT_MET


SEEDS = (0, 1, 2)
KL = {"topk128": (1.00, 0.90, 1.10), "codec": (1.002, 0.901, 1.101), "hybrid": (1.05, 0.96, 1.16),
      "sampled": (1.05, 0.95, 1.15), "online": (0.95, 0.85, 1.05), "ce": (2.0, 1.9, 2.1)}
CE = {"topk128": (5.00, 4.90, 5.10), "codec": (5.00, 4.91, 5.10), "hybrid": (5.05, 4.92, 5.12),
      "sampled": (5.10, 5.00, 5.2), "online": (4.95, 4.90, 5.0), "ce": (5.5, 5.4, 5.6)}


def runs() -> list[dict]:
    stores = [{"kind": "store", "store": "topk128", "bytes_per_position": 560.0},
              {"kind": "store", "store": "codec", "bytes_per_position": 200.0}]
    stores += [{"kind": "store", "store": f"{kind}-seed{seed}", "bytes_per_position": size}
               for kind, size in (("hybrid", 70.0), ("sampled", 66.0)) for seed in SEEDS]
    return stores + [{"kind": "run", "variant": v, "seed": seed, "heldout_ce": CE[v][seed], "heldout_kl": KL[v][seed],
                      "heldout_top1_agreement": 0.5, "train_seconds": 1.0,
                      "curve": [{"step": 0, "heldout_kl": 9.0}, {"step": 4, "heldout_kl": KL[v][seed]}]}
                     for seed in SEEDS for v in ("topk128", "codec", "hybrid", "sampled", "online", "ce")]


def test_summary_pairs_seeds_names_both_byte_ratios_and_judges_targets(capsys: pytest.CaptureFixture[str]) -> None:
    variants = ["topk128", "codec", "hybrid", "sampled", "online", "ce"]
    summary = summarise(runs(), variants)
    by = {r.get("variant", r.get("target", r["kind"])): r for r in summary}
    hybrid = by["hybrid"]
    assert hybrid["bytes_over_default_codec_topk128"] == pytest.approx(0.35)
    assert hybrid["bytes_over_lossless_topk128"] == pytest.approx(0.125)
    assert hybrid["kl_minus_topk128_per_seed"] == pytest.approx([0.05, 0.06, 0.06])
    # hybrid is 5.0% / 6.7% / 5.5% worse than top-128 on every seed: the interval is wholly above +1%.
    assert by["hybrid_kl_within_1pct_of_topk128"]["verdict"] == NOT_MET
    assert by["hybrid_bytes_at_most_40pct_of_default_codec"]["verdict"] == MET
    assert by["topk128_ahead_of_ce_only_heldout_kl"]["verdict"] == MET
    # codec: +0.2% / +0.11% / +0.09%: inside +-1% with its interval.
    assert by["codec_kl_within_1pct_of_topk128"]["verdict"] == MET
    assert by["curves"]["heldout_kl_by_step"]["ce"][1] == {"step": 4, "heldout_kl": pytest.approx(2.0),
                                                           "per_seed": {0: 2.0, 1: 1.9, 2: 2.1}}
    print_table(summary)
    out = capsys.readouterr().out
    assert "hybrid_kl_within_1pct_of_topk128" in out and "-> NOT met" in out and "35.0%" in out


def test_a_seed_missing_from_one_variant_leaves_the_target_unresolved():
    partial = [r for r in runs() if not (r["kind"] == "run" and r["variant"] == "hybrid" and r["seed"] > 0)]
    by = {r.get("target"): r for r in summarise(partial, ["topk128", "hybrid"]) if r["kind"] == "target"}
    assert by["hybrid_kl_within_1pct_of_topk128"]["per_seed"] == pytest.approx([0.05])
    assert by["hybrid_kl_within_1pct_of_topk128"]["verdict"] == NOT_RESOLVED


def test_a_rerun_skips_stored_results(make_config, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variant x seed is a stored result: a second call trains nothing and loads no teacher; a changed
    setting is another result; --max-new-runs bounds one call's work."""
    from support.runs import prepare

    from kdflow.bench import fidelity, fidelity_runs
    from kdflow.bench.fidelity_results import Results
    from kdflow.tasks.common import teacher_loading

    base = prepare(make_config(dataset__max_documents=16, student__steps=2, student__eval_shards=1))
    args, variants, seeds = fidelity.parse(["--steps", "2", "--seeds", "0,1", "--variants", "topk128,ce",
                                            "--eval-every", "1"])
    results = Results(tmp_path / "bench")
    first = fidelity.run_benchmark(args, base, results, variants, seeds)
    trained = [r for r in first if r["kind"] == "run"]
    assert [(r["variant"], r["seed"]) for r in trained] == [("topk128", 0), ("ce", 0), ("topk128", 1), ("ce", 1)]
    assert all([p["step"] for p in r["curve"]] == [0, 1, 2] for r in trained)
    assert len(list(results.folder.glob("*.json"))) == 5  # four runs and the teacher's held-out CE

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a stored result was computed again")

    monkeypatch.setattr(fidelity_runs, "train_with_curve", refuse)
    monkeypatch.setattr(teacher_loading, "load_teacher", refuse)
    again = fidelity.run_benchmark(args, base, results, variants, seeds)
    assert [r for r in again if r["kind"] == "run"] == trained
    assert all(r["written_now"] == 0 for r in again if r["kind"] == "store")
    monkeypatch.undo()
    bounded_args, *_ = fidelity.parse(["--steps", "2", "--seeds", "0,1", "--variants", "topk128,ce",
                                       "--eval-every", "1", "--max-new-runs", "1"])
    bounded = fidelity.run_benchmark(bounded_args, base.model_copy(update={"student": base.student.model_copy(
        update={"lr": 1e-2})}), results, variants, seeds)
    assert [(r["variant"], r["seed"]) for r in bounded if r["kind"] == "run"] == [("topk128", 0)]
    assert [(r["variant"], r["seed"]) for r in bounded if r["kind"] == "not_run"] == [("ce", 0), ("topk128", 1),
                                                                                      ("ce", 1)]
    assert len(list(results.folder.glob("*.json"))) == 6  # the teacher's held-out CE does not depend on lr


def test_online_kd_curve_and_the_dense_eval_match_a_full_forward_of_both_models(make_config) -> None:
    """Online KD steps with the student evaluated at several steps of its one run, and the held-out CE / full KL
    against a dense reference (both models' whole logits at once, float64)."""
    import torch
    from support.runs import prepare

    from kdflow.bench.fidelity_runs import TeacherStates, dense_eval, teacher_heldout_ce, train_with_curve
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings, training_settings
    from kdflow.tasks.common.teacher_loading import load_teacher
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_distill_data
    from kdflow.tasks.teacher.precompute import precompute_shards

    config = prepare(make_config(dataset__max_documents=16, student__steps=3, student__eval_shards=1,
                                 student__lr=1e-2))
    precompute_shards(open_run_root(config), teacher_pass_settings(config))
    teacher = load_teacher(config.teacher).eval()
    states = TeacherStates(teacher)
    data = open_distill_data(open_run_root(config), training_settings(config),
                             load_tokenizer(config.teacher, config.tokenizer))
    student, curve, info = train_with_curve(config, states, data, {0, 2}, online=True, chunk=7)
    assert [p["step"] for p in curve] == [0, 2, 3] and info["steps"] == 3
    assert math.isfinite(info["final_train_loss"]) and info["final_train_loss"] > 0
    assert curve[-1]["heldout_kl"] < curve[0]["heldout_kl"]  # three steps of pure KD move towards the teacher
    assert info["teacher_body_seconds"] > 0 and info["train_seconds"] > 0
    result = dense_eval(student, data, states, chunk=7)  # chunks that cut rows
    assert result == pytest.approx({k: v for k, v in curve[-1].items() if k != "step"}, rel=1e-6)
    with torch.no_grad():
        input_ids = data.load(data.eval_rows).input_ids
        log_p = torch.log_softmax(teacher(input_ids=input_ids).logits.double(), -1).flatten(0, 1)
        log_q = torch.log_softmax(student(input_ids=input_ids).logits.double(), -1).flatten(0, 1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    labels = input_ids[:, 1:].flatten()
    ce = float(-log_q.view(*input_ids.shape, -1)[:, :-1].flatten(0, 1).gather(1, labels[:, None]).mean())
    teacher_ce = float(-log_p.view(*input_ids.shape, -1)[:, :-1].flatten(0, 1).gather(1, labels[:, None]).mean())
    assert result["heldout_positions"] == input_ids.numel()
    assert result["heldout_kl"] == pytest.approx(kl, rel=1e-4) and result["heldout_ce"] == pytest.approx(ce, rel=1e-4)
    assert teacher_heldout_ce(data, states, chunk=7) == pytest.approx(teacher_ce, rel=1e-4)
    agree = float((log_p.argmax(-1) == log_q.argmax(-1)).double().mean())
    assert result["heldout_top1_agreement"] == pytest.approx(agree, abs=1e-9)
