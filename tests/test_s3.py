"""The run root on object storage: every stage on `s3://bucket/run` through fsspec, against a real S3 server.

moto's S3 server runs on loopback; the stages find it the way users point kdflow at MinIO or another
S3-compatible store, through environment variables that botocore and fsspec already read:
`AWS_ENDPOINT_URL` (botocore, any process) and `FSSPEC_S3_ENDPOINT_URL` (fsspec, read when it is imported),
with the credentials in `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`. No code path is special-cased for S3.
"""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.children import run
from support.s3_server import free_port, use_endpoint

pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (the [test] extra)")


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_run_root(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import boto3
    import s3fs

    use_endpoint(monkeypatch, s3_endpoint)
    bucket = f"kdflow-{uuid.uuid4().hex[:12]}"  # one bucket per test: the server lives for the module
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/run"
    s3fs.S3FileSystem.clear_instance_cache()


def _s3_keys(endpoint: str, run_root: str, under: str) -> list[str]:
    """Keys below `under` (relative to the run root), read with boto3 directly rather than through fsspec."""
    import boto3

    bucket, prefix = run_root.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", endpoint_url=endpoint)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/{under}")
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def test_every_stage_on_an_s3_run_root(s3_run_root: str, s3_endpoint: str, make_config: Callable[..., Any]) -> None:
    from kdflow.schemas.commits import list_commits, read_complete, stage_dir
    from kdflow.schemas.manifests import load_manifest
    from kdflow.schemas.stage_settings import (materialise_settings, open_run_root, teacher_pass_settings,
                                               tokenise_settings)
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise
    from kdflow.tasks.teacher.precompute import precompute_shards

    config = make_config(run_root=s3_run_root, dataset__max_documents=14)
    run_root = RunRoot(config.run_root)
    assert not run_root.is_local
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)

    corpus = materialise(open_run_root(config), materialise_settings(config))
    tokens = tokenise(open_run_root(config), tokenise_settings(config), tokenizer)
    topk = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert corpus.parts_written == corpus.parts >= 1 and tokens.shards_written == tokens.shards >= 2
    assert topk["written"] == tokens.shards and topk["complete"]

    # The data landed in the bucket, under final keys (object stores never see temp files).
    keys = _s3_keys(s3_endpoint, s3_run_root, "")
    for key in ("corpus/part-00000.parquet", "tokens/shard-00000.arrow", "tokens/shard-00000.commit.json",
                f"topk/{topk['tag']}/shard-00000.arrow", f"topk/{topk['tag']}/shard-00000.commit.json"):
        assert f"run/{key}" in keys
    assert not any(".tmp-" in key for key in keys)
    assert sum(key.startswith(f"run/topk/{topk['tag']}/") and key.endswith(".arrow") for key in keys) == tokens.shards

    # Rerun: everything is committed, so no stage writes anything.
    assert materialise(open_run_root(config), materialise_settings(config)).parts_written == 0
    assert tokenise(open_run_root(config), tokenise_settings(config), tokenizer).shards_written == 0
    again = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert again["written"] == 0 and again["skipped"] == tokens.shards

    # The manifests (tables of commit records) validate, read back from the bucket.
    corpus_store, tokens_store = stage_dir(run_root, "corpus"), stage_dir(run_root, "tokens")
    topk_store = stage_dir(run_root, "topk", topk["tag"])
    assert len(load_manifest(run_root, corpus_store, "corpus", corpus.fingerprint)) == corpus.parts
    assert len(load_manifest(run_root, tokens_store, "tokens", tokens.fingerprint,
                             seq_len=config.seq_len)) == tokens.shards
    topk_manifest = load_manifest(run_root, topk_store, "topk", topk["tag"], seq_len=config.seq_len)
    assert sorted(topk_manifest["shard_id"]) == list(range(tokens.shards))
    assert read_complete(run_root, tokens_store).shards == tokens.shards
    assert sorted(list_commits(run_root, tokens_store, "tokens", tokens.fingerprint)) == list(range(tokens.shards))

    # `kdflow status` in a fresh process, which finds the endpoint through fsspec's own variable this time.
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"} | {"FSSPEC_S3_ENDPOINT_URL": s3_endpoint}
    result = run([sys.executable, "-m", "kdflow", "status", s3_run_root], what="kdflow status on S3", timeout=120,
                 env=env)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "complete" in lines["corpus"]
    assert f"{tokens.shards}/{tokens.shards}" in lines["tokens"] and "complete" in lines["tokens"]
    topk_line = lines[f"topk/{topk['tag']}"]
    assert f"{tokens.shards}/{tokens.shards}" in topk_line and "complete" in topk_line


