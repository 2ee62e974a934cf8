"""Materialise on small local files: formats, order, budgets, empty documents, errors, reruns, resume."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.corpus import DOCS, committed_documents, sample_documents, write_jsonl, write_source

from kdflow.schemas.commits import list_commits, read_complete
from kdflow.schemas.errors import KDFlowError
from kdflow.schemas.layout import CORPUS_DIR
from kdflow.schemas.stage_settings import materialise_settings, open_run_root
from kdflow.schemas.storage import RunRoot, sha256_of
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.corpus.records import DataError


def store_files(config: Any) -> dict[str, tuple[int, str]]:
    """name -> (mtime_ns, sha256) of every file in the corpus store."""
    run_root = RunRoot(config.run_root)
    store = run_root.path(CORPUS_DIR)
    return {name: (os.stat(f"{store}/{name}").st_mtime_ns, sha256_of(run_root, f"{store}/{name}"))
            for name in run_root.listdir(store)}


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "txt", "folder", "glob"])
def test_formats_give_the_documents_in_order(make_config: Callable[..., Any], tmp_path: Path, kind: str) -> None:
    config = make_config(dataset__path=write_source(tmp_path / "src", kind, DOCS), dataset__documents_per_part=4)
    summary = materialise(open_run_root(config), materialise_settings(config))
    assert (summary.parts, summary.documents, summary.parts_written, summary.skipped_empty) == (3, 11, 3, 0)
    assert committed_documents(config) == list(enumerate(DOCS))
    done = read_complete(RunRoot(config.run_root), RunRoot(config.run_root).path(CORPUS_DIR))
    assert done is not None and (done.shards, done.rows, done.fingerprint) == (3, 11, summary.fingerprint)
    assert done.extra.source_exhausted is True


def test_streaming_reads_the_same_documents(make_config: Callable[..., Any], tmp_path: Path) -> None:
    config = make_config(dataset__path=write_source(tmp_path / "src", "jsonl", DOCS), dataset__streaming=True,
                         dataset__documents_per_part=5)
    assert materialise(open_run_root(config), materialise_settings(config)).parts == 3
    assert committed_documents(config) == list(enumerate(DOCS))


def test_empty_documents_are_skipped_and_counted(make_config: Callable[..., Any], tmp_path: Path) -> None:
    docs = ["", "first", "   ", "second", "\n\t", "third", ""]
    config = make_config(dataset__path=str(write_jsonl(tmp_path / "e.jsonl", docs)), dataset__documents_per_part=2)
    summary = materialise(open_run_root(config), materialise_settings(config))
    assert (summary.documents, summary.skipped_empty) == (3, 4)
    assert committed_documents(config) == [(0, "first"), (1, "second"), (2, "third")]
    done = read_complete(RunRoot(config.run_root), RunRoot(config.run_root).path(CORPUS_DIR))
    assert done.extra.skipped_empty == 4
    assert summary.skipped_first == [0, 2, 4, 6]


def test_the_summary_names_the_first_records_it_skipped(make_config: Callable[..., Any], tmp_path: Path) -> None:
    """The flow's summary line names the skipped records as errors name records (counted from 1), the first five."""
    from kdflow.flows.materialise import _which

    docs = ["a", "", "b", *[""] * 6, "c"]
    config = make_config(dataset__path=str(write_jsonl(tmp_path / "e.jsonl", docs)), dataset__documents_per_part=2)
    summary = materialise(open_run_root(config), materialise_settings(config))
    assert (summary.skipped_empty, summary.skipped_first) == (7, [1, 3, 4, 5, 6])
    assert _which(summary.skipped_first, 7) == ", the first: records 2, 4, 5, 6, 7 of the dataset"
    assert _which([3], 1) == ": record 4 of the dataset" and _which([], 0) == ""


