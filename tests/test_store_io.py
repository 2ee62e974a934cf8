"""`kdflow store import` / `export`: a top-K store out as Parquet a `datasets` call reads, back in through the
declared layouts, training on it gives the original's losses; bad input is one line naming row and field before
anything is written; a partial import resumes.

The original store is the dense v1 float16 store of tests/support/runs.py (written by the test helpers, not by the
code under test).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.runs import DENSE_TAG, read_lines, student_path

from kdflow.schemas.commits import stage_dir
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import read_store_info
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.teacher.logit_export import export_store
from kdflow.tasks.teacher.logit_import import import_store

V1 = {"precompute__store__format": "v1", "student__steps": 3, "student__save_every": 3}


def _at(root: Path, fresh_run, **overrides):
    """The fresh run's config with another (empty) run root."""
    return fresh_run(**overrides).model_copy(update={"run_root": str(root)})


def _info(config, tag: str):
    run_root = RunRoot(config.run_root)
    return read_store_info(run_root, stage_dir(run_root, "topk", tag))


def _losses(config) -> list[float]:
    return [record["loss"] for record in read_lines(student_path(config, "metrics.jsonl"))]


def _exported(fresh_run, tmp_path: Path, layout: str = "kdflow") -> tuple[object, Path]:
    original = fresh_run(student__topk_tag=DENSE_TAG, **V1)
    out = tmp_path / f"export-{layout}"
    export_store(str(original.run_root), str(out), DENSE_TAG, layout)
    return original, out


def test_export_import_train_gives_the_original_losses(fresh_run, tmp_path: Path) -> None:
    import datasets

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    original, out = _exported(fresh_run, tmp_path)
    loaded = datasets.load_dataset("parquet", data_files=sorted(str(p) for p in (out / "data").glob("*.parquet")),
                                   split="train")
    assert loaded.num_rows == json.loads((out / "kdflow_export.json").read_text())["rows"]
    assert np.asarray(loaded[0]["topk_ids"]).shape == (32, 8) and len(loaded[0]["input_ids"]) == 32

    imported_cfg = _at(tmp_path / "imported", fresh_run, **V1)
    summary = import_store(open_run_root(imported_cfg), teacher_pass_settings(imported_cfg), str(out / "data"),
                           "kdflow", "sharp-tiny")
    assert summary["complete"] and summary["tail"] == "source" and summary["written"] == summary["shards"]
    _imported_tokens_take_no_corpus(imported_cfg)
    imported_cfg = _at(tmp_path / "imported", fresh_run, student__topk_tag=summary["tag"], **V1)
    train(open_run_root(original), training_settings(original))
    train(open_run_root(imported_cfg), training_settings(imported_cfg))
    assert _losses(imported_cfg) == pytest.approx(_losses(original), rel=1e-5)

    # the default v2 codec (sqrt levels): the same loss within its rounding
    coded_cfg = _at(tmp_path / "coded", fresh_run, student__steps=3, student__save_every=3)
    coded = import_store(open_run_root(coded_cfg), teacher_pass_settings(coded_cfg), str(out / "data"), "kdflow",
                         "sharp-tiny")
    assert _info(coded_cfg, coded["tag"]).format == "v2"
    coded_cfg = _at(tmp_path / "coded", fresh_run, student__topk_tag=coded["tag"], student__steps=3,
                          student__save_every=3)
    train(open_run_root(coded_cfg), training_settings(coded_cfg))
    assert _losses(coded_cfg) == pytest.approx(_losses(original), rel=1e-2)


