"""Contracts between whole stores: what made a top-K store (`_store.json`), its format and codec settings,
which stores a config may read, and the one check that top-K shard i was made from token shard i.

Precompute writes `_store.json` into every top-K store it makes; the student's data loader, the fan-out flow
and `kdflow validate` read it, and check alignment with `alignment_problem`, without loading a teacher.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kdflow.schemas.commits import CommitRecord, read_complete, stage_dir
from kdflow.schemas.config import PrecomputeConfig, TeacherConfig
from kdflow.schemas.config_io import same_local_folder
from kdflow.schemas.layout import STORE_FILE, TOPK_DIR, is_store_name
from kdflow.schemas.sampled_settings import sampled_format, sampled_label
from kdflow.schemas.storage import RunRoot


class TopkStoreInfo(BaseModel):
    """`topk/TAG/_store.json`: the inputs and settings that made the store (unknown keys are kept)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    tag: str
    teacher_fingerprint: str
    tokens_fingerprint: str
    teacher: dict[str, Any]  # the teacher config section, without `device` (which does not change the numbers)
    teacher_identity: dict[str, Any]  # weights, dtype, quantisation
    top_k: int
    logprobs_dtype: str
    seq_len: int
    format: str = "v1"  # stores written before v2 have no such key
    store: dict[str, Any] | None = None  # `store_format(precompute)` of the config that made it (None: v1, before v2)
    codec: dict[str, Any] | None = None  # v2: the codec's settings (TopkCodec.settings(), with the table's sha256)

    def store_format(self) -> dict[str, Any]:
        """What this store's format settings are, in the terms of `store_format(precompute)`."""
        return self.store if self.store is not None else {"format": "v1", "logprobs_dtype": self.logprobs_dtype}

    @property
    def filled_by(self) -> str:
        """What writes this store's missing shards: the teacher pass, or for an imported one the import again."""
        return "kdflow store import" if (self.model_extra or {}).get("imported") else "precompute"

    @property
    def tail_computed(self) -> bool:
        """An imported store whose source had no tail mass: the tail stored is log(1 - sum p) of the kept ids,
        which counts the teacher's rounding as mass outside them (`kdflow store import`)."""
        imported = (self.model_extra or {}).get("imported")
        return isinstance(imported, dict) and imported.get("tail") == "computed"

    @property
    def normalisation(self) -> str:
        """"full" (log-probs over the whole vocabulary, exact tail) or "top_k" (renormalised over the K ids, the
        teacher's tail unknown: trained with the renormalised-K loss), as the store's codec settings say."""
        return str((self.codec or {}).get("normalisation", "full"))

    @property
    def masked(self) -> bool:
        """Whether the store's rows carry a per-position target mask (codec kdflow.topk.v3 with masked)."""
        return bool((self.codec or {}).get("masked", False))

    @property
    def targets(self) -> str:
        """topk, or hybrid / sampled (then `store_format()["sampling"]` holds H, S, scheme, seed)."""
        return self.store_format().get("targets", "topk")


def store_format(precompute: PrecomputeConfig) -> dict[str, Any]:
    """The top-K store format the precompute section asks for: v1 {format, logprobs_dtype}, v2 the codec's
    parameters. In the store's fingerprint (v2), `_store.json`, and compared with the store before training on it."""
    pre, store = precompute, precompute.store
    if store.format == "v1":
        return {"format": "v1", "logprobs_dtype": pre.logprobs_dtype}
    settings = {"format": "v2", "codec": "kdflow.topk.v2", "values": store.values,
                "levels": store.levels if store.values == "sqrt" else None, "tail": store.tail,
                "keep_mass": store.keep_mass, "zstd_level": store.zstd_level, "renumbering": store.renumbering}
    return settings if pre.targets == "topk" else settings | sampled_format(pre)


def format_label(settings: dict[str, Any]) -> str:
    """A store format in one short phrase, for messages: "v1 float16", "v2 sqrt/400, tail float16, ..."."""
    if settings.get("targets", "topk") != "topk":
        return f"{sampled_label(settings)}, head {format_label({**settings, 'targets': 'topk'})}"
    if settings.get("format") != "v2":
        return f"v1 {settings.get('logprobs_dtype')}"
    values = f"sqrt/{settings['levels']}" if settings.get("values") == "sqrt" else settings.get("values")
    keep = f", keep_mass {settings['keep_mass']}" if settings.get("keep_mass") is not None else ""
    return (f"v2 {values}, tail {settings.get('tail')}{keep}, zstd {settings.get('zstd_level')}, "
            f"renumbering {settings.get('renumbering')}")


def trained_alike(made: dict[str, Any], asked: dict[str, Any]) -> bool:
    """Whether two store formats train the same way: equal but for the noise hash that drew a sampled store
    (`precompute.sampling.hash_version` says how samples are drawn, not how they are read)."""
    def reading(settings: dict[str, Any]) -> dict[str, Any]:
        sampling = settings.get("sampling")
        if not isinstance(sampling, dict):
            return settings
        return settings | {"sampling": {k: v for k, v in sampling.items() if k != "hash_version"}}

    return reading(made) == reading(asked)


