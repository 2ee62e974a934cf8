"""The manifest of a store: the table of its commit records (kdflow.schemas.commits), validated with pandera."""

from __future__ import annotations

import pandas as pd
import pandera.pandas as pa

from kdflow.schemas.commits import SHA256_PATTERN, CommitRecord, list_commits
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import Stage
from kdflow.schemas.storage import RunRoot


class ManifestModel(pa.DataFrameModel):
    """The table of a store's commit records."""

    shard_id: int = pa.Field(ge=0, unique=True)
    data_file: str = pa.Field(unique=True)
    rows: int = pa.Field(ge=0)
    tokens: int = pa.Field(ge=0)
    bytes: int = pa.Field(gt=0)
    sha256: str = pa.Field(str_matches=SHA256_PATTERN)
    input_sha256: str = pa.Field(nullable=True)
    fingerprint: str

    class Config:
        strict = "filter"
        coerce = True

    @pa.dataframe_check(error="a store holds shards of exactly one fingerprint")
    def one_fingerprint(cls, frame: pd.DataFrame) -> bool:
        return frame["fingerprint"].nunique() <= 1


def manifest_frame(records: dict[int, CommitRecord] | list[CommitRecord]) -> pd.DataFrame:
    rows = [r.model_dump(exclude={"extra"}) for r in (records.values() if isinstance(records, dict) else records)]
    columns = list(CommitRecord.model_fields)
    columns.remove("extra")
    return pd.DataFrame(rows, columns=columns).sort_values("shard_id", ignore_index=True)


def validate_manifest(frame: pd.DataFrame, stage: Stage, seq_len: int | None = None, name: str = "") -> pd.DataFrame:
    """Validate a manifest; token and top-K stores also need tokens == rows * seq_len on every shard."""
    label = name or stage
    try:
        validated = ManifestModel.validate(frame, lazy=True)
    except pa.errors.SchemaErrors as error:
        cases = error.failure_cases
        first = cases.iloc[0]
        # Frame-wide checks report the model's name as their column: name a column only when there is one.
        where = f" on column {first['column']}" if first["column"] in frame.columns else ""
        raise StoreError(f"manifest of {label} is invalid: {first['check']} failed{where} "
                         f"({len(cases)} failure(s))") from None
    if stage in ("tokens", "topk") and seq_len is not None and len(validated):
        bad = validated[validated["tokens"] != validated["rows"] * seq_len]
        if len(bad):
            raise StoreError(f"manifest of {label} is invalid: shard {int(bad['shard_id'].iloc[0])} "
                             "has tokens != rows x seq_len")
    if stage == "topk" and validated["input_sha256"].isna().any():
        raise StoreError(f"manifest of {label} is invalid: a top-K shard does not name its token shard")
    return validated


def load_manifest(run_root: RunRoot, store: str, stage: Stage, fingerprint: str | None = None,
                  seq_len: int | None = None) -> pd.DataFrame:
    return validate_manifest(manifest_frame(list_commits(run_root, store, stage, fingerprint)), stage, seq_len,
                             name=store)
