"""The corpus's sources beyond plain files: compressed JSON and text, `data_files` inside a folder or on the hub,
folders written by `datasets`' `save_to_disk`, and files of a type kdflow cannot read. Each through the pre-flight
look (`probe_dataset`) and materialise, against the same documents written plainly."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.corpus import DOCS, committed_documents, write_jsonl, write_source

from kdflow.schemas.config import DatasetConfig
from kdflow.schemas.errors import ConfigError, KDFlowError
from kdflow.schemas.fingerprints import corpus_fingerprint
from kdflow.schemas.stage_settings import materialise_settings, open_run_root
from kdflow.tasks.corpus.dataset_files import file_builder
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.corpus.probe import probe_dataset
from kdflow.tasks.corpus.records import DataError


def _compress(path: Path, suffix: str) -> Path:
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[suffix]
    target = path.with_name(path.name + suffix)
    with opener(target, "wb") as handle:
        handle.write(path.read_bytes())
    path.unlink()
    return target


@pytest.mark.parametrize("kind, suffix", [("jsonl", ".gz"), ("json", ".bz2"), ("txt", ".xz"), ("folder", ".gz")])
@pytest.mark.parametrize("streaming", [False, True])
def test_compressed_json_and_text_files_give_the_same_documents(make_config: Callable[..., Any], tmp_path: Path,
                                                                kind: str, suffix: str, streaming: bool) -> None:
    path = write_source(tmp_path / "src", kind, DOCS)
    files = sorted((tmp_path / "src").rglob("docs.*"))
    for name in files:
        _compress(name, suffix)
    if kind != "folder":
        path += suffix
    config = make_config(dataset__path=path, dataset__documents_per_part=4, dataset__streaming=streaming)
    assert probe_dataset(config.dataset) is None  # the pre-flight look reads the first record through it
    assert materialise(open_run_root(config), materialise_settings(config)).documents == len(DOCS)
    assert committed_documents(config) == list(enumerate(DOCS))
    wrong = make_config(dataset__path=path, dataset__text_field="body")
    if kind != "txt":
        with pytest.raises(KDFlowError, match=r"dataset.text_field='body' is not a field of .*\{}".format(suffix)):
            probe_dataset(wrong.dataset)


@pytest.mark.parametrize("kind, suffix", [("jsonl", ""), ("json", ""), ("txt", ""), ("txt", ".gz")])
@pytest.mark.parametrize("streaming", [False, True])
def test_files_saved_with_a_byte_order_mark_and_crlf_line_ends_give_the_same_documents(
        make_config: Callable[..., Any], tmp_path: Path, kind: str, suffix: str, streaming: bool) -> None:
    """As editors on Windows save them: the mark is not text (the first document of a .txt kept it, and the
    pre-flight look refused a .jsonl that `datasets` reads), and a line end is not part of a line."""
    path = Path(write_source(tmp_path / "src", kind, DOCS))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n"))
    if suffix:
        path = _compress(path, suffix)
    config = make_config(dataset__path=str(path), dataset__documents_per_part=4, dataset__streaming=streaming)
    assert probe_dataset(config.dataset) is None
    materialise(open_run_root(config), materialise_settings(config))
    assert committed_documents(config) == list(enumerate(DOCS))


def test_a_bad_line_in_a_compressed_file_is_named_and_an_unknown_file_type_is_refused(
        make_config: Callable[..., Any], tmp_path: Path) -> None:
    import importlib.util

    lines = [json.dumps({"text": f"document {i}"}) for i in range(12)]
    lines[7] = '{"text": "no closing quote}'
    plain = tmp_path / "docs.jsonl"
    plain.write_text("\n".join(lines) + "\n")
    path = _compress(plain, ".gz")
    compressed = make_config(dataset__path=str(path))
    with pytest.raises(DataError) as caught:
        materialise(open_run_root(compressed), materialise_settings(compressed))
    assert str(caught.value).startswith(f"dataset file {path}: line 8 is not valid JSON (")
    settings = tmp_path / "settings.yaml"  # a file that exists but is no corpus: not taken for a hub dataset id
    settings.write_text("a: 1\n")
    with pytest.raises(ConfigError) as refused:
        probe_dataset(make_config(dataset__path=str(settings)).dataset)
    assert str(refused.value).startswith(f"dataset.path: cannot tell the format of '{settings}' (use .jsonl, ")
    zstd = tmp_path / "docs.jsonl.zst"
    zstd.write_bytes(b"\x28\xb5\x2f\xfd")  # zstd's magic number; needs the zstandard package to be read
    if importlib.util.find_spec("zstandard") is None:
        with pytest.raises(ConfigError, match=r"is zstandard-compressed: install it \(pip install zstandard\)"):
            probe_dataset(make_config(dataset__path=str(zstd)).dataset)


def test_data_files_are_found_inside_a_local_folder_and_left_to_the_hub_for_a_hub_id(
        make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    folder = Path(write_source(tmp_path / "src", "folder", DOCS))  # files/00/docs.jsonl, files/01/..., files/02/...
    (folder / "03").mkdir()
    write_jsonl(folder / "03" / "other.jsonl", ["not asked for"])
    config = make_config(dataset__path=str(folder), dataset__data_files="*/docs.jsonl", dataset__documents_per_part=4)
    assert probe_dataset(config.dataset) is None
    assert materialise(open_run_root(config), materialise_settings(config)).documents == len(DOCS)
    assert committed_documents(config) == list(enumerate(DOCS))
    listed = make_config(dataset__path=str(folder), dataset__data_files=["02/docs.jsonl", "00/docs.jsonl"])
    assert file_builder(listed.dataset) == ("json", [str(folder / "02" / "docs.jsonl"),
                                                     str(folder / "00" / "docs.jsonl")])  # in the order given
    with pytest.raises(ConfigError) as caught:
        probe_dataset(make_config(dataset__path=str(folder), dataset__data_files="*/missing.jsonl").dataset)
    assert str(caught.value) == f"dataset.data_files: no file matches '*/missing.jsonl' in {folder}"
    monkeypatch.setenv("HOME", str(folder))  # `~` in a path is the home folder, as pre-flight already took it
    assert file_builder(DatasetConfig(path="~/00/docs.jsonl")) == ("json", [str(folder / "00" / "docs.jsonl")])
    hub = DatasetConfig(path="allenai/c4", data_files="en/c4-train.00000-of-01024.json.gz")
    assert file_builder(hub) is None  # resolved by `datasets` on the hub, never globbed here
    with pytest.raises(ConfigError, match="does not exist"):
        probe_dataset(DatasetConfig(path=str(tmp_path / "typo"), data_files="*.jsonl"))
    monkeypatch.chdir(tmp_path)  # a relative path is looked for from the working directory, and the error says so
    with pytest.raises(ConfigError) as caught:
        probe_dataset(DatasetConfig(path="typo/*.jsonl"))
    assert str(caught.value) == f"dataset.path: no file matches 'typo/*.jsonl' (from the working directory {tmp_path})"


@pytest.mark.parametrize("kind", ["dataset", "dataset_dict"])
def test_a_saved_dataset_folder_is_read_with_its_split_and_resumes(make_config: Callable[..., Any], tmp_path: Path,
                                                                  kind: str) -> None:
    import datasets

    table = datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))})
    folder = tmp_path / "saved"
    if kind == "dataset":
        table.save_to_disk(str(folder))
        split = "train"  # a Dataset has no splits: any is taken as it
    else:
        other = datasets.Dataset.from_dict({"text": ["another split"], "n": [0]})
        datasets.DatasetDict({"train": other, "validation": table}).save_to_disk(str(folder))
        split = "validation"
    config = make_config(dataset__path=str(folder), dataset__split=split, dataset__documents_per_part=4)
    assert probe_dataset(config.dataset) is None
    stopped: list[int] = []

    def stop_after_one(record: Any) -> None:
        stopped.append(record.shard_id)
        raise KeyboardInterrupt("stopped after the first part")

    with pytest.raises(KeyboardInterrupt):
        materialise(open_run_root(config), materialise_settings(config), on_part=stop_after_one)
    resumed = materialise(open_run_root(config), materialise_settings(config))
    assert resumed.parts_written == 2  # resumed after the first part
    assert committed_documents(config) == list(enumerate(DOCS))
    with pytest.raises(ConfigError, match=r"dataset.text_field='body' is not a field of .*saved \(its first record "
                                          r"has: n, text\)"):
        probe_dataset(make_config(dataset__path=str(folder), dataset__split=split, dataset__text_field="body").dataset)
    if kind == "dataset_dict":
        with pytest.raises(ConfigError) as caught:
            probe_dataset(make_config(dataset__path=str(folder), dataset__split="test").dataset)
        assert str(caught.value) == f"dataset {str(folder)!r} has no split 'test' (it has: train, validation)"
    with pytest.raises(ConfigError, match="is a saved dataset .* remove data_files"):
        file_builder(DatasetConfig(path=str(folder), data_files="*.arrow"))


def test_a_folder_is_read_by_type_then_name_as_before_with_compressed_files_after(tmp_path: Path) -> None:
    """The order plain files were always read in (so a folder that read before reads the same), then compressed."""
    import gzip

    for name in ("b.jsonl", "a.json", "c.jsonl", "d.jsonl.gz", "sub/a.jsonl", "notes.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(gzip.compress(b"{}\n") if name.endswith(".gz") else b"{}\n")
    (tmp_path / "dir.jsonl").mkdir()  # a folder named like a file is no file
    builder, files = file_builder(DatasetConfig(path=str(tmp_path)))
    assert builder == "json"
    assert [str(Path(f).relative_to(tmp_path)) for f in files] == [
        "b.jsonl", "c.jsonl", "sub/a.jsonl", "a.json", "d.jsonl.gz"]
    # a glob without an extension is the files it matches, never taken for a hub id
    assert file_builder(DatasetConfig(path=str(tmp_path / "[bc].*"))) == ("json", [str(tmp_path / "b.jsonl"),
                                                                               str(tmp_path / "c.jsonl")])
    for pattern, problem in (("*", "cannot tell the format of '{}/notes.md', which '{}/*' matches"),
                             ("nothing*", "no file matches '{}/nothing*'"), ("sub/", None)):
        if problem is None:
            assert file_builder(DatasetConfig(path=f"{tmp_path}/{pattern}"))[1] == [str(tmp_path / "sub" / "a.jsonl")]
            continue
        with pytest.raises(ConfigError) as caught:
            file_builder(DatasetConfig(path=f"{tmp_path}/{pattern}"))
        assert str(caught.value).startswith(f"dataset.path: {problem.format(tmp_path, tmp_path)}")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.md").write_text("# no corpus here")
    with pytest.raises(ConfigError, match=r"dataset.path: '.*/notes' holds no file kdflow reads \(.jsonl, "):
        file_builder(DatasetConfig(path=str(tmp_path / "notes")))
    with pytest.raises(ConfigError, match=r"dataset.path: no file matches '.*/gone/'"):
        file_builder(DatasetConfig(path=f"{tmp_path}/gone/"))


@pytest.mark.parametrize("streaming", [False, True])
def test_txt_files_give_a_document_per_line_paragraph_or_file_as_sample_by_says(
        make_config: Callable[..., Any], tmp_path: Path, streaming: bool) -> None:
    books = tmp_path / "books"
    books.mkdir()
    texts = {"a.txt": "Chapter one.\nIt begins.\n\nChapter two.\nIt ends.\n", "b.txt": "A short note.\n"}
    for name, text in texts.items():
        (books / name).write_text(text, encoding="utf-8")
    expected = {
        "line": ["Chapter one.", "It begins.", "Chapter two.", "It ends.", "A short note."],  # the empty line skipped
        "paragraph": ["Chapter one.\nIt begins.", "Chapter two.\nIt ends.", "A short note."],
        "document": [texts["a.txt"], texts["b.txt"]],
    }
    fingerprints = set()
    for sample_by, documents in expected.items():
        config = make_config(run_root=str(tmp_path / sample_by), dataset__path=str(books),
                             dataset__sample_by=sample_by, dataset__streaming=streaming)
        assert probe_dataset(config.dataset) is None
        materialise(open_run_root(config), materialise_settings(config))
        assert [text.strip("\n") for _, text in committed_documents(config)] == [d.strip("\n") for d in documents]
        fingerprints.add(corpus_fingerprint(config))
    assert len(fingerprints) == 3  # another split of the same files is another corpus

    jsonl = make_config(dataset__path=str(write_jsonl(tmp_path / "d.jsonl", DOCS)), dataset__sample_by="document")
    with pytest.raises(ConfigError, match=r"^dataset.sample_by='document' applies to .txt files; .*d.jsonl is json"):
        probe_dataset(jsonl.dataset)


def test_a_field_added_to_the_dataset_section_leaves_existing_corpus_fingerprints_as_they_were() -> None:
    """Pinned values, computed before `sample_by` existed: stores made then keep their fingerprints and resume."""
    from kdflow.schemas.config_io import config_from_dict

    base = {"run_root": "r", "teacher": {"model": "t"}, "student": {"name": "s"}}
    books = config_from_dict(base | {"dataset": {"path": "books/*.txt"}})
    culturax = config_from_dict(base | {"dataset": {"path": "uonlp/CulturaX", "name": "ja", "streaming": True,
                                                    "max_tokens": 200_000_000, "documents_per_part": 50_000}})
    assert (corpus_fingerprint(books), corpus_fingerprint(culturax)) == ("c08286bdc1d03e8d", "94a68e7f4d6cf3a7")
    assert corpus_fingerprint(config_from_dict(base | {"dataset": {"path": "books/*.txt", "sample_by": "line"}})) \
        == "c08286bdc1d03e8d"  # the default, said out loud, is the same corpus
    under = config_from_dict(base | {"dataset": {"path": "books/*.txt", "json_field": "data"}})
    assert corpus_fingerprint(under) != "c08286bdc1d03e8d"  # set, it names another corpus


@pytest.mark.parametrize("kind, suffix", [("csv", ""), ("tsv", ""), ("csv", ".gz")])
@pytest.mark.parametrize("streaming", [False, True])
def test_csv_and_tsv_files_give_their_text_column_as_written(make_config: Callable[..., Any], tmp_path: Path,
                                                            kind: str, suffix: str, streaming: bool) -> None:
    """A header row names the columns, and the text column reads as written: a document of digits stays text,
    'NA' and 'null' are documents, not missing values, and a quoted document may hold the delimiter, quotes and
    line ends. Saved as Windows does it (a byte-order mark, CRLF), and compressed."""
    import csv

    docs = [*DOCS, "12345", "NA", "null", 'a "quoted", two-line\ndocument\twith a tab']
    path = tmp_path / f"docs.{kind}"
    with open(path, "w", encoding="utf-8-sig", newline="") as handle:
        writer = csv.writer(handle, delimiter="," if kind == "csv" else "\t", lineterminator="\r\n")
        writer.writerow(["", "body", "id"])  # an unnamed index column, as pandas' to_csv writes one
        writer.writerows([i, doc, "x" if i % 5 else i] for i, doc in enumerate(docs))
    if suffix:
        path = _compress(path, suffix)
    config = make_config(dataset__path=str(path), dataset__text_field="body", dataset__documents_per_part=4,
                         dataset__streaming=streaming)
    assert probe_dataset(config.dataset) is None
    assert materialise(open_run_root(config), materialise_settings(config)).documents == len(docs)
    assert committed_documents(config) == list(enumerate(docs))
    with pytest.raises(ConfigError) as caught:
        probe_dataset(make_config(dataset__path=str(path)).dataset)
    assert str(caught.value) == f"dataset.text_field='text' is not a column of {path} (its header row has: , body, id)"


def test_a_csv_row_with_another_number_of_fields_or_an_open_quote_is_named(make_config: Callable[..., Any],
                                                                          tmp_path: Path) -> None:
    rows = tmp_path / "rows.csv"
    rows.write_text('id,text\n1,hello\n2,"two, fields"\n3,three,fields\n')
    ragged = make_config(dataset__path=str(rows))
    with pytest.raises(DataError) as caught:
        materialise(open_run_root(ragged), materialise_settings(ragged))
    assert str(caught.value) == f"dataset file {rows}: line 4 has 3 fields, its header 2"
    quote = tmp_path / "quote.tsv"
    quote.write_text('id\ttext\n1\t"never closed\n2\tnext\n')
    quoted = make_config(run_root=str(tmp_path / "q"), dataset__path=str(quote))
    with pytest.raises(DataError) as caught:
        materialise(open_run_root(quoted), materialise_settings(quoted))
    assert str(caught.value) == (f"dataset file {quote}: line 3: unexpected end of data "
                                 "(a quoted field never closed?)")
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"empty.csv is empty: no header row naming its columns$"):
        probe_dataset(make_config(dataset__path=str(empty)).dataset)


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_a_later_file_without_the_text_field_is_named_before_any_work(tmp_path: Path, kind: str) -> None:
    """Only the first file was probed: a later one without the field failed inside materialise with
    "DatasetGenerationError: An error occurred while generating the dataset". Columns in another order read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(name: str, columns: dict[str, list[str]]) -> Path:
        path = tmp_path / f"{name}.{kind}"
        if kind == "parquet":
            pq.write_table(pa.table(columns), path)
        elif kind == "csv":
            path.write_text(",".join(columns) + "\n" + "".join(",".join(row) + "\n" for row in zip(*columns.values())))
        else:
            path.write_text("".join(json.dumps(dict(zip(columns, row))) + "\n" for row in zip(*columns.values())))
        return path

    write("a", {"id": ["1"], "text": ["one"]})
    write("b", {"text": ["two"], "id": ["2"]})  # another order: fine
    dataset = DatasetConfig(path=str(tmp_path))
    assert probe_dataset(dataset) is None
    c = write("c", {"id": ["3"], "body": ["three"]})
    with pytest.raises(ConfigError) as caught:
        probe_dataset(dataset)
    has = ("a column of {} (its header row has: id, body)" if kind == "csv"
           else "a field of {} (its first record has: body, id)")
    assert str(caught.value) == "dataset.text_field='text' is not " + has.format(c)


def test_a_record_whose_text_is_not_a_string_is_named_counting_from_one(make_config: Callable[..., Any],
                                                                       tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "nums.jsonl", ["a real document", {"text": 123}])
    numbers = make_config(dataset__path=str(source))
    with pytest.raises(DataError) as caught:  # it said "record 1" for the second line
        materialise(open_run_root(numbers), materialise_settings(numbers))
    assert str(caught.value) == "dataset field 'text' holds int, not text (record 2 of the dataset, counting from 1)"
