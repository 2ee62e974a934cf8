"""Fault tolerance end to end: a long teacher pass meets killed workers, corrupted files, full disks, a second
worker, a killed student and bad input, and a rerun ends with the bytes of a run that never failed.

One token store (corpus + tokens, 6 shards) and one uninterrupted top-K store are built once for the module;
each test works on its own copy. What test_precompute*.py and test_validate.py already assert (the CUDA-error
retry, the in-process kill/resume, the content checks of validate) is not repeated here.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.children import finish, kill_group, run
from support.corpus import flip_byte, sample_documents, write_jsonl
from support.runs import prepare

from kdflow.schemas.commits import list_commits, load_manifest
from kdflow.schemas.config import KDFlowConfig, config_from_dict, dump_config, set_dotted
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import commit_file_name, data_file_name
from kdflow.schemas.protocol import ERROR_PREFIX, EXIT_NO_SPACE, EXIT_USER_ERROR, PROGRESS_PREFIX, RESULT_PREFIX
from kdflow.schemas.storage import RunRoot, sha256_of
from kdflow.tasks.teacher.leases import ShardLeases
from kdflow.tasks.teacher.precompute import precompute_shards
from kdflow.tasks.teacher.precompute_worker import run as run_worker_here
from kdflow.validate import validate_run_root

REPO = Path(__file__).resolve().parents[1]
STORE_FILES = {"_complete.json", "_store.json", "config.yaml", "_renumbering.bin"}  # besides shard-N.arrow / .commit.json
SECRET = "sekrit-value"


@dataclass(frozen=True)
class Prepared:
    base: Path  # base/tokens-only: corpus + tokens; base/reference: the same plus an uninterrupted top-K store
    corpus: Path
    teacher: Path
    tag: str
    shards: int
    reference: dict[str, str]  # data file name -> sha256 of the uninterrupted run's top-K shard


def fault_config(run_root: Path, teacher: Path, corpus: Path, **overrides: Any) -> KDFlowConfig:
    """The tiny run of conftest's make_config (seq_len 32, K 8, 8 sequences a shard), dotted overrides `a__b=v`."""
    data: dict[str, Any] = {
        "run_root": str(run_root),
        "dataset": {"path": str(corpus), "documents_per_part": 16},
        "seq_len": 32,
        "teacher": {"model": str(teacher), "device": "cpu", "dtype": "float32"},
        "precompute": {"top_k": 8, "micro_batch": 4, "sequences_per_shard": 8, "max_attempts": 3, "retry_delay_s": 0},
        "student": {"steps": 6, "batch_size": 4, "eval_sequences": 8, "warmup_steps": 1, "save_every": 2, "device": "cpu",
                    "architecture": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "intermediate_size": 64}},
    }
    for key, value in overrides.items():
        set_dotted(data, key.replace("__", "."), value)
    return config_from_dict(data)


def data_hashes(store: Path) -> dict[str, str]:
    """sha256 of every top-K data file actually on disk (not what the records claim)."""
    return {p.name: sha256_of(RunRoot(str(store.parent)), str(p)) for p in sorted(store.glob("shard-*.arrow"))}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> Prepared:
    base = tmp_path_factory.mktemp("faults")
    corpus = write_jsonl(base / "docs.jsonl", sample_documents(16))
    prepare(fault_config(base / "tokens-only", tiny_teacher_dir, corpus))
    shutil.copytree(base / "tokens-only", base / "reference")
    summary = precompute_shards(fault_config(base / "reference", tiny_teacher_dir, corpus))
    reference = data_hashes(base / "reference" / "topk" / summary["tag"])
    assert summary["complete"] and len(reference) == summary["shards"] >= 4
    return Prepared(base, corpus, tiny_teacher_dir, summary["tag"], summary["shards"], reference)


@pytest.fixture
def run_copy(prepared: Prepared, tmp_path: Path) -> Callable[..., KDFlowConfig]:
    """-> copy(source='tokens-only'|'reference', run_root=None, **overrides): a private copy of a prepared run root."""

    def copy(source: str = "tokens-only", run_root: Path | None = None, **overrides: Any) -> KDFlowConfig:
        target = run_root or tmp_path / "run"
        shutil.copytree(prepared.base / source, target, dirs_exist_ok=True)
        return fault_config(target, prepared.teacher, prepared.corpus, **overrides)

    return copy


