"""`kdflow bench gpu`: the CUDA paths in one run of a few minutes, with no hub, ending in one JSON summary.

For the first time a GPU is lent (`infra/gpu-check.sh` runs this): a tiny Qwen3-MoE teacher is built from a
config with the reference vocabulary (196,608 ids) and a tokenizer trained on Python's docs, and loaded in
4-bit through bitsandbytes. Then, each step timed and its failure recorded without stopping the others:
corpus and token shards; `kdflow tune precompute` on that teacher (candidates in fresh processes, the
recommendation written into the check's config); the teacher pass in its worker process with it;
`kdflow bench precompute` and `kdflow bench loss` on the device; a few student steps with bf16 autocast;
a 2-process FSDP step when two GPUs are visible. The last stdout line is the summary (also `--out`).

`--device cpu` is the dry run: the same steps at small sizes (`--quick`), so that only the CUDA-specific
parts (the allocator's numbers, pinned copies, bf16 autocast, NCCL) go untested without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REFERENCE_VOCAB = 196_608


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdflow bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (the CPU dry run's; default with --device cpu)")
    parser.add_argument("--vocab", type=int, default=REFERENCE_VOCAB, help="the teacher's vocabulary")
    parser.add_argument("--work-dir", help="keep the teacher, stores and configs here (default: a temporary folder)")
    parser.add_argument("--out", help="also write the summary to this file")
    parser.add_argument("--fsdp", choices=["auto", "on", "off"], default="auto",
                        help="the 2-process FSDP step: auto runs it when two GPUs are visible")
    parser.add_argument("--no-4bit", dest="four_bit", action="store_false", help="load the teacher unquantised")
    return parser


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    """Every size of the check; the quick (dry-run) ones keep it to a minute or two on two CPU cores."""
    if args.quick:
        return {"hidden": 64, "layers": 2, "experts": 4, "seq_len": 32, "documents": 16, "per_shard": 16,
                "micro_batches": "2,4", "topk_bench": ["--vocab", "4096", "--hidden", "64", "--seq-len", "32",
                                                       "--micro-batches", "2", "--repeats", "1"],
                "loss_bench": ["--tokens", "256", "--vocab", "4096", "--hidden", "64", "--repeats", "1"],
                "student_steps": 3, "batch_size": 4}
    return {"hidden": 256, "layers": 2, "experts": 8, "seq_len": 512, "documents": 1000, "per_shard": 64,
            "micro_batches": "8,16,32,64", "topk_bench": ["--micro-batches", "14,28", "--repeats", "3"],
            "loss_bench": ["--tokens", "2048,8192", "--vocab", "196608", "--hidden", "2048", "--repeats", "2"],
            "student_steps": 8, "batch_size": 8}


def build_teacher(folder: Path, vocab: int, size: dict[str, Any], tokenizer_folder: Path) -> dict[str, Any]:
    """A random Qwen3-MoE with `vocab` ids (the reference teacher's architecture family) and the check's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    hidden = size["hidden"]
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=size["layers"],
                            num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                            num_experts=size["experts"], num_experts_per_tok=2,
                            moe_intermediate_size=hidden // 2, intermediate_size=2 * hidden,
                            max_position_embeddings=max(1024, size["seq_len"]), tie_word_embeddings=False,
                            eos_token_id=0, bos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab": vocab,
            "architecture": type(model).__name__}


def check_config(work: Path, args: argparse.Namespace, size: dict[str, Any]) -> dict[str, Any]:
    """The check's config as a plain dict (written to work/check.yaml, which `kdflow tune --write` edits)."""
    on_cuda = args.device == "cuda"
    return {
        "run_root": str(work / "run"),
        "dataset": {"path": str(work / "docs.jsonl"), "documents_per_part": 64},
        "seq_len": size["seq_len"],
        "teacher": {"model": str(work / "teacher"), "load_in_4bit": args.four_bit, "device": args.device,
                    "dtype": "bfloat16" if on_cuda else "float32"},
        "precompute": {"top_k": 32, "micro_batch": 4, "sequences_per_shard": size["per_shard"]},
        "student": {"name": "gpu-check", "steps": size["student_steps"], "batch_size": size["batch_size"],
                    "warmup_steps": 1, "eval_shards": 1, "eval_sequences": 8, "save_every": size["student_steps"],
                    "device": args.device, "autocast_bf16": True,
                    "architecture": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "intermediate_size": 128}},
    }


