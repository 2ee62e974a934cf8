"""Folders written by `datasets.Dataset.save_to_disk` (or a `DatasetDict`'s): recognised by their metadata files and
read with `datasets.load_from_disk`, memory-mapped. The corpus (`dataset.path`) and `kdflow store import` both take
them, and read them the same way.
"""

from __future__ import annotations

import os
from typing import Any

from kdflow.schemas.errors import ConfigError

SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")  # a Dataset's, a DatasetDict's


def is_saved_dataset(path: str) -> bool:
    """A local folder that `datasets.load_from_disk` reads."""
    return "://" not in path and os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, name)) for name in SAVED_DATASET_FILES)


def load_saved_dataset(path: str, split: str | None = None) -> Any:
    """The folder's `datasets.Dataset`: a DatasetDict's `split` (None: 'train', else its first), an error naming the
    splits it has when `split` is not among them."""
    import datasets

    data = datasets.load_from_disk(path)
    if isinstance(data, datasets.DatasetDict):
        if split is None:
            split = "train" if "train" in data else next(iter(data))
        if split not in data:
            raise ConfigError(f"dataset {path!r} has no split {split!r} (it has: {', '.join(data)})")
        data = data[split]
    return data
