"""Tokenise: corpus parts -> packed fixed-length token shards.

Documents are tokenised in batches with the fast tokenizer (no special tokens), each followed by EOS,
and the stream is cut into `seq_len` sequences: a document longer than what is left of a sequence
continues in the next one; the final remainder that does not fill a sequence is dropped and counted.
Each shard's commit record holds the stream position after it (document index, offset into that
document's tokens), so a rerun resumes right after the last committed shard and writes the same bytes.

Speed: the batches go straight to the Rust tokenizer behind the fast tokenizer (`BatchEncoder`: the same
ids as calling the tokenizer, without transformers' per-document conversion into dicts and lists of
masks), and a reader thread reads and encodes the next batch while this one is packed and written
(the Rust side runs without the GIL), so the stage runs at about the tokenizer's own batch speed. Two
fixed costs are hidden as well: on a fresh store the reader starts on the first documents while this thread
computes the tokenizer's fingerprint (~0.1 s for a 49K vocabulary, pure Python), and the corpus's last
documents are encoded in halving batches, so little is left to pack once the last encoding is done.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kdflow.schemas.commits import (CommitRecord, StageComplete, TokensCompleteInfo, TokenShardInfo, commit_or_remove,
                                    committed_prefix, list_commits, read_complete, remove_shards_from, stage_dir,
                                    write_complete)
from kdflow.schemas.disk_space import DiskFull
from kdflow.schemas.errors import StoreError
from kdflow.schemas.fingerprints import tokenizer_fingerprint, tokens_fingerprint_of
from kdflow.schemas.layout import data_file_name
from kdflow.schemas.shards import TEXT, read_corpus_part, token_batch, token_shard_writer
from kdflow.schemas.stage_settings import TokeniseSettings
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.tasks.common import faults

DOCS_PER_BATCH = 1024
SMALLEST_BATCH = 64  # the end of the corpus is encoded in halving batches down to this many documents


@dataclass
class TokeniseSummary:
    shards: int
    sequences: int
    tokens: int
    dropped_tokens: int
    shards_written: int
    fingerprint: str
    tokenizer_fingerprint: str
    seconds: float = 0.0
    tokens_written: int = 0  # by this run: the rate counts these, not shards committed before a resume


class BatchEncoder:
    """Documents -> token ids (no special tokens), from the Rust tokenizer behind a fast tokenizer.

    Calling the transformers tokenizer does the same Rust `encode_batch` and then converts every document's
    encoding into dicts of lists in Python; here the ids are all we take. Truncation or padding set on the
    Rust tokenizer (a tokenizer.json may carry them) would change the ids, so they are switched off on a
    copy, as transformers' own call does. Objects without a Rust tokenizer are called as tokenizers.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and (backend.truncation is not None or backend.padding is not None):
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()
        # encode_batch_fast: the same ids, without computing character offsets (tokenizers >= 0.21).
        self._encode_batch = None if backend is None else getattr(backend, "encode_batch_fast", backend.encode_batch)

    def encode(self, texts: list[str]) -> Any:
        """The batch's encodings; the Rust part runs without the GIL, so another thread may call this."""
        if self._encode_batch is None:
            return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return self._encode_batch(texts, add_special_tokens=False)

    def ids(self, encoded: Any) -> list[list[int]]:
        return encoded if self._encode_batch is None else [encoding.ids for encoding in encoded]


