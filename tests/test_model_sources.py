"""Where the models come from: a hub id (served from the local Hugging Face cache) works as its folder does, for
the teacher and for `student.init_from`; a pretrained student's tokenizer must give the run's tokens the same ids
(special tokens may differ: the base model of an instruction-tuned teacher's family).

The cache is laid out here as the hub's client lays it out (the suite runs with HF_HUB_OFFLINE=1: no network), so
what is tested is kdflow's handling of the id, not the download.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support.network import closed_port
from support.runs import prepare, student_path

from kdflow.schemas.errors import ConfigError, KDFlowError
from kdflow.tasks.preflight import run_preflight

STUDENT_ID = "kdflow-test/tiny-student"
TEACHER_ID = "kdflow-test/tiny-teacher"
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the cached snapshot's revision


def cache_repo(cache: Path, repo: str, source: Path) -> None:
    """Put the files of `source` in the hub cache `cache` as revision `main` (commit COMMIT) of model `repo`."""
    owner, name = repo.split("/")
    folder = cache / f"models--{owner}--{name}"
    shutil.copytree(source, folder / "snapshots" / COMMIT)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face hub cache for this test (the hub client reads the setting at each call)."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    return cache


def pretrained_student(folder: Path, teacher: Path, tokenizer_source: Path | None = None, eos: str | None = None,
                       vocab_size: int | None = None) -> Path:
    """The teacher's weights as a "pretrained" student, with a tokenizer of its own (the teacher's by default)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(teacher)
    if vocab_size is not None:
        model.resize_token_embeddings(vocab_size)
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source or teacher)
    if eos is not None:
        tokenizer.eos_token = eos  # another special-token setting, the same vocabulary
    tokenizer.save_pretrained(folder)
    return folder


