"""The bytes a store takes, counted one way everywhere (`kdflow store report`, `kdflow bench store`, `kdflow bench
fidelity`): every byte a reader of the store needs, per store.

- data: the committed shards' data files, whole (each Arrow stream's schema, its codec settings and, v2 with
  renumbering, its own copy of the renumbering table, then the rows);
- records: the shards' commit records (`shard-NNNNN.commit.json`);
- store files: the store's own files that exist of `_complete.json`, `_store.json`, `config.yaml` and
  `_renumbering.bin` (the table once more, so later workers need not recount the token store).

Lease and temporary files are not part of a store and are not counted. Per position: the total over the
committed positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kdflow.schemas.commits import CommitRecord
from kdflow.schemas.layout import COMPLETE_FILE, CONFIG_FILE, RENUMBERING_FILE, STORE_FILE, commit_file_name
from kdflow.schemas.storage import RunRoot

STORE_FILES = (COMPLETE_FILE, STORE_FILE, CONFIG_FILE, RENUMBERING_FILE)


@dataclass(frozen=True)
class StoreBytes:
    data: int
    records: int
    store_files: int
    positions: int

    @property
    def total(self) -> int:
        return self.data + self.records + self.store_files

    @property
    def per_position(self) -> float:
        return self.total / max(self.positions, 1)

    def fields(self) -> dict[str, Any]:
        """The report's fields: bytes and bytes_per_position (everything), and the three parts."""
        return {"bytes": self.total, "bytes_per_position": round(self.per_position, 2), "data_bytes": self.data,
                "record_bytes": self.records, "store_file_bytes": self.store_files}


def store_bytes(run_root: RunRoot, store: str, records: dict[int, CommitRecord]) -> StoreBytes:
    """Every byte of the store folder `store` that its committed shards (`records`) need to be read."""
    record_bytes = sum(run_root.size(f"{store}/{commit_file_name(r.stage, i)}") for i, r in records.items())
    present = set(run_root.listdir(store))
    return StoreBytes(data=sum(r.bytes for r in records.values()), records=record_bytes,
                      store_files=sum(run_root.size(f"{store}/{name}") for name in STORE_FILES if name in present),
                      positions=sum(r.tokens for r in records.values()))


# Bytes per stored id and per stored value, rounded up from what `kdflow store report` measured on v2 stores of
# the demo teacher at K = 128 (docs/formats.md, docs/benchmarks.md: ids 0.94 B with renumbering, sqrt400 values
# 0.58 B, float16 1.36 B, float32 2.97 B) and from a Zipf-like random teacher without renumbering (ids about
# 1.35 B, float32 values 3.2 B; tests/test_store_metric.py), so that an estimate from them is on the high side.
_ID_BYTES = 1.4
_VALUE_BYTES = {"sqrt": 0.75, "float16": 1.5, "float32": 3.3}


def estimated_bytes_per_position(precompute: Any) -> float:
    """What a store made with these `precompute` settings will take per position, before it exists (the pre-flight
    disk check): v1 exactly (int32 ids and `logprobs_dtype` values), v2 and sampled stores from measured rates,
    rounded up; an adaptive K (`keep_mass`) is counted at its full K."""
    store = precompute.store
    if store.format == "v1":
        return precompute.top_k * (4 + (2 if precompute.logprobs_dtype == "float16" else 4))
    per_position = 8 + (2 if store.tail == "float16" else 4)  # row framing and the tail
    head = precompute.top_k if precompute.targets == "topk" else (
        precompute.sampling.head if precompute.targets == "hybrid" else 0)
    per_position += head * (_ID_BYTES + _VALUE_BYTES[store.values])
    if precompute.targets != "topk":
        samples = precompute.sampling
        per_position += 4 + samples.samples * (_ID_BYTES + _VALUE_BYTES[samples.values])  # the threshold, the draws
    return per_position
