"""Fingerprints of config parts: a short, stable hash of their canonical JSON (`section_hash`).

A section may name fields that count only when set (`HASHED_WHEN_SET`): a new setting left at its default then
leaves the fingerprints of everything made before it unchanged.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel


def _hashed_fields(model: BaseModel, dumped: dict[str, Any]) -> dict[str, Any]:
    """`dumped` (model's JSON dump) less the fields of HASHED_WHEN_SET left at their default, in nested sections too."""
    fields = type(model).model_fields
    for name in getattr(model, "HASHED_WHEN_SET", ()):
        if getattr(model, name) == fields[name].default:
            dumped.pop(name, None)
    for name in fields:
        if isinstance(value := getattr(model, name), BaseModel):
            _hashed_fields(value, dumped[name])
    return dumped


def section_hash(*parts: BaseModel | dict | str | int | None, length: int = 16) -> str:
    """A short, stable hash of config parts (canonical JSON), used in fingerprints and store tags."""
    payload = [_hashed_fields(p, p.model_dump(mode="json")) if isinstance(p, BaseModel) else p for p in parts]
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]