def topk_store(config: KDFlowConfig, prepared: Prepared) -> Path:
    return Path(config.run_root) / "topk" / prepared.tag


def shard_files(ids: Iterable[int]) -> set[str]:
    return {name for i in ids for name in (data_file_name("topk", i), commit_file_name("topk", i))}


def assert_clean_and_identical(config: KDFlowConfig, prepared: Prepared) -> None:
    """Exactly one data file and one valid commit record per shard, nothing else (no temp file, lease or orphan),
    and every data file byte-identical to the uninterrupted run's."""
    store = topk_store(config, prepared)
    assert {p.name for p in store.iterdir()} == shard_files(range(prepared.shards)) | STORE_FILES
    records = list_commits(RunRoot(config.run_root), str(store), "topk", prepared.tag)
    assert sorted(records) == list(range(prepared.shards))
    on_disk = data_hashes(store)
    assert on_disk == prepared.reference
    assert {r.data_file: r.sha256 for r in records.values()} == on_disk


def lines_with(prefix: str, text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)]


def worker_env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KDFLOW_FAULT"} | extra


def start_worker(config_path: Path, **env: str) -> subprocess.Popen:
    """A teacher worker in its own process group (finish() waits for it and kills the group afterwards)."""
    return subprocess.Popen([sys.executable, "-m", "kdflow.tasks.teacher.precompute_worker", "--config", str(config_path)], cwd=REPO,
                            env=worker_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def write_config(config: KDFlowConfig, path: Path) -> Path:
    path.write_text(dump_config(config))
    return path


# --- the teacher pass -------------------------------------------------------------------------------------


def test_worker_killed_mid_shard_is_retried_by_the_flow_with_identical_output(prefect_harness, run_copy, prepared,
                                                                               monkeypatch) -> None:
    from kdflow.flows.precompute import precompute_flow

    config = run_copy()
    monkeypatch.setenv("KDFLOW_FAULT", "kill@shard=1,micro_batch=1")  # SIGKILL: no Python cleanup at all
    result = precompute_flow(config)

    fired = json.loads((Path(config.run_root) / "_faults" / "kill.micro_batch-1.shard-1.fired").read_text())
    assert result["attempt"] == 2 and result["worker_pid"] != fired["pid"]  # a second, fresh process finished
    assert result["written"] == prepared.shards - 1 and result["tag"] == prepared.tag
    # Committed exactly once each: shard 0 by the killed worker, before the kill, and never again; the rest by the retry,
    # which took over the killed worker's lease and temp file of shard 1.
    records = list_commits(RunRoot(config.run_root), str(topk_store(config, prepared)), "topk", prepared.tag)
    assert records[0].created_at < fired["time"] < min(r.created_at for i, r in records.items() if i > 0)
    assert_clean_and_identical(config, prepared)


def test_validate_fix_makes_the_next_run_recompute_exactly_the_damaged_shards(run_copy, prepared, capsys) -> None:
    config = run_copy("reference")
    store = topk_store(config, prepared)
    flip_byte(str(store / data_file_name("topk", 1)))  # same size: only re-hashing can tell
    truncated = store / data_file_name("topk", 3)
    size = truncated.stat().st_size
    os.truncate(truncated, size - 100)
    damaged = shard_files([1, 3])
    untouched = {p.name: p.stat().st_mtime_ns for p in store.glob("shard-*") if p.name not in damaged}

    assert validate_run_root(config.run_root) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if "PROBLEM" in line]
    assert len(problems) == 2, problems
    assert any(f"topk/{prepared.tag} shard 1: shard-00001.arrow has sha256" in line for line in problems)
    assert any(f"topk/{prepared.tag} shard 3: invalid commit record: data file has {size - 100} bytes, its record says {size}"
               in line for line in problems)

    assert validate_run_root(config.run_root, fix=True) == 1
    assert "removed 2 commit record(s)" in capsys.readouterr().out
    commits = sorted(p.name for p in store.glob("*.commit.json"))
    assert commits == [commit_file_name("topk", i) for i in range(prepared.shards) if i not in (1, 3)]

    capsys.readouterr()
    assert validate_run_root(config.run_root) == 0  # right after --fix: what the next run recomputes, as a note
    assert "shard(s) 1,3 have no commit record: the next run of precompute computes what is missing" in capsys.readouterr().out

    summary = precompute_shards(config)
    assert (summary["written"], summary["skipped"]) == (2, prepared.shards - 2)
    assert {p.name: p.stat().st_mtime_ns for p in store.glob("shard-*") if p.name not in damaged} == untouched
    assert_clean_and_identical(config, prepared)
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out


