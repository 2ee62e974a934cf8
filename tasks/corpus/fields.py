"""`dataset.text_field` in a record: a field's name, or a dotted path into nested records (`meta.body` in
`{"meta": {"body": "..."}}`, a JSON object or a Parquet struct). A field whose own name holds the dots wins.

A record's *shape* is what the checks can see before reading it in full: a mapping from field names to a value
(a first record's own value, or the column's declared type where a schema gives one: a pyarrow type, a `datasets`
feature) or to the shape of a nested record (a JSON object, a Parquet struct, a `datasets` feature dictionary).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_MISSING = object()


def field_value(record: Mapping[str, Any], path: str) -> Any:
    """The value at `path` (the field of that name, else the dotted path through nested records); raises
    KeyError(path) when neither is there."""
    if path in record:
        return record[path]
    value: Any = record
    for key in path.split("."):
        value = value.get(key, _MISSING) if isinstance(value, Mapping) else _MISSING
        if value is _MISSING:
            raise KeyError(path)
    return value


def has_field(shape: Mapping[str, Any], path: str) -> bool:
    try:
        field_value(shape, path)
    except KeyError:
        return False
    return True


def field_names(shape: Mapping[str, Any], limit: int = 40) -> list[str]:
    """The fields a text_field could name, nested records' by their dotted paths (`id, meta.body, meta.source`),
    sorted; at most `limit`, the last entry then saying how many more."""
    names: list[str] = []

    def walk(part: Mapping[str, Any], prefix: str) -> None:
        for key, value in part.items():
            if isinstance(value, Mapping) and value:
                walk(value, f"{prefix}{key}.")
            else:
                names.append(prefix + str(key))

    walk(shape, "")
    names.sort()
    return names if len(names) <= limit else [*names[:limit - 1], f"{len(names) - limit + 1} more"]


def arrow_shape(schema: Any) -> dict[str, Any]:
    """A pyarrow schema (or struct type) as a shape: struct fields nested."""
    import pyarrow as pa

    return {f.name: arrow_shape(f.type) if pa.types.is_struct(f.type) else f.type for f in schema}


def features_shape(features: Mapping[str, Any]) -> dict[str, Any]:
    """A `datasets.Features` (a dict of features; a nested dict is a struct) as a shape."""
    return {name: features_shape(value) if isinstance(value, Mapping) else value for name, value in features.items()}


def not_text(value: Any) -> str | None:
    """What a shape's leaf holds where that is not text (None for text, a null, or a column of text): the value's
    type (`int`), or the column's declared type (`int64`, `list<item: string>`, `List`)."""
    import pyarrow as pa

    if value is None or isinstance(value, str):
        return None
    if isinstance(value, pa.DataType) and pa.types.is_dictionary(value):  # a categorical column: its values'
        return None if not_text(value.value_type) is None else str(value)
    if isinstance(value, pa.DataType):
        text = (pa.types.is_string(value) or pa.types.is_large_string(value) or pa.types.is_null(value)
                or getattr(pa.types, "is_string_view", lambda _: False)(value))
        return None if text else str(value)
    if type(value).__name__ == "Value" and type(value).__module__.startswith("datasets"):
        return None if value.dtype in ("string", "large_string", "string_view", "null") else value.dtype
    return type(value).__name__  # a value's own type (int, list), or another feature's (List, ClassLabel)