def test_max_documents(make_config: Callable[..., Any], tmp_path: Path) -> None:
    config = make_config(dataset__path=write_source(tmp_path / "src", "jsonl", DOCS), dataset__max_documents=6,
                         dataset__documents_per_part=4)
    summary = materialise(open_run_root(config), materialise_settings(config))
    assert (summary.parts, summary.documents) == (2, 6)
    assert committed_documents(config) == list(enumerate(DOCS[:6]))
    done = read_complete(RunRoot(config.run_root), RunRoot(config.run_root).path(CORPUS_DIR))
    assert done.extra.source_exhausted is False


def test_max_tokens_stops_once_the_budget_is_reached(make_config: Callable[..., Any], tiny_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)

    def count_tokens(texts: list[str]) -> list[int]:
        return [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]  # + EOS

    counts = count_tokens(sample_documents(60))
    budget = sum(counts[:20]) - 3  # reached inside document 19: it is the last one taken
    config = make_config(dataset__max_tokens=budget)
    with pytest.raises(KDFlowError, match="max_tokens needs a tokenizer"):
        materialise(open_run_root(config), materialise_settings(config))
    summary = materialise(open_run_root(config), materialise_settings(config), count_tokens)
    assert (summary.documents, summary.tokens) == (20, sum(counts[:20]))
    assert [text for _, text in committed_documents(config)] == sample_documents(20)


