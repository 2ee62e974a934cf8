"""Text and JSONL for tiny runs: real English that ships with Python, and the tiny tokenizer's vocabulary size."""

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
