"""The compressor settings of a DistillKit logit capture: which bytes a position's log-probs and ids take.

DistillKit writes them as `compression_config.yaml` beside the Parquet files of a capture, and its training
config repeats them under `teacher: logprob_compressor:`. A capture cannot be decoded without them, and nothing
in the rows says which they were, so they are read from such a file and checked here, once, before any row.
Field names and defaults are DistillKit's own (its `DistributionQuantizationConfig`), so one file serves both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kdflow.schemas.errors import ConfigError

SETTINGS_FILE = "compression_config.yaml"  # what DistillKit's capture writes beside its Parquet files
FLOAT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
SPECIAL_TERMS = ("sqrt", "exp")  # DistillKit's non-power polynomial terms: sqrt(t), exp(t)
_REQUIRED = ("d", "k", "exact_k", "residual_bins")


@dataclass(frozen=True)
class ResidualBin:
    """`num_elements` residuals after the polynomial, quantised to `element_bits` with one scale per position."""

    scale_dtype: str
    element_bits: int
    num_elements: int


@dataclass(frozen=True)
class DistillKitSettings:
    """DistillKit's `logprob_compressor` settings; defaults are DistillKit's where it has one."""

    d: int  # vocabulary size: an id takes ceil(log2(d)) bits
    k: int  # log-probs (and ids) stored per position
    exact_k: int  # the first exact_k log-probs stored as floats of exact_dtype
    exact_dtype: str = "float32"
    polynomial_terms: tuple[int | str, ...] = ()  # powers of t, or "sqrt"/"exp": a curve through the other k - exact_k
    term_dtype: str = "float32"  # the dtype of the curve's coefficients
    residual_bins: tuple[ResidualBin, ...] = field(default_factory=tuple)
    delta_encoding: bool = True  # values are differences to the previous one (the first is itself)
    error_diffusion: bool = False  # how the capture rounded; decoding is the same either way
    normalize_t: bool = False  # t runs over [0, 1] instead of 0, 1, ..., k - exact_k - 1

    @property
    def index_bits(self) -> int:
        """ceil(log2(d)): DistillKit's width of one packed id."""
        return max(self.d - 1, 1).bit_length()

    @property
    def approx_k(self) -> int:
        return self.k - self.exact_k

    def logprob_bytes(self) -> int:
        """Bytes of one position's `compressed_logprobs` entry."""
        size = self.exact_k * FLOAT_BYTES[self.exact_dtype] + len(self.polynomial_terms) * FLOAT_BYTES[self.term_dtype]
        return size + sum(FLOAT_BYTES[b.scale_dtype] + (b.num_elements * b.element_bits + 7) // 8
                          for b in self.residual_bins)

    def index_bytes(self) -> int:
        """Bytes of one position's `bytepacked_indices` entry."""
        return (self.k * self.index_bits + 7) // 8

    def as_yaml_dict(self) -> dict[str, Any]:
        """The settings as DistillKit writes them (its `model_dump(mode="json")`)."""
        return {"d": self.d, "k": self.k, "exact_k": self.exact_k, "exact_dtype": self.exact_dtype,
                "polynomial_terms": list(self.polynomial_terms) or None, "term_dtype": self.term_dtype,
                "residual_bins": [{"scale_dtype": b.scale_dtype, "element_bits": b.element_bits,
                                   "num_elements": b.num_elements} for b in self.residual_bins],
                "delta_encoding": self.delta_encoding, "error_diffusion": self.error_diffusion,
                "normalize_t": self.normalize_t}


def lossless_settings(vocab_size: int, k: int) -> DistillKitSettings:
    """What export writes unless told otherwise: every log-prob as an exact float32, no curve, no deltas.

    It costs 4 bytes per log-prob, about what kdflow's own v1 store costs, but reads back bit for bit."""
    return DistillKitSettings(d=vocab_size, k=k, exact_k=k, exact_dtype="float32", delta_encoding=False)


def _integer(value: Any, name: str, where: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where}: {name} must be a whole number >= {least}, got {value!r}")
    return value


def _dtype(value: Any, name: str, where: str) -> str:
    if value not in FLOAT_BYTES:
        raise ConfigError(f"{where}: {name} must be one of {', '.join(FLOAT_BYTES)}, got {value!r}")
    return value


