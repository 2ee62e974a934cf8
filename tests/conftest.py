"""Shared test fixtures: tiny real tokenizers and teachers built from configs (no hub), corpora, configs;
the test tiers.

The Prefect test harness (a temporary server on SQLite) is started once per test session, and only
when a test asks for it (`prefect_harness`), because it costs ~10 s.

Tiers follow from the fixtures a test uses (`pytest_collection_modifyitems`), so a new test lands in its tier
by what it needs: `e2e` (whole pipeline runs, the Prefect server, PostgreSQL, the demo), else `process`
(child processes through `children`, the S3 servers of moto), else `unit`. A unit test that starts a child
process fails and names the fixture to ask for. `pytest -m unit` is the fast tier; plain `pytest` runs all.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.corpus import TINY_VOCAB, sample_documents, write_jsonl

# Two workers share the cores (`-n 2`): one compute thread each (inherited by their children), not two that
# oversubscribe the cores and spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Triton kernels run in the suite through Triton's interpreter, on CPU tensors. It must be on before anything
# imports triton (transformers and torch may, on their own): Triton builds its language's helper functions for the
# interpreter only when the setting is there at that moment. Without a GPU nothing else runs a Triton kernel.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["support.fixtures"]

# The tier of a test is that of the first of these sets holding one of its fixtures (direct or indirect), else unit.
E2E_FIXTURES = {"prefect_harness", "prefect_api_url", "infra_env", "prefect_stack"}
PROCESS_FIXTURES = {"children", "moto", "s3_endpoint"}
# Programs a library may start on its own inside a unit test: ctypes.util.find_library runs ldconfig or gcc,
# torch.compile runs the C++ compiler, openssl and Python probes of what it compiled; platform.architecture() (called
# by the croniter that Prefect's server vendors, on import) runs file; matplotlib (the training curve) runs fc-list
# to build its font cache, once a machine: on a fresh machine the first unit test that draws a curve met it.
LIBRARY_HELPERS = {"ldconfig", "gcc", "cc", "g++", "c++", "clang", "clang++", "ld", "objdump", "uname", "openssl",
                   "file", "fc-list"}
LIBRARY_MODULES = ("torchinductor", "torch/_inductor/", "torch._inductor.")


def pytest_configure(config: pytest.Config) -> None:
    """xdist 3.8 names each test's group by rewriting `item._nodeid`, which pytest 9.2 no longer reads: every test
    would silently become its own unit (module fixtures rebuilt, one Prefect server per worker)."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    from importlib.metadata import version

    from packaging.version import Version

    if Version(pytest.__version__) >= Version("9.2") and Version(version("pytest-xdist")) <= Version("3.8.0"):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {version('pytest-xdist')} runs no "
                                "test groups: install the test extra's pins (pip install -e '.[test]')")


