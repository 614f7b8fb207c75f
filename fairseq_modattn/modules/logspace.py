"""Log-space matrix product: log sum_c exp(a_ic + b_jc) without an (i x j x c) tensor."""

import torch
from torch import Tensor

from .precision import at_least_fp32


def log_matmul_exp(log_a: Tensor, log_b: Tensor) -> Tensor:
    """log( exp(log_a) @ exp(log_b)^T ) for (..., I, C) and (..., J, C), in fp32.

    Each row is shifted by its max over c so that the matmul operands lie in [0, 1] with a 1
    in every row. Where every product underflows (rows that disagree beyond ~1e-38) the result
    is clamped at log(tiny) ~ -87 (plus the shifts) instead of -inf, keeping it finite.
    """
    with torch.autocast(device_type=log_a.device.type, enabled=False):
        dtype = at_least_fp32(log_a, log_b)  # fp64 stays fp64 (gradcheck)
        log_a, log_b = log_a.to(dtype), log_b.to(dtype)
        shift_a = log_a.amax(-1, keepdim=True)
        shift_b = log_b.amax(-1, keepdim=True)
        inner = torch.matmul((log_a - shift_a).exp(), (log_b - shift_b).exp().transpose(-1, -2))
        return inner.clamp_min(torch.finfo(dtype).tiny).log() + shift_a + shift_b.transpose(-1, -2)
