"""Text and JSONL for tiny runs: real English that ships with Python, and the tiny tokenizer's vocabulary size; the
same few documents in each source format materialise reads, and what a corpus store holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_VOCAB = 384


def sample_documents(count: int = 60) -> list[str]:
    """Real English text that ships with Python: its documentation topics, one paragraph a document."""
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n") if len(p.strip()) > 40]
    return paragraphs[:count]


def write_jsonl(path: Path, documents: list[Any], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for doc in documents:
            handle.write(json.dumps(doc if isinstance(doc, dict) else {field: doc}) + "\n")
    return path


def flip_byte(path: str, offset: int = -40) -> None:
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0x01
    Path(path).write_bytes(bytes(data))


DOCS = [f"document number {i}: " + "word " * (i % 7) for i in range(11)]


def committed_documents(config: Any) -> list[tuple[int, str]]:
    """(doc_id, text) of every committed part, in part order."""
    from kdflow.schemas.commits import list_commits
    from kdflow.schemas.fingerprints import corpus_fingerprint
    from kdflow.schemas.layout import CORPUS_DIR
    from kdflow.schemas.shards import read_corpus_part
    from kdflow.schemas.storage import RunRoot

    run_root = RunRoot(config.run_root)
    store = run_root.path(CORPUS_DIR)
    records = list_commits(run_root, store, "corpus", corpus_fingerprint(config))
    assert sorted(records) == list(range(len(records)))
    rows: list[tuple[int, str]] = []
    for shard_id in sorted(records):
        table = read_corpus_part(run_root, f"{store}/{records[shard_id].data_file}")
        assert table.num_rows == records[shard_id].rows
        rows.extend(zip(table.column("doc_id").to_pylist(), table.column("text").to_pylist()))
    return rows


def write_source(folder: Path, kind: str, docs: list[str]) -> str:
    """The same documents in one of the supported layouts; -> the dataset path to configure."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        return str(write_jsonl(folder / "docs.jsonl", docs))
    if kind == "json":
        (folder / "docs.json").write_text(json.dumps([{"text": d, "source": "x"} for d in docs]), encoding="utf-8")
        return str(folder / "docs.json")
    if kind == "parquet":
        pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), folder / "docs.parquet")
        return str(folder / "docs.parquet")
    if kind == "txt":
        (folder / "docs.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
        return str(folder / "docs.txt")
    # A folder (and a glob over it) of three files whose sorted names give the document order.
    for index, start in enumerate((0, 4, 8)):
        write_jsonl(folder / "files" / f"{index:02d}" / "docs.jsonl", docs[start:start + 4])
    return str(folder / "files") if kind == "folder" else str(folder / "files" / "*" / "*.jsonl")
