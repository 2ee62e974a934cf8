"""The one typed config that flows through every stage.

Every default lives here, in the field definitions. The config is frozen (stages cannot drift apart by
mutating it) and strict: an unknown key is an error that names the key, so a typo never silently falls
back to a default. Pydantic models also make Prefect render the config as a form in its UI.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from kdflow.schemas.errors import ConfigError

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class DatasetConfig(_Section):
    """Where the documents come from: a hub dataset id or local/remote files (jsonl, json, parquet, txt)."""

    path: str = Field(description="Hub dataset id (e.g. uonlp/CulturaX), or a file, folder, glob or fsspec URL")
    name: str | None = Field(default=None, description="Hub dataset config name, e.g. 'ja'")
    data_files: str | list[str] | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = Field(default=False, description="Stream instead of downloading the whole set")
    revision: str | None = None
    max_documents: PositiveInt | None = Field(default=None, description="Stop after this many non-empty documents")
    max_tokens: PositiveInt | None = Field(default=None, description="Token budget: stop once this many are reached")
    documents_per_part: PositiveInt = 10_000


class TeacherConfig(_Section):
    model: str = Field(description="Hub model id or a local folder")
    gguf_file: str | None = Field(default=None, description="GGUF file name inside `model` (dequantised on load)")
    revision: str | None = None
    load_in_4bit: bool = Field(default=False, description="bitsandbytes nf4 quantisation")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    trust_remote_code: bool = False

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE_PATTERN.match(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value


class PrecomputeConfig(_Section):
    top_k: PositiveInt = 128
    micro_batch: PositiveInt = Field(default=8, description="Fixed for the whole run; never adapted at run time")
    chunk_tokens: PositiveInt | None = Field(default=None, description="lm_head rows per chunk; None: from chunk_memory_mib")
    chunk_memory_mib: PositiveInt = Field(default=1024, description="Memory budget for one chunk of logits")
    # Token shards and top-K shards are aligned 1:1, so this also sizes the token shards written by `tokenise`.
    sequences_per_shard: PositiveInt = 1024
    logprobs_dtype: Literal["float16", "float32"] = "float16"
    max_attempts: PositiveInt = Field(default=4, description="Worker processes tried before giving up")
    retry_delay_s: float = Field(default=10.0, ge=0)
    shards_per_flow_run: PositiveInt | None = Field(
        default=None, description="Fan out shard ranges of this size to the per-shard deployment (scale-out)"
    )
    fanout_deployment: str = Field(default="precompute-shards/gpu", description="FLOW/DEPLOYMENT that computes a shard range")
    lease_ttl_s: float = Field(
        default=900.0, gt=0, description="A shard's claim expires this long after its owner last renewed it (owner died)"
    )


class StudentArchitecture(_Section):
    """A small Llama-style student; the vocabulary is always the tokenizer's."""

    hidden_size: PositiveInt = 256
    num_hidden_layers: PositiveInt = 4
    num_attention_heads: PositiveInt = 4
    num_key_value_heads: PositiveInt = 2
    intermediate_size: PositiveInt = 688
    tie_word_embeddings: bool = True
    rope_theta: float = 10_000.0

    @model_validator(mode="after")
    def _heads(self) -> StudentArchitecture:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class KDConfig(_Section):
    kd_weight: float = Field(default=1.0, ge=0.0, le=1.0, description="1.0: pure KD; 0.0: pure cross-entropy")
    temperature: float = Field(default=1.0, gt=0.0)
    chunk_tokens: PositiveInt = 4096


class DistributedConfig(_Section):
    """torchrun settings; nproc_per_node=1 and nnodes=1 trains in the flow's own worker process."""

    nproc_per_node: PositiveInt = 1
    nnodes: PositiveInt = 1
    node_rank: int = Field(default=0, ge=0)
    rdzv_endpoint: str = "127.0.0.1:29500"
    rdzv_id: str = "kdflow"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    sharding: Literal["auto", "fsdp", "ddp"] = Field(
        default="auto", description="fsdp: parameters, gradients and optimizer state sharded over ranks; ddp: replicated; "
                                    "auto: fsdp on CUDA, ddp on CPU")


