"""Dense references for the chunked teacher top-K: a random head and hidden states, the float64 top-K and tail."""

from __future__ import annotations

import torch
from torch import Tensor, nn

HIDDEN, VOCAB = 48, 512


def dense_reference(hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int) -> tuple[Tensor, Tensor]:
    """Top-k of the full-vocabulary log-softmax, computed in float64 from whatever precision the inputs have."""
    logits = hidden.double() @ weight.double().T  # (N, V)
    if bias is not None:
        logits = logits + bias.double()
    top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return top.indices, top.values


def dense_tail(log_softmax: Tensor, topk_ids: Tensor) -> Tensor:
    """float64 log of the mass outside the given ids: log-sum-exp over the complement of a full log-softmax (..., V)."""
    outside = log_softmax.scatter(-1, topk_ids.long(), float("-inf"))
    return outside.logsumexp(-1)


def random_head(seed: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.3)  # logits of std ~2: a peaked distribution, ties very unlikely
        if bias:
            head.bias.normal_(0.0, 1.0)
    return head


def random_hidden(n_tokens: int, seed: int = 1) -> Tensor:
    return torch.randn(n_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
