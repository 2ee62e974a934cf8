"""What every flow shares: accepting the config in any form, and writing it beside a stage's output. Importing
it (as every flow module does) forwards the `kdflow` logger into Prefect run logs (kdflow.flows.logs)."""

from __future__ import annotations

from typing import Any

from kdflow.flows.logs import forward_kdflow_logs
from kdflow.schemas.config import KDFlowConfig, config_from_dict, dump_config, load_config
from kdflow.schemas.layout import CONFIG_FILE
from kdflow.schemas.storage import RunRoot


forward_kdflow_logs()


def as_config(config: KDFlowConfig | dict[str, Any] | str) -> KDFlowConfig:
    """Flows take the typed config, a plain dict (deployment parameters) or a YAML path."""
    if isinstance(config, KDFlowConfig):
        return config
    if isinstance(config, str):
        return load_config(config)
    return config_from_dict(config, source="flow parameter 'config'")


def write_stage_config(run_root: RunRoot, config: KDFlowConfig, store: str) -> None:
    """The resolved config, beside the stage's output: what made these files, readable by people."""
    path, text = f"{store}/{CONFIG_FILE}", dump_config(config).encode()
    if not run_root.exists(path) or run_root.read_bytes(path) != text:  # a rerun touches no file
        run_root.write_bytes_atomic(path, text)
