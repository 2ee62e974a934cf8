"""Fingerprints: short hashes that say which inputs and config parts made a store.

Two stores agree iff their fingerprints do. Each store's fingerprint folds in the one before it, so a
top-K store is tied to the exact token store (and through it the corpus and tokenizer) it was made from.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kdflow.schemas.config import KDFlowConfig, PrecomputeConfig
from kdflow.schemas.config_hash import section_hash
from kdflow.schemas.store_info import store_format


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of what decides token ids: the vocabulary (token -> id) and the special-token ids.

    Two tokenizers with the same fingerprint map every string to the same ids for packing purposes; the
    class (fast/slow) and the file it was loaded from (hub, local folder, GGUF) do not matter.
    """
    vocab = tokenizer.get_vocab()
    specials = {
        name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")
    }
    payload = json.dumps([sorted(vocab.items(), key=lambda item: item[1]), specials], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def corpus_fingerprint(config: KDFlowConfig) -> str:
    return section_hash("corpus", config.dataset)


def tokens_fingerprint(corpus_fp: str, tokenizer_fp: str, config: KDFlowConfig) -> str:
    return tokens_fingerprint_of(corpus_fp, tokenizer_fp, config.seq_len, config.precompute.sequences_per_shard)


def tokens_fingerprint_of(corpus_fp: str, tokenizer_fp: str, seq_len: int, sequences_per_shard: int) -> str:
    """tokens_fingerprint from the values it reads (tokenise's view of the config)."""
    return section_hash("tokens", corpus_fp, tokenizer_fp, seq_len, sequences_per_shard)


def topk_fingerprint(teacher_fp: str, tokens_fp: str, config: KDFlowConfig) -> str:
    """Also the store's TAG under topk/: teacher + K + store format + the token store it reads.

    v1 keeps its formula (K and the log-prob dtype), so stores made before v2 keep their tags and resume;
    v2 hashes `store_format(config.precompute)`, which names the format ("v2", "kdflow.topk.v2") and every codec
    parameter, so a store made with other codec settings is another store."""
    return topk_fingerprint_of(teacher_fp, tokens_fp, config.precompute)


def topk_fingerprint_of(teacher_fp: str, tokens_fp: str, precompute: PrecomputeConfig) -> str:
    """topk_fingerprint from the section it reads (the teacher pass's view of the config)."""
    if precompute.store.format == "v1":
        return section_hash("topk", teacher_fp, tokens_fp, precompute.top_k, precompute.logprobs_dtype, length=12)
    return section_hash("topk", teacher_fp, tokens_fp, precompute.top_k, store_format(precompute), length=12)


# The student settings a checkpoint resumes with: data, model and optimisation. Steps, saving, evaluation and
# device settings may change between runs, and so may those that change how the student computes but not what.
RESUME_FIELDS: dict[str, Any] = {"init_from": True, "prune": True, "architecture": True, "batch_size": True,
                                 "lr": True, "min_lr_ratio": True, "warmup_steps": True, "weight_decay": True,
                                 "betas": True, "grad_clip": True, "eval_shards": True, "seed": True,
                                 "kd": {"kd_weight", "temperature"}}


def student_resume_fields(student: Any) -> dict[str, Any]:
    """The student's part of a checkpoint's fingerprint (with the top-K and token stores' fingerprints).
    `kd.untargeted_ce_weight` (the loss on masked stores), `prune` and its width keys (`prune.intermediate_size`,
    `prune.key_value_heads`) count only when set, so that checkpoints made before those keys existed keep their
    fingerprint and resume."""
    fields = student.model_dump(mode="json", include=RESUME_FIELDS)
    if fields.get("prune") is None:  # checkpoints from before `student.prune` keep resuming
        fields.pop("prune", None)
    else:  # nor do its width keys change the fingerprint of a student pruned in depth only
        fields.pop("architecture")  # unused: the teacher's own shapes (the demo's config keeps one for --quick)
        for key in ("intermediate_size", "key_value_heads"):
            if fields["prune"].get(key) is None:
                fields["prune"].pop(key, None)
    if student.kd.untargeted_ce_weight != 0.0:
        fields["kd"]["untargeted_ce_weight"] = student.kd.untargeted_ce_weight
    return fields
