#!/usr/bin/env bash
# Download the wheels that the GPU check needs and the GPU machine's image lacks (infra/gpu-wheels.txt) for that
# machine's Python (3.12, CPython) and platform (x86-64 manylinux) into .whl/ (ignored by git), then print their
# total size: with the working tree it must stay under the 64 MiB that travels to that machine.
#
#   infra/gpu-wheels.sh            # here, where a package registry is reachable
#   WHEEL_DIR=elsewhere infra/gpu-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${WHEEL_DIR:-.whl}"
PYTHON="${KDFLOW_PYTHON:-.venv/bin/python}"
mkdir -p "$DIR"
mapfile -t wanted < <(grep -v '^\s*#' infra/gpu-wheels.txt | grep -v '^\s*$')
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
# --no-deps: the list is exact (each package's needs that the image lacks are listed themselves).
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform any -d "$DIR" "${wanted[@]}"
# Keep exactly the listed wheels (an older download of another version would stop the no-index install).
"$PYTHON" - "$DIR" "${wanted[@]}" <<'PY'
import re, sys
from pathlib import Path
folder, wanted = Path(sys.argv[1]), sys.argv[2:]
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
keep = {(norm(n), v) for n, v in (w.split("==") for w in wanted)}
total = 0
for wheel in sorted(folder.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    if (norm(name), version) not in keep:
        wheel.unlink()
        continue
    total += wheel.stat().st_size
found = len(list(folder.glob("*.whl")))
if found != len(keep):
    sys.exit(f"gpu-wheels: {found} wheels in {folder}, {len(keep)} listed in infra/gpu-wheels.txt")
print(f"gpu-wheels: {found} wheels, {total} bytes ({total / 2**20:.1f} MiB) in {folder}")
PY
