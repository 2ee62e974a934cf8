"""Progress for long stages: a terminal bar plus periodic log lines with rate and ETA (no Prefect here).

Flows pass `on_update` to forward the same numbers to a Prefect progress artifact. Inside a long unit (a
teacher shard is minutes of GPU time) `partial` reports how far the current unit is, so the numbers move
between units too.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

logger = logging.getLogger("kdflow")


def count_of(number: int, noun: str) -> str:
    """`1 part`, `1,024 parts`: a count for a line people read, the noun in the number it takes (plain -s plural)."""
    return f"{number:,} {noun}" + ("" if number == 1 else "s")


def format_duration(seconds: float | None) -> str:
    """Seconds as h:mm:ss (3725.2 -> '1:02:05'); '?' when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class Progress:
    """Counts units (shards, steps) and tokens; logs tokens/s and ETA at most every `log_every_s` seconds.

    `context`: fixed fields added to every update (the store's tag, the shard range), for the flow's artifact."""

    def __init__(self, stage: str, total: int | None, unit: str = "shard", *, log_every_s: float = 30.0,
                 on_update: Callable[[dict], None] | None = None, context: dict[str, Any] | None = None,
                 partial_every_s: float = 5.0) -> None:
        self.stage, self.total, self.unit = stage, total, unit
        self.done = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self._last_log = self.started
        self.log_every_s, self.partial_every_s = log_every_s, partial_every_s
        self.on_update = on_update
        self.context = dict(context or {})
        self._partial: tuple[int, int, int] | None = None  # (rows done, rows, tokens done) of the unit in progress
        self._last_partial = float("-inf")
        self.bar = tqdm(total=total, desc=stage, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True,
                        disable=None)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def rate(self) -> float:
        """Tokens per second, counting the unit in progress."""
        return (self.tokens + (self._partial or (0, 0, 0))[2]) / max(self.elapsed, 1e-9)

    def fraction_done(self) -> float:
        """Units done, counting the unit in progress by its rows."""
        rows_done, rows, _ = self._partial or (0, 0, 0)
        return self.done + (rows_done / rows if rows else 0.0)

    def eta_s(self) -> float | None:
        done = self.fraction_done()
        if not self.total or not done:
            return None
        return self.elapsed / done * max(self.total - done, 0)

    def start(self) -> None:
        """Report that work began (nothing done yet), so that a view of it exists before the first unit ends."""
        self._publish({})

    def partial(self, rows_done: int, rows: int, unit_id: int | None = None, tokens: int = 0) -> None:
        """Inside a unit: `rows_done` of its `rows` (`tokens` of them); reported at most every `partial_every_s` s."""
        self._partial = (rows_done, rows, tokens)
        now = time.perf_counter()
        if now - self._last_partial < self.partial_every_s and rows_done < rows:
            return
        self._last_partial = now
        current = {"current": unit_id, "current_rows_done": rows_done, "current_rows": rows}
        if now - self._last_log >= self.log_every_s:
            self._last_log = now
            logger.info("%s: %s %s: %s/%s rows; %d/%s %ss done, %.0f tok/s, ETA %s", self.stage, self.unit,
                        unit_id if unit_id is not None else "?", f"{rows_done:,}", f"{rows:,}", self.done,
                        self.total or "?", self.unit, self.rate(), format_duration(self.eta_s()))
        self._publish(current)

    def update(self, units: int = 1, tokens: int = 0, **extra: float) -> None:
        self.done += units
        self.tokens += tokens
        self._partial = None
        self.bar.update(units)
        self.bar.set_postfix(tok_s=f"{self.rate():,.0f}", **{k: f"{v:.4g}" for k, v in extra.items()}, refresh=False)
        now = time.perf_counter()
        if now - self._last_log >= self.log_every_s or (self.total is not None and self.done >= self.total):
            self._last_log = now
            eta = self.eta_s()
            logger.info("%s: %d/%s %ss, %s tokens, %.0f tok/s%s%s", self.stage, self.done, self.total or "?", self.unit,
                        f"{self.tokens:,}", self.rate(), f", ETA {format_duration(eta)}" if eta is not None else "",
                        "".join(f", {k} {v:.4g}" for k, v in extra.items()))
        self._publish(extra)

    def _publish(self, extra: dict[str, Any]) -> None:
        if self.on_update:
            self.on_update({**self.context, "stage": self.stage, "done": self.done, "total": self.total,
                            "fraction_done": self.fraction_done(), "tokens": self.tokens, "tokens_per_s": self.rate(),
                            "eta_s": self.eta_s(), **extra})

    def close(self) -> None:
        self.bar.close()
