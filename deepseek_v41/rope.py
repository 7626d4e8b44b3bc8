"""Text RoPE with YaRN (architecture.md §5.1): interleaved pairs on the last ``rope_dim`` channels.

Ratio-0 layers use ``rope_theta`` without YaRN; compressed layers use ``compress_rope_theta`` with YaRN.
No YaRN attention scale (mscale).  Angles are computed on the fly (no buffers), so a model built on the
meta device and materialized with ``to_empty`` has nothing to re-initialise.
"""

import math

import torch


def rope_frequencies(rope_dim: int, base: float, yarn: dict | None) -> torch.Tensor:
    """fp32 [rope_dim // 2] angular frequencies, YaRN-blended when ``yarn`` is given."""
    half = rope_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float32) * 2 / rope_dim))
    if yarn is None:
        return freqs
    factor = yarn["factor"]
    original = yarn["original_max_position_embeddings"]

    def correction(rotations):  # the pair index whose wavelength fits `rotations` turns in `original`
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction(yarn["beta_slow"])), rope_dim - 1)
    ramp = ((torch.arange(half, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def rope_cis(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """complex64 [n, rope_dim // 2] rotations e^{i·pos·f} for integer ``positions`` [n]."""
    angles = torch.outer(positions.to(torch.float32), freqs.to(positions.device))
    return torch.polar(torch.ones_like(angles), angles)


def _rotate_pairs(t: torch.Tensor, cos_sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    # t [b, n, (h,) rd] interleaved pairs, cos_sin fp32 [1, n, (1,) rd/2, 2] -> fp32 [b, n, (h,) rd]: the
    # complex product (re + i·im)(cos ± i·sin) per pair, in fp32
    pairs = t.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = cos_sin[..., 0], cos_sin[..., 1]
    if inverse:
        sin = -sin
    return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)


class _RotateTail(torch.autograd.Function):
    # x [b, n, (h,) d] -> the same with its last rd channels rotated in fp32 and rounded once.  Written into
    # one new tensor each way: autograd of slice + cat would zero-fill and add two full-size gradients per
    # call (q and the attention output are [b, s, 64, 512]: ~13 ms of a V4.1 proxy step on an H200).
    # The gradient of a rotation is the inverse rotation (the rounding passes the gradient straight through).
    @staticmethod
    def forward(ctx, x, cos_sin, inverse):
        ctx.save_for_backward(cos_sin)
        ctx.inverse = inverse
        return _RotateTail.apply_to(x, cos_sin, inverse)

    @staticmethod
    def backward(ctx, grad):
        (cos_sin,) = ctx.saved_tensors
        return _RotateTail.apply_to(grad, cos_sin, not ctx.inverse), None, None

    @staticmethod
    def apply_to(x, cos_sin, inverse):
        rope_dim = 2 * cos_sin.shape[-2]
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        out[..., :-rope_dim] = x[..., :-rope_dim]
        out[..., -rope_dim:] = _rotate_pairs(x[..., -rope_dim:], cos_sin, inverse)
        return out


def apply_rope(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cis.shape[-1]`` channels of x [b, n, (h,) d] by cis [n, rd/2] in fp32, round once."""
    shape = [1, cis.shape[0]] + [1] * (x.dim() - 3) + [cis.shape[-1], 2]
    return _RotateTail.apply(x, torch.view_as_real(cis).view(shape), inverse)
