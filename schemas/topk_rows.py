"""Rows of a top-K store shard of any format, read without reading the shard (kdflow.schemas.shard_rows),
then decoded: v1 (fixed-width columns), v2 top-K (kdflow.schemas.codec) and sampled targets
(kdflow.schemas.codec_sampled).

v1 shards are fixed-width: rows are gathered from a memory map (local disk) or fetched as byte ranges, one
per run of adjacent rows and column. v2 and sampled shards hold one record per row of zstd-framed binary
cells, which is not fixed-width: the reader fetches the record batches (precompute's micro-batches) that
hold the wanted rows, one byte range each, and decodes only the wanted rows. The shard's schema (its codec,
renumbering table included) comes from the stream's head, read once with the index; nothing else is kept.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from kdflow.schemas.codec import DecodedTopk, TopkCodec, decode, from_v1
from kdflow.schemas.codec_sampled import DecodedSampled, SampledCodec, decode_sampled
from kdflow.schemas.errors import StoreError
from kdflow.schemas.shard_rows import ShardRows
from kdflow.schemas.shards import schema_int, decode_topk_rows, topk_format
from kdflow.schemas.storage import RunRoot


def shard_codec(schema: pa.Schema, shown: str, seq_len: int | None, top_k: int | None,
                targets: str = "topk") -> TopkCodec | SampledCodec | None:
    """The codec a top-K store shard's schema names (None: v1), after checking its seq_len and K (where given),
    its format and what it holds (`targets`: topk, or hybrid / sampled); StoreError naming the shard otherwise."""
    try:
        stored_len = schema_int(schema, b"kdflow.seq_len", shown)
        if seq_len is not None and stored_len != seq_len:
            raise StoreError(f"{shown}: top-K shard has seq_len {stored_len}, expected {seq_len}")
        if targets != "topk":
            return SampledCodec.from_schema(schema)
        stored_k = schema_int(schema, b"kdflow.top_k", shown)
        if top_k is not None and stored_k != top_k:
            raise StoreError(f"{shown}: top-K shard has K={stored_k}, expected K={top_k}")
        codec = TopkCodec.from_schema(schema) if topk_format(schema) == 2 else None
    except ValueError as error:
        raise StoreError(f"{shown}: {error}") from None
    if codec is not None and (codec.seq_len, codec.top_k) != (stored_len, stored_k):
        raise StoreError(f"{shown}: codec settings disagree with kdflow.seq_len / kdflow.top_k")
    return codec


def decode_rows(codec: TopkCodec | SampledCodec | None, fetched: pa.RecordBatch | pa.Table, rows: np.ndarray,
                shown: str, seq_len: int, top_k: int) -> DecodedTopk | DecodedSampled:
    """Rows of a top-K store shard (`rows`: their numbers in the shard) decoded with the shard's codec (None: v1,
    `seq_len` x `top_k`); a corrupt row raises StoreError naming the shard and the row."""
    if codec is None:
        return from_v1(*decode_topk_rows(fetched, seq_len, top_k))
    decoder = decode if isinstance(codec, TopkCodec) else decode_sampled
    try:
        return decoder(fetched, codec=codec)
    except ValueError:
        for i, row in enumerate(np.asarray(rows).tolist()):  # name the row of the shard, not of the batch
            try:
                decoder(fetched.slice(i, 1), codec=codec, row_offset=int(row))
            except ValueError as error:
                raise StoreError(f"{shown}: {error}") from None
        raise


def iter_topk_rows(run_root: RunRoot, path: str, seq_len: int | None = None, targets: str = "topk", part_rows: int = 16
                   ) -> Iterator[tuple[TopkCodec | SampledCodec | None, int, DecodedTopk | DecodedSampled]]:
    """A top-K store shard of any format streamed record batch by record batch (memory: one record batch; a
    bounded read cache on object stores): (its codec, None for v1; the first row; those rows decoded), at most
    `part_rows` rows at a time."""
    shown, codec, first = run_root.display(path), None, 0
    for batch in ShardRows(run_root, path, 0).iter_batches():
        if first == 0:
            codec = shard_codec(batch.schema, shown, seq_len, None, targets)
        stored_len = schema_int(batch.schema, b"kdflow.seq_len", shown)
        stored_k = schema_int(batch.schema, b"kdflow.top_k", shown)
        for start in range(0, batch.num_rows, part_rows):
            part = batch.slice(start, part_rows)
            yield codec, first + start, decode_rows(codec, part,
                                                    np.arange(first + start, first + start + part.num_rows),
                                                    shown, stored_len, stored_k)
        first += batch.num_rows


class TopkRows(ShardRows):
    """The rows of one committed top-K store shard; `decode` turns what `take`/`take_rows` fetched into
    DecodedTopk (v1, v2) or DecodedSampled (`targets` hybrid or sampled), checking once per shard that its
    format, shape and codec are the store's (`store_codec`: the codec settings of its _store.json)."""

    def __init__(self, run_root: RunRoot, path: str, size: int, rows: int | None = None,
                 batch_rows: int | None = None, *, seq_len: int, top_k: int, targets: str = "topk",
                 store_codec: dict | None = None) -> None:
        super().__init__(run_root, path, size, rows, batch_rows)
        self.seq_len, self.top_k, self.targets, self.store_codec = seq_len, top_k, targets, store_codec
        self._codec: TopkCodec | SampledCodec | None = None
        self._checked = False

    def _fail(self, problem: str) -> StoreError:
        return StoreError(f"{self.run_root.display(self.path)}: {problem}")

    def codec(self) -> TopkCodec | SampledCodec | None:
        """The shard's codec (None: v1), checked against the store on first use."""
        if not self._checked:
            codec = shard_codec(self.index().schema, self.run_root.display(self.path), self.seq_len, self.top_k,
                                self.targets)
            settings = None if codec is None else codec.settings()
            if self.store_codec is not None and settings != self.store_codec:
                raise self._fail(f"written with codec {settings}, its store's is {self.store_codec}: a store never "
                                 "mixes codecs; delete the shard's commit record and rerun precompute")
            self._codec, self._checked = codec, True
        return self._codec

    def decode(self, fetched: pa.RecordBatch | pa.Table, rows: np.ndarray) -> DecodedTopk | DecodedSampled:
        """What `take(rows)` returned -> those rows decoded; a corrupt row raises StoreError naming shard and row."""
        return decode_rows(self.codec(), fetched, rows, self.run_root.display(self.path), self.seq_len, self.top_k)
