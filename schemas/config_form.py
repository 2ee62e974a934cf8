"""How the config reads as Prefect's parameter form (the UI's Deployments > Run > Custom run): field order and
titles, whatever fields a section has. Pure pydantic schema editing; `schemas/config.py` hooks it into every
section."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# Words of field names as a person reads them in the form; the rest are capitalised as they are.
_TITLE_WORDS = {"id": "ID", "ttl": "TTL", "kd": "KD", "ce": "CE", "lr": "LR", "gguf": "GGUF", "rdzv": "rendezvous",
                "bf16": "bf16", "4bit": "4-bit", "num": "number of", "seq": "sequence", "len": "length",
                "grad": "gradient", "accum": "accumulation", "rope": "RoPE", "fanout": "fan-out", "topk": "top-K",
                "logprobs": "log-prob", "nproc": "processes", "nnodes": "nodes", "dtype": "dtype", "mib": "MiB"}
_TITLE_UNITS = {"s": "(s)", "mib": "(MiB)"}  # a last word that is a unit: "lease_ttl_s" -> "Lease TTL (s)"


def form_title(name: str) -> str:
    """A field name as a form label: 'lease_ttl_s' -> 'Lease TTL (s)', 'rdzv_id' -> 'Rendezvous ID'."""
    words = name.split("_")
    unit = _TITLE_UNITS.get(words[-1]) if len(words) > 1 else None
    text = " ".join(_TITLE_WORDS.get(word, word) for word in (words[:-1] if unit else words))
    text = text.replace("top k", "top-K")
    return text[:1].upper() + text[1:] + (f" {unit}" if unit else "")


def form_schema(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """How the config reads as Prefect's parameter form, whatever fields a section has.

    `position` (the key Prefect's UI sorts a form's fields by) follows the fields' definition order: a server
    on PostgreSQL stores the schema as `jsonb`, which reorders object keys, so without it nested sections
    come back scrambled. Each field gets a readable title (its own `title=`, else `form_title` of its name);
    a section field (a `$ref`) gets its section's title and description beside the reference."""
    properties = schema.get("properties", {})
    for position, (name, field) in enumerate(model.model_fields.items()):
        entry = properties.get(name)
        if entry is None:
            continue
        entry["position"] = position
        entry["title"] = field.title or form_title(name)
        annotation = field.annotation
        if field.description is None and isinstance(annotation, type) and issubclass(annotation, BaseModel) \
                and annotation.__doc__:
            entry["description"] = " ".join(annotation.__doc__.split())
