"""`kdflow bench scale`: how memory, start-up and requests grow with the run's size, on local disk and on S3.

A synthetic teacher (a Llama built from a config: the reference vocabulary of 196,608, a tiny body) makes
top-K stores (K=128) for runs of two sizes, once on local disk; each is then copied to moto's S3 server
(started here, on loopback) as well. Per size and store, in a fresh process each: training (peak RSS, the
data loader's wait as a fraction of step time, start-up: opening the stores), the checks of
`kdflow validate` and the lines of `kdflow status` (kdflow.tasks.validate and run_status: peak RSS, seconds),
and on S3 the requests each made, per shard. Then run roots holding
only commit records (thousands of shards, tiny data files) time `kdflow status` and a stage's start-up
(one listing and the records of the token and top-K stores) as the shard count grows.
Prints one JSON object per line; every line carries the load average. Needs moto (the test extra) for S3.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kdflow.bench import harness
from kdflow.bench.args import bench_parser
from kdflow.bench.harness import open_root, peak_rss_mib, run_fresh
from kdflow.bench.scale_stores import Moto, records_only, store_env

MODULE = "kdflow.bench.scale"  # the child of each measurement: python -m MODULE --child KIND TARGET


def emit(record: dict[str, Any], note: bool = False) -> None:
    """One JSON line; `note`: it describes the setting, no measurement (`harness.note`)."""
    (harness.note if note else harness.emit)({"bench": "scale", **record,
                                              "loadavg": [round(x, 2) for x in os.getloadavg()]})


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


# --- the child processes: each measures one thing and prints one JSON line ---------------------------------


def child(kind: str, target: str) -> dict[str, Any]:
    """Run one measured thing in this (fresh) process; -> its numbers (seconds after the imports), peak RSS."""
    out: dict[str, Any] = {}
    if kind == "train":
        from kdflow.schemas.config_io import load_config
        from kdflow.schemas.stage_settings import open_run_root, training_settings
        from kdflow.tasks.common.tokenizer import load_tokenizer
        from kdflow.tasks.student.data import open_distill_data
        from kdflow.tasks.student.train import train

        started = time.perf_counter()
        config = load_config(target)
        tokenizer = load_tokenizer(config.teacher, config.tokenizer)
        opened = time.perf_counter()
        # what training does first: list the stores, read the records
        open_distill_data(open_run_root(config), training_settings(config), tokenizer)
        out["startup_s"] = round(time.perf_counter() - opened, 3)
        summary = train(open_run_root(config), training_settings(config))
        out |= {"steps": summary["steps"], "train_rows": summary["train_rows"], "final_loss": summary["final_loss"]}
    elif kind == "plan":  # the teacher pass's start-up on a finished store: list, read records, nothing to do
        import torch

        from kdflow.schemas.config_io import load_config
        from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
        from kdflow.tasks.teacher.precompute import plan_pass

        started = time.perf_counter()
        config = load_config(target)
        plan = plan_pass(open_run_root(config), teacher_pass_settings(config), None, torch.device("cpu"))
        out |= {"startup_s": round(time.perf_counter() - started, 3), "todo": len(plan.todo)}
    elif kind in ("validate", "status"):  # the checks and lines `kdflow validate` and `kdflow status` print
        from kdflow.tasks.run_status import status_lines
        from kdflow.tasks.validate import store_reports

        started = time.perf_counter()
        run_root = open_root(target)
        if not run_root.exists(run_root.root):
            out |= {"exit_code": 1, "output_lines": 1}
        elif kind == "status":
            out |= {"exit_code": 0, "output_lines": len(list(status_lines(run_root)))}
        else:
            reports = list(store_reports(run_root))
            # validate prints a heading, a line per store, note and problem, and its verdict (or "no stores")
            lines = 1 + sum(1 + len(r.notes) + len(r.problems) for r in reports) + 1
            out |= {"exit_code": int(not reports or any(r.problems for r in reports)), "output_lines": lines}
    elif kind == "startup":
        from kdflow.schemas.commits import list_commits, stage_dir
        from kdflow.schemas.store_info import topk_tags

        started = time.perf_counter()
        run_root = open_root(target)
        shards = len(list_commits(run_root, stage_dir(run_root, "tokens"), "tokens"))
        for tag in topk_tags(run_root):
            shards += len(list_commits(run_root, stage_dir(run_root, "topk", tag), "topk", tag))
        out["records_valid"] = shards
    else:
        raise SystemExit(f"unknown child {kind!r}")
    return out | {"seconds": round(time.perf_counter() - started, 3), "peak_rss_mib": peak_rss_mib()}


def run_child(kind: str, target: str, env: dict[str, str]) -> dict[str, Any]:
    done = run_fresh(MODULE, ["--child", kind, target], env=env, timeout=3600)
    if not done.ok:
        return {"error": f"exit {done.returncode}: {done.stderr_tail[:300]}"}
    return done.record | {"process_wall_s": round(done.wall_s, 2)}


# --- the runs ---------------------------------------------------------------------------------------------


def make_inputs(work: Path, args: argparse.Namespace, tokens: int) -> tuple[Path, Path, float]:
    """(corpus jsonl with at least `tokens` tokens, synthetic teacher folder with its tokenizer, tokens a document)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kdflow.bench.tokenise import pydoc_paragraphs, train_tiny_tokenizer

    texts = pydoc_paragraphs(400)
    tokenizer_dir = train_tiny_tokenizer(work / "tokenizer", texts, args.tokenizer_vocab)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    per_doc = sum(len(tokenizer(t)["input_ids"]) for t in texts) / len(texts)
    documents = pydoc_paragraphs(int(tokens * 1.3 / per_doc) + 400)
    corpus = work / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents), encoding="utf-8")
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.teacher_hidden, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=2 * args.teacher_hidden, max_position_embeddings=args.seq_len,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=1))
    teacher.save_pretrained(work / "teacher")
    tokenizer.save_pretrained(work / "teacher")
    return corpus, work / "teacher", per_doc


