"""`kdflow tune precompute CONFIG.yaml`: the teacher's fastest micro-batch that fits, measured on this machine.

Each candidate loads the configured teacher in a fresh process and times a few real micro-batches
(`kdflow.tasks.teacher.tune_search`); the table shows tok/s, peak memory and headroom, and the recommendation is the
fastest candidate that leaves `--headroom` of the memory free. `--write` puts it into CONFIG.yaml as
`precompute.micro_batch`, editing that one value in place (comments and layout kept), so that the run
uses it from its first shard to its last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from kdflow.schemas.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdflow tune precompute", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("--micro-batches", help="comma list of candidates (default: half, 1x, 2x and 4x the config's)")
    parser.add_argument("--headroom", type=float, default=0.10,
                        help="fraction of the device's memory (CPU: the machine's) left free at the peak "
                             "(default 0.10)")
    parser.add_argument("--batches", type=int, default=3, help="timed micro-batches per candidate (after one warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed micro-batches per candidate first")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="a candidate's process is killed after this")
    parser.add_argument("--keep-going", action="store_true", help="try larger candidates after an out-of-memory too")
    parser.add_argument("--write", action="store_true",
                        help="write the recommendation into CONFIG as precompute.micro_batch")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line after the table")
    parser.add_argument("--verbose", action="store_true", help="show the candidates' own log lines (stderr)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from kdflow.schemas.config_io import load_config
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.common.launch import config_file
    from kdflow.tasks.teacher import tune_search

    if not 0.0 <= args.headroom < 1.0:
        raise ConfigError(f"--headroom must be a fraction in [0, 1), got {args.headroom}")
    if args.batches < 1 or args.warmup < 0 or args.timeout_s <= 0:
        raise ConfigError("--batches must be >= 1, --warmup >= 0 and --timeout-s > 0")
    overrides = dict(_override(item) for item in args.set)
    config = load_config(args.config, overrides)
    sizes = (tune_search.parse_micro_batches(args.micro_batches) if args.micro_batches is not None
             else tune_search.default_micro_batches(config.precompute))
    run_root, settings = open_run_root(config), teacher_pass_settings(config)
    rows_from = tune_search.check_tune_inputs(run_root, settings,
                                              seq_len_given=_seq_len_given(args.config, overrides))
    if args.write:
        _check_writable(Path(args.config), settings, tune_search, run_root)
    from kdflow.tasks.common.models import resolve_device

    device = resolve_device(config.teacher.device)
    on = f"{device} ({config.teacher.device})" if config.teacher.device == "auto" else str(device)
    pre = config.precompute
    head = f"head {pre.sampling.head}, " if pre.targets == "hybrid" else ""
    targets = (f"top_k {pre.top_k}" if pre.targets == "topk"
               else f"{pre.targets} targets ({head}{pre.sampling.samples} samples)")
    print(f"kdflow tune precompute: {config.teacher.model} on {on}, seq_len {config.seq_len}, "
          f"{targets}; candidates {','.join(map(str, sizes))}; rows: {rows_from}", flush=True)

    def report(candidate: tune_search.Candidate) -> None:
        if candidate.status == "ok":
            detail = f"{candidate.tokens_per_s:,.0f} tok/s, headroom {candidate.record['headroom']:.1%}"
        else:
            detail = candidate.message
        print(f"  micro-batch {candidate.micro_batch}: {candidate.status}: {detail}", flush=True)

    with config_file(config, "kdflow-tune-") as path:
        candidates = tune_search.tune(path, sizes, batches=args.batches, warmup=args.warmup,
                                      timeout_s=args.timeout_s, keep_going=args.keep_going, on_candidate=report,
                                      on_log=_worker_log if args.verbose else _quiet)
    print()
    print(tune_search.table(candidates, args.headroom))
    result = tune_search.summary(candidates, args.headroom)
    chosen = result["recommended_micro_batch"]
    if chosen is None:
        print(f"\nno candidate ran with {args.headroom:.0%} headroom; try smaller micro-batches or "
              "teacher.load_in_4bit")
    else:
        print(f"\nrecommended: precompute.micro_batch: {chosen} ({result['recommended_tokens_per_s']:,.0f} tok/s, "
              f"{result['recommended_over_fastest']:.1%} of the fastest candidate)")
        if args.write:
            write_micro_batch(Path(args.config), chosen)
            print(f"written to {args.config}")
    if args.json:
        print(json.dumps({"tune": "precompute", **result}))
    return 0 if chosen is not None else 1


def _worker_log(line: str) -> None:
    print(f"    | {line}", file=sys.stderr, flush=True)


def _quiet(line: str) -> None:
    pass


def _override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"--set expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def _seq_len_given(path: str, overrides: dict[str, Any]) -> bool:
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return "seq_len" in data or "seq_len" in overrides


def _check_writable(path: Path, settings: Any, search: Any, run_root: Any) -> None:
    """--write must be able to edit the file, and must not change the micro-batch of a run already under way."""
    if not os.access(path, os.W_OK):
        raise ConfigError(f"--write: {path} is not writable")
    computed = search.committed_micro_batches(run_root, settings)
    if computed:
        raise ConfigError(f"--write: this config's top-K store already has shards computed with micro_batch "
                          f"{','.join(map(str, sorted(computed)))}; the micro-batch stays fixed for a run "
                          "(tune without --write)")


# --- editing one value of a YAML file in place -----------------------------------------------------------

_TOP_KEY = re.compile(r"^(?P<key>[A-Za-z_][\w.-]*)\s*:(?P<rest>.*)$")


def set_nested_value(text: str, section: str, key: str, value: Any) -> str:
    """`section: {key: value}` set in YAML text, keeping every other line (comments included) as it is.

    A block-style `section:` gets its `key:` line's value replaced (a trailing comment kept) or a new line
    under it; without the section, one is appended. The caller checks the result parses to what it should.
    """
    lines = text.splitlines(keepends=True)
    rendered = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    start = next((i for i, line in enumerate(lines) if (m := _TOP_KEY.match(line)) and m["key"] == section), None)
    if start is None:
        tail = "" if not text or text.endswith("\n") else "\n"
        return text + f"{tail}{section}:\n  {key}: {rendered}\n"
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
        end += 1
    children = [line for line in lines[start + 1:end] if line.strip() and not line.lstrip().startswith("#")]
    indent = re.match(r"^[ \t]*", children[0]).group(0) if children else "  "
    pattern = re.compile(rf"^{re.escape(indent)}{re.escape(key)}\s*:"
                         rf"(?P<value>[^#\n]*?)(?P<comment>\s+#.*)?(?P<eol>\r?\n?)$")
    for i in range(start + 1, end):
        match = pattern.match(lines[i])
        if match:
            lines[i] = f"{indent}{key}: {rendered}{match['comment'] or ''}{match['eol']}"
            return "".join(lines)
    if not lines[start].endswith("\n"):
        lines[start] += "\n"
    lines.insert(start + 1, f"{indent}{key}: {rendered}\n")
    return "".join(lines)


def write_micro_batch(path: Path, micro_batch: int) -> None:
    """precompute.micro_batch = micro_batch in the YAML file, in place; refused (nothing written) when the edit
    would change anything else, e.g. a flow-style `precompute: {...}`."""
    text = path.read_text(encoding="utf-8")
    before = yaml.safe_load(text) or {}
    edited = set_nested_value(text, "precompute", "micro_batch", micro_batch)
    expected = dict(before)
    expected["precompute"] = {**(before.get("precompute") or {}), "micro_batch": micro_batch}
    try:
        after = yaml.safe_load(edited)
    except yaml.YAMLError:
        after = None
    if after != expected:
        raise ConfigError(f"--write: cannot edit {path} in place; set precompute.micro_batch: {micro_batch} "
                          "there by hand")
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(edited, encoding="utf-8")
    os.chmod(temporary, path.stat().st_mode & 0o7777)
    os.replace(temporary, path)
