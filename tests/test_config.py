"""The config: strict keys, typed values, clear one-line errors, overrides, frozen, stable hashes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_hash import section_hash
from kdflow.schemas.config_io import config_from_dict, dump_config, load_config
from kdflow.schemas.errors import ConfigError

EXAMPLE: dict[str, Any] = {
    "run_root": "runs/example",
    "dataset": {"path": "uonlp/CulturaX", "name": "ja", "streaming": True, "max_documents": 1000},
    "seq_len": 256,
    "teacher": {"model": "org/teacher", "load_in_4bit": True, "device": "cuda:1"},
    "precompute": {"top_k": 64, "micro_batch": 4, "sequences_per_shard": 128},
    "student": {"name": "tiny-1", "steps": 50, "kd": {"kd_weight": 0.5, "chunk_tokens": 1024},
                "architecture": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}},
}


def with_changes(**changes: Any) -> dict[str, Any]:
    """A deep copy of EXAMPLE with dotted keys (`student__steps`) set."""
    data = copy.deepcopy(EXAMPLE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return data


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def config_error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_example_loads_with_values_and_defaults(tmp_path: Path) -> None:
    config = load_config(write_yaml(tmp_path / "c.yaml", EXAMPLE))
    assert config.dataset.name == "ja" and config.dataset.streaming and config.dataset.max_documents == 1000
    assert config.teacher.device == "cuda:1" and config.teacher.load_in_4bit
    assert config.precompute.top_k == 64 and config.precompute.logprobs_dtype == "float16"
    assert config.student.kd.chunk_tokens == 1024 and config.student.architecture.hidden_size == 64
    assert config.student.lr == 1e-3  # a default from the field definition


@pytest.mark.parametrize("changes, key", [
    ({"bogus": 1}, "bogus"),
    ({"student__stpes": 3}, "student.stpes"),
    ({"student__kd__tempreature": 2.0}, "student.kd.tempreature"),
    ({"precompute__topk": 8}, "precompute.topk"),
])
def test_unknown_key_is_named(changes: dict[str, Any], key: str) -> None:
    assert config_error(with_changes(**changes)).endswith(f"unknown config key '{key}'")


@pytest.mark.parametrize("changes, key", [
    ({"seq_len": 0}, "seq_len"),
    ({"precompute__top_k": 0}, "precompute.top_k"),
    ({"precompute__micro_batch": -1}, "precompute.micro_batch"),
    ({"seq_len": "long"}, "seq_len"),
    ({"seq_len": 3.5}, "seq_len"),
    ({"dataset__streaming": "maybe"}, "dataset.streaming"),
    ({"dataset__data_files": 3}, "dataset.data_files"),  # a union: no 'str' member tag in the key
    ({"precompute__logprobs_dtype": "bf16"}, "precompute.logprobs_dtype"),
    ({"student__kd__kd_weight": 1.5}, "student.kd.kd_weight"),
    ({"teacher": "org/teacher"}, "teacher"),
])
def test_wrong_values_name_the_key(changes: dict[str, Any], key: str) -> None:
    assert f"invalid value for '{key}':" in config_error(with_changes(**changes))


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", "cuda 0"])
def test_bad_device_string(device: str) -> None:
    assert "teacher.device" in config_error(with_changes(teacher__device=device))
    assert "student.device" in config_error(with_changes(student__device=device))


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_good_device_strings(device: str) -> None:
    assert config_from_dict(with_changes(teacher__device=device)).teacher.device == device


@pytest.mark.parametrize("name", ["../x", "..", ".", "a/b", "/abs", ".hidden", ""])
def test_student_name_that_could_escape(name: str) -> None:
    assert "student.name" in config_error(with_changes(student__name=name))


def test_a_temperature_other_than_one_is_refused_in_one_line() -> None:
    """No store keeps the teacher's tempered tail (docs/loss.md): T != 1 would soften teacher and student unalike."""
    with pytest.raises(ConfigError, match=r"student.kd.temperature=2.0 is refused: no store keeps") as error:
        config_from_dict(with_changes(student__kd__temperature=2.0))
    assert "\n" not in str(error.value)
    assert config_from_dict(with_changes(student__kd__temperature=1.0)).student.kd.temperature == 1.0


def test_missing_required_key() -> None:
    data = with_changes()
    del data["teacher"]
    assert config_error(data).endswith("missing required config key 'teacher'")
    # A pair given one value: its second item is 'missing' to pydantic, not a key the file lacks.
    assert config_error(with_changes(student__betas=[0.9])).endswith(
        "invalid value for 'student.betas': too few items (item 2 is missing)")


def test_architecture_heads_must_divide() -> None:
    assert config_error(with_changes(student__architecture__num_attention_heads=3)).endswith(
        "invalid value for 'student.architecture': hidden_size must be divisible by num_attention_heads")


def test_a_gguf_teacher_in_4_bits_is_refused_when_read() -> None:
    """transformers dequantises a GGUF and refuses to quantise it: that was the teacher worker's traceback."""
    message = config_error(with_changes(teacher__gguf_file="m.gguf", teacher__load_in_4bit=True))
    assert message.endswith("invalid value for 'teacher': load_in_4bit cannot be combined with gguf_file: a GGUF is "
                            "dequantised when it loads, and transformers quantises no GGUF again; give the model's "
                            "safetensors folder (or hub id) for 4 bits, or set load_in_4bit: false")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_root: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML") as caught:
        load_config(bad)
    assert "\n" not in str(caught.value)
    for text, said in (("run_root: /r\n\tseq_len: 32\n", "at line 2, column 1: found character '\\t' that cannot "
                                                           "start any token"),
                       ("run_root: /r\nseq_len: 32\nseq_len: -1\n", "at line 3, column 1: the key 'seq_len' is given "
                                                                    "twice")):  # YAML itself keeps the last one
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(ConfigError) as caught:
            load_config(bad)
        assert str(caught.value) == f"{bad}: not valid YAML {said}"
    anchored = tmp_path / "anchored.yaml"  # a merge key's values may be overridden: that is no key given twice
    anchored.write_text(yaml.safe_dump(with_changes()).replace("seq_len:", "base: &b {seq_len: 8}\nx:\n  <<: *b\n  "
                                                                         "seq_len: 16\nseq_len:", 1))
    with pytest.raises(ConfigError, match=r"unknown config key 'base'"):  # parsed, then refused by the schema
        load_config(anchored)
    (tmp_path / "empty.yaml").write_text("\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml is empty: a config sets at least run_root"):
        load_config(tmp_path / "empty.yaml")
    with pytest.raises(ConfigError, match=r"is a folder, not a config file"):
        load_config(tmp_path)
    listed = write_yaml(tmp_path / "list.yaml", [1, 2])
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(listed, {"seq_len": 8})
    typo = write_yaml(tmp_path / "typo.yaml", with_changes(student__stpes=3))
    with pytest.raises(ConfigError, match=r"typo\.yaml: unknown config key 'student\.stpes'"):
        load_config(typo)


def test_overrides_with_dotted_keys(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "c.yaml", EXAMPLE)
    config = load_config(path, {"student.steps": 7, "student.kd.kd_weight": 0.25, "seq_len": 64,
                                "precompute.chunk_tokens": 512})
    assert config.student.steps == 7 and config.student.kd.kd_weight == 0.25
    assert config.seq_len == 64 and config.precompute.chunk_tokens == 512
    assert config.student.name == "tiny-1"  # untouched keys keep the file's value
    with pytest.raises(ConfigError, match="unknown config key 'student.stesp'"):
        load_config(path, {"student.stesp": 1})
    with pytest.raises(ConfigError, match="'seq_len' is not a section"):
        load_config(path, {"seq_len.x": 1})
    with pytest.raises(ConfigError) as caught:  # the value came from the command line: named there, with the value
        load_config(path, {"student.steps": "abc"})
    assert str(caught.value).startswith("--set student.steps=abc: invalid value for 'student.steps': ")
    resolved = tmp_path / "resolved.yaml"  # as a run writes it: `prune: null`
    resolved.write_text(dump_config(config), encoding="utf-8")
    assert "prune: null" in resolved.read_text()
    pruned = load_config(resolved, {"student.prune.layers": 3})
    assert pruned.student.prune is not None and pruned.student.prune.layers == 3
    assert pruned.student.prune.importance == "cosine"  # the rest of an empty section takes its defaults


