"""`kdflow store import`: a top-K logit dataset -> a token store and a top-K store in the run root (no Prefect).

One pass over the source (kdflow.tasks.teacher.logit_staging) reads it batch by batch, checks every row once, packs
the rows (any length) into `seq_len` rows as tokenise packs documents (kdflow.tasks.teacher.logit_packing) and
stages them under `_imports/KEY/`, where no reader looks; a bad row stops it with one line naming row and column and
nothing visible. Only then are the token store (`tokens/`, the fingerprint this config expects, so training opens
it as its own) and the top-K store (`topk/TAG/`, in the config's store format: v2 with its codec or v1) written
from the staged shards with the commit protocol of every stage: data file, then commit record, then
`_complete.json`; the staging folder goes last. A rerun keeps the staged shards and the committed ones, so an import
killed at any moment resumes. The store's teacher fingerprint hashes the teacher's name, the layout and the packed
arrays, so another source's contents are another TAG; `_store.json` records the import under `imported`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from kdflow.schemas.codec import encode, kept_mass_tail
from kdflow.schemas.commits import (CommitRecord, StageComplete, TokensCompleteInfo, TokenShardInfo, TopkShardInfo,
                                    check_commits, commit_or_remove, list_commits, read_complete, stage_dir,
                                    write_complete)
from kdflow.schemas.config import PrecomputeConfig
from kdflow.schemas.config_hash import section_hash
from kdflow.schemas.disk_space import DiskFull
from kdflow.schemas.errors import ConfigError, StoreError, StoreUnreachable
from kdflow.schemas.fingerprints import tokenizer_fingerprint
from kdflow.schemas.layout import CONFIG_FILE, TOPK_DIR, data_file_name
from kdflow.schemas.logit_layouts import LogitLayout, resolve_layout
from kdflow.schemas.shards import (read_token_shard, token_batch, token_shard_writer, topk_batch, topk_shard_writer,
                                   topk_v2_shard_writer)
from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.schemas.store_info import TopkStoreInfo, read_store_info, store_format, topk_tags, write_store_info
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.teacher.logit_reader import source_files
from kdflow.tasks.teacher.logit_staging import (Checked, Packing, claim_staging, read_staged, remove_abandoned_staging,
                                               row_reader, stage_source, staging_dir)
from kdflow.tasks.teacher.source_rows import FULL, TOP_K
from kdflow.tasks.teacher.store_codec import store_codec

logger = logging.getLogger("kdflow.import")

TAIL_COMPUTED = "computed"  # _store.json `imported.tail`: the source had no tail, 1 - sum(p) was stored
TAIL_SOURCE = "source"
TAIL_NONE = "none"  # renormalised over the K (normalisation top_k): no tail is stored (it said "computed")


def _check_targets(pre: PrecomputeConfig) -> None:
    if pre.targets != "topk":
        raise ConfigError(f"precompute.targets={pre.targets}: an import makes top-K stores only; "
                          "set precompute.targets: topk")


def import_store(run_root: RunRoot, settings: TeacherPassSettings, source: str, layout_name: str | LogitLayout,
                 teacher_name: str, tokenizer: Any = None, distillkit_settings: str | None = None) -> dict[str, Any]:
    """Import `source` (layout `layout_name`: a built-in's name, a YAML file, or a declared layout) as the targets
    of teacher `teacher_name`; -> a summary with the TAG. `tokenizer`: the run's, already loaded (else loaded
    here). `distillkit_settings`: a DistillKit capture's compressor settings file, where the capture lacks one."""
    pre = settings.precompute
    _check_targets(pre)
    if not teacher_name.strip():
        raise ConfigError("the imported teacher needs a name (--teacher)")
    layout = resolve_layout(layout_name)
    files = source_files(source)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.teacher, settings.tokenizer)
    vocab_size, seq_len, top_k = len(tokenizer), settings.seq_len, pre.top_k
    packing = Packing(seq_len, top_k, vocab_size, pre.sequences_per_shard)
    run_root.ensure_writable()
    read_rows, decoder = row_reader(layout, files, distillkit_settings, top_k)  # settings problems: before anything
    tok_fp = tokenizer_fingerprint(tokenizer)
    tokens_fp = settings.tokens_fingerprint(tok_fp)
    _check_token_store(run_root, tokens_fp)  # before a pass over the source, which may be large
    staging = staging_dir(run_root, files, layout, packing, decoder)
    key = staging.rsplit("/", 1)[-1]  # the source files as they are, the layout and the packing
    if (finished := _finished_import(run_root, settings, key, teacher_name, tokens_fp)) is not None:
        return finished  # this source imported already, as this config stores it: nothing is read again
    for folder in remove_abandoned_staging(run_root, keep=staging):
        logger.info("import: removed %s, the staged work of a stopped import of another source", folder)
        _remove_unfinished_store(run_root, folder.rsplit("/", 1)[-1])
    claim_staging(run_root, staging)
    try:
        checked = stage_source(run_root, staging, files, layout, packing, tokenizer, read_rows)  # every row passed
        _check_staged(checked, source, pre.store.format)
    except (DiskFull, StoreUnreachable):  # not the source's fault: a rerun goes on from the staged shards
        raise
    except (StoreError, ConfigError):  # the source's rows: a rerun would read them again and fail alike
        _drop_staging(run_root, staging)
        raise
    if checked.normalisation == FULL and not checked.has_tail and checked.whole_mass == checked.targets \
            and top_k < vocab_size:
        logger.warning("import: the kept probabilities sum to 1 at every one of the %d positions with a target; if "
                       "the source renormalised them over the K, import it with --kind renormalised (as imported, "
                       "the store says the teacher put no mass outside the K ids)", checked.targets)
    teacher_fp = section_hash("imported-teacher", teacher_name, checked.digest)
    tag = settings.topk_fingerprint(teacher_fp, tokens_fp)
    tokens_done = _write_tokens(run_root, settings, staging, checked, tokens_fp, tok_fp, vocab_size, source)
    store = stage_dir(run_root, "topk", tag)
    remove_stale_temp_files(run_root, store)
    # the store format's new keywords only where this source needs them (a masked or top_k store)
    extra = {**({"masked": True} if checked.masked else {}), **({"short": True} if checked.short else {}),
             **({"normalisation": checked.normalisation} if checked.normalisation != FULL else {})}
    codec = store_codec(settings, run_root, store, tokens_done, vocab_size, **extra)
    imported = {"source": source, "key": key, "layout": layout.name, "teacher": teacher_name, "rows": checked.rows,
                "positions": checked.positions, "targets": checked.targets, "packed_rows": checked.packed_rows,
                "dropped_positions": checked.dropped_positions, "normalisation": checked.normalisation,
                "tail": TAIL_SOURCE if checked.has_tail else TAIL_NONE if checked.normalisation == TOP_K
                else TAIL_COMPUTED}
    run_root.write_bytes_atomic(f"{store}/{CONFIG_FILE}", settings.resolved_config.encode())
    v2 = {} if codec is None else {"format": "v2", "codec": codec.settings()}
    write_store_info(run_root, store, TopkStoreInfo(
        tag=tag, teacher_fingerprint=teacher_fp, tokens_fingerprint=tokens_fp,
        teacher={"imported": teacher_name}, teacher_identity={"imported": teacher_name, "source": source},
        top_k=top_k, logprobs_dtype=pre.logprobs_dtype, seq_len=seq_len, store=store_format(pre),
        imported=imported, **v2))
    info = TopkShardInfo(teacher_fingerprint=teacher_fp, tokens_fingerprint=tokens_fp, top_k=top_k, seq_len=seq_len,
                         logprobs_dtype=pre.logprobs_dtype, vocab_size=vocab_size, **v2)
    token_records = list_commits(run_root, stage_dir(run_root, "tokens"), "tokens", tokens_fp)
    committed = list_commits(run_root, store, "topk", tag)
    written = 0
    for staged in checked.shards:
        if staged.shard_id in committed:
            continue
        packed = read_staged(run_root, staging, staged)
        name = data_file_name("topk", staged.shard_id)
        path = f"{store}/{name}"
        opened = (topk_shard_writer(run_root, path, seq_len, top_k, pre.logprobs_dtype) if codec is None
                  else topk_v2_shard_writer(run_root, path, codec))
        with opened as writer:
            if codec is None:
                writer.write(*topk_batch(packed.ids, packed.logprobs, pre.logprobs_dtype))
            else:
                tail = packed.tail if packed.tail is not None else kept_mass_tail(packed.logprobs)
                target = {"target": packed.target} if checked.masked else {}
                writer.write_batch(encode(codec, packed.ids, packed.logprobs, tail, **target))
        commit_or_remove(run_root, store, CommitRecord(
            stage="topk", shard_id=staged.shard_id, data_file=name, rows=staged.rows, tokens=staged.rows * seq_len,
            bytes=writer.sink.nbytes, sha256=writer.sink.sha256, input_sha256=token_records[staged.shard_id].sha256,
            fingerprint=tag, extra=info), exclusive=True)
        written += 1
    from kdflow.tasks.teacher.precompute import complete_if_done  # the teacher pass's own completion

    complete_if_done(run_root, store, tag, tokens_done)
    complete = read_complete(run_root, store) is not None
    if complete:  # the staged shards are in the stores now
        _drop_staging(run_root, staging)
    shards = len(checked.shards)
    logger.info("import: %d rows (%d positions, %d with a target) of %s packed into %d rows of %d as top-K store %s "
                "(%d shards written, %d already committed, %d positions dropped)", checked.rows, checked.positions,
                checked.targets, source, checked.packed_rows, seq_len, tag, written, shards - written,
                checked.dropped_positions)
    return {"tag": tag, "store": run_root.display(store), "rows": checked.rows, "shards": shards,
            "written": written, "skipped": shards - written, "teacher_fingerprint": teacher_fp,
            "tail": imported["tail"], "complete": complete, "positions": checked.positions,
            "targets": checked.targets, "packed_rows": checked.packed_rows,
            "dropped_positions": checked.dropped_positions, "staged_reused": checked.reused, "masked": checked.masked,
            "normalisation": checked.normalisation}


