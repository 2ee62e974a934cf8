"""Student training on two processes through the real torchrun (CPU, gloo): the same loss curve and weights
as one process with the same global batch, under DDP and under FSDP; a 2-rank run stopped midway resumes
on one rank and a 1-rank run on two, ending where an uninterrupted run ends; the 2-rank final/ loads and
generates; killing the launcher's process group leaves no rank behind; the flow launches torchrun.

Tolerances: two ranks sum the same per-row terms in another order, so results agree to float rounding.
Measured: losses within ~2e-6 relative (a small KL, ~2e-3, is a difference of nearly equal terms), held-out
KL within ~7e-7, weights after 6 AdamW steps at lr 1e-3 within ~1.2e-7 absolute; the 1e-5 bounds leave room.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.children import run
from support.corpus import sample_documents, write_jsonl
from support.runs import final_weights, make_tokens, read_lines, run_config, student_path, write_dense_topk

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import config_from_dict, dump_config
from kdflow.schemas.errors import ConfigError, KDFlowError
from kdflow.schemas.layout import CHECKPOINT_MARKER, checkpoint_step

STEPS = 6
# batch 4 over 2 ranks x grad_accum 2: one row per micro-batch. 9 held-out rows, evaluated one row at a time:
# rank 0 runs 5 forwards, rank 1 four plus a spare one (forwards must pair up across ranks).
COMMON = {"student__steps": STEPS, "student__lr": 1e-3, "student__save_every": 2, "student__grad_accum": 2,
          "student__eval_sequences": 9, "student__eval_shards": 2}
TORCHRUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("distributed")
    corpus = write_jsonl(base / "docs.jsonl", sample_documents(30))
    config = run_config(base / "run", tiny_teacher_dir, corpus)
    make_tokens(config)
    write_dense_topk(config, tiny_teacher_dir)
    return base / "run", corpus


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def fresh_run(prepared_run: tuple[Path, Path], tiny_teacher_dir: Path, tmp_path: Path) -> Callable[..., KDFlowConfig]:
    """A private copy of the prepared run root; -> a config builder (2 ranks on a free port unless overridden)."""
    run_root, corpus = prepared_run
    shutil.copytree(run_root, tmp_path / "run")
    port = free_port()

    def build(**overrides: Any) -> KDFlowConfig:
        settings = COMMON | {"student__distributed__nproc_per_node": 2, "student__distributed__backend": "gloo",
                             "student__distributed__rdzv_endpoint": f"127.0.0.1:{port}"} | overrides
        return run_config(tmp_path / "run", tiny_teacher_dir, corpus, **settings)
    return build


@pytest.fixture(scope="module")
def one_rank(prepared_run: tuple[Path, Path], tiny_teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Any]:
    """The uninterrupted 1-process run everything is compared with: metrics, evaluations, final weights."""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    run_root, corpus = prepared_run
    copy = tmp_path_factory.mktemp("one-rank") / "run"
    shutil.copytree(run_root, copy)
    config = run_config(copy, tiny_teacher_dir, corpus, **(COMMON | {"student__grad_accum": 1}))
    train(open_run_root(config), training_settings(config))
    return {"metrics": read_lines(student_path(config, "metrics.jsonl")),
            "evals": read_lines(student_path(config, "eval.jsonl")),
            "weights": final_weights(config), "optimizer": load_optimizer_state(config, STEPS)}


def load_optimizer_state(config: KDFlowConfig, step: int) -> dict[str, Any]:
    return torch.load(student_path(config, f"checkpoint-{step}", "training_state.pt"), weights_only=True)["optimizer"]


def write_config(config: KDFlowConfig) -> str:
    path = Path(config.run_root).parent / f"{config.student.name}.yaml"
    path.write_text(dump_config(config))
    return str(path)


def torchrun(config: KDFlowConfig, *worker_args: str) -> dict[str, Any]:
    """The real launcher, as a user would type it; -> rank 0's summary line."""
    from kdflow.schemas.protocol import RESULT_PREFIX
    from kdflow.tasks.student.distributed import torchrun_command

    config_path = write_config(config)  # torchrun's per-rank folders beside it, not in the system's temp folder
    command = torchrun_command(config.student.distributed, config_path, *worker_args,
                               log_dir=str(Path(config_path).with_name("torchrun")))
    done = run(command, what="the 2-rank torchrun", timeout=TORCHRUN_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    results = [json.loads(line[len(RESULT_PREFIX):])
               for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(results) == 1, output[-4000:]  # rank 0 reports, rank 1 does not
    return results[0]


def assert_same_curve(records: list[dict[str, Any]], reference: list[dict[str, Any]], keys: tuple[str, ...]) -> float:
    """-> the largest relative difference of the first key (the loss, the KL)."""
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for key in keys:
        assert [r[key] for r in records] == pytest.approx([r[key] for r in reference], rel=1e-5, abs=1e-9), key
    return max(abs(a[keys[0]] - b[keys[0]]) / abs(b[keys[0]]) for a, b in zip(records, reference, strict=True))


def assert_same_weights(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=0, msg=name)


def max_difference(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((weights[name] - tensor).abs().max()) for name, tensor in reference.items())


TRAIN_KEYS = ("loss", "kd", "ce", "grad_norm", "lr")
EVAL_KEYS = ("kl", "ce", "top1_agreement")


@pytest.mark.usefixtures("children")
def test_two_ddp_ranks_match_one_rank_and_the_final_model_generates(fresh_run, one_rank) -> None:
    from transformers import AutoModelForCausalLM

    from kdflow.tasks.student.generate import generate

    config = fresh_run(student__name="ddp")
    summary = torchrun(config)
    assert summary["world_size"] == 2 and summary["backend"] == "gloo" and summary["steps"] == STEPS

    loss_rel = assert_same_curve(read_lines(student_path(config, "metrics.jsonl")), one_rank["metrics"], TRAIN_KEYS)
    kl_rel = assert_same_curve(read_lines(student_path(config, "eval.jsonl")), one_rank["evals"], EVAL_KEYS)
    weights = final_weights(config)
    assert_same_weights(weights, one_rank["weights"])
    print(f"ddp: loss max rel diff {loss_rel:.3g}, eval KL max rel diff {kl_rel:.3g}, "
          f"max |w2 - w1| {max_difference(weights, one_rank['weights']):.3g}")
    optimizer = load_optimizer_state(config, STEPS)  # rank 0's: the full state, in the 1-process format
    assert optimizer["param_groups"] == one_rank["optimizer"]["param_groups"]

    final = student_path(config, "final")
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as built
    text = generate(str(final), "The object", max_new_tokens=6, greedy=True, device="cpu")
    assert isinstance(text, str) and text.strip()


@pytest.mark.usefixtures("children")
def test_fsdp_runs_resume_across_rank_counts_and_end_like_an_uninterrupted_run(fresh_run, one_rank) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    # 2 ranks (FSDP on CPU) stopped after step 3, finished on 1 rank.
    two_then_one = fresh_run(student__name="two-then-one", student__distributed__sharding="fsdp")
    stopped = torchrun(two_then_one, "--stop-at-step", "3")
    assert stopped["stopped"] and stopped["steps"] == 3 and stopped["final_dir"] is None
    saved = load_optimizer_state(two_then_one, 3)  # gathered from the shards into the 1-process format
    assert sorted(saved["state"]) == list(range(len(one_rank["optimizer"]["state"])))
    for index, state in one_rank["optimizer"]["state"].items():
        assert saved["state"][index]["exp_avg"].shape == state["exp_avg"].shape
    resumed = train(open_run_root(two_then_one), training_settings(two_then_one))
    assert resumed["start_step"] == 3 and resumed["resumed_from"].endswith("checkpoint-3")

    # 1 rank stopped after step 3, finished on 2 FSDP ranks.
    one_then_two = fresh_run(student__name="one-then-two", student__distributed__sharding="fsdp")
    assert train(open_run_root(one_then_two), training_settings(one_then_two),
                 on_step=lambda record: record["step"] == 3)["steps"] == 3
    finished = torchrun(one_then_two)
    assert finished["start_step"] == 3 and finished["steps"] == STEPS and not finished["stopped"]
    final_optimizer = load_optimizer_state(one_then_two, STEPS)
    for index, state in one_rank["optimizer"]["state"].items():
        torch.testing.assert_close(final_optimizer["state"][index]["exp_avg"], state["exp_avg"], atol=1e-6, rtol=1e-4)

    for config in (two_then_one, one_then_two):
        loss_rel = assert_same_curve(read_lines(student_path(config, "metrics.jsonl")), one_rank["metrics"], TRAIN_KEYS)
        kl_rel = assert_same_curve(read_lines(student_path(config, "eval.jsonl")), one_rank["evals"], EVAL_KEYS)
        weights = final_weights(config)
        assert_same_weights(weights, one_rank["weights"])
        print(f"fsdp {config.student.name}: loss max rel diff {loss_rel:.3g}, eval KL max rel diff {kl_rel:.3g}, "
              f"max |w - w1| {max_difference(weights, one_rank['weights']):.3g}")


@pytest.mark.usefixtures("children")
def test_gradient_checkpointing_under_fsdp_matches_one_rank_without_it(fresh_run, one_rank) -> None:
    """Each FSDP unit (a decoder layer) is recomputed in backward while its weights are gathered again."""
    config = fresh_run(student__name="fsdp-checkpointing", student__distributed__sharding="fsdp",
                       student__gradient_checkpointing=True)
    assert torchrun(config)["steps"] == STEPS
    assert_same_curve(read_lines(student_path(config, "metrics.jsonl")), one_rank["metrics"], TRAIN_KEYS)
    assert_same_weights(final_weights(config), one_rank["weights"])


def newest_checkpoint_step(config: KDFlowConfig) -> int:
    """The step of the newest complete checkpoint of the student (-1 if none); folders come and go meanwhile."""
    folder = student_path(config)
    names = os.listdir(folder) if folder.is_dir() else []
    steps = [step for name in names if (step := checkpoint_step(name)) is not None
             and (folder / name / CHECKPOINT_MARKER).exists()]
    return max(steps, default=-1)


def _pids_running(marker: str) -> list[int]:
    """Processes whose command line contains `marker` (the ranks of one launch)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
@pytest.mark.usefixtures("children")
def test_killing_the_launch_group_takes_every_rank_down_and_the_run_resumes(fresh_run, tmp_path: Path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.distributed import torchrun_arguments
    from kdflow.tasks.student.train import train
    from kdflow.tasks.student.train_worker import EXEC_TORCHRUN

    config = fresh_run(student__name="killed", student__steps=10_000, student__save_every=1)
    config_path = write_config(config)
    command = [sys.executable, "-m", "kdflow.tasks.student.train_worker", EXEC_TORCHRUN,
               *torchrun_arguments(config.student.distributed, config_path, log_dir=str(tmp_path / "torchrun"))]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # Every step saves and only the newest 2 checkpoints are kept, so any one of them lives for about a step:
        # wait for a complete checkpoint at step >= 2, whichever it is, not for one that may already be gone.
        deadline = time.monotonic() + TORCHRUN_TIMEOUT_S
        while newest_checkpoint_step(config) < 2:
            assert launcher.poll() is None, (f"the 2-rank run exited ({launcher.returncode}) before a checkpoint "
                                             "at step >= 2")
            assert time.monotonic() < deadline, (f"no checkpoint at step >= 2 from the 2-rank run in "
                                                 f"{TORCHRUN_TIMEOUT_S} s")
            time.sleep(0.2)
        assert len(_pids_running(config_path)) >= 3  # the launcher (now torchrun) and two ranks
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # what the flow does when it is cancelled or exits
        launcher.wait()
    deadline = time.monotonic() + 30
    while _pids_running(config_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftovers = _pids_running(config_path)
    for pid in leftovers:  # a failure here must not leave ranks behind for the rest of the suite
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert leftovers == []  # the ranks died with their parent

    # on one rank, from the newest complete checkpoint
    resumed = train(open_run_root(config), training_settings(config), on_step=lambda record: True)
    assert resumed["start_step"] >= 2 and resumed["steps"] == resumed["start_step"] + 1


def test_flow_launches_torchrun_and_reports(fresh_run, one_rank, prefect_harness, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from kdflow.flows.train import train_student_flow

    children_tmp = tmp_path / "children-tmp"  # the children's temp folder: torchrun leaves nothing in it
    children_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(children_tmp))

    with pytest.raises(KDFlowError) as caught:  # every rank fails on the config: the rank's own one-line message
        train_student_flow(fresh_run(student__name="bad", student__eval_shards=99).model_dump(mode="json"))
    assert "student.eval_shards=99 leaves no training shard" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(KDFlowError, match="must be divisible by ranks x grad_accum = 2 x 2"):  # before any launch
        train_student_flow(fresh_run(student__batch_size=6).model_dump(mode="json"))

    config = fresh_run(student__name="flow", student__log_every=2, student__eval_every=3)
    summary = train_student_flow(config.model_dump(mode="json"))
    assert summary["world_size"] == 2 and summary["steps"] == STEPS and summary["final_dir"].endswith("final")
    assert student_path(config, "config.yaml").exists()
    assert_same_weights(final_weights(config), one_rank["weights"])
    # Rank 0's progress and evaluations reached the flow through the worker protocol, as keyed artifacts.
    from prefect.artifacts import Artifact

    progress, curve = Artifact.get("train-flow-progress"), Artifact.get("train-flow")
    assert progress.data == 100.0 and progress.updated > progress.created
    assert "](data:image/png;base64," in curve.data and student_path(config, "training_curve.png").exists()
    assert not list(children_tmp.glob("torchelastic_*"))  # its per-rank folders went with the config's


def test_launch_command_backend_and_sharding_choices() -> None:
    from kdflow.tasks.student.distributed import choose_backend, choose_sharding, torchrun_command

    distributed = config_from_dict({"run_root": "runs/x", "dataset": {"path": "x"}, "teacher": {"model": "x"},
                                    "student": {"distributed": {
        "nproc_per_node": 8, "nnodes": 2, "node_rank": 1, "rdzv_endpoint": "10.0.0.1:29400", "rdzv_id": "job7"}}}
    ).student.distributed
    command = torchrun_command(distributed, "/shared/run.yaml", "--stop-at-step", "5")
    assert command[1:] == ["-m", "torch.distributed.run", "--nproc_per_node", "8", "--nnodes", "2", "--node_rank", "1",
                           "--rdzv_backend", "c10d", "--rdzv_endpoint", "10.0.0.1:29400", "--rdzv_id", "job7",
                           "-m", "kdflow.tasks.student.train_worker", "--config", "/shared/run.yaml",
                           "--stop-at-step", "5"]
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert ((choose_backend("auto", cpu), choose_backend("auto", gpu), choose_backend("gloo", gpu))
            == ("gloo", "nccl", "gloo"))
    with pytest.raises(ConfigError, match="backend=nccl needs CUDA devices"):
        choose_backend("nccl", cpu)
    assert [choose_sharding("auto", d, 2) for d in (cpu, gpu)] == ["ddp", "fsdp"]
    assert choose_sharding("fsdp", gpu, 1) == choose_sharding("auto", cpu, 1) == "none"