def _flag(value: Any, name: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def _bin(value: Any, index: int, where: str) -> ResidualBin:
    name = f"residual_bins[{index}]"
    if not isinstance(value, dict) or set(value) != {"scale_dtype", "element_bits", "num_elements"}:
        raise ConfigError(f"{where}: {name} must have exactly scale_dtype, element_bits and num_elements")
    bits = _integer(value["element_bits"], f"{name}.element_bits", where, 1)
    if bits > 64:
        raise ConfigError(f"{where}: {name}.element_bits must be at most 64, got {bits}")
    return ResidualBin(_dtype(value["scale_dtype"], f"{name}.scale_dtype", where), bits,
                       _integer(value["num_elements"], f"{name}.num_elements", where, 1))


def _terms(value: Any, where: str) -> tuple[int | str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{where}: polynomial_terms must be a list, got {value!r}")
    for term in value:
        if not (term in SPECIAL_TERMS or (isinstance(term, int) and not isinstance(term, bool) and term >= 0)):
            raise ConfigError(f"{where}: polynomial term {term!r} is neither a power >= 0 nor one of "
                              f"{', '.join(SPECIAL_TERMS)}")
    return tuple(value)


def distillkit_settings(mapping: Any, where: str) -> DistillKitSettings:
    """Checked settings from the `logprob_compressor` mapping; `where` names the file in every message."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where}: the compressor settings must be a mapping, got {type(mapping).__name__}")
    unknown = sorted(set(mapping) - {f for f in DistillKitSettings.__dataclass_fields__})
    if unknown:
        raise ConfigError(f"{where}: unknown compressor setting {unknown[0]!r}")
    missing = [name for name in _REQUIRED if name not in mapping]
    if missing:
        raise ConfigError(f"{where}: the compressor setting {missing[0]!r} is missing")
    bins = mapping["residual_bins"]
    if not isinstance(bins, list):
        raise ConfigError(f"{where}: residual_bins must be a list, got {bins!r}")
    settings = DistillKitSettings(
        d=_integer(mapping["d"], "d", where, 2), k=_integer(mapping["k"], "k", where, 1),
        exact_k=_integer(mapping["exact_k"], "exact_k", where, 0),
        exact_dtype=_dtype(mapping.get("exact_dtype", "float32"), "exact_dtype", where),
        polynomial_terms=_terms(mapping.get("polynomial_terms"), where),
        term_dtype=_dtype(mapping.get("term_dtype", "float32"), "term_dtype", where),
        residual_bins=tuple(_bin(value, index, where) for index, value in enumerate(bins)),
        delta_encoding=_flag(mapping.get("delta_encoding", True), "delta_encoding", where),
        error_diffusion=_flag(mapping.get("error_diffusion", False), "error_diffusion", where),
        normalize_t=_flag(mapping.get("normalize_t", False), "normalize_t", where))
    if settings.k < settings.exact_k:
        raise ConfigError(f"{where}: k ({settings.k}) must be >= exact_k ({settings.exact_k})")
    if settings.approx_k and not settings.polynomial_terms and not settings.residual_bins:
        raise ConfigError(f"{where}: with exact_k < k, polynomial_terms or residual_bins must say how the rest "
                          "is stored")
    if sum(b.num_elements for b in settings.residual_bins) > settings.approx_k:
        raise ConfigError(f"{where}: residual_bins hold more than k - exact_k = {settings.approx_k} elements")
    return settings


def read_distillkit_settings(path: str | Path) -> DistillKitSettings:
    """The settings from a capture's folder (its `compression_config.yaml`) or a YAML file the user gives.

    The file may hold the settings themselves, or a DistillKit training config with them under
    `logprob_compressor:` or `teacher: logprob_compressor:`. Captures of DistillKit's older polynomial format
    (`legacy_logit_compression`) are refused by name."""
    path = Path(path)
    file = path / SETTINGS_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no DistillKit compressor settings at {file}: give the capture's {SETTINGS_FILE} "
                          "or the DistillKit config that names its logprob_compressor (--distillkit-settings FILE)")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read DistillKit settings {file}: {str(error).splitlines()[0]}") from None
    for outer in (data, (data or {}).get("teacher") if isinstance(data, dict) else None):
        if isinstance(outer, dict) and "legacy_logit_compression" in outer:
            raise ConfigError(f"{file}: DistillKit's legacy_logit_compression format is not supported; "
                              "only logprob_compressor (compressed_logprobs, bytepacked_indices)")
        if isinstance(outer, dict) and "logprob_compressor" in outer:
            return distillkit_settings(outer["logprob_compressor"], str(file))
    return distillkit_settings(data, str(file))


def settings_for_source(source: str | Path, given: str | Path | None = None) -> DistillKitSettings:
    """The settings an import of `source` uses: the file the user `given`, else the capture's own
    `compression_config.yaml` in the source folder, or beside the Parquet file the source names or one folder
    up (a dataset folder with its files in `data/`)."""
    if given is not None:
        return read_distillkit_settings(given)
    source = Path(source)
    folders = [source, source.parent] if source.is_dir() else [source.parent, source.parent.parent]
    found = [folder for folder in folders if (folder / SETTINGS_FILE).is_file()]
    return read_distillkit_settings(found[0] if found else folders[0])


def write_distillkit_settings(settings: DistillKitSettings, folder: str | Path) -> Path:
    """Write `compression_config.yaml` into `folder` (atomically: a reader never sees half of it)."""
    target = Path(folder) / SETTINGS_FILE
    partial = target.with_name(f".{SETTINGS_FILE}.partial")
    partial.write_text(yaml.safe_dump(settings.as_yaml_dict(), sort_keys=False), encoding="utf-8")
    partial.replace(target)
    return target
