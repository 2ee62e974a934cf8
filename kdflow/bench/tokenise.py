"""`kdflow bench tokenise`: the raw tokenizer's batch speed against the tokenise stage end to end.

All sides measure the same corpus on the same cores, in one process, in the stage's batch size: the raw
side is the Rust tokenizer's own batch call (`backend_tokenizer.encode_batch_fast`, or `encode_batch` on
an older tokenizers, without special tokens); `transformers_call` is `tokenizer(texts,
add_special_tokens=False)`, which adds transformers' per-document conversion to lists and dicts; the stage
side is `kdflow.tasks.corpus.tokenise` (read the corpus parts, encode, pack into rows, write Arrow shards,
hash, fsync, commit). Rates count the documents' own tokens (no EOS) on every side, so the ratios are the
fraction of raw speed the stage keeps; `same_ids` checks the stage's rows against the packing of the
transformers call's ids. Prints one JSON object per line. Default corpus: Python's documentation
paragraphs (`pydoc_data.topics`), repeated to `--documents`; default tokenizer: a byte-level BPE trained
here on the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kdflow.bench.args import bench_parser


def pydoc_paragraphs(count: int) -> list[str]:
    """`count` documents: the paragraphs of Python's shipped documentation, repeated in order."""
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n") if len(p.strip()) > 40]
    return [paragraphs[i % len(paragraphs)] for i in range(count)]


def train_tiny_tokenizer(folder: Path, texts: list[str], vocab_size: int) -> Path:
    """A byte-level BPE like the tests' one, saved as a HF fast-tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return folder


def _config(work: Path, corpus: Path, model: str, gguf_file: str | None, args: argparse.Namespace) -> Any:
    from kdflow.schemas.config_io import config_from_dict

    return config_from_dict({
        "run_root": str(work / "run"),
        "dataset": {"path": str(corpus), "documents_per_part": 10_000},
        "seq_len": args.seq_len,
        "teacher": {"model": model, "gguf_file": gguf_file},
        "precompute": {"sequences_per_shard": args.sequences_per_shard},
    }, source="bench")


def time_raw_tokenizer(tokenizer: Any, texts: list[str], batch: int) -> tuple[float, int]:
    """-> (seconds, tokens) of the Rust tokenizer's batched encoding, in the stage's batch size."""
    backend = tokenizer.backend_tokenizer
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    started, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), batch):
        tokens += sum(map(len, encode_batch(texts[i:i + batch], add_special_tokens=False)))
    return time.perf_counter() - started, tokens


def time_transformers_call(tokenizer: Any, texts: list[str], batch: int) -> tuple[float, list[list[int]]]:
    """-> (seconds, ids per document) of calling the transformers tokenizer, in the stage's batch size."""
    started, ids = time.perf_counter(), []
    for i in range(0, len(texts), batch):
        ids.extend(tokenizer(texts[i:i + batch], add_special_tokens=False, return_attention_mask=False)["input_ids"])
    return time.perf_counter() - started, ids


def stage_rows_match(config: Any, ids: list[list[int]], eos_id: int) -> bool:
    """The stage's rows equal every document's ids (from the transformers call) + EOS, packed into rows."""
    import numpy as np

    from kdflow.schemas.commits import list_commits, stage_dir
    from kdflow.schemas.shards import read_token_shard
    from kdflow.schemas.stage_settings import open_run_root

    run_root = open_run_root(config)
    store = stage_dir(run_root, "tokens")
    records = list_commits(run_root, store, "tokens")
    rows = [read_token_shard(run_root, f"{store}/{records[i].data_file}", config.seq_len) for i in sorted(records)]
    stored = np.concatenate(rows).reshape(-1) if rows else np.empty(0, dtype=np.int32)
    stream = np.fromiter((t for doc in ids for t in (*doc, eos_id)), dtype=np.int64)
    return bool(np.array_equal(stored, stream[:stored.size]))