def other_vocabulary(folder: Path) -> Path:
    """A real tokenizer trained on other text: most of the run's tokens are missing or have other ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(["zebras quietly graze over amber hills"] * 50, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def test_a_hub_teacher_in_the_local_cache_is_checked_and_gives_the_store_its_folder_gives(
        make_config, hub_cache: Path, tmp_path: Path, tiny_teacher_dir: Path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.common.models import teacher_identity
    from kdflow.tasks.teacher.precompute import precompute_shards

    cache_repo(hub_cache, TEACHER_ID, tiny_teacher_dir)
    with pytest.raises(ConfigError) as caught:  # the limits are read from the cached config.json
        run_preflight(make_config(teacher__model=TEACHER_ID, precompute__top_k=60000))
    assert str(caught.value).startswith("precompute.top_k=60000 must be between 1 and the teacher's vocabulary size")
    stores, identity = [], {}
    for name, teacher in (("by-id", TEACHER_ID), ("by-folder", str(tiny_teacher_dir))):
        config = make_config(run_root=str(tmp_path / name), teacher__model=teacher, dataset__max_documents=24)
        assert run_preflight(config) == []
        prepared = prepare(config)
        summary = precompute_shards(open_run_root(prepared), teacher_pass_settings(prepared))
        assert summary["complete"]
        stores.append(sorted(path.read_bytes() for path in (tmp_path / name / "topk").rglob("shard-*.arrow")))
        identity = teacher_identity(config.teacher)
    assert stores[0] == stores[1] and len(stores[0]) >= 3  # the same weights give the same shards
    # A hub teacher is named by its id and the cached snapshot's commit (a folder by its weights' hash), so a
    # newer snapshot of the same id makes another store rather than resuming this one.
    by_id = teacher_identity(make_config(teacher__model=TEACHER_ID).teacher)
    assert (by_id["model"], by_id["revision"]) == (TEACHER_ID, COMMIT) and "weights" in identity


def test_a_hub_student_in_the_local_cache_passes_pre_flight_trains_and_its_card_names_it(
        fresh_run, hub_cache: Path, tmp_path: Path, sharp_teacher_dir: Path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    # The same vocabulary with another end-of-text token: what an instruct teacher's base sibling ships.
    cache_repo(hub_cache, STUDENT_ID, pretrained_student(tmp_path / "student", sharp_teacher_dir, eos="<pad>"))
    config = fresh_run(student__init_from=STUDENT_ID, student__steps=2, student__save_every=2,
                       student__warmup_steps=1, student__lr=5e-5)
    ignored = f"student.architecture is ignored: the student is {STUDENT_ID!r} (student.init_from)"
    assert run_preflight(config, ["train"]) == [ignored]  # the test configs give a tiny architecture, unused here
    assert run_preflight(config.model_copy(update={"student": config.student.model_copy(update={"lr": 1e-3})}),
                         ["train"]) == [ignored, "student.lr=0.001 with student.init_from: a peak meant for random "
                                        "weights can undo what a pretrained student knows in a few steps; from "
                                        "pretrained weights 1e-5 to 1e-4 is usual"]
    summary = train(open_run_root(config), training_settings(config))
    assert summary["steps"] == 2
    card = student_path(config, "final", "README.md").read_text()
    assert f"base_model: {STUDENT_ID}" in card.split("---")[1]


def test_a_student_of_another_vocabulary_is_refused_in_pre_flight_from_a_folder_or_the_hub_cache(
        fresh_run, hub_cache: Path, tmp_path: Path, sharp_teacher_dir: Path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    other = pretrained_student(tmp_path / "other", sharp_teacher_dir, other_vocabulary(tmp_path / "other-tok"))
    cache_repo(hub_cache, "kdflow-test/other-vocabulary", other)
    for init_from in (str(other), "kdflow-test/other-vocabulary"):
        config = fresh_run(student__init_from=init_from)
        with pytest.raises(ConfigError) as caught:
            run_preflight(config, ["train"])
        message = str(caught.value)
        assert message.startswith(f"student.init_from={init_from!r} has another vocabulary: ") and "\n" not in message
        with pytest.raises(KDFlowError) as caught:  # the training stage checks again when it loads the model
            train(open_run_root(config), training_settings(config))
        assert str(caught.value) == message
    assert not [path for path in student_path(config).rglob("*") if path.is_file()]  # no checkpoint, no model


def test_a_student_whose_embedding_is_smaller_than_the_vocabulary_is_refused(
        fresh_run, tmp_path: Path, sharp_teacher_dir: Path) -> None:
    small = pretrained_student(tmp_path / "small", sharp_teacher_dir, vocab_size=100)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (small / name).unlink()  # no tokenizer of its own: only its config.json tells
    with pytest.raises(ConfigError) as caught:
        run_preflight(fresh_run(student__init_from=str(small)), ["train"])
    assert str(caught.value).startswith(f"student.init_from={str(small)!r} has vocab_size 100, fewer than the run "
                                        "tokenizer's ")


def test_a_hub_id_that_is_not_in_the_cache_offline_is_one_line_in_pre_flight_and_at_load(fresh_run,
                                                                                          hub_cache: Path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config = fresh_run(student__init_from="kdflow-test/not-downloaded")
    with pytest.raises(ConfigError) as refused:  # the suite runs with HF_HUB_OFFLINE=1
        run_preflight(config, ["train"])
    assert str(refused.value) == (
        f"student.init_from='kdflow-test/not-downloaded' is a hub model that is not in the local Hugging Face cache "
        f"({hub_cache}) and the hub cannot be reached from here (HF_HUB_OFFLINE is set): download it where the hub "
        "can be reached (hf download kdflow-test/not-downloaded) into that cache, or give a local model folder (there "
        f"is no folder 'kdflow-test/not-downloaded' in the working directory {os.getcwd()})")
    with pytest.raises(KDFlowError) as caught:  # the stage checks again when it loads the model
        train(open_run_root(config), training_settings(config))
    message = str(caught.value)
    assert message.startswith("student.init_from 'kdflow-test/not-downloaded' is not a loadable causal LM: ")
    assert "\n" not in message
    # One word that is no folder here (a mistyped one, or an owner-less hub id such as gpt2): the same line, at once
    for setting, word in (("teacher.model", "my-teacher"), ("student.init_from", "final")):
        key = setting.replace(".", "__")
        with pytest.raises(ConfigError, match=rf"^{setting}='{word}' is a hub model that is not in the local .*"
                                              rf"there is no folder '{word}' in the working directory"):
            run_preflight(fresh_run(**{key: word}), ["precompute", "train"])


def test_a_hub_that_cannot_be_reached_refuses_what_is_not_cached_and_nothing_else(
        make_config, hub_cache: Path, tiny_teacher_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online (HF_HUB_OFFLINE unset), against a real endpoint: a port nothing listens on, then one that accepts."""
    import socket

    from kdflow.tasks.common import hub_access

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    closed = closed_port(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    config = make_config(teacher__model=TEACHER_ID, tokenizer=str(tiny_teacher_dir))
    with pytest.raises(ConfigError, match=rf"^teacher.model='{TEACHER_ID}' is a hub model that is not in the local "
                                          rf"Hugging Face cache .* \(127.0.0.1:{closed}: Connection refused\): "):
        run_preflight(config, ["precompute"])
    assert hub_access.hub_dataset_problem("someone/corpus").startswith(
        "dataset.path='someone/corpus' is a hub dataset with nothing in the local cache, and the hub cannot be reached")
    (hub_cache / "datasets--someone--corpus").mkdir()
    assert hub_access.hub_dataset_problem("someone/corpus") is None  # cached: `datasets` reads it offline
    cache_repo(hub_cache, TEACHER_ID, tiny_teacher_dir)
    run_preflight(config, ["precompute"])  # cached: no network needed
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert hub_access.hub_unreachable() is None
        assert hub_access.hub_model_problem("teacher.model", "someone/not-cached") is None  # fetched when it loads


def test_object_store_reads_lift_datasets_offline_flag_for_object_stores_only() -> None:
    """s3:// and local files: datasets may read them inside the block although HF_HUB_OFFLINE is set; a file
    behind http(s) or hf:// keeps the flag (that is the hub, or may be); the flag is back after the block."""
    import datasets

    from kdflow.tasks.common.hub_access import object_store_reads

    before = datasets.config.HF_HUB_OFFLINE
    assert before  # tests/conftest.py sets HF_HUB_OFFLINE
    with object_store_reads(["s3://bucket/a.jsonl", "local/b.jsonl"]):
        assert datasets.config.HF_HUB_OFFLINE is False
    assert datasets.config.HF_HUB_OFFLINE == before
    for files in (["s3://bucket/a.jsonl", "https://huggingface.co/x/a.jsonl"], ["hf://datasets/x/a.jsonl"],
                  ["local/only.jsonl"]):
        with object_store_reads(files):
            assert datasets.config.HF_HUB_OFFLINE == before, files


def test_a_run_root_given_for_a_model_names_its_trained_students(tmp_path: Path) -> None:
    from kdflow.tasks.common.model_files import model_folder_problem

    for name in ("tiny", "wide"):
        (tmp_path / "students" / name / "final").mkdir(parents=True)
        (tmp_path / "students" / name / "final" / "config.json").write_text("{}")
    (tmp_path / "students" / "unfinished").mkdir()
    assert model_folder_problem(str(tmp_path)) == (
        f"no config.json in it: a run root, whose trained students are {tmp_path}/students/tiny/final, "
        f"{tmp_path}/students/wide/final")
    assert model_folder_problem(str(tmp_path / "students")) == "no config.json in it"
