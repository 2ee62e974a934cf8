"""Which files a dataset config names, and in which format: resolved without reading them (no `datasets`, no
pyarrow), so that the pre-flight checks and materialise agree on what the source is.
"""

from __future__ import annotations

import glob
import os

from kdflow.schemas.config import DatasetConfig
from kdflow.schemas.errors import ConfigError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def file_builder(dataset: DatasetConfig) -> tuple[str, list[str]] | None:
    """(builder, data_files) when the dataset is given as files, else None (a hub id)."""
    candidates = dataset.data_files if dataset.data_files is not None else dataset.path
    key = "dataset.data_files" if dataset.data_files is not None else "dataset.path"
    files = [candidates] if isinstance(candidates, str) else list(candidates)
    builders = set()
    expanded: list[str] = []
    for name in files:
        lowered = name.lower()
        builder = next((b for ext, b in FILE_BUILDERS.items() if lowered.endswith(ext)), None)
        is_local_dir = "://" not in name and os.path.isdir(name)
        if builder is None and not is_local_dir:
            if dataset.data_files is not None:
                raise ConfigError(f"dataset.data_files: cannot tell the format of {name!r} "
                                  "(use .jsonl, .json, .parquet or .txt)")
            return None
        if is_local_dir:
            for ext, b in FILE_BUILDERS.items():
                found = sorted(glob.glob(os.path.join(name, f"**/*{ext}"), recursive=True))
                if found:
                    builders.add(b)
                    expanded.extend(found)
            continue
        builders.add(builder)
        if "://" in name:
            expanded.append(name)
            continue
        matches = sorted(glob.glob(name, recursive=True))
        if not matches:
            raise ConfigError(f"{key}: no file matches {name!r}")
        expanded.extend(matches)
    if len(builders) != 1:
        raise ConfigError(f"{key}: files must share one format, found {sorted(builders) or 'none'}")
    if dataset.data_files is not None and dataset.path not in ("json", "parquet", "text", "csv"):
        # `path` names a hub dataset with explicit data files: keep the hub path.
        return None
    return builders.pop(), expanded
