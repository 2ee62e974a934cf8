"""The teacher pass as Prefect artifacts: one progress bar per store (per shard range when fanned out), and the
fan-out coordinator's overall bar and table of ranges, all under stable keys and updated in place."""

from __future__ import annotations

from typing import Any

from kdflow.flows.artifacts import KeyedProgress, KeyedTable, artifact_key
from kdflow.schemas.config_hash import section_hash
from kdflow.schemas.protocol import format_shard_ids
from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import teacher_section
from kdflow.tasks.common.progress import format_duration


def precompute_key(run_root: RunRoot, settings: TeacherPassSettings,
                   shard_ids: list[int] | None = None) -> str:
    """`precompute-HASH` for the store this config makes (run root, teacher, K, dtype: known without loading the
    teacher, the same on every rerun), `precompute-HASH-shards-0-15` for one range of it."""
    store = section_hash(run_root.url, teacher_section(settings.teacher), settings.precompute.top_k,
                         settings.precompute.logprobs_dtype, settings.seq_len, length=10)
    return artifact_key("precompute", store, *(["shards", format_shard_ids(shard_ids)] if shard_ids else []))


def teacher_progress(update: dict[str, Any]) -> tuple[float, str]:
    """A worker's progress line -> (percent of the asked-for shards, one line for people)."""
    skipped, total = update.get("skipped", 0), update.get("total") or 0
    wanted = skipped + total
    if update.get("phase"):
        return (100.0 * skipped / wanted if wanted else 0.0,
                f"{update['phase']}: {total} shards to compute, {skipped} already committed")
    done = skipped + update.get("fraction_done", update.get("done", 0))
    text = f"{skipped + update.get('done', 0)}/{wanted} shards committed"
    if update.get("current") is not None:
        text += f"; shard {update['current']}: {update['current_rows_done']:,}/{update['current_rows']:,} rows"
    text += (f"; {update.get('tokens', 0):,} tokens at {update.get('tokens_per_s', 0):,.0f} tok/s; "
             f"ETA {format_duration(update.get('eta_s'))}")
    return (100.0 * done / wanted if wanted else 100.0), text


class TeacherProgress:
    """The worker's progress lines as the keyed progress artifact of its store (or shard range)."""

    def __init__(self, run_root: RunRoot, settings: TeacherPassSettings, shard_ids: list[int] | None) -> None:
        self.artifact = KeyedProgress(precompute_key(run_root, settings, shard_ids))

    def update(self, update: dict[str, Any]) -> None:
        percent, text = teacher_progress(update)
        self.artifact.set(percent, text, force=bool(update.get("phase")))


class FanOutBoard:
    """What the fan-out coordinator shows while it waits: overall progress (from each range run's own progress
    artifact, read by key) and a table of the ranges, their flow runs and states."""

    def __init__(self, run_root: RunRoot, settings: TeacherPassSettings, ranges: list[list[int]],
                 runs: list[Any]) -> None:
        self.ranges, self.runs = ranges, runs
        self.range_keys = [precompute_key(run_root, settings, part) for part in ranges]
        self.progress = KeyedProgress(precompute_key(run_root, settings), every_s=0.0)
        self.table = KeyedTable(precompute_key(run_root, settings) + "-ranges")

    def refresh(self, client: Any, states: dict[Any, Any], elapsed_s: float) -> None:
        """`states`: flow run id -> its latest state; reads the ranges' progress artifacts in one call."""
        try:
            from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

            latest = {a.key: a for a in client.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(
                key=ArtifactCollectionFilterKey(any_=self.range_keys)))}
        except Exception:  # noqa: BLE001 - without the ranges' bars, states alone still fill the table
            latest = {}
        rows, weighted, finished = [], 0.0, 0
        for part, run, key in zip(self.ranges, self.runs, self.range_keys):
            state = states.get(run.id)
            artifact = latest.get(key)
            percent = float(artifact.data) if artifact is not None and isinstance(artifact.data, (int, float)) else 0.0
            if state is not None and state.is_completed():
                percent, finished = 100.0, finished + 1
            weighted += percent * len(part)
            rows.append({"shards": format_shard_ids(part), "flow run": run.name,
                         "state": state.name if state is not None else "Scheduled", "progress": f"{percent:.0f}%",
                         "detail": (artifact.description or "") if artifact is not None else ""})
        overall = weighted / max(sum(len(part) for part in self.ranges), 1)
        eta = elapsed_s / overall * (100.0 - overall) if overall > 0 else None
        self.progress.set(overall, f"{finished}/{len(self.ranges)} shard ranges done, {overall:.0f}% of "
                                   f"{sum(len(part) for part in self.ranges)} shards; ETA {format_duration(eta)}")
        self.table.set(rows, f"{len(self.ranges)} shard ranges fanned out to the GPU pool")
