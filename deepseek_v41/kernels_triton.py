"""Triton GPU kernels for memory-bound pieces of the training step: RoPE, the fp32 RMSNorm, the head's loss,
the MoE combine and the experts' weighted SwiGLU.

* ``rope_rotate``: rotate the last ``rd`` channels (interleaved pairs) of x [rows, d] by per-position
  (cos, sin) in fp32 and round once; the other channels are copied (or left alone when rotating in
  place).  Bit-identical to the eager ``rope._rotate``: the products and the sum are rounded separately
  (no fused multiply-add), as eager PyTorch does.  One pass over x instead of eager's clone + ~10 ops.
* ``cross_entropy_rows_triton`` / ``cross_entropy_grad_hi_lo_triton``: the ``bf16x3`` head's fused loss
  (``layers._LinearBf16x3CrossEntropy``): per-row log-sum-exp and loss in one pass over the fp32 logits, and
  the split logits gradient [g_hi; g_lo] written straight from the logits in one more.
* ``rms_norm_triton``: the ``rms_norm: triton`` backend, ``x·rsqrt(mean(x²)+eps)·w`` in fp32 with one
  rounding to x's dtype, and its backward, one kernel each way (plus a small sum of the weight-gradient
  partials).  The same formula as ``torch_fp32``; only the fp32 summation order differs.
* ``gather_sum_rows``: out[t] = Σ_j y[src[t·k + j]] (+ the shared expert's row) in fp32, one pass (the MoE
  combine and the dispatch's adjoint, ``moe._sum_slots``), instead of a permuting ``index_copy_``, a sum over an
  [n, k, dim] view and the casts and add of the shared expert's output.
* ``weighted_swiglu_triton``: ``moe.weighted_swiglu`` (clamped SwiGLU times the routing weight, fp32 math, one
  rounding) and its backward (gate, up and weight gradients), one kernel each way.
* ``mix_dx_triton``: the input gradient of mHC's mix GEMM (``mhc_tile_kernels``), the 24-wide product and the
  RMS term in one pass.
* ``qdq_triton``: quantization.py's three quantize-dequantize references in one kernel each, bit-identical, without
  autograd (inference: the ``quant: torch`` boundaries use it on CUDA when no gradient is asked for).
* ``split_sinkhorn_triton``: mHC's coefficient split and its 20 Sinkhorn rounds in one kernel, without autograd
  (inference: ``mhc.hc_split_sinkhorn`` uses it on CUDA when no gradient is asked for).
* ``index_scores_triton``: a decode step's indexer scores (per-head products, ReLU, weighted sum, visibility) in
  one kernel, without the fp32 [b, n, H, T] products eager writes and reads back (inference on CUDA: the default
  backend ``decode_indexer: auto``).

Triton ships with the CUDA builds of PyTorch; on CPU (or without Triton) the callers use eager PyTorch.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds come without Triton
    triton = None


def triton_usable(x: torch.Tensor) -> bool:
    """True when ``x`` lives on a CUDA device and Triton is importable."""
    return triton is not None and x.is_cuda


def inference_kernel_usable(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """True where a forward-only Triton kernel may stand in for an eager chain: x on CUDA with Triton, no gradient
    asked of x or ``tensors``, and not inside torch.compile's tracing (Inductor fuses the eager chain itself)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors))
    return triton_usable(x) and not needs_grad and not torch.compiler.is_compiling()


