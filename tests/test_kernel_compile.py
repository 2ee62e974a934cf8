"""`kdflow bench kernels`: every Triton kernel of the pass compiled ahead of time for Hopper and for the 24 GB
reference card, here without a GPU, by the Triton the suite installs (the interpreter runs them for their values
elsewhere in the suite; this is what the interpreter cannot tell: that the GPU's compiler takes them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.usefixtures("children")
def test_every_kernel_compiles_for_sm90_and_sm86_within_their_shared_memory() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # decorated as compiled, not interpreted
    result = subprocess.run([sys.executable, "-m", "kdflow", "bench", "kernels", "--arch", "90,86"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    compiled = [line for line in lines if "kernel" in line]
    assert not [line for line in lines if "error" in line]
    kernels = {"tile_stats", "sample_tile_stats", "tile_keys", "head_gemm_tile_stats", "expert_gate_up", "expert_down"}
    for arch in (90, 86):
        assert {line["kernel"] for line in compiled if line["arch"] == arch} == kernels
    assert all(line["fits_shared"] and line["cubin_bytes"] > 0 for line in compiled)
    assert all(line["registers"] and not line["spill_stores"] for line in compiled)  # ptxas -v: nothing spilled
    cases = {line["case"] for line in compiled}
    assert {"tile_stats float32", "tile_stats bfloat16", "sampler gumbel bfloat16", "experts bfloat16 small",
            "experts bfloat16 large"} <= cases
    assert {"head_gemm bfloat16 -> float32", "head_gemm sampler gumbel bfloat16 -> float32"} <= cases
    gemm = [line for line in compiled if line["case"].startswith("head_gemm") and "bfloat16 ->" in line["case"]]
    assert gemm and all(line["tensor_cores"] == ("wgmma" if line["arch"] == 90 else "mma") for line in gemm)
    experts = [line for line in compiled if line["kernel"].startswith("expert_") and "float32" not in line["case"]]
    assert all(line["tensor_cores"] in ("mma", "wgmma") for line in experts)  # 16-bit GEMMs are on tensor cores
    ieee = [line for line in compiled if line["case"].startswith("experts float32")]  # float32: full products
    assert ieee and all(line["tensor_cores"] is None for line in ieee)
    large = [line for line in experts if line["case"].endswith(" large")]
    assert large and all(line["tensor_cores"] == ("wgmma" if line["arch"] == 90 else "mma") for line in large)
    hopper = [line for line in experts if line["case"].endswith(" hopper")]  # sm_90's prefill tiling: there only
    assert hopper and {(line["arch"], line["tensor_cores"]) for line in hopper} == {(90, "wgmma")}


def test_a_target_it_does_not_know_is_one_line() -> None:
    from kdflow.bench.kernels import main

    with pytest.raises(SystemExit, match=r"--arch '75': known are 80,86,89,90"):
        main(["--arch", "75"])
