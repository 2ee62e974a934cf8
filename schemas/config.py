"""The one typed config that flows through every stage.

Every default lives here, in the field definitions. The config is frozen (stages cannot drift apart by
mutating it) and strict: an unknown key is an error that names the key, so a typo never silently falls
back to a default. Pydantic models also make Prefect render the config as a form in its UI.
The config in and out of text (YAML files, `--set` overrides): kdflow.schemas.config_io; its parts' fingerprints:
kdflow.schemas.config_hash.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from kdflow.schemas.config_form import form_schema

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")


def _check_device(value: str) -> str:
    if not _DEVICE_PATTERN.match(value):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
    return value


Device = Annotated[str, AfterValidator(_check_device)]  # auto, cpu, cuda, cuda:N or mps

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# student.eval_full_kl: auto loads the teacher for the held-out evaluation only when its local weight files total at
# most this (a teacher of a few hundred million parameters: seconds of one pass over the held-out rows on a CPU).
EVAL_FULL_KL_AUTO_BYTES = 1 << 30


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, json_schema_extra=form_schema)

    # Fields added to a fingerprinted section after stores were made from it: `section_hash` hashes them only when
    # set away from their default, so adding one leaves every existing fingerprint, and so every store, as it was.
    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset()


class DatasetConfig(_Section):
    """Where the documents come from: a hub dataset id, or local/remote jsonl, json, parquet, csv, tsv or txt files."""

    path: str = Field(description="Hub dataset id (e.g. uonlp/CulturaX), or a file, folder, glob or fsspec URL")
    name: str | None = Field(default=None, description="Hub dataset config name, e.g. 'ja'")
    data_files: str | list[str] | None = Field(default=None, description="Files (paths, globs or URLs) within `path`; "
                                                "leave empty to read `path` itself")
    split: str = Field(default="train", description="Dataset split to read")
    text_field: str = Field(default="text", description="Field holding each document's text; a dotted path (meta.body) "
                                                        "reaches into nested records")
    json_field: str | None = Field(default=None, description=".json files whose records sit under a key "
                                                             "({\"data\": [...]}): that key")
    streaming: bool = Field(default=False, description="Stream instead of downloading the whole set")
    revision: str | None = Field(default=None, description="Hub revision (branch, tag or commit) of the dataset")
    max_documents: PositiveInt | None = Field(default=None, description="Stop after this many non-empty documents")
    max_tokens: PositiveInt | None = Field(default=None, description="Token budget: stop once this many are reached")
    documents_per_part: PositiveInt = Field(default=10_000, description="Documents per committed corpus part")
    sample_by: Literal["line", "paragraph", "document"] = Field(
        default="line", description=".txt files: a document per line, per paragraph (blank-line separated) or per "
                                    "file")

    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"sample_by", "json_field"})


class TeacherConfig(_Section):
    """The model whose top-K log-probabilities the student learns from."""

    model: str = Field(description="Hub model id, a local folder, or package:NAME (a folder inside an installed "
                                   "package)")
    gguf_file: str | None = Field(default=None, description="GGUF file name inside `model` (dequantised on load)")
    revision: str | None = Field(default=None, description="Hub revision (branch, tag or commit) of the model")
    load_in_4bit: bool = Field(default=False, description="Quantise the weights to 4 bits on load (bitsandbytes nf4)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weight dtype; auto: bfloat16 on a GPU that supports it, else float32")
    device: Device = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    trust_remote_code: bool = Field(default=False, description="Run the model repository's own code (trusted models "
                                                               "only)")
    lm_head_float32: bool = Field(
        default=True, description="A bf16/fp16 teacher's logits in float32, never rounded to 16 bits (on CUDA the "
                                  "same matmul with float32 output: no extra memory). Rounding cost a trained "
                                  "teacher 4.5e-4 nats a position, 3.4x the codec's error (`kdflow bench "
                                  "logits-precision`); false: the logits of the model's own forward")

    @model_validator(mode="after")
    def _gguf_is_not_quantised_again(self) -> TeacherConfig:
        if self.load_in_4bit and self.gguf_file:
            raise ValueError("load_in_4bit cannot be combined with gguf_file: a GGUF is dequantised when it loads, and "
                             "transformers quantises no GGUF again; give the model's safetensors folder (or hub id) "
                             "for 4 bits, or set load_in_4bit: false")
        return self


class TopkStoreConfig(_Section):
    """How top-K shards are stored (README, "Top-K store format"). A store made with other settings is another
    store (its tag differs); training on one whose settings differ from these is an error naming both."""

    format: Literal["v2", "v1"] = Field(
        default="v2", description="v2: compact codec with the exact tail mass; v1: int32 ids + "
                                  "precompute.logprobs_dtype "
                                  "log-probs, no tail (what stores made before v2 hold)")
    values: Literal["sqrt", "float16", "float32"] = Field(
        default="sqrt", description="v2 log-probs: sqrt = quantised with step 1/levels on sqrt(p) (KL ~ top_k / (6 "
                                    "levels^2) "
                                    "nats/position); float16 or float32 = lossless IEEE bits")
    levels: int = Field(default=400, ge=1, le=65535, description="v2 values=sqrt: quantisation levels of sqrt(p)")
    tail: Literal["float16", "float32"] = Field(
        default="float16", description="v2: storage of tail_logprob, the log of the teacher's mass outside the stored "
                                       "ids")
    keep_mass: float | None = Field(
        default=None, gt=0.0, le=1.0, description="v2 adaptive K: per position keep the fewest ids whose mass reaches "
                                                  "this "
                                                  "share of the top-K mass, the rest joins the tail; None keeps all K")
    zstd_level: int = Field(default=1, ge=1, le=22, description="v2: zstd level of the byte streams (1 is smallest "
                                                                "here)")
    renumbering: Literal["unigram", "none"] = Field(
        default="unigram", description="v2: code ids renumbered by their frequency in the token store (smaller gaps), "
                                       "or as is")


class SamplingConfig(_Section):
    """Sampled teacher targets (`precompute.targets: sampled | hybrid`): per position an exact top-`head` (hybrid
    only), `samples` distinct tokens drawn from the teacher outside it, and what an unbiased loss needs."""

    head: PositiveInt = Field(default=16, description="hybrid: exact top-H tokens per position (sampled: none)")
    samples: PositiveInt = Field(default=12, description="Tokens sampled per position from the teacher's tail")
    scheme: Literal["priority", "gumbel"] = Field(
        default="priority", description="priority: Duffield priority sampling (weights max(p, tau)); "
                                        "gumbel: sampling without replacement (Gumbel top-S)")
    seed: int = Field(default=0, ge=0, description="With the shard, row and position, seeds every position's draw")
    values: Literal["float16", "float32"] = Field(
        default="float16", description="Storage of the sampled tokens' log-probs (the head's follows precompute.store; "
                                       "the threshold is always float32)")
    hash_version: Literal["kdflow.2", "kdflow.1"] = Field(
        default="kdflow.2", description="The draw's noise hash; kdflow.1 only to finish a store begun with it")


class PrecomputeConfig(_Section):
    """The teacher pass: how many log-probabilities to keep per position, batch shapes, retries and fan-out."""

    targets: Literal["topk", "sampled", "hybrid"] = Field(
        default="topk", description="topk: the top-K with a tail bucket; hybrid: exact top-H head + sampled tail; "
                                    "sampled: only sampled tokens (precompute.sampling)")
    sampling: SamplingConfig = Field(default=SamplingConfig(), description="Sampled targets: head, samples, scheme...")
    top_k: PositiveInt = Field(default=128, description="Teacher log-probabilities kept per position (K)")
    micro_batch: PositiveInt = Field(default=8, description="Sequences per forward (out of memory: retried at half)")
    chunk_tokens: PositiveInt | None = Field(default=None, description="Positions per logits chunk; empty: by budget")
    chunk_memory_mib: PositiveInt = Field(default=1024, description="Memory budget for one chunk of logits (MiB)")
    head: Literal["slab", "tiled", "tiled-gemm"] = Field(
        default="slab", description="How the pass reads the logits: slab loop, tiled (once per tile of ids) or "
                                    "tiled-gemm (tile stats made by the lm_head GEMM); docs/benchmarks.md")
    experts: Literal["auto", "grouped_mm", "batched_mm", "eager", "kdflow_fused"] = Field(
        default="auto", description="How a MoE teacher's experts run (transformers' experts_implementation, or "
                                    "kdflow_fused: Triton, CUDA); auto: transformers'; `kdflow tune precompute`")
    compile_body: bool = Field(default=False, description="torch.compile the teacher's body at the pass's fixed "
                               "micro-batch shape (CUDA graphs on CUDA); `kdflow bench body` times it (`compiled`)")
    # Token shards and top-K shards are aligned 1:1, so this also sizes the token shards written by `tokenise`.
    sequences_per_shard: PositiveInt = Field(default=1024, description="Sequences per shard (token and top-K alike)")
    logprobs_dtype: Literal["float16", "float32"] = Field(default="float16", description="How v1 stores keep the "
                                                          "log-probabilities (v2: precompute.store.values)")
    store: TopkStoreConfig = Field(default=TopkStoreConfig(), description="Top-K shard format and codec settings")
    report_rows: int = Field(default=4, ge=0, description="Rows the pass re-runs through the teacher for the store "
                                                          "report's KL (a Prefect artifact); 0: no re-run")
    max_attempts: PositiveInt = Field(default=4, description="Teacher processes tried (after CUDA errors, crashes) "
                                                             "before failing")
    retry_delay_s: float = Field(default=10.0, ge=0, description="Wait before the first retry; doubles with each "
                                                                 "further one")
    shards_per_flow_run: PositiveInt | None = Field(
        default=None, description="Fan out ranges of this many shards as runs of the fan-out deployment; empty: one "
                                  "process")
    fanout_deployment: str = Field(default="precompute-shards/gpu", description="FLOW/DEPLOYMENT that computes one "
                                                                                "shard range")
    lease_ttl_s: float = Field(
        default=900.0, gt=0, description="A shard's claim expires this long after its owner last renewed it (the "
                                         "owner died)")


class StudentArchitecture(_Section):
    """A small Llama-style student; the vocabulary is always the tokenizer's."""

    hidden_size: PositiveInt = Field(default=256, description="Width of the residual stream")
    num_hidden_layers: PositiveInt = Field(default=4, description="Decoder layers")
    num_attention_heads: PositiveInt = Field(default=4, description="Query heads per layer")
    num_key_value_heads: PositiveInt = Field(default=2, title="Number of key/value heads",
                                             description="Key/value heads per layer (grouped-query attention)")
    intermediate_size: PositiveInt = Field(default=688, description="Width of each layer's MLP")
    tie_word_embeddings: bool = Field(default=True, description="Share the input embedding with the output layer")
    rope_theta: float = Field(default=10_000.0, description="Base of the rotary position embedding")

    @model_validator(mode="after")
    def _heads(self) -> StudentArchitecture:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class KDConfig(_Section):
    """The loss: KL to the teacher's top-K, optionally mixed with next-token cross-entropy."""

    kd_weight: float = Field(default=1.0, ge=0.0, le=1.0, description="1.0: pure KD; 0.0: pure cross-entropy")
    temperature: float = Field(default=1.0, gt=0.0, description="Softens teacher and student alike; only 1.0 for "
                               "now: no store keeps the teacher's tempered tail that T != 1 needs")
    chunk_tokens: PositiveInt = Field(default=4096, description="Positions per chunk of student logits in the loss")
    untargeted_ce_weight: float = Field(default=0.0, ge=0.0, le=1.0, description="Weight of next-token cross-entropy "
                                        "at positions without a teacher target (a masked store's prompt tokens); "
                                        "0.0: no loss there")


