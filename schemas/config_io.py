"""The config in and out of text: YAML files, dotted overrides (`--set student.steps=50`), validation errors.

The models themselves live in `kdflow.schemas.config`, which knows nothing of text.
"""

from __future__ import annotations

import argparse
import os
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.layout import CONFIG_FILE

if TYPE_CHECKING:
    from kdflow.schemas.storage import RunRoot


def _section(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds: its model, also where it is optional (`PruneConfig | None`)."""
    members = typing.get_args(annotation) or (annotation,)
    models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
    return models[0] if len(models) == 1 else None


def _config_key(loc: tuple[int | str, ...]) -> str:
    """The dotted config key of an error location, without pydantic's union-member tags ('str', 'list[str]')."""
    parts: list[str] = []
    model: type[BaseModel] | None = KDFlowConfig
    for item in loc:
        if model is not None and isinstance(item, str):
            parts.append(item)  # a field of this section, or the unknown key itself
            field = model.model_fields.get(item)
            model = _section(field.annotation) if field is not None else None
        elif isinstance(item, int):
            parts.append(str(item))  # an index into a list or tuple value
        else:
            break  # a union member tag below a plain field
    return ".".join(parts)


def _format_validation_error(error: ValidationError, source: str, overrides: dict[str, Any] | None = None) -> str:
    first = error.errors()[0]
    where = _config_key(first["loc"]) or "<root>"
    overrides = overrides or {}
    parts = where.split(".")
    given = next((key for key in (".".join(parts[:n]) for n in range(len(parts), 0, -1)) if key in overrides), None)
    if given is not None:  # the value (or the list or section holding it) came from the command line
        source = f"--set {given}={overrides[given]}"
    elif where != "<root>" and (inside := [key for key in overrides if key.startswith(f"{where}.")]):
        named = [key for key in inside if key[len(where) + 1:].split(".")[0] in first["msg"]]  # those it names
        source += " with " + ", ".join(f"--set {key}={overrides[key]}" for key in named or inside)  # a section's check
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown config key '{where}'"
    if first["type"] == "missing" and first["loc"] and isinstance(first["loc"][-1], int):  # a tuple's item
        items = _config_key(first["loc"][:-1]) or "<root>"
        return f"{source}: invalid value for '{items}': too few items (item {first['loc'][-1] + 1} is missing)"
    if first["type"] == "missing":
        return f"{source}: missing required config key '{where}'"
    message = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    if where == "<root>":  # a check of the whole config, whose message names its keys
        named = [key for key in overrides if key in message]
        return f"{f'--set {named[0]}={overrides[named[0]]}' if len(named) == 1 else source}: {message}"
    if given is not None and first["type"] in ("string_type", "int_type", "float_type", "bool_type") and not isinstance(
            overrides[given], str):  # YAML read `007` as 7, `on` as True, nothing as null
        message += (f" (--set reads its value as YAML, which made it {overrides[given]!r}; quote text: "
                    f"--set '{given}=\"...\"')" if overrides[given] is not None else
                    " (--set gave no value: YAML's null)")
    return f"{source}: invalid value for '{where}': {message}"


def config_from_dict(data: dict[str, Any], source: str = "config", overrides: dict[str, Any] | None = None
                     ) -> KDFlowConfig:
    """The config; a problem is one line naming `source`, or the `--set` override (dotted key -> value) it came
    from."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return KDFlowConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source, overrides)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _where(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> KDFlowConfig:
    """Load a YAML config; `overrides` are dotted keys (`student.steps`) applied before validation."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a folder, not a config file (kdflow status and validate take a run root)")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]  # "found character '\t' ..."
        raise ConfigError(f"{path}: not valid YAML{_where(error)}: {problem}") from None
    if data is None:
        raise ConfigError(f"{path} is empty: a config sets at least run_root, dataset.path and teacher.model "
                          "(kdflow configs --write DIR copies examples)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value)
    return config_from_dict(data, source=str(path), overrides=overrides)


def config_named(given: str) -> KDFlowConfig | None:
    """The config when `given` names a config file (`kdflow status configs/example.yaml`), else None."""
    if given.lower().endswith((".yaml", ".yml")) and Path(given).is_file():
        return load_config(given)
    return None


def run_root_of(given: str) -> str:
    """A run root as given on a command line, or the one the config file `given` names."""
    config = config_named(given)
    if config is None and "://" not in given and given.endswith((".yaml", ".yml")) and not Path(given).exists():
        raise ConfigError(f"config file {given} does not exist")
    if config is None and "://" not in given and Path(given).is_file():  # a data file, a typo'd config name
        raise ConfigError(f"{given} is a file, neither a run root (a folder or URL) nor a config (.yaml)")
    if config is not None and "://" not in config.run_root and os.path.isfile(config.run_root):
        raise ConfigError(f"run_root {config.run_root!r} (in {given}) is a file, not a run root (a folder or URL)")
    return config.run_root if config is not None else given


def relative_run_root_hint(url: str, given: str) -> str:
    """Where a run root named by a config file (`given`) and missing is relative: that it was looked for from the
    working directory, and the folder above the config that holds it, if one does (else "")."""
    if given == url or "://" in url or Path(url).is_absolute():
        return ""
    hint = f"; a relative run_root is read from the working directory ({Path.cwd()})"
    found = next((base for base in Path(given).resolve().parents if (base / url).is_dir()), None)
    return hint + (f": run from {found}, which holds {found / url}" if found is not None else "")


def same_local_folder(first: str, second: str) -> bool:
    """Two spellings of one existing local folder (`./teacher/`, `teacher`, its absolute path, `~/...`, a link)."""
    folders = [os.path.expanduser(name) for name in (first, second)]
    return all("://" not in f and os.path.isdir(f) for f in folders) and (
        os.path.realpath(folders[0]) == os.path.realpath(folders[1]))


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        if node.get(key) is None:  # an empty optional section (`student.prune: null`) takes its first key
            node[key] = {}
        node = node[key]
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{key}' is not a section")
    node[leaf] = value


def dump_config(config: KDFlowConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def saved_config(run_root: RunRoot, folder: str) -> KDFlowConfig:
    """The config written beside a store or a student (`folder/config.yaml`), read back: FileNotFoundError where
    there is none, ConfigError where it no longer validates (one of another kdflow)."""
    return config_from_dict(yaml.safe_load(run_root.read_bytes(f"{folder}/{CONFIG_FILE}")) or {},
                            source=f"{folder}/{CONFIG_FILE}")


def write_stage_config(run_root: RunRoot, config: KDFlowConfig, folder: str) -> None:
    """The resolved config, beside a stage's output: what made these files, readable by people."""
    write_resolved_config(run_root, folder, dump_config(config))


def write_resolved_config(run_root: RunRoot, folder: str, resolved: str) -> None:
    """`resolved` (dump_config's text, as a stage's settings view keeps it) as `folder/config.yaml`; a rerun that
    would write the same bytes touches no file."""
    path, text = f"{folder}/{CONFIG_FILE}", resolved.encode()
    if not run_root.exists(path) or run_root.read_bytes(path) != text:
        run_root.write_bytes_atomic(path, text)


def parse_override(text: str) -> tuple[str, Any]:
    """One `KEY=VALUE` override of the command line (`--set`): the dotted key and its value parsed as YAML."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    if not all(part.strip() for part in key.split(".")):
        raise argparse.ArgumentTypeError(f"--set {text}: the key {key.strip()!r} has an empty part (KEY=VALUE, "
                                         "KEY dotted: student.steps=50)")
    return key.strip(), yaml.safe_load(value)


def setting_changes(pairs: list[tuple[str, Any, Any]]) -> list[str]:
    """`KEY OLD, now NEW` for each (key, old, new) that differs; of two sections, the keys that differ
    (`student.architecture.hidden_size 256, now 128`), not both whole."""
    found: list[str] = []
    for key, old, new in pairs:
        if isinstance(old, dict) and isinstance(new, dict) and old != new:
            found += setting_changes([(f"{key}.{name}", old.get(name), new.get(name)) for name in {**old, **new}])
        elif old != new:
            found.append(f"{key} {old!r}, now {new!r}")
    return found
