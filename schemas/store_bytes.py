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
