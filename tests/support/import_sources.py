"""Small teacher captures for the import tests: kdflow's own layout with valid top-K targets, written as Parquet
parts, and the config an import into a fresh run root takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def capture_table(rows: int, length: int | list[int], seed: int = 0, vocab: int = 200, k: int = 8) -> pa.Table:
    """Rows of kdflow's own layout with valid top-K targets: distinct ids, log-probs sorted, mass below 1.
    `length`: every row's, or a list cycled over the rows."""
    rng = np.random.default_rng(seed)
    lengths = [length] * rows if isinstance(length, int) else [length[i % len(length)] for i in range(rows)]
    n = sum(lengths)
    ids = np.argsort(rng.random((n, vocab)), axis=1)[:, :k]
    logprobs = np.sort(np.log(rng.dirichlet(np.ones(k + 1), n)[:, :k]), axis=-1)[:, ::-1]
    tokens = rng.integers(0, vocab, n)
    starts = np.cumsum([0, *lengths])

    def per_row(array: np.ndarray) -> list:
        return [array[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]

    return pa.table({"input_ids": per_row(tokens), "topk_ids": per_row(ids),
                     "topk_logprobs": per_row(logprobs)})


def import_config(make_config: Any, root: Path, **overrides: Any) -> Any:
    return make_config(precompute__store__format="v1", precompute__logprobs_dtype="float32",
                       **overrides).model_copy(update={"run_root": str(root)})


def write_parts(folder: Path, table: pa.Table, cuts: list[int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index, (start, stop) in enumerate(zip([0, *cuts], [*cuts, table.num_rows])):
        pq.write_table(table.slice(start, stop - start), folder / f"part-{index}.parquet", row_group_size=5)
    return folder