def test_chat_with_a_student_on_s3_talks_to_a_copy_made_for_the_session(
        s3_run_root: str, tiny_teacher_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kdflow chat s3://.../students/NAME`: transformers loads local folders only, so final/ is copied to a
    scratch folder for the conversation and removed after it; the replies are those of the local folder."""
    import s3fs

    from kdflow.cli import main

    s3fs.S3FileSystem().put(f"{tiny_teacher_dir}/", f"{s3_run_root}/students/tiny/final/", recursive=True)
    args = ["--prompt", "The object", "--greedy", "--max-new-tokens", "4"]
    assert main(["chat", str(tiny_teacher_dir), *args]) == 0
    local = capsys.readouterr().out
    assert main(["chat", f"{s3_run_root}/students/tiny", *args]) == 0
    remote = capsys.readouterr()
    assert remote.out == local and local.strip()
    copied = re.search(rf"^kdflow: copied {s3_run_root}/students/tiny/final \(\d+ files, [\d.]+ MiB\) to (\S+) for "
                       "this session$", remote.err, re.MULTILINE)
    assert copied and not Path(copied.group(1)).exists()  # the copy lives as long as the conversation

    assert main(["chat", f"{s3_run_root}/students/nobody", *args]) == 2
    assert capsys.readouterr().err.strip() == (f"kdflow: error: student '{s3_run_root}/students/nobody' is not a "
                                               f"model: no config.json in {s3_run_root}/students/nobody")


@pytest.mark.parametrize("streaming", [False, True])
def test_a_dataset_file_on_s3_is_read_offline_and_an_edit_is_named_by_its_new_version(
        s3_run_root: str, make_config: Callable[..., Any], tmp_path: Path, streaming: bool) -> None:
    """A dataset file on an object store is read with HF_HUB_OFFLINE set (as here, and on machines kept off the
    hub: datasets refuses every URL then, its own bucket's too, unless materialise lifts that for object stores).
    The corpus sources' record there holds size and version (ETag) of each file, not its hash: an object written
    again with other bytes is named by the next run, as another size or another version; written back with the
    first bytes, its ETag is the first again and the run goes on."""
    import s3fs
    from support.corpus import DOCS

    from kdflow.schemas.dataset_record import DatasetRecord
    from kdflow.schemas.errors import ConfigError
    from kdflow.schemas.layout import CORPUS_DIR, SOURCES_FILE
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.preflight import run_preflight

    source = s3_run_root.rsplit("/", 1)[0] + "/src/docs.jsonl"
    original = "".join(json.dumps({"text": text}) + "\n" for text in DOCS).encode()
    fs = s3fs.S3FileSystem()
    fs.pipe(source, original)
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # tests/conftest.py
    config = make_config(run_root=str(tmp_path / "run"), dataset__path=source, dataset__documents_per_part=4,
                         dataset__streaming=streaming)
    assert materialise(open_run_root(config), materialise_settings(config)).documents == len(DOCS)
    recorded = DatasetRecord.model_validate_json(Path(config.run_root, CORPUS_DIR, SOURCES_FILE).read_bytes())
    assert [(f.name, f.size, f.sha256) for f in recorded.files] == [(source, len(original), None)]
    assert recorded.files[0].version and run_preflight(config, "materialise") == []

    fs.pipe(source, original.replace(b"word", b"ward", 1))  # the same size, other bytes: another ETag
    fs.invalidate_cache()
    with pytest.raises(ConfigError, match=re.escape(f"({source}: another version (")):
        run_preflight(config, "materialise")
    with pytest.raises(ConfigError, match="changed since materialise read them"):
        materialise(open_run_root(config), materialise_settings(config))
    fs.pipe(source, original + b'{"text": "one more"}\n')
    fs.invalidate_cache()
    with pytest.raises(ConfigError, match=re.escape(f"({source}: {len(original):,} -> {len(original) + 21:,} bytes)")):
        run_preflight(config, "materialise")
    fs.pipe(source, original)  # put back: the first bytes, the first ETag
    fs.invalidate_cache()
    assert run_preflight(config, "materialise") == []
    assert materialise(open_run_root(config), materialise_settings(config)).parts_written == 0


def test_a_run_root_in_a_missing_bucket_is_refused_not_created(s3_run_root: str, s3_endpoint: str,
                                                               make_config: Callable[..., Any],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`kdflow run` with a mistyped bucket ran the whole pipeline in a bucket s3fs's makedirs created; and without
    credentials the probe's removal raised botocore's own error over the one-line StoreError. Pre-flight says
    both before Prefect starts (they showed 10-90 s into the run)."""
    import boto3
    import s3fs

    from kdflow.schemas.errors import ConfigError, StoreError
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.preflight import run_preflight

    missing = f"kdflow-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreError, match=rf"^s3://{missing}/run: the bucket '{missing}' does not exist"):
        RunRoot(f"s3://{missing}/run").ensure_writable()
    with pytest.raises(ConfigError, match=rf"^s3://{missing}/run: the bucket '{missing}' does not exist"):
        run_preflight(make_config(run_root=f"s3://{missing}/run"), "materialise")
    assert run_preflight(make_config(run_root=s3_run_root), "materialise") == []
    buckets = {b["Name"] for b in boto3.client("s3", endpoint_url=s3_endpoint).list_buckets()["Buckets"]}
    assert missing not in buckets and s3_run_root.split("/")[2] in buckets
    s3fs.S3FileSystem.clear_instance_cache()
    for name, value in {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE":
                        "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StoreError, match="no credentials"):
        RunRoot(s3_run_root).ensure_writable()
    with pytest.raises(ConfigError, match="no credentials"):
        run_preflight(make_config(run_root=s3_run_root), "materialise")


@pytest.mark.usefixtures("children")
def test_an_s3_run_root_without_s3fs_installed_is_one_line_naming_the_extra() -> None:
    """It was "kdflow: error: ImportError: Install s3fs to access S3", exit 1, for status, validate and run."""
    import subprocess

    from kdflow.schemas.protocol import EXIT_USER_ERROR

    without = ("import runpy, sys\nsys.modules['s3fs'] = None  # not installed\n"
               "sys.argv = ['kdflow', *sys.argv[1:]]\nrunpy.run_module('kdflow', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", without, "status", "s3://some-bucket/run"], capture_output=True,
                            text=True, timeout=180, cwd=Path(__file__).resolve().parents[1])
    assert (result.returncode, result.stderr.splitlines()) == (EXIT_USER_ERROR, [
        "kdflow: error: run root s3://some-bucket/run: Install s3fs to access S3 (kdflow's s3 extra: pip install "
        "'kdflow[s3]')"]), result.stderr