def _imported_tokens_take_no_corpus(config) -> None:
    """tokens/ of an import is not the config's corpus tokenised: tokenise (which would skip it as done, its
    fingerprint being the config's) and pre-flight for materialise refuse it, before anything is written."""
    from kdflow.schemas.stage_settings import open_run_root, tokenise_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.tokenise import tokenise
    from kdflow.tasks.preflight import run_preflight

    with pytest.raises(StoreError, match=r"holds the rows imported from .* \(kdflow store import\), not this config's"):
        tokenise(open_run_root(config), tokenise_settings(config), load_tokenizer(config.teacher, config.tokenizer))
    with pytest.raises(ConfigError, match="materialise and tokenise the corpus in another run_root"):
        run_preflight(config, "materialise,tokenise,precompute")
    assert not (Path(config.run_root) / "corpus").exists()


def test_a_store_exported_as_distillkit_imports_back_to_the_same_targets(fresh_run, tmp_path: Path) -> None:
    """DistillKit's packed format (lossless settings written beside the data) out and in again: the same ids and
    log-probs, position for position; the capture's own settings file is what the import reads."""
    from kdflow.schemas.commits import list_commits
    from kdflow.schemas.shards import TopkShard

    original, out = _exported(fresh_run, tmp_path, "distillkit")
    assert (out / "compression_config.yaml").is_file()
    assert {"input_ids", "compressed_logprobs", "bytepacked_indices"} <= set(
        pq.read_table(sorted((out / "data").glob("*.parquet"))[0]).column_names)
    config = _at(tmp_path / "imported", fresh_run, **V1)
    settings_file = str(out / "compression_config.yaml")
    with pytest.raises(ConfigError, match=r"^--distillkit-settings applies to DistillKit's packed captures \(--layout "
                                          r"distillkit\), not layout kdflow: remove it$"):  # it was silently ignored
        import_store(open_run_root(config), teacher_pass_settings(config), str(out / "data"), "kdflow", "sharp-tiny",
                     distillkit_settings=settings_file)
    with pytest.raises(ConfigError, match=r"not kdflow: remove it$"):
        export_store(str(original.run_root), str(tmp_path / "other"), DENSE_TAG, "kdflow",
                     distillkit_settings=settings_file)
    summary = import_store(open_run_root(config), teacher_pass_settings(config), str(out / "data"), "distillkit",
                           "sharp-tiny")
    assert summary["complete"] and summary["tail"] == "computed"

    def arrays(run_root: str, tag: str) -> list:
        root = RunRoot(run_root)
        store = stage_dir(root, "topk", tag)
        return [TopkShard(root, f"{store}/{record.data_file}").read()
                for _, record in sorted(list_commits(root, store, "topk").items())]

    for before, after in zip(arrays(original.run_root, DENSE_TAG), arrays(config.run_root, summary["tag"]),
                             strict=True):
        np.testing.assert_array_equal(after.ids, before.ids)
        # float16 rows whose mass rounds above 1 are scaled back to 1 by the reader (as DistillKit's own does)
        np.testing.assert_allclose(after.logprobs.astype(np.float32), before.logprobs.astype(np.float32), rtol=2e-3,
                                   atol=1e-4)


def test_a_layout_declared_in_yaml_exports_and_imports_back(fresh_run, tmp_path: Path) -> None:
    """Export takes the YAML layouts import takes (it took built-ins only): a trainer's own column names out, and
    the same file reads them back to the same targets."""
    layout = tmp_path / "mine.yaml"
    layout.write_text("tokens: tokens\nids: top_ids\nvalues: top_logprobs\ntail: rest\n")
    original, out = _exported(fresh_run, tmp_path, str(layout))
    table = pq.read_table(sorted((out / "data").glob("*.parquet"))[0])
    assert table.column_names == ["tokens", "top_ids", "top_logprobs", "rest"]
    assert json.loads((out / "kdflow_export.json").read_text())["layout"] == "mine"
    config = _at(tmp_path / "imported", fresh_run, **V1)
    summary = import_store(open_run_root(config), teacher_pass_settings(config), str(out / "data"), str(layout),
                           "sharp-tiny")
    assert summary["complete"] and summary["tail"] == "source"
    before, after = (RunRoot(c.run_root) for c in (original, config))
    for shard in ("shard-00000.arrow", "shard-00001.arrow"):
        assert (after.read_bytes(f"{stage_dir(after, 'topk', summary['tag'])}/{shard}")
                == before.read_bytes(f"{stage_dir(before, 'topk', DENSE_TAG)}/{shard}"))
    with pytest.raises(ConfigError, match=r"^unknown logit layout 'axolotol'; known: "):  # one line, not usage
        export_store(str(original.run_root), str(tmp_path / "typo"), DENSE_TAG, "axolotol")