def test_a_data_file_without_its_commit_record_is_never_read_and_is_recomputed(run_copy, prepared, capsys) -> None:
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_stores

    config = run_copy("reference")
    store = topk_store(config, prepared)
    run_root = RunRoot(config.run_root)
    # What a writer stopped between its data file and its commit record leaves, here with wrong contents of the
    # right size: nothing may trust it.
    orphan = store / data_file_name("topk", 2)
    (store / commit_file_name("topk", 2)).unlink()
    orphan.write_bytes(bytes(orphan.stat().st_size))

    assert 2 not in list_commits(run_root, str(store), "topk", prepared.tag)
    assert 2 not in set(load_manifest(run_root, str(store), "topk", prepared.tag, config.seq_len)["shard_id"])
    with pytest.raises(StoreError) as caught:  # the student's reader refuses it, in one line
        open_stores(config, load_tokenizer(config))
    assert "shard-00002" in str(caught.value) and "is not committed; run precompute first" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert validate_run_root(config.run_root) == 1
    assert f"topk/{prepared.tag} shard 2: no commit record" in capsys.readouterr().out

    summary = precompute_shards(config)
    assert (summary["written"], summary["skipped"]) == (1, prepared.shards - 1)
    assert_clean_and_identical(config, prepared)


# --- full disks -------------------------------------------------------------------------------------------


