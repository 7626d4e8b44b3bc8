"""TileLang GPU kernels for CSA2 sparse attention (forward and backward) and the indexer scores.

Backend ``attn: tilelang``.  Every kernel here computes the same function as its pure-PyTorch
contract in ``sparse_attention.py`` (``sparse_attention_torch``, ``indexer_scores_torch``) and is
tested against it on the GPU (``tests/gpu/test_tilelang_attention.py``).

Sparse attention (``sparse_attention_tilelang``), one CUDA block per (query token, 64 heads):

* forward: gathers the selected latent rows ``kv[idx]`` block by block (64 slots), online softmax
  in fp32 with the exponent in base 2, probabilities rounded to bf16 before P·V, and the sink
  ``exp(sink_h)`` added to the denominator at the end.  It saves the base-2 log-sum-exp
  ``lse2 = log2(sum_t exp(logit_t) + exp(sink_h))``, which the backward reuses.
* backward: recomputes ``P = exp2(logit·log2e − lse2)`` per block, ``dS = P·(dP − Δ)`` with
  ``Δ = rowsum(dO·O)``, accumulates ``dq`` in registers and scatter-adds
  ``dkv[idx] += scale·dSᵀQ + Pᵀ dO`` with fp32 atomics (order-dependent rounding: ``dkv`` is not
  bit-deterministic).  ``dsink_h = −Σ p_sink·Δ`` is a cheap elementwise reduction in PyTorch.
* FLOP convention of the benchmarks: forward ``4·b·s·h·k·d`` (QKᵀ and PV), backward 2.5× that
  (QKᵀ recompute, dO·Vᵀ, dS·K, dSᵀ·Q, Pᵀ·dO), with ``k`` the number of index slots (padding and
  empty slots included).

Indexer (``indexer_scores_tilelang``): ``score[b,i,t] = Σ_h relu(q[b,i,h]·k[b,t])·w[b,i,h]`` with
causally invisible entries ``t >= (i+1)//ratio`` set to ``-inf``; forward only (the indexer is
frozen).

Compilation and caches: kernels are specialised on shapes, dtype and device and built on first use.
Built kernels are kept in a process-wide dict keyed by ``(kernel, shapes, dtype, device)``;
``warmup_tilelang_kernels`` builds them ahead of training.  Below that, TileLang keeps its own
on-disk cache of compiled kernels in ``$TILELANG_CACHE_DIR`` (default ``~/.tilelang/cache``), so a
second process with the same shapes loads them in well under a second instead of recompiling.
"""

import math
import threading

import torch

try:
    import tilelang
    import tilelang.language as T
except ImportError:  # optional GPU dependency: pip install 'deepseek_v41[gpu]'
    tilelang = None
    T = None

LOG2E = 1.4426950408889634
HEADS_PER_BLOCK = 64  # one warpgroup MMA is 64 rows: a block handles 64 heads of one query
SLOTS_PER_BLOCK = 64  # index slots gathered per pipeline step (idx is padded to a multiple)

_KERNELS: dict = {}
_KERNELS_LOCK = threading.Lock()


def tilelang_available() -> tuple[bool, str]:
    """(True, "") when the TileLang kernels can run here, else (False, what is missing)."""
    if tilelang is None:
        return False, "attn backend 'tilelang' needs the package tilelang: pip install 'deepseek_v41[gpu]'"
    if not torch.cuda.is_available():
        return False, "attn backend 'tilelang' needs a CUDA GPU"
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        return False, "attn backend 'tilelang' needs a Hopper (sm_90) or newer GPU"
    return True, ""


def _require_tilelang() -> None:
    ok, reason = tilelang_available()
    if not ok:
        raise RuntimeError(reason)


def _cached(key: tuple, build):
    """Builds the kernel for ``key`` once per process (thread-safe)."""
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _KERNELS_LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                kernel = build()
                _KERNELS[key] = kernel
    return kernel


# ----------------------------------------------------------------------------------------------
# Kernel programs.  Each returns a TileLang prim_func; shapes are static.
# ----------------------------------------------------------------------------------------------

_PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def _build_attn_fwd(batch, seq, n_kv, heads, dim, slots, scale, threads=256, stages=2):
    # Q [b, s, H, d] bf16, KV [b, n, d] bf16, Idx [b, s, k] int32, Sink2 [H] fp32 (sink·log2e)
    # -> O [b, s, H, d] bf16, Lse2 [b, s, H] fp32 (base-2 log-sum-exp with the sink)
    HB, BI = HEADS_PER_BLOCK, SLOTS_PER_BLOCK
    n_hblk, n_steps = heads // HB, slots // BI
    c = scale * LOG2E
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def attn_fwd(
        Q: T.Tensor([batch, seq, heads, dim], bf16),
        KV: T.Tensor([batch, n_kv, dim], bf16),
        Idx: T.Tensor([batch, seq, slots], "int32"),
        Sink2: T.Tensor([heads], f32),
        O: T.Tensor([batch, seq, heads, dim], bf16),
        Lse2: T.Tensor([batch, seq, heads], f32),
    ):
        with T.Kernel(seq * n_hblk, batch, threads=threads) as (bx, bz):
            s_i = bx // n_hblk
            h0 = (bx % n_hblk) * HB
            q_s = T.alloc_shared([HB, dim], bf16)
            kv_s = T.alloc_shared([BI, dim], bf16)
            p_s = T.alloc_shared([HB, BI], bf16)
            valid = T.alloc_fragment([BI], "bool")
            acc_o = T.alloc_fragment([HB, dim], f32)
            acc_s = T.alloc_fragment([HB, BI], f32)
            m = T.alloc_fragment([HB], f32)  # running row max of the raw logits q·k
            m_prev = T.alloc_fragment([HB], f32)
            l = T.alloc_fragment([HB], f32)  # running sum of exp2((q·k − m)·c)
            l_blk = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            lse = T.alloc_fragment([HB], f32)

            T.copy(Q[bz, s_i, h0 : h0 + HB, :], q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, -1.0e30)  # finite: a block of only empty slots must not give inf − inf

            for it in T.Pipelined(n_steps, num_stages=stages):
                # gather the selected rows; empty slots (-1) read row 0 and are masked below
                for r, d in T.Parallel(BI, dim):
                    kv_s[r, d] = KV[bz, T.max(Idx[bz, s_i, it * BI + r], 0), d]
                for r in T.Parallel(BI):
                    valid[r] = Idx[bz, s_i, it * BI + r] >= 0
                for h, r in T.Parallel(HB, BI):
                    acc_s[h, r] = T.if_then_else(valid[r], 0, -T.infinity(f32))
                T.gemm(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for h in T.Parallel(HB):
                    alpha[h] = T.exp2((m_prev[h] - m[h]) * c)
                for h, r in T.Parallel(HB, BI):
                    acc_s[h, r] = T.exp2(acc_s[h, r] * c - m[h] * c)
                T.reduce_sum(acc_s, l_blk, dim=1)
                for h in T.Parallel(HB):
                    l[h] = l[h] * alpha[h] + l_blk[h]
                for h, d in T.Parallel(HB, dim):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_s, p_s)
                T.gemm(p_s, kv_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            # the sink joins the denominator only: rescale to the common max with it
            for h in T.Parallel(HB):
                lse[h] = T.max(m[h] * c, Sink2[h0 + h])
                alpha[h] = T.exp2(m[h] * c - lse[h])
                l[h] = l[h] * alpha[h] + T.exp2(Sink2[h0 + h] - lse[h])
                alpha[h] = alpha[h] / l[h]
                lse[h] = lse[h] + T.log2(l[h])
            for h, d in T.Parallel(HB, dim):
                acc_o[h, d] = acc_o[h, d] * alpha[h]
            T.copy(acc_o, q_s)
            T.copy(q_s, O[bz, s_i, h0 : h0 + HB, :])
            T.copy(lse, Lse2[bz, s_i, h0 : h0 + HB])

    return attn_fwd


def _build_attn_bwd(batch, seq, n_kv, heads, dim, slots, scale, block=32, threads=256, stages=2):
    # Q, dO [b, s, H, d] bf16, KV [b, n, d] bf16, Idx [b, s, k] int32, Lse2, Delta [b, s, H] fp32
    # -> dQ [b, s, H, d] bf16, dKV [b, n, d] fp32 (zero-initialised; accumulated with atomics)
    HB, BI = HEADS_PER_BLOCK, block
    n_hblk, n_steps = heads // HB, slots // BI
    c = scale * LOG2E
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def attn_bwd(
        Q: T.Tensor([batch, seq, heads, dim], bf16),
        KV: T.Tensor([batch, n_kv, dim], bf16),
        dO: T.Tensor([batch, seq, heads, dim], bf16),
        Idx: T.Tensor([batch, seq, slots], "int32"),
        Lse2: T.Tensor([batch, seq, heads], f32),
        Delta: T.Tensor([batch, seq, heads], f32),
        dQ: T.Tensor([batch, seq, heads, dim], bf16),
        dKV: T.Tensor([batch, n_kv, dim], f32),
    ):
        with T.Kernel(seq * n_hblk, batch, threads=threads) as (bx, bz):
            s_i = bx // n_hblk
            h0 = (bx % n_hblk) * HB
            q_s = T.alloc_shared([HB, dim], bf16)
            do_s = T.alloc_shared([HB, dim], bf16)
            kv_s = T.alloc_shared([BI, dim], bf16)
            p_s = T.alloc_shared([HB, BI], bf16)
            ds_s = T.alloc_shared([HB, BI], bf16)
            rows = T.alloc_shared([BI], "int32")
            acc_s = T.alloc_fragment([HB, BI], f32)
            acc_dp = T.alloc_fragment([HB, BI], f32)
            acc_dq = T.alloc_fragment([HB, dim], f32)
            acc_dkv = T.alloc_fragment([BI, dim], f32)
            lse = T.alloc_fragment([HB], f32)
            delta = T.alloc_fragment([HB], f32)

            T.copy(Q[bz, s_i, h0 : h0 + HB, :], q_s)
            T.copy(dO[bz, s_i, h0 : h0 + HB, :], do_s)
            T.copy(Lse2[bz, s_i, h0 : h0 + HB], lse)
            T.copy(Delta[bz, s_i, h0 : h0 + HB], delta)
            T.fill(acc_dq, 0)

            for it in T.Pipelined(n_steps, num_stages=stages):
                for r in T.Parallel(BI):
                    rows[r] = Idx[bz, s_i, it * BI + r]
                for r, d in T.Parallel(BI, dim):
                    kv_s[r, d] = KV[bz, T.max(Idx[bz, s_i, it * BI + r], 0), d]
                T.gemm(q_s, kv_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(do_s, kv_s, acc_dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                # P = softmax probability (sink included in lse); empty slots get P = 0
                for h, r in T.Parallel(HB, BI):
                    acc_s[h, r] = T.if_then_else(rows[r] >= 0, T.exp2(acc_s[h, r] * c - lse[h]), 0)
                for h, r in T.Parallel(HB, BI):
                    acc_dp[h, r] = acc_s[h, r] * (acc_dp[h, r] - delta[h]) * scale
                T.copy(acc_s, p_s)
                T.copy(acc_dp, ds_s)
                T.gemm(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(ds_s, q_s, acc_dkv, transpose_A=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                for r, d in T.Parallel(BI, dim):
                    if rows[r] >= 0:
                        T.atomic_add(dKV[bz, rows[r], d], acc_dkv[r, d])

            T.copy(acc_dq, q_s)
            T.copy(q_s, dQ[bz, s_i, h0 : h0 + HB, :])

    return attn_bwd


def _build_indexer(batch, seq, n_idx, heads, dim, ratio, block_q=4, block_t=128, threads=256, stages=2):
    # Qi [b, s, H, D] bf16, W [b, s, H] fp32, K [b, T, D] bf16 -> Score [b, s, T] fp32
    BQ, BT = block_q, block_t
    M = BQ * heads
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def indexer(
        Qi: T.Tensor([batch, seq, heads, dim], bf16),
        W: T.Tensor([batch, seq, heads], f32),
        K: T.Tensor([batch, n_idx, dim], bf16),
        Score: T.Tensor([batch, seq, n_idx], f32),
    ):
        with T.Kernel(T.ceildiv(n_idx, BT), T.ceildiv(seq, BQ), batch, threads=threads) as (bt, bq, bz):
            q_s = T.alloc_shared([M, dim], bf16)
            k_s = T.alloc_shared([BT, dim], bf16)
            w_s = T.alloc_shared([M], f32)
            r_s = T.alloc_shared([M, BT], f32)
            acc = T.alloc_fragment([M, BT], f32)
            out = T.alloc_fragment([BQ, BT], f32)
            i0 = bq * BQ
            t0 = bt * BT
            # last query of the block sees entries t < (i0 + BQ) // ratio: skip fully hidden tiles
            if t0 < (i0 + BQ) // ratio:
                for m_, d in T.Parallel(M, dim):
                    q_s[m_, d] = T.if_then_else(i0 + m_ // heads < seq, Qi[bz, i0 + m_ // heads, m_ % heads, d], 0)
                for m_ in T.Parallel(M):
                    w_s[m_] = T.if_then_else(i0 + m_ // heads < seq, W[bz, i0 + m_ // heads, m_ % heads], 0)
                for t, d in T.Parallel(BT, dim):
                    k_s[t, d] = T.if_then_else(t0 + t < n_idx, K[bz, t0 + t, d], 0)
                T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                for m_, t in T.Parallel(M, BT):
                    r_s[m_, t] = T.max(acc[m_, t], 0) * w_s[m_]
                T.clear(out)
                for i, t in T.Parallel(BQ, BT):
                    for h in T.serial(heads):
                        out[i, t] += r_s[i * heads + h, t]
                for i, t in T.Parallel(BQ, BT):
                    if i0 + i < seq and t0 + t < n_idx:
                        Score[bz, i0 + i, t0 + t] = T.if_then_else(
                            t0 + t < (i0 + i + 1) // ratio, out[i, t], -T.infinity(f32)
                        )
            else:
                for i, t in T.Parallel(BQ, BT):
                    if i0 + i < seq and t0 + t < n_idx:
                        Score[bz, i0 + i, t0 + t] = -T.infinity(f32)

    return indexer
