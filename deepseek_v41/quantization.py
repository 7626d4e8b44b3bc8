"""Simulated quantize→dequantize boundaries of CSA2 (architecture.md §6), with straight-through gradients.

The forward rounds exactly as the official kernels do; the backward is the identity (project choice,
as NeMo's V4.1 port: DeepSeek defines no estimator).  The rounding is done in an autograd.Function,
not as ``x + (q - x).detach()``, because that sum re-rounds in bf16 and would not reproduce ``q``.

| boundary            | format | block (last dim) | scale                      |
|---------------------|--------|------------------|----------------------------|
| window KV           | FP8    | 32               | UE8M0 power of two         |
| compressed KV       | FP4    | 16               | E4M3 value                 |
| index keys/queries  | FP4    | 32               | UE8M0 power of two         |

Backend ``quant``: ``torch`` (the references below; on CUDA without autograd, e.g. a decode step, the same in one
Triton kernel each, ``kernels_triton.qdq_triton``, bit for bit) or ``tile_kernels`` (tile-kernels' fused
``per_token_cast_and_cast_back`` for the two UE8M0 boundaries, CUDA, bf16 inputs whose last dim is a multiple
of 64; bit-identical to the references; the E4M3-scale boundary keeps the reference, see ``quant_ops``).
"""

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    # x [..., n] -> fp32 [..., n // block, block]
    if x.shape[-1] % block:
        raise ValueError(f"quantization block {block} does not divide the last dimension {x.shape[-1]}")
    return x.float().unflatten(-1, (-1, block))


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    # UE8M0 scale: the smallest power of two with amax / scale <= qmax.
    return torch.exp2(torch.ceil(torch.log2(amax / qmax)))


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 level (±{0, .5, 1, 1.5, 2, 3, 4, 6}) of ``y`` in [-6, 6], ties to the even code.

    The levels are evenly spaced within [0, 2), [2, 4) and [4, 6] (steps .5, 1, 2), and in each range
    round-half-to-even of ``y / step`` lands on the even code, so three ``torch.round`` calls do it.
    """
    a = y.abs()
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(q, y)


def fp8_qdq_reference(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    xb = _blocks(x, block)
    scale = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=1e-4), FP8_MAX)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)


def fp4_qdq_reference(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    xb = _blocks(x, block)
    scale = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126), FP4_MAX)
    q = round_to_e2m1((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2).to(x.dtype)


def fp4_e4m3_scale_qdq_reference(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-9)
    scale = (amax / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    q = round_to_e2m1((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _one_kernel(x: torch.Tensor) -> bool:
    # on CUDA without autograd (inference, a decode step): the reference in one Triton kernel, bit for bit
    from .kernels_triton import inference_kernel_usable

    return inference_kernel_usable(x)


def fp8_qdq(x: torch.Tensor) -> torch.Tensor:
    """Window KV boundary: FP8 e4m3, blocks of 32, UE8M0 scales; identity backward."""
    if _one_kernel(x):
        from .kernels_triton import qdq_triton

        return qdq_triton(x, "fp8")
    return _StraightThrough.apply(x, fp8_qdq_reference)


def fp4_qdq(x: torch.Tensor) -> torch.Tensor:
    """Index query/key boundary: FP4 e2m1, blocks of 32, UE8M0 scales (MXFP4-like); identity backward."""
    if _one_kernel(x):
        from .kernels_triton import qdq_triton

        return qdq_triton(x, "fp4")
    return _StraightThrough.apply(x, fp4_qdq_reference)


def fp4_e4m3_scale_qdq(x: torch.Tensor) -> torch.Tensor:
    """Compressed KV boundary: FP4 e2m1, groups of 16, E4M3 value scales (NVFP4-like); identity backward."""
    if _one_kernel(x):
        from .kernels_triton import qdq_triton

        return qdq_triton(x, "fp4_e4m3_scale")
    return _StraightThrough.apply(x, fp4_e4m3_scale_qdq_reference)


def _tile_kernels_qdq(fmt: str, block: int, round_sf: bool, use_e4m3_sf: bool):
    try:  # in try: an optional GPU dependency that remote-code loading must not require
        from tile_kernels.quant import per_token_cast_and_cast_back
    except ImportError as error:
        raise RuntimeError("quant backend 'tile_kernels' needs the package tile_kernels") from error

    def qdq(x: torch.Tensor) -> torch.Tensor:
        # x [..., n] bf16 -> the same values rounded through the format, one fused kernel (on a copy: in place)
        if x.dtype != torch.bfloat16 or not x.is_cuda or x.shape[-1] % 64:
            raise ValueError(
                f"quant backend 'tile_kernels' needs bf16 CUDA inputs with a last dim that is a multiple of 64, got "
                f"{x.dtype} {tuple(x.shape)} on {x.device}; use quant backend 'torch'"
            )
        out = x.reshape(-1, x.shape[-1]).clone()
        per_token_cast_and_cast_back(out, fmt, block, round_sf=round_sf, use_e4m3_sf=use_e4m3_sf)
        return out.view_as(x)

    return qdq


def quant_ops(backend: dict) -> tuple:
    """``(fp8_qdq, fp4_qdq, fp4_e4m3_scale_qdq)`` for ``backend["quant"]``, each with an identity backward.

    ``tile_kernels`` runs the two power-of-two-scale boundaries fused; the E4M3-scale one (compressed KV)
    stays on the reference: tile-kernels' E4M3-scale cast-and-cast-back differs from it (and so from the
    official kernels, which the reference matches bit for bit) in ~0.02 % of values (435 of 2,097,152 on the
    H200 test).
    """
    if backend["quant"] != "tile_kernels":
        return fp8_qdq, fp4_qdq, fp4_e4m3_scale_qdq
    fp8 = _tile_kernels_qdq("e4m3", 32, round_sf=True, use_e4m3_sf=False)
    fp4 = _tile_kernels_qdq("e2m1", 32, round_sf=True, use_e4m3_sf=False)
    return (lambda x: _StraightThrough.apply(x, fp8)), (lambda x: _StraightThrough.apply(x, fp4)), fp4_e4m3_scale_qdq
