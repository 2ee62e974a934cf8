"""Pre-flight: the whole config checked before any Prefect server or stage starts, for the stages being run.

`kdflow run` and `kdflow demo` call `run_preflight` right after the config loads and before Prefect is
imported; a flow run started from a deployment calls it first thing (`kdflow.flows.common.preflight_when_deployed`).
Each check fails with one `ConfigError` line naming the setting and its value, and writes nothing; the whole list
takes a second or two, because nothing heavy is loaded: no torch, no transformers, no Prefect, no weights
(configs are read as JSON, GGUF headers and tokenizer.json directly).
What cannot be told that cheaply (a hub model not cached yet, an object store's write permission) is left to
the stage, which checks it again when it loads the real thing.

The checks are one list, `CHECKS` at the end of this module, run in order; each names the stages it applies to.
A new check is a function taking the `Preflight` context (kdflow.tasks.preflight_context), here or in
kdflow.tasks.preflight_stores (what the run root already holds), and one line in that list.
Warnings (free disk against an estimate of what the run writes) are returned, printed by the caller.
"""

from __future__ import annotations

import os

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.layout import CORPUS_DIR, STUDENTS_DIR, TOKENS_DIR, TOPK_DIR
from kdflow.tasks.preflight_context import Check, Preflight, chosen_stages
from kdflow.tasks.preflight_stores import check_imported, check_resume, check_sources, check_train_inputs


def run_preflight(config: KDFlowConfig, stages: list[str] | str | None = None) -> list[str]:
    """Every check that applies to `stages`, in order; the first failure raises ConfigError. -> warnings."""
    context = Preflight(config, chosen_stages(stages))
    for item in CHECKS:
        if item.stages & context.stages:
            item.run(context)
    return context.warnings


# --- the checks -------------------------------------------------------------------------------------------


def check_run_root(context: Preflight) -> None:
    """A local run root must be a folder (or creatable) that this process may write; an object store's bucket
    must exist and answer these credentials (one request). Nothing is written here."""
    run_root = context.run_root
    if not run_root.is_local:
        try:
            run_root.check_bucket()  # a mistyped bucket or no credentials showed only once Prefect had started
        except StoreError as error:
            raise ConfigError(str(error)) from None
        return  # whether these credentials may write shows with the first write
    url, path = context.config.run_root, run_root.root
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"run_root={url!r} is a file, not a folder")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"run_root={url!r} cannot be created: {existing} is a file")
    folders = [existing] + [os.path.join(path, name) for name in (CORPUS_DIR, TOKENS_DIR, TOPK_DIR, STUDENTS_DIR)
                            if os.path.isdir(os.path.join(path, name))]
    for folder in folders:
        if not os.access(folder, os.W_OK | os.X_OK):  # also false on a read-only filesystem, even for root
            raise ConfigError(f"run_root={url!r} cannot be written: {folder} is read-only for this user")


def check_dataset(context: Preflight) -> None:
    """The source exists and its first record holds `dataset.text_field` (skipped when the corpus is done)."""
    from kdflow.schemas.fingerprints import corpus_fingerprint
    from kdflow.tasks.corpus.probe import probe_dataset

    done = context.complete(CORPUS_DIR)
    if done is not None and done.get("fingerprint") == corpus_fingerprint(context.config):
        return  # materialise will skip everything: the source need not be reachable
    warning = probe_dataset(context.config.dataset)
    if warning:
        context.warn(warning)


