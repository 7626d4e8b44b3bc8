"""Text RoPE with YaRN (architecture.md §5.1): interleaved pairs on the last ``rope_dim`` channels.

Ratio-0 layers use ``rope_theta`` without YaRN; compressed layers use ``compress_rope_theta`` with YaRN.
No YaRN attention scale (mscale).  Angles are computed on the fly (no buffers), so a model built on the
meta device and materialized with ``to_empty`` has nothing to re-initialise.
"""

import math

import torch

from .kernels_triton import rope_kernel_fits, rope_rotate, triton_usable


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


def _rotate(x: torch.Tensor, cos_sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    # x [b, n, (h,) d], cos_sin fp32 [n, rd/2, 2] -> x with its last rd channels (interleaved pairs) multiplied
    # by cos + i·sin in fp32 and rounded once to x's dtype: a new contiguous tensor, or x itself (inplace).
    # On CUDA one Triton pass (kernels_triton.rope_rotate, bit-identical): for q [1, 4096, 64, 512] eager
    # takes 0.55 ms on the H200 (clone + ~10 ops on the tail), a torch.compile'd version 0.44 ms with static
    # shapes (recompiling for each new shape) and 1.5 ms with dynamic ones; the kernel's 33 calls of a
    # 4096-token training step (in place on q, out of place on the attention output and the gradients) take
    # 1.9 ms together.
    rd = 2 * cos_sin.shape[-2]
    if triton_usable(x) and rope_kernel_fits(x, rd) and not torch.compiler.is_compiling():
        return rope_rotate(x, cos_sin, inplace)
    cs = cos_sin.view([1, cos_sin.shape[0]] + [1] * (x.dim() - 3) + list(cos_sin.shape[-2:]))
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = cs[..., 0], cs[..., 1]
    out = x if inplace else x.clone(memory_format=torch.contiguous_format)
    out[..., -rd:] = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
    return out


class _RotateTail(torch.autograd.Function):
    # Autograd of slice + cat would zero-fill and add two full-size gradients per call (q and the attention
    # output are [b, s, 64, 512]).  The gradient of a rotation is the inverse rotation, cos − i·sin (the
    # rounding passes the gradient straight through).  In place, only the rd-channel tail is read and written:
    # for an x that no other op saved for its backward (q straight from its projection).  head_dim: x's last
    # dim holds heads of that width, each rotated (so a projection's [b, s, h·d] output is rotated in place
    # as it is: rotating a [b, s, h, d] view of it in place would make autograd copy the whole gradient twice
    # and zero-fill one more, for the view's CopySlices / AsStrided backward)
    # grad_inplace: the incoming gradient is rotated in place (only its tail is read and written, an eighth of a
    # 512-wide head) instead of into a full copy; for a caller whose output's gradient reaches this node as a
    # buffer nothing else holds (see apply_rope)
    @staticmethod
    def forward(ctx, x, cos_sin, inplace, head_dim, grad_inplace):
        ctx.save_for_backward(cos_sin)
        ctx.head_dim, ctx.grad_inplace = head_dim, grad_inplace
        if inplace:
            ctx.mark_dirty(x)
        out = _rotate(_split_heads(x, head_dim), cos_sin, inplace)
        return x if inplace else out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        (cos_sin,) = ctx.saved_tensors
        in_place = ctx.grad_inplace and grad.is_contiguous()
        grad = grad.contiguous()
        out = _rotate(_split_heads(grad, ctx.head_dim), _conjugate(cos_sin), inplace=in_place)
        return out.view(grad.shape), None, None, None, None


def _split_heads(x: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    # [.., h·head_dim] -> [.., h, head_dim] (a view); None: x as it is
    return x if head_dim is None else x.view(*x.shape[:-1], -1, head_dim)


def _conjugate(cos_sin: torch.Tensor) -> torch.Tensor:
    # [..., 2] (cos, sin) -> (cos, −sin), exact; built on the device (a host constant would make a CUDA call wait)
    return torch.stack([cos_sin[..., 0], -cos_sin[..., 1]], dim=-1)


def apply_rope(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False, inplace: bool = False,
               head_dim: int | None = None, grad_inplace: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cis.shape[-1]`` channels of x [b, n, (h,) d] by cis [n, rd/2] in fp32, round once.

    ``head_dim``: x is [b, n, h·head_dim], and each head's tail is rotated.  ``inplace=True`` overwrites x's
    tails (x must be contiguous and not saved by another op for its backward; autograd raises if it was).
    ``grad_inplace=True`` rotates the output's gradient in place in the backward: only for an output whose
    gradient is a fresh buffer of one consumer's backward (a matmul's, the sparse attention's), never one
    that autograd may hand to another input too (an addition's backward passes one tensor to both sides)."""
    # x [b, n, (h,) d], cis complex [n, rd/2]
    cos_sin = torch.view_as_real(cis)  # fp32 [n, rd/2, 2]
    if inplace and not x.is_contiguous():
        raise ValueError("apply_rope(inplace=True) needs a contiguous x")
    if head_dim is not None and x.shape[-1] % head_dim:
        raise ValueError(f"apply_rope: the last dim ({x.shape[-1]}) is not a multiple of head_dim ({head_dim})")
    cos_sin = _conjugate(cos_sin) if inverse else cos_sin
    if not (torch.is_grad_enabled() and x.requires_grad):  # no backward: the rotation itself (what torch.compile traces)
        out = _rotate(_split_heads(x, head_dim), cos_sin, inplace)
        return x if inplace else out.view(x.shape)
    return _RotateTail.apply(x, cos_sin, inplace, head_dim, grad_inplace)
