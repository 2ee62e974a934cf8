"""The model card written with the final model: `students/NAME/final/README.md`, in the Hugging Face card layout.

YAML front matter (`library_name: transformers`, `base_model` when the student was initialised from a hub model,
`datasets` when the corpus is a hub dataset, `tags: [distillation, kdflow]`, `pipeline_tag: text-generation`),
then what made the student (teacher, corpus, top-K store, steps, tokens, hardware), its held-out metrics against
the teacher (every value `eval.jsonl` holds, first and last evaluation), the training curve
(`training_curve.png` beside the card, when matplotlib is installed) and how to load it and chat with it.
The card names things as a reader elsewhere can find them: a hub id as it is, a local folder or file by its last
part, the store by `topk/TAG`. On an imported store the teacher is the one `kdflow store import` named, not
`teacher.model`, and the card says in one line why there is no `kl_full` when the config does not say the two are
the same (`student.imported_is_teacher_model`).
`card_facts` gathers the facts of a run (rank 0, at the end of training); `render_card` is a pure function of
them. Both are written with the final model each time it is written, so a resumed run's card shows its last step.
"""

from __future__ import annotations

import math
import os
import posixpath
from typing import Any

import torch
import yaml

from kdflow.schemas.layout import TRAINING_CURVE_FILE
from kdflow.schemas.stage_settings import TrainingSettings
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import format_label, read_store_info
from kdflow.tasks.common.model_files import hub_id, shown_name
from kdflow.tasks.student.heldout_teacher import full_kl_off_reason, imported_teacher
from kdflow.tasks.student.monitor import perplexity_text
from kdflow.tasks.student.prune import pruned_line, width_summary

CARD_FILE = "README.md"
# Held-out values with a name of their own (eval.jsonl may hold more: they are shown by their key).
METRIC_NAMES = {"kl_stored": "KL to the teacher's top-K (K+1 buckets)",
                "kl_full": "full-vocabulary KL to the teacher", "ce": "cross-entropy (nats/token)",
                "perplexity": "perplexity", "top1_agreement": "top-1 agreement"}
STORED_KL_NAMES = {"sampled": "KL to the stored sampled targets",
                   "hybrid": "KL to the stored targets (head and samples)"}
NOT_METRICS = {"step", "sequences"}


def hardware(device: torch.device, world_size: int) -> str:
    """The machine that trained: accelerator (or CPU cores) times ranks, and the torch version."""
    ranks = f"{world_size} x " if world_size > 1 else ""
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = f"{device.type.upper()} ({os.cpu_count()} cores)"
    return f"{ranks}{what}, torch {torch.__version__}"


