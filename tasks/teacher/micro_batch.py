"""Which micro-batch a teacher pass runs at: the config's, unless the GPU ran out of memory at it.

The flow retries a CUDA out-of-memory in a fresh process at half the micro-batch (flows/precompute.py). A pass
that stepped down records in each shard's commit record the micro-batch it ran at, the config's, and the device:
a later run of the same store on the same kind of device (a rerun after a GPU reset, the next scheduled run)
starts at the size that fitted instead of running out of memory again after loading the teacher. A changed
`precompute.micro_batch`, or another GPU, starts from the config again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kdflow.schemas.commits import CommitRecord

if TYPE_CHECKING:  # torch only where a device is named: `kdflow status` reads the records without it
    import torch


def device_label(device: torch.device) -> str:
    """What decides which micro-batch fits: a GPU's name and memory ("NVIDIA GeForce RTX 3090, 23.6 GiB"),
    else the device's type ("cpu")."""
    if device.type != "cuda":
        return device.type
    import torch

    properties = torch.cuda.get_device_properties(device)
    return f"{properties.name}, {properties.total_memory / 2**30:.1f} GiB"


def stepped_down(records: Iterable[CommitRecord], device: str, configured: int) -> CommitRecord | None:
    """The newest commit record of a shard computed on `device` at less than `configured` while the config said
    `configured` (so: after an out-of-memory at it), or None."""
    found = [record for record in records
             if getattr(record.extra, "device", None) == device
             and getattr(record.extra, "micro_batch_configured", None) == configured
             and (getattr(record.extra, "micro_batch", None) or configured) < configured]
    return max(found, key=lambda record: record.created_at, default=None)


def start_micro_batch(records: Iterable[CommitRecord], device: str, configured: int,
                      given: int | None = None) -> tuple[int, CommitRecord | None]:
    """-> (the micro-batch to run at, the record it was learned from or None). `given`: the flow's, after an
    out-of-memory in this run (it wins: it was halved from what ran)."""
    if given is not None:
        return given, None
    record = stepped_down(records, device, configured)
    return (record.extra.micro_batch, record) if record is not None else (configured, None)


def stepped_down_lines(records: Iterable[CommitRecord]) -> list[str]:
    """For `kdflow status`: per device whose shards ran at less than the config said, where a later run starts."""
    records = list(records)
    kinds = {(getattr(r.extra, "device", None), getattr(r.extra, "micro_batch_configured", None)) for r in records}
    lines = []
    for device, configured in sorted(kind for kind in kinds if None not in kind):
        record = stepped_down(records, device, configured)
        if record is not None:
            lines.append(f"micro-batch {record.extra.micro_batch} on {device}: the config's {configured} ran out of "
                         f"memory there; later runs there start at {record.extra.micro_batch}")
    return lines