def check_teacher(context: Preflight) -> None:
    """The teacher's files are there (its weights only by name), and top_k and seq_len fit its config. Where these
    stages read only its tokenizer (training on an imported store, say), the folder may hold just that."""
    from kdflow.tasks.common.hub_access import check_hub_teacher
    from kdflow.tasks.common.model_configs import teacher_limits_problem
    from kdflow.tasks.common.model_files import check_teacher_files

    stages, config = context.stages, context.config
    model = "precompute" in stages or ("train" in stages and (config.student.prune is not None
                                                              or config.student.eval_full_kl is True))
    needs_teacher = model or (context.tokenizer_from_teacher and (
        stages & {"tokenise", "train"} or ("materialise" in stages and config.dataset.max_tokens)))
    if not needs_teacher:
        return
    if check_teacher_files(config.teacher, model=model) is None:  # a hub id
        check_hub_teacher(config.teacher)
    if "precompute" in stages:
        shape = context.teacher_shape
        problem = teacher_limits_problem(shape.vocab_size, shape.context_length, top_k=config.precompute.top_k,
                                         seq_len=config.seq_len)
        if problem:
            raise ConfigError(f"{problem} (read from {shape.source})")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def check_tokenizer(context: Preflight) -> None:
    """The run's tokenizer can be read, and an explicit `tokenizer:` is the teacher's own vocabulary."""
    from kdflow.tasks.common.hub_access import check_hub_model
    from kdflow.tasks.common.model_configs import tokenizer_mismatch, tokenizer_vocab
    from kdflow.tasks.common.model_files import resolve_model_files

    config, stages = context.config, context.stages
    if not (stages & {"tokenise", "precompute", "train"} or config.dataset.max_tokens):
        return
    if context.tokenizer_from_teacher:
        source = resolve_model_files(config.teacher.model, config.teacher.gguf_file)
        if os.path.isdir(source) and not config.teacher.gguf_file and not any(
                os.path.exists(os.path.join(source, name)) for name in _TOKENIZER_FILES):
            raise ConfigError(f"teacher.model {config.teacher.model!r} has no tokenizer files "
                              f"({', '.join(_TOKENIZER_FILES[:3])}, ...): set `tokenizer:` to the teacher's tokenizer")
        # it parses (or says why)
        tokenizer_vocab(config.teacher.model, config.teacher.gguf_file, config.teacher.revision)
        return
    try:
        source = resolve_model_files(config.tokenizer)
    except ConfigError as error:
        raise ConfigError(f"tokenizer: {error}") from None
    if not os.path.exists(source):
        check_hub_model("tokenizer", config.tokenizer, filenames=("tokenizer_config.json", "tokenizer.json"))
    if os.path.isdir(source) and not any(os.path.exists(os.path.join(source, name)) for name in _TOKENIZER_FILES):
        raise ConfigError(f"tokenizer={config.tokenizer!r} is not a tokenizer folder "
                          f"(no {', '.join(_TOKENIZER_FILES[:3])}, ...)")
    vocab = tokenizer_vocab(config.tokenizer)
    if vocab is not None and not vocab:
        raise ConfigError(f"tokenizer={config.tokenizer!r} has an empty vocabulary")
    mismatch = tokenizer_mismatch(config.tokenizer, config.teacher)
    if mismatch:
        raise ConfigError(mismatch)


def check_distributed(context: Preflight) -> None:
    """Ranks, nodes and the global batch fit together; the rendezvous endpoint is HOST:PORT."""
    student = context.config.student
    distributed = student.distributed
    if distributed.node_rank >= distributed.nnodes:
        raise ConfigError(f"student.distributed.node_rank={distributed.node_rank} "
                          f"must be below nnodes={distributed.nnodes}")
    world_size = distributed.nproc_per_node * distributed.nnodes
    if student.batch_size % (world_size * student.grad_accum):
        raise ConfigError(f"student.batch_size={student.batch_size} must be divisible by ranks x grad_accum = "
                          f"{world_size} x {student.grad_accum}")
    host, _, port = distributed.rdzv_endpoint.rpartition(":")
    if world_size > 1 and (not host or not port.isdigit() or not 0 < int(port) < 65536):
        raise ConfigError(f"student.distributed.rdzv_endpoint={distributed.rdzv_endpoint!r} must be HOST:PORT")


