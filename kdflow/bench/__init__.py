"""kdflow's benchmarks, each printing one JSON object per line: `kdflow bench NAME [options]`.

One module per benchmark (`BENCHES` names them); `harness` holds what they share (a measurement in a fresh
process, peak memory, JSON-line output); `store_train`, `stores` and the `fidelity_*` modules are helpers of
the store, scale and fidelity benches. Only the command line (`kdflow.cli`) imports this package; a benchmark's
module is imported when it runs, so `kdflow --help` stays instant.
"""

from __future__ import annotations

import importlib

# `kdflow bench NAME` -> the module whose main(argv) runs it (the CLI's choices, in its --help order).
BENCHES = {
    "precompute": "kdflow.bench.precompute",
    "loss": "kdflow.bench.loss",
    "tokenise": "kdflow.bench.tokenise",
    "store": "kdflow.bench.store",
    "fidelity": "kdflow.bench.fidelity",
    "teacher-pass": "kdflow.bench.teacher_pass",
    "gpu": "kdflow.bench.gpu",
    "logits-precision": "kdflow.bench.logits_precision",
    "train-step": "kdflow.bench.train_step",
    "scale": "kdflow.bench.scale",
}

# What each one measures, for `kdflow bench --help` (its module's docstring says how).
SUMMARIES = {
    "precompute": "the teacher pass's top-K step, chunked against dense",
    "loss": "time and peak memory of the fused top-K KL loss against a dense one",
    "tokenise": "the tokenizer's batch speed against the tokenise stage end to end",
    "store": "bytes/position, KL and speed of every top-K codec setting",
    "fidelity": "how well a student learns the teacher from each kind of stored target",
    "teacher-pass": "the whole teacher pass against the bare forward of the same model and batch",
    "gpu": "the GPU check: every CUDA path at the reference teacher's shapes (infra/gpu-check.sh)",
    "logits-precision": "how far a 16-bit teacher's rounded logits move what the pass stores",
    "train-step": "the student's training step against its limit",
    "scale": "how memory, start-up and requests grow with the run's size, on local disk and on S3",
}


def run_bench(name: str, argv: list[str]) -> int:
    """Run benchmark `name` with its own command-line options; -> its exit code, under the harness's rule
    that a benchmark which measured nothing never exits 0 (`kdflow.bench.harness.run_main`)."""
    from kdflow.bench.harness import run_main

    return run_main(name, importlib.import_module(BENCHES[name]).main, argv)
