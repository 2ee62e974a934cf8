"""The GPU check's sizes, its reference shapes and its plan: what each step will run, at which size, with which
memory estimate, and which steps would be skipped (and why) on a device of a given memory.

The reference teacher is `llm-jp/llm-jp-4-32b-a3b-base` (Qwen3-MoE). Its model card's architecture table gives
32 layers, hidden size 2,560, 40 attention heads, 128 routed experts of which 8 are active, a 65,536-token
context, 503,316,480 embedding parameters (= 196,608 x 2,560), 31,635,712,512 non-embedding, 3,827,476,992
activated and 32,139,028,992 total parameters (read from a mirror of the card, llmsreview.com/models/
llm-jp--llm-jp-4-32b-a3b-thinking; its config.json could not be downloaded here). The card gives neither the
KV heads nor the expert width: with head_dim 128 (Qwen3-MoE's), the parameter counts are met exactly by 4 KV
heads and an expert width (moe_intermediate_size) of 960, and by no other integer pair; both are derived,
`derived_shapes_check` recomputes the card's four counts from them (tested).

`--plan` prints this plan at full size without building anything (tested here, on a CPU), so a step that would
skip on the GPU machine is known before a minute of it is spent, and a skip is never counted as a failure.
"""

from __future__ import annotations

from typing import Any

from kdflow.tasks.common.units import GIB

REFERENCE_VOCAB = 196_608
REFERENCE_SHAPES: dict[str, int] = {
    "hidden_size": 2560, "num_attention_heads": 40, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 960, "num_hidden_layers": 32,
    "vocab_size": REFERENCE_VOCAB,
}
REFERENCE_CARD = {"embedding": 503_316_480, "non_embedding": 31_635_712_512, "activated": 3_827_476_992,
                  "total": 32_139_028_992}
# The shapes at the CPU rehearsal's sizes (same family, every dimension small).
QUICK_SHAPES: dict[str, int] = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hidden_layers": 2, "vocab_size": 4096,
}
H200_MEMORY_GIB = 139.0
H100_MEMORY_GIB = 78.0  # the other kind the device tool lends (and the one a plain first call gets)
# Time, from the H200 check of 2026-12-04 (docs/results/gpu-check-h200-2026-12-04.md): the whole call then (set-up
# included), the limit of one call (infra/gpu-check.sh), and what the steps added since are expected to take: the
# full-depth step builds (random init on the device) and quantises ~32B parameters, then times 5 modes in 2
# precisions at the extrapolated full-depth rate (~24,300 tok/s constrained); the profile loads the L4 teacher;
# the hub-layout load writes and loads a 2-layer checkpoint at full width; the capped run builds the 4-bit teacher
# layer by layer and tries five micro-batches. Together they outgrow one call: `call_time` says by how much.
LAST_CHECK_S = 406
CALL_LIMIT_S = 540
FULL_DEPTH_FIXED_S = 35
FULL_DEPTH_TOKENS_PER_S = 24_000
FULL_DEPTH_MODES = 5  # timed in each precision: body, forward, the pass's step, and its two kdflow variants
HEAD_S = 47  # `kdflow bench head`'s nine variants, tiled-gemm's in four tilings, at 16,384 tokens, compiles: a guess
PROFILE_S = 15
HUB_LAYOUT_S = 40  # ~5.8 GB written (drawn on the GPU) and loaded into 4-bit in a child, at 2 layers
CAPPED_S = 65  # the 32-layer 4-bit teacher built layer by layer; five micro-batches tried twice each, under two
#               experts implementations (the fused one compiled first)
TUNE_CAPPED_S = 80  # `kdflow tune precompute --random-weights --memory-gib 24`: up to 3 processes, each making the
#                    32-layer random 4-bit teacher (a guess)
BODY_S = 90  # the L4 4-bit teacher loaded, four experts implementations timed (the fused one in four tilings, each
#            compiled), two inductor compiles of the body (with grouped_mm and the fused experts): a guess
# Issue 44's steps, which the check runs right after what they need (the teacher, the token shards, the tuned
# micro-batch), and the steps measured on 2026-12-04 that it runs last, for the budget to skip first.
ISSUE_STEPS = ("profile", "full_depth", "bench_head", "body_variants", "capped_24gib", "hub_layout_load",
               "tune_capped_24gib")
