"""Student training through its Prefect flow (a small summary, the markdown report) and on the real precompute's
output. (Training itself against test-written top-K stores: test_train.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

from support.corpus import sample_documents, write_jsonl
from support.runs import make_tokens, run_config, student_path


def test_flow_trains_writes_its_config_and_returns_a_small_summary(fresh_run, prefect_harness) -> None:
    from kdflow.flows.train import train_student_flow

    config = fresh_run(student__steps=3)
    result = train_student_flow(config.model_dump(mode="json"))
    assert result["steps"] == 3 and result["final_dir"].endswith("final")
    assert result["eval_after"]["kl"] < result["eval_before"]["kl"]
    assert student_path(config, "config.yaml").read_text().startswith("run_root:")
    assert len(json.dumps(result)) < 4000
    from prefect.artifacts import Artifact

    report = Artifact.get("train-student")  # the markdown report of this run (student name "student")
    assert report is not None and "| after (step 3) |" in report.data and "Loss " in report.data


def test_training_report_shows_the_curve_and_evaluation() -> None:
    from kdflow.flows.train import sparkline, training_report

    assert sparkline([8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]) == "█▇▆▅▄▃▂▁"
    assert sparkline([1.0] * 200, width=50) == "▁" * 50
    metrics = [{"step": s, "loss": 5.0 / s, "kd": 4.0 / s, "ce": 6.0, "lr": 1e-3, "grad_norm": 0.5,
                "tokens_per_s": 100.0}
               for s in range(1, 31)]
    evaluation = {"kl": 1.0, "ce": 2.0, "perplexity": 7.39, "top1_agreement": 0.25}
    summary = {"student": "s", "steps": 30, "final_dir": "runs/x/students/s/final", "student_dir": "runs/x/students/s",
               "topk_store": "runs/x/topk/t", "eval_before": {"step": 0, **evaluation},
               "eval_after": {"step": 30, **evaluation}}
    report = training_report(summary, metrics)
    assert "| 30 | 0.1667 |" in report and "| 1 | 5.0000 |" in report  # first and last steps are in the table
    assert "| after (step 30) | 1.0000 | 7.39 | 25.0% | - |" in report  # no full KL computed
    summary["eval_after"] = summary["eval_after"] | {"kl_full": 1.5}
    assert "| after (step 30) | 1.0000 | 7.39 | 25.0% | 1.5000 |" in training_report(summary, metrics)
    summary["eval_before"] = summary["eval_before"] | {"perplexity": 3.6156683e28}  # an untrained student's
    assert "| before (step 0) | 1.0000 | 3.62e+28 | 25.0% | - |" in training_report(summary, metrics)


def test_training_on_the_real_precompute_output(tmp_path: Path, sharp_teacher_dir: Path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings, training_settings
    from kdflow.tasks.student.train import train
    from kdflow.tasks.teacher.precompute import precompute_shards

    corpus = write_jsonl(tmp_path / "docs.jsonl", sample_documents(16))
    config = run_config(tmp_path / "run", sharp_teacher_dir, corpus, student__steps=2, student__eval_shards=1)
    make_tokens(config)
    precompute_shards(open_run_root(config), teacher_pass_settings(config))
    summary = train(open_run_root(config), training_settings(config))
    assert summary["topk_store"].startswith(str(tmp_path / "run" / "topk"))
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    assert (tmp_path / "run" / "students" / "student" / "final" / "model.safetensors").exists()
