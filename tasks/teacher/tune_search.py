"""Finding the teacher's micro-batch: candidates in fresh processes, a table, a recommendation (no Prefect here).

Used by `kdflow tune precompute` and by the `tune-precompute` flow. Each candidate runs
`python -m kdflow.tasks.teacher.tune_worker` (one process, its own process group, killed after `timeout_s`),
so an out-of-memory or a driver error ends that candidate only and is reported by its exit code. After
an out-of-memory the larger candidates are skipped (memory grows with the micro-batch) unless
`keep_going`; other failures do not stop the search, and a user error (exit 2: the same for every
candidate) ends it with that error. The checks that need no process run first (`check_tune_inputs`). At the
recommended micro-batch, one more worker then times both heads (`run_trial("heads")`) and, for a MoE teacher,
another its experts implementations (`run_trial("experts")`), so that `precompute.head` and `precompute.experts`
can name the fastest that this machine ran correctly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kdflow.schemas.commits import list_commits, stage_dir
from kdflow.schemas.config import PrecomputeConfig
from kdflow.schemas.errors import ConfigError, KDFlowError, StoreError, first_line
from kdflow.schemas.protocol import EXIT_CUDA_OOM, EXIT_USER_ERROR, describe_exit_code
from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import find_topk_stores
from kdflow.tasks.common.launch import kill_group, run_child

TUNE_WORKER = "kdflow.tasks.teacher.tune_worker"
OUT_OF_MEMORY_EXIT_CODES = frozenset({EXIT_CUDA_OOM, 128 + 9})  # CUDA OOM; SIGKILL, what the kernel's OOM killer sends


@dataclass
class Candidate:
    """One micro-batch's outcome: status ok | out of memory | failed | timed out | skipped."""

    micro_batch: int
    status: str
    exit_code: int | None = None
    message: str = ""
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float | None:
        return self.record.get("tokens_per_s") if self.status == "ok" else None

    def as_dict(self) -> dict[str, Any]:
        return {"micro_batch": self.micro_batch, "status": self.status, "exit_code": self.exit_code,
                "message": self.message, **{k: v for k, v in self.record.items() if k not in ("micro_batch", "status")}}


def parse_micro_batches(text: str | list[int] | None) -> list[int]:
    """'8,14,28' (or a list) -> sorted distinct sizes; empty, non-integer or non-positive entries are errors."""
    items = text if isinstance(text, list) else [p.strip() for p in (text or "").split(",") if p.strip()]
    if not items:
        raise ConfigError("the micro-batch list is empty: give sizes such as --micro-batches 8,14,28,56")
    sizes = []
    for item in items:
        try:
            size = int(item)
        except (TypeError, ValueError):
            raise ConfigError(f"micro-batch {item!r} is not an integer (expected sizes such as 8,14,28,56)") from None
        if size < 1:
            raise ConfigError(f"micro-batch {size} must be >= 1")
        sizes.append(size)
    return sorted(set(sizes))