REMEASURED = ("logits_precision", "bench_loss", "bench_precompute", "bench_train_step", "train_bf16")
SETUP_S = 15  # a call's set-up from the carried wheels (13 s on 2026-12-04)
CAP_GIB = 24.0  # the memory promise: a 24 GB GPU (gpu_capped.py)
BF16_PEAK_TFLOPS = 790.0  # the H200's measured bf16 matmul rate on the lent machine (KINDS.md), the MFU roofline


def reference_config(shapes: dict[str, int], **extra: Any) -> Any:
    """The check's Qwen3-MoE config of `shapes`: an untied head, ids 0 and 1 as end/start and padding, and a dense
    MLP width (4x hidden) that no layer uses; `extra` for the rest (the context length)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**shapes, intermediate_size=4 * shapes["hidden_size"], tie_word_embeddings=False,
                          eos_token_id=0, bos_token_id=0, pad_token_id=1, **extra)


def layer_parameters(shapes: dict[str, int]) -> dict[str, int]:
    """Parameters of one decoder layer: all of them and those one token uses (attention, router, 8 experts)."""
    hidden, head_dim = shapes["hidden_size"], shapes["head_dim"]
    attention = hidden * head_dim * (2 * shapes["num_attention_heads"] + 2 * shapes["num_key_value_heads"])
    norms = 2 * hidden + 2 * head_dim
    router = shapes["num_experts"] * hidden
    expert = 3 * hidden * shapes["moe_intermediate_size"]
    shared = attention + norms + router
    return {"total": shared + shapes["num_experts"] * expert, "active": shared + shapes["num_experts_per_tok"] * expert,
            "attention": attention, "experts": shapes["num_experts"] * expert}


def model_parameters(shapes: dict[str, int], layers: int | None = None) -> dict[str, int]:
    """Whole-model counts at `layers` (default: the config's), untied embedding and lm_head."""
    layers = shapes["num_hidden_layers"] if layers is None else layers
    per_layer = layer_parameters(shapes)
    embedding = shapes["vocab_size"] * shapes["hidden_size"]
    final_norm = shapes["hidden_size"]
    return {"embedding": embedding, "non_embedding": layers * per_layer["total"] + final_norm + embedding,
            "activated": layers * per_layer["active"] + final_norm + 2 * embedding,
            "total": layers * per_layer["total"] + final_norm + 2 * embedding}


def derived_shapes_check() -> dict[str, bool]:
    """The card's four parameter counts, recomputed from REFERENCE_SHAPES: each True when it matches exactly."""
    counts = model_parameters(REFERENCE_SHAPES)
    return {key: counts[key] == value for key, value in REFERENCE_CARD.items()}


def sizes(quick: bool) -> dict[str, Any]:
    """Every size of the check; the quick ones keep the CPU rehearsal to about a minute on two cores."""
    if quick:
        return {"shapes": QUICK_SHAPES, "depths": (1, 2), "seq_len": 32, "documents": 16, "per_shard": 16, "top_k": 32,
                "micro_batches": "2,4", "topk_bench": {"vocab": 4096, "hidden": 64, "seq_len": 32, "micro_batches": "2",
                                                       "repeats": 1},
                "loss_tokens": [256], "loss_hidden": 64, "loss_vocab": 4096, "pass_shards": 1, "head_tokens": 256,
                "pass_bits": ("4bit",), "pass_repeats": 1, "precision_tokens": 64,
                "student_steps": 3, "batch_size": 4, "train_seq_len": 32,
                "full_depth": {"micro_batch": 2, "repeats": 1, "matmul_size": 256}, "hub_layout_layers": 2,
                "capped": {"seq_len": 32, "micro_batches": [4, 2], "tune_candidates": [2, 4]}}
    # 128 sequences a shard: 4 micro-batches of 32, so that the pass's host side overlaps the device as it does
    # in a real run (1,024 a shard by default); one micro-batch a shard would time the shard's end serially.
    return {"shapes": REFERENCE_SHAPES, "depths": (2, 4), "seq_len": 1024, "documents": 3000, "per_shard": 128,
            "top_k": 128,
            "micro_batches": "16,32", "topk_bench": {"hidden": 2560, "micro_batches": "16,32", "repeats": 3,
                                                       "dense_limit_gib": 60.0},
            "loss_tokens": [8192, 16384, 32768], "loss_hidden": 2560, "loss_vocab": REFERENCE_VOCAB, "pass_shards": 2,
            "head_tokens": 16384,
            "pass_bits": ("4bit", "bf16"), "pass_repeats": 2, "precision_tokens": 8192,
            "student_steps": 6, "batch_size": 8, "train_seq_len": 1024,
            "full_depth": {"micro_batch": 32, "repeats": 2, "matmul_size": 8192}, "hub_layout_layers": 2,
            # the tune's candidates ascending (it stops at the first that runs out of memory), the llmjp one last
            "capped": {"seq_len": 512, "micro_batches": [56, 48, 32, 16, 8], "tune_candidates": [32, 48, 56]}}


def teacher_bytes(shapes: dict[str, int], layers: int, four_bit: bool, experts_4bit: bool = True,
                  float_bytes: int = 2) -> int:
    """Weights on the device. 4-bit: the attention's nn.Linear layers (bitsandbytes) and the fused experts
    (kdflow.tasks.common.fused_experts) at half a byte a value + a float32 scale per 64; embedding, lm_head,
    routers and norms stay bf16 (`float_bytes` a value). `experts_4bit=False`: bitsandbytes alone, transformers 5."""
    per_layer = layer_parameters(shapes)
    counts = model_parameters(shapes, layers)
    if not four_bit:
        return float_bytes * counts["total"]
    quantised = layers * (per_layer["attention"] + (per_layer["experts"] if experts_4bit else 0))
    return int(float_bytes * (counts["total"] - quantised) + quantised * (0.5 + 4 / 64))


def pass_activation_bytes(shapes: dict[str, int], micro_batch: int, seq_len: int) -> int:
    """A rough upper bound of the pass's working memory at one micro-batch: the hidden states of a layer in bf16
    with the MoE's routed copies (x experts per token), attention scores and one vocabulary chunk of logits."""
    tokens = micro_batch * seq_len
    hidden = 2 * tokens * shapes["hidden_size"] * (8 + 2 * shapes["num_experts_per_tok"])
    routed = 2 * tokens * shapes["num_experts_per_tok"] * 2 * shapes["moe_intermediate_size"]
    logits = 4 * min(tokens, 8192) * shapes["vocab_size"]
    return hidden + routed + logits


def full_depth_bytes(shapes: dict[str, int], micro_batch: int, seq_len: int) -> dict[str, int]:
    """The full-depth step's peaks: `4bit` built layer by layer (never more than one layer in 16 bits), `bf16`
    built whole (its weights are the peak; quantised in place afterwards) with the pass's working memory, and
    `bf16_forward` with the bare forward's whole logits in bf16 on top (micro-batch x seq x vocab)."""
    layers = shapes["num_hidden_layers"]
    working = pass_activation_bytes(shapes, micro_batch, seq_len)
    one_layer = 2 * layer_parameters(shapes)["total"]
    bf16 = teacher_bytes(shapes, layers, False) + working
    return {"4bit": teacher_bytes(shapes, layers, True) + one_layer + working, "bf16": bf16,
            "bf16_forward": bf16 + 2 * micro_batch * seq_len * shapes["vocab_size"]}


def dense_loss_bytes(tokens: int, vocab: int) -> int:
    from kdflow.bench.loss import DENSE_PEAK_PER_LOGITS

    return int(DENSE_PEAK_PER_LOGITS * tokens * vocab * 4)


def remeasured(depths: tuple[int, int] | list[int]) -> list[str]:
    """The steps measured on 2026-12-04, in the order the check runs them after issue 44's."""
    passes = [f"teacher_pass_L{depth}_{bits}" for bits in ("4bit", "bf16") for depth in depths]
    return ["teacher_weights_4bit", *passes, "extrapolated_4bit", "extrapolated_bf16", *REMEASURED]


def call_time(steps: dict[str, dict[str, Any]], depths: tuple[int, int] | list[int]) -> dict[str, Any]:
    """The calls the check takes: 2026-12-04's steps (their measured whole) and issue 44's (estimated) exceed one
    call's limit; the check runs issue 44's right after the steps they need and 2026-12-04's re-measurements last,
    so it is those that its budget skips, for a second call (an estimate of its length: what spills, set-up)."""
    issue_s = sum(steps[name]["estimated_s"] for name in ISSUE_STEPS)
    spill = max(0, LAST_CHECK_S + issue_s - CALL_LIMIT_S)
    return {"last_check": LAST_CHECK_S, "issue_steps": list(ISSUE_STEPS), "issue_steps_s": issue_s,
            "total": LAST_CHECK_S + issue_s, "limit": CALL_LIMIT_S, "first_call": min(CALL_LIMIT_S,
                                                                                     LAST_CHECK_S + issue_s),
            "second_call_steps": remeasured(depths) if spill else [], "second_call": SETUP_S + spill if spill else 0}


def plan(quick: bool, memory_gib: float = H200_MEMORY_GIB, budget_s: float = 480.0) -> dict[str, Any]:
    """What the check will run at these sizes on a device of `memory_gib`: one entry per step, each with its
    sizes, its memory estimate and `would` ('run' or 'skip: why'). Nothing is built or allocated."""
    size = sizes(quick)
    shapes = size["shapes"]
    limit = memory_gib * GIB
    largest_mb = max(int(m) for m in size["micro_batches"].split(","))
    steps: dict[str, dict[str, Any]] = {}

    def add(name: str, estimate: int, **fields: Any) -> None:
        would = "run" if estimate <= 0.9 * limit else f"skip: estimated {estimate / GIB:.1f} GiB > 90% of device"
        steps[name] = {"estimated_gib": round(estimate / GIB, 2), "would": would, **fields}

    for depth in size["depths"]:
        for four_bit in (True, False):
            weights = teacher_bytes(shapes, depth, four_bit)
            add(f"teacher_pass_L{depth}_{'4bit' if four_bit else 'bf16'}",
                weights + pass_activation_bytes(shapes, largest_mb, size["seq_len"]), layers=depth,
                weights_gib=round(weights / GIB, 2), micro_batch_max=largest_mb, seq_len=size["seq_len"])
    full = {bits: teacher_bytes(shapes, shapes["num_hidden_layers"], bits == "4bit") for bits in ("4bit", "bf16")}
    depth = size["full_depth"]
    full_tokens = depth["micro_batch"] * size["seq_len"]
    # 4-bit always (built layer by layer where the bf16 weights do not fit); bf16 where its weights fit, timed
    # first and then quantised in place, each mode's running out of memory its outcome (gpu_full_depth.py): the
    # bare forward's whole logits beside 60 GiB of weights do not fit an H100.
    peaks = full_depth_bytes(shapes, depth["micro_batch"], size["seq_len"])
    bf16 = {"build": "run" if full["bf16"] <= 0.9 * limit else
            f"skip: weights {full['bf16'] / GIB:.1f} GiB > 90% of device: 4-bit alone, built layer by layer"}
    if bf16["build"] == "run":
        bf16 |= {mode: "run" if peaks[key] <= limit else f"may run out of memory: estimated {peaks[key] / GIB:.1f} GiB"
                 for mode, key in (("body_topk", "bf16"), ("forward", "bf16_forward"))}
    add("full_depth", peaks["4bit"], layers=shapes["num_hidden_layers"], weights_bf16_gib=round(full["bf16"] / GIB, 2),
        weights_4bit_gib=round(full["4bit"] / GIB, 2), micro_batch=depth["micro_batch"], seq_len=size["seq_len"],
        bf16_estimated_gib=round(peaks["bf16"] / GIB, 2), bf16=bf16,
        weights_4bit_experts_16bit_gib=round(
            teacher_bytes(shapes, shapes["num_hidden_layers"], True, experts_4bit=False) / GIB, 2),
        estimated_s=round(FULL_DEPTH_FIXED_S + 2 * FULL_DEPTH_MODES * (1 + depth["repeats"]) * full_tokens
                          / FULL_DEPTH_TOKENS_PER_S))
    largest = teacher_bytes(shapes, size["depths"][1], True)
    add("profile", largest + pass_activation_bytes(shapes, largest_mb, size["seq_len"]), layers=size["depths"][1],
        micro_batch_max=largest_mb, estimated_s=PROFILE_S)
    hub = model_parameters(shapes | {"num_hidden_layers": size["hub_layout_layers"]})["total"]
    add("hub_layout_load", teacher_bytes(shapes, size["hub_layout_layers"], True), layers=size["hub_layout_layers"],
        checkpoint_gib=round(2 * hub / GIB, 2), estimated_s=HUB_LAYOUT_S)
    capped = size["capped"]
    add("capped_24gib", int(CAP_GIB * GIB), layers=shapes["num_hidden_layers"], seq_len=capped["seq_len"],
        micro_batches=capped["micro_batches"], estimated_s=CAPPED_S)
    add("tune_capped_24gib", int(CAP_GIB * GIB), layers=shapes["num_hidden_layers"], seq_len=capped["seq_len"],
        micro_batches=capped["tune_candidates"], estimated_s=TUNE_CAPPED_S)
    # the head's variants: the weight and, the most of them, the sampled ones in torch over one block of 4,096 rows
    # (float32 logits, two 8-byte noise buffers, float32 keys and their temporaries: ~32 bytes a logit)
    add("bench_head", 2 * size["loss_vocab"] * size["loss_hidden"] + 32 * 4096 * size["loss_vocab"],
        tokens=size["head_tokens"], vocab=size["loss_vocab"], hidden=size["loss_hidden"], estimated_s=HEAD_S)
    add("body_variants", largest + pass_activation_bytes(shapes, largest_mb, size["seq_len"]), layers=size["depths"][1],
        variants=["grouped_mm", "batched_mm", "eager", "kdflow_fused", "compiled", "compiled_fused"],
        estimated_s=BODY_S)
    dense_limit = 0.6 * limit
    for tokens in size["loss_tokens"]:
        dense = dense_loss_bytes(tokens, size["loss_vocab"])
        steps[f"loss_dense_{tokens}"] = {
            "estimated_gib": round(dense / GIB, 2), "tokens": tokens, "vocab": size["loss_vocab"],
            "would": "run" if dense <= dense_limit else f"skip: estimated {dense / GIB:.1f} GiB > 60% of device"}
        add(f"loss_fused_{tokens}", 4 * tokens * (size["loss_hidden"] * 2 + 8192) + 8 * size["loss_vocab"]
            * size["loss_hidden"], tokens=tokens)
    add("train_step", 16 * size["loss_vocab"] * 256 + dense_loss_bytes(size["batch_size"] * size["train_seq_len"],
                                                                        size["loss_vocab"]) // 2,
        vocab=size["loss_vocab"], batch=size["batch_size"], seq_len=size["train_seq_len"])
    counts = model_parameters(shapes)
    return {"bench": "gpu_check_plan", "quick": quick, "device_memory_gib": memory_gib, "budget_s": budget_s,
            "shapes": shapes, "depths": list(size["depths"]), "parameters_full_depth": counts,
            "card_counts_match": derived_shapes_check() if not quick else None,
            "steps": steps, "time_s": call_time(steps, size["depths"]),
            "would_skip": sorted(n for n, s in steps.items() if str(s["would"]).startswith("skip"))}
