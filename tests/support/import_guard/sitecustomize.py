"""An import guard for the GPU check's rehearsal: with this folder first on PYTHONPATH and KDFLOW_IMPORT_ALLOWED
naming files of allowed distributions (os.pathsep between them; one name a line, `name==version` and `#`
comments allowed), a top-level import of a package installed here whose distribution is not listed is not found,
exactly as on a machine without it. Child processes inherit both variables, so they are guarded too.

The needs of an allowed distribution as installed here (its Requires-Dist, without extras, followed through)
are allowed too: the versions here may need what the image's versions bring along (huggingface_hub's httpx2,
pandas' pytz), and refusing those would test this machine, not the check. Prefect, datasets and the like stay
refused unless listed: nothing allowed requires them.

Only the path-based finder is wrapped: the standard library, kdflow itself and modules that belong to no
installed distribution pass. `importlib.util.find_spec` answers None for a refused package, as where it is
absent (libraries that probe optional packages so fall back quietly, as they would there). Each refused name
is appended to KDFLOW_IMPORT_REFUSED_LOG when that is set.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import re
import sys


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).strip().lower()


def _closure(names: set[str]) -> set[str]:
    """`names` and, followed through, every requirement without an extra marker of those installed here."""
    todo, seen = list(names), set(names)
    while todo:
        try:
            requires = importlib.metadata.requires(todo.pop()) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" in requirement.replace('extra==', 'extra =='):
                continue
            name = _normal(re.split(r"[=<>!~\[; (]", requirement.strip(), maxsplit=1)[0])
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _allowed(paths: str) -> set[str]:
    names = {"kdflow"}
    for path in filter(None, paths.split(os.pathsep)):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                line = line.split("#", 1)[0].strip()
                if line:
                    names.add(_normal(re.split(r"[=<>\[; ]", line, maxsplit=1)[0]))
    return names


class _Guard(importlib.machinery.PathFinder):
    refused: set[str] = set()
    owners: dict[str, list[str]] = {}
    allowed: set[str] = set()

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):  # type: ignore[override]
        top = fullname.partition(".")[0]
        owners = cls.owners.get(top)
        if owners and top not in sys.stdlib_module_names and not any(_normal(o) in cls.allowed for o in owners):
            if top not in cls.refused:
                cls.refused.add(top)
                log = os.environ.get("KDFLOW_IMPORT_REFUSED_LOG")
                if log:
                    with open(log, "a", encoding="utf-8") as handle:
                        handle.write(f"{top}\n")
            return None
        return super().find_spec(fullname, path, target)


def _install() -> None:
    paths = os.environ.get("KDFLOW_IMPORT_ALLOWED")
    if not paths:
        return
    _Guard.allowed = _closure(_allowed(paths) - {"kdflow"}) | {"kdflow"}
    _Guard.owners = importlib.metadata.packages_distributions()
    sys.meta_path[:] = [_Guard if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]


_install()