def test_stacked_layout_without_tail_is_computed_recorded_and_warned_once(fresh_run, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.data import open_stores

    original, out = _exported(fresh_run, tmp_path, "stacked")
    table = pq.read_table(sorted((out / "data").glob("*.parquet"))[0])
    assert table.column_names == ["inputs", "targets"]
    assert np.asarray(table.column("targets")[0].as_py()).shape == (32, 2, 8)
    jsonl = tmp_path / "stacked.jsonl"
    rows = pa.concat_tables([pq.read_table(p) for p in sorted((out / "data").glob("*.parquet"))]).to_pylist()
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = _at(tmp_path / "imported", fresh_run, **V1)
    summary = import_store(open_run_root(config), teacher_pass_settings(config), str(jsonl), "stacked", "sharp-tiny")
    assert summary["tail"] == "computed"
    info = _info(config, summary["tag"])
    assert info.tail_computed and info.model_extra["imported"]["teacher"] == "sharp-tiny"
    config = _at(tmp_path / "imported", fresh_run, student__topk_tag=summary["tag"], **V1)
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    with caplog.at_level(logging.WARNING, logger="kdflow.train"):
        open_stores(open_run_root(config), training_settings(config), tokenizer)
        open_stores(open_run_root(config), training_settings(config), tokenizer)
    assert len([r for r in caplog.records if "without tail mass" in r.getMessage()]) == 1
    # The imported rows are no dataset's: a config naming the user's own corpus trains on them too (it was refused,
    # "made from another dataset ...: add tokenise", and tokenise then refused the imported store).
    from kdflow.tasks.preflight_stores import check_stage_inputs

    own = config.model_copy(update={"dataset": config.dataset.model_copy(update={"path": str(jsonl)})})
    check_stage_inputs(own, "train")
    assert open_stores(open_run_root(own), training_settings(own), tokenizer).topk_store.endswith(summary["tag"])
    untagged = _at(tmp_path / "imported", fresh_run, **V1)  # it said "... ; run precompute first"
    with pytest.raises(StoreError, match=f"top-K store {summary['tag']} under .* was imported for this token store "
                                         r"\(kdflow store import\): train on one with student.topk_tag$"):
        open_stores(open_run_root(untagged), training_settings(untagged), tokenizer)

    import datasets  # the same rows as a Hugging Face dataset folder: the same arrays, the same store

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    again_cfg = _at(tmp_path / "again", fresh_run, **V1)
    again = import_store(open_run_root(again_cfg), teacher_pass_settings(again_cfg), str(tmp_path / "saved"), "stacked",
                         "sharp-tiny")
    assert again["tag"] == summary["tag"] and again["rows"] == len(rows)


def test_a_partial_import_resumes_to_the_same_bytes(fresh_run, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _exported(fresh_run, tmp_path)
    config = _at(tmp_path / "imported", fresh_run, **V1)
    first = import_store(open_run_root(config), teacher_pass_settings(config), str(out / "data"), "kdflow",
                         "sharp-tiny")
    root = Path(config.run_root)
    store = root / "topk" / first["tag"]
    files = {p: p.read_bytes() for p in sorted(root.rglob("shard-*.arrow"))}
    (store / "shard-00003.commit.json").unlink()
    (store / "shard-00005.arrow").unlink()
    (store / "_complete.json").unlink()
    (root / "tokens" / "shard-00006.commit.json").unlink()
    from kdflow.commands.validate import validate_run_root
    from kdflow.tasks.teacher.logit_export import export_store

    with pytest.raises(StoreError, match="is not complete; finish kdflow store import first"):  # not precompute
        export_store(str(root), str(tmp_path / "again"), first["tag"])
    validate_run_root(str(root))
    said = capsys.readouterr().out
    assert "the next run of kdflow store import" in said and "precompute" not in said, said
    again = import_store(open_run_root(config), teacher_pass_settings(config), str(out / "data"), "kdflow",
                         "sharp-tiny")
    assert again["tag"] == first["tag"] and again["written"] == 2 and again["complete"]
    assert {p: p.read_bytes() for p in sorted(root.rglob("shard-*.arrow"))} == files
    assert validate_run_root(str(root)) == 0  # validated like a computed store: hashes, alignment, contents
    from kdflow.commands.store_report import store_report

    (report,) = store_report(str(root), first["tag"], rows=8, kl_rows=4)
    assert "no teacher to re-run" in report["kl_note"]


def _source(tmp_path: Path, change: str) -> Path:
    rng = np.random.default_rng(0)
    rows, seq_len, k = 3, 32, 8
    input_ids = rng.integers(0, 200, (rows, seq_len)).tolist()
    ids = np.stack([rng.permutation(200)[:k] for _ in range(rows * seq_len)]).reshape(rows, seq_len, k).tolist()
    logprobs = np.sort(np.log(rng.dirichlet(np.ones(k + 1), rows * seq_len)[:, :k]), axis=-1)[:, ::-1]
    logprobs = logprobs.reshape(rows, seq_len, k).tolist()
    if change == "ragged K":
        ids[1][4] = ids[1][4][:7]
        logprobs[1][4] = logprobs[1][4][:7]
    elif change == "id outside":
        ids[2][5][3] = 10**6
    elif change == "unsorted":
        logprobs[1][6][0], logprobs[1][6][1] = logprobs[1][6][1], logprobs[1][6][0]
    elif change == "sum above 1":
        logprobs[2][7] = [-0.1] * k
    table = {"input_ids": input_ids, "target_token_ids": ids, "target_logprobs": logprobs}
    if change == "sum above 1":  # full-vocabulary log-probs (axolotl's are renormalised over the K: summing to 1)
        table = {"input_ids": input_ids, "topk_ids": ids, "topk_logprobs": logprobs}
    if change == "text":
        table = {"input_ids": input_ids, "topk_ids": ids, "topk_logprobs": logprobs,
                 "text": ["hello world"] * rows}
    if change == "NaN tail":  # it was named "a tail log-mass above 0"
        tails = np.log1p(-np.exp(np.array(logprobs)).sum(-1))
        tails[1][10] = np.nan
        table = {"input_ids": input_ids, "topk_ids": ids, "topk_logprobs": logprobs, "tail_logprob": tails.tolist()}
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(table), path)
    return path


IN_BAD = "(counting from 0; in bad.parquet)"


@pytest.mark.parametrize("change, where", [
    ("ragged K", f"row 1 {IN_BAD} field target_token_ids: ragged K: position 4 has 7"),
    ("id outside", f"row 2 {IN_BAD} field target_token_ids: id 1000000 at position 5 is outside the vocabulary"),
    ("unsorted", f"row 1 {IN_BAD} field target_logprobs: log-probs not sorted by descending value at position 6"),
    ("sum above 1", f"row 2 {IN_BAD} field topk_logprobs: log-probs whose probabilities sum above 1 at position 7"),
    ("text", f"row 0 {IN_BAD} field text: the tokenizer's encoding differs from input_ids at position 0"),
    ("NaN tail", f"row 1 {IN_BAD} field tail_logprob: a tail log-mass that is NaN at position 10"),
])
def test_bad_input_is_one_line_naming_row_and_field_before_anything_is_written(
        fresh_run, tmp_path: Path, change: str, where: str) -> None:
    config = _at(tmp_path / "imported", fresh_run, **V1)
    with pytest.raises(StoreError) as error:
        import_store(open_run_root(config), teacher_pass_settings(config), str(_source(tmp_path, change)),
                     "kdflow" if change in ("text", "sum above 1", "NaN tail") else "axolotl", "t")
    assert "\n" not in str(error.value) and where in str(error.value), str(error.value)
    assert not (tmp_path / "imported").exists() or not any((tmp_path / "imported").rglob("*.arrow"))


@pytest.mark.usefixtures("children")
def test_the_commands_export_and_import(fresh_run, tmp_path: Path) -> None:
    import sys

    from support.children import run
    from support.faults import write_config

    original = fresh_run(**V1)
    out = tmp_path / "export"

    def kdflow(*args: str):
        return run([sys.executable, "-m", "kdflow", "store", *args], what="kdflow store", timeout=600)

    exported = kdflow("export", str(original.run_root), str(out), "--tag", DENSE_TAG, "--layout", "axolotl")
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["layout"] == "axolotl"
    # axolotl's rows are renormalised over the K: a v2 store records that (v1 has no place for it)
    config = write_config(_at(tmp_path / "imported", fresh_run, student__steps=3), tmp_path / "imported.yaml")
    bad = kdflow("import", str(_source(tmp_path, "unsorted")), "--config", str(config), "--layout", "axolotl",
                 "--teacher", "t")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "kdflow: error: row 1 (counting from 0; in bad.parquet) field target_logprobs: log-probs not sorted by "
        "descending value at position 6"]
    done = kdflow("import", str(out / "data"), "--config", str(config), "--layout", "axolotl", "--teacher", "t",
                  "--set", "student.log_every=1")
    assert done.returncode == 0, done.stderr
    tag, tail = (json.loads(done.stdout.splitlines()[0])[key] for key in ("tag", "tail"))
    assert tail == "none"  # renormalised over the K: no tail stored (it said "computed")
    assert f"--stages train --set student.log_every=1 --set student.topk_tag={tag}`" in done.stdout  # its --set too
    assert (tmp_path / "imported" / "topk" / tag / "_complete.json").exists()


