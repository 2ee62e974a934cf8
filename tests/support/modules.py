"""kdflow's own modules as the wheel installs them: the repository's package folders and their installed names."""

from __future__ import annotations

import functools
from pathlib import Path

REPO = Path(__file__).parent.parent.parent
FOLDERS = {"kdflow": "kdflow", "schemas": "kdflow.schemas", "tasks": "kdflow.tasks", "flows": "kdflow.flows",
           "configs": "kdflow.configs"}


@functools.cache
def source_modules() -> dict[str, Path]:
    """Installed module name -> file, for every Python file of the package folders (read once: callers must not
    change the dict)."""
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            modules[name] = path
    return modules
