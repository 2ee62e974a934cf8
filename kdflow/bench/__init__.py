"""kdflow's benchmarks, each printing one JSON object per line: `kdflow bench NAME [options]`.

Every benchmark ships in the wheel. Users run precompute, loss, tokenise, store, teacher-pass, train-step,
logits-precision, body, import and gpu (the GPU check): what their own machine, teacher and settings cost. head,
kernels, fidelity and scale are developer benchmarks, marked "(developers)" in `kdflow bench --help`: they answer
questions about kdflow's own design (what the pass's head costs each way it can run, whether every Triton kernel
compiles for the GPUs it targets, which kind of stored target a student learns from best, over many stored runs;
how memory, start-up and requests grow with a run's size, on S3 through moto, a test extra).

One module per benchmark (`BENCHES` names them), with helpers beside them: `harness` (a measurement in a fresh
process, peak memory, JSON-line output, the exit rule), `args` (the command line every bench shares), and the
helpers of one bench each (`store_train`; `scale_stores`; the `fidelity_*` modules; `gpu_plan`, `gpu_steps`,
`gpu_teachers`; `logits_precision_measure`; `train_step_measure`). A bench with a `records(args)` function yields
the dicts its JSON lines are printed from, so that Python code (the GPU check) takes its measurements as they are.

The benchmarks build on the stages' own code (kdflow.schemas, kdflow.tasks) and the demo's assets, never on a
command, a flow or the CLI (tests/test_layout.py); only the command line (`kdflow.cli`) imports this package, and a
benchmark's module is imported when it runs, so `kdflow --help` stays instant.
"""

from __future__ import annotations

import importlib

# `kdflow bench NAME` -> the module whose main(argv) runs it (the CLI's choices, in its --help order: the users'
# benchmarks, then the developers').
BENCHES = {
    "precompute": "kdflow.bench.precompute",
    "loss": "kdflow.bench.loss",
    "tokenise": "kdflow.bench.tokenise",
    "store": "kdflow.bench.store",
    "teacher-pass": "kdflow.bench.teacher_pass",
    "train-step": "kdflow.bench.train_step",
    "logits-precision": "kdflow.bench.logits_precision",
    "head": "kdflow.bench.head",
    "body": "kdflow.bench.body",
    "kernels": "kdflow.bench.kernels",
    "import": "kdflow.bench.import_rate",
    "gpu": "kdflow.bench.gpu",
    "fidelity": "kdflow.bench.fidelity",
    "scale": "kdflow.bench.scale",
}

DEVELOPERS = "(developers) "  # what marks a developer benchmark in the listing

# What each one measures, for `kdflow bench --help` (its module's docstring says how).
SUMMARIES = {
    "precompute": "the teacher pass's top-K step, chunked against dense",
    "loss": "time and peak memory of the fused top-K KL loss against a dense one",
    "tokenise": "the tokenizer's batch speed against the tokenise stage end to end",
    "store": "bytes/position, KL and speed of every top-K codec setting",
    "teacher-pass": "the whole teacher pass against the bare forward of the same model and batch",
    "train-step": "the student's training step against its limit",
    "logits-precision": "how far a 16-bit teacher's rounded logits move what the pass stores",
    "head": DEVELOPERS + "the teacher's head (lm_head, log-sum-exp, top-K) each way the pass can take it, "
            "against its matmul",
    "body": "a MoE teacher's body under each experts implementation and torch.compile, against eager",
    "kernels": DEVELOPERS + "every Triton kernel of the pass compiled for sm_90, sm_86 and sm_80, no GPU needed",
    "import": "positions/s, MB/s and peak memory of `kdflow store import` against the source's size",
    "gpu": "the GPU check: every CUDA path at the reference teacher's shapes (infra/gpu-check.sh)",
    "fidelity": DEVELOPERS + "how well a student learns the teacher from each kind of stored target",
    "scale": DEVELOPERS + "how memory, start-up and requests grow with the run's size, on local disk and on S3",
}


def run_bench(name: str, argv: list[str]) -> int:
    """Run benchmark `name` with its own command-line options; -> its exit code, under the harness's rule
    that a benchmark which measured nothing never exits 0 (`kdflow.bench.harness.run_main`)."""
    from kdflow.bench.harness import run_main

    return run_main(name, importlib.import_module(BENCHES[name]).main, argv)