class DistributedConfig(_Section):
    """Several GPUs or machines for the student, through torchrun; one process on one node trains in the flow's own
    process."""

    nproc_per_node: PositiveInt = Field(default=1, title="Processes per node",
                                        description="Ranks (GPUs) on each machine")
    nnodes: PositiveInt = Field(default=1, title="Nodes", description="Machines taking part")
    node_rank: int = Field(default=0, ge=0, description="This machine's number, 0 to nodes - 1")
    rdzv_endpoint: str = Field(default="127.0.0.1:29500", description="HOST:PORT where the ranks meet; node 0's "
                                                                      "address")
    rdzv_id: str = Field(default="kdflow", description="The job's name at the rendezvous; new for each job sharing an "
                                                       "endpoint")
    backend: Literal["auto", "nccl", "gloo"] = Field(default="auto", description="auto: nccl for GPUs, gloo for CPUs")
    sharding: Literal["auto", "fsdp", "ddp"] = Field(
        default="auto", description="fsdp: parameters, gradients and optimizer state sharded over ranks; ddp: "
                                    "replicated; "
                                    "auto: fsdp on CUDA, ddp on CPU")


class PruneConfig(_Section):
    """A student made from the teacher: its embedding, final norm, head and the `layers` most important blocks, and
    optionally fewer MLP channels and attention heads in each (kdflow.tasks.student.prune_width)."""

    layers: PositiveInt = Field(description="Teacher blocks the student keeps (the most important, in their order)")
    importance: Literal["cosine", "skip_loss"] = Field(
        default="cosine", description="How blocks are ranked on the calibration rows: cosine (how much a block turns "
                                      "its input; one forward) or skip_loss (how much the teacher's loss rises "
                                      "without it; one forward per block)")
    calibration_rows: PositiveInt = Field(default=16, description="Training rows of the token store the importance "
                                                                   "is measured on")
    intermediate_size: PositiveInt | None = Field(None, description="MLP channels each kept block (each expert) "
                                                                    "keeps, the most active ones; empty: all")
    key_value_heads: PositiveInt | None = Field(None, description="Key/value heads each kept block keeps (with their "
                                                                  "query heads), the most active ones; empty: all")


