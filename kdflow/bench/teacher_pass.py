"""`kdflow bench teacher-pass`: the whole teacher pass against the bare forward of the same model and batch.

On one loaded teacher and the same token rows (the first `--shards` token shards, cut into the pass's fixed
micro-batch, the last one padded), it times:
- `body`: the model body's forward only (hidden states, no lm_head);
- `forward`: the model's own forward to full logits `(micro_batch, seq_len, vocab)`, i.e. body + lm_head, in
  the model's dtype (its own lm_head, also where `teacher.lm_head_float32` wraps it for the pass): the least any
  teacher pass must compute, so this stage's limit on this machine;
- `topk`: the body plus the chunked top-K and full-vocabulary log-sum-exp (`TeacherTopkStep`, the step the
  pass runs, with the pass's chunk size), results left on the device; for a config of sampled or hybrid
  targets, the step that pass runs instead, the chunked sampler (`TeacherSampledStep`; every line's `targets`
  says which);
- `stage`: `precompute_shards` over those shards into an emptied top-K store (planning, shard reads, the step,
  host copies, encoding, the background writer, leases, commits), the teacher already loaded. Not inside it:
  the store report's re-run of `precompute.report_rows` rows (set to 0 here: a fixed cost after the shards,
  not per-token work) and the store's renumbering table (built by one untimed stage run before the rounds and
  kept, as a pass over an existing store reads it).
Every mode does the same rows each round and is timed the same way: wall seconds around one call that does all
of its micro-batches, device synchronised at the end. Modes are interleaved over `--repeats` rounds; each mode's
line gives `tokens_per_s` = real tokens (`tokens`, padding excluded) / its best round's seconds
(`seconds_best`), with every round's seconds and process CPU seconds beside it. One last line gives the ratios
of tokens_per_s: `stage/forward`, `topk/forward`, `stage/topk` (and over `body`); the stage's line also
gives its background writer's seconds encoding and writing (`writer_busy_s`), the seconds the pass was
blocked on it (`waited_for_writer_s`), the whole call's seconds (`call_s`; `phases_s`: plan, setup, shards,
finish) and its shards' own rate: where a pass's time goes beyond the device's. Without `--config`, the demo teacher
(SmolLM2-135M, dequantised once into RUN_ROOT/teacher-smollm2 as `kdflow demo` does) and the demo's token
shards are prepared under `--run-root`. The stage writes into a scratch copy of the token store, never into
the config's own run root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kdflow.bench.args import bench_parser

MODES = ("body", "forward", "topk", "stage")


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("teacher-pass", __doc__, run_root=True, repeats=3, threads=True, device=None,
                          helps={"run_root": "where the demo inputs are prepared",
                                 "repeats": "rounds; each mode reports its best",
                                 "device": "default: the config's teacher.device"})
    parser.add_argument("--config", help="a config whose token store exists (default: the demo's, under --run-root)")
    parser.add_argument("--shards", type=int, default=3, help="token shards timed per mode and round")
    parser.add_argument("--micro-batch", type=int, help="default: the config's precompute.micro_batch")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    return parser


def prepare_demo(run_root: str) -> Any:
    """The demo's teacher folder, text, corpus and token shards under `run_root` (kept for reruns) -> config."""
    from kdflow.demo_assets import demo_config, local_run_root, locate_teacher_gguf, prepare_teacher, write_corpus
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root, tokenise_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise

    root = local_run_root(run_root)
    config = demo_config(root)
    write_corpus(Path(config.dataset.path))
    prepare_teacher(locate_teacher_gguf(), Path(config.teacher.model))
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    materialise(open_run_root(config), materialise_settings(config), lambda texts: [len(ids) + 1 for ids in
                                       tokenizer(texts, add_special_tokens=False)["input_ids"]])
    tokenise(open_run_root(config), tokenise_settings(config), tokenizer)
    return config


