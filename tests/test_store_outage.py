"""The run root's object store going away in the middle of the teacher pass: one line naming the store, committed
shards kept, and the flow's next worker (or the user's rerun) going on from them once the store is back."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed (the [test] extra)")

from support.s3_buckets import Bucket, prepare  # noqa: E402
from support.s3_server import TcpProxy, use_endpoint  # noqa: E402

from kdflow.schemas.commits import list_commits, stage_dir  # noqa: E402
from kdflow.schemas.protocol import EXIT_STORE_UNREACHABLE  # noqa: E402
from kdflow.schemas.storage import RunRoot  # noqa: E402
from kdflow.tasks.common.failures import exit_code_for  # noqa: E402


def test_the_flow_retries_a_teacher_worker_that_lost_the_store_and_finishes_the_pass(
        prefect_harness: None, bucket: Bucket, make_config, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store goes away after two shards' commits and comes back once that worker has failed: the worker exits
    4 (object store unreachable), the flow starts another after `precompute.retry_delay_s`, and that one finishes
    the pass without computing the committed shards again (it was a user error, exit 2, never retried). The store
    comes back as the second worker starts, not after a fixed second: a first worker still in botocore's retry then
    got through, and the pass finished at attempt 1."""
    from kdflow.flows import precompute as flow_module

    config = make_config(run_root=bucket.run_root, dataset__max_documents=20, precompute__retry_delay_s=1)
    prepare(config)
    proxy = TcpProxy(bucket.moto.port)
    proxy.cut_after = (re.compile(rb"PUT /\S+/topk/\S+\.commit\.json"), 2)
    launched, launch = [], flow_module.run_child

    def back_for_the_next_worker(*args: Any, **kwargs: Any) -> Any:
        launched.append(proxy.was_cut.is_set())
        if len(launched) > 1:
            proxy.restore()
        return launch(*args, **kwargs)

    monkeypatch.setattr(flow_module, "run_child", back_for_the_next_worker)
    try:
        use_endpoint(monkeypatch, proxy.endpoint, AWS_MAX_ATTEMPTS="2")  # botocore: one retry, not four
        result = flow_module.precompute_flow(config)
    finally:
        proxy.cut()
    assert launched == [False, True] and result["attempt"] == 2, result  # it verified every shard and _complete
    assert 0 < result["written"] <= result["shards"] - 2, result  # the second worker did not redo the first's


def test_the_store_unreachable_mid_pass_is_one_line_and_a_rerun_resumes(bucket: Bucket, make_config,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kdflow.schemas.errors import StoreError
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.teacher.precompute import precompute_shards

    # In one process the lease the failed pass could not release belongs to a live pid: it lapses after its ttl.
    config = make_config(run_root=bucket.run_root, dataset__max_documents=20, precompute__lease_ttl_s=3)
    prepare(config)
    proxy = TcpProxy(bucket.moto.port)
    proxy.cut_after = (re.compile(rb"PUT /\S+/topk/\S+\.commit\.json"), 2)  # cut once two shards are committed
    try:
        use_endpoint(monkeypatch, proxy.endpoint, AWS_MAX_ATTEMPTS="2")  # botocore: one retry, not four
        with pytest.raises(StoreError) as failed:
            precompute_shards(open_run_root(config), teacher_pass_settings(config))
        message = str(failed.value)
        assert "\n" not in message and f"s3://{bucket.name}/run/topk/" in message and "unreachable" in message, message
        assert exit_code_for(failed.value) == EXIT_STORE_UNREACHABLE  # a worker meeting it is retried by the flow
        use_endpoint(monkeypatch, bucket.moto.endpoint)
        run_root = RunRoot(bucket.run_root)
        (tag,) = run_root.listdir(run_root.path("topk"))
        committed = sorted(list_commits(run_root, stage_dir(run_root, "topk", tag), "topk", tag))
        assert len(committed) >= 2

        proxy.restore()
        use_endpoint(monkeypatch, proxy.endpoint)
        result = precompute_shards(open_run_root(config), teacher_pass_settings(config))
        assert result["complete"] and result["skipped"] == len(committed)  # nothing committed was computed again
        assert result["written"] == result["shards"] - len(committed) > 0
    finally:
        proxy.cut()
