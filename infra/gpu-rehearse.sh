#!/usr/bin/env bash
# Rehearse the GPU check here, on the CPU, as it will run on the lent GPU machine: infra/gpu-check.sh as shipped,
# with the carried wheels (.whl/, from infra/gpu-wheels.sh), under a Python 3.12 virtual environment that copies the
# part of the GPU image the check imports, at the image's versions where they are known (infra/gpu-image-packages.txt:
# torch 2.11, transformers 5.17, ...) and holding nothing the image lacks. What the suite's rehearsal cannot see
# shows here: a wheel built for the wrong Python, a package the image has in another version, kdflow imported from
# the tree instead of its install. Downloads about 3 GB the first time (torch's CUDA build; it runs on the CPU).
#
#   infra/gpu-rehearse.sh              # the check at the rehearsal's sizes; its summary in gpu-check.json
#   infra/gpu-rehearse.sh --plan       # only the plan at full size
#   infra/gpu-rehearse.sh --tests      # the suite's tests of what runs on the GPU (Triton kernels through Triton
#                                      # 3.6's interpreter, the experts, the compiled body) under the image's versions
#
# Environment: KDFLOW_PYTHON312 (a Python 3.12 to build from; default: python3.12 on PATH, else pyenv's),
# KDFLOW_GPU_MIRROR (the environment's folder, default .gpu-mirror, ignored by git; kept between runs).
set -euo pipefail
cd "$(dirname "$0")/.."
MIRROR="${KDFLOW_GPU_MIRROR:-.gpu-mirror}"
# The image's packages that the check's code paths import (and theirs); the image holds many more.
NEEDED=(torch transformers accelerate huggingface-hub tokenizers safetensors numpy triton pyarrow pandas fsspec
        matplotlib typing-inspect mypy-extensions pyyaml xxhash aiohttp requests tqdm packaging filelock regex
        psutil setuptools wheel)

if [[ ! -f "$MIRROR/.complete" ]]; then  # built whole or built again
    base="${KDFLOW_PYTHON312:-}"
    if [[ -z "$base" ]]; then  # the first Python 3.12 that runs (a pyenv shim may exist and refuse)
        for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
            if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
                base=$candidate
                break
            fi
        done
    fi
    [[ -n "$base" ]] || { echo "gpu-rehearse: no Python 3.12 here; set KDFLOW_PYTHON312" >&2; exit 2; }
    rm -rf "$MIRROR"
    "$base" -m venv "$MIRROR"
    "$MIRROR/bin/python" -m pip install -q -c <(grep '==' infra/gpu-image-packages.txt) "${NEEDED[@]}"
    # What pip brought along that the image lacks (pydantic, say) comes from the carried wheels there: remove it.
    "$MIRROR/bin/python" -P - infra/gpu-image-packages.txt <<'PY'  # -P: not this tree's egg-info
import importlib.metadata as md, re, subprocess, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = {norm(line.split("#")[0].split("==")[0].strip()) for line in open(sys.argv[1]) if line.split("#")[0].strip()}
extra = sorted({d.metadata["Name"] for d in md.distributions()} - {"pip"}, key=norm)
extra = [name for name in extra if norm(name) not in image]
if extra:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *extra], check=True)
    print("gpu-rehearse: removed, not in the image:", " ".join(extra), file=sys.stderr)
PY
    touch "$MIRROR/.complete"
fi
[[ -n "$(ls .whl/*.whl 2>/dev/null)" ]] || bash infra/gpu-wheels.sh
site="${KDFLOW_GPU_SITE:-/tmp/kdflow-gpu-mirror-site}"  # where kdflow and the wheels are installed, as there
if [[ " $* " == *" --tests "* ]]; then
    # kdflow and the wheels into their own folder, as gpu-check.sh installs them; beside them pytest and a numpy that
    # Triton 3.6's interpreter runs on (it converts 1-element arrays to Python ints, which numpy 2.5 refuses; the GPU
    # compiles the kernels and never interprets them), in a folder of their own: the image has neither pytest's
    # version nor that numpy. The unit tier only: the others start flows, and Prefect is not on the image.
    tools="$MIRROR/test-tools"
    rm -rf "$site"
    "$MIRROR/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
    "$MIRROR/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target "$site" .
    if [[ ! -f "$tools/.complete" ]]; then
        rm -rf "$tools"
        "$MIRROR/bin/python" -m pip install -q --target "$tools" "pytest>=8,<9.2" "numpy<2.4"
        touch "$tools/.complete"
    fi
    PYTHONPATH="$tools:$site" exec "$MIRROR/bin/python" -P -m pytest -o addopts="" -p no:cacheprovider -q -m unit \
        -W ignore::pytest.PytestUnknownMarkWarning tests/test_fused_moe.py tests/test_tiled_topk.py \
        tests/test_head_gemm.py tests/test_sampled_tiles.py tests/test_sampling.py tests/test_fused_experts.py \
        tests/test_body_variants.py tests/test_topk.py tests/test_expert_check.py tests/test_teacher_benches.py \
        tests/test_gpu_full_depth.py tests/test_gpu_hub_layout.py tests/test_gpu_profile.py tests/test_gpu_plan.py \
        tests/test_gpu_report.py
fi
sizes=(--device cpu)  # the rehearsal's sizes on this CPU; the plan is at full size, for the GPU
[[ " $* " == *" --plan "* ]] && sizes=()
KDFLOW_PYTHON="$MIRROR/bin/python" KDFLOW_GPU_SITE="$site" \
    exec bash infra/gpu-check.sh "${sizes[@]}" "$@"
