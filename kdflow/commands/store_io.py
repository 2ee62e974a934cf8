"""`kdflow store import` and `kdflow store export`: teacher targets in and out of kdflow as top-K logit datasets
(kdflow.tasks.teacher.logit_import / logit_export; layouts in kdflow.schemas.logit_layouts)."""

from __future__ import annotations

import argparse
import json
import shlex

from kdflow.schemas.config_io import parse_override
from kdflow.schemas.config_io import run_root_of
from kdflow.schemas.logit_layouts import LAYOUTS

_LAYOUTS = "; ".join(f"{layout.name}: {layout.description}" for layout in LAYOUTS.values())


def import_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdflow store import", description=(
        "Build a token store and a top-K store (the config's format) from a local Hugging Face dataset folder, "
        f"Parquet or JSON lines holding token ids and per-position top-K ids and log-probs. Layouts: {_LAYOUTS}"))
    parser.add_argument("source", help="dataset folder (datasets.save_to_disk), Parquet file/folder or .jsonl")
    parser.add_argument("--config", required=True, help="the run's YAML config (run_root, seq_len, top_k, store)")
    parser.add_argument("--set", action="append", type=parse_override, metavar="KEY=VALUE",
                        help="override a config key (repeatable)")
    parser.add_argument("--layout", required=True, choices=sorted(LAYOUTS), help="the source's column layout")
    parser.add_argument("--teacher", required=True, help="the name of the teacher that made the targets")
    args = parser.parse_args(argv)
    from kdflow.schemas.config_io import load_config
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.teacher.logit_import import import_store

    config = load_config(args.config, dict(args.set or []))
    summary = import_store(open_run_root(config), teacher_pass_settings(config), args.source, args.layout,
                           args.teacher)
    print(json.dumps(summary))
    print(f"imported as top-K store {summary['tag']}: train on it with "
          f"`kdflow run {shlex.quote(args.config)} --stages train --set student.topk_tag={summary['tag']}`")
    return 0


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdflow store export", description=(
        "Write a top-K store as Parquet shards (OUT_DIR/data/train-*.parquet) that "
        "datasets.load_dataset('parquet', ...) reads, each column as the layout declares it (full, renormalised or "
        "logit values, the stacked pair's order, a per-id target mask where the layout has one), so that the "
        f"trainer the layout comes from reads it. Layouts: {_LAYOUTS}"))
    parser.add_argument("run_root", help="the run root, or the config file that names it")
    parser.add_argument("out_dir")
    parser.add_argument("--tag", help="the store (default: the run root's only one)")
    parser.add_argument("--layout", default="kdflow", choices=sorted(LAYOUTS), help="column layout (default kdflow)")
    args = parser.parse_args(argv)
    from kdflow.tasks.teacher.logit_export import export_store

    print(json.dumps(export_store(run_root_of(args.run_root), args.out_dir, args.tag, args.layout)))
    return 0
