"""The command line every benchmark shares: `kdflow bench NAME`'s parser with the options the benches word the same
way (where it runs, where its inputs are kept, how often it repeats, threads, seed, the top-K's K, the sequence
length), each bench giving only its own default; it then adds only its own options.

`options(parser, **values)` is the same parser's result without a command line: how Python code (`kdflow bench gpu`)
sets a bench's options by name and calls its `records`, so that no one parses a bench's printed lines.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from kdflow.schemas.errors import first_paragraph

NOT_TAKEN: Any = object()  # a shared option this bench does not take (None is a default: "from the config")

HELP = {
    "device": "where it runs",
    "run_root": "where its inputs are prepared and kept for reruns",
    "repeats": "timed runs of each measurement; the best is reported",
    "threads": "torch CPU threads (0: torch's default)",
    "seed": "the random seed of its inputs",
    "top_k": "K of the teacher's top-K",
    "seq_len": "tokens per sequence",
}


def bench_parser(name: str, doc: str | None, *, device: Any = NOT_TAKEN, devices: Sequence[str] | None = None,
                 run_root: Any = NOT_TAKEN, repeats: Any = NOT_TAKEN, threads: bool = False, seed: Any = NOT_TAKEN,
                 top_k: Any = NOT_TAKEN, seq_len: Any = NOT_TAKEN, helps: dict[str, str] | None = None
                 ) -> argparse.ArgumentParser:
    """`kdflow bench NAME`'s parser (its description: the first line of `doc`, the bench module's docstring) with
    the shared options this bench takes, at its defaults. `run_root=True`: runs/bench-NAME. `devices`: the
    choices of --device (default: any name torch takes). `helps`: option -> this bench's own help text."""
    parser = argparse.ArgumentParser(prog=f"kdflow bench {name}", description=first_paragraph(doc))
    helps = HELP | (helps or {})

    def shared(option: str, default: Any, kind: type, **more: Any) -> None:
        if default is NOT_TAKEN:
            return
        text = helps[option] + ("" if default is None or "default" in helps[option] else f" (default {default})")
        parser.add_argument(f"--{option.replace('_', '-')}", type=kind, default=default, help=text, **more)

    shared("device", device, str, **({"choices": list(devices)} if devices else {}))
    shared("run_root", f"runs/bench-{name}" if run_root is True else run_root, str)
    shared("repeats", repeats, int)
    shared("threads", 0 if threads else NOT_TAKEN, int)
    shared("seed", seed, int)
    shared("top_k", top_k, int)
    shared("seq_len", seq_len, int)
    return parser


def options(parser: argparse.ArgumentParser, **values: Any) -> argparse.Namespace:
    """The parser's defaults with `values` in place of some (option names as attributes: `seq_len`); a name the
    parser does not have is an error, as an unknown option is on the command line."""
    args = parser.parse_args([])
    unknown = sorted(set(values) - set(vars(args)))
    if unknown:
        raise TypeError(f"{parser.prog} has no option {', '.join(unknown)}")
    for key, value in values.items():
        setattr(args, key, value)
    return args


def tilings_option(text: str) -> list[Any]:
    """An option's comma list of Triton GEMM tilings, BMxBNxBK:STAGES:WARPS (kdflow.tasks.teacher.gemm_tiles)."""
    from kdflow.tasks.teacher.gemm_tiles import parse_tilings

    try:
        return parse_tilings(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
