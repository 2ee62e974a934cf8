"""What every benchmark shares: a measurement in a fresh process, peak memory, JSON-line output, run roots.

A fresh process per measurement keeps one measurement's allocations out of another's peak: the parent runs
`python -m MODULE ARGS...` (`run_fresh`), the child prints its record as the last JSON line of its stdout,
and the parent reads it back (`ChildResult.record`) or turns a failure into an error record
(`ChildResult.failure`).

Peak memory on CPU is the resident set's high-water mark (VmHWM in /proc/self/status, reset to the current
resident set by writing 5 to /proc/self/clear_refs); on CUDA the allocator's peak statistics.

The rule every `kdflow bench NAME` exits by (`run_main`): a benchmark that printed no measurement exits 1,
with one line on stderr naming what it did not measure, even where its own `main` returned 0. A measurement is
a JSON line on stdout without an "error" or a "skipped" key (nor a "status" of "skipped"/"error"); a line that
only describes the setting is printed with `note` and counts as none.

A benchmark opens a config's run root with `kdflow.schemas.stage_settings.open_run_root(config)`, and one it
names by URL or path alone (a scratch copy, a records-only root) with `open_root`.
"""

from __future__ import annotations

import io
import json
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kdflow.schemas.storage import RunRoot


# --- JSON lines -----------------------------------------------------------------------------------------------


def emit(record: dict[str, Any]) -> None:
    """One record, one JSON line on stdout, flushed (a reader sees each as it is measured)."""
    print(json.dumps(record), flush=True)


def json_records(text: str) -> list[dict[str, Any]]:
    """The JSON objects among a process's output lines (lines that start with "{")."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def note(record: dict[str, Any]) -> None:
    """A JSON line that describes the setting (sizes, the machine), not a measurement: the exit rule ignores it."""
    if isinstance(sys.stdout, _Tally):
        sys.stdout.notes += 1
    emit(record)


def is_measurement(record: dict[str, Any]) -> bool:
    """Whether a JSON line reports something measured: not an error, not a skip (a skip or an error names its
    reason as a string; a summary's list of the steps it skipped is no skip of its own)."""
    status = str(record.get("status", ""))
    said = [record.get(key) for key in ("error", "skipped")]
    return not (any(isinstance(v, str) for v in said) or status.startswith(("error", "skipped", "failed")))


# --- the exit rule --------------------------------------------------------------------------------------------


class _Tally(io.TextIOBase):
    """stdout while a benchmark runs: every write passes through; each complete JSON line is classified."""

    def __init__(self, out: Any) -> None:
        super().__init__()
        self.out = out
        self.measured = 0
        self.notes = 0  # `note` lines still to come (each is counted when its line is complete)
        self.unmeasured: list[str] = []  # why each unmeasured line measured nothing
        self.pending = ""

    def write(self, text: str) -> int:
        self.out.write(text)
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self._count(line)
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def _count(self, line: str) -> None:
        if not line.startswith("{"):
            return
        try:
            record = json.loads(line)
        except ValueError:
            return
        if self.notes:
            self.notes -= 1
        elif is_measurement(record):
            self.measured += 1
        else:
            what = next((str(record[k]) for k in ("variant", "mode", "setting", "what") if k in record), "a record")
            why = record.get("error") or record.get("skipped") or record.get("reason") or record.get("status")
            self.unmeasured.append(f"{what}: {why}")


def run_main(name: str, main: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run a benchmark's `main(argv)` under the exit rule: -> its exit code, or 1 where it measured nothing."""
    tally = _Tally(sys.stdout)
    sys.stdout = tally
    try:
        code = main(argv)
    finally:
        sys.stdout = tally.out
        tally._count(tally.pending)
    if code or tally.measured:
        return code
    reasons = "; ".join(tally.unmeasured) or "it printed no measurement"
    print(f"kdflow bench {name}: measured nothing ({reasons})", file=sys.stderr, flush=True)
    return 1


# --- run roots ------------------------------------------------------------------------------------------------


def open_root(url: str) -> RunRoot:
    """The run root at a URL or local path that no config names (with a config: `open_run_root(config)`)."""
    from kdflow.schemas.storage import RunRoot

    return RunRoot(url)


# --- a measurement in a fresh process -------------------------------------------------------------------------


@dataclass
class ChildResult:
    """How a fresh-process measurement ended: its exit code, its last JSON line, its last stderr line."""

    returncode: int
    record: dict[str, Any] | None  # the last line of stdout that starts with "{", parsed; None without one
    stderr_tail: str  # the last line of stderr ("" when it wrote none)
    wall_s: float  # seconds from start to exit, process start-up included

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.record is not None

    @property
    def killed(self) -> bool:
        """Killed by SIGKILL: on a benchmark's child, the kernel's OOM killer."""
        return self.returncode in (-9, 137)

    def failure(self) -> dict[str, Any]:
        """The error fields of a child that did not finish: out of memory when killed, else its last words."""
        if self.killed:
            return {"error": "out of memory", "killed": True}
        return {"error": self.stderr_tail or f"exit {self.returncode}"}


def run_fresh(module: str, argv: list[str], env: dict[str, str] | None = None,
              timeout: float | None = None) -> ChildResult:
    """Run `python -m module *argv` in a fresh interpreter and wait for it; its output is captured."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", module, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    stderr_lines = done.stderr.strip().splitlines()
    return ChildResult(returncode=done.returncode, record=json.loads(lines[-1]) if lines else None,
                       stderr_tail=stderr_lines[-1] if stderr_lines else "",
                       wall_s=time.perf_counter() - started)


# --- peak memory ----------------------------------------------------------------------------------------------


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def reset_peak(device: Any) -> int:
    """Start a peak-memory window on a torch device; -> the bytes in use at its start (the baseline)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    return proc_status_bytes("VmRSS")


def peak_bytes(device: Any) -> int:
    """The most bytes in use since `reset_peak` (CUDA: allocated tensors; CPU: the resident set)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return proc_status_bytes("VmHWM")


def synchronise(device: Any) -> None:
    """Wait for the device's queued work (a timer must not stop before it); nothing to wait for on CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark (VmHWM: reset by exec, unlike getrusage's ru_maxrss, which
    keeps the parent's peak at fork time)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class HostMemoryPeaks:
    """The peaks of this process's anonymous and file-backed resident memory (RssAnon, RssFile of
    /proc/self/status), sampled every `every_s` by a thread while the block runs. VmHWM alone counts a memory-mapped
    checkpoint's touched pages, which the kernel can drop; RssAnon is what the process itself holds."""

    def __init__(self, every_s: float = 0.02) -> None:
        import threading

        self.every_s, self.peaks = every_s, {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            for field in self.peaks:
                self.peaks[field] = max(self.peaks[field], proc_status_bytes(field))
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> HostMemoryPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class PeakMemory:
    """Peak memory growth over a baseline taken when it is made (after the inputs exist); device "cpu"/"cuda"."""

    def __init__(self, device: str) -> None:
        import torch

        self.device = device
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
            self.method = "cuda max_memory_allocated - baseline"
            return
        try:  # Linux: writing 5 resets VmHWM to the current RSS, so input creation does not count.
            Path("/proc/self/clear_refs").write_text("5")
            self.baseline = proc_status_bytes("VmRSS")
            self.method = "VmHWM (reset after inputs) - VmRSS baseline"
        except OSError:
            self.baseline = proc_status_bytes("VmHWM")
            self.method = "VmHWM - VmHWM after inputs (lower bound)"

    def growth_bytes(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return proc_status_bytes("VmHWM") - self.baseline