class StudentConfig(_Section):
    """The student: its architecture, optimiser and schedule, evaluation, checkpoints, loss and ranks."""

    name: str = Field(default="student", description="Folder under students/ (a new name starts a new student)")
    init_from: str | None = Field(default=None, title="Initialise from",
                                  description="A model to start from instead of `architecture`: a Hugging Face folder "
                                              "or hub id with the run tokenizer's vocabulary (the teacher's)")
    architecture: StudentArchitecture = StudentArchitecture()
    prune: PruneConfig | None = Field(default=None, title="Prune the teacher",
                                      description="Start from the teacher's own weights with fewer blocks instead of "
                                                  "`architecture` (kdflow.tasks.student.prune); empty: off")
    steps: PositiveInt = Field(default=200, description="Optimiser steps in total (a resumed run continues to this)")
    batch_size: PositiveInt = Field(default=8, description="Sequences per optimiser step (global, all ranks)")
    grad_accum: PositiveInt = Field(default=1, description="Micro-batches per optimiser step on each rank")
    lr: float = Field(default=1e-3, gt=0, title="Learning rate", description="Peak learning rate (AdamW)")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Final learning rate / peak (cosine decay)")
    warmup_steps: int = Field(default=20, ge=0, description="Steps of linear warmup")
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW weight decay (matrices only)")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), title="Adam betas", description="AdamW beta1 and beta2")
    grad_clip: float = Field(default=1.0, gt=0, description="Clip the gradient norm to this")
    eval_shards: int = Field(default=1, ge=0, description="Last N token shards held out for evaluation")
    eval_sequences: PositiveInt = Field(default=64, description="Held-out sequences per evaluation")
    eval_every: int = Field(default=0, ge=0, description="0: evaluate at the start and the end only")
    eval_full_kl: bool | Literal["auto"] = Field(
        default="auto", title="Evaluate the full-vocabulary KL",
        description="Also report kl_full, the KL to the teacher's whole distribution on the held-out rows, from one "
                    "teacher pass over them per run (the teacher loaded on the student's device while it runs). "
                    "auto: on when the teacher is a local folder whose weight files total at most "
                    "EVAL_FULL_KL_AUTO_BYTES (1 GiB); true: always; false: never")
    imported_is_teacher_model: bool = Field(False, description="Imported store made by teacher.model: kl_full on it")
    save_every: PositiveInt = Field(default=100, description="Steps between checkpoints")
    keep_checkpoints: PositiveInt = Field(default=2, description="Complete checkpoints kept in students/NAME (newest)")
    topk_tag: str | None = Field(default=None, description="Train on topk/TAG; default: the store made for this config")
    seed: int = Field(default=0, description="Seeds the initial weights and the data order")
    device: Device = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    autocast_bf16: bool = Field(default=True, description="bf16 autocast where the device supports it (CUDA)")
    log_every: PositiveInt = Field(default=10, description="Steps between training log lines (loss, lr, tok/s, ETA)")
    tensorboard: bool = Field(default=False, description="Also write TensorBoard event files to "
                                                         "students/NAME/tensorboard "
                                                          "(the tensorboard extra)")
    gradient_checkpointing: bool = Field(
        default=False, description="Keep only each decoder layer's input and recompute the layer in backward: "
                                   "less activation memory, one more forward of the body per step")
    compile: bool = Field(
        default=False, description="torch.compile the student's decoder layers (the body); the first steps wait "
                                   "for the compiler (a C++ compiler on CPU)")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        default="sdpa", title="Attention implementation",
        description="The student's attention: sdpa (PyTorch's fused kernels), eager (plain matmuls), "
                    "flash_attention_2 (the flash-attn package, CUDA only)")
    prefetch_steps: int = Field(default=2, ge=0, description="Optimiser steps of batches read ahead in a background "
                                "thread (pinned memory on CUDA); bounds the loader's memory. 0: read in the step")
    kd: KDConfig = KDConfig()
    distributed: DistributedConfig = DistributedConfig()
    lease_ttl_s: float = Field(
        default=900.0, gt=0, description="One trainer per student: another run waits while the trainer's lease is "
                                         "renewed; a trainer on another host that stops renewing it for this long is "
                                         "taken over")

    @model_validator(mode="after")
    def _one_start(self) -> StudentConfig:
        if self.prune is not None and self.init_from is not None:
            raise ValueError("student.prune and student.init_from both say where the student starts: set one")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME_PATTERN.match(value) or value in {".", ".."}:
            raise ValueError(f"student name must be a plain folder name (letters, digits, . _ -), got {value!r}")
        return value