def test_missing_text_field_is_one_line_error(make_config: Callable[..., Any], tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bodies.jsonl", [{"body": "hello", "id": 1}])
    config = make_config(dataset__path=str(path))
    with pytest.raises(DataError) as caught:
        materialise(open_run_root(config), materialise_settings(config))
    assert str(caught.value) == "dataset has no text field 'text' (the fields of record 1 of the dataset: body, id)"
    assert list_commits(RunRoot(config.run_root), RunRoot(config.run_root).path(CORPUS_DIR), "corpus") == {}


@pytest.mark.parametrize("suffix, content, line", [
    (".jsonl", b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "bad \xff byte"}\n', 3),
    (".txt", b"fine\nalso fine\nbad \xfe byte\nfine again\n", 3),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_invalid_utf8_names_file_and_line(make_config: Callable[..., Any], tmp_path: Path, suffix: str, content: bytes,
                                          line: int, streaming: bool) -> None:
    path = tmp_path / f"broken{suffix}"
    path.write_bytes(content)
    config = make_config(dataset__path=str(path), dataset__streaming=streaming)
    with pytest.raises(DataError) as caught:
        materialise(open_run_root(config), materialise_settings(config))
    message = str(caught.value)
    assert message.startswith(f"{path}: invalid UTF-8 at line {line}") and "\n" not in message
    assert message.endswith("; kdflow reads UTF-8: convert it first (iconv -f ENCODING -t UTF-8)")
    run_root = RunRoot(config.run_root)
    assert list_commits(run_root, run_root.path(CORPUS_DIR), "corpus") == {}
    assert read_complete(run_root, run_root.path(CORPUS_DIR)) is None


@pytest.mark.parametrize("streaming", [False, True])
def test_a_malformed_json_line_names_its_file_and_line(make_config: Callable[..., Any], tmp_path: Path,
                                                      streaming: bool, capfd: pytest.CaptureFixture[str]) -> None:
    lines = [json.dumps({"text": f"document {i}"}) for i in range(40)]
    lines[29] = '{"text": "no closing quote}'
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = make_config(dataset__path=str(path), dataset__streaming=streaming, dataset__documents_per_part=8)
    with pytest.raises(DataError) as caught:
        materialise(open_run_root(config), materialise_settings(config))
    assert str(caught.value).startswith(f"dataset file {path}: line 30 is not valid JSON (")
    assert "\n" not in str(caught.value)
    assert "Failed to load JSON" not in capfd.readouterr().err  # datasets' own line ("Invalid encoding") is not shown
    run_root = RunRoot(config.run_root)
    assert read_complete(run_root, run_root.path(CORPUS_DIR)) is None


@pytest.mark.parametrize("content, says", [
    ("", "holds no records"),  # datasets: "generator raised StopIteration"
    ("\n\n", "holds no records"),  # datasets: 'Instruction "train" corresponds to no data!'
    ('{"text": ""}\n{"text": "   "}\n', "holds no documents: 2 records, all with an empty 'text'"),
])
def test_an_empty_dataset_says_so(make_config: Callable[..., Any], tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    config = make_config(dataset__path=str(path))
    with pytest.raises(DataError) as caught:
        materialise(open_run_root(config), materialise_settings(config))
    assert str(caught.value).startswith(f"dataset '{path}'") and says in str(caught.value), str(caught.value)
    run_root = RunRoot(config.run_root)
    assert read_complete(run_root, run_root.path(CORPUS_DIR)) is None


def test_rerun_does_no_work(make_config: Callable[..., Any]) -> None:
    config = make_config()
    first = materialise(open_run_root(config), materialise_settings(config))
    assert (first.parts, first.documents, first.parts_written) == (4, 60, 4)
    before = store_files(config)
    again = materialise(open_run_root(config), materialise_settings(config))
    assert again.parts_written == 0 and (again.parts, again.documents, again.fingerprint) == (4, 60, first.fingerprint)
    assert store_files(config) == before


@pytest.mark.parametrize("budget", ["max_documents", "max_tokens"])
def test_interrupted_run_resumes_to_identical_parts(make_config: Callable[..., Any], tiny_tokenizer_dir: Path,
                                                    tmp_path: Path, budget: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)

    def count_tokens(texts: list[str]) -> list[int]:
        return [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    docs = sample_documents(40)
    for index in (3, 9, 10, 17, 30):
        docs.insert(index, "   ")  # empty documents on both sides of the interruption
    path = str(write_jsonl(tmp_path / "docs.jsonl", docs))
    limit = 33 if budget == "max_documents" else sum(count_tokens(sample_documents(33))) - 5

    def config_at(name: str) -> Any:
        return make_config(run_root=str(tmp_path / name), dataset__path=path, dataset__documents_per_part=6,
                           **{f"dataset__{budget}": limit})

    reference, interrupted = config_at("reference"), config_at("interrupted")
    expected = materialise(open_run_root(reference), materialise_settings(reference), count_tokens)
    seen: list[int] = []

    def stop_after_two(record: Any) -> None:
        seen.append(record.shard_id)
        if len(seen) == 2:
            raise KeyboardInterrupt("stopped after part 1")

    with pytest.raises(KeyboardInterrupt):
        materialise(open_run_root(interrupted), materialise_settings(interrupted), count_tokens, on_part=stop_after_two)
    run_root = RunRoot(interrupted.run_root)
    assert sorted(list_commits(run_root, run_root.path(CORPUS_DIR), "corpus")) == [0, 1]
    assert read_complete(run_root, run_root.path(CORPUS_DIR)) is None

    resumed = materialise(open_run_root(interrupted), materialise_settings(interrupted), count_tokens)
    assert resumed.parts_written == expected.parts - 2
    assert (resumed.parts, resumed.documents, resumed.tokens) == (expected.parts, 33, expected.tokens)
    assert resumed.skipped_empty == expected.skipped_empty == 5
    assert committed_documents(interrupted) == committed_documents(reference)
    assert {n: sha for n, (_, sha) in store_files(interrupted).items() if n.endswith(".parquet")} == \
        {n: sha for n, (_, sha) in store_files(reference).items() if n.endswith(".parquet")}
    records = [list_commits(RunRoot(c.run_root), RunRoot(c.run_root).path(CORPUS_DIR), "corpus")
               for c in (reference, interrupted)]
    assert [r.extra for _, r in sorted(records[0].items())] == [r.extra for _, r in sorted(records[1].items())]

