"""What pre-flight's checks share: the config, the stages being run, the warnings, things read once
(`Preflight`), and the shape of one check (`Check`).

It sits below the modules that hold checks (kdflow.tasks.preflight, kdflow.tasks.preflight_stores), so that
kdflow.tasks.preflight can list every check in one place, those of preflight_stores too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kdflow.schemas.config import STAGES, KDFlowConfig
from kdflow.schemas.errors import ConfigError, first_line
from kdflow.schemas.layout import COMPLETE_FILE

ALL_STAGES = frozenset(STAGES)


@dataclass
class Preflight:
    """What the checks share: the config, the stages being run, warnings, and things read once."""

    config: KDFlowConfig
    stages: frozenset[str]
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    @cached_property
    def run_root(self) -> Any:
        from kdflow.schemas.storage import RunRoot

        url = self.config.run_root
        try:
            return RunRoot(url)
        except ImportError as error:
            raise ConfigError(f"run_root={url!r} needs the package {error.name or 'for its protocol'}: "
                              "pip install 'kdflow[s3]' (or the fsspec filesystem for that URL)") from None
        except (ValueError, OSError) as error:
            raise ConfigError(f"run_root={url!r} cannot be opened: {first_line(error)}") from None

    def complete(self, *parts: str) -> dict[str, Any] | None:
        """A store's `_complete.json` (read as JSON: no pandera import), None if missing or unreadable."""
        run_root = self.run_root
        try:
            return json.loads(run_root.read_bytes(run_root.path(*parts, COMPLETE_FILE)))
        except Exception:  # noqa: BLE001 - missing, unreadable, or a store not reachable yet: the stage will tell
            return None

    @cached_property
    def teacher_shape(self) -> Any:
        from kdflow.tasks.common.model_configs import teacher_shape

        return teacher_shape(self.config.teacher)

    @property
    def tokenizer_from_teacher(self) -> bool:
        return self.config.tokenizer is None


@dataclass(frozen=True)
class Check:
    """One check of pre-flight's list (`CHECKS` in kdflow.tasks.preflight): its name, what it runs, and the stages
    it applies to (it runs when any of them is being run)."""

    name: str
    run: Callable[[Preflight], None]
    stages: frozenset[str] = ALL_STAGES


def chosen_stages(stages: list[str] | str | None) -> frozenset[str]:
    """`--stages` (a list or 'a,b') -> the stages; an unknown name is an error naming it."""
    names = [s.strip() for s in stages.split(",")] if isinstance(stages, str) else list(stages or STAGES)
    unknown = [s for s in names if s not in STAGES]
    if "" in unknown:  # `--stages ""`, or a stray comma: never the whole pipeline by accident
        raise ConfigError(f"--stages: an empty stage name in {','.join(names)!r}; stages are {', '.join(STAGES)}")
    if unknown:
        raise ConfigError(f"--stages: unknown stage {unknown[0]!r}; stages are {', '.join(STAGES)}")
    return frozenset(names)