class Steps:
    """Runs each step, timing it; a failing step is recorded (its first line; the traceback on stderr)."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Any]] = {}

    def run(self, name: str, step: Callable[[], dict[str, Any] | None], *, needs: tuple[str, ...] = ()) -> None:
        failed = [n for n in needs if self.results.get(n, {}).get("status") != "ok"]
        if failed:
            self.results[name] = {"status": "skipped", "reason": f"needs {', '.join(failed)}"}
            return
        print(f"kdflow bench gpu: {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            result = step() or {}
            self.results[name] = {"status": "ok", "seconds": round(time.perf_counter() - started, 2), **result}
        except BaseException as error:  # noqa: BLE001 - one step's failure must not hide the others
            if isinstance(error, KeyboardInterrupt):
                raise
            traceback.print_exc(file=sys.stderr)
            message = (str(error).strip().splitlines() or [type(error).__name__])[0]
            self.results[name] = {"status": "failed", "seconds": round(time.perf_counter() - started, 2),
                                  "error": f"{type(error).__name__}: {message}"}


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def captured(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    """Run a `kdflow` subcommand's main in this process, its stdout captured (and echoed to stderr)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(argv)
    sys.stderr.write(buffer.getvalue())
    return code, buffer.getvalue()


def environment(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                            "python": sys.version.split()[0], "cpus": os.cpu_count()}
    with contextlib.suppress(ImportError):
        import bitsandbytes
        import transformers

        info |= {"transformers": transformers.__version__, "bitsandbytes": bitsandbytes.__version__}
    if torch.cuda.is_available():
        info |= {"cuda": torch.version.cuda,
                 "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                 "gpu_memory_mib": [round(torch.cuda.get_device_properties(i).total_memory / 2**20)
                                    for i in range(torch.cuda.device_count())],
                 "bf16": torch.cuda.is_bf16_supported()}
    return info


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.quick = args.quick or args.device == "cpu"
    if args.vocab < 1024:
        raise SystemExit(f"--vocab must be >= 1024, got {args.vocab}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import yaml

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kdflow bench gpu: no CUDA device is visible (use --device cpu for the dry run)")
    started = time.perf_counter()
    size = sizes(args)
    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kdflow-gpu-")))
        work.mkdir(parents=True, exist_ok=True)
        config_path = work / "check.yaml"
        config_path.write_text(yaml.safe_dump(check_config(work, args, size), sort_keys=False), encoding="utf-8")
        steps = Steps()
        steps.run("teacher", lambda: _teacher(work, args, size))
        steps.run("tokens", lambda: _tokens(work, config_path), needs=("teacher",))
        steps.run("tune_precompute", lambda: _tune(config_path, size), needs=("tokens",))
        steps.run("precompute", lambda: _precompute(config_path), needs=("tokens",))
        steps.run("bench_precompute", lambda: _bench("precompute", ["--device", args.device, *size["topk_bench"]]))
        steps.run("bench_loss", lambda: _bench("loss", ["--device", args.device, *size["loss_bench"]]))
        steps.run("train_bf16", lambda: _train(config_path), needs=("precompute",))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if args.fsdp == "on" or (args.fsdp == "auto" and gpus >= 2):
            steps.run("fsdp_2_process", lambda: _fsdp(config_path), needs=("precompute",))
        else:
            steps.results["fsdp_2_process"] = {"status": "skipped", "reason": f"{gpus} GPU(s) visible"}
    failed = [name for name, result in steps.results.items() if result["status"] == "failed"]
    summary = {"bench": "gpu_check", "device": args.device, "quick": args.quick, "ok": not failed, "failed": failed,
               "seconds": round(time.perf_counter() - started, 1), "loadavg": [round(x, 2) for x in os.getloadavg()],
               "environment": environment(args.device), "steps": steps.results}
    text = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    return 0 if not failed else 1


# --- the steps ----------------------------------------------------------------------------------------------


def _teacher(work: Path, args: argparse.Namespace, size: dict[str, Any]) -> dict[str, Any]:
    from kdflow.bench.tokenise import pydoc_paragraphs, train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(work / "tokenizer", pydoc_paragraphs(400), 384)
    texts = pydoc_paragraphs(size["documents"])
    (work / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return build_teacher(work / "teacher", args.vocab, size, tokenizer) | {"load_in_4bit": args.four_bit}


def _tokens(work: Path, config_path: Path) -> dict[str, Any]:
    from kdflow.schemas.config import load_config
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise

    config = load_config(config_path)
    materialise(config)
    summary = tokenise(config, load_tokenizer(config))
    return {"shards": summary.shards, "sequences": summary.sequences, "tokens": summary.tokens}


def _tune(config_path: Path, size: dict[str, Any]) -> dict[str, Any]:
    from kdflow.tune import main as tune_main

    code, out = captured(tune_main, [str(config_path), "--micro-batches", size["micro_batches"], "--batches", "2",
                                     "--write", "--json", "--timeout-s", "300"])
    result = json_lines(out)[-1]
    if code != 0:
        raise RuntimeError(f"kdflow tune precompute exited {code}: no recommendation")
    return {key: result[key] for key in ("recommended_micro_batch", "recommended_tokens_per_s", "fastest_micro_batch",
                                         "recommended_over_fastest", "candidates")}


def _precompute(config_path: Path) -> dict[str, Any]:
    """The teacher pass in its worker process, as the precompute flow starts it (the tuned micro-batch if written)."""
    from kdflow.tasks.common.launch import run_child
    from kdflow.tasks.teacher.precompute_worker import MODULE

    outcome = run_child(MODULE, ["--config", str(config_path)], on_log=lambda pid, line: print(line, file=sys.stderr))
    if outcome.exit_code != 0 or outcome.result is None:
        message = outcome.errors[-1]["message"] if outcome.errors else ""
        raise RuntimeError(f"the teacher worker exited {outcome.exit_code}: {message}")
    keys = ("tag", "written", "tokens", "tokens_per_s", "peak_device_memory_mib", "device")
    return {key: outcome.result.get(key) for key in keys}


def _bench(what: str, argv: list[str]) -> dict[str, Any]:
    from kdflow.bench import run_bench

    code, out = captured(lambda bench_argv: run_bench(what, bench_argv), argv)
    records = json_lines(out)
    errors = [r for r in records if r.get("error") or str(r.get("status", "ok")).startswith("error")]
    if code != 0 or not records or errors:
        raise RuntimeError(f"kdflow bench {what} exited {code}: {errors[0] if errors else 'no records'}")
    return {"records": records}


def _train(config_path: Path) -> dict[str, Any]:
    import torch

    from kdflow.schemas.config import load_config
    from kdflow.tasks.student.train import autocast_for, train

    config = load_config(config_path)
    device = torch.device(config.student.device)
    autocast = autocast_for(device, config.student.autocast_bf16)
    summary = train(config)
    loss = summary["final_loss"]
    if loss is None or not torch.isfinite(torch.tensor(loss)):
        raise RuntimeError(f"training ended with loss {loss}")
    return {"steps": summary["steps"], "final_loss": loss, "tokens": summary["tokens"],
            "seconds_training": summary["seconds"],
            "autocast": "bf16" if isinstance(autocast, torch.autocast) else "off"}


def _fsdp(config_path: Path) -> dict[str, Any]:
    """Two ranks through torchrun, FSDP-sharded, for two more steps of a separate student."""
    import socket

    import yaml

    from kdflow.tasks.common.launch import config_file, run_child
    from kdflow.schemas.config import load_config
    from kdflow.tasks.student.distributed import torchrun_arguments
    from kdflow.tasks.student.train_worker import EXEC_TORCHRUN, MODULE

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    data["student"] |= {"name": "gpu-check-fsdp", "steps": 2, "save_every": 2,
                        "distributed": {"nproc_per_node": 2, "sharding": "fsdp", "rdzv_endpoint": f"127.0.0.1:{port}"}}
    config = load_config(_write(config_path.with_name("fsdp.yaml"), yaml.safe_dump(data, sort_keys=False)))
    with config_file(config, "kdflow-gpu-fsdp-") as path:
        outcome = run_child(MODULE, [EXEC_TORCHRUN, *torchrun_arguments(config.student.distributed, path)],
                            on_log=lambda pid, line: print(line, file=sys.stderr))
    if outcome.exit_code != 0 or outcome.result is None:
        message = outcome.errors[0].get("message") if outcome.errors else ""
        raise RuntimeError(f"torchrun exited {outcome.exit_code}: {message}")
    return {"steps": outcome.result.get("steps"), "final_loss": outcome.result.get("final_loss"), "world_size": 2}


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
