"""Pre-flight checks of what the run root already holds, for the stages being run: with `--stages`, that a stage
left out has written what the chosen ones read (`check_stage_inputs`, which `kdflow run` calls); that the dataset's
files are as materialise read them into the corpus store (`sources`); and that a student's checkpoints can resume
with this config (`resume`, a check of `run_preflight` for train).

They read small files (`_complete.json`, `_sources.json`, folder names, the config saved beside the student) and
stat the dataset's files, hashing only one whose modification time moved at the same size, and say in one line
what the stage would say later: after Prefect started, or, for a student, after a re-tokenised corpus went
through the whole teacher pass. What only the stores can tell (the teacher's files, the tokenizer's ids), the
stage checks when it opens them.
"""

from __future__ import annotations

import os
from typing import Any

from kdflow.schemas.config import STAGES, KDFlowConfig
from kdflow.schemas.config_io import saved_config, setting_changes
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.fingerprints import student_resume_fields
from kdflow.schemas.layout import CORPUS_DIR, STUDENTS_DIR, TOKENS_DIR, TOPK_DIR, checkpoint_name
from kdflow.schemas.stage_settings import held_out_problem
from kdflow.schemas.storage import complete_checkpoint_steps
from kdflow.tasks.preflight_context import Preflight, chosen_stages

# The stores each stage reads, by the stage that writes them.
READS_FROM = {"tokenise": ("materialise",), "precompute": ("tokenise",), "train": ("tokenise", "precompute")}
_OUTPUT = {"materialise": ("the corpus store", CORPUS_DIR), "tokenise": ("the token store", TOKENS_DIR),
           "precompute": ("a top-K store", TOPK_DIR)}


def check_stage_inputs(config: KDFlowConfig, stages: list[str] | str | None) -> None:
    """`--stages` leaving out a stage whose store a chosen stage reads: that store must be there already, else
    one ConfigError line, before Prefect starts (the stage would fail there, after its server's start). A local
    run root only: an object store's first read tells (the stage checks again either way)."""
    context = Preflight(config, chosen_stages(stages))
    if not context.run_root.is_local:
        return
    chosen = [stage for stage in STAGES if stage in context.stages]
    for stage in chosen:
        for before in READS_FROM.get(stage, ()):
            what, folder = _OUTPUT[before]
            state = None if before in context.stages else _output_problem(context, before, folder)
            if state is None:
                continue
            raise ConfigError(f"--stages {','.join(chosen)}: {stage} reads {what}, which {before} writes, and "
                              f"{os.path.join(context.run_root.root, folder)} {state}: add {before} to --stages "
                              "(or leave --stages out to run every stage)")


def _output_problem(context: Preflight, before: str, folder: str) -> str | None:
    """Why the store `before` writes cannot be read as this config's: none there ('holds none', 'is not
    complete'), or a complete corpus or token store that another dataset, seq_len or shard size made (its
    fingerprint is not this config's): 'was made with SETTING OLD, now NEW', from the config saved beside it."""
    from kdflow.schemas.fingerprints import corpus_fingerprint, tokens_fingerprint_of

    if folder == TOPK_DIR:  # one folder per store (its tag), which says what made it; training names the one it wants
        path = os.path.join(context.run_root.root, TOPK_DIR)
        return None if os.path.isdir(path) and any(not n.startswith(".") for n in os.listdir(path)) else "holds none"
    done = context.complete(folder)
    if done is None:
        return "is not complete"
    if (done.get("extra") or {}).get("imported_from"):
        return None  # `kdflow store import` wrote it from a capture: no dataset of any config made it
    config = context.config
    corpus = corpus_fingerprint(config)
    if before == "materialise":
        expected = corpus
    elif (done.get("extra") or {}).get("tokenizer_fingerprint"):
        expected = tokens_fingerprint_of(corpus, done["extra"]["tokenizer_fingerprint"], config.seq_len,
                                         config.precompute.sequences_per_shard)
    else:
        return None  # a token store that does not record its tokenizer: the stage says so
    if done.get("fingerprint") == expected:
        return None
    try:
        saved = saved_config(context.run_root, context.run_root.path(folder))
        changes = _input_changes(saved, config, tokens=before == "tokenise")
    except Exception:  # noqa: BLE001 - no config beside it (an older store): the fingerprints alone
        changes = []
    return "was made with " + "; ".join(changes) if changes else "was made from another dataset, seq_len or shard size"


def _input_changes(saved: KDFlowConfig, config: KDFlowConfig, *, tokens: bool) -> list[str]:
    """`SETTING OLD, now NEW` for the dataset's settings (and, `tokens`, seq_len and the shard size) that differ."""
    was, now = saved.dataset.model_dump(mode="json"), config.dataset.model_dump(mode="json")
    pairs: list[tuple[str, Any, Any]] = [(f"dataset.{key}", value, now.get(key)) for key, value in was.items()]
    if tokens:
        pairs += [("seq_len", saved.seq_len, config.seq_len),
                  ("precompute.sequences_per_shard", saved.precompute.sequences_per_shard,
                   config.precompute.sequences_per_shard)]
    return setting_changes(pairs)


