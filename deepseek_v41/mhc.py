"""Manifold-constrained hyper-connections (mHC) with the V4.1 delayed pre-mix (architecture.md §7).

The residual is ``hc`` streams X [b, s, hc, d].  Each sublayer owns fp32 ``fn [(2+hc)*hc, hc*d]``,
``base [(2+hc)*hc]`` and ``scale [3]`` from which per-token coefficients are mixed:
``pre [hc]`` (collapse weights), ``post [hc]`` (how much of the sublayer output each stream takes) and
``comb [hc, hc]`` (a Sinkhorn-balanced stream-to-stream mix, indexed [source, destination]).
All coefficients stay fp32 end to end.
"""

import torch

from .layers import by_positions

# Without autograd (inference) the streams' reads and writes below go this many positions at a time: each makes a few
# fp32 copies of the streams [b, s, hc, d] (10 GiB each at 128k tokens on one row), which a long prefill cannot hold
MHC_POSITIONS = 16384


def hc_mix_logits(x, fn, norm_eps: float) -> torch.Tensor:
    # x [b, s, hc, d] -> fp32 [b, s, (2+hc)*hc]: the streams, RMS-normalised as one hc·d vector, times fn
    return by_positions(lambda x: _hc_mix_logits(x, fn, norm_eps), x, block=MHC_POSITIONS)


def _hc_mix_logits(x, fn, norm_eps: float) -> torch.Tensor:
    flat = x.flatten(-2).float()
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return torch.nn.functional.linear(flat, fn.float()) * inv_rms


def hc_mix(x, fn, base, scale, hc: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    # x [b, s, hc, d] -> pre [b, s, hc], post [b, s, hc], comb [b, s, hc(src), hc(dst)], all fp32
    return hc_split_sinkhorn(hc_mix_logits(x, fn, norm_eps), scale, base, hc, sinkhorn_iters, hc_eps)


def hc_split_sinkhorn(mixes, scale, base, hc: int, sinkhorn_iters: int, eps: float):
    # mixes fp32 [..., (2+hc)*hc] -> pre [..., hc] (not normalised), post [..., hc] in (0, 2),
    # comb [..., hc, hc]: Sinkhorn-balanced, ending on a column normalisation.  On CUDA without autograd (inference,
    # a decode step) one Triton kernel instead of ~120 small ones (6 per round); Inductor fuses the eager form itself
    if sinkhorn_fusable(mixes, scale, base, hc, sinkhorn_iters):
        from .kernels_triton import split_sinkhorn_triton

        return split_sinkhorn_triton(mixes, scale, base, hc, sinkhorn_iters, eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    # exp(x - max) / sum written out (the official rounding; torch.softmax's fused kernel differs by fp32 ulps, which
    # move ~1e-4 of the bf16 streams through hc_post)
    comb = torch.exp(comb - comb.amax(-1, keepdim=True).detach())
    comb = comb / comb.sum(-1, keepdim=True) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def sinkhorn_fusable(mixes, scale, base, hc: int, iters: int) -> bool:
    from .kernels_triton import inference_kernel_usable

    return iters >= 1 and hc & (hc - 1) == 0 and inference_kernel_usable(mixes, scale, base)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    # x [b, s, hc, d], pre [b, s, hc] -> [b, s, d]: weighted collapse in fp32, one rounding
    return by_positions(_hc_pre, x, pre, block=MHC_POSITIONS)


def _hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bsh,bshd->bsd", pre.float(), x.float()).to(x.dtype)


def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    # y [b, s, d], x [b, s, hc, d] -> [b, s, hc, d]: out_j = post_j * y + sum_i comb[i, j] * x_i
    # (its fp32 products [b, s, hc, hc, d] are hc stream copies: hc times fewer positions at a time)
    return by_positions(_hc_post, y, x, post, comb, block=MHC_POSITIONS // x.shape[2])


def _hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    # the stream mix rounded as the official rounds it: fp32 products summed over the source stream (an einsum's
    # GEMM fuses the multiply-adds in its own order, which moves ~1e-4 of the bf16 outputs by an ulp)
    mixed = (comb.float().unsqueeze(-1) * x.float().unsqueeze(-2)).sum(2)  # [b, s, hc(src), hc(dst), d] -> dst
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)


def hc_mix_pre(x, fn, base, scale, pre_in, hc: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    # x [b, s, hc, d], pre_in [b, s, hc] -> (pre, post, comb) of this sublayer's mix and its input
    # hc_pre(x, pre_in) [b, s, d]: the two reads of the streams at the head of a sublayer
    return (*hc_mix(x, fn, base, scale, hc, sinkhorn_iters, hc_eps, norm_eps), hc_pre(x, pre_in))


def mhc_ops(backend: dict) -> tuple:
    """``(hc_mix_pre, hc_pre, hc_post)`` for ``backend["mhc"]``: these eager fp32 functions (``torch``) or
    tile-kernels' fused CUDA kernels (``tile_kernels``, ``mhc_tile_kernels.py``)."""
    if backend["mhc"] == "tile_kernels":
        # "from .module import" (not "from . import module"): the form save_pretrained's file scan follows
        from .mhc_tile_kernels import hc_mix_pre as fused_mix_pre
        from .mhc_tile_kernels import hc_post as fused_post
        from .mhc_tile_kernels import hc_pre as fused_pre

        return fused_mix_pre, fused_pre, fused_post
    return hc_mix_pre, hc_pre, hc_post
