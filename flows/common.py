"""What every flow shares: accepting the config in any form, and the pre-flight checks of a run started from a
deployment. Importing it (as every flow module does) forwards the `kdflow` logger into Prefect run logs
(kdflow.flows.logs)."""

from __future__ import annotations

import logging
from typing import Any

from kdflow.flows.logs import forward_kdflow_logs
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import config_from_dict, load_config
from kdflow.tasks.path_spellings import with_stored_spellings


forward_kdflow_logs()


def as_config(config: KDFlowConfig | dict[str, Any] | str) -> KDFlowConfig:
    """Flows take the typed config, a plain dict (deployment parameters) or a YAML path. A dataset or init_from spelt
    otherwise than the run root's stores spell the same files takes their spelling (tasks.path_spellings)."""
    if isinstance(config, str):
        config = load_config(config)
    elif not isinstance(config, KDFlowConfig):
        config = config_from_dict(config, source="flow parameter 'config'")
    config, notes = with_stored_spellings(config)
    for note in notes:
        logging.getLogger("kdflow").info("%s", note)
    return config


def preflight_when_deployed(config: KDFlowConfig, stages: list[str]) -> None:
    """The pre-flight checks that `kdflow run` makes before Prefect starts, for a flow run started from a
    deployment (the UI, `prefect deployment run`, a schedule, a trigger): a bad setting in a custom run then
    fails it within seconds, in one line, before any stage reads or writes, not hours in (a wrong `top_k`
    met at the teacher pass, after the whole corpus was tokenised). Subflows of a pipeline and runs of
    `kdflow run` were checked before they started, so they are not checked again."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    flow_run = context.flow_run if context is not None else None
    if flow_run is None or flow_run.deployment_id is None or flow_run.parent_task_run_id is not None:
        return
    from prefect import get_run_logger

    from kdflow.tasks.preflight import run_preflight

    logger = get_run_logger()
    for warning in run_preflight(config, stages):
        logger.warning("pre-flight: %s", warning)
    logger.info("pre-flight: the config checked for %s", ", ".join(stages))


