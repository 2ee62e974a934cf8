"""One shard of the teacher pass, device -> host -> Arrow, overlapped: the results of a micro-batch copied to the
host once (pinned buffers on CUDA) and encoded into the open shard file by a background thread while the next
forward runs (kdflow.tasks.teacher.precompute uses both)."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kdflow.schemas.codec import TopkCodec, encode
from kdflow.schemas.shards import StreamShardWriter, topk_batch
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common import faults

WRITE_QUEUE_DEPTH = 2


class HostCopies:
    """Copies a micro-batch's results to the host once: on CUDA into a ring of pinned buffers, without blocking,
    on a copy stream of its own, so that the next micro-batch's forward runs while the copy does (an event
    tells the writer when the copy landed); on the CPU the results already are host tensors."""

    def __init__(self, device: torch.device, shape: tuple[int, int, int], logprobs_dtype: torch.dtype,
                 slots: int) -> None:
        self.on_cuda = device.type == "cuda"
        self.logprobs_dtype = logprobs_dtype
        self.free: queue.Queue[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = queue.Queue()
        self.stream = torch.cuda.Stream(device) if self.on_cuda else None
        for _ in range(slots if self.on_cuda else 0):
            self.free.put((torch.empty(shape, dtype=torch.int32, pin_memory=True),
                           torch.empty(shape, dtype=logprobs_dtype, pin_memory=True),
                           torch.empty(shape[:2], dtype=torch.float32, pin_memory=True)))

    def copy(self, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, tail_logprob: torch.Tensor
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any, Callable[[], None]]:
        """(rows, T, K), (rows, T, K), (rows, T) device tensors -> host arrays, a CUDA event (or None) and a
        release callback."""
        topk_logprobs = topk_logprobs.to(self.logprobs_dtype)  # on the device: halves the transfer for float16
        if not self.on_cuda:
            return topk_ids.numpy(), topk_logprobs.numpy(), tail_logprob.numpy(), None, lambda: None
        slot = self.free.get()
        rows = topk_ids.shape[0]
        host_ids, host_logprobs, host_tail = slot[0][:rows], slot[1][:rows], slot[2][:rows]
        self.stream.wait_stream(torch.cuda.current_stream(topk_ids.device))  # the copy starts once they are computed
        with torch.cuda.stream(self.stream):
            host_ids.copy_(topk_ids, non_blocking=True)
            host_logprobs.copy_(topk_logprobs, non_blocking=True)
            host_tail.copy_(tail_logprob, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # their memory is not reused before the copy stream is done
        for tensor in (topk_ids, topk_logprobs, tail_logprob):
            tensor.record_stream(self.stream)
        return host_ids.numpy(), host_logprobs.numpy(), host_tail.numpy(), event, lambda: self.free.put(slot)


class BackgroundWriter:
    """One thread encoding queued micro-batches (v2: `codec`) into an open shard file while the next forward runs."""

    def __init__(self, writer: StreamShardWriter, logprobs_dtype: str, run_root: RunRoot, shard_id: int,
                 codec: TopkCodec | None = None, encode_batch: Callable[..., Any] | None = None) -> None:
        self.writer, self.logprobs_dtype, self.run_root, self.shard_id = writer, logprobs_dtype, run_root, shard_id
        # None: v1
        self.encode_batch = encode_batch or (None if codec is None else lambda *arrays: encode(codec, *arrays))
        self.queue: queue.Queue[tuple | None] = queue.Queue(maxsize=WRITE_QUEUE_DEPTH)
        self.error: BaseException | None = None
        # Where a pass's time goes: seconds this thread spent encoding and writing (after the copy landed), and
        # seconds the producer spent blocked on it (a full queue, the drain at the end of the shard).
        self.busy_s = self.waited_s = 0.0
        self.thread = threading.Thread(target=self._run, name=f"topk-writer-{shard_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            arrays, ready, release, micro_batch = item
            try:
                if self.error is None:
                    if ready is not None:
                        ready.synchronize()
                    faults.maybe_fire("write", self.run_root, stage="precompute", shard=self.shard_id,
                                      micro_batch=micro_batch)
                    started = time.perf_counter()
                    if self.encode_batch is not None:
                        self.writer.write_batch(self.encode_batch(*arrays))
                    else:
                        self.writer.write(*topk_batch(*arrays[:2], self.logprobs_dtype))  # v1: no tail
                    self.busy_s += time.perf_counter() - started
            except BaseException as error:  # handed to the producer, which raises it
                self.error = error
            finally:
                release()
                self.queue.task_done()
        self.queue.task_done()

    def put(self, arrays: tuple[np.ndarray, ...], ready: Any, release: Callable[[], None], micro_batch: int) -> None:
        self._raise()
        started = time.perf_counter()
        self.queue.put((arrays, ready, release, micro_batch))
        self.waited_s += time.perf_counter() - started

    def drain(self, flush: bool = False) -> None:
        """Wait until every queued micro-batch is in the file (flushed to the OS if asked); raise its error."""
        started = time.perf_counter()
        self.queue.join()
        self.waited_s += time.perf_counter() - started
        self._raise()
        if flush:
            self.writer.sink.flush()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the thread. Bounded: after a driver failure a CUDA call in it may never return, and the worker
        must still exit (the daemon thread dies with the process)."""
        with contextlib.suppress(queue.Full):
            self.queue.put(None, timeout=timeout_s)
        self.thread.join(timeout_s)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
