"""The streaming import: rows of any length packed into seq_len rows against a plain reference (everything
concatenated, cut every seq_len), the reader on all three source formats in small batches, the one-pass import of
a multi-file Parquet source, nothing visible after a bad row in the last file, and a kill -9 mid-import resumed to
the bytes of an uninterrupted import.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.import_sources import capture_table as _table
from support.import_sources import import_config as _config
from support.import_sources import write_parts as _write_parts

from kdflow.schemas.errors import StoreError
from kdflow.schemas.shards import read_token_shard, read_topk_shard
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.teacher.logit_import import import_store
from kdflow.tasks.teacher.logit_packing import RowPacker
from kdflow.tasks.teacher.logit_reader import iter_source, source_files
from kdflow.tasks.teacher.source_rows import SourceRows

K, VOCAB = 4, 50


def _source_rows(rng: np.random.Generator, first_row: int, lengths: list[int], tail: bool) -> SourceRows:
    n = sum(lengths)
    return SourceRows(first_row=first_row, offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                      tokens=rng.integers(0, VOCAB, n).astype(np.int32),
                      ids=rng.integers(0, VOCAB, (n, K)).astype(np.int32),
                      logprobs=rng.normal(size=(n, K)).astype(np.float32), target=rng.random(n) < 0.7,
                      tail=rng.normal(size=n).astype(np.float32) if tail else None, text=None)


def _batches(seed: int, tail: bool = True) -> list[SourceRows]:
    """Batches of rows of any length (empty rows too, some longer than a packed row), in source order."""
    rng = np.random.default_rng(seed)
    batches, row = [], 0
    for _ in range(12):
        lengths = [int(x) for x in rng.choice([0, 1, 3, 7, 20], size=int(rng.integers(1, 5)))]
        batches.append(_source_rows(rng, row, lengths, tail))
        row += len(lengths)
    return batches


@pytest.mark.parametrize("seed, seq_len, tail", [(0, 7, True), (1, 5, False), (2, 16, True)])
def test_packing_is_concatenation_cut_every_seq_len_and_resumes_from_its_position(seed, seq_len, tail) -> None:
    batches = _batches(seed, tail)
    fields = ["tokens", "ids", "logprobs", "target"] + (["tail"] if tail else [])
    flat = {name: np.concatenate([getattr(b, name) for b in batches]) for name in fields}
    rows = len(flat["tokens"]) // seq_len
    expected = {name: array[:rows * seq_len].reshape(rows, seq_len, *array.shape[1:]) for name, array in flat.items()}

    packer, got, positions = RowPacker(seq_len), [], []
    for batch in batches:
        packer.add(batch)
        while packer.rows_ready() >= 2:  # shards of 2 packed rows
            got.append(packer.take(2))
            positions.append(packer.position())
    if packer.rows_ready():
        got.append(packer.take(packer.rows_ready()))
    assert packer.remainder == len(flat["tokens"]) - rows * seq_len < seq_len
    for name in fields:
        np.testing.assert_array_equal(np.concatenate([getattr(p, name) for p in got]), expected[name])
    assert (got[0].tail is None) == (not tail)

    # a packer started at the position after any shard packs the same rows as the first did from there
    assert len(positions) >= 2
    for shard, position in enumerate(positions):
        again, resumed = RowPacker(seq_len, position), []
        for batch in batches:
            again.add(batch)
            while again.rows_ready() >= 2:
                resumed.append(again.take(2))
        assert len(resumed) == len(positions) - shard - 1
        for name in fields:
            for mine, theirs in zip(resumed, got[shard + 1:]):
                np.testing.assert_array_equal(getattr(mine, name), getattr(theirs, name))


def _read_all(path: Path, **options) -> tuple[list[int], pa.Table]:
    firsts, batches = [], []
    for first_row, batch, *_ in iter_source(source_files(str(path)), **options):
        assert batch.num_rows <= options.get("batch_rows", 256)
        firsts.append(first_row)
        batches.append(batch)
    return firsts, pa.Table.from_batches(batches)


def test_the_reader_streams_all_three_formats_in_order_in_small_batches(tmp_path: Path) -> None:
    import datasets

    table = _table(23, 5)
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 10), tmp_path / "pq" / "a.parquet", row_group_size=4)
    pq.write_table(table.slice(10), tmp_path / "pq" / "b.parquet", row_group_size=3)
    (tmp_path / "js").mkdir()
    for name, part in (("a.jsonl", table.slice(0, 12)), ("b.jsonl", table.slice(12))):
        (tmp_path / "js" / name).write_text("".join(json.dumps(row) + "\n" for row in part.to_pylist()))
    datasets.Dataset.from_list(table.to_pylist()).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    datasets.DatasetDict({"test": datasets.Dataset.from_list(table.slice(0, 2).to_pylist()),
                          "train": datasets.Dataset.from_list(table.to_pylist())}).save_to_disk(str(tmp_path / "dict"))
    assert len(list((tmp_path / "saved").glob("*.arrow"))) == 3
    longest = max(len(line) for line in (tmp_path / "js" / "a.jsonl").read_text().splitlines())

    for path, extra in ((tmp_path / "pq", {}), (tmp_path / "js", {"json_block_bytes": longest * 2 + 2}),
                        (tmp_path / "saved", {}), (tmp_path / "dict", {})):
        firsts, read = _read_all(path, batch_rows=3, **extra)
        assert read.column("input_ids").to_pylist() == table.column("input_ids").to_pylist(), path
        np.testing.assert_allclose(np.asarray(read.column("topk_logprobs").to_pylist()),
                                   np.asarray(table.column("topk_logprobs").to_pylist()))
        assert firsts == sorted(firsts) and firsts[0] == 0 and len(firsts) >= 8
        skipped, rest = _read_all(path, batch_rows=3, start_row=11, columns=["input_ids"], **extra)
        assert skipped[0] == 11 and rest.column_names == ["input_ids"]
        assert rest.column("input_ids").to_pylist() == table.column("input_ids").to_pylist()[11:]


def _import(config, source: Path, teacher: str = "t") -> dict:
    return import_store(open_run_root(config), teacher_pass_settings(config), str(source), "kdflow", teacher)


def test_a_multi_file_parquet_source_is_imported_in_one_pass_as_its_packed_rows(make_config, tmp_path: Path) -> None:
    table = _table(40, 20)  # 800 positions of rows of 20: 25 packed rows of 32, 0 dropped; shards of 8 rows
    source = _write_parts(tmp_path / "src", table, [13, 27])
    config = _config(make_config, tmp_path / "run")
    summary = _import(config, source)
    assert summary | {"tag": None, "store": None, "teacher_fingerprint": None} == {
        "tag": None, "store": None, "teacher_fingerprint": None, "rows": 40, "shards": 4, "written": 4,
        "skipped": 0, "tail": "computed", "complete": True, "positions": 800, "targets": 800, "packed_rows": 25,
        "dropped_positions": 0, "staged_reused": 0, "masked": False, "normalisation": "full"}
    root = RunRoot(str(tmp_path / "run"))
    tokens = np.concatenate([read_token_shard(root, str(p)) for p in sorted((tmp_path / "run" / "tokens").glob(
        "shard-*.arrow"))])
    ids, logprobs = zip(*(read_topk_shard(root, str(p)) for p in sorted(
        (tmp_path / "run" / "topk" / summary["tag"]).glob("shard-*.arrow"))))
    flat = np.asarray(table.column("input_ids").to_pylist()).ravel()
    np.testing.assert_array_equal(tokens, flat.reshape(25, 32))
    np.testing.assert_array_equal(np.concatenate(ids), np.asarray(
        table.column("topk_ids").to_pylist()).reshape(25, 32, 8))
    np.testing.assert_allclose(np.concatenate(logprobs), np.asarray(
        table.column("topk_logprobs").to_pylist()).reshape(25, 32, 8), rtol=1e-6)
    assert not (tmp_path / "run" / "_imports").exists() or not any((tmp_path / "run" / "_imports").iterdir())

    # the same contents in other files (other names and times): the same store; other contents: another TAG
    same = _import(_config(make_config, tmp_path / "same"), _write_parts(tmp_path / "src2", table, [20]))
    assert same["tag"] == summary["tag"]
    changed = table.set_column(2, "topk_logprobs", pa.array(
        [[[v - 0.01 for v in position] for position in row] for row in table.column("topk_logprobs").to_pylist()]))
    other = _import(_config(make_config, tmp_path / "other"), _write_parts(tmp_path / "src3", changed, [20]))
    assert other["tag"] != summary["tag"]


def test_a_bad_row_in_the_last_file_leaves_nothing_visible_and_fails_the_rerun_alike(make_config,
                                                                                      tmp_path: Path) -> None:
    table = _table(40, 20)
    rows = table.column("topk_ids").to_pylist()
    rows[37][3][2] = 10**6
    bad = table.set_column(1, "topk_ids", pa.array(rows))
    source = _write_parts(tmp_path / "src", bad, [13, 27])
    config = _config(make_config, tmp_path / "run")
    messages = []
    for _ in range(2):
        with pytest.raises(StoreError) as error:
            _import(config, source)
        messages.append(str(error.value))
        assert not (tmp_path / "run" / "tokens").exists() and not (tmp_path / "run" / "topk").exists()
    assert messages[0] == messages[1]
    # the source's row 37 is row 10 of its third file (the files hold 13, 14 and 13 rows)
    assert messages[0].startswith("row 37 (counting from 0; row 10 of part-2.parquet) field topk_ids: id 1000000 at "
                                  "position 3 is outside")
    assert "\n" not in messages[0]
    # Nothing staged is kept: a fixed source is other files (another staging key), and this one fails alike.
    assert not (tmp_path / "run" / "_imports").exists()


@pytest.mark.usefixtures("children")
def test_kill_9_mid_import_resumes_to_the_uninterrupted_bytes(make_config, tmp_path: Path) -> None:
    import shutil

    from support.children import run
    from support.faults import write_config

    from kdflow.schemas.owners import owner_tag

    source = _write_parts(tmp_path / "src", _table(40, 20), [13, 27])
    reference = _import(_config(make_config, tmp_path / "reference"), source)
    config = write_config(_config(make_config, tmp_path / "run"), tmp_path / "run.yaml")
    command = [sys.executable, "-m", "kdflow", "store", "import", str(source), "--config", str(config), "--layout",
               "kdflow", "--teacher", "t"]
    killed = run(command, what="import killed", timeout=600,
                 env=os.environ | {"KDFLOW_FAULT": "kill@at=commit,stage=import,shard=2"})
    assert killed.returncode == -9, killed.stderr
    assert (tmp_path / "run" / "_faults" / "kill.at-commit.shard-2.stage-import.fired").exists()
    assert not (tmp_path / "run" / "topk").exists()
    # Had the source changed before the rerun, its KEY would differ and the killed import's staging stay forever
    # (~8 KB a position): a copy under another KEY stands for it; its process is dead. A live import's is kept.
    imports = tmp_path / "run" / "_imports"
    (staged,) = imports.iterdir()
    shutil.copytree(staged, imports / "abandoned")
    (imports / "live").mkdir()
    (imports / "live" / "_owner.txt").write_text(owner_tag())  # this test's process: alive
    done = run(command, what="import rerun", timeout=600)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[0])
    assert summary["tag"] == reference["tag"] and summary["staged_reused"] == 2 and summary["complete"]
    assert sorted(p.name for p in imports.iterdir()) == ["live"]  # the finished import's own staging went too
    assert f"removed {imports / 'abandoned'}, the staged work of a stopped import" in done.stderr

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("shard-*.arrow"))}

    assert files(tmp_path / "run") == files(tmp_path / "reference") and len(files(tmp_path / "run")) == 8


def test_a_source_without_a_column_of_its_layout_says_which(make_config, tmp_path: Path) -> None:
    table = _table(6, 20).drop_columns(["topk_logprobs"]).append_column("top_logprobs", pa.array([[0.0]] * 6))
    source = _write_parts(tmp_path / "src", table, [])
    with pytest.raises(StoreError, match=r"has no column 'topk_logprobs' of layout kdflow \(columns: input_ids, "
                                         r"topk_ids, top_logprobs\)$"):  # the source's columns, not just those read
        _import(_config(make_config, tmp_path / "run"), source)
    assert not (tmp_path / "run" / "tokens").exists()


def test_rows_of_varying_length_are_imported_as_their_concatenation_cut_every_seq_len(make_config,
                                                                                      tmp_path: Path) -> None:
    lengths = [5, 40, 17, 32, 1, 70, 9]
    table = _table(30, lengths, seed=3)
    total = sum(len(row) for row in table.column("input_ids").to_pylist())
    source = _write_parts(tmp_path / "src", table, [11, 12])
    summary = _import(_config(make_config, tmp_path / "run"), source)
    rows = total // 32
    assert (summary["positions"], summary["packed_rows"], summary["dropped_positions"]) == (total, rows, total % 32)
    root = RunRoot(str(tmp_path / "run"))
    tokens = np.concatenate([read_token_shard(root, str(p)) for p in sorted((tmp_path / "run" / "tokens").glob(
        "shard-*.arrow"))])
    ids = np.concatenate([read_topk_shard(root, str(p))[0] for p in sorted(
        (tmp_path / "run" / "topk" / summary["tag"]).glob("shard-*.arrow"))])
    flat_tokens = [t for row in table.column("input_ids").to_pylist() for t in row]
    flat_ids = [p for row in table.column("topk_ids").to_pylist() for p in row]
    np.testing.assert_array_equal(tokens, np.asarray(flat_tokens[:rows * 32]).reshape(rows, 32))
    np.testing.assert_array_equal(ids, np.asarray(flat_ids[:rows * 32]).reshape(rows, 32, 8))


@pytest.mark.parametrize("values", ["float32", "sqrt"])
def test_positions_holding_fewer_than_top_k_entries_are_stored_with_their_own_count(make_config, tmp_path: Path,
                                                                                    values: str) -> None:
    """A capture padded at the end of some positions (id -1, log-prob -inf: its source returned fewer than K) goes
    into a v2 store whose config asks for all K: each position keeps its own count, nothing else changes."""
    from kdflow.schemas.shards import TopkShard

    table = _table(40, 20, seed=3)  # 25 packed rows of 32, k = 8
    ids = np.asarray(table.column("topk_ids").to_pylist())  # (40, 20, 8)
    logprobs = np.asarray(table.column("topk_logprobs").to_pylist())
    short = np.random.default_rng(7).integers(1, 9, ids.shape[:2])  # entries per position, 8 = all of them
    ids[np.arange(8) >= short[..., None]], logprobs[np.arange(8) >= short[..., None]] = -1, -np.inf
    source = tmp_path / "short.parquet"
    pq.write_table(table.set_column(1, "topk_ids", pa.array(ids.tolist())).set_column(
        2, "topk_logprobs", pa.array(logprobs.tolist())), source)
    config = make_config(precompute__store__values=values).model_copy(update={"run_root": str(tmp_path / "run")})
    summary = _import(config, source)
    assert summary["complete"] and summary["written"] == 4
    root = RunRoot(config.run_root)
    shards = [TopkShard(root, str(p)) for p in sorted((tmp_path / "run" / "topk" / summary["tag"]).glob(
        "shard-*.arrow"))]
    decoded = [shard.read() for shard in shards]
    assert all(shard.codec.keep_mass == 1.0 for shard in shards)  # the count of each position is stored
    kept = np.concatenate([shard.kept for shard in decoded]).ravel()
    np.testing.assert_array_equal(kept, short.ravel())
    got_ids = np.concatenate([shard.ids for shard in decoded]).reshape(-1, 8)
    got_logprobs = np.concatenate([shard.logprobs for shard in decoded]).reshape(-1, 8)
    assert ((got_ids == -1) == (np.arange(8) >= short.reshape(-1, 1))).all()
    assert np.isneginf(got_logprobs[got_ids < 0]).all()
    order = np.argsort(-logprobs.reshape(-1, 8), axis=1, kind="stable")  # decoded: by descending value, as stored
    want_ids = np.take_along_axis(ids.reshape(-1, 8), order, 1)
    if values == "float32":
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_logprobs, logprobs.reshape(-1, 8).astype(np.float32))
    else:  # quantised: the same sets of ids, values within the codec's step
        assert [set(row) for row in got_ids] == [set(row) for row in want_ids]
    tail = np.concatenate([shard.tail for shard in decoded]).ravel()
    want_tail = np.log1p(-np.exp(logprobs.reshape(-1, 8)).sum(1))
    np.testing.assert_allclose(tail, want_tail, atol=2e-3, rtol=2e-3)  # float16 storage


def test_a_run_root_of_another_config_is_refused_before_the_source_is_read(make_config, tmp_path: Path) -> None:
    source = tmp_path / "src.parquet"
    pq.write_table(_table(40, 20), source)
    _import(_config(make_config, tmp_path / "run"), source)
    other = _config(make_config, tmp_path / "run", precompute__sequences_per_shard=4)
    with pytest.raises(StoreError, match="was made for another config .*; import into a new run root"):
        _import(other, source)
    assert not any((tmp_path / "run" / "_imports").glob("*/*"))  # nothing staged: the source was not read


def test_a_finished_import_is_not_read_again_unless_its_files_or_the_store_settings_change(
        make_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kdflow.tasks.teacher.logit_import as logit_import

    source = tmp_path / "src.parquet"
    pq.write_table(_table(40, 20), source)
    config = _config(make_config, tmp_path / "run")
    first = _import(config, source)
    staged = logit_import.stage_source

    def not_again(*args, **kwargs):
        raise AssertionError("the source was read again")

    monkeypatch.setattr(logit_import, "stage_source", not_again)
    again = _import(config, source)
    assert again == first | {"written": 0, "skipped": first["shards"], "staged_reused": 0}
    monkeypatch.setattr(logit_import, "stage_source", staged)
    v2 = make_config(precompute__logprobs_dtype="float32").model_copy(update={"run_root": str(tmp_path / "run")})
    other_format = _import(v2, source)
    assert other_format["tag"] != first["tag"] and other_format["written"] == first["shards"]  # read, as v2
    os.utime(source, ns=(1, 1))  # the file changed (or seems to): read and checked again, the same store
    assert _import(config, source)["tag"] == first["tag"]