def scratch_copy(config: Any, shards: int, folder: str) -> tuple[Any, list[Any]]:
    """A run root in `folder` holding the first `shards` token shards (and the store's records) -> (config, token
    arrays). The stage computes there, so the real run root is never written. The config's token store must be
    complete and made for this config and its tokenizer (`open_token_store`); the copy is complete with those
    shards (the v2 codec's renumbering counts a whole token store)."""
    from kdflow.bench.harness import open_root
    from kdflow.schemas.commits import list_commits, stage_dir, write_complete
    from kdflow.schemas.errors import StoreError
    from kdflow.schemas.fingerprints import tokenizer_fingerprint
    from kdflow.schemas.shards import read_token_shard
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.schemas.token_store import open_token_store
    from kdflow.tasks.common.tokenizer import load_tokenizer

    source = open_run_root(config)
    tokenizer_fp = tokenizer_fingerprint(load_tokenizer(config.teacher, config.tokenizer))
    store = open_token_store(source, tokenizer_fp, teacher_pass_settings(config).tokens_fingerprint(tokenizer_fp))
    tokens, done = store.path, store.complete
    records = list_commits(source, tokens, "tokens", done.fingerprint)
    missing = [i for i in range(shards) if i not in records]
    if shards > done.shards or missing:
        raise StoreError(f"--shards {shards}: the token store has {done.shards} shards ({len(records)} committed)")
    target = open_root(folder)
    target_tokens = stage_dir(target, "tokens")
    target.makedirs(target_tokens)
    for name in [n for i in range(shards) for n in (records[i].data_file, _commit_name(i))]:
        target.write_bytes_atomic(f"{target_tokens}/{name}", source.read_bytes(f"{tokens}/{name}"))
    write_complete(target, target_tokens, done.model_copy(update={
        "shards": shards, "rows": sum(records[i].rows for i in range(shards)),
        "tokens": sum(records[i].tokens for i in range(shards))}))
    arrays = [read_token_shard(target, f"{target_tokens}/{records[i].data_file}", config.seq_len)
              for i in range(shards)]
    precompute = config.precompute.model_copy(update={"report_rows": 0})  # no store report: see the docstring
    return config.model_copy(update={"run_root": folder, "precompute": precompute}), arrays


def _commit_name(shard_id: int) -> str:
    from kdflow.schemas.layout import commit_file_name

    return commit_file_name("tokens", shard_id)


def micro_batches(arrays: list[Any], micro_batch: int) -> list[tuple[Any, int]]:
    """(padded (micro_batch, T) int64 ids, real rows) per micro-batch, shard by shard as the pass cuts them."""
    import numpy as np

    batches = []
    for rows in arrays:
        for start in range(0, len(rows), micro_batch):
            part = rows[start:start + micro_batch]
            padded = np.zeros((micro_batch, rows.shape[1]), dtype=np.int64)
            padded[:len(part)] = part
            batches.append((padded, len(part)))
    return batches


def step_functions(config: Any, model: Any, batches: list[tuple[Any, int]], scratch: Any,
                   shards: int) -> tuple[dict[str, Callable[[], None]], int, list[dict[str, Any]]]:
    """One callable per mode, each doing the whole of its work over every micro-batch once; the chunk (rows) of
    the `topk` mode's step; the list each stage call appends its host-side seconds to (its record's fields)."""
    import torch

    from kdflow.schemas.layout import TOPK_DIR
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.common.float32_logits import Float32Logits
    from kdflow.tasks.common.models import body_hidden_states, output_layer
    from kdflow.tasks.teacher.loading import output_rows
    from kdflow.tasks.teacher.precompute import precompute_shards
    from kdflow.tasks.teacher.sampled_pass import sampled_step
    from kdflow.tasks.teacher.topk import TeacherTopkStep, topk_chunk_tokens

    pre = config.precompute
    device = next(model.parameters()).device
    # On the device before timing, as the stage's copy is tiny.
    inputs = [torch.from_numpy(ids).to(device) for ids, _ in batches]
    vocab = output_rows(model)
    if pre.targets == "topk":
        topk_step = TeacherTopkStep(model, pre.top_k, topk_chunk_tokens(pre, vocab))

        def step(ids: Any, index: int) -> Any:
            return topk_step(ids)
        chunk_tokens = topk_step.chunk_tokens
    else:  # the sampler, seeded as the pass seeds its first shard's rows
        sampler = sampled_step(model, pre, vocab)

        def step(ids: Any, index: int) -> Any:
            return sampler(ids, shard=0, first_row=index * len(ids))
        chunk_tokens = sampler.chunk_tokens
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def body() -> None:
        for ids in inputs:
            body_hidden_states(model, ids)
        sync()

    own_head = output_layer(model)
    bare_head = own_head.linear if isinstance(own_head, Float32Logits) else own_head

    def forward() -> None:
        model.set_output_embeddings(bare_head)
        try:
            with torch.inference_mode():
                for ids in inputs:
                    model(input_ids=ids, use_cache=False).logits  # noqa: B018 - the logits are the work
            sync()
        finally:
            model.set_output_embeddings(own_head)

    def topk() -> None:
        for index, ids in enumerate(inputs):
            step(ids, index)
        sync()

    shard_ids = list(range(shards))
    stage_calls: list[dict[str, Any]] = []  # each stage call's host-side seconds, in order
    scratch_root, scratch_settings = open_run_root(scratch), teacher_pass_settings(scratch)

    def stage() -> None:
        empty_store(Path(scratch.run_root) / TOPK_DIR)
        summary = precompute_shards(scratch_root, scratch_settings, shard_ids, model=model)
        if summary["written"] != shards:
            raise RuntimeError(f"the stage wrote {summary['written']} shards, expected {shards}")
        # the writer's seconds, the call's (planning, store files, commits included) and its shards' own rate
        stage_calls.append({"writer_busy_s": summary["writer"]["busy_s"],
                            "waited_for_writer_s": summary["writer"]["waited_for_s"], "call_s": summary["seconds"],
                            "phases_s": summary["phases_s"], "shards_tokens_per_s": summary["tokens_per_s"]})

    return {"body": body, "forward": forward, "topk": topk, "stage": stage}, chunk_tokens, stage_calls