def check_student(context: Preflight) -> None:
    """`student.init_from` is a model folder (or a hub id) whose tokenizer and embedding take the run's token ids;
    `student.prune` keeps no more blocks than the teacher has."""
    from kdflow.tasks.common.hub_access import check_hub_model
    from kdflow.tasks.common.model_configs import student_vocab_problem, tokenizer_vocab
    from kdflow.tasks.common.model_files import model_folder_problem, resolve_model_files

    config = context.config
    prune = config.student.prune
    if prune is not None:
        shape = context.teacher_shape
        if shape.layers is not None and prune.layers > shape.layers:
            raise ConfigError(f"student.prune.layers={prune.layers}: the teacher has {shape.layers} blocks to keep "
                              f"from (read from {shape.source})")
        from kdflow.tasks.student.prune_width import width_problem

        problem = width_problem(prune.intermediate_size, prune.key_value_heads, mlp=shape.mlp_width,
                                heads=shape.heads, kv_heads=shape.key_value_heads, experts=shape.experts)
        if problem:
            raise ConfigError(f"{problem} (read from {shape.source})")
    init_from = config.student.init_from
    if init_from is None:
        return
    try:
        source = resolve_model_files(init_from)
    except ConfigError as error:
        raise ConfigError(f"student.init_from={init_from!r}: {error}") from None
    problem = model_folder_problem(source) if os.path.exists(source) else None  # a hub id: fetched when it loads
    if problem:
        raise ConfigError(f"student.init_from={init_from!r} is not a model: {problem}")
    if not os.path.exists(source):
        check_hub_model("student.init_from", init_from)
    run_vocab = (tokenizer_vocab(config.teacher.model, config.teacher.gguf_file, config.teacher.revision)
                 if context.tokenizer_from_teacher else tokenizer_vocab(config.tokenizer))
    problem = student_vocab_problem(init_from, run_vocab)
    if problem:
        raise ConfigError(problem)
    if config.student.architecture != type(config.student.architecture)():
        context.warn(f"student.architecture is ignored: the student is {init_from!r} (student.init_from)")


# Above this peak learning rate a pretrained student is warned of (at 1e-3, the default for random students, the
# demo teacher's own weights as a student went from a held-out KL of 0.001 to 0.59 in 6 steps).
PRETRAINED_LR_WARNING = 3e-4
# A student pruned from the teacher must heal what the cut broke, so it takes a higher peak than a pretrained one
# (the demo's trains at 5e-4), but not a random student's (3e-3 in the demo's --quick budget).
PRUNED_LR_WARNING = 1e-3


def check_schedule(context: Preflight) -> None:
    """Warnings: the warmup takes the whole run (`--set student.steps=10` under the default 20-step warmup); a
    pretrained (`init_from`) or pruned (`prune`) student under a learning rate meant for random weights."""
    student = context.config.student
    if student.init_from and student.lr > PRETRAINED_LR_WARNING:
        context.warn(f"student.lr={student.lr:g} with student.init_from: a peak meant for random weights can undo "
                     f"what a pretrained student knows in a few steps; from pretrained weights 1e-5 to 1e-4 is usual")
    if student.prune is not None and student.lr > PRUNED_LR_WARNING:
        context.warn(f"student.lr={student.lr:g} with student.prune: a peak meant for random weights can undo the "
                     f"teacher's blocks the student starts from; a pruned student heals at 1e-4 to "
                     f"{PRUNED_LR_WARNING:g}")
    if student.warmup_steps >= student.steps:
        context.warn(f"student.warmup_steps={student.warmup_steps} is not below student.steps={student.steps}: the "
                     f"learning rate rises for the whole run, to {student.steps / student.warmup_steps:.0%} of "
                     "student.lr at the last step, and never decays; lower warmup_steps")