@pytest.mark.parametrize(("overrides", "message"), [
    # inside an optional section (`student.prune: PruneConfig | None`): the key was cut at 'student.prune'
    ({"student.prune.layers": 2, "student.prune.colour": "red"},
     "--set student.prune.colour=red: unknown config key 'student.prune.colour'"),
    ({"student.prune.layers": 0}, "--set student.prune.layers=0: invalid value for 'student.prune.layers': Input "
                                  "should be greater than 0"),
    ({"student.prune.importance": "magnitude"}, "c.yaml: missing required config key 'student.prune.layers'"),
    # a list set whole, short of items: named by the --set that gave it
    ({"student.betas": [0.9]}, "--set student.betas=[0.9]: invalid value for 'student.betas': too few items (item 2 "
                               "is missing)"),
    # a section's own check, with a key from each side
    ({"student.prune.layers": 2, "student.init_from": "/models/x"},
     "c.yaml with --set student.prune.layers=2, --set student.init_from=/models/x: invalid value for 'student': "
     "student.prune and student.init_from both say where the student starts: set one"),
    # a check of the whole config whose message names the key given
    ({"student.kd.temperature": 2}, "--set student.kd.temperature=2: student.kd.temperature=2.0 is refused: "),
])
def test_an_error_names_the_set_it_came_from(tmp_path: Path, overrides: dict, message: str) -> None:
    path = write_yaml(tmp_path / "c.yaml", EXAMPLE)
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    assert str(caught.value).removeprefix(str(tmp_path) + "/").startswith(message), str(caught.value)


@pytest.mark.parametrize("text", ["student..steps=3", "=3", "student.=3"])
def test_a_set_key_with_an_empty_part_is_refused(text: str) -> None:
    import argparse

    from kdflow.schemas.config_io import parse_override

    with pytest.raises(argparse.ArgumentTypeError, match="has an empty part"):
        parse_override(text)


def test_config_is_frozen() -> None:
    config = config_from_dict(with_changes())
    with pytest.raises(pydantic.ValidationError):
        config.seq_len = 8  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        config.student.kd.temperature = 9.0  # type: ignore[misc]


def test_dump_config_round_trips(tmp_path: Path) -> None:
    config = config_from_dict(with_changes())
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(config), encoding="utf-8")
    again = load_config(path)
    assert again == config
    assert isinstance(again, KDFlowConfig) and dump_config(again) == dump_config(config)


def test_section_hash_is_stable_and_sensitive() -> None:
    config = config_from_dict(with_changes())
    same = config_from_dict(with_changes())
    assert section_hash("tokens", config.dataset, 5) == section_hash("tokens", same.dataset, 5)
    assert len(section_hash(config.dataset)) == 16 and len(section_hash(config.dataset, length=12)) == 12
    # Key order of a plain dict does not matter; every value does.
    assert section_hash({"a": 1, "b": 2}) == section_hash({"b": 2, "a": 1})
    changed = config_from_dict(with_changes(dataset__max_documents=1001))
    assert section_hash(config.dataset) != section_hash(changed.dataset)
    assert section_hash("tokens", config.dataset) != section_hash("topk", config.dataset)
    assert section_hash(config.dataset, 5) != section_hash(config.dataset, 6)
    # Pinned to sha256 of the canonical JSON '["x",1,null]': a drift would silently recompute every store.
    assert section_hash("x", 1, None) == "ab34dabd09fbd5b7"