def run_config(run_root: str, corpus: Path, teacher: Path, documents: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "run_root": run_root,
        "dataset": {"path": str(corpus), "max_documents": documents, "documents_per_part": 20_000},
        "seq_len": args.seq_len,
        "teacher": {"model": str(teacher), "device": "cpu", "dtype": "float32"},
        "precompute": {"top_k": args.top_k, "micro_batch": 8, "sequences_per_shard": args.sequences_per_shard},
        "student": {"steps": args.steps, "batch_size": args.batch_size, "eval_sequences": 8, "warmup_steps": 2,
                    "save_every": 10_000, "device": "cpu", "prefetch_steps": args.prefetch_steps},
    }


def write_config(data: dict[str, Any], path: Path) -> Path:
    from kdflow.schemas.config_io import config_from_dict, dump_config

    path.write_text(dump_config(config_from_dict(data)))
    return path


def prepare_disk_run(work: Path, name: str, corpus: Path, teacher: Path, documents: int,
                     args: argparse.Namespace) -> tuple[Path, dict]:
    """materialise, tokenise and the teacher pass on local disk (not measured); -> (run root, store sizes)."""
    from kdflow.schemas.config_io import config_from_dict
    from kdflow.schemas.stage_settings import (materialise_settings, open_run_root, teacher_pass_settings,
                                               tokenise_settings)
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise
    from kdflow.tasks.teacher.precompute import precompute_shards

    run_root = work / name
    config = config_from_dict(run_config(str(run_root), corpus, teacher, documents, args))
    materialise(open_run_root(config), materialise_settings(config))
    tokenised = tokenise(open_run_root(config), tokenise_settings(config),
                         load_tokenizer(config.teacher, config.tokenizer))
    started = time.perf_counter()
    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    topk_bytes = sum(p.stat().st_size for p in (run_root / "topk").rglob("shard-*.arrow"))
    return run_root, {"token_shards": tokenised.shards, "tokens": summary["tokens"], "topk_bytes": topk_bytes,
                      "teacher_pass_s": round(time.perf_counter() - started, 1),
                      "teacher_tok_s": summary["tokens_per_s"]}