class SmallDisk:
    """A tmpfs at `path` (needs root), sized in pages, its unit of allocation; `resize` works in place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], check=True, capture_output=True,
                       text=True)
        self.page = os.statvfs(path).f_frsize

    def pages(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.page)

    def resize(self, pages: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={pages * self.page // 1024}k", str(self.path)], check=True,
                       capture_output=True)

    def used_pages(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_blocks - stats.f_bfree

    def fill(self) -> None:
        """Leave no free page: the state another process filling the disk leaves."""
        free = os.statvfs(self.path).f_bavail
        (self.path / "ballast").write_bytes(bytes(free * self.page))
        assert os.statvfs(self.path).f_bavail == 0


@pytest.fixture
def small_disk(tmp_path: Path, children: Any) -> Iterator[tuple[SmallDisk | None, str]]:
    """-> (disk, "") or (None, why no tmpfs could be mounted here)."""
    try:
        disk = SmallDisk(tmp_path / "disk")
    except (OSError, subprocess.CalledProcessError) as error:
        yield None, f"cannot mount a tmpfs here: {(getattr(error, 'stderr', None) or str(error)).strip().splitlines()[0]}"
        return
    try:
        yield disk, ""
    finally:
        subprocess.run(["umount", "-l", str(disk.path)], check=False)


@pytest.mark.usefixtures("children")
def test_disk_full_mid_pass_fails_with_exit_code_3_and_a_rerun_after_freeing_space_completes(small_disk, run_copy, prepared,
                                                                                               tmp_path) -> None:
    disk, why = small_disk
    if disk is not None:  # a real full filesystem: the top-K writes fail where the kernel says so
        config = run_copy(run_root=disk.path / "run")
        shard_pages = disk.pages((prepared.base / "reference" / "topk" / prepared.tag / "shard-00000.arrow").stat().st_size)
        # Room for config.yaml, _store.json, _renumbering.bin, shard 0 (data, lease, then its commit record) and all
        # but one page of shard 1.
        disk.resize(disk.used_pages() + 3 + shard_pages + 2 + shard_pages - 1)
        env: dict[str, str] = {}
    else:  # no tmpfs: the same error injected where a write would fail
        config = run_copy()
        env = {"KDFLOW_FAULT": "enospc@shard=1,micro_batch=1"}
    worker = start_worker(write_config(config, tmp_path / "config.yaml"), **env)
    stdout, stderr = finish(worker, what="the teacher worker on a full disk", timeout=300)

    assert worker.returncode == EXIT_NO_SPACE, why + stderr[-3000:]
    [error] = lines_with(ERROR_PREFIX, stdout)
    assert error["exit_code"] == EXIT_NO_SPACE
    last_line = stderr.strip().splitlines()[-1]
    assert last_line == f"kdflow worker: no space left on device: {error['message']}"
    # Where, about how much the shard needs, and what to do, in one line.
    shard = topk_store(config, prepared) / data_file_name("topk", 1)
    assert error["message"].startswith(f"disk full at {shard} (needs about ") and " MB free)" in error["message"]
    assert error["message"].endswith("; free space there and rerun to resume: committed work is kept")
    store = topk_store(config, prepared)
    committed = set(list_commits(RunRoot(config.run_root), str(store), "topk", prepared.tag))
    assert 0 in committed and 1 not in committed  # shard 0 is kept, shard 1 was under way
    # Nothing half-written: no uncommitted data file, temp file or lease.
    assert {p.name for p in store.iterdir()} <= shard_files(committed) | STORE_FILES

    if disk is not None:
        disk.resize(disk.pages(16 << 20))  # someone frees space
    summary = precompute_shards(config)
    assert summary["complete"] and summary["written"] == prepared.shards - len(committed)
    assert_clean_and_identical(config, prepared)


@pytest.fixture
def full_disk_run(small_disk: tuple[SmallDisk | None, str], run_copy: Callable[..., KDFlowConfig]) -> KDFlowConfig:
    """A tokenised run root on a tmpfs without a free page (skipped where no tmpfs can be mounted)."""
    disk, why = small_disk
    if disk is None:
        pytest.skip(why)
    config = run_copy(run_root=disk.path / "run")
    disk.fill()
    return config


def test_disk_already_full_is_exit_code_3_and_a_lease_leaves_no_temp_file(full_disk_run, tmp_path, capsys) -> None:
    config = full_disk_run
    # The worker's own code path, in this process (its exit code is returned, not exited with).
    assert run_worker_here(["--config", str(write_config(config, tmp_path / "config.yaml"))]) == EXIT_NO_SPACE
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line == (f"kdflow worker: no space left on device: disk full at {config.run_root} (0 MB free); free space "
                         "there and rerun to resume: committed work is kept")
    assert not (Path(config.run_root) / "topk").exists()

    store = Path(config.run_root, "lease-store")
    store.mkdir()
    with pytest.raises(OSError) as caught:
        ShardLeases(RunRoot(config.run_root), str(store), ttl_s=60).acquire(1)
    assert caught.value.errno == errno.ENOSPC and list(store.iterdir()) == []


def test_a_failed_write_probe_leaves_nothing_behind(full_disk_run) -> None:
    with pytest.raises(StoreError, match="disk full at "):
        RunRoot(full_disk_run.run_root).ensure_writable()
    assert not list(Path(full_disk_run.run_root).glob("*write-probe*"))


@pytest.mark.usefixtures("children")
def test_disk_full_while_saving_a_checkpoint_names_it_and_leaves_no_half_checkpoint(small_disk, run_copy, tmp_path) -> None:
    from kdflow.tasks.student.train import train

    disk, why = small_disk
    if disk is None:
        pytest.skip(why)
    config = run_copy("reference", run_root=disk.path / "run")
    disk.resize(disk.used_pages() + 24)  # room for the logs, not for a checkpoint (weights and optimizer: ~300 KB)
    with pytest.raises(StoreError) as caught:
        train(config)
    student = Path(config.run_root) / "students" / config.student.name
    message = str(caught.value)
    assert message.startswith(f"disk full at {student / 'checkpoint-2'} (needs about ") and "\n" not in message
    assert "student.keep_checkpoints=2 needs room for 3 checkpoints while the next one is written" in message
    assert [p.name for p in student.iterdir() if "checkpoint" in p.name] == []  # no half checkpoint, no staging folder
    steps = [json.loads(line)["step"] for line in (student / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    disk.resize(disk.pages(16 << 20))  # someone frees space: the rerun trains from the start (nothing was saved)
    assert train(config)["steps"] == config.student.steps


# --- two workers on one run root --------------------------------------------------------------------------


@pytest.mark.usefixtures("children")
def test_two_workers_racing_on_one_run_root_compute_each_shard_once(run_copy, prepared, tmp_path, capsys) -> None:
    config = run_copy(precompute__lease_ttl_s=10)  # a worker waiting on the other's lease polls every ttl/10 s
    config_path = write_config(config, tmp_path / "config.yaml")
    workers = [start_worker(config_path) for _ in range(2)]  # started together, no lease seeded: a real race
    try:
        outputs = [finish(worker, what="two racing teacher workers", timeout=300) for worker in workers]
    finally:
        for worker in workers:  # the other one too, if the first did not finish
            kill_group(worker)
    assert [w.returncode for w in workers] == [0, 0], [err[-2000:] for _, err in outputs]

    results = [lines_with(RESULT_PREFIX, out)[0] for out, _ in outputs]
    computed = []  # per worker: progress lines whose token count grew (a shard computed, not found committed)
    for out, _ in outputs:
        progress = lines_with(PROGRESS_PREFIX, out)
        computed.append(sum(b["tokens"] > a["tokens"] for a, b in zip([{"tokens": 0}, *progress], progress)))
    assert [r["written"] for r in results] == computed
    assert sum(computed) == prepared.shards  # no shard computed twice, none left out
    assert all(r["complete"] and r["committed"] == prepared.shards for r in results)

    run_root = RunRoot(config.run_root)
    store = topk_store(config, prepared)
    assert len(load_manifest(run_root, str(store), "topk", prepared.tag, config.seq_len)) == prepared.shards
    assert_clean_and_identical(config, prepared)
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out


# --- the student ------------------------------------------------------------------------------------------

TRAIN_SLOWLY = ("import sys, time\n"
                "from kdflow.schemas.config import load_config\n"
                "from kdflow.tasks.student.train import train\n"
                "train(load_config(sys.argv[1]), on_step=lambda record: time.sleep(0.25))\n")


@pytest.mark.usefixtures("children")
def test_student_killed_mid_run_resumes_to_the_same_weights(run_copy, prepared, tmp_path) -> None:
    from kdflow.tasks.student.train import train

    whole = run_copy("reference", student__name="whole")
    train(whole)
    killed = fault_config(Path(whole.run_root), prepared.teacher, prepared.corpus, student__name="killed")
    student = Path(killed.run_root) / "students" / "killed"

    log = tmp_path / "killed.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", TRAIN_SLOWLY, str(write_config(killed, tmp_path / "killed.yaml"))],
                                   cwd=REPO, env=worker_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 240
        while not (student / "checkpoint-2" / "checkpoint.json").exists():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL and not (student / "final").exists()
    complete = sorted(int(p.parent.name.split("-")[1]) for p in student.glob("checkpoint-*/checkpoint.json"))
    assert complete and complete[-1] < killed.student.steps

    # What a kill during a save leaves: a staging folder, and a newer checkpoint without its marker (an object-store
    # upload stops like that). Resuming from either would skip steps; both must be ignored and cleaned up.
    newest = student / f"checkpoint-{complete[-1]}"
    shutil.copytree(newest, student / f".checkpoint-{complete[-1] + 1}.tmp-deadbeef")
    half = shutil.copytree(newest, student / f"checkpoint-{complete[-1] + 2}")
    (half / "checkpoint.json").unlink()

    resumed = train(killed)
    assert resumed["start_step"] == complete[-1] and resumed["resumed_from"].endswith(newest.name)
    checkpoints = [p for p in student.iterdir() if "checkpoint-" in p.name]  # pruned: the newest two, both whole
    assert sorted(p.name for p in checkpoints) == ["checkpoint-4", "checkpoint-6"]
    assert all((p / "checkpoint.json").exists() for p in checkpoints)
    steps = [json.loads(line)["step"] for line in (student / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, killed.student.steps + 1))
    reference = load_file(Path(whole.run_root) / "students" / "whole" / "final" / "model.safetensors")
    weights = load_file(student / "final" / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name


# --- bad input --------------------------------------------------------------------------------------------


def cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m kdflow ARGS` with a private Prefect home and no server: a temporary one is started if needed."""
    clean = {k: v for k, v in worker_env().items() if not k.startswith("PREFECT_")}
    clean |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    return run([sys.executable, "-m", "kdflow", *args], what=f"kdflow {args[0]}", timeout=420, cwd=REPO, env=clean | env)


