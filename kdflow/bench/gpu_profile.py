"""Where one micro-batch of the teacher pass spends its time, by kernel family (issue 44, item 1: look before
changing). One micro-batch of the pass as the pass runs it (`TeacherTopkStep`: body, lm_head, chunked log-sum-exp
and top-K; the results copied to the host; the store's encoding) under torch.profiler; every op's self time and,
on a GPU, the device time of the kernels it launched, summed by family.

A kernel's name alone does not say whose it is (the lm_head and an expert are both a GEMM, the router's top-k and
the head's are both `topk`), so each module of the model is labelled while it runs (a `record_function` opened by
a forward pre-hook and closed by its forward hook: attention, router, experts, activation, norm, lm_head, body)
and the pass's own phases too (step, device-to-host, encoding). The chunked head multiplies by the lm_head's weight
without calling its module, so a GEMM under the step's label and no module's is the lm_head's. An op is classified
by its innermost label and its name (with its kernels' names on a GPU) through `FAMILY_PATTERNS`, a table read
top to bottom, first match wins; what no row matches is "other". The table is tested on op names collected from
a CPU profile of a tiny Qwen3-MoE pass (tests/test_gpu_profile.py) and on the CUDA kernel names the H200 is
expected to show (cuBLAS/CUTLASS GEMMs, bitsandbytes' kDequantize, flash attention, topk, Memcpy DtoH); the
record lists each family's costliest op names, so a name the table misses shows under "other" there.

Pure torch (+ numpy/pyarrow for the encoding); no Prefect.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

FAMILIES = ("attention", "router_topk", "permute_unpermute", "expert_gemm", "expert_dequantisation", "activations",
            "norms", "lm_head_matmul", "log_sum_exp", "top_k", "device_to_host", "encoding", "other")
LABEL = "kdflow::"
_ANY = r""  # matches anything, the empty label too
_GEMM = r"\bmm\b|matmul|linear|gemm|addmm|bmm|grouped_mm|cutlass|cublas|sm90_xmma|ampere_.*gemm|_mm_"
# (family, innermost label (regex), op name and its kernels' names (regex)): first match wins.
FAMILY_PATTERNS: tuple[tuple[str, str, str], ...] = (
    ("device_to_host", r"^d2h$", _ANY),
    ("device_to_host", _ANY, r"memcpy dtoh|memcpy.*device.?to.?host"),
    ("encoding", r"^encode$", _ANY),
    ("expert_dequantisation", r"^(experts|activation)$", r"dequantize|dequant"),
    # kdflow_fused (tasks/teacher/fused_moe.py): its two Triton kernels are the experts' GEMMs (the activation, the
    # routing weight and NF4 reads fused in), before the activation row could take `expert_gate_up` for an "up"
    ("expert_gemm", r"^experts$", r"expert_gate_up|expert_down"),
    ("norms", r"^norm$", _ANY),
    ("activations", r"^activation$", _ANY),
    ("activations", r"^experts$", r"silu|gelu|sigmoid|swiglu|act_and_mul|aten::mul\b|mul_kernel|mulfunctor"),
    ("attention", r"^(attention|rotary)$", _ANY),
    ("router_topk", r"^router$", _ANY),
    ("expert_gemm", r"^experts$", _GEMM),
    ("permute_unpermute", r"^(experts|moe_block)$", _ANY),
    ("lm_head_matmul", r"^lm_head$", _ANY),
    ("lm_head_matmul", r"^step$", _GEMM),  # the chunked head multiplies by the lm_head's weight, not its module
    ("top_k", r"^step$", r"topk|sort|radix|kth|gather|tile_keys"),  # tile_keys: the tiled sampler's candidates
    # the tiled heads' one read of the logits (their tile statistics kernels): the log-sum-exp's pass
    ("log_sum_exp", r"^step$", r"tile_stats"),
    ("log_sum_exp", r"^step$", r"logsumexp|\bexp|\blog\b|log_|amax|\bmax\b|\bsum\b|reduce|sub|add|softmax|scatter"),
    # scatter_: the kept columns zeroed before the tail is summed (slab.split_logsumexp_)
)
_COMPILED = tuple((family, re.compile(scope), re.compile(name, re.I)) for family, scope, name in FAMILY_PATTERNS)


def classify(scope: str, name: str) -> str:
    """The family of an op (its name and its kernels' names, space-separated) under its innermost label."""
    for family, scope_pattern, name_pattern in _COMPILED:
        if scope_pattern.search(scope) and name_pattern.search(name):
            return family
    return "other"


def module_label(name: str, module: Any, lm_head: Any, body: Any = None) -> str | None:
    """What a module is, for the profile's labels, by its class's and attribute's names (transformers' own);
    None for a container whose ops belong to its children."""
    kind = type(module).__name__
    last = name.rsplit(".", 1)[-1]
    if module is lm_head:
        return "lm_head"
    if module is body:  # the decoder: its own ops (residual adds, masks) are no head work
        return "body"
    if kind.endswith("Experts") or last == "experts":
        return "experts"
    if "Router" in kind or last == "gate":
        return "router"
    if "Norm" in kind or last.endswith("norm") or last.endswith("layernorm"):
        return "norm"
    if "Attention" in kind or last in ("self_attn", "attn", "attention"):
        return "attention"
    if "Rotary" in kind or "rotary" in last:
        return "rotary"
    if "Activation" in kind or last in ("act_fn", "act"):
        return "activation"
    if "SparseMoe" in kind or "MoeBlock" in kind or "MoE" in kind:
        return "moe_block"
    if "Embedding" in kind:
        return "embedding"
    return None


@contextlib.contextmanager
def labelled_modules(model: Any, lm_head: Any) -> Iterator[None]:
    """Every labelled module of `model` runs inside a `record_function("kdflow::<label>")` while in this block."""
    import torch

    handles = []
    body = getattr(model, "base_model", None)
    for name, module in model.named_modules():
        label = module_label(name, module, lm_head, None if body is model else body)
        if label is None:
            continue
        stack: list[Any] = []

        def enter(mod: Any, inputs: Any, label: str = label, stack: list[Any] = stack) -> None:
            scope = torch.profiler.record_function(LABEL + label)
            scope.__enter__()
            stack.append(scope)

        def leave(mod: Any, inputs: Any, output: Any, stack: list[Any] = stack) -> None:
            if stack:
                stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _scope(event: Any) -> str:
    """The innermost kdflow label over an event (the event itself when it is one); "" when none."""
    while event is not None:
        if event.name.startswith(LABEL):
            return event.name[len(LABEL):]
        event = event.cpu_parent
    return ""


def family_table(events: Any) -> dict[str, Any]:
    """Self CPU and device microseconds by family over a profile's events, and each family's op names, costliest
    first (ten of each family, to read what it holds; every one of "other", to grow the table from a new
    machine's names)."""
    cpu_us = dict.fromkeys(FAMILIES, 0.0)
    device_us = dict.fromkeys(FAMILIES, 0.0)
    names: dict[str, dict[str, float]] = {family: {} for family in FAMILIES}
    for event in events:
        if getattr(event, "device_type", None) is not None and "CPU" not in str(event.device_type):
            continue  # a device-side event: counted through the CPU op that launched it (`kernels`)
        scope = _scope(event)
        kernels = list(getattr(event, "kernels", []) or [])
        text = " ".join([event.name, *(kernel.name for kernel in kernels)])
        family = classify(scope, text)
        cpu_us[family] += event.self_cpu_time_total
        device = sum(kernel.duration for kernel in kernels)
        device_us[family] += device
        key = f"{scope or '-'}: {event.name}"
        names[family][key] = names[family].get(key, 0.0) + event.self_cpu_time_total + device
    return {"cpu_us": {k: round(v, 1) for k, v in cpu_us.items()},
            "device_us": {k: round(v, 1) for k, v in device_us.items()},
            "ops": {family: [name for name, _ in sorted(seen.items(), key=lambda item: -item[1])][
                              :None if family == "other" else 10]
                    for family, seen in names.items() if seen}}


def profile_micro_batch(model: Any, input_ids: Any, top_k: int, chunk_tokens: int, codec: Any = None,
                        warmup: int = 1) -> dict[str, Any]:
    """One micro-batch of the pass (step, copies to the host, encoding when `codec` is given) under the profiler,
    after `warmup` unprofiled runs; its families' times (device time on a GPU, CPU time otherwise, both given),
    each as a share of the whole, and the micro-batch's wall seconds."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from kdflow.schemas.codec import encode
    from kdflow.tasks.common.models import output_layer
    from kdflow.tasks.teacher.topk import TeacherTopkStep

    cuda = input_ids.device.type == "cuda"
    step = TeacherTopkStep(model, top_k, chunk_tokens)

    def one() -> None:
        with record_function(LABEL + "step"):
            ids, logprobs, tail = step(input_ids)
        with record_function(LABEL + "d2h"):
            ids, logprobs, tail = ids.cpu(), logprobs.cpu(), tail.cpu()
        if codec is not None:
            with record_function(LABEL + "encode"):
                encode(codec, np.asarray(ids), np.asarray(logprobs), np.asarray(tail))

    with torch.inference_mode():
        for _ in range(warmup):
            one()
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with labelled_modules(model, output_layer(model)), profile(activities=activities) as prof:
            started = time.perf_counter()
            one()
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
    table = family_table(prof.events())
    basis = "device_us" if cuda else "cpu_us"
    total = sum(table[basis].values()) or 1.0
    return {"tokens": int(input_ids.numel()), "seconds": round(seconds, 4), "time_basis": basis,
            "share": {family: round(us / total, 4) for family, us in table[basis].items()}, **table}


def profile_teacher(config_path: Any, micro_batch: int | None, model: Any = None) -> dict[str, Any]:
    """The GPU check's `profile` step: one micro-batch (the tuned one, else the config's) of random ids through
    the config's teacher (loaded as the pass loads it, unless `model` is given), with the v2 codec's encoding at
    the config's top-K. Its table is printed on stderr (the check's log) as it is recorded."""
    import sys

    import torch

    from kdflow.schemas.codec import TopkCodec
    from kdflow.schemas.config_io import load_config
    from kdflow.tasks.common.teacher_loading import load_teacher
    from kdflow.tasks.teacher.loading import output_rows
    from kdflow.tasks.teacher.topk import topk_chunk_tokens

    config = load_config(config_path)
    pre = config.precompute
    model = load_teacher(config.teacher) if model is None else model
    device = next(model.parameters()).device
    vocab, rows = output_rows(model), micro_batch or pre.micro_batch
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, config.seq_len), generator=generator).to(device)
    chunk = topk_chunk_tokens(pre, vocab)
    result = profile_micro_batch(model, ids, pre.top_k, chunk, TopkCodec(config.seq_len, pre.top_k, vocab))
    result = {"layers": model.config.num_hidden_layers, "micro_batch": rows, "seq_len": config.seq_len,
              "four_bit": config.teacher.load_in_4bit, **result}
    print("\n".join(table_lines(result)), file=sys.stderr, flush=True)
    return result


def table_lines(result: dict[str, Any]) -> list[str]:
    """The profile as a short table: each family's milliseconds (the time basis) and share, costliest first."""
    basis = result["time_basis"]
    lines = [f"profile: {result['layers']} layers, micro-batch {result['micro_batch']} x {result['seq_len']}, "
             f"{result['seconds']:.3f} s wall; {basis.removesuffix('_us')} time by family"]
    for family in sorted(FAMILIES, key=lambda f: -result[basis][f]):
        lines.append(f"  {family:<22} {result[basis][family] / 1000:>10.2f} ms {result['share'][family]:>7.1%}")
    return lines