class StudentConfig(_Section):
    name: str = "student"
    init_from: str | None = Field(default=None, description="Local HF checkpoint to start from instead of `architecture`")
    architecture: StudentArchitecture = StudentArchitecture()
    steps: PositiveInt = 200
    batch_size: PositiveInt = Field(default=8, description="Sequences per optimiser step (global, all ranks)")
    grad_accum: PositiveInt = 1
    lr: float = Field(default=1e-3, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=20, ge=0)
    weight_decay: float = Field(default=0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(default=1.0, gt=0)
    eval_shards: int = Field(default=1, ge=0, description="Last N token shards held out for evaluation")
    eval_sequences: PositiveInt = 64
    eval_every: int = Field(default=0, ge=0, description="0: evaluate at the start and the end only")
    save_every: PositiveInt = 100
    keep_checkpoints: PositiveInt = Field(default=2, description="Complete checkpoints kept in students/NAME (newest)")
    topk_tag: str | None = Field(default=None, description="Train on topk/TAG; default: the store made for this config")
    seed: int = 0
    device: str = "auto"
    autocast_bf16: bool = Field(default=True, description="bf16 autocast where the device supports it (CUDA)")
    kd: KDConfig = KDConfig()
    distributed: DistributedConfig = DistributedConfig()

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME_PATTERN.match(value) or value in {".", ".."}:
            raise ValueError(f"student name must be a plain folder name (letters, digits, . _ -), got {value!r}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE_PATTERN.match(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value


class KDFlowConfig(_Section):
    """Everything a run needs. Sections map 1:1 to stages; see DESIGN.md, 'One config'."""

    run_root: str = Field(description="Any fsspec URL: runs/demo, file:///data/kd, s3://bucket/kd")
    dataset: DatasetConfig
    tokenizer: str | None = Field(default=None, description="Tokenizer path or id; defaults to the teacher's")
    seq_len: PositiveInt = 512
    teacher: TeacherConfig
    precompute: PrecomputeConfig = PrecomputeConfig()
    student: StudentConfig = StudentConfig()

    @property
    def tokenizer_source(self) -> tuple[str, str | None]:
        """(path, gguf_file) the tokenizer loads from: the explicit one, else the teacher's."""
        if self.tokenizer is not None:
            return self.tokenizer, None
        return self.teacher.model, self.teacher.gguf_file


def section_hash(*parts: BaseModel | dict | str | int | None, length: int = 16) -> str:
    """A short, stable hash of config parts (canonical JSON), used in fingerprints and store tags."""
    payload = [p.model_dump(mode="json") if isinstance(p, BaseModel) else p for p in parts]
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def _config_key(loc: tuple[int | str, ...]) -> str:
    """The dotted config key of an error location, without pydantic's union-member tags ('str', 'list[str]')."""
    parts: list[str] = []
    model: type[BaseModel] | None = KDFlowConfig
    for item in loc:
        if model is not None and isinstance(item, str):
            parts.append(item)  # a field of this section, or the unknown key itself
            field = model.model_fields.get(item)
            annotation = field.annotation if field is not None else None
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        elif isinstance(item, int):
            parts.append(str(item))  # an index into a list or tuple value
        else:
            break  # a union member tag below a plain field
    return ".".join(parts)


def _format_validation_error(error: ValidationError, source: str) -> str:
    first = error.errors()[0]
    where = _config_key(first["loc"]) or "<root>"
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown config key '{where}'"
    if first["type"] == "missing":
        return f"{source}: missing required config key '{where}'"
    return f"{source}: invalid value for '{where}': {first['msg']}"


def config_from_dict(data: dict[str, Any], source: str = "config") -> KDFlowConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return KDFlowConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source)) from None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> KDFlowConfig:
    """Load a YAML config; `overrides` are dotted keys (`student.steps`) applied before validation."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value)
    return config_from_dict(data, source=str(path))


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{key}' is not a section")
    node[leaf] = value


def dump_config(config: KDFlowConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