if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, out_ptr, cs_ptr, n_rows, heads, n_pos, D: tl.constexpr, RD: tl.constexpr,
                     COPY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # x, out [n_rows, D] (rows ordered (b, pos, head)); cs fp32 [n_pos, RD/2, 2] = (cos, sin)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < n_rows
        pos = (rows // heads) % n_pos
        row_off = rows.to(tl.int64) * D
        tail = tl.arange(0, RD)
        mask = live[:, None]
        v = tl.load(x_ptr + row_off[:, None] + (D - RD) + tail[None, :], mask=mask, other=0.0).to(tl.float32)
        cs = tl.load(cs_ptr + pos[:, None] * RD + tail[None, :], mask=mask, other=0.0)
        re, im = tl.split(tl.reshape(v, (BLOCK_R, RD // 2, 2)))
        cos, sin = tl.split(tl.reshape(cs, (BLOCK_R, RD // 2, 2)))
        rotated = tl.reshape(tl.join(re * cos - im * sin, re * sin + im * cos), (BLOCK_R, RD))
        out_tail = out_ptr + row_off[:, None] + (D - RD) + tail[None, :]
        tl.store(out_tail, rotated.to(out_ptr.dtype.element_ty), mask=mask)
        if COPY:  # the pass-through channels [0, D - RD)
            cols = tl.arange(0, BLOCK_C)
            for c0 in tl.static_range(0, D - RD, BLOCK_C):
                m = mask & (c0 + cols < D - RD)[None, :]
                ptr = row_off[:, None] + c0 + cols[None, :]
                tl.store(out_ptr + ptr, tl.load(x_ptr + ptr, mask=m), mask=m)

    @triton.jit
    def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, D, eps, BLOCK_D: tl.constexpr):
        # x, y [n_rows, D], w [D] -> y = x·r·w (fp32, one rounding), rstd fp32 [n_rows] = r
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        x = tl.load(x_ptr + row.to(tl.int64) * D + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row.to(tl.int64) * D + cols, (x * r * w).to(y_ptr.dtype.element_ty), mask=m)
        tl.store(rstd_ptr + row, r)

    @triton.jit
    def _rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, D,
                             ROWS_PER_PROGRAM: tl.constexpr, BLOCK_D: tl.constexpr):
        # dx = r·(g − x̂·mean(x̂·g)) with g = dy·w, x̂ = x·r; this program's rows' share of dw = Σ dy·x̂
        # goes to dw_part [programs, D] (fp32)
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        first = tl.program_id(0) * ROWS_PER_PROGRAM
        for i in range(ROWS_PER_PROGRAM):
            row = tl.minimum(first + i, n_rows - 1)  # a short last chunk redoes its last row, adding nothing
            live = first + i < n_rows
            off = row.to(tl.int64) * D + cols
            x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + off, mask=m, other=0.0).to(tl.float32)
            r = tl.load(rstd_ptr + row)
            xhat = x * r
            g = dy * w
            c = tl.sum(xhat * g, axis=0) / D
            tl.store(dx_ptr + off, ((g - xhat * c) * r).to(dx_ptr.dtype.element_ty), mask=m & live)
            dw += tl.where(live, dy * xhat, 0.0)
        tl.store(dw_part_ptr + tl.program_id(0) * D + cols, dw, mask=m)

    @triton.jit
    def _ce_rows_kernel(logits_ptr, targets_ptr, lse_ptr, loss_ptr, V, BLOCK_V: tl.constexpr):
        # one row of fp32 logits [n, V]: lse = log Σ exp (online, per lane, then across lanes), and the row's
        # loss lse − logit[target] (0 when target < 0)
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * V
        cols = tl.arange(0, BLOCK_V)
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf"))
            m_new = tl.maximum(m, x)
            empty = m_new == float("-inf")  # no value in this lane yet
            acc = tl.where(empty, 0.0, acc * tl.exp(m - m_new) + tl.exp(x - m_new))
            m = m_new
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, acc * tl.exp(m - top)), axis=0))
        t = tl.load(targets_ptr + row)
        picked = tl.load(base + tl.maximum(t, 0))
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(t >= 0, lse - picked, 0.0))

    @triton.jit
    def _ce_grad_hi_lo_kernel(logits_ptr, lse_ptr, targets_ptr, grad_loss_ptr, grad_logits_ptr, out_ptr, n, V,
                              HAS_GRAD_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr):
        # g = grad_loss·(softmax − one-hot) on counted rows (+ grad_logits) -> out bf16 [2n, V] = [g_hi; g_lo]
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        m = cols < V
        off = row.to(tl.int64) * V + cols
        x = tl.load(logits_ptr + off, mask=m, other=0.0)
        t = tl.load(targets_ptr + row)
        scale = tl.where(t >= 0, tl.load(grad_loss_ptr), 0.0)
        g = (tl.exp(x - tl.load(lse_ptr + row)) - tl.where(cols == t, 1.0, 0.0)) * scale
        if HAS_GRAD_LOGITS:
            g += tl.load(grad_logits_ptr + off, mask=m, other=0.0)
        hi = g.to(tl.bfloat16)
        tl.store(out_ptr + off, hi, mask=m)
        tl.store(out_ptr + n.to(tl.int64) * V + off, (g - hi.to(tl.float32)).to(tl.bfloat16), mask=m)


    @triton.jit
    def _gather_sum_kernel(y_ptr, src_ptr, add_ptr, out_ptr, dim, K: tl.constexpr, ADD: tl.constexpr,
                           BLOCK: tl.constexpr):
        # out [n, dim] row t = Σ_j y[src[t·K + j]] (y [m, dim]) (+ add[t]), summed in fp32 in j order, rounded once
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < dim
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(src_ptr + t * K + j).to(tl.int64)
            acc += tl.load(y_ptr + row * dim + cols, mask=m, other=0.0).to(tl.float32)
        if ADD:
            acc += tl.load(add_ptr + t.to(tl.int64) * dim + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_fwd_kernel(gate_ptr, up_ptr, w_ptr, out_ptr, m, inter, limit, CLAMP: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # out [m, inter] = silu(min(gate, limit)) · clamp(up, ±limit) · w[row], fp32 math, one rounding
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < m)[:, None] & (cols < inter)[None, :]
        off = rows.to(tl.int64)[:, None] * inter + cols[None, :]
        g = tl.load(gate_ptr + off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if CLAMP:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        w = tl.load(w_ptr + rows, mask=rows < m, other=0.0)
        h = g * tl.sigmoid(g) * u * w[:, None]
        tl.store(out_ptr + off, h.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(gate_ptr, up_ptr, w_ptr, dh_ptr, dgate_ptr, dup_ptr, dw_ptr, m, inter, limit,
                           CLAMP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # with a = silu(g)·u (clamped g, u): dw[row] = Σ dh·a, du = dh·w·silu(g), dg = dh·w·u·silu'(g), where
        # silu'(g) = s·(1 + g·(1 − s)), s = sigmoid(g); a clamp passes the gradient only inside its range
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < m
        w = tl.load(w_ptr + rows, mask=live, other=0.0)
        dw = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, inter, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = live[:, None] & (cols < inter)[None, :]
            off = rows.to(tl.int64)[:, None] * inter + cols[None, :]
            g = tl.load(gate_ptr + off, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(up_ptr + off, mask=mask, other=0.0).to(tl.float32)
            dh = tl.load(dh_ptr + off, mask=mask, other=0.0).to(tl.float32)
            gc, uc = g, u
            if CLAMP:
                uc = tl.minimum(tl.maximum(u, -limit), limit)
                gc = tl.minimum(g, limit)
            s = tl.sigmoid(gc)
            silu = gc * s
            dw += tl.sum(dh * (silu * uc), axis=1)
            dhw = dh * w[:, None]
            du = dhw * silu
            dg = dhw * uc * (s * (1.0 + gc * (1.0 - s)))
            if CLAMP:
                du = tl.where((u >= -limit) & (u <= limit), du, 0.0)
                dg = tl.where(g <= limit, dg, 0.0)
            tl.store(dgate_ptr + off, dg.to(dgate_ptr.dtype.element_ty), mask=mask)
            tl.store(dup_ptr + off, du.to(dup_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + rows, dw, mask=live)

    @triton.jit
    def _mix_dx_kernel(gy_ptr, fn_ptr, coef_ptr, x_ptr, dx_ptr, m, K, N: tl.constexpr, N_PAD: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr = "ieee"):
        # dx [m, K] = gy [m, N] · fn [N, K] − coef·x in fp32 (the dot at PRECISION: "ieee" fused multiply-adds,
        # "tf32x3" / "tf32" on tensor cores; N zero-padded to N_PAD), rounded once to dx's
        # dtype.  N (the mix count, 24) is a short inner dimension: x is read and dx written once, and the fp32
        # product never goes to memory
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ns = tl.arange(0, N_PAD)
        rmask, cmask, nmask = rows < m, cols < K, ns < N
        g = tl.load(gy_ptr + rows[:, None] * N + ns[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        f = tl.load(fn_ptr + ns[:, None] * K + cols[None, :], mask=nmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(g, f, input_precision=PRECISION)
        off = rows.to(tl.int64)[:, None] * K + cols[None, :]
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(coef_ptr + rows, mask=rmask, other=0.0)
        tl.store(dx_ptr + off, (acc - c[:, None] * x).to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _pow2_ceil(v):
        # fp32 v > 0 (normal) -> 2^ceil(log2 v), exactly: from the exponent and whether a mantissa bit is set
        bits = v.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        return (e << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_half_even(a):
        # a >= 0 -> the nearest integer, ties to even (torch.round), from exact operations only
        f = tl.floor(a)
        d = a - f
        odd = f - 2.0 * tl.floor(f * 0.5)  # 1.0 when f is odd
        return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))

    @triton.jit
    def _qdq_kernel(x_ptr, out_ptr, n_blocks, MODE: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr):
        # x, out [n_blocks · BLOCK]: each block of BLOCK values rounded through a format and back, quantization.py's
        # references step by step in exact fp32 operations (IEEE division), so the result is theirs bit for bit.
        # MODE 0: FP8 e4m3, UE8M0 scale; 1: FP4 e2m1, UE8M0 scale; 2: FP4 e2m1, E4M3 scale
        blocks = tl.program_id(0) * R + tl.arange(0, R)
        off = blocks.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        live = (blocks < n_blocks)[:, None]
        xb = tl.load(x_ptr + off, mask=live, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(xb), axis=1)
        if MODE == 0:
            scale = _pow2_ceil(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
        elif MODE == 1:
            scale = _pow2_ceil(tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-126), 6.0))
        else:
            scale = tl.minimum(tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-9), 6.0), 448.0)
            scale = scale.to(tl.float8e4nv).to(tl.float32)
        y = tl.math.div_rn(xb, scale[:, None])
        if MODE == 0:
            y = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
        else:  # quantization.round_to_e2m1: half-to-even on the level grid of each range, then y's sign
            y = tl.minimum(tl.maximum(y, -6.0), 6.0)
            a = tl.abs(y)
            q = tl.where(a < 2, _round_half_even(a * 2) * 0.5,
                         tl.where(a < 4, _round_half_even(a), _round_half_even(a * 0.5) * 2))
            sign = y.to(tl.int32, bitcast=True) & -2147483648
            y = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        tl.store(out_ptr + off, (y * scale[:, None]).to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _split_sinkhorn_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, n_rows, eps, HC: tl.constexpr,
                               ITERS: tl.constexpr, BLOCK_R: tl.constexpr):
        # mix fp32 [n, (2+HC)·HC] -> pre, post [n, HC], comb [n, HC(src), HC(dst)]: mhc.hc_split_sinkhorn with the
        # whole Sinkhorn loop in registers (eager runs ~6 kernels per round)
        W: tl.constexpr = (2 + HC) * HC
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < n_rows
        r64 = rows.to(tl.int64)
        h = tl.arange(0, HC)
        m2 = live[:, None]
        s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
        pre = tl.load(mix_ptr + r64[:, None] * W + h[None, :], mask=m2, other=0.0) * s0 + tl.load(base_ptr + h)[None, :]
        post = tl.load(mix_ptr + r64[:, None] * W + HC + h[None, :], mask=m2, other=0.0) * s1 \
            + tl.load(base_ptr + HC + h)[None, :]
        tl.store(pre_ptr + r64[:, None] * HC + h[None, :], tl.sigmoid(pre) + eps, mask=m2)
        tl.store(post_ptr + r64[:, None] * HC + h[None, :], 2 * tl.sigmoid(post), mask=m2)
        ij = h[None, :, None] * HC + h[None, None, :]  # [1, HC, HC]
        m3 = live[:, None, None]
        c = tl.load(mix_ptr + r64[:, None, None] * W + 2 * HC + ij, mask=m3, other=0.0) * s2 + tl.load(base_ptr + 2 * HC + ij)
        c = tl.exp(c - tl.max(c, axis=2)[:, :, None])  # softmax over the destinations
        c = c / tl.sum(c, axis=2)[:, :, None] + eps
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
            c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        tl.store(comb_ptr + r64[:, None, None] * (HC * HC) + ij, c, mask=m3)

    @triton.jit
    def _index_scores_kernel(q_ptr, w_ptr, k_ptr, vis_ptr, out_ptr, n, T, H: tl.constexpr, D: tl.constexpr,
                             BT: tl.constexpr, ROUND: tl.constexpr):
        # one query row (b·n + j) x BT entries: q bf16 [b·n, H, D], w fp32 [b·n, H] (bf16 values), k [b, T, D]
        # (bf16 values), vis int64 [b·n] -> out fp32 [b·n, T] = sum_h w_h relu(q_h . k_t), -inf at t >= vis,
        # with ROUND (a bf16 model) rounded where the official bf16 Indexer rounds: each dot product, each weighted
        # value, the head sum; without (an fp32 model) fp32 throughout
        row = tl.program_id(1)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        h = tl.arange(0, H)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row.to(tl.int64) * (H * D) + h[:, None] * D + d[None, :])
        k_rows = k_ptr + (row // n).to(tl.int64) * T * D + t[:, None].to(tl.int64) * D + d[None, :]
        keys = tl.load(k_rows, mask=(t < T)[:, None], other=0.0).to(q.dtype)  # [BT, D], bf16 (exact)
        dots = tl.dot(q, tl.trans(keys))  # fp32 [H, BT]: bf16 products are exact, the sums fp32
        w = tl.load(w_ptr + row.to(tl.int64) * H + h)
        if ROUND:
            weighted = tl.maximum(dots.to(tl.bfloat16), 0.0) * w.to(tl.bfloat16)[:, None]
            scores = tl.sum(weighted.to(tl.bfloat16).to(tl.float32), axis=0).to(tl.bfloat16).to(tl.float32)
        else:
            scores = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        scores = tl.where(t < tl.load(vis_ptr + row), scores, float("-inf"))
        tl.store(out_ptr + row.to(tl.int64) * T + t, scores, mask=t < T)


def rope_kernel_fits(x: torch.Tensor, rd: int) -> bool:
    """Whether ``rope_rotate`` takes x [.., d] with rd rotated channels: contiguous, rd a power of two <= d."""
    return x.is_contiguous() and rd & (rd - 1) == 0 and rd <= x.shape[-1]


def rope_rotate(x: torch.Tensor, cos_sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """x [b, n, (h,) d] contiguous, cos_sin fp32 [n, rd/2, 2] -> x with its last rd channels rotated (a new
    tensor, or x itself when ``inplace``)."""
    d, rd = x.shape[-1], 2 * cos_sin.shape[-2]
    if not rope_kernel_fits(x, rd):
        raise ValueError(f"rope_rotate needs a contiguous x and a power-of-two rotated width <= {d}, got {rd}")
    n_pos = x.shape[1]
    heads = x[0, 0].numel() // d
    n_rows = x.numel() // d
    out = x if inplace else torch.empty_like(x)
    block_r = 64
    _rope_kernel[(triton.cdiv(n_rows, block_r),)](
        x, out, cos_sin.contiguous(), n_rows, heads, n_pos, D=d, RD=rd, COPY=not inplace, BLOCK_R=block_r,
        BLOCK_C=64, num_warps=4, enable_fp_fusion=False,
    )
    return out


class _RMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n_rows, d = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(d)
        _rms_norm_fwd_kernel[(n_rows,)](x2, weight, y, rstd, n_rows, d, eps, BLOCK_D=block,
                                        num_warps=min(16, max(1, block // 512)))
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, d = x2.shape
        dy2 = dy.reshape(-1, d).contiguous()
        dx = torch.empty_like(x2)
        sms = torch.cuda.get_device_properties(x2.device).multi_processor_count
        rows_per_program = triton.cdiv(n_rows, 4 * sms)
        programs = triton.cdiv(n_rows, rows_per_program)
        dw_part = torch.empty(programs, d, dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(d)
        _rms_norm_bwd_kernel[(programs,)](x2, weight, dy2, rstd, dx, dw_part, n_rows, d,
                                          ROWS_PER_PROGRAM=rows_per_program, BLOCK_D=block,
                                          num_warps=min(16, max(1, block // 512)))
        return dx.view(dy.shape), dw_part.sum(0).to(weight.dtype), None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> x·rsqrt(mean(x²)+eps)·weight in fp32, rounded once to x's dtype (CUDA)."""
    if not triton_usable(x):
        raise RuntimeError("rms_norm backend 'triton' needs a CUDA tensor and the package triton "
                           "(it comes with CUDA builds of PyTorch)")
    return _RMSNormTriton.apply(x, weight, eps)


def cross_entropy_rows_triton(logits: torch.Tensor, targets: torch.Tensor):
    """fp32 logits [n, V] (contiguous), targets [n] (< 0: not counted) -> (lse [n], Σ_counted lse − logit[t])."""
    n, V = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    _ce_rows_kernel[(n,)](logits, targets, lse, loss, V, BLOCK_V=2048, num_warps=8)
    return lse, loss.sum()


def cross_entropy_grad_hi_lo_triton(logits, lse, targets, grad_loss, grad_logits, out) -> None:
    """``layers.cross_entropy_grad_hi_lo`` in one pass over the logits (grad_loss: a 0-dim fp32 tensor)."""
    n, V = logits.shape
    block = 2048
    has = grad_logits is not None
    grad_logits = grad_logits.float().contiguous() if has else logits  # any pointer when unused
    _ce_grad_hi_lo_kernel[(n, triton.cdiv(V, block))](
        logits, lse, targets, grad_loss, grad_logits, out, n, V, HAS_GRAD_LOGITS=has, BLOCK_V=block, num_warps=8
    )


def gather_sum_rows(y: torch.Tensor, src: torch.Tensor, k: int, dtype, add: torch.Tensor | None = None):
    """y [m, dim], src int [n·k] (rows of y), add [n, dim] or None -> [n, dim] in ``dtype``:
    row t = Σ_j y[src[t·k + j]] (+ add[t]) in fp32, rounded once."""
    y = y.contiguous()
    dim = y.shape[1]
    n = src.numel() // k
    out = torch.empty((n, dim), dtype=dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(dim))
    _gather_sum_kernel[(n, triton.cdiv(dim, block))](
        y, src.contiguous(), y if add is None else add.contiguous(), out, dim, K=k, ADD=add is not None, BLOCK=block,
        num_warps=4,
    )
    return out


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weights, limit):
        gate, up, weights = gate.contiguous(), up.contiguous(), weights.float().contiguous()
        m, inter = gate.shape
        out = torch.empty_like(gate)
        grid = (triton.cdiv(m, 8), triton.cdiv(inter, 256))
        _swiglu_fwd_kernel[grid](gate, up, weights, out, m, inter, float(limit), CLAMP=limit > 0,
                                 BLOCK_R=8, BLOCK_C=256, num_warps=4)
        ctx.save_for_backward(gate, up, weights)
        ctx.limit = limit
        return out

    @staticmethod
    def backward(ctx, dh):
        gate, up, weights = ctx.saved_tensors
        m, inter = gate.shape
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        dw = torch.empty(m, dtype=torch.float32, device=gate.device)
        _swiglu_bwd_kernel[(triton.cdiv(m, 8),)](gate, up, weights, dh.contiguous(), dgate, dup, dw, m, inter,
                                                 float(ctx.limit), CLAMP=ctx.limit > 0, BLOCK_R=8, BLOCK_C=256,
                                                 num_warps=4)
        return dgate, dup, dw, None


def weighted_swiglu_triton(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor, limit: float):
    """``moe.weighted_swiglu`` on CUDA: gate, up [m, inter], weights fp32 [m] -> [m, inter] in gate's dtype."""
    return _WeightedSwiGLU.apply(gate, up, weights, limit)


def mix_dx_triton(g_y: torch.Tensor, fn: torch.Tensor, coef: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The mHC mix GEMM's input gradient in one pass: g_y fp32 [m, N] · fn fp32 [N, K] − coef fp32 [m, 1] · x
    [m, K], in fp32, rounded once to x's dtype.  With N = (2+hc)·hc = 24 the product's inner dimension is too
    short for a GEMM to pay: writing its fp32 [m, K] result and subtracting coef·x in a second pass is what this
    replaces (examples/benchmarks/fp32_islands.py)."""
    m, k = x.shape
    n = fn.shape[0]
    dx = torch.empty_like(x)
    block_r, block_c = 128, 64
    _mix_dx_kernel[(triton.cdiv(m, block_r), triton.cdiv(k, block_c))](
        g_y.float().contiguous(), fn.float().contiguous(), coef.float().contiguous(), x.contiguous(), dx, m, k, N=n,
        N_PAD=max(16, triton.next_power_of_2(n)), BLOCK_R=block_r, BLOCK_C=block_c, PRECISION="tf32x3", num_warps=4,
    )
    return dx


def split_sinkhorn_triton(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                          eps: float):
    """``mhc.hc_split_sinkhorn``'s forward in one kernel (no autograd): mixes fp32 [..., (2+hc)·hc] -> pre [..., hc],
    post [..., hc], comb [..., hc, hc], fp32.  The same formulas; fp32 rounding differs from eager's by a few ulp
    (exp and the fused operations).  hc a power of two."""
    lead = mixes.shape[:-1]
    flat = mixes.reshape(-1, mixes.shape[-1]).float().contiguous()
    n = flat.shape[0]
    pre = flat.new_empty(*lead, hc)
    post = flat.new_empty(*lead, hc)
    comb = flat.new_empty(*lead, hc, hc)
    block_r = 32
    _split_sinkhorn_kernel[(max(1, triton.cdiv(n, block_r)),)](
        flat, scale.float().contiguous(), base.float().contiguous(), pre, post, comb, n, eps, HC=hc, ITERS=iters,
        BLOCK_R=block_r, num_warps=1,
    )
    return pre, post, comb


QDQ_MODES = {"fp8": (0, 32), "fp4": (1, 32), "fp4_e4m3_scale": (2, 16)}


def qdq_triton(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """quantization.py's ``fp8_qdq_reference`` / ``fp4_qdq_reference`` / ``fp4_e4m3_scale_qdq_reference`` (``fmt``
    "fp8", "fp4", "fp4_e4m3_scale") of x [..., n] in one kernel, no autograd: a fresh tensor, bit-identical to the
    reference (eager runs 14-25 kernels each)."""
    mode, block = QDQ_MODES[fmt]
    if x.shape[-1] % block:
        raise ValueError(f"quantization block {block} does not divide the last dimension {x.shape[-1]}")
    flat = x.contiguous()
    out = torch.empty_like(flat)
    n_blocks = flat.numel() // block
    rows = 64
    _qdq_kernel[(max(1, triton.cdiv(n_blocks, rows)),)](flat, out, n_blocks, MODE=mode, BLOCK=block, R=rows,
                                                       num_warps=4)
    return out


def index_scores_fits(q: torch.Tensor) -> bool:
    """The decode indexer kernel's shapes: q [b, n, H, D] with H and D powers of two >= 16 (tensor-core tiles)."""
    H, D = q.shape[-2:]
    return all(v >= 16 and v & (v - 1) == 0 for v in (H, D))


def index_scores_triton(q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, visible: torch.Tensor):
    """``sparse_attention.indexer_scores_torch(..., score_dtype=q.dtype)`` for a decode step, in one kernel:
    q [b, n, H, D], weights [b, n, H], index_k [b, T, D], visible [b, n] (entries each query sees) -> fp32 scores
    [b, n, T], -inf at t >= visible; for a bf16 q rounded as the official bf16 Indexer rounds them (bf16 values).
    Eager forms the per-head products [b, n, H, T] and reads them three times (at batch 32 and 32k entries, 134 MB
    per pass and layer); here they stay in registers.  q and the keys hold MXFP4 values (``quantization.fp4_qdq``:
    two-bit significands), exact in bf16: the products are exact on bf16 tensor cores; only the fp32 summation
    orders (over D, over the heads) differ from eager's, which moves a rounded score by one bf16 ulp where a sum
    falls next to a rounding boundary."""
    b, n, H, D = q.shape
    T = index_k.shape[1]
    out = torch.empty(b, n, T, dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    rows = b * n
    q16 = q.to(torch.bfloat16).contiguous()
    block_t = 64
    _index_scores_kernel[(triton.cdiv(T, block_t), rows)](
        q16, weights.float().contiguous(), index_k.contiguous(), visible.reshape(rows).to(torch.int64).contiguous(),
        out, n, T, H=H, D=D, BT=block_t, ROUND=q.dtype == torch.bfloat16, num_warps=4,
    )
    return out
