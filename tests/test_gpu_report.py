"""The GPU check's results page (kdflow/bench/gpu_report.py, `kdflow bench gpu --report`): two calls' summaries
merged step by step, issue 44's targets judged from the figures as measured, the page's sections."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit


def _full_depth(four_bit_topk: float, bf16_topk: float) -> dict[str, Any]:
    """The pass as configured by default (`topk`) at 0.6 of kdflow's tiled head and fused experts, which the target
    is then judged on; the tiled-gemm variant failed."""
    record = {"tokens_per_s": {"body": 90_000.0, "forward": 60_000.0, "topk": 0.0, "topk_tiled_fused": 0.0},
              "mfu_of_measured_matmul": {"body": 0.4, "forward": 0.3, "topk": 0.2, "topk_tiled_fused": 0.33},
              "peak_device_gib": 30.0, "failed": {"topk_gemm_fused": "RuntimeError: no kernel"}}
    four_bit = json.loads(json.dumps(record)) | {"experts_left_unquantised": []}
    four_bit["tokens_per_s"] |= {"topk": 0.6 * four_bit_topk, "topk_tiled_fused": four_bit_topk}
    bf16 = json.loads(json.dumps(record)) | {"out_of_memory": {"forward": "CUDA out of memory"}}
    bf16["tokens_per_s"] |= {"topk": 0.6 * bf16_topk, "topk_tiled_fused": bf16_topk}
    return {"status": "ok", "layers": 32, "micro_batch": 32, "seq_len": 1024, "top_k": 128,
            "roofline_tflops": {"measured_bf16_matmul": 795.2, "datasheet_dense_bf16": 989.0},
            "bf16": bf16, "4bit": four_bit, "4bit/bf16": {"topk": 0.5, "topk_tiled_fused": round(four_bit_topk
                                                                                                / bf16_topk, 4)}}


def _summaries() -> list[dict[str, Any]]:
    head = [{"variant": "matmul", "vocab": 196_608, "us_per_token": 1.3},
            {"variant": "slab", "vocab": 196_608, "us_per_token": 5.5, "over_matmul": 4.2},
            {"variant": "tiled-triton", "vocab": 196_608, "us_per_token": 1.6, "over_matmul": 1.2},
            {"variant": "tiled-gemm", "vocab": 196_608, "us_per_token": 1.4, "correct": False},  # fast, but wrong
            {"variant": "sampled-tiled-triton", "vocab": 196_608, "us_per_token": 0.9, "over_matmul": 0.7}]
    environment = {"torch": "2.11.0+cu130", "gpus": ["NVIDIA H200"], "gpu_memory_mib": [143156]}
    first = {"ok": False, "quick": False, "seconds": 533.0, "loadavg": [1.0, 1.0, 1.0], "date_utc": "2026-12-06 10:00",
             "environment": environment, "steps": {
                 "precompute": {"status": "ok", "tokens_per_s": 80_000.0, "head": "tiled"},
                 "targets_sampled": {"status": "ok", "tokens_per_s": 70_000.0, "head": "tiled"},
                 "targets_hybrid": {"status": "ok", "tokens_per_s": 60_000.0, "head": "tiled"},
                 "full_depth": _full_depth(50_000.0, 51_000.0),
                 "bench_head": {"status": "ok", "records": head},
                 "body_variants": {"status": "failed", "error": "RuntimeError: boom"},
                 "capped_24gib": {"status": "skipped", "reason": "budget: 20 s left, needs ~60 s"}}}
    second = {"ok": True, "quick": False, "seconds": 150.0, "loadavg": [1.0, 1.0, 1.0], "environment": environment,
              "steps": {"precompute": {"status": "skipped", "reason": "not asked for (--only)"},
                        "capped_24gib": {"status": "ok", "layers": 32, "seq_len": 512, "cap_gib": 24.0,
                                         "candidates": [{"experts": "grouped_mm", "micro_batch": 56,
                                                         "status": "out of memory", "error": "CUDA out of memory"},
                                                        {"experts": "kdflow_fused", "micro_batch": 48, "status": "ok",
                                                         "tokens_per_s": 3000.0, "peak_gib": 23.1}],
                                         "fits_by_experts": {"grouped_mm": 32, "kdflow_fused": 48},
                                         "llmjp_micro_batch_fits": False},
                        "tune_capped_24gib": {"status": "ok", "layers": 32, "seq_len": 512, "cap_gib": 24.0,
                                              "command": "kdflow tune precompute --random-weights --memory-gib 24",
                                              "recommended_micro_batch": 56, "candidates": [
                                                  {"micro_batch": 32, "status": "ok", "tokens_per_s": 2900.0,
                                                   "headroom": 0.2}, {"micro_batch": 56, "status": "ok",
                                                                      "tokens_per_s": 3100.0, "headroom": 0.05}]}}}
    return [first, second]


def test_two_calls_merge_and_each_target_is_judged_from_its_figures() -> None:
    from kdflow.bench.gpu_report import judged, merged

    summary = merged(_summaries())
    steps = summary["steps"]
    assert steps["precompute"]["status"] == "ok"  # the second call's skip does not hide the first call's figure
    assert steps["capped_24gib"]["status"] == "ok"  # the second call ran what the first skipped for its budget
    verdicts = {target.split(" >=")[0].split(" <=")[0]: (measured, verdict)
                for target, measured, verdict in judged(summary)}
    full_depth = verdicts["full-depth 4-bit pass"]  # judged on the fastest way the pass ran, named
    assert full_depth[1] == "met" and "50,000 tok/s at 32 layers (topk_tiled_fused)" in full_depth[0]
    assert verdicts["4-bit"] == ("0.980", "met")
    assert verdicts["head"][1] == "met" and "1.60 us/token (tiled-triton" in verdicts["head"][0]  # not the sampler's,
    # nor a variant whose targets differ from the slab loop's
    assert verdicts["sampled pass"][1] == "met" and verdicts["sampled pass"][0].startswith("0.875")
    assert "heads tiled and tiled" in verdicts["sampled pass"][0]  # the samplers weighed, not two heads
    assert verdicts["hybrid pass"][1] == "not met" and verdicts["hybrid pass"][0].startswith("0.750")
    capped = next(v for k, v in verdicts.items() if k.startswith("the llmjp"))
    assert capped == ("largest that ran, by experts implementation: grouped_mm 32, kdflow_fused 48", "not met")
    tuned = next(v for k, v in verdicts.items() if k.startswith("`kdflow tune precompute` under 24 GiB"))
    assert tuned == ("recommended 56 (32 ok, 56 ok)", "met")


def test_a_target_whose_step_did_not_run_says_why_and_a_rehearsal_is_not_judged() -> None:
    from kdflow.bench.gpu_report import judged, merged

    first = _summaries()[0]
    first["steps"]["full_depth"] = {"status": "failed", "error": "RuntimeError: expert weights left unquantised"}
    del first["steps"]["targets_hybrid"]
    rows = {target.split(" ")[0]: (measured, verdict) for target, measured, verdict in judged(merged([first]))}
    assert rows["full-depth"] == ("not measured (failed: RuntimeError: expert weights left unquantised)",
                                  "not measured")
    assert rows["hybrid"] == ("not measured (no such step in the summaries)", "not measured")
    first["quick"] = True
    assert {verdict for _, _, verdict in judged(merged([first]))} == {"not judged (rehearsal sizes)"}


def test_the_page_and_its_verdict_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kdflow bench gpu --report A B --out PAGE`: the page names the device and date, holds each section whose
    step ran, an out-of-memory mode as such; the last stdout line is the verdicts; a file that is no summary is
    one line naming it."""
    from kdflow.bench.gpu import main

    paths = []
    for number, summary in enumerate(_summaries(), 1):
        paths.append(tmp_path / f"call{number}.json")
        paths[-1].write_text(json.dumps(summary))
    page = tmp_path / "page.md"
    assert main(["--report", *map(str, paths), "--out", str(page)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["bench"] == "gpu_report" and list(line["targets"].values()).count("not met") == 2
    text = page.read_text()
    assert text.startswith("# GPU check: results on NVIDIA H200 (2026-12-06 10:00)")
    for heading in ("## Issue 44's targets", "## Full depth (32 layers", "## The head's variants",
                    "## Under a 24.0 GiB cap", "## `kdflow tune precompute --random-weights", "## Every step"):
        assert heading in text, heading
    assert "| bf16 | forward | out of memory: CUDA out of memory |" in text and "**not met**" in text
    assert "| 4bit | topk_gemm_fused | failed: RuntimeError: no kernel |" in text
    assert "| body_variants | failed |" in text and "The MoE body" not in text  # a failed step has no section
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match=r"--report .*bad.json: not a gpu-check summary"):
        main(["--report", str(tmp_path / "bad.json")])


def test_the_body_table_names_each_tiling_the_fused_experts_ran_in() -> None:
    """`body_variants`' records of the fused experts in other tilings than the device's are rows of their own,
    named by tiling, each with its ratio to grouped_mm; the device's own is plain `kdflow_fused`."""
    from kdflow.bench.gpu_report import merged, render

    records = [{"variant": "grouped_mm", "tokens_per_s": 100.0, "max_rel_diff": 0.0},
               {"variant": "kdflow_fused", "tokens_per_s": 150.0, "max_rel_diff": 0.004,
                "moe_tiles": "128x64x64:3:8", "moe_tiles_default": True},
               {"variant": "kdflow_fused", "tokens_per_s": 120.0, "max_rel_diff": 0.004,
                "moe_tiles": "64x64x32:3:4", "moe_tiles_default": False}]
    summary = _summaries()[0]
    summary["steps"]["body_variants"] = {"status": "ok", "records": records, "fastest": "kdflow_fused",
                                         "over_grouped_mm": {"grouped_mm": 1.0, "kdflow_fused": 1.5,
                                                             "kdflow_fused 64x64x32:3:4": 1.2}}
    text = render(merged([summary]))
    assert "| kdflow_fused | 150 | 1.5 | 0.004 |" in text
    assert "| kdflow_fused 64x64x32:3:4 | 120 | 1.2 | 0.004 |" in text
