"""S3 for the tests that need it: the bucket that the `bucket` fixture makes (tests/conftest.py: moto's server, one
per test module, and a fresh bucket per test with this process's S3 clients pointed at it), and a run root there
prepared up to the token store."""

from __future__ import annotations

from dataclasses import dataclass

from support.s3_server import MotoProcess

from kdflow.schemas.config import KDFlowConfig


@dataclass
class Bucket:
    moto: MotoProcess
    name: str
    run_root: str  # s3://NAME/run

    def requests_since(self, mark: int) -> list[tuple[str, str, int]]:
        return [r for r in self.moto.requests()[mark:] if f"/{self.name}" in r[1]]


def prepare(config: KDFlowConfig) -> None:
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root, tokenise_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise

    materialise(open_run_root(config), materialise_settings(config))
    tokenise(open_run_root(config), tokenise_settings(config), load_tokenizer(config.teacher, config.tokenizer))