def default_micro_batches(precompute: PrecomputeConfig) -> list[int]:
    """Around the configured micro-batch: half, itself, twice and four times it."""
    current = precompute.micro_batch
    return sorted({max(1, current // 2), current, 2 * current, 4 * current})


def check_tune_inputs(run_root: RunRoot, settings: TeacherPassSettings, *, seq_len_given: bool = True,
                      weights: bool = True) -> str:
    """What can be checked without a process: the teacher's config loads and admits top_k and seq_len; there are
    token shards of seq_len, or seq_len was given. -> where the candidates' rows will come from."""
    teacher, seq_len = settings.teacher, settings.seq_len
    store = stage_dir(run_root, "tokens")
    records = list_commits(run_root, store, "tokens")
    if records:
        first = records[min(records)]
        if first.extra.seq_len is not None and first.extra.seq_len != seq_len:
            raise StoreError(f"the token shards in {run_root.display(store)} have seq_len {first.extra.seq_len}, the "
                             f"config says {seq_len}")
        rows_from = f"{len(records)} token shards in {run_root.display(store)}"
    elif not seq_len_given:
        raise ConfigError(f"no token shards in {run_root.display(store)} and no seq_len in the config: set seq_len "
                          "(tokens of that length are made up from Python's documentation) or run tokenise first")
    else:
        rows_from = f"no token shards yet: Python's documentation in rows of {seq_len} tokens"
    from kdflow.tasks.common.hub_access import check_hub_teacher
    from kdflow.tasks.teacher.loading import check_teacher_limits, load_teacher_config
    from kdflow.tasks.teacher.sampling import check_sampling_fits

    check_hub_teacher(teacher)  # not cached and no hub: one line now, not after a minute of retries
    try:
        teacher_config = load_teacher_config(teacher, weights)
    except KDFlowError:
        raise
    except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError... for a bad model
        raise ConfigError(f"teacher {teacher.model!r} cannot be loaded: {first_line(error)}") from None
    check_teacher_limits(teacher_config, top_k=settings.precompute.top_k, seq_len=seq_len)
    check_sampling_fits(settings.precompute, teacher_config)
    if teacher.load_in_4bit:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("teacher.load_in_4bit needs bitsandbytes: pip install bitsandbytes")
    return rows_from


def committed_micro_batches(run_root: RunRoot, settings: TeacherPassSettings) -> set[int]:
    """Micro-batches the committed shards of this config's top-K stores were computed with."""
    sizes = set()
    for tag in find_topk_stores(run_root, settings.teacher, settings.precompute):
        for record in list_commits(run_root, stage_dir(run_root, "topk", tag), "topk", tag).values():
            if record.extra.micro_batch is not None:
                sizes.add(record.extra.micro_batch)
    return sizes


def worker_options(device_setting: str, random_weights: bool, memory_gib: float | None,
                   what: str = "--memory-gib") -> tuple[str, ...]:
    """The tune worker's options for a teacher made from its config (`random_weights`) and a cap of `memory_gib`
    (checked first: a CUDA device, a positive size; a one-line ConfigError naming `what` otherwise)."""
    options: tuple[str, ...] = ("--random-weights",) if random_weights else ()
    if memory_gib is None:
        return options
    from kdflow.tasks.common.device_memory import check_capped_device

    check_capped_device(device_setting, memory_gib, what)
    return (*options, "--memory-gib", f"{memory_gib:g}")


def run_candidate(config_path: str, micro_batch: int, *, batches: int, warmup: int, timeout_s: float,
                  on_log: Callable[[str], None] = lambda line: None, worker_args: tuple[str, ...] = ()) -> Candidate:
    """One candidate in a fresh worker process, killed (with its process group) after `timeout_s`; `worker_args`:
    the worker's `--random-weights` and `--memory-gib N`."""
    args = ["--config", config_path, "--micro-batch", str(micro_batch), "--batches", str(batches),
            "--warmup", str(warmup), *worker_args]
    status, exit_code, message, result = _in_worker(args, timeout_s, on_log)
    return Candidate(micro_batch, status, exit_code, message, result or {})


def has_experts(settings: TeacherPassSettings, weights: bool = True) -> bool:
    """Whether the teacher is a MoE model (its experts implementations are then worth timing)."""
    from kdflow.tasks.common.fused_experts import expert_count
    from kdflow.tasks.teacher.loading import load_teacher_config

    return expert_count(load_teacher_config(settings.teacher, weights)) is not None


@dataclass(frozen=True)
class TrialKind:
    """A trial after the search: the field of its outcome holding its records, the one holding its
    recommendation, and the `precompute` setting that recommendation is for."""

    records: str
    recommended: str
    setting: str


TRIALS = {"heads": TrialKind("heads", "recommended_head", "head"),
          "experts": TrialKind("experts", "recommended_experts", "experts")}


def run_trial(kind: str, config_path: str, micro_batch: int, *, repeats: int, timeout_s: float,
              on_log: Callable[[str], None] = lambda line: None, worker_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """One more trial at the recommended `micro_batch` in a fresh worker process: `experts` (a MoE teacher's
    experts implementations, `tune_trial.measure_experts`) or `heads` (both heads, `tune_heads.measure_heads`) ->
    {"micro_batch", "status", "message", its records, its recommendation or None}. A failure is its status, never
    an exception: the micro-batch's recommendation stands without it."""
    fields = TRIALS[kind]
    args = ["--config", config_path, "--micro-batch", str(micro_batch), "--batches", str(repeats), f"--{kind}",
            *worker_args]
    status, _, message, result = _in_worker(args, timeout_s, on_log)
    result = result or {}
    return {"micro_batch": micro_batch, "status": status, "message": message,
            fields.records: result.get(fields.records, []), fields.recommended: result.get(fields.recommended)}


def _in_worker(args: list[str], timeout_s: float,
               on_log: Callable[[str], None]) -> tuple[str, int | None, str, dict[str, Any] | None]:
    """The tune worker with `args`, killed (with its process group) after `timeout_s` -> (status ok | out of memory
    | failed | timed out, exit code, message, its result line)."""
    timer: list[threading.Timer] = []
    timed_out = threading.Event()

    def started(pid: int) -> None:
        def expire() -> None:
            timed_out.set()
            kill_group(pid)

        timer.append(threading.Timer(timeout_s, expire))
        timer[0].daemon = True
        timer[0].start()

    try:
        outcome = run_child(TUNE_WORKER, args, on_started=started, on_log=lambda pid, line: on_log(line))
    finally:
        for pending in timer:
            pending.cancel()
    message = (outcome.errors[-1].get("message", "") if outcome.errors else "")
    if timed_out.is_set():
        return "timed out", outcome.exit_code, f"killed after {timeout_s:g} s", None
    if outcome.exit_code == 0 and outcome.result is not None:
        return "ok", 0, "", outcome.result
    status = "out of memory" if outcome.exit_code in OUT_OF_MEMORY_EXIT_CODES else "failed"
    return status, outcome.exit_code, message or describe_exit_code(outcome.exit_code), None


Runner = Callable[[int], Candidate]


def run_candidates(sizes: list[int], runner: Runner, *, keep_going: bool = False,
                   on_candidate: Callable[[Candidate], None] = lambda c: None) -> list[Candidate]:
    """Every size in ascending order through `runner`; after an out-of-memory the larger ones are skipped."""
    results: list[Candidate] = []
    out_of_memory_at = None
    for size in sorted(sizes):
        if out_of_memory_at is not None and not keep_going:
            candidate = Candidate(size, "skipped", None, f"micro-batch {out_of_memory_at} ran out of memory")
        else:
            candidate = runner(size)
            if candidate.exit_code == EXIT_USER_ERROR:
                raise ConfigError(candidate.message or "the tune worker reported a user error")
            if candidate.status == "out of memory" and out_of_memory_at is None:
                out_of_memory_at = size
        results.append(candidate)
        on_candidate(candidate)
    return results


def tune(config_path: str, sizes: list[int], *, batches: int = 3, warmup: int = 1, timeout_s: float = 1800.0,
         keep_going: bool = False, on_log: Callable[[str], None] = lambda line: None,
         on_candidate: Callable[[Candidate], None] = lambda c: None,
         worker_args: tuple[str, ...] = ()) -> list[Candidate]:
    """Every candidate in its own worker process, on the resolved config at `config_path` (the caller writes it:
    `kdflow.tasks.common.launch.config_file`)."""
    def runner(size: int) -> Candidate:
        return run_candidate(config_path, size, batches=batches, warmup=warmup, timeout_s=timeout_s, on_log=on_log,
                             worker_args=worker_args)

    return run_candidates(sizes, runner, keep_going=keep_going, on_candidate=on_candidate)


def recommend(candidates: list[Candidate], headroom: float) -> Candidate | None:
    """The fastest candidate that ran and left at least `headroom` (a fraction of the total memory) free."""
    fitting = [c for c in candidates if c.status == "ok" and c.record.get("headroom", 0.0) >= headroom]
    return max(fitting, key=lambda c: (c.tokens_per_s, -c.micro_batch), default=None)


def summary(candidates: list[Candidate], headroom: float) -> dict[str, Any]:
    """The table's rows, the recommendation, and how its speed compares with the fastest candidate that ran."""
    best = max((c for c in candidates if c.status == "ok"), key=lambda c: c.tokens_per_s, default=None)
    chosen = recommend(candidates, headroom)
    return {"candidates": [c.as_dict() for c in candidates], "headroom_required": headroom,
            "recommended_micro_batch": chosen.micro_batch if chosen else None,
            "recommended_tokens_per_s": chosen.tokens_per_s if chosen else None,
            "fastest_micro_batch": best.micro_batch if best else None,
            "fastest_tokens_per_s": best.tokens_per_s if best else None,
            "recommended_over_fastest": (round(chosen.tokens_per_s / best.tokens_per_s, 4) if chosen and best
                                         else None)}


def table(candidates: list[Candidate], headroom: float, markdown: bool = False) -> str:
    """A fixed-width (or markdown) table: one row per candidate, the recommendation marked."""
    chosen = recommend(candidates, headroom)
    cuda = any(c.record.get("memory") == "cuda" for c in candidates)
    memory_keys = ["peak_allocated_mib", "peak_reserved_mib"] if cuda else ["peak_rss_mib"]
    header = ["micro_batch", "status", "tok/s",
              *(["peak alloc MiB", "peak reserved MiB"] if cuda else ["peak RSS MiB"]),
              "total MiB", "headroom", ""]
    rows = []
    for c in candidates:
        r = c.record
        status = c.status + (f" (exit {c.exit_code})" if c.status != "ok" and c.exit_code else "")
        if chosen is c:
            note = "<- recommended"
        elif c.status != "ok":
            note = c.message
        else:
            note = "below headroom" if r.get("headroom", 0.0) < headroom else ""
        rows.append([str(c.micro_batch), status, _num(c.tokens_per_s), *[_num(r.get(key)) for key in memory_keys],
                     _num(r.get("total_mib")), f"{r['headroom']:.1%}" if "headroom" in r else "-", note])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]

    def line(row: list[str]) -> str:
        cells = [cell.ljust(width) if i == 1 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))]
        return ("  ".join(cells) + "  " + row[-1]).rstrip()

    return "\n".join(line(row) for row in [header, *rows])


def experts_report(outcome: dict[str, Any], configured: str) -> str:
    """`run_trial("experts")`'s outcome as lines: each implementation's tokens/s and distance from eager, the
    recommendation."""
    rows = [(r["variant"], f"{r['tokens_per_s']:>12,.0f} tok/s  {r['max_rel_diff']:.2e} from eager"
             if "tokens_per_s" in r else r.get("skipped") or r.get("error", "")) for r in outcome["experts"]]
    scope = "the body: embeddings to the final norm" + (", compiled as the pass compiles it (precompute.compile_body)"
                                                         if outcome.get("compiled_body") else "")
    return _trial_report(outcome, "experts implementations", scope, rows,
                         "precompute.experts", outcome["recommended_experts"], configured,
                         "no experts implementation matched eager's hidden states")


def heads_report(outcome: dict[str, Any], configured: str) -> str:
    """`run_trial("heads")`'s outcome as lines: each head's tokens/s (the pass's step) and, for the tiled ones, their
    distance from the slab loop's targets (or why one was not timed); the recommendation."""
    rows = []
    for r in outcome["heads"]:
        if "tokens_per_s" not in r:
            rows.append((r["head"], r.get("skipped", "")))
            continue
        runs = f" (runs {r['runs']})" if r["runs"] != r["head"] else ""
        detail = f"{r['tokens_per_s']:>12,.0f} tok/s{runs}"
        if "max_logprob_diff" in r:
            detail += f"  log-probs {r['max_logprob_diff']:.1e}, tail {r['max_tail_diff']:.1e} from slab"
        rows.append((r["head"], detail))
    return _trial_report(outcome, "heads", "the pass's step: body, head, host copy", rows, "precompute.head",
                         outcome["recommended_head"], configured, "no head ran")


def _trial_report(outcome: dict[str, Any], what: str, scope: str, rows: list[tuple[str, str]], key: str,
                  chosen: str | None, configured: str, none: str) -> str:
    if outcome["status"] != "ok":
        return f"{what} not timed: {outcome['status']}: {outcome['message']}"
    width = max((len(name) for name, _ in rows), default=0)
    lines = [f"{what} at micro-batch {outcome['micro_batch']} ({scope}):"]
    lines += [f"  {name.ljust(width)}  {detail}" for name, detail in rows]
    lines.append(f"recommended: {key}: {chosen} (the config has {configured})" if chosen else
                 f"{none}: {key} stays as it is")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
