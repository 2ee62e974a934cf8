"""kdflow as a user installs it: a wheel built from the checkout, installed without `-e` into a fresh environment.

The wheel must hold every module and nothing else (no top-level `tasks`, `flows` or `schemas` of its own), and the
files kdflow reads at run time (the demo's config, the example configs and their documents) as package data: an
installed kdflow runs `kdflow demo --quick` from any folder, with no checkout beside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from support.children import run
from support.modules import REPO, source_modules


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, children: None) -> Path:
    # Built from a copy without build/: setuptools never removes a file it copied there earlier, so a module
    # since moved would still be in a wheel built from the checkout itself.
    folder = tmp_path_factory.mktemp("wheel")
    source = folder / "source"
    shutil.copytree(REPO, source,
                    ignore=shutil.ignore_patterns(".git", ".venv", "build", "runs", "*.egg-info", "__pycache__"))
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                 "--wheel-dir", str(folder), str(source)], what="pip wheel", timeout=300)
    assert built.returncode == 0, built.stderr
    return next(folder.glob("kdflow-*.whl"))


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding the wheel alone; its dependencies are this environment's (a .pth line
    adds their folder, whose own .pth files, the editable install's among them, are not run)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    what="the fresh environment's site-packages", timeout=60).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    result = run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                  "--quiet", str(wheel)], what="pip install the wheel", timeout=300)
    assert result.returncode == 0, result.stderr
    return venv


def test_every_package_folder_is_in_the_wheel_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    files = {name for name in names if name.endswith(".py")}
    top_level = {name.split("/")[0] for name in files}
    assert top_level == {"kdflow"}  # no `tasks`, `flows` or `schemas` of its own
    packages = [name for name, path in source_modules().items() if path.name == "__init__.py"]  # every package folder
    missing = [package for package in packages if f"{package.replace('.', '/')}/__init__.py" not in files]
    assert missing == []
    assert len(files) == len(source_modules())  # every module, no stray file
    from kdflow.configs import SHIPPED

    assert {f"kdflow/configs/{name}" for name in SHIPPED} <= names


def test_the_installed_wheel_runs_its_demo_from_another_folder(installed: Path, tmp_path: Path,
                                                               prefect_api_url: str) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "PYTHON"))}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": prefect_api_url}
    kdflow = str(installed / "bin" / "kdflow")
    where = run([str(installed / "bin" / "python"), "-c", "import kdflow.configs; print(kdflow.configs.__file__)"],
                what="where kdflow is imported from", timeout=60, env=env, cwd=elsewhere)
    assert where.stdout.strip().startswith(str(installed)), where.stdout + where.stderr  # the wheel's, not the checkout

    demo = run([kdflow, "demo", "--quick", "--run-root", str(tmp_path / "demo")], what="kdflow demo --quick from a "
               "wheel", timeout=900, env=env, cwd=elsewhere)
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-3000:]
    assert (tmp_path / "demo" / "students" / "demo-student-quick" / "final" / "config.json").is_file()

    copied = run([kdflow, "configs", "--write", "configs"], what="kdflow configs --write", timeout=120, env=env,
                 cwd=elsewhere)
    assert copied.returncode == 0, copied.stderr
    assert (elsewhere / "configs" / "example.yaml").read_bytes() == (REPO / "configs" / "example.yaml").read_bytes()
    assert (elsewhere / "configs" / "data" / "example.jsonl").is_file()
    again = run([kdflow, "configs", "--write", "configs"], what="kdflow configs --write again", timeout=120, env=env,
                cwd=elsewhere)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "exists already" in again.stderr
