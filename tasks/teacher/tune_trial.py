"""One micro-batch candidate of the teacher pass, measured in this process (the tune worker's body).

The teacher loads exactly as the pass loads it (`load_teacher`: whole-model placement, 4-bit, dtype), and
each micro-batch does what the pass does per micro-batch: the ids to the device, the body and the chunked
top-K (`topk_step`: the pass's chunk size and head, the body compiled where `precompute.compile_body` says) and
the one host copy (`HostCopies`), or for sampled and hybrid targets the chunked sampler and the copy of its fields
(`SampledPass`). The rows are the
run's own token shards, or, before any exist, Python's documentation tokenised with the run's tokenizer
and packed to `seq_len`. After `warmup` untimed micro-batches, `batches` timed ones give tokens per second;
the peak memory covers all of them. One process per candidate (`kdflow.tasks.teacher.tune_worker`): an
out-of-memory or a driver error ends that candidate only.

Memory: on CUDA the allocator's peaks (allocated, reserved) and the device's free memory at the end; the
headroom is what would have been free at the peak, `free_now - (peak_reserved - reserved_now)`, so the CUDA
context and other processes on the device count. On the CPU, the resident-set peak (VmHWM) and, likewise,
`MemAvailable + RSS_now - peak_RSS`. Headroom fractions are of the device's (or machine's) total memory.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdflow.schemas.commits import list_commits, stage_dir
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.shards import read_token_shard
from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common import faults
from kdflow.tasks.common.models import resolve_device, resolve_dtype
from kdflow.tasks.common.random_teacher import build_random_teacher
from kdflow.tasks.common.teacher_loading import load_teacher
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.common.units import MIB
from kdflow.tasks.teacher.body_variants import EXPERTS_TOLERANCE, measure_pass_experts, use_experts
from kdflow.tasks.teacher.host_writer import HostCopies
from kdflow.tasks.teacher.loading import (check_teacher_limits, check_tokenizer_fits, load_teacher_config, output_rows,
                                          vocab_rows)
from kdflow.tasks.teacher.precompute import deterministic_algorithms
from kdflow.tasks.teacher.sampled_pass import SampledPass, sampled_codec, sampled_step
from kdflow.tasks.teacher.topk import topk_step


def committed_token_shards(run_root: RunRoot) -> list[str]:
    """Data files of the committed token shards, in shard order (any fingerprint: only their rows are used)."""
    store = stage_dir(run_root, "tokens")
    records = list_commits(run_root, store, "tokens")
    return [f"{store}/{records[i].data_file}" for i in sorted(records)]


def token_rows(run_root: RunRoot, seq_len: int, tokenizer: Any, rows: int) -> tuple[np.ndarray, str]:
    """`rows` sequences of `seq_len` ids (repeated when there are fewer) -> (ids (rows, T), where they came from)."""
    parts, have = [], 0
    for path in committed_token_shards(run_root):
        parts.append(read_token_shard(run_root, path, seq_len))
        have += len(parts[-1])
        if have >= rows:
            break
    source = f"token shards in {run_root.display(stage_dir(run_root, 'tokens'))}"
    if not have:
        parts, source = [_packed_documentation(tokenizer, seq_len)], "Python's documentation, tokenised"
    ids = np.concatenate(parts)
    return np.resize(ids, (rows, seq_len)) if len(ids) < rows else ids[:rows], source


def _packed_documentation(tokenizer: Any, seq_len: int) -> np.ndarray:
    """Python's shipped documentation, each topic followed by EOS, cut into `seq_len` rows (at least one)."""
    from pydoc_data.topics import topics

    stream: list[int] = []
    for text in topics.values():
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        stream.append(tokenizer.eos_token_id)
    rows = max(1, len(stream) // seq_len)
    return np.resize(np.asarray(stream, dtype=np.int32), (rows, seq_len))


def _proc_kib(path: str, field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path(path).read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def memory_record(device: torch.device) -> dict[str, Any]:
    """Peak memory of this process on `device` and the headroom left at that peak (module docstring)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved, peak_reserved = torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device)
        headroom = free - (peak_reserved - reserved)
        return {"memory": "cuda", "peak_allocated_mib": round(torch.cuda.max_memory_allocated(device) / MIB, 1),
                "peak_reserved_mib": round(peak_reserved / MIB, 1), "total_mib": round(total / MIB, 1),
                "headroom_mib": round(headroom / MIB, 1), "headroom": round(headroom / total, 4)}
    peak_rss, rss = _proc_kib("/proc/self/status", "VmHWM") << 10, _proc_kib("/proc/self/status", "VmRSS") << 10
    total, available = _proc_kib("/proc/meminfo", "MemTotal") << 10, _proc_kib("/proc/meminfo", "MemAvailable") << 10
    headroom = available + rss - peak_rss
    return {"memory": "cpu rss", "peak_rss_mib": round(peak_rss / MIB, 1), "total_mib": round(total / MIB, 1),
            "headroom_mib": round(headroom / MIB, 1), "headroom": round(headroom / max(total, 1), 4)}


def pass_step(settings: TeacherPassSettings, model: torch.nn.Module, vocab: int, micro_batch: int,
              device: torch.device) -> tuple[Callable[[torch.Tensor, int], tuple[Any, Callable[[], None]]], int]:
    """The pass's work on one micro-batch of `micro_batch` rows, as ShardComputer builds it for the config's targets
    (top-K: the chunked top-K and its host copy; sampled, hybrid: the sampler and its six fields' host copy) ->
    (step: (ids on the device, micro-batch index) -> (CUDA event or None, release), chunk_tokens). `vocab`: the
    teacher's output rows."""
    pre = settings.precompute
    if pre.targets != "topk":  # no store here: the codec without a renumbering table (its shapes are what counts)
        candidate = dataclasses.replace(settings, precompute=pre.model_copy(update={"micro_batch": micro_batch}))
        sampled = SampledPass(candidate, model, sampled_codec(pre, settings.seq_len, vocab),
                              sampled_step(model, pre, vocab).chunk_tokens, slots=2)

        def sample(input_ids: torch.Tensor, index: int) -> tuple[Any, Callable[[], None]]:
            *_, ready, release = sampled(input_ids, micro_batch, shard=0, first_row=index * micro_batch)
            return ready, release

        return sample, sampled.chunk_tokens
    step = topk_step(model, pre, vocab)  # as the pass runs it: its head, its body compiled or not
    storage = torch.float16 if pre.logprobs_dtype == "float16" else torch.float32
    host = HostCopies(device, (micro_batch, settings.seq_len, pre.top_k), storage, slots=2)

    def topk(input_ids: torch.Tensor, index: int) -> tuple[Any, Callable[[], None]]:
        *_, ready, release = host.copy(*step(input_ids))  # (B, T, K), (B, T, K), (B, T)
        return ready, release

    return topk, step.chunk_tokens


@dataclasses.dataclass
class Trial:
    """A teacher loaded as the pass loads it (4-bit, dtype, `precompute.experts`) and the rows a trial runs."""

    model: torch.nn.Module
    device: torch.device
    ids: np.ndarray  # (rows, seq_len) token ids
    rows_from: str
    load_seconds: float


def load_for_trial(run_root: RunRoot, settings: TeacherPassSettings, rows: int, experts: bool = True,
                   random_weights: bool = False) -> Trial:
    """The teacher on its device and `rows` rows of the run's tokens (the checks of the pass first); `experts`:
    set `precompute.experts` (False: leave transformers' choice, for a trial that sets it itself);
    `random_weights`: the teacher made from its config alone (kdflow.tasks.common.random_teacher)."""
    teacher, seq_len = settings.teacher, settings.seq_len
    device = resolve_device(teacher.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"teacher.device is {teacher.device} but this machine has no CUDA device")
    model_config = load_teacher_config(teacher, weights=not random_weights)
    check_teacher_limits(model_config, top_k=settings.precompute.top_k, seq_len=seq_len)
    tokenizer = load_tokenizer(teacher, settings.tokenizer)
    started = time.perf_counter()
    if random_weights:
        model = build_random_teacher(model_config, device, resolve_dtype(teacher, device),
                                     four_bit=teacher.load_in_4bit, lm_head_float32=teacher.lm_head_float32)
    else:
        model = load_teacher(teacher, device=device)
    if experts:
        use_experts(model, settings.precompute.experts)
    load_seconds = time.perf_counter() - started
    check_tokenizer_fits(tokenizer, model)
    ids, source = token_rows(run_root, seq_len, tokenizer, rows)
    if ids.min() < 0 or ids.max() >= vocab_rows(model):
        raise StoreError(f"{source} hold id {int(ids.max())}, outside the teacher's embedding of {vocab_rows(model)} "
                         "rows")
    return Trial(model, device, ids, source, load_seconds)


def time_micro_batches(step: Callable[[torch.Tensor, int], tuple[Any, Callable[[], None]]], ids: np.ndarray,
                       micro_batch: int, warmup: int, batches: int, device: torch.device, run_root: RunRoot) -> float:
    """Seconds of `batches` micro-batches of `ids` through `step` (a `pass_step`), after `warmup` untimed ones."""
    timed_from = 0.0
    with deterministic_algorithms():
        for index in range(warmup + batches):
            if index == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                timed_from = time.perf_counter()
            rows = torch.from_numpy(ids[index * micro_batch:(index + 1) * micro_batch].astype(np.int64))
            ready, release = step(rows.to(device, non_blocking=True), index)
            faults.maybe_fire("micro_batch", run_root, micro_batch=index, micro_batch_size=micro_batch)
            if ready is not None:
                ready.synchronize()
            release()
    return time.perf_counter() - timed_from


def check_counts(micro_batch: int, batches: int, warmup: int = 0) -> None:
    """micro_batch and batches >= 1, warmup >= 0, or a ConfigError naming them."""
    if micro_batch < 1 or batches < 1 or warmup < 0:
        raise ConfigError(f"micro_batch and batches must be >= 1 and warmup >= 0, got {micro_batch}, {batches}, "
                          f"{warmup}")


def measure_candidate(run_root: RunRoot, settings: TeacherPassSettings, micro_batch: int, batches: int,
                      warmup: int = 1, random_weights: bool = False) -> dict[str, Any]:
    """Load the teacher and time `batches` micro-batches of `micro_batch` rows -> the candidate's record."""
    check_counts(micro_batch, batches, warmup)
    trial = load_for_trial(run_root, settings, (warmup + batches) * micro_batch, random_weights=random_weights)
    device, vocab = trial.device, output_rows(trial.model)
    step, chunk_tokens = pass_step(settings, trial.model, vocab, micro_batch, device)
    seconds = time_micro_batches(step, trial.ids, micro_batch, warmup, batches, device, run_root)
    tokens = batches * micro_batch * settings.seq_len
    return {"micro_batch": micro_batch, "status": "ok", "tokens_per_s": round(tokens / seconds, 1),
            "seconds": round(seconds, 3), "tokens": tokens, "batches": batches, "warmup": warmup,
            "load_seconds": round(trial.load_seconds, 2), "device": str(device), "threads": torch.get_num_threads(),
            "rows_from": trial.rows_from, "chunk_tokens": chunk_tokens, "vocab": vocab, **memory_record(device)}


def measure_experts(run_root: RunRoot, settings: TeacherPassSettings, micro_batch: int, repeats: int = 2,
                    tolerance: float = EXPERTS_TOLERANCE, random_weights: bool = False) -> dict[str, Any]:
    """A MoE teacher's body under each experts implementation on `micro_batch` of the run's rows, as the pass runs
    it: compiled where `precompute.compile_body` says (`measure_pass_experts`) -> {"experts": one record per
    implementation, "recommended_experts": the fastest whose hidden states are within `tolerance` of eager's, or
    None}. The teacher loads as the pass loads it."""
    check_counts(micro_batch, repeats)
    trial = load_for_trial(run_root, settings, micro_batch, experts=False, random_weights=random_weights)
    rows = torch.from_numpy(trial.ids.astype(np.int64)).to(trial.device)
    compiled = settings.precompute.compile_body
    with deterministic_algorithms():
        records, recommended = measure_pass_experts(trial.model, rows, compiled, repeats, tolerance)
    return {"micro_batch": micro_batch, "experts": records, "tolerance": tolerance, "compiled_body": compiled,
            "recommended_experts": recommended}
