"""`kdflow bench import`: the rate and peak memory of `kdflow store import` against the source's size.

Positions/s, MB/s of source and the peak resident set, per source size, so that flat memory shows: the peak should
stay the same as the source grows. For each size of `--positions` it writes a synthetic Parquet source in kdflow's
own layout, full-vocabulary log-probs (random valid top-K rows: K distinct ids in the vocabulary, log-probs sorted
descending, mass below 1; rows of varying length), then imports it into an empty run root in a fresh process
(`kdflow.bench.harness.run_fresh`), which reports its wall time and its peak resident set. The source is not
counted in the rate's time; the load average is printed beside the rate, since on a busy machine the rate means
little. One JSON line per size.
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
from kdflow.bench.harness import emit, note, peak_rss_mib, run_fresh
from kdflow.tasks.common.units import MIB

LAYOUT = "kdflow"
LENGTHS = (96, 200, 333, 512, 1000)  # row lengths of the source: not multiples of seq_len, some longer than it


def write_source(path: Path, positions: int, top_k: int, vocab: int, seed: int, group_rows: int) -> dict[str, int]:
    """A Parquet file of at least `positions` positions (whole rows), written row group by row group (flat memory
    here too)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    step = max(vocab // top_k, 1)
    written, rows = 0, 0
    writer = None
    try:
        while written < positions:
            lengths = rng.choice(LENGTHS, group_rows)
            count = min(group_rows, int(np.searchsorted(np.cumsum(lengths), positions - written)) + 1)
            lengths = lengths[:count]
            n = int(lengths.sum())
            base = rng.integers(0, vocab, n)
            ids = ((base[:, None] + np.arange(top_k) * step) % vocab).astype(np.int32)  # K distinct ids
            # each p <= 1/(K+1), descending: the kept mass stays below 1
            logprobs = (-np.log(top_k + 1) - np.cumsum(rng.exponential(0.3, (n, top_k)), axis=1)).astype(np.float32)
            offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            table = pa.table({
                "input_ids": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, vocab, n, dtype=np.int32))),
                "topk_ids": pa.ListArray.from_arrays(
                    offsets, pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), top_k)),
                "topk_logprobs": pa.ListArray.from_arrays(
                    offsets, pa.FixedSizeListArray.from_arrays(pa.array(logprobs.ravel()), top_k))})
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=group_rows)
            written, rows = written + n, rows + count
    finally:
        if writer is not None:
            writer.close()
    return {"positions": written, "rows": rows, "bytes": path.stat().st_size}


def _config(work: Path, tokenizer: str, args: argparse.Namespace) -> Any:
    from kdflow.schemas.config_io import config_from_dict

    corpus = work / "unused.jsonl"  # the config names a corpus; an import reads none
    corpus.write_text(json.dumps({"text": "unused"}) + "\n", encoding="utf-8")
    return config_from_dict({
        "run_root": str(work / "run"), "dataset": {"path": str(corpus)}, "seq_len": args.seq_len,
        "teacher": {"model": tokenizer},
        "precompute": {"top_k": args.top_k, "sequences_per_shard": args.sequences_per_shard,
                       "store": {"format": args.store_format}}}, source="bench")


def child(argv: list[str]) -> int:
    """In a fresh process: import the source with the config; print one JSON line (seconds, peak RSS)."""
    from kdflow.schemas.config_io import load_config
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.teacher.logit_import import import_store

    config_path, source = argv
    config = load_config(config_path, {})
    settings = teacher_pass_settings(config)
    tokenizer = load_tokenizer(settings.teacher, settings.tokenizer)  # not timed: transformers' import and load
    started = time.perf_counter()
    summary = import_store(open_run_root(config), settings, source, LAYOUT, "bench-teacher", tokenizer)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "peak_rss_mib": peak_rss_mib(), "packed_rows": summary["packed_rows"],
                      "shards": summary["shards"], "complete": summary["complete"]}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    parser = bench_parser("import", __doc__, seed=0, top_k=32, seq_len=2048)
    parser.add_argument("--positions", default="1000000,4000000",
                        help="source sizes in positions, comma list (two or more show whether memory is flat)")
    parser.add_argument("--vocab-size", type=int, default=384, help="vocabulary of the tokenizer trained here")
    parser.add_argument("--sequences-per-shard", type=int, default=64)
    parser.add_argument("--store-format", default="v2", choices=["v1", "v2"])
    args = parser.parse_args(argv)
    from kdflow.bench.tokenise import pydoc_paragraphs, train_tiny_tokenizer
    from kdflow.schemas.config_io import dump_config
    from kdflow.tasks.teacher.logit_reader import BATCH_ROWS

    sizes = [int(size) for size in args.positions.split(",") if size.strip()]
    with tempfile.TemporaryDirectory(prefix="kdflow-bench-import-") as tmp:
        work = Path(tmp)
        tokenizer = train_tiny_tokenizer(work / "tokenizer", pydoc_paragraphs(400), args.vocab_size)
        config = _config(work, str(tokenizer), args)
        (work / "config.yaml").write_text(dump_config(config), encoding="utf-8")
        note({"bench": "import", "layout": LAYOUT, "top_k": args.top_k, "seq_len": args.seq_len,
              "store_format": args.store_format, "sequences_per_shard": args.sequences_per_shard,
              "row_lengths": list(LENGTHS), "cpus": os.cpu_count()})
        for size in sizes:
            source = work / "source.parquet"
            made = write_source(source, size, args.top_k, args.vocab_size, args.seed, BATCH_ROWS)
            shutil.rmtree(work / "run", ignore_errors=True)
            result = run_fresh("kdflow.bench.import_rate", ["--child", str(work / "config.yaml"), str(source)])
            record = {"bench": "import", "positions": made["positions"], "source_rows": made["rows"],
                      "source_mb": round(made["bytes"] / MIB, 1),
                      "loadavg": [round(x, 2) for x in os.getloadavg()]}
            if not result.ok:
                emit(record | result.failure())
                continue
            seconds = result.record["seconds"]
            emit(record | {"seconds": round(seconds, 3), "positions_per_s": round(made["positions"] / seconds),
                           "mb_per_s": round(made["bytes"] / MIB / seconds, 2),
                           "peak_rss_mib": result.record["peak_rss_mib"],
                           "packed_rows": result.record["packed_rows"], "shards": result.record["shards"]})
            source.unlink()
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