def files_containing(folder: Path, needle: bytes) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.usefixtures("children")
def test_cli_error_inside_a_stage_is_one_line_without_traceback_and_leaks_no_secret(prepared, tmp_path) -> None:
    """A malformed line deep in the source passes the pre-flight look at the first record; materialise finds it
    under Prefect: the run ends Failed with that line as its message, and the terminal shows no traceback."""
    lines = [json.dumps({"text": text}) for text in sample_documents(12)]
    lines[6] = '{"text": "an unterminated string'
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    config = fault_config(tmp_path / "run", prepared.teacher, corpus)
    config_path = write_config(config, tmp_path / "config.yaml")
    done = cli(["run", str(config_path)], tmp_path, AWS_SECRET_ACCESS_KEY=SECRET)
    assert done.returncode == EXIT_USER_ERROR, done.stderr[-3000:]
    message = f"dataset file {corpus}: line 7 is not valid JSON"
    # Prefect's own one-line log lines (the failed runs, the temporary server stopping) surround it; ours is one line.
    [error] = [line for line in done.stderr.splitlines() if line.startswith("kdflow: error:")]
    assert error.startswith(f"kdflow: error: {message}") and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not list(Path(config.run_root).glob("corpus/*.commit.json"))
    home = tmp_path / "prefect-home"  # Prefect's database: the run's state message and logs, as the UI shows them
    assert files_containing(home, message.encode())
    for folder in (Path(config.run_root), home):
        assert files_containing(folder, SECRET.encode()) == []
    assert SECRET not in done.stdout + done.stderr


