"""`kdflow store import` and `kdflow store export`: teacher targets in and out of kdflow as top-K logit datasets
(kdflow.tasks.teacher.logit_import / logit_export; layouts in kdflow.schemas.logit_layouts)."""

from __future__ import annotations

import argparse
import json
import shlex

from kdflow.schemas.config_io import parse_override
from kdflow.schemas.config_io import run_root_of
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.logit_layouts import KINDS, LAYOUTS, ROLES, STACKED_ORDERS, LogitLayout, declare_layout

_LAYOUTS = "; ".join(f"{layout.name}: {layout.description}" for layout in LAYOUTS.values())


def _column(text: str) -> tuple[str, str]:
    role, sep, column = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROLE=COLUMN")
    return role.strip(), column.strip()


def import_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdflow store import", description=(
        "Build a token store and a top-K store (the config's format) from a local Hugging Face dataset folder, "
        "Parquet or JSON lines holding token ids and per-position top-K ids and values, rows of any length. "
        f"Built-in layouts: {_LAYOUTS}. Or declare one: a YAML file of the layout's fields, or --column options."))
    parser.add_argument("source", help="dataset folder (datasets.save_to_disk), Parquet file/folder, .jsonl, or a "
                        "quoted glob of such files")
    parser.add_argument("--config", required=True, help="the run's YAML config (run_root, seq_len, top_k, store)")
    parser.add_argument("--set", action="append", type=parse_override, metavar="KEY=VALUE",
                        help="override a config key (repeatable)")
    parser.add_argument("--layout", help=f"a built-in layout ({', '.join(sorted(LAYOUTS))}) or a YAML file "
                        "declaring one; --column, --kind and --stacked-order change it")
    parser.add_argument("--column", action="append", type=_column, metavar="ROLE=COLUMN",
                        help=f"the column of a role (repeatable; ROLE= removes it); roles: {', '.join(ROLES)}")
    parser.add_argument("--kind", choices=KINDS, help="what the values are (default logprobs)")
    parser.add_argument("--stacked-order", choices=STACKED_ORDERS, help="which of a stacked pair comes first")
    parser.add_argument("--teacher", required=True, help="the name of the teacher that made the targets")
    parser.add_argument("--distillkit-settings", metavar="FILE", help="--layout distillkit: the capture's compressor "
                        "settings (default: the compression_config.yaml it ships)")
    return parser


def declared_layout(args: argparse.Namespace) -> LogitLayout:
    """The layout the options declare: --layout (a built-in or YAML file) changed by --column/--kind/...,
    or a whole layout from --column options."""
    if args.layout is None and not args.column:
        raise ConfigError("name a --layout (a built-in or a YAML file) or declare one with --column ROLE=COLUMN")
    return declare_layout(args.layout, dict(args.column or []), kind=args.kind, stacked_order=args.stacked_order)


def import_main(argv: list[str] | None = None) -> int:
    args = import_parser().parse_args(argv)
    from kdflow.schemas.config_io import load_config
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.teacher.logit_import import import_store

    layout = declared_layout(args)
    config = load_config(args.config, dict(args.set or []))
    summary = import_store(open_run_root(config), teacher_pass_settings(config), args.source, layout, args.teacher,
                           distillkit_settings=args.distillkit_settings)
    print(json.dumps(summary))
    same = "".join(f" --set {shlex.quote(f'{key}={value}')}" for key, value in args.set or [])  # this import's
    print(f"imported as top-K store {summary['tag']}: train on it with `kdflow run {shlex.quote(args.config)} "
          f"--stages train{same} --set student.topk_tag={summary['tag']}`")
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
    parser.add_argument("--layout", default="kdflow", help=f"a built-in layout ({', '.join(sorted(LAYOUTS))}; "
                        "default kdflow) or a YAML file declaring one, as import reads them")
    parser.add_argument("--distillkit-settings", metavar="FILE", help="--layout distillkit: the compressor settings "
                        "to write with (default: lossless, every value an exact float32)")
    args = parser.parse_args(argv)
    from kdflow.tasks.teacher.logit_export import export_store

    print(json.dumps(export_store(run_root_of(args.run_root), args.out_dir, args.tag, args.layout,
                                  distillkit_settings=args.distillkit_settings)))
    return 0