def _sections(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {"KDFlowConfig": schema, **schema["$defs"]}


def _as_jsonb(value: Any) -> Any:
    """What PostgreSQL's jsonb gives back: object keys ordered by length, then bytes (values unchanged)."""
    if isinstance(value, dict):
        return {key: _as_jsonb(value[key]) for key in sorted(value, key=lambda k: (len(k.encode()), k.encode()))}
    if isinstance(value, list):
        return [_as_jsonb(item) for item in value]
    return value


def test_form_schema_keeps_field_order_titles_and_descriptions_through_jsonb() -> None:
    from kdflow.schemas import config as config_module

    schema = _as_jsonb(KDFlowConfig.model_json_schema())
    models = {name: getattr(config_module, name) for name in _sections(schema)}
    for name, section in _sections(schema).items():
        fields = list(models[name].model_fields)
        # Prefect's UI sorts a form's fields by `position` (stable): that must give the definition order back.
        shown = sorted(section["properties"], key=lambda key: section["properties"][key].get("position", 0))
        assert shown == fields, name
        for key, entry in section["properties"].items():
            assert entry.get("description"), f"{name}.{key} has no description"
            assert entry["title"] and "_" not in entry["title"], f"{name}.{key}: title {entry['title']!r}"
    assert list(schema["properties"]) != list(models["KDFlowConfig"].model_fields)  # the scramble is real
    titles = {key: entry["title"] for section in _sections(schema).values()
              for key, entry in section["properties"].items()}
    assert titles["lease_ttl_s"] == "Lease TTL (s)" and titles["rdzv_id"] == "Rendezvous ID"
    assert titles["seq_len"] == "Sequence length" and titles["top_k"] == "Top-K" and titles["lr"] == "Learning rate"
    assert titles["chunk_memory_mib"] == "Chunk memory (MiB)" and titles["student"] == "Student"
    # A section's own description reaches the field that holds it, and no description points at a file.
    assert schema["properties"]["teacher"]["description"].startswith("The model whose top-K")
    assert not any(".md" in (section.get("description") or "") for section in _sections(schema).values())


def test_form_title_reads_like_a_label() -> None:
    from kdflow.schemas.config_form import form_title

    assert form_title("retry_delay_s") == "Retry delay (s)"
    assert form_title("num_key_value_heads") == "Number of key value heads"
    assert form_title("load_in_4bit") == "Load in 4-bit"
    assert form_title("steps") == "Steps" and form_title("s") == "S"


def test_a_cuda_device_where_there_is_none_is_refused_for_the_stage_that_uses_it(make_config) -> None:
    from kdflow.tasks.common.devices import cuda_unavailable
    from kdflow.tasks.preflight import run_preflight

    if (why := cuda_unavailable()) is None:
        pytest.skip("this machine may have a CUDA device")
    assert run_preflight(make_config(student__device="cuda"), ["materialise", "tokenise", "precompute"]) == []
    with pytest.raises(ConfigError) as caught:
        run_preflight(make_config(student__device="cuda:1"), ["train"])
    assert str(caught.value) == f"student.device='cuda:1', but {why}: set it to auto (a GPU when there is one) or cpu"
    with pytest.raises(ConfigError, match=r"^teacher.device='cuda', but "):
        run_preflight(make_config(teacher__device="cuda"), ["precompute"])
    from kdflow.tasks.student.distributed import rank_device

    with pytest.raises(ConfigError) as caught:  # where torch is loaded, the same reason as pre-flight's
        rank_device("cuda", 0, 1)
    assert str(caught.value) == f"student.device='cuda', but {why}: set it to auto (a GPU when there is one) or cpu"


def test_a_command_s_run_root_is_a_folder_a_url_or_a_config_never_a_data_file(tmp_path: Path) -> None:
    from kdflow.schemas.config_io import run_root_of
    from kdflow.schemas.errors import ConfigError

    data = tmp_path / "docs.jsonl.gz"
    data.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"docs.jsonl.gz is a file, neither a run root \(a folder or URL\) nor a "):
        run_root_of(str(data))
    assert run_root_of(str(tmp_path / "runs" / "new")) == str(tmp_path / "runs" / "new")  # not made yet: as given
    assert run_root_of("s3://bucket/kd") == "s3://bucket/kd"
    with pytest.raises(ConfigError, match=r"^config file \S+/missing.yaml does not exist$"):
        run_root_of(str(tmp_path / "missing.yaml"))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"run_root": str(tmp_path / "r"), "dataset": {"path": "x.jsonl"},
                                      "teacher": {"model": "t"}}))
    assert run_root_of(str(config)) == str(tmp_path / "r")
    (tmp_path / "r").write_text("")  # a config whose run_root is a file: one line, not NotADirectoryError
    with pytest.raises(ConfigError, match=rf"^run_root '{tmp_path / 'r'}' \(in {config}\) is a file, not a run root"):
        run_root_of(str(config))
