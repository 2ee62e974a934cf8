"""kdflow as a user installs it: a wheel built from the checkout, installed without `-e` into a fresh environment.

The wheel must hold every module and nothing else (no top-level `tasks`, `flows` or `schemas` of its own), and the
files kdflow reads at run time (the demo's config, the example configs and their documents) as package data: an
installed kdflow runs `kdflow demo --quick` from any folder, with no checkout beside it. The demo's end-to-end test
is here for that reason: it runs the installed wheel's `kdflow demo --quick` (and its rerun) from another folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from support.children import run
from support.modules import REPO, source_modules

from kdflow import demo_assets
from kdflow.commands import demo


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, children: None) -> Path:
    """The wheel, built once per pytest run: under xdist this module's tests run on two workers (the demo's on the
    Prefect server's), and the second takes the first's wheel rather than building its own (~25 s)."""
    from filelock import FileLock

    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one per pytest run, shared by its workers
    if run_id is None:
        return _build_wheel(tmp_path_factory.mktemp("wheel"))
    folder = tmp_path_factory.getbasetemp().parent / f"wheel-{run_id}"  # the workers' common temporary folder
    folder.mkdir(exist_ok=True)
    with FileLock(folder / ".lock"):
        return next(folder.glob("kdflow-*.whl"), None) or _build_wheel(folder)


def _build_wheel(folder: Path) -> Path:
    # Built from a copy of what the build reads (pyproject.toml, README.md, the package folders it maps), not from
    # the checkout: setuptools never removes a file it copied to build/ earlier, so a module since moved would still
    # be in a wheel built there, and a checkout also holds what it ignores (.venv, runs, the GPU mirror: GBs).
    source = folder / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder_name in set(package_dirs.values()):
        shutil.copytree(REPO / folder_name, source / folder_name, ignore=shutil.ignore_patterns("__pycache__"))
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


def test_the_installed_wheel_imports_itself_and_writes_out_its_example_configs(installed: Path,
                                                                              tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    kdflow = str(installed / "bin" / "kdflow")
    where = run([str(installed / "bin" / "python"), "-c", "import kdflow.configs; print(kdflow.configs.__file__)"],
                what="where kdflow is imported from", timeout=60, env=env, cwd=elsewhere)
    assert where.stdout.strip().startswith(str(installed)), where.stdout + where.stderr  # the wheel's, not the checkout
    copied = run([kdflow, "configs", "--write", "configs"], what="kdflow configs --write", timeout=120, env=env,
                 cwd=elsewhere)
    assert copied.returncode == 0, copied.stderr
    assert (elsewhere / "configs" / "example.yaml").read_bytes() == (REPO / "configs" / "example.yaml").read_bytes()
    assert (elsewhere / "configs" / "data" / "example.jsonl").is_file()
    again = run([kdflow, "configs", "--write", "configs"], what="kdflow configs --write again", timeout=120, env=env,
                cwd=elsewhere)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "exists already" in again.stderr


# Files a rerun writes again with the same bytes (each stage's resolved config, the training logs).
REWRITTEN = {"config.yaml", "metrics.jsonl", "eval.jsonl"}


def _snapshot(folder: Path) -> dict[str, int | bytes]:
    """Every file under `folder` -> its mtime in ns (its bytes for REWRITTEN): a rerun that does no work
    changes none of them."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.name in REWRITTEN else p.stat().st_mtime_ns
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != demo.SUMMARY_FILE}


