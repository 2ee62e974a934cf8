"""`kdflow bench fidelity` on more than one corpus and with a student made from the teacher: the standard library
corpus, the corpus's own folder of results, a tiny rehearsal with `--prune-layers` (the student starts from the
teacher's blocks, every variant from the same weights, and each variant's share of the gap closed is reported),
and a pruned student that does not depend on the seed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


def test_the_stdlib_corpus_is_the_library_code_in_a_fixed_order(tmp_path: Path) -> None:
    from kdflow.demo_assets import STDLIB_FILE_CHARS, stdlib_lines, stdlib_order, write_stdlib_corpus

    lines = stdlib_lines()
    records = [json.loads(line) for line in lines]
    files = [record["file"] for record in records]
    assert len(records) > 100 and all(record["text"].strip() for record in records)
    assert files == sorted(files, key=stdlib_order) and len(set(files)) == len(files)
    assert max(len(record["text"]) for record in records) <= STDLIB_FILE_CHARS
    budget, taken = 200_000, []  # ~50K tokens of code: many modules, none of them most of it
    for record in records:
        if sum(map(len, taken)) >= budget:
            break
        taken.append(record["text"])
    assert len(taken) >= 12 and max(map(len, taken)) < 0.2 * budget
    assert {"argparse.py", "json/decoder.py"} <= set(files)
    folders = {part for name in files for part in name.split("/")[:-1]}
    assert not folders & {"test", "tests", "idle_test", "site-packages"}, folders
    path = tmp_path / "source" / "stdlib.jsonl"
    first = write_stdlib_corpus(path)
    assert first["written"] and first["documents"] == len(lines)
    assert path.read_bytes() == "".join(lines).encode("utf-8")  # the same bytes on a second reading of the library
    mtime = path.stat().st_mtime_ns
    assert write_stdlib_corpus(path)["written"] is False and path.stat().st_mtime_ns == mtime


def test_a_corpus_names_its_results_folder_and_bad_files_are_refused(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow.bench import fidelity
    from kdflow.bench.fidelity_corpus import choose_corpus
    from kdflow.bench.fidelity_results import Results

    assert Results(tmp_path).folder.name == "fidelity-results"  # where every result before --corpus was stored
    assert Results(tmp_path, "stdlib").folder.name == "fidelity-results-stdlib"
    mine = tmp_path / "my docs.jsonl"
    mine.write_text(json.dumps({"text": "hello", "id": 1}) + "\n")
    corpus = choose_corpus(str(mine), str(tmp_path))
    assert corpus.name == corpus.source == str(mine)
    assert Results(tmp_path, corpus.name).folder.name.startswith("fidelity-results-my_docs-")
    old = Results(tmp_path)  # a result stored before the corpus was named reads as pydoc
    old.save_record({"kind": "run", "variant": "ce", "seed": 0, "key": "abc"})
    assert old.load("ce", 0, "abc")["corpus"] == "pydoc" and Results(tmp_path, "stdlib").load("ce", 0, "abc") is None
    (tmp_path / "no_text.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    for argument, message in (("pydocs", "not pydoc, stdlib or a .jsonl file"),
                              (str(tmp_path / "missing.jsonl"), "cannot read it"),
                              (str(tmp_path / "no_text.jsonl"), "no string `text` field")):
        with pytest.raises(SystemExit):
            fidelity.parse(["--corpus", argument])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in error and argument in error


def test_a_rehearsal_with_a_student_pruned_from_the_teacher(sharp_teacher_dir: Path, corpus_file: Path,
                                                            tmp_path: Path) -> None:
    """2 steps, 1 seed, 2 variants: both start from the same blocks of the teacher (held-out KL at step 0 below the
    random student's), the result names the pruning, and the gap-share fields are there and finite; the random
    student's results are other results."""
    from support.runs import prepare
    from support.tiny import tiny_config

    from kdflow.bench import fidelity
    from kdflow.bench.fidelity_results import Results
    from kdflow.bench.fidelity_summary import summarise
    from kdflow.schemas.errors import ConfigError

    base = prepare(tiny_config(tmp_path / "run", sharp_teacher_dir, corpus_file, dataset__max_documents=16,
                               student__steps=2, student__eval_shards=1))
    results = Results(tmp_path / "bench")
    argv = ["--steps", "2", "--seeds", "0", "--eval-every", "1"]
    args, variants, seeds = fidelity.parse([*argv, "--prune-layers", "3"])
    with pytest.raises(ConfigError, match="--prune-layers 3: the teacher has 2 blocks"):
        fidelity.run_benchmark(args, base, results, variants, seeds)
    args, variants, seeds = fidelity.parse([*argv, "--variants", "topk128,ce", "--prune-layers", "1"])
    records = fidelity.run_benchmark(args, base, results, variants, seeds)
    pruned = [r for r in records if r["kind"] == "run"]
    assert [r["student"] for r in pruned] == ["topk128-seed0-pruned1-cosine", "ce-seed0-pruned1-cosine"]
    assert all(r["prune"]["teacher_layers"] == 2 and len(r["prune"]["kept"]) == 1 for r in pruned)
    assert all(r["corpus"] == "pydoc" for r in pruned)
    assert pruned[0]["curve"][0] == pruned[1]["curve"][0]  # the same initial weights for every variant
    summary = summarise(records, variants, {"corpus": "pydoc", "student": fidelity.student_label(args)})
    teacher_ce = next(r["heldout_ce"] for r in records if r["kind"] == "teacher")
    for record, run in zip((r for r in summary if r["kind"] == "variant"), pruned, strict=True):
        assert record["student"] == "pruned1-cosine" and math.isfinite(record["kl_gap_closed"])
        start = run["curve"][0]
        assert record["kl_gap_closed"] == pytest.approx(1 - run["heldout_kl"] / start["heldout_kl"])
        if start["heldout_ce"] > teacher_ce:  # else the student starts below the floor: no gap to close
            assert record["ce_gap_closed"] == pytest.approx((start["heldout_ce"] - run["heldout_ce"]) /
                                                            (start["heldout_ce"] - teacher_ce))
    args, variants, seeds = fidelity.parse([*argv, "--variants", "ce"])
    random = [r for r in fidelity.run_benchmark(args, base, results, variants, seeds) if r["kind"] == "run"]
    assert random[0]["student"] == "ce-seed0" and random[0]["prune"] is None and random[0]["key"] != pruned[1]["key"]
    assert pruned[0]["curve"][0]["heldout_kl"] < random[0]["curve"][0]["heldout_kl"]
    assert len(list(results.folder.glob("*.json"))) == 4  # three runs and the teacher's held-out CE


def test_a_pruned_student_keeps_the_same_blocks_whatever_its_seed(fresh_run) -> None:
    """The calibration rows are taken in an order of their own, not the seed's: the measured importance, and so
    the blocks kept, are the same for every seed (the benchmark's seeds share one pruned start)."""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import StudentRun

    plans = []
    for seed in (0, 1):
        config = fresh_run(student__name=f"seed{seed}", student__seed=seed, student__prune={"layers": 1})
        run = StudentRun(open_run_root(config), training_settings(config), 0, 1)
        run.loader.close()
        plans.append(run.model.config.kdflow_prune)
    assert plans[0] == plans[1]


def test_the_share_of_the_gap_closed_by_hand() -> None:
    from kdflow.bench.fidelity_summary import gap_closed

    run = {"heldout_kl": 1.0, "heldout_ce": 5.0, "curve": [{"step": 0, "heldout_kl": 4.0, "heldout_ce": 8.0}]}
    assert gap_closed(run, 2.0) == {"kl_gap_closed": 0.75, "ce_gap_closed": 0.5}  # 3 of 4 nats; 3 of 6 nats
    assert gap_closed(run, None) == {"kl_gap_closed": 0.75, "ce_gap_closed": None}  # no teacher CE stored
    assert gap_closed(run, 9.0)["ce_gap_closed"] is None  # a start below the teacher's CE has no gap to close
    worse = run | {"heldout_kl": 5.0}
    assert gap_closed(worse, 2.0)["kl_gap_closed"] == pytest.approx(-0.25)  # worse than its start
    assert gap_closed({"heldout_kl": 1.0, "heldout_ce": 5.0, "curve": []}, 2.0) == {"kl_gap_closed": None,
                                                                                     "ce_gap_closed": None}