def card_facts(settings: TrainingSettings, run_root: RunRoot, stores: Any, *, step: int, elapsed_s: float,
               tokens_per_step: int, evals: list[dict[str, Any]], device: torch.device, world_size: int,
               parameters: int, curve: bool, pruned: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the card says about this run (`stores`: kdflow.tasks.student.data.DistillStores; `pruned`: what a
    student made by `student.prune` kept of the teacher, its config's `kdflow_prune`)."""
    info = read_store_info(run_root, stores.topk_store)
    positions = sum(pair.rows for pair in stores.pairs) * stores.seq_len
    stored = sum(pair.topk_bytes for pair in stores.pairs)
    sampling = stores.sampling or {}
    if stores.targets == "topk":
        kept = f"top-{stores.top_k}" + (f" (adaptive: keep_mass {stores.codec['keep_mass']})"
                                        if stores.codec and stores.codec.get("keep_mass") is not None else "")
    elif stores.targets == "hybrid":
        kept = f"exact head of {sampling.get('head')} + {sampling.get('samples')} sampled tokens"
    else:
        kept = f"{sampling.get('samples')} sampled tokens"
    teacher, dataset, student = settings.teacher, settings.dataset, settings.student
    imported = imported_teacher(info)
    return {
        "name": student.name, "teacher": imported or shown_name(teacher.model), "imported": imported is not None,
        "teacher_gguf": None if imported else teacher.gguf_file, "teacher_4bit": not imported and teacher.load_in_4bit,
        "dataset": shown_name(dataset.path), "dataset_name": dataset.name, "dataset_split": dataset.split,
        "init_from": shown_name(student.init_from) if student.init_from else None, "seq_len": stores.seq_len,
        # on the hub: decided from the settings as given (a shown local `name/final` looks like a hub id)
        "init_from_on_hub": hub_id(student.init_from) is not None, "dataset_on_hub": hub_id(dataset.path) is not None,
        "pruned": pruned_line(pruned),
        "store": f"topk/{info.tag if info is not None else posixpath.basename(stores.topk_store.rstrip('/'))}",
        "targets": stores.targets, "kept": kept,
        "format": format_label(info.store_format()) if info is not None else "v1 (no _store.json)",
        "bytes_per_position": stored / positions if positions and stored else None, "store_positions": positions,
        "steps": step, "tokens": step * tokens_per_step, "batch_size": student.batch_size,
        "parameters": parameters, "hardware": hardware(device, world_size), "training_s": elapsed_s,
        "evals": [evals[0], evals[-1]] if len(evals) > 1 else list(evals), "curve": curve,
        "kl_full_note": full_kl_off_reason(info, shown_name(teacher.model), student.imported_is_teacher_model),
        "pruned_width": width_summary(pruned),  # its blocks narrowed too (student.prune.intermediate_size, ...)
    }


def _front_matter(facts: dict[str, Any]) -> str:
    data: dict[str, Any] = {"library_name": "transformers"}
    if facts.get("init_from_on_hub"):
        data["base_model"] = facts["init_from"]
    if facts.get("dataset_on_hub"):
        data["datasets"] = [facts["dataset"]]
    data |= {"tags": ["distillation", "kdflow"], "pipeline_tag": "text-generation"}
    return "---\n" + yaml.safe_dump(data, sort_keys=False) + "---\n"


def _value(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if key == "top1_agreement":
        return f"{value:.1%}"
    if key == "perplexity":
        return perplexity_text(value)
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)


def _metrics_table(evals: list[dict[str, Any]], targets: str | None) -> list[str]:
    if not evals:
        return ["No held-out evaluation was run (`student.eval_shards: 0`)."]
    # `kl` is kl_stored's old name (records of older runs hold only `kl`): one row, under the new name
    evals = [{("kl_stored" if k == "kl" else k): v for k, v in e.items() if k != "kl" or "kl_stored" not in e}
             for e in evals]
    names = METRIC_NAMES | ({"kl_stored": STORED_KL_NAMES[targets]} if targets in STORED_KL_NAMES else {})
    keys = list(dict.fromkeys(k for e in evals for k, v in e.items()
                              if k not in NOT_METRICS and (v is None or isinstance(v, (int, float)))))
    lines = ["| held-out | " + " | ".join(f"step {e['step']}" for e in evals) + " |",
             "| --- | " + " | ".join("---" for _ in evals) + " |"]
    lines += [f"| {names.get(k, k)} | " + " | ".join(_value(k, e.get(k)) for e in evals) + " |" for k in keys]
    sequences = evals[-1].get("sequences")
    rows = f"{sequences} held-out sequences" if sequences else "held-out sequences"
    return [f"Against the teacher, on {rows} of the corpus (shards never trained on), at the first and the last "
            "evaluation:", "", *lines]


def render_card(facts: dict[str, Any]) -> str:
    """The card's text (front matter and Markdown) from `card_facts`."""
    teacher = f"`{facts['teacher']}`" + (f" (GGUF `{facts['teacher_gguf']}`)" if facts.get("teacher_gguf") else "")
    teacher += ", 4-bit" if facts.get("teacher_4bit") else ""
    teacher += " (its targets imported with `kdflow store import`)" if facts.get("imported") else ""
    corpus = f"`{facts['dataset']}`" + (f" (`{facts['dataset_name']}`)" if facts.get("dataset_name") else "")
    corpus += f", split `{facts['dataset_split']}`"
    per_position = facts.get("bytes_per_position")
    rows = [("teacher", teacher), ("corpus", corpus),
            ("student", f"{facts['parameters']:,} parameters, initialised from "
                        + (f"`{facts['init_from']}`" if facts.get("init_from") else
                           f"the teacher: {facts['pruned']}" if facts.get("pruned") else "random weights")),
            ("teacher targets", f"{facts['targets']}: {facts['kept']} per position"),
            ("store", f"`{facts['store']}`, format {facts['format']}"),
            ("bytes per position", f"{per_position:.1f} over {facts['store_positions']:,} positions"
             if per_position else "n/a"),
            ("sequence length", str(facts["seq_len"])),
            ("steps", f"{facts['steps']} (batch {facts['batch_size']} sequences)"),
            ("tokens", f"{facts['tokens']:,}"),
            ("hardware", facts["hardware"]),
            ("training time", f"{facts['training_s']:.0f} s")]
    if facts.get("pruned_width"):  # under the student's row
        rows.insert(3, ("student width", f"each block keeps {facts['pruned_width']}"))
    lines = [_front_matter(facts).rstrip("\n"), "", f"# {facts['name']}", "",
             f"A student distilled offline with kdflow from the teacher {teacher}: trained "
             "against the teacher's log-probabilities, computed once over the corpus and stored.", "",
             "## Training", "", "| | |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in rows], "",
             "## Held-out metrics", "", *_metrics_table(facts.get("evals") or [], facts.get("targets")), "",
             *([f"{facts['kl_full_note'][0].upper()}{facts['kl_full_note'][1:]}.", ""]
               if facts.get("kl_full_note") and facts.get("evals") else []),
             "## Training curve", ""]
    if facts.get("curve"):
        lines.append(f"![training curve: loss per step and held-out KL]({TRAINING_CURVE_FILE})")
    else:
        lines.append("No curve image: matplotlib is not installed where this student was trained.")
    lines += ["", "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              'tokenizer = AutoTokenizer.from_pretrained("PATH")  # this folder, or its hub id once uploaded',
              'model = AutoModelForCausalLM.from_pretrained("PATH")',
              'inputs = tokenizer("The object", return_tensors="pt")',
              "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0], skip_special_tokens=True))",
              "```", "",
              "PATH is a local folder: where this folder lies on an object store, copy it first (transformers "
              "loads local folders only). A conversation on the terminal (history kept, replies streamed): "
              "`kdflow chat PATH`, where PATH may also be the folder's URL (`s3://...`): it copies the folder for "
              "the session.", ""]
    return "\n".join(lines)


def card_files(facts: dict[str, Any], metrics: list[dict[str, Any]], evals: list[dict[str, Any]]) -> dict[str, bytes]:
    """README.md, and training_curve.png when matplotlib is installed (`facts["curve"]` says which)."""
    files: dict[str, bytes] = {}
    if facts.get("curve"):
        from kdflow.tasks.student.monitor import plot_training_curve

        files[TRAINING_CURVE_FILE] = plot_training_curve(metrics, evals, f"student {facts['name']}")
    files[CARD_FILE] = render_card(facts).encode("utf-8")
    return files


def matplotlib_installed() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
