"""The commit protocol and storage: records written last, invalid records ignored, manifests validated."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pandas as pd
import pytest

from kdflow.schemas.commits import (CommitRecord, StageComplete, check_commit, committed_prefix, list_commits,
                                    read_complete, stage_dir, write_commit, write_complete)
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import commit_file_name, data_file_name
from kdflow.schemas.manifests import load_manifest, manifest_frame, validate_manifest
from kdflow.schemas.storage import RunRoot, sha256_of

SEQ_LEN = 4
FINGERPRINT = "f" * 16


@pytest.fixture
def run_root(tmp_path: Path) -> RunRoot:
    return RunRoot(str(tmp_path / "run"))


def commit_shard(run_root: RunRoot, store: str, shard_id: int, payload: bytes, fingerprint: str = FINGERPRINT,
                 rows: int = 2) -> CommitRecord:
    """Write a tokens-stage data file, then its record (last), the way a stage does."""
    name = data_file_name("tokens", shard_id)
    sha = run_root.write_bytes_atomic(f"{store}/{name}", payload)
    record = CommitRecord(stage="tokens", shard_id=shard_id, data_file=name, rows=rows, tokens=rows * SEQ_LEN,
                          bytes=len(payload), sha256=sha, fingerprint=fingerprint)
    write_commit(run_root, store, record)
    return record


def test_names_and_layout(run_root: RunRoot) -> None:
    assert data_file_name("tokens", 3) == "shard-00003.arrow"
    assert data_file_name("corpus", 12) == "part-00012.parquet"
    assert commit_file_name("topk", 7) == "shard-00007.commit.json"
    assert stage_dir(run_root, "tokens") == os.path.join(run_root.root, "tokens")
    assert stage_dir(run_root, "topk", "abc123") == os.path.join(run_root.root, "topk", "abc123")
    with pytest.raises(ValueError, match="tag"):
        stage_dir(run_root, "topk")


def test_committed_shards_are_listed_and_data_without_record_is_invisible(run_root: RunRoot) -> None:
    store = stage_dir(run_root, "tokens")
    first = commit_shard(run_root, store, 0, b"zero")
    commit_shard(run_root, store, 1, b"one!")
    run_root.write_bytes_atomic(f"{store}/{data_file_name('tokens', 2)}", b"two, no record yet")
    records = list_commits(run_root, store, "tokens", FINGERPRINT)
    assert sorted(records) == [0, 1]
    assert records[0] == first and first.sha256 == hashlib.sha256(b"zero").hexdigest()
    assert check_commit(run_root, store, "tokens", 2, FINGERPRINT) == (None, "no commit record")
    assert committed_prefix(records) == 2
    assert committed_prefix({0: first, 2: first}) == 1 and committed_prefix({}) == 0


def test_a_listing_while_another_writer_renames_its_files_still_sees_every_commit(run_root: RunRoot) -> None:
    """Two teacher workers on one store: a file that vanished between the folder's listing and its size (the
    other's temporary file, renamed) made the whole listing empty, so a worker that had seen every shard commit
    ended without _complete.json (a flaky race test showed it)."""
    import threading

    store = stage_dir(run_root, "tokens")
    commit_shard(run_root, store, 0, b"zero")
    stop, moving = threading.Event(), os.path.join(store, ".shard-00001.arrow.tmp-1")

    def rename_back_and_forth() -> None:
        while not stop.is_set():
            Path(moving).touch()
            os.replace(moving, moving + "x")
            os.remove(moving + "x")

    other = threading.Thread(target=rename_back_and_forth, daemon=True)
    other.start()
    try:
        listings = [sorted(list_commits(run_root, store, "tokens", FINGERPRINT)) for _ in range(5000)]
    finally:
        stop.set()
        other.join()
    assert all(listing == [0] for listing in listings), sum(listing != [0] for listing in listings)


def test_invalid_records_are_ignored_with_a_reason(run_root: RunRoot) -> None:
    store = stage_dir(run_root, "tokens")
    for shard_id in range(4):
        commit_shard(run_root, store, shard_id, b"payload-%d" % shard_id)
    os.remove(f"{store}/{data_file_name('tokens', 0)}")  # data file missing
    run_root.write_bytes_atomic(f"{store}/{data_file_name('tokens', 1)}", b"shorter")  # another size
    commit_shard(run_root, store, 2, b"payload-2", fingerprint="0" * 16)  # another fingerprint
    with open(f"{store}/{commit_file_name('tokens', 3)}", "w") as handle:  # half-written record
        handle.write('{"stage": "tokens", "shard_')

    assert check_commit(run_root, store, "tokens", 0, FINGERPRINT) == (None, "data file missing")
    assert check_commit(run_root, store, "tokens", 1, FINGERPRINT) == (None, "data file has 7 bytes, its record says 9")
    record, reason = check_commit(run_root, store, "tokens", 2, FINGERPRINT)
    assert record is None and reason == f"fingerprint {'0' * 16} is not the store's {FINGERPRINT}"
    record, reason = check_commit(run_root, store, "tokens", 3, FINGERPRINT)
    assert record is None and reason.startswith("unreadable commit record")
    assert list_commits(run_root, store, "tokens", FINGERPRINT) == {}
    # Without a fingerprint to compare with, only the record of shard 2 is valid.
    assert sorted(list_commits(run_root, store, "tokens")) == [2]


def test_record_that_names_another_shard_is_invalid(run_root: RunRoot) -> None:
    store = stage_dir(run_root, "tokens")
    record = commit_shard(run_root, store, 0, b"zero")
    moved = record.model_copy(update={"shard_id": 5})
    run_root.write_bytes_atomic(f"{store}/{commit_file_name('tokens', 1)}", moved.model_dump_json().encode())
    assert check_commit(run_root, store, "tokens", 1) == (None, "commit record names another shard")


def test_complete_marker_round_trip_and_corruption(run_root: RunRoot) -> None:
    store = stage_dir(run_root, "tokens")
    assert read_complete(run_root, store) is None
    complete = StageComplete(stage="tokens", shards=3, rows=6, tokens=24, fingerprint=FINGERPRINT, extra={"seq_len": 4})
    write_complete(run_root, store, complete)
    assert read_complete(run_root, store) == complete
    run_root.write_bytes_atomic(f"{store}/_complete.json", b"{broken")
    with pytest.raises(StoreError, match="_complete.json: unreadable"):
        read_complete(run_root, store)


def test_atomic_writer_leaves_nothing_on_error(run_root: RunRoot) -> None:
    target = run_root.path("tokens", "shard-00000.arrow")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with run_root.atomic_writer(target) as writer:
            writer.write(b"half of the data")
            raise RuntimeError("disk on fire")
    assert not os.path.exists(target)
    assert os.listdir(os.path.dirname(target)) == []  # no temp file left behind
    with run_root.atomic_writer(target) as writer:
        writer.write(b"all of ")
        writer.write(memoryview(b"the data"))
    assert open(target, "rb").read() == b"all of the data"
    assert writer.nbytes == 15
    assert writer.sha256 == hashlib.sha256(b"all of the data").hexdigest() == sha256_of(run_root, target)
    assert os.listdir(os.path.dirname(target)) == ["shard-00000.arrow"]


def test_failed_rewrite_keeps_the_old_file(run_root: RunRoot) -> None:
    target = run_root.path("corpus", "part-00000.parquet")
    run_root.write_bytes_atomic(target, b"old")
    with pytest.raises(KeyboardInterrupt):
        with run_root.atomic_writer(target) as writer:
            writer.write(b"new but interrupted")
            raise KeyboardInterrupt
    assert open(target, "rb").read() == b"old" and os.listdir(os.path.dirname(target)) == ["part-00000.parquet"]


def good_records(count: int = 3) -> list[CommitRecord]:
    return [CommitRecord(stage="tokens", shard_id=i, data_file=data_file_name("tokens", i), rows=2, tokens=2 * SEQ_LEN,
                         bytes=10 + i,
                         sha256=hashlib.sha256(b"%d" % i).hexdigest(), fingerprint=FINGERPRINT) for i in range(count)]


def test_valid_manifest_passes() -> None:
    frame = validate_manifest(manifest_frame(good_records()), "tokens", SEQ_LEN)
    assert frame["shard_id"].tolist() == [0, 1, 2] and int(frame["tokens"].sum()) == 3 * 2 * SEQ_LEN


def manifest_error(frame: pd.DataFrame, stage: str = "tokens") -> str:
    with pytest.raises(StoreError) as caught:
        validate_manifest(frame, stage, SEQ_LEN, name="tokens/")  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("manifest of tokens/ is invalid: ") and "\n" not in message
    return message


def test_manifest_rejects_duplicate_shard_ids() -> None:
    records = good_records()
    records[2] = records[2].model_copy(update={"shard_id": 1})
    assert "on column shard_id" in manifest_error(manifest_frame(records))


def test_manifest_rejects_bad_sha256() -> None:
    frame = manifest_frame(good_records())
    frame.loc[1, "sha256"] = "ABC"
    assert "sha256" in manifest_error(frame)


def test_manifest_rejects_tokens_that_are_not_rows_times_seq_len() -> None:
    records = good_records()
    records[2] = records[2].model_copy(update={"tokens": 2 * SEQ_LEN - 1})
    assert "shard 2 has tokens != rows x seq_len" in manifest_error(manifest_frame(records))


def test_manifest_rejects_two_fingerprints() -> None:
    records = good_records()
    records[0] = records[0].model_copy(update={"fingerprint": "0" * 16})
    assert "exactly one fingerprint" in manifest_error(manifest_frame(records))


def test_topk_manifest_needs_input_hashes() -> None:
    records = [r.model_copy(update={"stage": "topk"}) for r in good_records()]
    assert "does not name its token shard" in manifest_error(manifest_frame(records), "topk")
    named = [r.model_copy(update={"input_sha256": r.sha256}) for r in records]
    assert len(validate_manifest(manifest_frame(named), "topk", SEQ_LEN)) == 3


def test_load_manifest_reads_the_store(run_root: RunRoot) -> None:
    store = stage_dir(run_root, "tokens")
    for shard_id in range(3):
        commit_shard(run_root, store, shard_id, b"x" * (shard_id + 1))
    frame = load_manifest(run_root, store, "tokens", FINGERPRINT, SEQ_LEN)
    assert frame["bytes"].tolist() == [1, 2, 3]
    commit_shard(run_root, store, 3, b"other", fingerprint="0" * 16)
    with pytest.raises(StoreError, match="exactly one fingerprint"):
        load_manifest(run_root, store, "tokens", None, SEQ_LEN)


@pytest.mark.parametrize("part", ["..", "../x", "a/../../b", "/etc", "a//b", ".hidden", "a/.git", "", "a b", "~"])
def test_run_root_path_rejects_escaping_components(run_root: RunRoot, part: str) -> None:
    with pytest.raises(StoreError, match="unsafe path component"):
        run_root.path("tokens", part)


def test_run_root_path_joins_safe_components(run_root: RunRoot) -> None:
    assert (run_root.path("topk", "abc123/shard-00000.arrow")
            == os.path.join(run_root.root, "topk", "abc123/shard-00000.arrow"))
    assert run_root.path("tokens", "_complete.json") == os.path.join(run_root.root, "tokens", "_complete.json")
    assert RunRoot("file:///tmp/kd").root == "/tmp/kd"


@pytest.mark.parametrize("make_url", [lambda tmp: str(tmp / "a-file" / "run"), lambda tmp: "/proc/kdflow-test/run"])
def test_unwritable_run_root_is_one_line_error(tmp_path: Path, make_url) -> None:
    # Tests run as root, where a chmod 0o500 folder is still writable: a path under a regular file is not.
    (tmp_path / "a-file").write_text("a file, not a folder")
    url = make_url(tmp_path)
    with pytest.raises(StoreError) as caught:
        RunRoot(url).ensure_writable()
    message = str(caught.value)
    assert message.startswith(f"run root {url!r} cannot be written: ") and "\n" not in message


def test_listdir_and_remove_tolerate_missing_paths(run_root: RunRoot) -> None:
    assert run_root.listdir(run_root.path("nothing-here")) == []
    run_root.remove(run_root.path("nothing-here", "x"))
    run_root.write_bytes_atomic(run_root.path("tokens", "b"), b"1")
    run_root.write_bytes_atomic(run_root.path("tokens", "a"), b"2")
    assert run_root.listdir(run_root.path("tokens")) == ["a", "b"]
    run_root.remove(run_root.path("tokens", "a"))
    assert (not run_root.exists(run_root.path("tokens", "a"))
            and run_root.read_bytes(run_root.path("tokens", "b")) == b"1")
