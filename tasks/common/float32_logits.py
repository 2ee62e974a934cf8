"""`teacher.lm_head_float32`: a 16-bit teacher's logits computed in float32 and never rounded to 16 bits.

Rounding logits to bf16 (8 significant bits) moves them by up to 2^-9 of their size: ~0.06 nats at a trained
teacher's top logits (~27). On the demo's trained teacher (SmolLM2-135M in bf16, real text) that cost 4.5e-4
nats of KL per position, 3.4x what the store's codec may cost (`kdflow bench logits-precision` measures it).

`Float32Logits` wraps the teacher's own 16-bit `nn.Linear` lm_head; its weight is not copied. On CUDA the one
16-bit matmul writes float32 (cuBLAS accumulates in float32 anyway: `torch.mm(..., out_dtype=torch.float32)`, no
extra memory, the same tensor-core matmul; the GPU check times it); on other devices, or a torch without that
overload, both operands are upcast a slab at a time. The teacher's slab loop (kdflow.tasks.teacher.slab, under the
chunked top-K and the sampler) takes the weight and this choice from it; calling the module gives the same float32
logits (`model(ids).logits`).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor, nn

# The dtypes whose logits `teacher.lm_head_float32` changes (loading and the teacher's identity ask this too).
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class Float32Logits(nn.Module):
    """A 16-bit `nn.Linear` lm_head whose output is float32 logits, never rounded to its dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if type(linear) is not nn.Linear or linear.weight.dtype not in SIXTEEN_BIT:
            raise TypeError(f"Float32Logits wraps a bf16/fp16 nn.Linear, not {type(linear).__name__} "
                            f"({getattr(getattr(linear, 'weight', None), 'dtype', None)})")
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> Tensor:
        return self.linear.weight

    @property
    def bias(self) -> Tensor | None:
        return self.linear.bias

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (..., H) -> float32 logits (..., V)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        return float32_logits(flat, self.linear.weight, self.linear.bias).view(*hidden.shape[:-1], -1)


def float32_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """hidden (c, H) @ weight (s, H).T (+ bias) as float32, from 16-bit or float32 operands: the 16-bit matmul
    with float32 output where the device has it, else both upcast. `out` (c, s) float32 is used on the upcast
    path (a reused buffer); the fast path returns a new tensor. Either result may be overwritten by the caller."""
    if hidden.dtype == weight.dtype and weight.dtype in SIXTEEN_BIT and float32_output_matmul(hidden.device):
        logits = torch.mm(hidden, weight.t(), torch.float32)
    else:
        hidden = hidden if hidden.dtype == torch.float32 else hidden.float()
        logits = torch.mm(hidden, weight.float().t(), out=out) if out is not None else hidden @ weight.float().t()
    if bias is not None:
        logits += bias.float()
    return logits


@lru_cache(maxsize=None)
def _probe(device_type: str, index: int | None) -> bool:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    one = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    try:
        result = torch.mm(one, one, torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return result.dtype == torch.float32 and float(result[0, 0]) == 2.0


def float32_output_matmul(device: torch.device) -> bool:
    """Whether this torch multiplies 16-bit matrices into float32 output on `device` (CUDA, torch >= 2.8 or so;
    not the CPU). Asked once per device."""
    return _probe(device.type, device.index)
