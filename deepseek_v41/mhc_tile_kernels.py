"""mHC on tile-kernels' fused CUDA kernels (backend ``mhc: tile_kernels``), forward and backward.

The same functions as ``mhc.py`` (``hc_mix_pre``, ``hc_pre``, ``hc_post``), with the per-token work done by
tile-kernels instead of chains of eager fp32 ops:

| here           | tile-kernels (``tile_kernels.mhc``)                                   | replaces in ``mhc.py``                     |
|----------------|-----------------------------------------------------------------------|--------------------------------------------|
| ``hc_mix_pre`` | ``mhc_pre_split_mixes_*``, ``mhc_sinkhorn_*``, ``mhc_pre_apply_mix_*`` | the split, the 20 Sinkhorn rounds, collapse |
| ``hc_pre``     | ``mhc_pre_apply_mix_{fwd,bwd}``                                       | the fp32 einsum collapse                   |
| ``hc_post``    | ``mhc_post_{fwd,bwd}``                                                | the fp32 einsum mix + ``post · y``         |

The mix GEMM of ``hc_mix_pre`` (streams · ``fn`` with the RMS factor) stays in PyTorch, as tile-kernels leaves
it to DeepGEMM; here it is an fp32-accurate GEMM on bf16 tensor cores (``hc_mix_logits_bf16x3``).
Coefficients stay fp32; streams and sublayer outputs are bf16, which the
kernels require (their hidden size must also be a multiple of 128).  tile-kernels' defaults are not V4's:
the post multiplier 2.0 and the Sinkhorn round count are passed explicitly.
"""

import torch

try:  # optional GPU dependency (backends.check_available names it); in try so remote-code loading never needs it
    from tile_kernels import mhc as tkm
except ImportError:
    tkm = None

from .kernels_triton import mix_dx_triton, triton_usable
from .layers import mm_bf16x3

POST_MULT = 2.0  # post = 2 · sigmoid(...)


