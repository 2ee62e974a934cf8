"""Sampled teacher targets by name: their kinds, sampling schemes and noise-hash version, and what
`precompute.targets: sampled | hybrid` adds to a store's format settings (its fingerprint and `_store.json`).

The bytes of such a store: `kdflow.schemas.codec_sampled`; the draw: `kdflow.tasks.teacher.sampling`.
"""

from __future__ import annotations

from kdflow.schemas.config import PrecomputeConfig

SAMPLED_KINDS = ("hybrid", "sampled")
SCHEMES = ("priority", "gumbel")
# The noise hash a sampled store is drawn with (kdflow.tasks.teacher.sampling_noise), newest first: kdflow.2 (32-bit,
# float32 keys) for new stores; kdflow.1 (64-bit, float64 keys) to finish a store begun before kdflow.2.
HASH_VERSIONS = ("kdflow.2", "kdflow.1")
HASH_VERSION = HASH_VERSIONS[0]


def sampled_format(precompute: PrecomputeConfig) -> dict[str, object]:
    """What `precompute.targets: sampled | hybrid` adds to a store's format settings (`stores.store_format`):
    so a store's fingerprint and `_store.json` name the kind of targets and every parameter of the draw."""
    sampling = precompute.sampling
    head = sampling.head if precompute.targets == "hybrid" else 0
    draw = {"head": head, "samples": sampling.samples, "scheme": sampling.scheme, "seed": sampling.seed,
            "values": sampling.values, "hash_version": sampling.hash_version}
    return {"targets": precompute.targets, "sampling": draw}


def sampled_label(settings: dict[str, object]) -> str:
    """"hybrid H16+S12 (priority, seed 0)" for messages."""
    sampling = settings.get("sampling") or {}
    head = f"H{sampling.get('head')}+" if settings.get("targets") == "hybrid" else ""
    return (f"{settings.get('targets')} {head}S{sampling.get('samples')} "
            f"({sampling.get('scheme')}, seed {sampling.get('seed')})")
