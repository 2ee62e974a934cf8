"""The teacher worker's protocol: exit-code classification (which failures the flow retries), fault specs that
fire once, and shard id lists."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from kdflow.schemas.errors import ConfigError, StoreError, StoreUnreachable
from kdflow.schemas.protocol import (EXIT_CUDA_ECC, EXIT_CUDA_ERROR, EXIT_CUDA_ILLEGAL_ADDRESS,
                                     EXIT_CUDA_LAUNCH_FAILURE, EXIT_CUDA_NOT_READY, EXIT_CUDA_OOM, EXIT_NO_SPACE,
                                     EXIT_STORE_UNREACHABLE, EXIT_UNEXPECTED, EXIT_USER_ERROR, RETRYABLE_EXIT_CODES,
                                     format_shard_ids, parse_shard_ids)
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common import faults
from kdflow.tasks.common.failures import exit_code_for



@pytest.mark.parametrize(("error", "code"), [
    (RuntimeError("CUDA driver error: device not ready"), EXIT_CUDA_NOT_READY),
    (RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors might be asynchronously reported"),
     EXIT_CUDA_LAUNCH_FAILURE),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), EXIT_CUDA_ILLEGAL_ADDRESS),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), EXIT_CUDA_ECC),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), EXIT_CUDA_OOM),
    (RuntimeError("CUDA error: out of memory"), EXIT_CUDA_OOM),
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"), EXIT_CUDA_ERROR),
    (RuntimeError("NCCL error: unhandled cuda error"), EXIT_CUDA_ERROR),
    (RuntimeError("CUDA error: device-side assert triggered"), EXIT_UNEXPECTED),  # the same input fails again
    (RuntimeError("DefaultCPUAllocator: can't allocate memory"), EXIT_UNEXPECTED),
    (ConfigError("precompute.top_k=500 is too large"), EXIT_USER_ERROR),
    (OSError(errno.ENOSPC, "No space left on device"), EXIT_NO_SPACE),
    (StoreUnreachable("s3://b/run/topk/x: the store is unreachable (Connection refused)"), EXIT_STORE_UNREACHABLE),
    (StoreError("s3://b/run: access denied (Forbidden)"), EXIT_USER_ERROR),
    (ValueError("a bug"), EXIT_UNEXPECTED),
])
def test_exit_code_classification(error: BaseException, code: int) -> None:
    assert exit_code_for(error) == code
    assert (code in RETRYABLE_EXIT_CODES) == (code >= 70 or code == EXIT_STORE_UNREACHABLE)


def test_a_wrapped_driver_error_is_still_retryable() -> None:
    try:
        try:
            raise RuntimeError("CUDA driver error: device not ready")
        except RuntimeError as inner:
            raise ValueError("the forward pass failed") from inner
    except ValueError as outer:
        assert exit_code_for(outer) == EXIT_CUDA_NOT_READY


def test_fault_specs_and_fire_once(tmp_path, monkeypatch) -> None:
    parsed = faults.parse_faults("cuda_error@shard=1,micro_batch=2; kill@micro_batch=0;enospc")
    assert [f.name for f in parsed] == ["cuda_error.micro_batch-2.shard-1", "kill.micro_batch-0", "enospc"]
    for bad in ("explode@shard=1", "kill@shard=x", "kill@row=1"):
        with pytest.raises(ConfigError, match="KDFLOW_FAULT"):
            faults.parse_faults(bad)
    run_root = RunRoot(str(tmp_path))
    monkeypatch.setenv("KDFLOW_FAULT", "cuda_error@shard=1")
    faults.maybe_fire("micro_batch", run_root, shard=0, micro_batch=0)  # another shard: nothing
    with pytest.raises(RuntimeError, match="CUDA driver error: device not ready"):
        faults.maybe_fire("micro_batch", run_root, shard=1, micro_batch=0)
    faults.maybe_fire("micro_batch", run_root, shard=1, micro_batch=0)  # fired once in this run root
    assert json.loads((tmp_path / "_faults" / "cuda_error.shard-1.fired").read_text())["pid"] == os.getpid()
    monkeypatch.setenv("KDFLOW_FAULT", "enospc@shard=2")
    with pytest.raises(OSError) as caught:
        faults.maybe_fire("write", run_root, shard=2, micro_batch=0)
    assert caught.value.errno == errno.ENOSPC


def test_shard_id_lists_round_trip() -> None:
    assert (parse_shard_ids("0,3,5") == [0, 3, 5] and parse_shard_ids("3-6") == [3, 4, 5, 6]
            and parse_shard_ids(None) is None)
    assert format_shard_ids([5, 0, 1, 2, 9, 10]) == "0-2,5,9-10"
    assert parse_shard_ids(format_shard_ids([0, 1, 2, 7])) == [0, 1, 2, 7]
    with pytest.raises(ValueError, match="--shards"):
        parse_shard_ids("3-x")
