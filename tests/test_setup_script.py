"""infra/setup.sh --dry-run on Linux: which torch it would install, decided by pip's own resolution of
torch==2.13.0 as pip is configured (offline here: a folder of stand-in wheels, no index). A CPU build found
that way is installed as is; a CUDA build (one that requires nvidia-* packages), or none, sends it to PyTorch's
CPU wheel index as an extra index."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def stand_in_torch(folder: Path, version: str, requires: list[str]) -> None:
    """A wheel named torch with only metadata: enough for pip to resolve it, never installed."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"torch-{version}.dist-info"
    metadata = "".join(["Metadata-Version: 2.1\nName: torch\n", f"Version: {version}\n",
                        *(f"Requires-Dist: {r}\n" for r in requires)])
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", metadata)
        wheel.writestr(f"{info}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def dry_run(tmp_path: Path, wheels: Path) -> str:
    venv = tmp_path / "venv"  # a bare environment with pip and no torch
    if not venv.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nno-index = true\nfind-links = {wheels}\n", encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": str(config), "KDFLOW_VENV": str(venv), "KDFLOW_TORCH": "cpu",
            "PYTHON": sys.executable}
    script = tmp_path / "repo" / "infra" / "setup.sh"  # a copy: the script runs from the folder above its own
    if not script.exists():
        script.parent.mkdir(parents=True)
        shutil.copy(ROOT / "infra" / "setup.sh", script)
    done = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU index is chosen on Linux only")
@pytest.mark.usefixtures("children")
def test_setup_takes_a_cpu_torch_pip_finds_else_the_cpu_index(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    stand_in_torch(wheels, "2.13.0", ["filelock", "sympy>=1.13.3"])  # as PyTorch's CPU builds declare
    torch_lines = [line for line in dry_run(tmp_path, wheels).splitlines() if "torch==2.13.0" in line]
    assert any("the CPU build pip finds as configured" in line for line in torch_lines), torch_lines
    assert not any(CPU_INDEX in line for line in torch_lines)
    assert any(line.endswith("pip --disable-pip-version-check -q install torch==2.13.0") for line in torch_lines)

    shutil.rmtree(wheels)
    stand_in_torch(wheels, "2.13.0", ["filelock", 'nvidia-cublas-cu12==12.8.4.1; platform_system == "Linux"'])
    torch_lines = [line for line in dry_run(tmp_path, wheels).splitlines() if "torch==2.13.0" in line]
    assert any(line.endswith(f"install --extra-index-url {CPU_INDEX} torch==2.13.0") for line in torch_lines)

    shutil.rmtree(wheels)
    wheels.mkdir()  # pip finds no torch at all: the CPU index too
    out = dry_run(tmp_path, wheels)
    assert f"--extra-index-url {CPU_INDEX} torch==2.13.0" in out and "dry run: nothing was changed" in out
