"""Stores for `kdflow bench scale`: moto's S3 server on loopback with its request log counted, and run roots
that hold only commit records (thousands of shards, tiny data files)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kdflow.bench.harness import open_root

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


class Moto:
    def __init__(self, work: Path) -> None:
        import socket

        from kdflow.schemas.storage import RunRoot  # noqa: F401 - fail here, not in a child, if fsspec lacks s3

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.log_path = work / "moto.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"moto's S3 server did not start: {self.log_path.read_text()[-500:]}")
            time.sleep(0.2)

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != "FSSPEC_S3_ENDPOINT_URL"} | CREDENTIALS | {
            "AWS_ENDPOINT_URL": self.endpoint}

    def mark(self) -> int:
        self._log.flush()
        return len(self.log_path.read_text().splitlines())

    def requests_since(self, mark: int) -> dict[str, int]:
        counts: dict[str, int] = {}
        for line in self.log_path.read_text().splitlines()[mark:]:
            for method in ("GET", "PUT", "HEAD", "POST", "DELETE"):
                if f'"{method} ' in line:
                    kind = "LIST" if method == "GET" and "list-type=" in line else method
                    kind = "GET_SHARD_DATA" if kind == "GET" and ".arrow " in line else kind  # row ranges, stream heads
                    counts[kind] = counts.get(kind, 0) + 1
        return counts

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


@contextlib.contextmanager
def store_env(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:
        pass
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def records_only(url: str, shards: int, env: dict[str, str]) -> None:
    """A run root whose token and top-K stores hold `shards` commit records and 8-byte data files."""
    import hashlib

    from kdflow.schemas.commits import CommitRecord, StageComplete
    from kdflow.schemas.layout import commit_file_name, data_file_name
    with store_env(env):
        run_root = open_root(url)
        payload, sha = b"8 bytes!", hashlib.sha256(b"8 bytes!").hexdigest()
        files: dict[str, bytes] = {}
        for stage, folder, fingerprint in (("tokens", ("tokens",), "t" * 16), ("topk", ("topk", "a" * 12), "a" * 12)):
            store = run_root.path(*folder)
            for shard_id in range(shards):
                name = data_file_name(stage, shard_id)
                record = CommitRecord(stage=stage, shard_id=shard_id, data_file=name, rows=1, tokens=512,
                                      bytes=len(payload), sha256=sha, input_sha256=sha, fingerprint=fingerprint)
                files[f"{store}/{name}"] = payload
                files[f"{store}/{commit_file_name(stage, shard_id)}"] = record.model_dump_json(indent=1).encode()
            complete = StageComplete(stage=stage, shards=shards, rows=shards, tokens=512 * shards,
                                     fingerprint=fingerprint)
            files[f"{store}/_complete.json"] = complete.model_dump_json().encode()
        if run_root.is_local:
            for path, data in files.items():
                os.makedirs(os.path.dirname(path), exist_ok=True)
                Path(path).write_bytes(data)
        else:
            run_root.fs.pipe(files)  # concurrent PUTs
