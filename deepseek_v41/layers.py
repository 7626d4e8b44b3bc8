"""RMSNorm and Linear, built from the ``rms_norm`` / ``linear`` backend names.

Every backend keeps the parameter name ``weight`` and its dtype, so a checkpoint loads and saves the same
whichever backend computes it.
"""

import torch
from torch import nn

try:  # optional: the `te` backends (backends.check_available names it when missing)
    import transformer_engine.pytorch as te
except ImportError:
    te = None


class RMSNorm(nn.Module):
    """``torch_fp32`` (default): upcast, x·rsqrt(mean(x²)+eps)·w in fp32, one rounding to the input dtype.
    ``torch``: ``F.rms_norm`` in the input dtype (faster, rounds differently)."""

    def __init__(self, dim: int, eps: float, backend: str = "torch_fp32", dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps
        self.fp32 = backend == "torch_fp32"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., dim] -> [..., dim]
        if not self.fp32:
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def make_rms_norm(dim: int, eps: float, backend: dict, dtype=None) -> nn.Module:
    """``te``: Transformer Engine's fused RMSNorm, whose parameter is also ``weight``."""
    if backend["rms_norm"] == "te":
        return te.RMSNorm(dim, eps=eps, params_dtype=dtype or torch.get_default_dtype())
    return RMSNorm(dim, eps, backend["rms_norm"], dtype)


def make_linear(in_features: int, out_features: int, backend: dict, bias: bool = False, dtype=None) -> nn.Module:
    """``torch``: nn.Linear.  ``te``: Transformer Engine's Linear, whose parameter is also ``weight``."""
    if backend["linear"] == "te":
        return te.Linear(in_features, out_features, bias=bias, params_dtype=dtype or torch.get_default_dtype())
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
