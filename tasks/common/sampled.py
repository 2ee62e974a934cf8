"""Sampled teacher targets, as both sides see them: an exact top-H head plus S tokens sampled outside it.

Per position (docs/formats.md and docs/loss.md, "Sampled targets"):
- `head_ids` (H,), `head_logprobs` (H,): the H largest teacher log-probabilities (normalised over the full
  vocabulary), by descending value, ties to the lower id;
- `tail_logprob`: log of the teacher's exact mass outside the head (a log-sum-exp at capture, never
  `1 - sum`); 0 when H = 0;
- `sample_ids` (S,), `sample_logprobs` (S,): S distinct ids outside the head, drawn by order sampling: every
  id j gets a key z_j + noise_j and the S largest tail keys are the sample;
- `log_threshold`: the (S+1)-th largest tail key minus the full log-sum-exp (log tau); -inf when the tail
  has no more than S tokens (then every tail token is in the sample).

Given the other tail keys, a tail token is in the sample exactly when its key beats the S-th largest of
them, which is then the stored threshold; so its inclusion probability is known:
    priority (noise -log u, Duffield-Lund-Thorup priority sampling): pi = min(1, p / tau)
    gumbel   (noise -log(-log u), sampling without replacement):      pi = 1 - exp(-p / tau)
and the Horvitz-Thompson weights w = p / pi give E[sum over the sample of w_s f_s] = sum over the tail of
p_j f_j for any f fixed before the draw. The teacher side (`kdflow.tasks.teacher.sampling`) draws them,
the student side (`kdflow.tasks.student.sampled_loss`) turns them into an unbiased KL.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from kdflow.schemas.sampled_settings import SCHEMES

__all__ = ["TARGET_KINDS", "SampledTargets", "cat_targets", "ht_weights", "target_kind"]
TARGET_KINDS = ("topk", "sampled", "hybrid")


@dataclass(frozen=True)
class SampledTargets:
    """Sampled targets of N positions (or (B, T) positions: every field shares the leading shape)."""

    head_ids: Tensor  # (N, H) int32, descending log-prob, ties: lower id first
    head_logprobs: Tensor  # (N, H) float, log p over the full vocabulary
    tail_logprob: Tensor  # (N,) float32, log of the mass outside the head (0 when H == 0)
    sample_ids: Tensor  # (N, S) int32, distinct, outside the head
    sample_logprobs: Tensor  # (N, S) float, log p of the sampled ids
    log_threshold: Tensor  # (N,) float32, (S+1)-th tail key - lse; -inf: the whole tail is sampled

    @property
    def head(self) -> int:
        return self.head_ids.shape[-1]

    @property
    def samples(self) -> int:
        return self.sample_ids.shape[-1]

    @property
    def rows(self) -> int:
        return self.tail_logprob.shape[0]

    def map(self, fn) -> SampledTargets:  # noqa: ANN001 - a Tensor -> Tensor function
        """The same function applied to every field (slicing, index_select, .to(device), ...)."""
        return SampledTargets(*(fn(getattr(self, f.name)) for f in fields(self)))

    def flatten_positions(self) -> SampledTargets:
        """(B, T, ...) fields -> (B * T, ...)."""
        return self.map(lambda t: t.flatten(0, 1))

    def to(self, device: torch.device | str) -> SampledTargets:
        return self.map(lambda t: t.to(device, non_blocking=True))


def cat_targets(parts: list[SampledTargets]) -> SampledTargets:
    """Concatenate along the first dimension."""
    return SampledTargets(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(SampledTargets)))


def target_kind(targets: SampledTargets) -> str:
    """'hybrid' (exact top-H head + sampled tail) or 'sampled' (H = 0: the whole KL from samples)."""
    return "hybrid" if targets.head else "sampled"


def ht_weights(sample_logprobs: Tensor, log_threshold: Tensor, scheme: str) -> Tensor:
    """Horvitz-Thompson weights w = p / pi of sampled tokens: (..., S) log p and (...,) log tau -> (..., S).

    Computed in float64 and returned in sample_logprobs' dtype. A threshold of -inf means every tail token
    with p > 0 was sampled (pi = 1, w = p); p = 0 gives w = 0.
    """
    log_p = sample_logprobs.double()
    gap = log_p - log_threshold.double()[..., None]  # log(p / tau)
    if scheme == "priority":
        log_pi = gap.clamp(max=0.0)
    elif scheme == "gumbel":  # log(1 - exp(-exp(gap))), which is gap itself when gap is very negative
        log_pi = torch.where(gap < -30.0, gap, torch.log(-torch.expm1(-gap.clamp(max=30.0).exp())))
    else:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    exact = torch.isneginf(log_threshold.double())[..., None]
    weights = torch.where(exact, log_p, log_p - log_pi).exp()
    return torch.where(torch.isneginf(log_p), 0.0, weights).to(sample_logprobs.dtype)
