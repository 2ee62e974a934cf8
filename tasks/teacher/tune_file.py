"""Tuning the micro-batch of a config file: the request checked before any process starts, and the recommendation
written back into that file (`precompute.micro_batch`, edited in place, comments and layout kept).

`kdflow tune precompute` (kdflow.commands.tune) prints around these; `kdflow bench gpu` calls them as they are. The
search itself is `kdflow.tasks.teacher.tune_search`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import load_config
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.stage_settings import TeacherPassSettings, open_run_root, teacher_pass_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.teacher import tune_search


@dataclass
class TuneRequest:
    """What a tune of `path` will try: the config as loaded (overrides applied), the candidates, where their
    rows come from (the token shards, or Python's documentation), and whether the teacher has experts to time."""

    path: Path
    config: KDFlowConfig
    sizes: list[int]
    rows_from: str
    experts: bool = False


def check_tune_request(path: str | Path, overrides: dict[str, Any] | None = None, *, micro_batches: str | None = None,
                       headroom: float = 0.10, batches: int = 3, warmup: int = 1, timeout_s: float = 1800.0,
                       write: bool = False, random_weights: bool = False) -> TuneRequest:
    """Every check that needs no process: the settings, the config, the teacher, the token shards and, with
    `write`, that the file may be edited. -> the request; a ConfigError (or StoreError) names what is wrong."""
    if not 0.0 <= headroom < 1.0:
        raise ConfigError(f"--headroom must be a fraction in [0, 1), got {headroom}")
    if batches < 1 or warmup < 0 or timeout_s <= 0:
        raise ConfigError("--batches must be >= 1, --warmup >= 0 and --timeout-s > 0")
    path, overrides = Path(path), overrides or {}
    config = load_config(path, overrides)
    sizes = (tune_search.parse_micro_batches(micro_batches) if micro_batches is not None
             else tune_search.default_micro_batches(config.precompute))
    run_root, settings = open_run_root(config), teacher_pass_settings(config)
    rows_from = tune_search.check_tune_inputs(run_root, settings, seq_len_given=_seq_len_given(path, overrides),
                                              weights=not random_weights)
    if write:
        _check_writable(path, run_root, settings)
    return TuneRequest(path, config, sizes, rows_from, tune_search.has_experts(settings, weights=not random_weights))


def _seq_len_given(path: Path, overrides: dict[str, Any]) -> bool:
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return "seq_len" in data or "seq_len" in overrides


def _check_writable(path: Path, run_root: RunRoot, settings: TeacherPassSettings) -> None:
    """--write must be able to edit the file, and must not change the micro-batch of a run already under way."""
    if not os.access(path, os.W_OK):
        raise ConfigError(f"--write: {path} is not writable")
    computed = tune_search.committed_micro_batches(run_root, settings)
    if computed:
        raise ConfigError(f"--write: this config's top-K store already has shards computed with micro_batch "
                          f"{','.join(map(str, sorted(computed)))}; the micro-batch stays fixed for a run "
                          "(tune without --write)")


# --- editing one value of a YAML file in place -----------------------------------------------------------

_TOP_KEY = re.compile(r"^(?P<key>[A-Za-z_][\w.-]*)\s*:(?P<rest>.*)$")


def set_nested_value(text: str, section: str, key: str, value: Any) -> str:
    """`section: {key: value}` set in YAML text, keeping every other line (comments included) as it is.

    A block-style `section:` gets its `key:` line's value replaced (a trailing comment kept) or a new line
    under it; without the section, one is appended. The caller checks the result parses to what it should.
    """
    lines = text.splitlines(keepends=True)
    rendered = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    start = next((i for i, line in enumerate(lines) if (m := _TOP_KEY.match(line)) and m["key"] == section), None)
    if start is None:
        tail = "" if not text or text.endswith("\n") else "\n"
        return text + f"{tail}{section}:\n  {key}: {rendered}\n"
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
        end += 1
    children = [line for line in lines[start + 1:end] if line.strip() and not line.lstrip().startswith("#")]
    indent = re.match(r"^[ \t]*", children[0]).group(0) if children else "  "
    pattern = re.compile(rf"^{re.escape(indent)}{re.escape(key)}\s*:"
                         rf"(?P<value>[^#\n]*?)(?P<comment>\s+#.*)?(?P<eol>\r?\n?)$")
    for i in range(start + 1, end):
        match = pattern.match(lines[i])
        if match:
            lines[i] = f"{indent}{key}: {rendered}{match['comment'] or ''}{match['eol']}"
            return "".join(lines)
    if not lines[start].endswith("\n"):
        lines[start] += "\n"
    lines.insert(start + 1, f"{indent}{key}: {rendered}\n")
    return "".join(lines)


def write_micro_batch(path: Path, micro_batch: int) -> None:
    """precompute.micro_batch = micro_batch in the YAML file, in place (`write_precompute_setting`)."""
    write_precompute_setting(path, "micro_batch", micro_batch)


def write_precompute_setting(path: Path, key: str, value: Any) -> None:
    """precompute.KEY = value in the YAML file, in place (`write_precompute_settings`)."""
    write_precompute_settings(path, {key: value})


def write_precompute_settings(path: Path, values: dict[str, Any]) -> None:
    """precompute.KEY = value for each of `values` in the YAML file, in place and at once; refused (nothing
    written) when the edit would change anything else, e.g. a flow-style `precompute: {...}`."""
    text = path.read_text(encoding="utf-8")
    before = yaml.safe_load(text) or {}
    edited = text
    for key, value in values.items():
        edited = set_nested_value(edited, "precompute", key, value)
    expected = dict(before)
    expected["precompute"] = {**(before.get("precompute") or {}), **values}
    try:
        after = yaml.safe_load(edited)
    except yaml.YAMLError:
        after = None
    if after != expected:
        wanted = ", ".join(f"precompute.{key}: {value}" for key, value in values.items())
        raise ConfigError(f"--write: cannot edit {path} in place; set {wanted} there by hand")
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(edited, encoding="utf-8")
    os.chmod(temporary, path.stat().st_mode & 0o7777)
    os.replace(temporary, path)