def format_mismatch(info: TopkStoreInfo, precompute: PrecomputeConfig, shown: str) -> str | None:
    """The one-line reason a store may not be trained on with this precompute section, or None when the formats
    agree (`trained_alike`). A target mask and top-K normalisation are properties of an imported source, not of
    the config: they live in the codec settings, never in `store_format`, and are not compared here."""
    made, asked = info.store_format(), store_format(precompute)
    if trained_alike(made, asked):
        return None
    if made.get("targets", "topk") != asked.get("targets", "topk"):
        return (f"top-K store {shown} holds {format_label(made)} targets, the config asks for {format_label(asked)} "
                "(precompute.targets, precompute.sampling): the loss follows the config; set them to the store's")
    return (f"top-K store {shown} was made as {format_label(made)}, the config asks for {format_label(asked)} "
            "(precompute.store); set precompute.store to the store's settings, "
            "or run precompute to make the store asked for")


def teacher_section(teacher: TeacherConfig) -> dict[str, Any]:
    """The teacher settings a store records and is matched by."""
    return teacher.model_dump(mode="json", exclude={"device"})


def same_teacher_settings(recorded: dict[str, Any], now: dict[str, Any]) -> bool:
    """Two teacher sections alike, a local folder however it is spelt (`./teacher/`, `teacher`, its absolute path,
    a link to it) being one teacher: the store's tag already names the weights, not the path."""
    if {k: v for k, v in recorded.items() if k != "model"} != {k: v for k, v in now.items() if k != "model"}:
        return False
    before, after = str(recorded.get("model")), str(now.get("model"))
    return before == after or same_local_folder(before, after)


def write_store_info(run_root: RunRoot, store: str, info: TopkStoreInfo) -> None:
    run_root.write_bytes_atomic(f"{store}/{STORE_FILE}", info.model_dump_json(indent=1).encode())


def filled_by(info: TopkStoreInfo | None) -> str:
    """What writes a top-K store's missing shards (`TopkStoreInfo.filled_by`); the teacher pass where the store
    has no `_store.json` yet."""
    return info.filled_by if info is not None else "precompute"


def read_store_info(run_root: RunRoot, store: str) -> TopkStoreInfo | None:
    """The store's `_store.json`, or None when it has none (or an unreadable one: a store of another tool)."""
    try:
        return TopkStoreInfo.model_validate_json(run_root.read_bytes(f"{store}/{STORE_FILE}"))
    except (FileNotFoundError, ValidationError, ValueError):
        return None


def topk_tags(run_root: RunRoot) -> list[str]:
    """The names under topk/ that are stores (not hidden or bookkeeping entries)."""
    return [tag for tag in run_root.listdir(run_root.path(TOPK_DIR)) if is_store_name(tag)]


def find_topk_stores(run_root: RunRoot, teacher: TeacherConfig, precompute: PrecomputeConfig, *,
                     any_format: bool = False, to_train: bool = False) -> list[str]:
    """Tags of the top-K stores made for this teacher, K, token store and store format, read from their
    _store.json (no teacher loaded; with teacher.dtype auto, a CPU and a GPU host make two). `any_format`: also
    those made with other format settings (to name them in an error); `to_train`: also those that train alike
    (`trained_alike`: a sampled store drawn with another noise hash)."""
    tokens_done = read_complete(run_root, stage_dir(run_root, "tokens"))
    if tokens_done is None:
        return []
    made_by, wanted = teacher_section(teacher), store_format(precompute)
    tags = []
    for tag in topk_tags(run_root):
        info = read_store_info(run_root, stage_dir(run_root, "topk", tag))
        if (info is not None and info.tokens_fingerprint == tokens_done.fingerprint
                and same_teacher_settings(info.teacher, made_by)
                and info.top_k == precompute.top_k
                and (any_format or info.store_format() == wanted
                     or (to_train and trained_alike(info.store_format(), wanted)))):
            tags.append(tag)
    return tags


def tokens_made_from(records: Iterable[CommitRecord]) -> set[str]:
    """The fingerprints of the token stores a top-K store's shards were computed from, as their commit records say
    (none for records that do not say). A store whose set lacks today's token store is stale (status, validate)."""
    return {record.extra.tokens_fingerprint for record in records} - {None}


def alignment_problem(token: CommitRecord | None, topk: CommitRecord) -> str | None:
    """Why top-K shard i is not the teacher's output on token shard i (same input bytes, same rows), or None.

    The reason reads after "the top-K shard": "... was made from another token shard (...)"."""
    if token is None:
        return f"has no valid token shard {topk.shard_id} to align with"
    if topk.input_sha256 != token.sha256:
        return (f"was made from another token shard (input sha256 {str(topk.input_sha256)[:12]}, "
                f"token shard {token.shard_id} has {token.sha256[:12]})")
    if topk.rows != token.rows:
        return f"has {topk.rows} rows, token shard {token.shard_id} has {token.rows}"
    return None