def empty_store(topk: Path) -> None:
    """Every file of the scratch top-K stores removed but their renumbering tables: the next stage call
    computes every shard again, as a pass over an existing store does."""
    from kdflow.schemas.layout import RENUMBERING_FILE

    for path in sorted(topk.rglob("*"), reverse=True):  # children before their folders
        if path.is_dir():
            if not any(path.iterdir()):
                path.rmdir()
        elif path.name != RENUMBERING_FILE:
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    from kdflow.bench.harness import emit

    for record in records(build_parser().parse_args(argv)):
        emit(record)
    return 0


def records(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Each mode's record (its best round), then the ratios between modes; `args` from `_parser`."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes must be a comma list of {', '.join(MODES)}; got {args.modes!r}")
    for name in ("shards", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise SystemExit(f"--micro-batch must be >= 1, got {args.micro_batch}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from kdflow.schemas.config_io import load_config
    from kdflow.tasks.common.models import resolve_device
    from kdflow.tasks.common.teacher_loading import load_teacher
    from kdflow.tasks.teacher.precompute import deterministic_algorithms

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    config = load_config(args.config) if args.config else prepare_demo(args.run_root)
    if args.micro_batch:
        precompute = config.precompute.model_copy(update={"micro_batch": args.micro_batch})
        config = config.model_copy(update={"precompute": precompute})
    device = resolve_device(args.device or config.teacher.device)
    model = load_teacher(config.teacher, device=device)
    with tempfile.TemporaryDirectory(prefix="kdflow-bench-teacher-pass-") as folder:
        scratch, arrays = scratch_copy(config, args.shards, folder)
        batches = micro_batches(arrays, config.precompute.micro_batch)
        tokens = sum(len(rows) for rows in arrays) * config.seq_len
        steps, chunk_tokens, stage_calls = step_functions(config, model, batches, scratch, args.shards)
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        cpu_seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        with deterministic_algorithms():  # as the pass runs
            if "stage" in modes:
                steps["stage"]()  # untimed: builds the store's renumbering table, kept by every round
            for _ in range(args.repeats):
                for mode in modes:
                    wall, cpu = time.perf_counter(), time.process_time()
                    steps[mode]()
                    seconds[mode].append(time.perf_counter() - wall)
                    cpu_seconds[mode].append(time.process_time() - cpu)
    common = {"bench": "teacher_pass", "teacher": config.teacher.model, "device": str(device),
              "threads": torch.get_num_threads(), "micro_batch": config.precompute.micro_batch,
              "seq_len": config.seq_len, "top_k": config.precompute.top_k, "targets": config.precompute.targets,
              "chunk_tokens": chunk_tokens, "shards": args.shards, "micro_batches": len(batches), "tokens": tokens,
              "padded_tokens": len(batches) * config.precompute.micro_batch * config.seq_len}
    rates = {}
    for mode in modes:
        best = min(seconds[mode])
        rates[mode] = tokens / best
        # the stage's best round: its background writer busy, the pass blocked on it ([0]: the untimed call)
        extra = stage_calls[1:][seconds[mode].index(best)] if mode == "stage" else {}
        yield (common | {"mode": mode, "tokens_per_s": round(rates[mode], 1), "seconds_best": round(best, 3),
                        "seconds_median": round(statistics.median(seconds[mode]), 3),
                        "seconds_all": [round(s, 3) for s in seconds[mode]],
                        "cpu_seconds_best": round(min(cpu_seconds[mode]), 3),
                        "loadavg_1m": round(os.getloadavg()[0], 2)} | extra)
    ratios = {f"{num}/{den}": round(rates[num] / rates[den], 3)
              for num, den in (("stage", "forward"), ("stage", "body"), ("stage", "topk"), ("topk", "forward"),
                               ("topk", "body")) if num in rates and den in rates}
    loadavg = [round(x, 2) for x in os.getloadavg()]
    yield {"bench": "teacher_pass", "what": "ratios", **ratios, "loadavg": loadavg}


if __name__ == "__main__":
    raise SystemExit(main())