def _imported_stores(run_root: RunRoot) -> Iterator[tuple[str, str, TopkStoreInfo, dict[str, Any]]]:
    """(tag, store folder, store info, its `imported` record) of every top-K store an import wrote."""
    for tag in topk_tags(run_root) if run_root.exists(run_root.path(TOPK_DIR)) else []:
        store = stage_dir(run_root, "topk", tag)
        info = read_store_info(run_root, store)
        imported = (info.model_extra or {}).get("imported") if info is not None else None
        if isinstance(imported, dict):
            yield tag, store, info, imported


def _remove_unfinished_store(run_root: RunRoot, key: str) -> None:
    """The top-K store a stopped import had begun to write from staging folder `key`, now removed: nothing can
    finish it any more (its TAG hashes the staged arrays), so it goes rather than stay `in progress` for good."""
    for _, store, _, imported in _imported_stores(run_root):
        if imported.get("key") == key and read_complete(run_root, store) is None:
            with contextlib.suppress(FileNotFoundError):
                run_root.fs.rm(store, recursive=True)
            logger.warning("import: removed top-K store %s, which that stopped import had begun and no import can "
                           "finish now", run_root.display(store))


def _drop_staging(run_root: RunRoot, staging: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        run_root.fs.rm(staging, recursive=True)
    if run_root.is_local:  # an empty _imports/ left after every import (object stores have no empty folders)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(staging))


def _check_staged(checked: Checked, source: str, store_format: str) -> None:
    if checked.targets == 0:
        raise StoreError(f"import source {source!r} has no position with a teacher target (each is masked, or its "
                         "values are all -inf): nothing to train on")
    if checked.masked and store_format == "v1":  # v1 shards have no place for the mask: never drop it silently
        raise ConfigError(f"import source {source!r} has positions without a teacher target, which only the v2 store "
                          "format records; set precompute.store.format: v2")


def _finished_import(run_root: RunRoot, settings: TeacherPassSettings, key: str, teacher_name: str,
                     tokens_fp: str) -> dict[str, Any] | None:
    """The summary of a complete store that an earlier import of the same source files (names, sizes, times),
    layout and packing wrote under this teacher name and this config's store settings; None when there is none."""
    tokens_done = read_complete(run_root, stage_dir(run_root, "tokens"))
    if tokens_done is None or tokens_done.fingerprint != tokens_fp:
        return None
    for tag, store, info, imported in _imported_stores(run_root):
        if imported.get("key") != key or imported.get("teacher") != teacher_name:
            continue
        done = read_complete(run_root, store)
        if done is None or tag != settings.topk_fingerprint(info.teacher_fingerprint, tokens_fp):
            continue  # unfinished, or another store format of the same source
        logger.info("import: %s was imported already as top-K store %s (%d shards): nothing to do",
                    imported.get("source"), tag, done.shards)
        return {"tag": tag, "store": run_root.display(store), "rows": imported.get("rows"), "shards": done.shards,
                "written": 0, "skipped": done.shards, "teacher_fingerprint": info.teacher_fingerprint,
                "tail": imported.get("tail"), "complete": True, "positions": imported.get("positions"),
                "targets": imported.get("targets"),
                "packed_rows": imported.get("packed_rows"), "dropped_positions": imported.get("dropped_positions"),
                "staged_reused": 0, "masked": bool((info.codec or {}).get("masked")),
                "normalisation": imported.get("normalisation")}
    return None


def _check_token_store(run_root: RunRoot, tokens_fp: str) -> StageComplete | None:
    """The run root's complete token store, refused when another config made it; None when there is none."""
    store = stage_dir(run_root, "tokens")
    done = read_complete(run_root, store)
    if done is not None and done.fingerprint != tokens_fp:
        raise StoreError(f"token store {run_root.display(store)} was made for another config (fingerprint "
                         f"{done.fingerprint}); import into a new run root")
    return done


def _write_tokens(run_root: RunRoot, settings: TeacherPassSettings, staging: str, checked: Checked, tokens_fp: str,
                  tok_fp: str, vocab_size: int, source: str) -> StageComplete:
    """tokens/: the packed rows' token ids, shard by shard (token shard i pairs with top-K shard i); committed
    shards are kept if they hold the same ids."""
    store = stage_dir(run_root, "tokens")
    shown, seq_len = run_root.display(store), settings.seq_len
    done = _check_token_store(run_root, tokens_fp)
    remove_stale_temp_files(run_root, store)
    checks = check_commits(run_root, store, "tokens", tokens_fp)
    for staged in checked.shards:
        shard_id = staged.shard_id
        input_ids = read_staged(run_root, staging, staged).tokens
        record = checks.get(shard_id, (None, ""))[0]
        if record is not None:
            if not np.array_equal(read_token_shard(run_root, f"{store}/{record.data_file}", seq_len), input_ids):
                raise StoreError(f"token store {shown} shard {shard_id} holds other sequences than the import "
                                 "source; import into a new run root")
            continue
        name = data_file_name("tokens", shard_id)
        with token_shard_writer(run_root, f"{store}/{name}", seq_len) as writer:
            writer.write(token_batch(input_ids))
        commit_or_remove(run_root, store, CommitRecord(
            stage="tokens", shard_id=shard_id, data_file=name, rows=staged.rows, tokens=staged.rows * seq_len,
            bytes=writer.sink.nbytes, sha256=writer.sink.sha256, fingerprint=tokens_fp,
            extra=TokenShardInfo(seq_len=seq_len, tokenizer_fingerprint=tok_fp, vocab_size=vocab_size)))
    rows = checked.packed_rows
    complete = StageComplete(stage="tokens", shards=len(checked.shards), rows=rows, tokens=rows * seq_len,
                             fingerprint=tokens_fp,
                             extra=TokensCompleteInfo(dropped_tokens=checked.dropped_positions, seq_len=seq_len,
                                                      tokenizer_fingerprint=tok_fp,
                                                      corpus_fingerprint=settings.corpus_fingerprint,
                                                      vocab_size=vocab_size, imported_from=source))
    if done is None or done.shards != complete.shards:
        write_complete(run_root, store, complete)
        return complete
    return done