@pytest.mark.usefixtures("children")
def test_cli_student_name_that_escapes_the_run_root_is_a_config_error(prepared, tmp_path) -> None:
    config_path = write_config(fault_config(tmp_path / "run", prepared.teacher, prepared.corpus), tmp_path / "config.yaml")
    done = cli(["run", str(config_path), "--set", "student.name=../x"], tmp_path)
    assert done.returncode == EXIT_USER_ERROR
    assert done.stderr.strip().splitlines() == [
        f"kdflow: error: {config_path}: invalid value for 'student.name': Value error, student name must be a plain "
        "folder name (letters, digits, . _ -), got '../x'"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize(("teacher", "args", "message"), [
    (None, ["--shards", "../3"], "--shards: expected ids like 0,3,5 or 3-9, got '../3'"),
    (None, ["--shards", "2,99"], "shard 99 does not exist: the token store has shards 0-"),
    ("tiny_tokenizer_dir", [], "not a model folder (no config.json)"),  # a tokenizer folder given as the teacher
])
def test_worker_bad_input_is_exit_code_2_one_line_and_commits_nothing(run_copy, tmp_path, capsys, request, teacher, args,
                                                                      message) -> None:
    config = run_copy(**({"teacher__model": str(request.getfixturevalue(teacher))} if teacher else {}))
    assert run_worker_here(["--config", str(write_config(config, tmp_path / "config.yaml")), *args]) == EXIT_USER_ERROR
    captured = capsys.readouterr()
    [error] = lines_with(ERROR_PREFIX, captured.out)
    assert message in error["message"] and "\n" not in error["message"]
    assert captured.err.strip().splitlines()[-1] == f"kdflow worker: user error: {error['message']}"
    assert not list(Path(config.run_root).glob("topk/*/*.commit.json"))