def _installed_demo(installed: Path, root: Path, tmp_path: Path, prefect_api_url: str) -> str:
    """`kdflow demo --quick --run-root ROOT` of the installed wheel, from a folder of its own; its stdout."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    result = run([str(installed / "bin" / "kdflow"), "demo", "--quick", "--run-root", str(root)],
                 what="kdflow demo --quick from the installed wheel", timeout=900,
                 env=_user_env(tmp_path, prefect_api_url), cwd=elsewhere)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout


def _user_env(tmp_path: Path, prefect_api_url: str) -> dict[str, str]:
    """This environment without Prefect's or Python's settings, on the session's Prefect server."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "PYTHON"))}
    return env | {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": prefect_api_url}


def test_quick_demo_from_the_installed_wheel_learns_validates_and_resumes(installed: Path, tmp_path: Path,
                                                                         prefect_api_url: str) -> None:
    """`kdflow demo --quick` as a user who installed the wheel runs it: from another folder, no checkout."""
    from kdflow.schemas.commits import list_commits, read_complete
    from kdflow.schemas.manifests import load_manifest
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.common.models import teacher_fingerprint
    from kdflow.tasks.student.generate import generate

    root = tmp_path / "demo"
    first = _installed_demo(installed, root, tmp_path, prefect_api_url)
    config = demo_assets.demo_config(str(root), quick=True)
    run_root = RunRoot(str(root))

    # Every store's manifest validates, and so does the whole run root.
    for stage, store in (("corpus", "corpus"), ("tokens", "tokens")):
        done = read_complete(run_root, run_root.path(store))
        assert done is not None and len(load_manifest(run_root, run_root.path(store), stage,
                                                      done.fingerprint)) == done.shards
    (tag,) = os.listdir(root / "topk")
    assert len(load_manifest(run_root, run_root.path("topk", tag), "topk", tag, config.seq_len)) == len(
        list_commits(run_root, run_root.path("tokens"), "tokens"))
    from kdflow.commands.validate import validate_run_root

    assert validate_run_root(str(root)) == 0

    # The student learnt: held-out KL to the teacher fell clearly, and the saved model generates.
    student_dir = root / "students" / config.student.name
    evals = [json.loads(line) for line in (student_dir / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == config.student.steps
    assert evals[-1]["kl"] < 0.85 * evals[0]["kl"], evals
    # the full-vocabulary KL is reported too, above the stored top-K one (which merges the tail into one bucket)
    assert all(e["kl_full"] > e["kl_stored"] for e in evals) and evals[-1]["kl_full"] < evals[0]["kl_full"], evals
    assert "KL to the teacher, full vocabulary" in first
    assert evals[-1]["perplexity"] < evals[0]["perplexity"]
    text = generate(str(student_dir / "final"), demo.SAMPLE_PROMPT, max_new_tokens=8, device="cpu")
    assert isinstance(text, str) and text  # new tokens decoded (may be mostly punctuation and newlines)
    assert "held out" in first and f"kdflow chat {student_dir / 'final'}" in first

    # The teacher folder records the GGUF it came from, and the teacher fingerprint depends on that record.
    gguf = demo_assets.locate_teacher_gguf()
    teacher_dir = root / demo_assets.TEACHER_DIR
    recorded = json.loads((teacher_dir / "config.json").read_text())["kdflow_source"]
    assert recorded["gguf_sha256"] == demo_assets.file_sha256(gguf) and recorded["gguf_file"] == gguf.name
    other = tmp_path / "other-gguf"
    other.mkdir()
    settings = json.loads((teacher_dir / "config.json").read_text())
    settings["kdflow_source"]["gguf_sha256"] = "0" * 64
    (other / "config.json").write_text(json.dumps(settings))
    (other / "model.safetensors").symlink_to(teacher_dir / "model.safetensors")
    moved = config.teacher.model_copy(update={"model": str(other)})
    assert teacher_fingerprint(config.teacher) != teacher_fingerprint(moved)

    # A rerun does no work: no file changes, and it says every stage skipped.
    before = _snapshot(root)
    second = _installed_demo(installed, root, tmp_path, prefect_api_url)
    assert _snapshot(root) == before
    assert "worked" not in second.split("this run", 1)[1].split("held out", 1)[0]
    assert "nothing recomputed" in second
    shutil.rmtree(root / "students")  # the stores stay valid without the student
    assert validate_run_root(str(root)) == 0
