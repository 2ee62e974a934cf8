"""The `kdflow` command line and the materialise/tokenise flows under Prefect."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.children import run

from kdflow.schemas.config_io import dump_config
from kdflow.schemas.layout import CONFIG_FILE

REPO = Path(__file__).parent.parent
COMMANDS = ("demo", "run", "status", "validate", "store", "chat", "bench", "tune")


def kdflow(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "kdflow", *args], what=f"kdflow {' '.join(args)}", timeout=timeout, env=env,
               cwd=REPO)


def store_mtimes(run_root: Path) -> dict[str, int]:
    """Every data file and record of the corpus and token stores (config.yaml is rewritten by each run on purpose)."""
    return {str(p.relative_to(run_root)): p.stat().st_mtime_ns for p in sorted(run_root.rglob("*"))
            if p.is_file() and p.name != CONFIG_FILE}


@pytest.mark.usefixtures("children")
def test_help_lists_the_commands() -> None:
    result = kdflow("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert f"    {command} " in result.stdout
    version = kdflow("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"kdflow {importlib.metadata.version('kdflow')}"


@pytest.mark.usefixtures("children")
def test_unknown_config_key_is_one_line_without_traceback(tmp_path: Path) -> None:
    valid = "run_root: runs/x\ndataset: {path: docs.jsonl}\nteacher: {model: m}\n"
    config = tmp_path / "typo.yaml"
    config.write_text(valid + "student: {stpes: 3}\n", encoding="utf-8")
    result = kdflow("run", str(config), "--stages", "materialise")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [f"kdflow: error: {config}: unknown config key 'student.stpes'"]
    config.write_text(valid, encoding="utf-8")
    result = kdflow("run", str(config), "--set", "seq_len=0")
    assert result.returncode != 0 and result.stderr.strip().splitlines() == [
        "kdflow: error: --set seq_len=0: invalid value for 'seq_len': Input should be greater than 0"]


@pytest.mark.usefixtures("children")
def test_run_twice_then_status_and_validate(make_config: Callable[..., Any], tiny_tokenizer_dir: Path,
                                            tmp_path: Path) -> None:
    config = make_config(tokenizer=str(tiny_tokenizer_dir))
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config), encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    # No server given: Prefect starts a temporary one, with its database under this PREFECT_HOME.
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

    first = kdflow("run", str(path), "--stages", "materialise,tokenise", env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    run_root = Path(config.run_root)
    before = store_mtimes(run_root)
    assert "corpus/part-00003.commit.json" in before and "tokens/_complete.json" in before

    # The same file spelt relative to the working folder (the stores say absolute): the stores' spelling is taken.
    relative = os.path.relpath(config.dataset.path, REPO)
    second = kdflow("run", str(path), "--stages", "materialise,tokenise", "--set", f"dataset.path={relative}", env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stdout + second.stderr
    assert f"kdflow: dataset {relative!r} names the files that " in second.stderr and "reused" in second.stderr
    assert ("materialise: 4 parts, 60 documents (0 parts written now; " in log
            and "(0 written now, " in log.split("tokenise:")[-1])
    assert "materialise: 4/4 parts already committed, nothing to do" in log
    assert "tokenise: 27/27 shards already committed, nothing to do" in log
    assert store_mtimes(run_root) == before

    (run_root / "topk" / ".partial-copy").mkdir(parents=True)  # not a store: status and validate pass over it
    status = kdflow("status", str(run_root))
    assert status.returncode == 0
    lines = {line.split()[0]: line for line in status.stdout.splitlines()}
    assert "4/4" in lines["corpus"] and "complete" in lines["corpus"] and "tokens not counted" in lines["corpus"]
    assert "27/27" in lines["tokens"] and "6,720 tokens" in lines["tokens"] and "complete" in lines["tokens"]

    validate = kdflow("validate", str(path))  # the config file names the run root
    assert validate.returncode == 0 and "validate: OK, 2 stores, 31 shards" in validate.stdout
    assert kdflow("status", str(path)).stdout == status.stdout

    read, write = os.pipe()  # a reader that stopped reading (`kdflow status | head -1`): no error, SIGPIPE's status
    os.close(read)
    closed = subprocess.run([sys.executable, "-m", "kdflow", "status", str(run_root)], stdout=write,
                            stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert (closed.returncode, closed.stderr) == (141, "")


def test_flows_under_prefect(prefect_harness: None, make_config: Callable[..., Any], tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from kdflow.flows import materialise as materialise_module
    from kdflow.flows.materialise import materialise_flow
    from kdflow.flows.tokenise import tokenise_flow

    config = make_config()
    corpus = materialise_flow(config)
    assert (corpus["parts"], corpus["documents"], corpus["parts_written"]) == (4, 60, 4)
    tokens = tokenise_flow(config.model_dump(mode="json"))  # deployment parameters arrive as a plain dict
    assert (tokens["shards"], tokens["shards_written"]) == (27, 27)
    assert materialise_flow(config)["parts_written"] == 0
    assert tokenise_flow(config)["shards_written"] == 0
    assert (Path(config.run_root) / "tokens" / CONFIG_FILE).read_text(encoding="utf-8") == dump_config(config)

    budget = make_config(run_root=str(tmp_path / "budget"), dataset__max_tokens=2_000)  # counts with the tokenizer
    assert 0 < materialise_flow(budget)["documents"] < 60

    def refused(*args: Any) -> None:
        raise AssertionError("a finished corpus store loaded the tokenizer")

    monkeypatch.setattr(materialise_module, "load_tokenizer", refused)  # a rerun finds the store finished first
    assert materialise_flow(budget)["parts_written"] == 0
    assert "holds a finished corpus of another dataset" not in caplog.text

    other = tmp_path / "other.jsonl"  # another dataset into the same run root: done, and said
    other.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(8)))
    replacing = make_config(run_root=budget.run_root, dataset__path=str(other))
    assert materialise_flow(replacing)["documents"] == 8
    assert (f"corpus holds a finished corpus of another dataset or other dataset settings (dataset.path "
            f"{budget.dataset.path!r}, now {str(other)!r}; dataset.max_tokens 2000, now None); this run replaces it, "
            "and the token store") in caplog.text

    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.run_status import status_lines

    def tokens_lines() -> list[str]:
        lines = list(status_lines(RunRoot(config.run_root)))
        at = next(i for i, line in enumerate(lines) if line.startswith("tokens "))
        return lines[at:at + 2]

    assert "complete" in tokens_lines()[0] and "stale" not in " ".join(tokens_lines())
    materialise_flow(make_config(dataset__path=str(other)))  # the tokenised run root's corpus replaced
    line, note = tokens_lines()
    assert "stale (complete)" in line and note == (
        "  stale: tokenised from another corpus than corpus/ holds now; the next run's tokenise makes it again")


def test_bench_tokenise_prints_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kdflow.bench.tokenise import main

    assert main(["--documents", "40", "--repeats", "1", "--parallelism", "false", "--seq-len", "32",
                 "--sequences-per-shard", "4"]) == 0
    raw, call, stage, ratio = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert ((raw["what"], call["what"], stage["what"], ratio["what"])
            == ("raw_tokenizer", "transformers_call", "tokenise_stage", "ratio"))
    assert raw["doc_tokens"] == call["doc_tokens"] == stage["doc_tokens"] > 0 and raw["documents"] == 40
    assert ratio["same_ids"] is True  # the stage's rows hold exactly the transformers call's ids, packed
    # Every document's tokens plus one EOS each end up in a row or in the dropped tail.
    assert stage["sequences"] * 32 + stage["dropped_tokens"] == stage["doc_tokens"] + 40
    # The ratio is the raw tokenizer's time over the stage's: below 1 only where the stage took longer.
    value, slower = ratio["stage_over_raw"], stage["seconds"] > raw["seconds"]
    assert value > 0 and not (value < 1 and not slower) and not (value > 1 and slower), (value, raw, stage)


def test_status_marks_a_top_k_store_of_replaced_token_shards_stale(fresh_run,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from support.runs import DENSE_TAG, make_tokens

    from kdflow.commands.status import print_status

    config = fresh_run()
    print_status(config.run_root)
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    shards = lines["tokens"].split()[1]
    assert f" {shards} " in lines[f"topk/{DENSE_TAG}"] and " complete " in lines[f"topk/{DENSE_TAG}"]

    make_tokens(fresh_run(precompute__sequences_per_shard=3))  # tokenise again, into other shards
    print_status(config.run_root)
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["tokens"].split()[1] != shards
    # Counted against the token store it was made from, and said to be stale.
    assert f" {shards} " in lines[f"topk/{DENSE_TAG}"] and " stale (complete) " in lines[f"topk/{DENSE_TAG}"]
    assert "stale: computed from token shards since replaced by tokenise; training skips it" in out


def test_status_says_where_a_students_training_stands(fresh_run, capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow.commands.status import print_status
    from kdflow.schemas.config_io import dump_config
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    first = fresh_run(student__steps=2, student__save_every=2)
    train(open_run_root(first), training_settings(first))
    config = fresh_run(student__steps=6)  # rerun for more steps, stopped in a checkpoint's write (no marker yet)
    student = Path(config.run_root, "students", config.student.name)
    (student / "config.yaml").write_text(dump_config(config))
    (student / "checkpoint-4").mkdir()
    print_status(config.run_root)
    line = capsys.readouterr().out.splitlines()[-1]
    evaluation = json.loads((student / "eval.jsonl").read_text().splitlines()[-1])
    full = f", full-vocabulary {evaluation['kl_full']:.4f}" if evaluation.get("kl_full") is not None else ""
    assert line == (f"students/{config.student.name:<13} step 2 of 6: 1 checkpoint (latest checkpoint-2), final "
                    f"model saved; held-out KL to the stored targets {evaluation['kl']:.4f}{full} at step 2")
    weights = student / "final" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a copy cut short: status no longer calls it saved
    print_status(config.run_root)
    assert "2), final model damaged (kdflow validate names it; a rerun of train writes it again); held-out" in \
        capsys.readouterr().out.splitlines()[-1]


def test_a_warning_of_a_library_with_its_own_terminal_handler_is_printed_once(children) -> None:
    """huggingface_hub and datasets print their warnings themselves and propagate them: each hub retry was two lines."""
    script = ("import logging; from kdflow.commands.serverless import install_terminal_logging\n"
              "logging.basicConfig(format='%(levelname)s %(message)s')\n"
              "install_terminal_logging(logging.getLogger().handlers[0], False)\n"
              "import huggingface_hub, datasets\n"
              "for name in ('huggingface_hub.utils._http', 'datasets.load', 'kdflow.x'):\n"
              "    logging.getLogger(name).warning('from %s', name)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stderr.splitlines() == ["from huggingface_hub.utils._http", "from datasets.load",
                                        "WARNING from kdflow.x"]


def test_ctrl_c_that_a_library_wrapped_is_still_an_interruption(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while Prefect serialised a flow run's parameters came out as "kdflow: error:
    PydanticSerializationError: Error calling function `_ser_model`: KeyboardInterrupt" (exit 1)."""
    from pydantic_core import PydanticSerializationError

    from kdflow import cli

    def interrupted(args: Any) -> int:
        raise PydanticSerializationError("Error calling function `_ser_model`: KeyboardInterrupt: ")

    monkeypatch.setattr(cli, "_cmd_run", interrupted)
    assert cli.main(["run", "any.yaml"]) == 130
    assert capsys.readouterr().err.strip() == "kdflow: interrupted; rerun the same command to resume"

    def failed(args: Any) -> int:
        raise PydanticSerializationError("Error calling function `_ser_model`: ValueError: no")

    monkeypatch.setattr(cli, "_cmd_run", failed)
    assert cli.main(["run", "any.yaml"]) == 1 and "PydanticSerializationError" in capsys.readouterr().err


