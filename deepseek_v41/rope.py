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


def apply_rope(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cis.shape[-1]`` channels of x [b, n, (h,) d] by cis [n, rd/2] in fp32, round once."""
    rope_dim = 2 * cis.shape[-1]
    shape = [1, cis.shape[0]] + [1] * (x.dim() - 3) + [cis.shape[-1]]
    cis = cis.view(shape)
    if inverse:
        cis = cis.conj()
    tail = torch.view_as_complex(x[..., -rope_dim:].float().unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(tail * cis).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)
