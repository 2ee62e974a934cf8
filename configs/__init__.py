"""The example configs, shipped inside kdflow as package data (`kdflow.configs`).

In a checkout they are the files of this folder (`configs/demo.yaml`, `example.yaml`, `llmjp.yaml` and the example's
documents in `data/`); in an installed wheel they are read through `importlib.resources`, so `kdflow demo` needs no
checkout. `kdflow configs` lists them and `kdflow configs --write DIR` copies them out to start a project from.
"""

from __future__ import annotations

import os
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

# Every file shipped here, as paths under this package (pyproject.toml's package-data lists the same patterns).
SHIPPED = ("demo.yaml", "example.yaml", "llmjp.yaml", "data/example.jsonl")


def shipped(name: str) -> Traversable:
    """One shipped file (`demo.yaml`, `data/example.jsonl`), wherever kdflow is installed."""
    resource = files(__name__)
    for part in name.split("/"):
        resource = resource / part
    return resource


def write_examples(folder: str | os.PathLike[str]) -> list[Path]:
    """Copy every shipped file under `folder`, keeping `data/`; a file already there is an error, none is changed.

    Written into a project's `configs/`, `example.yaml` runs as it is from the project's root (its dataset path is
    `configs/data/example.jsonl`)."""
    target = Path(folder)
    existing = [str(target / name) for name in SHIPPED if (target / name).exists()]
    if existing:
        raise FileExistsError(f"{existing[0]} exists already; choose another folder or remove it")
    written = []
    for name in SHIPPED:
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(shipped(name).read_bytes())
        written.append(path)
    return written
