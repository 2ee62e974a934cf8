"""Flow `pipeline`: every stage in order, each one a subflow that skips what is already committed."""

from __future__ import annotations

from typing import Any

from prefect import flow

from kdflow.flows.common import as_config
from kdflow.flows.materialise import materialise_flow
from kdflow.flows.tokenise import tokenise_flow
from kdflow.schemas.config import STAGES, KDFlowConfig
from kdflow.schemas.errors import ConfigError


@flow(name="pipeline", log_prints=True)
def pipeline_flow(config: KDFlowConfig, stages: list[str] | None = None) -> dict[str, Any]:
    config = as_config(config)
    chosen = list(stages or STAGES)
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown stage {unknown[0]!r}; stages are {', '.join(STAGES)}")
    results: dict[str, Any] = {}
    if "materialise" in chosen:
        results["materialise"] = materialise_flow(config)
    if "tokenise" in chosen:
        results["tokenise"] = tokenise_flow(config)
    if "precompute" in chosen:
        from kdflow.flows.precompute import precompute_flow

        results["precompute"] = precompute_flow(config)
    if "train" in chosen:
        from kdflow.flows.train import train_student_flow

        results["train"] = train_student_flow(config)
    return results