def _check_streams(x: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16 or not x.is_cuda:
        raise TypeError(
            f"mhc backend 'tile_kernels' needs bf16 CUDA streams, got {x.dtype} on {x.device}; "
            "load the model in bfloat16 on a GPU or use mhc backend 'torch'"
        )
    if x.shape[-1] % 128:
        raise ValueError(
            f"mhc backend 'tile_kernels' needs a hidden size that is a multiple of 128, got {x.shape[-1]}; "
            "use mhc backend 'torch'"
        )


class _SplitSinkhorn(torch.autograd.Function):
    # mixes fp32 [n, (2+hc)·hc] -> pre [n, hc], post [n, hc], comb [n, hc, hc]
    @staticmethod
    def forward(ctx, mixes, scale, base, hc, iters, eps):
        n = mixes.shape[0]
        pre = mixes.new_empty(n, hc)
        post = mixes.new_empty(n, hc)
        logits = mixes.new_empty(n, hc * hc)  # comb before the Sinkhorn rounds
        tkm.mhc_pre_split_mixes_fwd(mixes, scale, base, pre, post, logits, POST_MULT, eps)
        comb = mixes.new_empty(n, hc, hc)
        tkm.mhc_sinkhorn_fwd(logits.view(n, hc, hc), comb, iters, eps)
        ctx.save_for_backward(mixes, scale, base, post, logits)
        ctx.hc, ctx.iters, ctx.eps = hc, iters, eps
        return pre, post, comb

    @staticmethod
    def backward(ctx, d_pre, d_post, d_comb):
        mixes, scale, base, post, logits = ctx.saved_tensors
        n, hc = mixes.shape[0], ctx.hc
        d_pre = torch.zeros_like(post) if d_pre is None else d_pre.contiguous()
        d_post = torch.zeros_like(post) if d_post is None else d_post.contiguous()
        d_comb = mixes.new_zeros(n, hc, hc) if d_comb is None else d_comb.contiguous()
        d_logits = torch.empty_like(d_comb)
        tkm.mhc_sinkhorn_bwd(d_comb, logits.view(n, hc, hc), d_logits, ctx.iters, ctx.eps)
        d_mixes, d_scale, d_base = torch.empty_like(mixes), torch.empty_like(scale), torch.empty_like(base)
        tkm.mhc_pre_split_mixes_bwd(
            d_pre, d_post, d_logits.view(n, hc * hc), mixes, post, scale, base, d_mixes, d_scale, d_base, POST_MULT
        )
        return d_mixes, d_scale, d_base, None, None, None


class _PreApplyMix(torch.autograd.Function):
    # x bf16 [n, hc, d], pre fp32 [n, hc] -> bf16 [n, d]
    @staticmethod
    def forward(ctx, x, pre):
        out = x.new_empty(x.shape[0], x.shape[2])
        tkm.mhc_pre_apply_mix_fwd(x, pre, out)
        ctx.save_for_backward(x, pre)
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, pre = ctx.saved_tensors
        d_x = torch.zeros_like(x)  # the kernel accumulates into it
        d_pre = tkm.mhc_pre_apply_mix_bwd(d_out.contiguous(), x, pre, d_x)
        return d_x, d_pre


class _Post(torch.autograd.Function):
    # y bf16 [b, s, d], x bf16 [b, s, hc, d], post fp32 [b, s, hc, 1], comb fp32 [b, s, hc, hc] -> bf16 [b, s, hc, d]
    @staticmethod
    def forward(ctx, y, x, post, comb):
        ctx.save_for_backward(y, x, post, comb)
        return tkm.mhc_post_fwd(y, x, post, comb)

    @staticmethod
    def backward(ctx, d_out):
        y, x, post, comb = ctx.saved_tensors
        grads = tkm.mhc_post_bwd(y, x, post, comb, d_out.contiguous())
        return tuple(g.to(t.dtype) for g, t in zip(grads, (y, x, post, comb)))


class _MixLogitsBf16x3(torch.autograd.Function):
    # x bf16 [m, hc, d], fn fp32 [N, hc·d] -> fp32 [m, N] = (x · fnᵀ) · r with r = rsqrt(mean(x²) + eps) per row
    # (x as [m, hc·d]).  The GEMMs run on bf16 tensor cores (mm_bf16x3; x is exact in bf16, so two products), the
    # mean square is reduced from bf16 in fp32, and dx is formed in fp32 and rounded to bf16 once (on CUDA by one
    # Triton pass, kernels_triton.mix_dx_triton: its 24-long inner dimension is too short for tensor cores).
    # With pre fp32 [m, hc] it also returns the collapse Σ_h pre_h·x_h bf16 [m, d] (tile-kernels'
    # mhc_pre_apply_mix), the sublayer input read from the same streams: its backward adds pre·grad into the
    # mix's dx in place (the kernel accumulates), so the streams get one gradient for both uses, without the
    # zero-filled buffer and the separate add of the two that autograd would need (~0.7 ms a sublayer at
    # 16384 tokens on the H200).
    @staticmethod
    def forward(ctx, x, fn, eps, pre):
        m, hc, d = x.shape
        flat = x.view(m, hc * d)
        r = torch.rsqrt(torch.linalg.vector_norm(flat, dim=-1, keepdim=True, dtype=torch.float32).square() / (hc * d) + eps)
        y = mm_bf16x3(flat, fn.t())
        ctx.save_for_backward(x, fn, r, y, pre)
        ctx.set_materialize_grads(False)
        if pre is None:
            return y * r
        collapsed = x.new_empty(m, d)
        tkm.mhc_pre_apply_mix_fwd(x, pre, collapsed)
        return y * r, collapsed

    @staticmethod
    def backward(ctx, grad, d_collapsed=None):
        x, fn, r, y, pre = ctx.saved_tensors
        m, hc, d = x.shape
        flat = x.view(m, hc * d)
        dx = d_fn = d_pre = None
        if grad is not None:
            g_y = grad * r  # [m, N]
            # d(y·r)/dx = g_y · fn + (Σ_n grad·y) · dr/dx, dr/dx = −r³ x / K
            coef = (grad * y).sum(-1, keepdim=True) * r.pow(3) / (hc * d)  # [m, 1]
            if triton_usable(x):  # one pass: the 24-wide product in fp32 and the RMS term, rounded once
                dx = mix_dx_triton(g_y, fn, coef, flat)
            else:  # fp32 a [m, K] − coef · x in fp32, rounded once to x's dtype
                dx = torch.addcmul(mm_bf16x3(g_y, fn), coef, flat.float(), value=-1.0).to(x.dtype)
            d_fn = mm_bf16x3(g_y.t(), flat) if ctx.needs_input_grad[1] else None
        if d_collapsed is not None:
            dx = torch.zeros_like(flat) if dx is None else dx
            d_pre = tkm.mhc_pre_apply_mix_bwd(d_collapsed.contiguous(), x, pre, dx.view(m, hc, d))  # dx += pre·grad
        return None if dx is None else dx.view(m, hc, d), d_fn, None, d_pre


def hc_mix_logits_bf16x3(x, fn, norm_eps: float) -> torch.Tensor:
    """``mhc.hc_mix_logits`` for bf16 streams x [b, s, hc, d] -> fp32 [b, s, (2+hc)·hc], on bf16 tensor cores
    with fp32 accuracy and no fp32 copy of the streams (eager, that copy and its passes cost more than the GEMM)."""
    out = _MixLogitsBf16x3.apply(x.reshape(-1, *x.shape[-2:]), fn.float(), norm_eps, None)
    return out.view(*x.shape[:-2], fn.shape[0])


def hc_mix_pre(x, fn, base, scale, pre_in, hc: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """``mhc.hc_mix_pre`` on tile-kernels: x [b, s, hc, d] bf16, pre_in [b, s, hc] -> (pre, post, comb) of this
    sublayer's mix, all fp32, and the sublayer input hc_pre(x, pre_in) bf16 [b, s, d], from one autograd node
    over the streams (``_MixLogitsBf16x3``)."""
    _check_streams(x)
    b, s, _, d = x.shape
    mixes, collapsed = _MixLogitsBf16x3.apply(
        x.reshape(b * s, hc, d).contiguous(), fn.float(), norm_eps, pre_in.float().reshape(b * s, hc).contiguous()
    )
    pre, post, comb = _SplitSinkhorn.apply(mixes, scale.float(), base.float(), hc, sinkhorn_iters, hc_eps)
    return pre.view(b, s, hc), post.view(b, s, hc), comb.view(b, s, hc, hc), collapsed.view(b, s, d)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    # x [b, s, hc, d] bf16, pre [b, s, hc] fp32 -> [b, s, d] bf16
    _check_streams(x)
    b, s, hc, d = x.shape
    out = _PreApplyMix.apply(x.reshape(b * s, hc, d).contiguous(), pre.float().reshape(b * s, hc).contiguous())
    return out.view(b, s, d)


def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    # y [b, s, d], x [b, s, hc, d] -> [b, s, hc, d]: out_j = post_j * y + sum_i comb[i, j] * x_i
    _check_streams(x)
    return _Post.apply(
        y.to(x.dtype).contiguous(), x.contiguous(), post.float().unsqueeze(-1).contiguous(), comb.float().contiguous()
    )