def tier_of(fixturenames: list[str]) -> str:
    if E2E_FIXTURES.intersection(fixturenames):
        return "e2e"
    return "process" if PROCESS_FIXTURES.intersection(fixturenames) else "unit"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers set here and xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = {item: tier_of(getattr(item, "fixturenames", [])) for item in items}
    for item, tier in tiers.items():
        item.add_marker(getattr(pytest.mark, tier))
    # The suite runs on two workers (`-n 2 --dist loadgroup`, pyproject.toml). Each module is one group (its
    # module-scoped fixtures are built once), except that every test on the session's Prefect server is in one
    # group, so one pytest run starts one such server. That group, the longest by far, starts first; the others
    # keep file order (`--no-loadscope-reorder`), which mixes heavy modules with light ones. Starting every
    # end-to-end group first was slower: two multi-process tests at once on two cores contend (15:20 against 14:31).
    on_server = {item: "prefect_harness" in getattr(item, "fixturenames", []) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group("prefect-server" if on_server[item] else item.nodeid.split("::")[0]))
    items.sort(key=lambda item: not on_server[item])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Prefect binds its console log handler to whatever `sys.stderr` is when its logging is first set up. Were
    that inside a test using `capsys`, every later flow would log into that test's closed stream ("I/O operation on
    closed file"), depending on which test a worker happened to run first. So a run that will start flows sets up
    Prefect's logging now, against the session's own capture stream."""
    if any(item.get_closest_marker("unit") is None for item in session.items):
        import prefect.main  # noqa: F401  (its import configures Prefect's logging)


@pytest.fixture(scope="session")
def children() -> Any:
    """Child processes of a test (`support.children`: run, started, finish, ...): asking for it makes the test
    a `process` test."""
    from support import children as helpers

    return helpers


@pytest.fixture(autouse=True)
def _unit_tests_start_no_child(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("unit") is None:
        return
    popen = subprocess.Popen

    class NoChild(popen):  # type: ignore[misc,valid-type]
        def __init__(self, args: Any, *more: Any, **options: Any) -> None:
            one = isinstance(args, (str, bytes, os.PathLike))
            program, words = (args, [args]) if one else (args[0], list(args))
            helper = os.path.basename(os.fsdecode(program)).split()[0] in LIBRARY_HELPERS
            if not helper and not any(m in os.fsdecode(w) for w in words for m in LIBRARY_MODULES):
                pytest.fail(f"a unit test started a child process ({program}): ask for the `children` fixture "
                            "(tests/conftest.py), which makes it a `process` test", pytrace=False)
            super().__init__(args, *more, **options)

    monkeypatch.setattr(subprocess, "Popen", NoChild)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained on Python's docs, saved as a HF fast tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(sample_documents(400), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<pad>")
    folder = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(folder)
    return folder


def _save_teacher(folder: Path, model_config: Any, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A tiny Llama teacher (random weights) with the tiny tokenizer, as a local HF model folder."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=1)
    return _save_teacher(tmp_path_factory.mktemp("teacher-llama"), config, tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_moe_teacher_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A tiny Qwen3-MoE teacher: the reference teacher's architecture family."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False,
                            eos_token_id=0, bos_token_id=0, pad_token_id=1)
    return _save_teacher(tmp_path_factory.mktemp("teacher-moe"), config, tiny_tokenizer_dir)


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "data" / "docs.jsonl", sample_documents(60))


@pytest.fixture
def make_config(tmp_path: Path, tiny_teacher_dir: Path, corpus_file: Path) -> Callable[..., Any]:
    """Build a KDFlowConfig for a tiny run; keyword arguments are dotted overrides (`student__steps=3`)."""
    from support.tiny import tiny_config

    def build(**overrides: Any) -> Any:
        return tiny_config(tmp_path / "run", tiny_teacher_dir, corpus_file, **overrides)

    return build


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server on SQLite, started once for the whole test run."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_api_url(prefect_harness: None) -> str:
    """The API of the session's Prefect server, for child processes (`PREFECT_API_URL`): a `kdflow run` child
    given it starts no temporary server of its own (~10 s each)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """moto's S3 server in a process of its own, one per test module (requests logged: `MotoProcess.requests`)."""
    from support.s3_server import MotoProcess

    server = MotoProcess(tmp_path_factory.mktemp("moto") / "requests.log", threaded=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(moto: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh bucket on the module's moto server, this process's S3 clients pointed at it (`support.s3_buckets`)."""
    import uuid

    import boto3
    import s3fs
    from support.s3_buckets import Bucket
    from support.s3_server import CREDENTIALS, use_endpoint

    use_endpoint(monkeypatch, moto.endpoint)
    name = f"kdflow-{uuid.uuid4().hex[:12]}"
    keys = {k.lower(): CREDENTIALS[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    boto3.client("s3", endpoint_url=moto.endpoint, **keys).create_bucket(Bucket=name)
    yield Bucket(moto, name, f"s3://{name}/run")
    s3fs.S3FileSystem.clear_instance_cache()