def check_sources(context: Preflight) -> None:
    """A finished corpus store of this config's fingerprint was made from the dataset's files as they were
    (`corpus/_sources.json`): a file edited, added or removed since is named, not silently left out (refused where
    the run materialises; a warning where its stages only read the store)."""
    from kdflow.schemas.dataset_record import read_dataset_record
    from kdflow.schemas.fingerprints import corpus_fingerprint
    from kdflow.tasks.corpus.dataset_changes import changed_files_refusal, changes, shown_changes

    run_root = context.run_root
    store = run_root.path(CORPUS_DIR)
    fingerprint = corpus_fingerprint(context.config)
    try:
        recorded = read_dataset_record(run_root, store, fingerprint)
    except Exception:  # noqa: BLE001 - a run root not reachable yet: materialise checks again
        return
    done = context.complete(CORPUS_DIR)
    if done is None or done.get("fingerprint") != fingerprint:
        return  # unfinished: nothing was made from it, and materialise starts it again after a change (it says so)
    found = changes(recorded, context.config.dataset) if recorded is not None else []
    if found and "materialise" not in context.stages:  # the stages after it read the store as it was made
        context.warn(f"the dataset's files changed since materialise read them into {run_root.display(store)} "
                     f"({shown_changes(found)}); this run's stages use the corpus store as it was made, and a run "
                     "with materialise will refuse the change")
    elif found:
        raise ConfigError(changed_files_refusal(found, run_root.display(store)))


def check_imported(context: Preflight) -> None:
    """A run root whose token store `kdflow store import` wrote takes no corpus: said before materialise runs."""
    from kdflow.tasks.corpus.tokenise import imported_tokens_problem

    try:
        problem = imported_tokens_problem(context.run_root)
    except Exception:  # noqa: BLE001 - a run root not reachable yet: tokenise checks again
        return
    if problem is not None:
        raise ConfigError(problem)


def check_resume(context: Preflight) -> None:
    """A student with a complete checkpoint resumes only with the settings its fingerprint holds: a change to
    one of them (the student's resume settings, the dataset, `seq_len`, the shard size; the top-K store's
    when precompute runs too) is refused now rather than by the training, after the stages before it."""
    run_root, name = context.run_root, context.config.student.name
    folder = run_root.path(STUDENTS_DIR, name)
    try:
        steps = complete_checkpoint_steps(run_root, folder)
        saved = saved_config(run_root, folder)
    except Exception:  # noqa: BLE001 - no student yet, no config beside it, one of another kdflow: training tells
        return
    changes = resume_changes(saved, context.config, topk="precompute" in context.stages) if steps else []
    if changes:
        shown = run_root.display(folder)
        raise ConfigError(f"student.name={name!r}: its checkpoints (up to {checkpoint_name(max(steps))}) were "
                          f"trained with {'; '.join(changes)}, so they cannot resume: choose another student.name, "
                          f"or delete {shown}")


def resume_changes(saved: KDFlowConfig, config: KDFlowConfig, *, topk: bool) -> list[str]:
    """`SETTING OLD, now NEW` for each setting that feeds a checkpoint's fingerprint and differs (`topk`: also
    the top-K store's settings, which decide the store trained on when precompute makes it)."""
    was, now = student_resume_fields(saved.student), student_resume_fields(config.student)
    student = [(f"student.{key}", value, now.get(key)) for key, value in was.items()]
    store: list[tuple[str, Any, Any]] = []
    if topk and saved.student.topk_tag is None and config.student.topk_tag is None:
        store = [("precompute.top_k", saved.precompute.top_k, config.precompute.top_k),
                 ("precompute.store", saved.precompute.store.model_dump(mode="json"),
                  config.precompute.store.model_dump(mode="json"))]
    return setting_changes(student) + _input_changes(saved, config, tokens=True) + setting_changes(store)


def check_train_inputs(context: Preflight) -> None:
    """Training on a token store this run does not make again (no tokenise in `--stages`): it leaves a shard to
    train on beside the held-out ones (else `--stages precompute,train` ran the whole teacher pass first); and with
    no stage before training, the top-K store it would train on is there (`student.topk_tag`, or one made for this
    config's teacher, K and store settings). Said now rather than by the training inside Prefect."""
    if "tokenise" in context.stages:
        return  # the token store is made again first: the pipeline checks right after tokenise
    done = context.complete(TOKENS_DIR)
    if done is None:
        return  # no finished token store (or one of another kdflow): training names what is missing
    config, run_root = context.config, context.run_root
    problem = held_out_problem(config.student.eval_shards, int(done.get("shards", 0)), int(done.get("rows", 0)))
    if problem is not None:
        raise ConfigError(problem)
    if context.stages & {"materialise", "precompute"}:
        return  # the top-K store is (re)made first: training checks it after precompute
    from kdflow.schemas.commits import list_commits, read_commit, read_complete, stage_dir
    from kdflow.schemas.stage_settings import training_settings
    from kdflow.schemas.store_info import filled_by, read_store_info
    from kdflow.tasks.student.data import find_topk_store, verify_pair

    tokens = stage_dir(run_root, "tokens")
    first = read_commit(run_root, tokens, "tokens", 0)
    if first is None:
        return
    settings = training_settings(config)
    try:  # the store training would take, and its first shard against this config (K, seq_len, token shard)
        store = find_topk_store(run_root, settings, str(done.get("fingerprint", "")), first)
        info = read_store_info(run_root, store)
        verify_pair(run_root, settings.data, first, read_commit(run_root, store, "topk", 0), tokens, store,
                    filled_by(info))
    except StoreError as error:
        raise ConfigError(str(error)) from None
    if read_complete(run_root, store) is None:  # nothing in these stages finishes it
        made = len(list_commits(run_root, store, "topk", store.rsplit("/", 1)[-1]))
        again = ("run the `kdflow store import` that made it again" if (info is not None and (
            info.model_extra or {}).get("imported")) else "add precompute to --stages")
        raise ConfigError(f"top-K store {run_root.display(store)} is unfinished ({made}/{done.get('shards', '?')} "
                          f"shards): {again} to finish it before training on it")