def test_exporting_from_a_run_root_without_a_top_k_store_says_so(tmp_path: Path) -> None:
    (tmp_path / "run" / "tokens").mkdir(parents=True)  # tokenised, not yet precomputed
    with pytest.raises(StoreError) as caught:
        export_store(str(tmp_path / "run"), str(tmp_path / "out"))
    assert str(caught.value) == (f"no top-K store under {tmp_path / 'run' / 'topk'}: the precompute stage has not "
                                 "written one yet")
    with pytest.raises(StoreError, match=f"^run root {tmp_path / 'nope'} does not exist$"):  # a typo: not "precompute"
        export_store(str(tmp_path / "nope"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_export_and_report_take_the_run_s_config_file(fresh_run, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from support.faults import write_config

    from kdflow.commands.store_io import export_main
    from kdflow.commands.store_report import main as report_main

    config = fresh_run(**V1)
    config_file = write_config(config, tmp_path / "run.yaml")
    outputs = []
    for given in (str(config.run_root), str(config_file)):  # a config file said NotADirectoryError: run.yaml/topk
        capsys.readouterr()
        assert export_main([given, str(tmp_path / f"out-{len(outputs)}"), "--tag", DENSE_TAG]) == 0
        assert report_main([given, "--tag", DENSE_TAG, "--kl-rows", "0", "--rows", "4", "--json"]) == 0
        outputs.append(capsys.readouterr().out.splitlines())
    assert len(outputs[0]) == 2 and outputs[1] == [outputs[0][0].replace("out-0", "out-1"), outputs[0][1]]
