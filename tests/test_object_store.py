"""A run root on an object store at scale: conditional writes, two writers racing, one listing per store, training
reads by byte range equal to local reads, and the store's faults (credentials, bucket, network) as one line.

moto's S3 server runs in its own process (tests/support/s3_server.py), serving one request at a time so that its
conditional writes are atomic as on S3, and logging every request so that the tests count them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed (the [test] extra)")

from support.s3_buckets import Bucket, prepare  # noqa: E402
from support.s3_server import MotoProcess, TcpProxy, kinds, use_endpoint  # noqa: E402

from kdflow.commands.validate import validate_run_root  # noqa: E402
from kdflow.schemas.commits import CommitRecord, list_commits, write_commit  # noqa: E402
from kdflow.schemas.config_io import dump_config
from kdflow.schemas.layout import commit_file_name, data_file_name  # noqa: E402
from kdflow.schemas.protocol import EXIT_USER_ERROR, RESULT_PREFIX  # noqa: E402
from kdflow.schemas.storage import RunRoot  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def worker(config_path: Path, **env: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "kdflow.tasks.teacher.precompute_worker", "--config", str(config_path)]
    return subprocess.Popen(args, cwd=REPO, env=os.environ | env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def lines_with(prefix: str, text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)]


def successful_puts(requests: list[tuple[str, str, int]], pattern: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for method, path, status in requests:
        if method == "PUT" and status == 200 and re.search(pattern, path):
            counts[path] = counts.get(path, 0) + 1
    return counts


# --- conditional writes -----------------------------------------------------------------------------------


def test_records_and_leases_are_created_only_if_absent(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    run_root = RunRoot(bucket.run_root)
    assert run_root.conditional_writes  # moto honours If-None-Match and If-Match, as S3 does
    path = run_root.path("topk", "tag", "shard-00000.lease")
    assert run_root.create_if_absent(path, b"first")
    assert not run_root.create_if_absent(path, b"second") and run_root.read_bytes(path) == b"first"
    data, version = run_root.read_versioned(path)
    assert data == b"first" and version
    assert run_root.replace_if_unchanged(path, b"taken over", version)
    assert not run_root.replace_if_unchanged(path, b"too late", version)  # changed since `version` was read
    assert run_root.read_bytes(path) == b"taken over"

    # A commit record that is there and valid stands; an invalid one in the way is replaced.
    store = run_root.path("tokens")
    name = data_file_name("tokens", 0)
    sha = run_root.write_bytes_atomic(f"{store}/{name}", b"data")
    record = CommitRecord(stage="tokens", shard_id=0, data_file=name, rows=1, tokens=4, bytes=4, sha256=sha,
                          fingerprint="f" * 16)
    assert write_commit(run_root, store, record, exclusive=True)
    assert not write_commit(run_root, store, record.model_copy(update={"host": "other"}), exclusive=True)
    run_root.write_bytes_atomic(f"{store}/{commit_file_name('tokens', 0)}", b"{half a record")
    assert (write_commit(run_root, store, record, exclusive=True)
            and list_commits(run_root, store, "tokens") == {0: record})

    # The fallback for stores without conditional writes: checked, written, read back.
    monkeypatch.setenv("KDFLOW_CONDITIONAL_WRITES", "off")
    fallback = RunRoot(f"s3://{bucket.name}/other")
    assert not fallback.conditional_writes
    target = fallback.path("shard-00001.lease")
    assert fallback.create_if_absent(target, b"one") and not fallback.create_if_absent(target, b"two")
    assert fallback.read_bytes(target) == b"one"


def test_a_store_is_listed_once_and_its_records_read_without_a_request_per_data_file(bucket: Bucket) -> None:
    run_root = RunRoot(bucket.run_root)
    store = run_root.path("tokens")
    for shard_id in range(30):
        name = data_file_name("tokens", shard_id)
        sha = run_root.write_bytes_atomic(f"{store}/{name}", b"x" * (shard_id + 1))
        write_commit(run_root, store, CommitRecord(stage="tokens", shard_id=shard_id, data_file=name, rows=1, tokens=4,
                                                   bytes=shard_id + 1, sha256=sha, fingerprint="f" * 16))
    mark = len(bucket.moto.requests())
    assert sorted(list_commits(run_root, store, "tokens", "f" * 16)) == list(range(30))
    assert kinds(bucket.requests_since(mark)) == {"LIST": 1, "GET": 30}


# --- two writers ------------------------------------------------------------------------------------------


def test_two_processes_racing_on_the_same_shards_write_each_record_once(
        bucket: Bucket, make_config, tmp_path: Path) -> None:
    config = make_config(run_root=bucket.run_root, dataset__max_documents=20, precompute__lease_ttl_s=10)
    prepare(config)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(config))
    mark = len(bucket.moto.requests())
    workers = [worker(config_path) for _ in range(2)]  # started together: a real race for every shard
    outputs = [w.communicate(timeout=300) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [err[-3000:] for _, err in outputs]
    results = [lines_with(RESULT_PREFIX, out)[0] for out, _ in outputs]
    shards = results[0]["shards"]
    assert shards >= 4 and sum(r["written"] for r in results) == shards  # each shard committed by one of them
    assert all(r["complete"] and r["committed"] == shards for r in results)
    assert not any("Found credentials" in err or "Found endpoint" in err for _, err in outputs)  # botocore's INFO

    requests = bucket.requests_since(mark)
    records = successful_puts(requests, r"/topk/[0-9a-f]+/shard-\d+\.commit\.json$")
    data = successful_puts(requests, r"/topk/[0-9a-f]+/shard-\d+\.arrow$")
    assert len(records) == shards and set(records.values()) == {1}  # each record written once
    assert len(data) == shards and set(data.values()) == {1}  # and no shard computed twice
    refused = [r for r in requests if r[0] == "PUT" and r[2] == 412]  # conditional creates that lost
    assert all(".lease" in path or "_conditional-probe" in path for _, path, _ in refused)


# --- the student reads rows by byte range -----------------------------------------------------------------


def test_training_on_s3_reads_exactly_what_it_reads_on_disk(bucket: Bucket, make_config, tmp_path: Path) -> None:
    import fsspec

    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings, training_settings
    from kdflow.tasks.student.train import train
    from kdflow.tasks.teacher.precompute import precompute_shards

    on_s3 = make_config(run_root=bucket.run_root, dataset__max_documents=40, student__steps=3, student__grad_accum=2)
    prepare(on_s3)
    assert precompute_shards(open_run_root(on_s3), teacher_pass_settings(on_s3))["complete"]
    fsspec.filesystem("s3").get(f"{bucket.name}/run", str(tmp_path / "local"), recursive=True)
    on_disk = make_config(run_root=str(tmp_path / "local"), dataset__max_documents=40, student__steps=3,
                          student__grad_accum=2)

    mark = len(bucket.moto.requests())
    remote, local = (train(open_run_root(run), training_settings(run)) for run in (on_s3, on_disk))
    assert remote["final_loss"] == local["final_loss"] and remote["eval_after"] == local["eval_after"]
    metrics = [json.loads(line) for line in RunRoot(on_s3.run_root).read_bytes(
        f"{RunRoot(on_s3.run_root).path('students', 'student')}/metrics.jsonl").decode().splitlines()]
    local_metrics = [json.loads(line)
                     for line in (tmp_path / "local/students/student/metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == [m["loss"] for m in local_metrics]
    assert all(0 <= m["data_wait_fraction"] <= 1 for m in metrics)
    # The stage lists each store once at start-up (no listing or HEAD per shard), then reads rows by ranged GETs.
    requests = bucket.requests_since(mark)
    listings = [path for method, path, _ in requests if method == "GET" and "list-type=" in path]
    assert sum("prefix=run/tokens/&" in path for path in listings) == 1
    assert sum(bool(re.search(r"prefix=run/topk/[0-9a-f]+/&", path)) for path in listings) == 1
    assert not [path for method, path, _ in requests if method == "HEAD" and re.search(r"/(tokens|topk)/", path)]
    assert [path for method, path, _ in requests if method == "GET" and re.search(r"/topk/.*\.arrow", path)]
    assert validate_run_root(on_s3.run_root) == 0


@pytest.mark.parametrize("store", ["v1", "hybrid"])
def test_v1_and_sampled_stores_on_s3_load_the_rows_their_shards_hold(bucket: Bucket, make_config, store: str) -> None:
    """Rows by byte range for the other formats: v1 (fixed-width, per-row ranges) and hybrid sampled targets (whole
    record batches); the loader's batch equals the shard decoded whole, tail and samples included; validate streams."""
    import numpy as np

    from kdflow.schemas.codec_sampled import SampledShard
    from kdflow.schemas.shards import TopkShard
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings, training_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_distill_data
    from kdflow.tasks.teacher.precompute import precompute_shards

    overrides = ({"precompute__store__format": "v1"} if store == "v1" else
                 {"precompute__targets": "hybrid", "precompute__sampling": {"head": 4, "samples": 6, "seed": 5}})
    config = make_config(run_root=bucket.run_root, dataset__max_documents=24, precompute__micro_batch=3, **overrides)
    prepare(config)
    assert precompute_shards(open_run_root(config), teacher_pass_settings(config))["complete"]
    data = open_distill_data(open_run_root(config), training_settings(config),
                             load_tokenizer(config.teacher, config.tokenizer))
    rows = np.array([data.train_rows - 1, 0, 4, 3, 0])  # across shards, out of order, one repeated
    batch = data.train_batch(rows)
    run_root = RunRoot(config.run_root)
    for i, (pair, row) in enumerate(data.locate(rows)):
        shard = (TopkShard(run_root, pair.topk_path) if store == "v1"
                 else SampledShard(run_root, pair.topk_path)).read([row])
        assert np.array_equal(batch.topk_ids[i].numpy(), shard.ids[0])
        assert np.array_equal(batch.topk_logprobs[i].numpy(), shard.logprobs[0])
        assert np.array_equal(batch.tail_logprob[i].numpy(), shard.tail[0])
        if store == "hybrid":
            assert np.array_equal(batch.samples[0][i].numpy(), shard.sample_ids[0])
            assert np.array_equal(batch.samples[2][i].numpy(), shard.log_threshold[0])
    assert (batch.samples is None) == (store == "v1")
    assert validate_run_root(config.run_root) == 0