def check_disk(context: Preflight) -> None:
    """A warning, with the numbers, when the run may write more than the run root's disk has free."""
    from kdflow.schemas.disk_space import free_bytes
    from kdflow.schemas.store_bytes import estimated_bytes_per_position
    from kdflow.tasks.corpus.dataset_files import compression_of, file_builder

    if not context.run_root.is_local:
        return
    config, stages = context.config, context.stages
    tokens_done = context.complete(TOKENS_DIR)
    tokens = tokens_done.get("tokens") if tokens_done else None
    source_bytes = None
    try:
        files = file_builder(config.dataset)
        if files is not None:
            # a compressed file holds about 4 times its bytes of text
            source_bytes = sum(os.path.getsize(f) * (4 if compression_of(f) else 1)
                               for f in files[1] if "://" not in f and os.path.isfile(f))
    except ConfigError:
        pass
    if tokens is None:
        tokens = config.dataset.max_tokens or (source_bytes // 4 if source_bytes else None)  # ~4 bytes a token
    parts: dict[str, int] = {}
    if "materialise" in stages and source_bytes and context.complete(CORPUS_DIR) is None:
        parts["corpus"] = source_bytes // 2  # zstd Parquet
    if tokens and "tokenise" in stages and tokens_done is None:
        parts["tokens"] = tokens * 4
    if tokens and "precompute" in stages:
        parts["top-K"] = int(tokens * estimated_bytes_per_position(config.precompute))
    student = _student_bytes(context) if "train" in stages else None
    if student:
        parts["student"] = student
    needed, free = sum(parts.values()), free_bytes(context.run_root.root)
    if free is not None and needed > free:
        listed = ", ".join(f"{name} {size / 1e9:.2f}" for name, size in parts.items())
        context.warn(f"the run may write about {needed / 1e9:.2f} GB under run_root={config.run_root!r} ({listed} GB) "
                     f"but only {free / 1e9:.2f} GB are free there")


def _student_bytes(context: Preflight) -> int | None:
    """fp32 weights + AdamW moments per checkpoint, keep_checkpoints + 1 of them at once, plus final/. The student's
    size: the teacher's with the pruned blocks and widths (`student.prune`), the model it starts from
    (`student.init_from`; None when neither's config is at hand), or `student.architecture`."""
    from kdflow.tasks.common.model_configs import ModelShape, model_folder_shape

    student = context.config.student
    if student.prune is not None:
        prune = student.prune
        params = context.teacher_shape.parameters(prune.layers, prune.intermediate_size, prune.key_value_heads)
    elif student.init_from is not None:
        try:
            shape = model_folder_shape(student.init_from)
        except ConfigError:
            shape = None
        params = shape.parameters() if shape is not None else None
    else:
        arch = student.architecture
        vocab = (context.teacher_shape.vocab_size if context.tokenizer_from_teacher and "precompute" in context.stages
                 else None) or 50_000
        params = ModelShape(vocab, None, "student.architecture", arch.num_hidden_layers, arch.intermediate_size,
                            arch.num_attention_heads, arch.num_key_value_heads, hidden=arch.hidden_size,
                            tied=arch.tie_word_embeddings).parameters()
    return None if params is None else params * 4 * (3 * (student.keep_checkpoints + 1) + 1)


def check_devices(context: Preflight) -> None:
    """A `cuda` device asked for where there is none: the teacher's for precompute, the student's for train."""
    from kdflow.tasks.common.devices import cuda_unavailable, no_cuda_message

    config = context.config
    for stage, setting, value in (("precompute", "teacher.device", config.teacher.device),
                                  ("train", "student.device", config.student.device)):
        why = cuda_unavailable() if stage in context.stages and value.startswith("cuda") else None
        if why:
            raise ConfigError(no_cuda_message(setting, value, why))


# Every check, in the order they run, with the stages each applies to (none named: every stage). The last two, of
# what the run root already holds, live in kdflow.tasks.preflight_stores.
CHECKS: list[Check] = [
    Check("run_root", check_run_root),
    Check("dataset", check_dataset, frozenset({"materialise"})),
    Check("teacher", check_teacher, frozenset({"materialise", "tokenise", "precompute", "train"})),
    Check("tokenizer", check_tokenizer, frozenset({"materialise", "tokenise", "precompute", "train"})),
    Check("distributed", check_distributed, frozenset({"train"})),
    Check("student", check_student, frozenset({"train"})),
    Check("schedule", check_schedule, frozenset({"train"})),
    Check("disk", check_disk),
    Check("devices", check_devices, frozenset({"precompute", "train"})),
    Check("sources", check_sources, frozenset({"materialise", "tokenise", "precompute", "train"})),
    Check("imported", check_imported, frozenset({"materialise", "tokenise"})),
    Check("resume", check_resume, frozenset({"train"})),
    Check("train_inputs", check_train_inputs, frozenset({"train"})),
]
