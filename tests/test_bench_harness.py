"""The exit rule every `kdflow bench NAME` runs under (`kdflow.bench.harness.run_main`): a benchmark that
measured nothing exits 1 with one line naming what it did not measure, whatever its own main returned."""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import pytest

from kdflow.bench import harness


def bench_printing(*records: dict[str, Any], notes: int = 0, code: int = 0) -> Any:
    def main(argv: list[str]) -> int:
        for index, record in enumerate(records):
            (harness.note if index < notes else harness.emit)(record)
        print("a plain line, not JSON")
        return code

    return main


def test_a_bench_that_measured_nothing_exits_1_naming_why(capsys: pytest.CaptureFixture[str]) -> None:
    main = bench_printing({"variant": "plain", "skipped": "no tokenizer at runs/demo/teacher-smollm2"},
                          {"variant": "stage", "error": "out of memory"})
    assert harness.run_main("train-step", main, []) == 1
    out, err = capsys.readouterr()
    assert [json.loads(line)["variant"] for line in out.splitlines() if line.startswith("{")] == ["plain", "stage"]
    assert err == ("kdflow bench train-step: measured nothing (plain: no tokenizer at runs/demo/teacher-smollm2; "
                   "stage: out of memory)\n")


def test_notes_and_skipped_steps_are_not_measurements(capsys: pytest.CaptureFixture[str]) -> None:
    main = bench_printing({"what": "setup", "vocab": 3000}, {"steps": {}, "status": "skipped", "reason": "no GPU"},
                          notes=1)
    assert harness.run_main("scale", main, []) == 1
    assert capsys.readouterr().err.strip() == "kdflow bench scale: measured nothing (a record: no GPU)"
    assert harness.run_main("scale", bench_printing(), []) == 1
    assert "it printed no measurement" in capsys.readouterr().err


def test_one_measurement_keeps_the_bench_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    records = ({"what": "setup"}, {"mode": "body", "tokens_per_s": 12.5}, {"mode": "stage", "error": "boom"})
    assert harness.run_main("teacher-pass", bench_printing(*records, notes=1), []) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line) for line in out.splitlines() if line.startswith("{")] == list(records) and err == ""
    assert harness.run_main("teacher-pass", bench_printing(*records, notes=1, code=3), []) == 3
    assert sys.stdout is not None and not isinstance(sys.stdout, harness._Tally)  # stdout restored


def test_kdflow_bench_dispatches_through_the_rule(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow import bench

    module = types.ModuleType("kdflow_test_empty_bench")
    module.main = bench_printing({"variant": "fused", "skipped": "no stores"})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(bench.BENCHES, "empty", module.__name__)
    assert bench.run_bench("empty", []) == 1
    assert capsys.readouterr().err.strip() == "kdflow bench empty: measured nothing (fused: no stores)"


def test_a_summary_listing_its_skipped_steps_is_a_measurement(capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU check's summary names the steps it skipped in a list: that is no skip of its own."""
    main = bench_printing({"bench": "gpu_check", "ok": True, "skipped": ["fsdp_2_process"], "failed": []})
    assert harness.run_main("gpu", main, []) == 0
    assert harness.is_measurement({"skipped": ["a"], "error": None}) and not harness.is_measurement({"error": "x"})


def test_kdflow_bench_help_lists_what_each_benchmark_measures(capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow.bench import BENCHES, SUMMARIES
    from kdflow.cli import main

    assert set(SUMMARIES) == set(BENCHES)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out  # it listed the names alone
    assert all(f"  {name:<17} {SUMMARIES[name]}" in out for name in BENCHES)
