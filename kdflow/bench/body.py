"""`kdflow bench body`: a MoE teacher's body (the pass's forward without its head) under each way its experts can
run, side by side at one micro-batch: transformers' `grouped_mm`, `batched_mm` and `eager`, kdflow's
`kdflow_fused` (two Triton kernels, CUDA only: skipped elsewhere; `--moe-tiles` times it in more tilings than the
device's), and the body under torch.compile at the fixed shape (CUDA graphs on CUDA) with either experts:
`compiled` (`grouped_mm`) and `compiled_fused` (`kdflow_fused`). One JSON line per variant: tokens/s (the best of
`--repeats` after a warm-up; the warm-up's own seconds apart, for a compiled body its compile), how far its hidden
states are from eager's, or the one-line error that stopped it. The teacher is the
config's, loaded as the pass loads it (4-bit experts included); the ids are random, since the speed does not
depend on what they mean.
`precompute.experts` and `precompute.compile_body` then pick one for the pass (kdflow.tasks.teacher.body_variants);
`--write` sets both in the config file to the fastest variant whose hidden states are within `--tolerance` of
eager's (a compiled body only where it was compiled as the pass compiles it, by inductor).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kdflow.bench.args import bench_parser, tilings_option
from kdflow.bench.harness import emit, note


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    found = []
    for record in records(args):
        emit(record)
        found.append(record)
    if args.write:
        from kdflow.tasks.teacher.body_variants import fastest_correct, pass_settings
        from kdflow.tasks.teacher.tune_file import write_precompute_settings

        chosen = fastest_correct(found, args.tolerance, compiled=args.compile_backend == "inductor")
        if chosen is None:
            raise SystemExit(f"kdflow bench body: no variant ran within {args.tolerance} of eager: nothing written")
        settings = pass_settings(chosen)
        write_precompute_settings(Path(args.config), settings)
        note({"bench": "body", "wrote": {f"precompute.{key}": value for key, value in settings.items()},
              "config": args.config})
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kdflow.tasks.teacher.body_variants import EXPERTS_TOLERANCE, VARIANTS

    parser = bench_parser("body", __doc__, device=None, repeats=3, seq_len=None,
                          helps={"device": "where it runs (default: the config's teacher.device)",
                                 "seq_len": "tokens per sequence (default: the config's seq_len)"})
    parser.add_argument("--config", help="a config whose teacher is a MoE model (needed)")
    parser.add_argument("--micro-batch", type=int, help="sequences per forward (default: precompute.micro_batch)")
    parser.add_argument("--variants", type=lambda text: tuple(text.split(",")), default=VARIANTS,
                        help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--write", action="store_true",
                        help="set precompute.experts and precompute.compile_body in the config file to the fastest "
                             "correct variant")
    parser.add_argument("--tolerance", type=float, default=EXPERTS_TOLERANCE,
                        help="largest difference from eager's hidden states, relative to their largest, that --write "
                             f"counts as correct (default {EXPERTS_TOLERANCE}: bf16 rounding)")
    parser.add_argument("--moe-tiles", type=tilings_option, default=[],
                        help="more tilings of kdflow_fused's kernels to time beside the device's, a comma list of "
                             "BMxBNxBK:STAGES:WARPS (128x128x64:3:8); --write takes the device's")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for the compiled bodies (aot_eager: capture the graph without "
                             "codegen; --write then takes only the uncompiled ones)")
    return parser


def records(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    import torch

    from kdflow.schemas.config_io import load_config
    from kdflow.tasks.common.teacher_loading import load_teacher
    from kdflow.tasks.teacher.body_variants import measure_body_variants
    from kdflow.tasks.teacher.loading import output_rows

    if not args.config:
        raise SystemExit("kdflow bench body: --config CONFIG is needed (a config whose teacher is a MoE model)")
    config = load_config(args.config)
    model = load_teacher(config.teacher, device=args.device)
    device = next(model.parameters()).device
    rows, seq_len = args.micro_batch or config.precompute.micro_batch, args.seq_len or config.seq_len
    ids = torch.randint(0, output_rows(model), (rows, seq_len), generator=torch.Generator().manual_seed(0))
    shape = {"bench": "body", "layers": model.config.num_hidden_layers, "micro_batch": rows, "seq_len": seq_len,
             "four_bit": config.teacher.load_in_4bit, "device": str(device)}
    note(shape | {"note": "shape"})
    for record in measure_body_variants(model, ids.to(device), args.variants, args.repeats, args.compile_backend,
                                        args.moe_tiles):
        yield shape | record