def time_stage(config: Any, tokenizer: Any) -> tuple[float, Any]:
    """-> (seconds, summary) of the tokenise stage from scratch (an earlier token store is removed first)."""
    from kdflow.schemas.layout import TOKENS_DIR
    from kdflow.schemas.stage_settings import open_run_root, tokenise_settings
    from kdflow.tasks.corpus.tokenise import tokenise

    shutil.rmtree(Path(config.run_root) / TOKENS_DIR, ignore_errors=True)
    started = time.perf_counter()
    summary = tokenise(open_run_root(config), tokenise_settings(config), tokenizer)
    return time.perf_counter() - started, summary


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("tokenise", __doc__, seq_len=512, repeats=3,
                          helps={"repeats": "best of this many timings per side"})
    parser.add_argument("--tokenizer", help="a local tokenizer folder (default: train a tiny byte-level BPE)")
    parser.add_argument("--gguf-file", help="a GGUF file inside --tokenizer to read the tokenizer from")
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--vocab-size", type=int, default=384,
                        help="vocabulary of the tokenizer trained when none is given")
    parser.add_argument("--sequences-per-shard", type=int, default=256)
    parser.add_argument("--parallelism", default="false,true",
                        help="TOKENIZERS_PARALLELISM values to measure, comma list")
    args = parser.parse_args(argv)
    if args.gguf_file and not args.tokenizer:
        parser.error("--gguf-file needs --tokenizer (the folder that holds it)")

    from kdflow.schemas.layout import CORPUS_DIR
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import DOCS_PER_BATCH

    texts = pydoc_paragraphs(args.documents)
    parallelism_before = os.environ.get("TOKENIZERS_PARALLELISM")
    with tempfile.TemporaryDirectory(prefix="kdflow-bench-tokenise-") as tmp:
        work = Path(tmp)
        corpus = work / "docs.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        model = args.tokenizer or str(train_tiny_tokenizer(work / "tokenizer", pydoc_paragraphs(400), args.vocab_size))
        config = _config(work, corpus, model, args.gguf_file, args)
        tokenizer = load_tokenizer(config.teacher, config.tokenizer)
        # not timed: the corpus parts are the stage's input
        materialise(open_run_root(config), materialise_settings(config))
        corpus_bytes = sum(p.stat().st_size for p in (work / "run" / CORPUS_DIR).glob("*.parquet"))
        common = {"bench": "tokenise", "documents": len(texts), "chars": sum(map(len, texts)), "vocab": len(tokenizer),
                  "tokenizer": args.tokenizer or f"trained byte-level BPE {args.vocab_size}", "cpus": os.cpu_count(),
                  "seq_len": args.seq_len, "corpus_parquet_bytes": corpus_bytes}
        for parallel in [p.strip() for p in args.parallelism.split(",") if p.strip()]:
            os.environ["TOKENIZERS_PARALLELISM"] = parallel  # read by the Rust side on each batch call
            raw, call, stage = [], [], []
            for _ in range(args.repeats):  # interleaved, so that a busy moment of the machine hits every side
                raw.append(time_raw_tokenizer(tokenizer, texts, DOCS_PER_BATCH))
                call.append(time_transformers_call(tokenizer, texts, DOCS_PER_BATCH))
                stage.append(time_stage(config, tokenizer))
            (raw_seconds, doc_tokens), (call_seconds, ids) = min(raw), min(call, key=lambda r: r[0])
            stage_seconds, summary = min(stage, key=lambda r: r[0])
            side = common | {"tokenizers_parallelism": parallel, "doc_tokens": doc_tokens}
            print(json.dumps(side | {"what": "raw_tokenizer", "seconds": round(raw_seconds, 4),
                                     "tokens_per_s": round(doc_tokens / raw_seconds)}), flush=True)
            print(json.dumps(side | {"what": "transformers_call", "seconds": round(call_seconds, 4),
                                     "tokens_per_s": round(doc_tokens / call_seconds)}), flush=True)
            print(json.dumps(side | {"what": "tokenise_stage", "seconds": round(stage_seconds, 4),
                                     "tokens_per_s": round(doc_tokens / stage_seconds), "shards": summary.shards,
                                     "sequences": summary.sequences, "dropped_tokens": summary.dropped_tokens}),
                  flush=True)
            print(json.dumps({"bench": "tokenise", "what": "ratio", "tokenizers_parallelism": parallel,
                              "stage_over_raw": round(raw_seconds / stage_seconds, 3),
                              "stage_over_transformers_call": round(call_seconds / stage_seconds, 3),
                              "same_ids": stage_rows_match(config, ids, tokenizer.eos_token_id),
                              "loadavg": [round(x, 2) for x in os.getloadavg()]}), flush=True)
    if parallelism_before is None:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = parallelism_before
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
