"""Which failures of a worker process are worth a retry in a fresh process: an exception -> its exit code.

A CUDA driver error ("device not ready", "unspecified launch failure", an ECC error...) leaves the CUDA
context of the process unusable, so the only retry that can work is a new process. The worker exits with
one code per kind of failure (the codes are the worker protocol's, `kdflow.schemas.protocol`); the flow
retries exactly the retryable ones and fails at once on a user error (bad config or input: the same input
would fail the same way). Pure functions on the exception's type and message: testable without a GPU.
"""

from __future__ import annotations

import errno

from kdflow.schemas.errors import KDFlowError, StoreUnreachable
from kdflow.schemas.protocol import (EXIT_CUDA_ECC, EXIT_CUDA_ERROR, EXIT_CUDA_ILLEGAL_ADDRESS,
                                     EXIT_CUDA_LAUNCH_FAILURE, EXIT_CUDA_NOT_READY, EXIT_CUDA_OOM, EXIT_NO_SPACE,
                                     EXIT_STORE_UNREACHABLE, EXIT_UNEXPECTED, EXIT_USER_ERROR)

# Most specific first: a message is matched against these in order (lower-cased).
_CUDA_PATTERNS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("device not ready", "cudaerrornotready", "cuda_error_not_ready"), EXIT_CUDA_NOT_READY),
    (("illegal memory access", "illegal address", "cudaerrorillegaladdress", "cuda_error_illegal_address"),
     EXIT_CUDA_ILLEGAL_ADDRESS),
    (("ecc error", "cudaerrorecc", "cuda_error_ecc"), EXIT_CUDA_ECC),
    (("launch failure", "cudaerrorlaunchfailure", "cuda_error_launch_failed"), EXIT_CUDA_LAUNCH_FAILURE),
    (("cuda out of memory", "cuda error: out of memory", "cudaerrormemoryallocation", "cuda_error_out_of_memory",
      "cublas_status_alloc_failed"),
     EXIT_CUDA_OOM),
)
_GENERIC_CUDA_MARKERS = ("cuda error", "cuda driver error", "cuda runtime error", "cudaerror", "cuda_error",
                         "cublas_status", "cudnn_status", "cudnn error", "nccl error", "cuda failure",
                         "nvml", "gpu is lost")
# Deterministic failures that merely surface as CUDA errors: the same input fails the same way again.
_NOT_RETRYABLE_CUDA = ("device-side assert",)


def exception_chain(error: BaseException) -> list[BaseException]:
    """The exception and its causes/contexts, outermost first (a driver error is often wrapped)."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def classify_message(message: str, type_name: str = "") -> int | None:
    """The CUDA exit code a message (and exception type name) points to, or None if it is not a CUDA error."""
    text = f"{type_name}: {message}".lower()
    if any(marker in text for marker in _NOT_RETRYABLE_CUDA):
        return None
    if "outofmemoryerror" in type_name.lower() and "cuda" in text:
        return EXIT_CUDA_OOM
    for markers, code in _CUDA_PATTERNS:
        if any(marker in text for marker in markers):
            return code
    if any(marker in text for marker in _GENERIC_CUDA_MARKERS):
        return EXIT_CUDA_ERROR
    return None


def exit_code_for(error: BaseException) -> int:
    """The worker's exit code for an exception that ended it."""
    chain = exception_chain(error)
    # First: a full disk is often reported as a user error ("run root cannot be written") with the OSError as
    # its context, and it is no fault of the config: freeing space and rerunning works.
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain):
        return EXIT_NO_SPACE
    if any(isinstance(e, StoreUnreachable) for e in chain):  # before KDFlowError: not the config's fault
        return EXIT_STORE_UNREACHABLE
    if any(isinstance(e, KDFlowError) for e in chain):
        return EXIT_USER_ERROR
    for item in chain:
        code = classify_message(str(item), type(item).__name__)
        if code is not None:
            return code
    return EXIT_UNEXPECTED