class EncodedBatches:
    """The encodings of each batch, read and encoded by a thread up to `depth` batches ahead. The thread starts
    at construction, not at the first `next`: the caller may do other work while the first batches are
    encoded. `close()` (also on leaving a `with`) stops the thread, whether or not iteration began."""

    _DONE = object()

    def __init__(self, batches: Iterator[list[str]], encoder: BatchEncoder, depth: int = 2) -> None:
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, args=(batches, encoder), name="tokenise-reader",
                                        daemon=True)
        self._thread.start()

    def _produce(self, batches: Iterator[list[str]], encoder: BatchEncoder) -> None:
        try:
            for texts in batches:
                item = encoder.encode(texts)
                while not self._stop.is_set():
                    with contextlib.suppress(queue.Full):
                        self._ready.put(item, timeout=0.1)
                        break
                if self._stop.is_set():
                    return
            self._ready.put(self._DONE)
        except BaseException as error:  # handed to the consumer, which raises it
            self._ready.put(error)

    def __iter__(self) -> EncodedBatches:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        item = self._ready.get()
        if item is self._DONE or isinstance(item, BaseException):
            self._finished = True
            if item is self._DONE:
                raise StopIteration
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._ready.get_nowait()
        self._thread.join()

    def __enter__(self) -> EncodedBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def batch_sizes(count: int, last: bool) -> Iterator[int]:
    """Batch sizes covering `count` documents: DOCS_PER_BATCH each, and when these are the corpus's last
    documents, halving batches over the final ones (down to SMALLEST_BATCH), so that the work left after the
    last encoding (packing, the last shard) is small. Batching never changes the ids."""
    while count > 0:
        size = min(DOCS_PER_BATCH, count)
        if last and count < 2 * DOCS_PER_BATCH:
            size = min(count, max(SMALLEST_BATCH, count // 2))
        yield size
        count -= size


def iter_documents(run_root: RunRoot, corpus_store: str, parts: list[str], start_doc: int) -> Iterator[list[str]]:
    """Batches of document texts in corpus order, from global document index `start_doc` on."""
    seen = 0
    for name in parts:
        table = read_corpus_part(run_root, f"{corpus_store}/{name}")
        if seen + table.num_rows <= start_doc:
            seen += table.num_rows
            continue
        texts = table.column(TEXT).to_pylist()[max(0, start_doc - seen):]
        seen += table.num_rows
        start = 0
        for size in batch_sizes(len(texts), last=name == parts[-1]):
            yield texts[start:start + size]
            start += size


class Packer:
    """Packs a token stream into fixed-length rows and knows the stream position after each row."""

    def __init__(self, seq_len: int, eos_id: int, start_doc: int, start_offset: int) -> None:
        self.seq_len, self.eos_id = seq_len, eos_id
        self.buffer = np.empty(0, dtype=np.int32)  # (tokens,) not yet packed into a row
        self.docs: deque[list[int]] = deque()  # [doc index, its tokens still in the buffer, its full length]
        self.next_doc = start_doc
        self.skip = start_offset  # tokens of the first document already packed in an earlier shard

    def add(self, encoded: list[list[int]]) -> None:
        full_lengths = []
        for ids in encoded:
            ids.append(self.eos_id)
            full_lengths.append(len(ids))
        if self.skip:
            del encoded[0][: self.skip]
        flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=sum(map(len, encoded)))
        self.buffer = np.concatenate([self.buffer, flat]) if self.buffer.size else flat
        for ids, full in zip(encoded, full_lengths):
            self.docs.append([self.next_doc, len(ids), full])
            self.next_doc += 1
        self.skip = 0

    def rows_ready(self) -> int:
        return self.buffer.size // self.seq_len

    def take(self, rows: int) -> tuple[np.ndarray, tuple[int, int]]:
        """-> (rows, seq_len) ids and the stream position (doc index, offset) right after them."""
        count = rows * self.seq_len
        out = self.buffer[:count].reshape(rows, self.seq_len)
        self.buffer = self.buffer[count:]
        while count and self.docs:
            doc = self.docs[0]
            if doc[1] <= count:
                count -= doc[1]
                self.docs.popleft()
            else:
                doc[1] -= count
                count = 0
        if not self.docs:
            return out, (self.next_doc, 0)
        doc_index, remaining, full = self.docs[0]
        return out, (doc_index, full - remaining)


def imported_tokens_problem(run_root: RunRoot) -> str | None:
    """Why this run root's token store cannot take a tokenised corpus: it holds the rows `kdflow store import`
    wrote from a capture (tokenise would otherwise skip it as done, and the teacher pass run over those rows)."""
    store = stage_dir(run_root, "tokens")
    done = read_complete(run_root, store)
    source = getattr(done.extra, "imported_from", None) if done is not None else None
    if not source:
        return None
    return (f"token store {run_root.display(store)} holds the rows imported from {source} (kdflow store import), not "
            "this config's corpus: materialise and tokenise the corpus in another run_root")


def tokenise(
    run_root: RunRoot,
    settings: TokeniseSettings,
    tokenizer: Any,
    on_shard: Callable[[CommitRecord], None] | None = None,
) -> TokeniseSummary:
    """Pack the corpus store's documents into token shards of `seq_len` ids, `sequences_per_shard` rows each."""
    started = time.perf_counter()
    if (problem := imported_tokens_problem(run_root)) is not None:
        raise StoreError(problem)
    corpus_store, store = stage_dir(run_root, "corpus"), stage_dir(run_root, "tokens")
    corpus_done = read_complete(run_root, corpus_store)
    corpus_fp = settings.corpus_fingerprint
    if corpus_done is None or corpus_done.fingerprint != corpus_fp:
        raise StoreError(f"corpus store {run_root.display(corpus_store)} is not complete for this config; "
                         "run materialise first")
    corpus_parts = list_commits(run_root, corpus_store, "corpus", corpus_fp)
    if committed_prefix(corpus_parts) < corpus_done.shards:
        missing = committed_prefix(corpus_parts)
        raise StoreError(f"corpus store {run_root.display(corpus_store)} has no valid commit for part {missing}; "
                         "run materialise again")
    parts = [data_file_name("corpus", i) for i in range(corpus_done.shards)]
    encoder = BatchEncoder(tokenizer)

    remove_stale_temp_files(run_root, store)  # what a killed run of this stage left
    with contextlib.ExitStack() as cleanup:  # the reader thread stops however this ends
        batches = None
        if not list_commits(run_root, store, "tokens") and read_complete(run_root, store) is None:
            # A fresh store starts at document 0 whatever the fingerprint: encode while it is computed.
            batches = cleanup.enter_context(EncodedBatches(iter_documents(run_root, corpus_store, parts, 0), encoder))
        seq_len, per_shard = settings.seq_len, settings.sequences_per_shard
        vocab_size = len(tokenizer)  # every id is below it (added tokens included): `kdflow validate` checks this
        tok_fp = tokenizer_fingerprint(tokenizer)
        fingerprint = tokens_fingerprint_of(corpus_fp, tok_fp, seq_len, per_shard)
        committed = list_commits(run_root, store, "tokens", fingerprint) if batches is None else {}
        done = read_complete(run_root, store) if batches is None else None
        prefix = committed_prefix(committed)
        sequences = sum(committed[i].rows for i in range(prefix))
        if done is not None and done.fingerprint == fingerprint and done.shards == prefix:
            remove_shards_from(run_root, store, "tokens", prefix)  # as a finished run of an older kdflow left them
            return TokeniseSummary(prefix, sequences, sequences * seq_len, done.extra.dropped_tokens or 0, 0,
                                   fingerprint, tok_fp)

        start_doc, start_offset = ((committed[prefix - 1].extra.end_doc, committed[prefix - 1].extra.end_offset)
                                   if prefix else (0, 0))
        if batches is None:
            batches = cleanup.enter_context(EncodedBatches(iter_documents(run_root, corpus_store, parts, start_doc),
                                                           encoder))
        packer = Packer(seq_len, tokenizer.eos_token_id, start_doc, start_offset)
        written, sequences_before = 0, sequences

        def write_shard(rows: int) -> None:
            nonlocal prefix, written, sequences
            input_ids, (end_doc, end_offset) = packer.take(rows)
            path = f"{store}/{data_file_name('tokens', prefix)}"
            try:
                with token_shard_writer(run_root, path, seq_len) as writer:
                    writer.write(token_batch(input_ids))
            except DiskFull as error:
                raise error.needing(input_ids.nbytes) from error.__cause__
            faults.maybe_fire("commit", run_root, stage="tokenise", shard=prefix)
            record = CommitRecord(
                stage="tokens", shard_id=prefix, data_file=data_file_name("tokens", prefix), rows=rows,
                tokens=rows * seq_len, bytes=writer.sink.nbytes, sha256=writer.sink.sha256, fingerprint=fingerprint,
                extra=TokenShardInfo(end_doc=end_doc, end_offset=end_offset, seq_len=seq_len,
                                     tokenizer_fingerprint=tok_fp, vocab_size=vocab_size),
            )
            commit_or_remove(run_root, store, record)
            if on_shard:
                on_shard(record)
            prefix, written, sequences = prefix + 1, written + 1, sequences + rows

        for encoded in batches:
            packer.add(encoder.ids(encoded))
            while packer.rows_ready() >= per_shard:
                write_shard(per_shard)
        if packer.rows_ready():
            write_shard(packer.rows_ready())
        dropped = int(packer.buffer.size)
        remove_shards_from(run_root, store, "tokens", prefix)  # an earlier store's shards beyond this one's end
        write_complete(run_root, store, StageComplete(
            stage="tokens", shards=prefix, rows=sequences, tokens=sequences * seq_len, fingerprint=fingerprint,
            extra=TokensCompleteInfo(dropped_tokens=dropped, seq_len=seq_len, tokenizer_fingerprint=tok_fp,
                                     corpus_fingerprint=corpus_fp, vocab_size=vocab_size),
        ))
        return TokeniseSummary(prefix, sequences, sequences * seq_len, dropped, written, fingerprint, tok_fp,
                               time.perf_counter() - started, (sequences - sequences_before) * seq_len)