# --- faults of the store ----------------------------------------------------------------------------------


def kdflow_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kdflow", *args], cwd=REPO, env=os.environ | env, capture_output=True,
                          text=True, timeout=180)


def assert_one_line(result: subprocess.CompletedProcess, *phrases: str) -> None:
    assert result.returncode == EXIT_USER_ERROR, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdflow: error: "), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_missing_credentials_a_missing_bucket_and_wrong_credentials_are_one_line(
        bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    RunRoot(bucket.run_root).write_bytes_atomic(RunRoot(bucket.run_root).path("corpus", "x"), b"1")
    no_credentials = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
                      "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}
    assert_one_line(kdflow_cli("status", bucket.run_root, **no_credentials), bucket.run_root, "no credentials")
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    assert_one_line(kdflow_cli("status", missing), missing, "bucket", "does not exist")
    assert_one_line(kdflow_cli("validate", missing), missing, "does not exist")

    # Wrong credentials need a server that checks them: moto with authentication on after 3 requests (IAM set-up).
    import boto3

    server = MotoProcess(tmp_path / "auth.log", threaded=True, auth_after=3)
    try:
        iam = boto3.client("iam", endpoint_url=server.endpoint, aws_access_key_id="testing",
                           aws_secret_access_key="testing")
        iam.create_user(UserName="kd")
        key = iam.create_access_key(UserName="kd")["AccessKey"]
        iam.put_user_policy(UserName="kd", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=key["AccessKeyId"],
                     aws_secret_access_key=key["SecretAccessKey"]).create_bucket(Bucket="guarded")
        secret = "wrong-secret-value-123"
        result = kdflow_cli("status", "s3://guarded/run", AWS_ENDPOINT_URL=server.endpoint,
                            AWS_ACCESS_KEY_ID=key["AccessKeyId"], AWS_SECRET_ACCESS_KEY=secret)
        assert_one_line(result, "s3://guarded/run", "access denied")
        assert secret not in result.stderr + result.stdout
    finally:
        server.stop()