class KDFlowConfig(_Section):
    """Everything a run needs, section by section in pipeline order: the data, the teacher pass, the student."""

    run_root: str = Field(description="Any fsspec URL: runs/demo, file:///data/kd, s3://bucket/kd")
    dataset: DatasetConfig
    tokenizer: str | None = Field(default=None, description="Tokenizer path or id; defaults to the teacher's")
    seq_len: PositiveInt = Field(default=512, title="Sequence length", description="Tokens per training sequence")
    teacher: TeacherConfig
    precompute: PrecomputeConfig = PrecomputeConfig()
    student: StudentConfig = StudentConfig()

    @model_validator(mode="after")
    def _sampled_targets_temperature(self) -> KDFlowConfig:
        if self.precompute.targets != "topk" and self.precompute.store.format != "v2":
            raise ValueError(f"precompute.targets={self.precompute.targets} needs precompute.store.format: v2 "
                             f"(v1 stores hold top-K only)")
        if self.precompute.targets != "topk" and self.student.kd.temperature != 1.0:
            raise ValueError(f"student.kd.temperature={self.student.kd.temperature} needs precompute.targets: topk; "
                             f"{self.precompute.targets} targets are sampled at temperature 1 and unbiased only there")
        if self.student.kd.temperature != 1.0:
            raise ValueError(f"student.kd.temperature={self.student.kd.temperature} is refused: no store keeps the "
                             f"teacher's tempered tail, which softening teacher and student alike needs (docs/loss.md)")
        return self


# The pipeline's stages, in order: what `kdflow run --stages` and the `pipeline` flow take.
STAGES = ("materialise", "tokenise", "precompute", "train")