def test_a_set_value_that_yaml_read_as_another_type_says_how_to_quote_it(make_config: Callable[..., Any],
                                                                        tmp_path: Path) -> None:
    """`--set student.name=007` reached the config as 7 ("should be a valid string"), `--set student.steps=` as null."""
    from kdflow.schemas.config_io import load_config
    from kdflow.schemas.errors import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text(dump_config(make_config()), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path, {"student.name": 7})
    assert str(caught.value) == ("--set student.name=7: invalid value for 'student.name': Input should be a valid "
                                 "string (--set reads its value as YAML, which made it 7; quote text: --set "
                                 "'student.name=\"...\"')")
    with pytest.raises(ConfigError, match=r"valid integer \(--set gave no value: YAML's null\)$"):
        load_config(path, {"student.steps": None})
    with pytest.raises(ConfigError, match=r"unable to parse string as an integer$"):  # text already: no hint
        load_config(path, {"student.steps": "abc"})


def test_status_of_a_folder_with_no_stores_says_what_it_is(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """It printed two `empty` rows and nothing else, for a new run root and for a student's folder alike."""
    from kdflow.commands.status import print_status

    student = tmp_path / "run" / "students" / "s"
    (student / "checkpoint-4").mkdir(parents=True)
    (tmp_path / "new").mkdir()
    run_root = tmp_path / "run"
    for folder, said in ((tmp_path / "new", "nothing has run in this run root yet"),
                         (student, f"a student's folder (final/, checkpoint-N/), whose run root is {run_root}")):
        assert print_status(str(folder)) == 0
        assert capsys.readouterr().out.splitlines()[-1] == (
            f"no stores here (corpus/, tokens/, topk/, students/): {said}")
    assert print_status(str(tmp_path / "run")) == 0 and "no stores here" not in capsys.readouterr().out
