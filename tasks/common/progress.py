"""Progress for long stages: a terminal bar plus periodic log lines with rate and ETA (no Prefect here).

Flows pass `on_update` to forward the same numbers to a Prefect progress artifact.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from tqdm.auto import tqdm

logger = logging.getLogger("kdflow")


class Progress:
    """Counts units (shards, steps) and tokens; logs tokens/s and ETA at most every `log_every_s` seconds."""

    def __init__(self, stage: str, total: int | None, unit: str = "shard", *, log_every_s: float = 30.0,
                 on_update: Callable[[dict], None] | None = None) -> None:
        self.stage, self.total, self.unit = stage, total, unit
        self.done = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self._last_log = self.started
        self.log_every_s = log_every_s
        self.on_update = on_update
        self.bar = tqdm(total=total, desc=stage, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True,
                        disable=None)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def rate(self) -> float:
        return self.tokens / max(self.elapsed, 1e-9)

    def eta_s(self) -> float | None:
        if not self.total or not self.done:
            return None
        return self.elapsed / self.done * max(self.total - self.done, 0)

    def update(self, units: int = 1, tokens: int = 0, **extra: float) -> None:
        self.done += units
        self.tokens += tokens
        self.bar.update(units)
        self.bar.set_postfix(tok_s=f"{self.rate():,.0f}", **{k: f"{v:.4g}" for k, v in extra.items()}, refresh=False)
        now = time.perf_counter()
        if now - self._last_log >= self.log_every_s or (self.total is not None and self.done >= self.total):
            self._last_log = now
            eta = self.eta_s()
            logger.info("%s: %d/%s %ss, %s tokens, %.0f tok/s%s%s", self.stage, self.done, self.total or "?", self.unit,
                        f"{self.tokens:,}", self.rate(), f", ETA {eta:.0f} s" if eta is not None else "",
                        "".join(f", {k} {v:.4g}" for k, v in extra.items()))
        if self.on_update:
            self.on_update({"stage": self.stage, "done": self.done, "total": self.total, "tokens": self.tokens,
                            "tokens_per_s": self.rate(), "eta_s": self.eta_s(), **extra})

    def close(self) -> None:
        self.bar.close()
