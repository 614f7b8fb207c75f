"""The precision that statistics, softmaxes and masks are computed in (docs/design.md,
"Numerics conventions").

"At least fp32" is the join of fp32 with the inputs' dtypes in torch's promotion lattice:

    at_least_fp32(fp16 | bf16 | fp32 inputs) = fp32,    at_least_fp32(any fp64 input) = fp64.

Half-precision activations (``--fp16``, ``--amp``, bf16 autocast) thus never carry a softmax,
a log-space product or a GMM statistic, and fp64 inputs keep their precision end to end, which
gradcheck and the float64 references of the tests need.
"""

import torch
from torch import Tensor


def at_least_fp32(*tensors: Tensor) -> torch.dtype:
    """The dtype an "fp32" computation on ``tensors`` runs in: fp32, or fp64 if any is fp64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype
