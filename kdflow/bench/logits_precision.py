"""`kdflow bench logits-precision`: how far a 16-bit teacher's rounded logits move what the pass stores, on a
trained teacher and real text: the demo's teacher (SmolLM2-135M) loaded in bf16 (or fp16), Python's documentation
topics (the demo's corpus) as input. One JSON line (`logits_precision_measure.precision`): KL per position
of the 16-bit logits from float32 ones on the same hidden states, against the store codec's budget; the same
for float32 logits merely rounded (rounding the output is then the whole error, and so device-independent);
the top-K id overlap and tail mass; and the chunked top-K with `teacher.lm_head_float32` on and off (time,
stored values). This measurement set that option's default.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from kdflow.bench.args import bench_parser


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("logits-precision", __doc__, run_root=True, device="cpu", seq_len=256, top_k=128, seed=0,
                          helps={"run_root": "where the demo teacher is kept",
                                 "seq_len": "tokens of each (documents shorter are passed over)",
                                 "seed": "which documents (a random pick)"})
    parser.add_argument("--sequences", type=int, default=8, help="documents of the corpus, one sequence each")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("sequences", "seq_len", "top_k"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import AutoTokenizer

    from kdflow.bench.harness import emit
    from kdflow.bench.logits_precision_measure import logits_precision
    from kdflow.demo_assets import corpus_lines, demo_config, local_run_root, locate_teacher_gguf, prepare_teacher

    folder = Path(demo_config(local_run_root(args.run_root)).teacher.model)
    prepare_teacher(locate_teacher_gguf(), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [json.loads(line)["text"] for line in corpus_lines()]
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(args.seed)).tolist()
    rows: list[list[int]] = []
    for index in order:
        ids = tokenizer(texts[index], add_special_tokens=False)["input_ids"]
        if len(ids) >= args.seq_len:
            rows.append(ids[: args.seq_len])
        if len(rows) == args.sequences:
            break
    if not rows:
        raise SystemExit(f"no document of the corpus has {args.seq_len} tokens: lower --seq-len")
    record: dict[str, Any] = {"bench": "logits_precision", "teacher": folder.name, "device": args.device,
                              "sequences": len(rows), "seq_len": args.seq_len}
    record |= logits_precision(folder, args.device, len(rows) * args.seq_len, args.top_k,
                               input_ids=torch.tensor(rows), dtype=args.dtype)
    emit(record | {"loadavg_1m": round(os.getloadavg()[0], 2)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