def subset_run(full: Path, target: Path, shards: int) -> dict[str, int]:
    """A run root of `shards` token shards and their top-K shards made from the full run's (hard links: the same
    bytes; each store's _complete.json rewritten for the count). Shard j is the full run's shard j, or, past the
    shards the teacher computed (`--teacher-tokens`), a copy of full shard j mod their count under its own id
    and commit record (the short last shard of the teacher's token store is never used). One teacher pass thus
    serves every size, and the sizes differ in nothing but their number of shards."""
    from kdflow.schemas.commits import list_commits, read_complete, write_commit, write_complete
    from kdflow.schemas.layout import COMPLETE_FILE, data_file_name

    shutil.copytree(full / "corpus", target / "corpus")
    (tag,) = [p.name for p in (full / "topk").iterdir()]
    source, run_root = open_root(str(full)), open_root(str(target))
    rows = tokens = 0
    for folder, stage in (("tokens", "tokens"), (f"topk/{tag}", "topk")):
        (target / folder).mkdir(parents=True)
        computed = list_commits(source, str(full / folder), stage)
        full_size = max(r.rows for r in computed.values())
        pool = [computed[i] for i in sorted(computed) if computed[i].rows == full_size]  # never the short last shard
        for path in (full / folder).iterdir():  # the store's own files: config.yaml, _store.json, ...
            if path.name != COMPLETE_FILE and not re.match(r"^shard-\d{5,}\.", path.name):
                os.link(path, target / folder / path.name)
        for shard_id in range(shards):
            record = pool[shard_id % len(pool)]
            name = data_file_name(stage, shard_id)
            os.link(full / folder / record.data_file, target / folder / name)
            write_commit(run_root, str(target / folder),
                         record.model_copy(update={"shard_id": shard_id, "data_file": name}))
        records = list_commits(run_root, str(target / folder), stage)
        rows, tokens = sum(r.rows for r in records.values()), sum(r.tokens for r in records.values())
        done = read_complete(source, str(full / folder))
        write_complete(run_root, str(target / folder), done.model_copy(update={"shards": len(records), "rows": rows,
                                                                               "tokens": tokens}))
    topk_bytes = sum(p.stat().st_size for p in (target / "topk").rglob("shard-*.arrow"))
    return {"token_shards": shards, "tokens": tokens, "topk_bytes": topk_bytes}


def data_wait(metrics_text: str) -> dict[str, Any]:
    """Loader wait over step time, from metrics.jsonl; the first step (nothing prefetched yet) apart."""
    records = [json.loads(line) for line in metrics_text.splitlines() if line.strip()]
    seconds = [r["tokens"] / r["tokens_per_s"] for r in records]
    waits = [r["data_wait_s"] for r in records]
    later = slice(1, None)
    return {"step_s_mean": round(sum(seconds[later]) / max(len(seconds) - 1, 1), 3),
            "data_wait_fraction": round(sum(waits[later]) / max(sum(seconds[later]), 1e-9), 5),
            "first_step_wait_s": round(waits[0], 3) if waits else None}