def test_a_lease_released_on_the_way_out_of_an_error_never_replaces_it(bucket: Bucket, monkeypatch) -> None:
    """The store that broke the body usually breaks the release too: the body's error is the one reported (the
    lease lapses after its ttl), and `remove` names the store it could not reach in one line."""
    from kdflow.schemas.errors import StoreError
    from kdflow.tasks.common.leases import Leases

    proxy = TcpProxy(bucket.moto.port)
    try:
        use_endpoint(monkeypatch, proxy.endpoint, AWS_MAX_ATTEMPTS="1")
        run_root = RunRoot(bucket.run_root)
        leases = Leases(run_root, run_root.path("topk", "tag"), ttl_s=60)
        assert leases.acquire(0)
        with pytest.raises(RuntimeError, match="the body's own error"), leases.holding(0):
            proxy.cut()
            raise RuntimeError("the body's own error")
        with pytest.raises(StoreError, match=f"^s3://{bucket.name}/run/topk/tag/[^\n]*unreachable[^\n]*$"):
            run_root.remove(leases.path(0))
        proxy.restore()
        assert leases.read(0)["owner"] == leases.owner  # still there until its ttl; a body that succeeds releases it
        with leases.holding(0):
            pass
        assert leases.read(0) is None
    finally:
        proxy.cut()


