"""`kdflow store report RUN_ROOT`: per top-K store, bytes/position, the codec's KL against the teacher re-run on
a few rows, the tail-mass histogram and how many positions keep how many ids (`kdflow.tasks.teacher.store_quality`).

The teacher is loaded as the store's own `config.yaml` says (same weights, dtype and quantisation, so the KL
measures what the storage lost, not a change of precision), on `--device` or the config's device; its
logits, top-K and log-sum-exp are float32 over the full vocabulary, as at capture. `--kl-rows 0` skips it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

from kdflow.schemas.commits import list_commits, stage_dir
from kdflow.schemas.config_io import config_from_dict
from kdflow.schemas.config_io import relative_run_root_hint, run_root_of
from kdflow.schemas.errors import StoreError, first_paragraph
from kdflow.schemas.layout import CONFIG_FILE
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import alignment_problem, read_store_info, topk_tags


def _teacher_step(config: Any, device: str | None, cache: dict[str, Any]) -> Any:
    """A TeacherTopkStep for the store's teacher, loaded once per distinct teacher section."""
    from kdflow.tasks.common.teacher_loading import load_teacher
    from kdflow.tasks.teacher.sampled_pass import sampled_step
    from kdflow.tasks.teacher.topk import TeacherTopkStep, topk_chunk_tokens

    targets = [config.precompute.targets, config.precompute.sampling.model_dump(mode="json")]
    key = json.dumps([config.teacher.model_dump(mode="json"), device, config.precompute.top_k, targets], sort_keys=True)
    if key not in cache:
        model = load_teacher(config.teacher, device=device)
        vocab = model.get_output_embeddings().out_features
        chunk = topk_chunk_tokens(config.precompute, vocab)
        cache[key] = TeacherTopkStep(model, config.precompute.top_k, chunk) if targets[0] == "topk" else sampled_step(
            model, config.precompute, vocab)  # hybrid / sampled: the store's own draw, re-run
    return cache[key]


def _made_from_other_tokens(run_root: RunRoot, records: dict[int, Any], picks: list[tuple[int, int]]) -> bool:
    """Whether a picked row's top-K shard is not the teacher's output on the token shard now at its place
    (`alignment_problem`, as training and export judge it): re-running the teacher there would measure nothing."""
    tokens = list_commits(run_root, stage_dir(run_root, "tokens"), "tokens")
    return any(alignment_problem(tokens.get(shard), records[shard]) for shard in {shard for shard, _ in picks})


def store_report(url: str, tag: str | None = None, rows: int = 256, kl_rows: int = 8,
                 device: str | None = None) -> list[dict[str, Any]]:
    """One summary per store (or only `tag`), with the teacher's KL when `kl_rows` > 0."""
    from kdflow.tasks.teacher.store_quality import sample_rows, store_summary, teacher_fidelity

    run_root = RunRoot(url)
    tags = [tag] if tag else topk_tags(run_root)
    if tag and tag not in topk_tags(run_root):
        raise StoreError(f"no top-K store {tag} under {run_root.display(run_root.path('topk'))}")
    teachers: dict[str, Any] = {}
    summaries = []
    for name in tags:
        summary = store_summary(run_root, name, rows)
        store = stage_dir(run_root, "topk", name)
        info = read_store_info(run_root, store)
        if kl_rows and summary["shards"] and info is not None and info.model_extra.get("imported"):
            summary["kl_note"] = "imported targets (kdflow store import): no teacher to re-run, KL not measured"
        elif kl_rows and summary["shards"]:
            try:
                config = config_from_dict(yaml.safe_load(run_root.read_bytes(f"{store}/{CONFIG_FILE}")),
                                          f"{name}/{CONFIG_FILE}")
            except FileNotFoundError:
                summary["kl_note"] = f"no {CONFIG_FILE} beside the store: teacher unknown, KL not measured"
            else:
                records = list_commits(run_root, store, "topk")
                picks = sample_rows(records, kl_rows)
                if _made_from_other_tokens(run_root, records, picks):
                    summary["kl_note"] = ("made from token shards that tokenise has since replaced: the teacher "
                                          "cannot be re-run on its inputs, KL not measured")
                else:
                    step = _teacher_step(config, device, teachers)
                    summary |= teacher_fidelity(step, run_root, name, picks, config.precompute.micro_batch)
        summaries.append(summary)
    return summaries


def main(argv: list[str] | None = None) -> int:
    from kdflow.tasks.teacher.store_quality import report_markdown

    parser = argparse.ArgumentParser(prog="kdflow store report", description=first_paragraph(__doc__))
    parser.add_argument("run_root", help="the run root, or the config file that names it")
    parser.add_argument("--tag", help="one store (default: every store under topk/)")
    parser.add_argument("--rows", type=int, default=256, help="rows sampled for the histograms (default 256)")
    parser.add_argument("--kl-rows", type=int, default=8, help="rows re-run through the teacher for the KL (0: none)")
    parser.add_argument("--device", default=None, help="device of the teacher (default: the store config's)")
    parser.add_argument("--json", action="store_true", help="one JSON object per store instead of Markdown")
    args = parser.parse_args(argv)
    given, args.run_root = args.run_root, run_root_of(args.run_root)
    run_root = RunRoot(args.run_root)
    if not run_root.exists(run_root.root):  # as kdflow status and validate say it
        print(f"run root {args.run_root} does not exist{relative_run_root_hint(args.run_root, given)}")
        return 1
    summaries = store_report(args.run_root, args.tag, args.rows, args.kl_rows, args.device)
    if not summaries:
        print(f"no top-K stores under {args.run_root}")
        return 1
    for summary in summaries:
        print(json.dumps(summary) if args.json else report_markdown(summary))
    return 0