def measure_run(label: dict[str, Any], run_root: str, config_path: Path, env: dict[str, str], shards: int,
                moto: Moto | None) -> None:
    for kind, target in (("plan", str(config_path)), ("train", str(config_path)), ("validate", run_root),
                         ("status", run_root)):
        mark = moto.mark() if moto else 0
        result = run_child(kind, target, env)
        if moto is not None:
            requests = moto.requests_since(mark)
            result |= {"requests": requests, "requests_per_shard": round(sum(requests.values()) / shards, 1)}
        if kind == "train" and "error" not in result:
            with store_env(env):
                root = open_root(run_root)
                result |= data_wait(root.read_bytes(root.path("students", "student", "metrics.jsonl")).decode())
        emit(label | {"what": kind} | result)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("scale", __doc__, top_k=128, seq_len=512)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "TARGET"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="0.25M,1M", help="run sizes in tokens, comma list (K and M suffixes)")
    parser.add_argument("--stores", default="disk,s3", help="disk, s3 (moto's server on loopback), or both")
    parser.add_argument("--records", default="1000,3000,10000",
                        help="shard counts of the records-only run roots on disk")
    parser.add_argument("--s3-records", default="300,1000,3000",
                        help="the same on S3 (moto serves ~100 requests/s here: the request counts are the measure)")
    parser.add_argument("--vocab", type=int, default=196_608, help="the synthetic teacher's vocabulary")
    parser.add_argument("--teacher-hidden", type=int, default=8, help="the synthetic teacher's hidden size")
    parser.add_argument("--tokenizer-vocab", type=int, default=4096,
                        help="the BPE trained here (the student's vocabulary)")
    parser.add_argument("--sequences-per-shard", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prefetch-steps", type=int, default=2)
    parser.add_argument("--teacher-tokens",
                        help="compute at most this many tokens with the teacher (K and M suffixes); larger runs "
                             "repeat those shards under their own ids (the teacher pass is not what is measured)")
    parser.add_argument("--workdir", help="where the runs go (default: a temporary folder, removed at the end)")
    args = parser.parse_args(argv)
    if args.child:
        harness.emit(child(*args.child))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kdflow-bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    moto: Moto | None = None
    try:
        if "s3" in stores:
            moto = Moto(work)
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            with store_env(moto.env()):
                import fsspec

                fsspec.filesystem("s3").mkdir(bucket)
        corpus, teacher, per_doc = make_inputs(work, args, max(sizes) if args.teacher_tokens is None
                                               else min(max(sizes), parse_size(args.teacher_tokens)))
        emit({"what": "setup", "vocab": args.vocab, "teacher_hidden": args.teacher_hidden, "top_k": args.top_k,
              "seq_len": args.seq_len, "sequences_per_shard": args.sequences_per_shard,
              "tokenizer_vocab": args.tokenizer_vocab, "batch_size": args.batch_size, "steps": args.steps,
              "cpus": os.cpu_count()}, note=True)
        per_shard = args.sequences_per_shard * args.seq_len  # tokens
        shard_counts = {size: max(2, -(-size // per_shard)) for size in sizes}
        computed_shards = max(shard_counts.values()) if args.teacher_tokens is None else max(
            1, min(max(shard_counts.values()), -(-parse_size(args.teacher_tokens) // per_shard)))
        documents = int((computed_shards + 0.05) * per_shard / per_doc) + 1  # what the teacher pass computes
        full_root, info = prepare_disk_run(work, "full", corpus, teacher, documents, args)
        emit({"what": "teacher_pass", **info})
        for size in sizes:
            name = f"run-{size}"
            disk_root = work / name
            info = subset_run(full_root, disk_root, shard_counts[size])
            shards = 2 * info["token_shards"]  # token and top-K shards
            emit({"what": "prepared", "size": size, **info}, note=True)
            if "s3" in stores:  # before any training writes a student into the disk copy
                with store_env(moto.env()):
                    import fsspec

                    fsspec.filesystem("s3").put(f"{disk_root}/", f"{bucket}/{name}", recursive=True)
            for store in stores:
                url, env = ((str(disk_root), dict(os.environ)) if store == "disk"
                            else (f"s3://{bucket}/{name}", moto.env()))
                config_path = write_config(run_config(url, corpus, teacher, documents, args),
                                           work / f"{name}-{store}.yaml")
                measure_run({"size": size, "store": store, "shards": shards}, url, config_path, env, shards,
                            moto if store == "s3" else None)
            if not args.workdir:  # hard links: the copy costs no disk, but --workdir keeps it for a look afterwards
                shutil.rmtree(disk_root, ignore_errors=True)
        for store in stores:
            counts = (args.records if store == "disk" else args.s3_records).split(",")
            for count in [int(c) for c in counts if c.strip()]:
                url = str(work / f"records-{count}") if store == "disk" else f"s3://{bucket}/records-{count}"
                env = dict(os.environ) if store == "disk" else moto.env()
                records_only(url, count, env)
                for kind in ("startup", "status"):
                    mark = moto.mark() if store == "s3" else 0
                    result = run_child(kind, url, env)
                    if store == "s3":
                        result["requests"] = moto.requests_since(mark)
                    emit({"what": f"records_{kind}", "store": store, "shards_per_store": count} | result)
                if store == "disk":
                    shutil.rmtree(url, ignore_errors=True)
    finally:
        if moto is not None:
            moto.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        harness.emit(child(sys.argv[2], sys.argv[3]))
        raise SystemExit(0)
    raise SystemExit(main())
