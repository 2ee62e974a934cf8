"""`kdflow store import`: a top-K logit dataset -> a token store and a top-K store in the run root (no Prefect).

Every row of the source is checked first (kdflow.tasks.teacher.logit_dataset); nothing is written before all
pass. Then the token store (`tokens/`, the fingerprint this config expects, so training opens it as its own) and
the top-K store (`topk/TAG/`, in the config's store format: v2 with its codec or v1) are written shard by shard
with the commit protocol of every stage: data file, then commit record, then `_complete.json`. A rerun skips the
committed shards, so a killed import resumes. The store's teacher fingerprint hashes the teacher's name and the
source's arrays, so another source is another TAG; `_store.json` records the import under `imported`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kdflow.schemas.codec import encode
from kdflow.schemas.commits import (CommitRecord, StageComplete, TokensCompleteInfo, TokenShardInfo, TopkShardInfo,
                                    check_commits, commit_or_remove, list_commits, read_complete, stage_dir,
                                    write_complete)
from kdflow.schemas.config import PrecomputeConfig
from kdflow.schemas.config_hash import section_hash
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.fingerprints import tokenizer_fingerprint
from kdflow.schemas.layout import CONFIG_FILE, data_file_name
from kdflow.schemas.logit_layouts import LogitLayout, resolve_layout
from kdflow.schemas.shards import (read_token_shard, token_batch, token_shard_writer, topk_batch, topk_shard_writer,
                                   topk_v2_shard_writer)
from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.schemas.store_info import TopkStoreInfo, store_format, write_store_info
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.teacher.logit_dataset import (check_columns, check_text, computed_tail, digest_rows, new_digest,
                                               read_logit_dataset, logit_rows)
from kdflow.tasks.teacher.store_codec import store_codec

logger = logging.getLogger("kdflow.import")

TAIL_COMPUTED = "computed"  # _store.json `imported.tail`: the source had no tail, 1 - sum(p) was stored
TAIL_SOURCE = "source"


def _check_targets(pre: PrecomputeConfig) -> None:
    if pre.targets != "topk":
        raise ConfigError(f"precompute.targets={pre.targets}: an import makes top-K stores only; "
                          "set precompute.targets: topk")


def import_store(run_root: RunRoot, settings: TeacherPassSettings, source: str, layout_name: str | LogitLayout,
                 teacher_name: str, tokenizer: Any = None) -> dict[str, Any]:
    """Import `source` (layout `layout_name`: a built-in's name, a YAML file, or a declared layout) as the targets
    of teacher `teacher_name`; -> a summary with the TAG. `tokenizer`: the run's, already loaded (else loaded
    here)."""
    pre = settings.precompute
    _check_targets(pre)
    if not teacher_name.strip():
        raise ConfigError("the imported teacher needs a name (--teacher)")
    layout = resolve_layout(layout_name)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.teacher, settings.tokenizer)
    vocab_size, seq_len, top_k, per_shard = len(tokenizer), settings.seq_len, pre.top_k, pre.sequences_per_shard
    table = read_logit_dataset(source)
    check_columns(table, layout, source)
    if table.num_rows == 0:
        raise StoreError(f"import source {source!r} has no rows")
    ranges = [(start, min(start + per_shard, table.num_rows)) for start in range(0, table.num_rows, per_shard)]

    def rows_of(start: int, stop: int) -> Any:
        return logit_rows(table, layout, start, stop, seq_len, top_k, vocab_size)

    digest, has_tail = new_digest(), None  # pass 1: every row checked before anything is written
    digest.update(f"{layout.name}\n".encode())
    for start, stop in ranges:
        rows = rows_of(start, stop)
        check_text(rows, tokenizer, start, layout)
        has_tail = rows.tail is not None
        digest_rows(digest, rows)

    tok_fp = tokenizer_fingerprint(tokenizer)
    tokens_fp = settings.tokens_fingerprint(tok_fp)
    teacher_fp = section_hash("imported-teacher", teacher_name, digest.hexdigest())
    tag = settings.topk_fingerprint(teacher_fp, tokens_fp)
    run_root.ensure_writable()
    tokens_done = _write_tokens(run_root, settings, ranges, rows_of, tokens_fp, tok_fp, vocab_size, source)
    store = stage_dir(run_root, "topk", tag)
    remove_stale_temp_files(run_root, store)
    codec = store_codec(settings, run_root, store, tokens_done, vocab_size)
    imported = {"source": source, "layout": layout.name, "teacher": teacher_name, "rows": table.num_rows,
                "tail": TAIL_SOURCE if has_tail else TAIL_COMPUTED}
    run_root.write_bytes_atomic(f"{store}/{CONFIG_FILE}", settings.resolved_config.encode())
    v2 = {} if codec is None else {"format": "v2", "codec": codec.settings()}
    write_store_info(run_root, store, TopkStoreInfo(
        tag=tag, teacher_fingerprint=teacher_fp, tokens_fingerprint=tokens_fp,
        teacher={"imported": teacher_name}, teacher_identity={"imported": teacher_name, "source": source},
        top_k=top_k, logprobs_dtype=pre.logprobs_dtype, seq_len=seq_len, store=store_format(pre),
        imported=imported, **v2))
    info = TopkShardInfo(teacher_fingerprint=teacher_fp, tokens_fingerprint=tokens_fp, top_k=top_k, seq_len=seq_len,
                         logprobs_dtype=pre.logprobs_dtype, vocab_size=vocab_size,
                         **({} if codec is None else {"format": "v2", "codec": codec.settings()}))
    token_records = list_commits(run_root, stage_dir(run_root, "tokens"), "tokens", tokens_fp)
    committed = list_commits(run_root, store, "topk", tag)
    written = 0
    for shard_id, (start, stop) in enumerate(ranges):
        if shard_id in committed:
            continue
        rows = rows_of(start, stop)
        tail = rows.tail if rows.tail is not None else computed_tail(rows.logprobs)
        name = data_file_name("topk", shard_id)
        path = f"{store}/{name}"
        opened = (topk_shard_writer(run_root, path, seq_len, top_k, pre.logprobs_dtype) if codec is None
                  else topk_v2_shard_writer(run_root, path, codec))
        with opened as writer:
            if codec is None:
                writer.write(*topk_batch(rows.ids, rows.logprobs, pre.logprobs_dtype))
            else:
                writer.write_batch(encode(codec, rows.ids, rows.logprobs, tail))
        commit_or_remove(run_root, store, CommitRecord(
            stage="topk", shard_id=shard_id, data_file=name, rows=stop - start, tokens=(stop - start) * seq_len,
            bytes=writer.sink.nbytes, sha256=writer.sink.sha256, input_sha256=token_records[shard_id].sha256,
            fingerprint=tag, extra=info), exclusive=True)
        written += 1
    from kdflow.tasks.teacher.precompute import complete_if_done  # the teacher pass's own completion

    complete_if_done(run_root, store, tag, tokens_done)
    logger.info("import: %d rows of %s as top-K store %s (%d shards written, %d already committed)",
                table.num_rows, source, tag, written, len(ranges) - written)
    return {"tag": tag, "store": run_root.display(store), "rows": table.num_rows, "shards": len(ranges),
            "written": written, "skipped": len(ranges) - written, "teacher_fingerprint": teacher_fp,
            "tail": imported["tail"], "complete": read_complete(run_root, store) is not None}


def _write_tokens(run_root: RunRoot, settings: TeacherPassSettings, ranges: list[tuple[int, int]], rows_of: Any,
                  tokens_fp: str, tok_fp: str, vocab_size: int, source: str) -> StageComplete:
    """tokens/: the source's token ids, shard by shard; committed shards are kept if they hold the same ids."""
    store = stage_dir(run_root, "tokens")
    shown, seq_len = run_root.display(store), settings.seq_len
    done = read_complete(run_root, store)
    if done is not None and done.fingerprint != tokens_fp:
        raise StoreError(f"token store {shown} was made for another config (fingerprint {done.fingerprint}); "
                         "import into a new run root")
    remove_stale_temp_files(run_root, store)
    checks = check_commits(run_root, store, "tokens", tokens_fp)
    for shard_id, (start, stop) in enumerate(ranges):
        input_ids = rows_of(start, stop).input_ids
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
            stage="tokens", shard_id=shard_id, data_file=name, rows=stop - start, tokens=(stop - start) * seq_len,
            bytes=writer.sink.nbytes, sha256=writer.sink.sha256, fingerprint=tokens_fp,
            extra=TokenShardInfo(seq_len=seq_len, tokenizer_fingerprint=tok_fp, vocab_size=vocab_size)))
    rows = ranges[-1][1]
    complete = StageComplete(stage="tokens", shards=len(ranges), rows=rows, tokens=rows * seq_len,
                             fingerprint=tokens_fp,
                             extra=TokensCompleteInfo(dropped_tokens=0, seq_len=seq_len, tokenizer_fingerprint=tok_fp,
                                                      corpus_fingerprint=settings.corpus_fingerprint,
                                                      vocab_size=vocab_size, imported_from=source))
    if done is None or done.shards != complete.shards:
        write_complete(run_root, store, complete)
        return complete
    return done
