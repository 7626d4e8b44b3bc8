"""TileLang GPU kernels for CSA2 sparse attention (forward and backward) and the indexer scores.

Backend ``attn: tilelang``.  Every kernel here computes the same function as its pure-PyTorch
contract in ``sparse_attention.py`` (``sparse_attention_torch``, ``indexer_scores_torch``) and is
tested against it on the GPU (``tests/gpu/test_tilelang_attention.py``).

Sparse attention (``sparse_attention_tilelang``), one CUDA block per (query token, 64 heads):

* forward: at head dim 512 on Hopper (DeepSeek-V4.1) the hand-written CUDA kernel of
  ``sparse_attention_cuda`` (warp-specialised, 424 against 323 TFLOP/s for the kernel below at the V4.1
  shape); the TileLang kernel below for other head dims, other GPUs, or with ``DS41_SPARSE_FWD=tilelang``.
  Both keep the same contract and write the same ``lse2`` for the backward.
* TileLang forward (compiled with TileLang's fast math: hardware ``ex2.approx``, ~2-4 % faster here):
  gathers the selected latent rows ``kv[idx]`` block by block (64 slots) with cp.async into two
  shared buffers, so the next block's gather overlaps this block's math; online softmax in fp32
  with the exponent in base 2, probabilities rounded to bf16 before P·V, and the sink
  ``exp(sink_h)`` added to the denominator at the end.  It saves the base-2 log-sum-exp
  ``lse2 = log2(sum_t exp(logit_t) + exp(sink_h))``, which the backward reuses.  What bounds it
  (``examples/benchmarks/attention.py --bounds``, H200, V4.1 shape): its math alone takes 89 % of
  its time.  Row sums are kept per slot column and reduced once at the end; the row max still needs
  a cross-warpgroup reduction per block.  Per-warpgroup structures that avoid it were slower
  (``results/attention_h200.txt``).
* backward (default, bit-deterministic): one kernel (at head dim 512 on Hopper the hand-written CUDA kernel of
  ``sparse_attention_cuda_bwd``, 1.1x the TileLang one described here, unless ``DS41_SPARSE_BWD_SLOTS=tilelang``)
  computes ``Δ = rowsum(dO·O)``, recomputes
  ``P = exp2(logit·log2e − lse2)`` per block of 64 slots, forms ``dS = scale·P·(dP − Δ)``, accumulates
  ``dQ = dS·kv[idx]`` and writes each slot's kv gradient ``dSᵀQ + Pᵀ dO`` (bf16, one [k, d] tile per query and 64
  heads; the kernel runs one batch row at a time, so the buffer is s·k·d·2 bytes).  While a block's kv gradients
  are computed and stored (128 columns at a time through a small swizzled staging tile), the next block's rows are
  already being gathered into the one [64, d] buffer that fits next to Q and dO.  Blocks after the query's last key
  are skipped (they add nothing to dQ, and the row sum never reads an empty slot's tile).  ``_reduce_slot_grads``
  then sums the tiles into rows in a fixed order: a stable sort of ``idx`` gives each kv row its (query, slot)
  entries in query order and one Triton program per row adds them in fp32 (8 running sums, then a fixed tree) and
  rounds once to bf16.  The same inputs give the same bits on every run, whatever the launch order; repeated rows
  in one query's ``idx`` are summed like any other.  The per-slot values are rounded to bf16 before the sum (relative
  error ~2⁻⁹ each, not growing with the number of terms), the same order of error as the final bf16 ``dkv``.
  ``dsink_h = −Σ p_sink·Δ`` is a cheap elementwise reduction in PyTorch.
* backward, opt-in ``DS41_SPARSE_BWD=atomic``: a first kernel scatter-adds ``dkv[idx] += dSᵀQ + Pᵀ dO`` with fp32
  atomics (order-dependent rounding: not bit-deterministic) and writes dS; a second gathers again for
  ``dq = dS·kv[idx]``.  Kernel-only on the H200 at the V4.1 shape (s 4096, 640 slots)
  (``examples/benchmarks/attention.py --kernels``): see ``results/attention_h200.txt`` for both modes.
* head counts that are not a multiple of 64 are padded with zero heads and ``idx`` with empty
  slots to a multiple of 64; both are exact (padded heads get ``dO = 0`` and add nothing to
  ``dkv``; empty slots get ``P = 0``).
* FLOP convention of the benchmarks: forward ``4·b·s·h·k·d`` (QKᵀ and PV), backward 2.5× that
  (QKᵀ recompute, dO·Vᵀ, dS·K, dSᵀ·Q, Pᵀ·dO), with ``k`` the number of index slots (padding and
  empty slots included).

Indexer (``indexer_scores_tilelang``): ``score[b,i,t] = Σ_h relu(q[b,i,h]·k[b,t])·w[b,i,h]`` with
causally invisible entries ``t >= (offset+i+1)//ratio`` set to ``-inf`` (``offset``: a runtime argument, the
first query's position when a long prefill scores its queries in chunks); forward only (the indexer is frozen).

Compilation and caches: kernels are specialised on shapes, dtype and device and built on first use.
Built kernels are kept in a process-wide dict keyed by ``(kernel, shapes, dtype, device)``;
``warmup_tilelang_kernels`` builds them ahead of training.  Below that, TileLang keeps its own
on-disk cache of compiled kernels in ``$TILELANG_CACHE_DIR`` (default ``~/.tilelang/cache``), so a
later process with the same shapes loads them instead of rebuilding (a build takes 5-17 s per
kernel on the H200 machine).
"""

import functools
import os
import threading

import torch

from .sparse_attention_cuda import (
    LOG2E,
    cuda_forward_kernel,
    cuda_forward_usable,
    padded_slots,
    sparse_attention_forward_cuda,
)
from .sparse_attention_cuda_bwd import cuda_backward_kernel, cuda_backward_usable, sparse_attention_slot_grads_cuda

try:
    import tilelang
    import tilelang.language as T
except ImportError:  # optional GPU dependency: pip install 'deepseek_v41[gpu]'
    tilelang = None
    T = None

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds come without Triton
    triton = None
    tl = None

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
    if triton is None:
        return False, ("attn backend 'tilelang' needs Triton (the deterministic backward's reduction; CUDA builds of "
                       "PyTorch ship it): pip install 'deepseek_v41[gpu]' triton")
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


def _gather_macro(dim, threads, n_gathered):
    """(gather, n_rows): a macro that starts copying the kv rows of slot block ``blk`` (SLOTS_PER_BLOCK slots of
    ``idx_s``) into a [SLOTS_PER_BLOCK, dim] shared buffer with 16-byte cp.async and commits them as one group
    (empty slots, -1, are zero-filled, not read); ``rows`` is a local int32 [n_rows] scratch.  Blocks from
    ``n_gathered`` on are skipped (the forward's "math" probe)."""
    BI, vec = SLOTS_PER_BLOCK, 8  # bf16 per 16-byte cp.async
    per_row = dim // vec  # 16-byte chunks per row
    chunks = BI * per_row  # per block; thread t copies chunks t, t + threads, ...
    n_rows = -(-chunks // threads)

    @T.macro
    def gather(KV, idx_s, rows, kv_buf, bz, blk, t):
        # read this thread's row numbers first: interleaved with the copies, each shared read of the
        # index would get two barriers from TileLang's sync planner (it cannot tell idx_s from kv_buf)
        if blk < n_gathered:
            for u in T.unroll(n_rows):
                if chunks % threads == 0 or u * threads + t < chunks:
                    rows[u] = idx_s[blk * BI + (u * threads + t) // per_row]
            for u in T.unroll(n_rows):
                if chunks % threads == 0 or u * threads + t < chunks:
                    T.ptx_cp_async(
                        T.access_ptr(
                            kv_buf[(u * threads + t) // per_row, (u * threads + t) % per_row * vec], "w", vec
                        ),
                        T.access_ptr(KV[bz, T.max(rows[u], 0), (u * threads + t) % per_row * vec], "r", vec),
                        vec,
                        rows[u] >= 0,
                    )
        T.ptx_commit_group()

    return gather, n_rows


def _build_attn_fwd(batch, seq, n_kv, heads, dim, slots, scale, threads=256, probe=""):
    # Q [b, s, H, d] bf16, KV [b, n, d] bf16, Idx [b, s, k] int32, Sink2 [H] fp32 (sink·log2e)
    # -> O [b, s, H, d] bf16, Lse2 [b, s, H] fp32 (base-2 log-sum-exp with the sink)
    # probe (benchmarks only, the output is meaningless): "gather" keeps the gathers and barriers and drops
    # the math; "math" gathers the first two blocks only and computes every block on them.
    # Hand-written double buffering: the index row is staged in shared memory once, and while the
    # two warpgroups work on one block of 64 rows, cp.async gathers the next block into the other of
    # two separate buffers (empty slots are zero-filled, not read).  Against TileLang's automatic
    # pipeline over a global index read this is 4 % faster at s = 4096 and 35 % at s <= 1024.
    HB, BI = HEADS_PER_BLOCK, SLOTS_PER_BLOCK
    n_hblk, n_steps = heads // HB, slots // BI
    n_pairs = n_steps // 2  # blocks go in pairs, buffer 0 then 1; an odd last block uses buffer 0
    c = scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    gather, n_rows = _gather_macro(dim, threads, n_gathered=2 if probe == "math" else n_steps)
    with_math = probe != "gather"

    @T.macro
    def step(q_s, kv_buf, p_s, idx_s, blk, acc_s, acc_o, m, m_prev, l_part, alpha, pending=1):
        T.ptx_wait_group(pending)  # this block's rows have landed (the next block's may be in flight)
        T.sync_threads()
        if with_math:
            for h, r in T.Parallel(HB, BI):
                acc_s[h, r] = T.if_then_else(idx_s[blk * BI + r] >= 0, 0, -T.infinity(f32))
            T.gemm(q_s, kv_buf, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.copy(m, m_prev)
            T.reduce_max(acc_s, m, dim=1, clear=False)
            for h in T.Parallel(HB):
                m[h] = T.max(m[h], m_prev[h])
            for h in T.Parallel(HB):
                alpha[h] = T.exp2((m_prev[h] - m[h]) * c)
            for h, r in T.Parallel(HB, BI):
                acc_s[h, r] = T.exp2(acc_s[h, r] * c - m[h] * c)
            for h, r in T.Parallel(HB, BI):
                l_part[h, r] = l_part[h, r] * alpha[h] + acc_s[h, r]
            for h, d in T.Parallel(HB, dim):
                acc_o[h, d] = acc_o[h, d] * alpha[h]
            T.copy(acc_s, p_s)
            T.gemm(p_s, kv_buf, acc_o, policy=T.GemmWarpPolicy.FullRow)
        T.sync_threads()  # every warp is done with this buffer before it is refilled

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
            kv0 = T.alloc_shared([BI, dim], bf16)
            kv1 = T.alloc_shared([BI, dim], bf16)
            p_s = T.alloc_shared([HB, BI], bf16)
            idx_s = T.alloc_shared([slots], "int32")
            rows = T.alloc_local([n_rows], "int32")
            acc_o = T.alloc_fragment([HB, dim], f32)
            acc_s = T.alloc_fragment([HB, BI], f32)
            m = T.alloc_fragment([HB], f32)  # running row max of the raw logits q·k
            m_prev = T.alloc_fragment([HB], f32)
            # running sums of exp2((q·k − m)·c), kept per slot column and summed over the row once at the end:
            # a row sum per block would cost a cross-warpgroup reduction each time (1.09 -> 1.05 ms at V4.1 shape)
            l_part = T.alloc_fragment([HB, BI], f32)
            l = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            lse = T.alloc_fragment([HB], f32)

            tx = T.get_thread_binding()
            T.copy(Q[bz, s_i, h0 : h0 + HB, :], q_s)
            T.copy(Idx[bz, s_i, :], idx_s)
            T.fill(acc_o, 0)
            T.fill(l_part, 0)
            T.fill(m, -1.0e30)  # finite: a block of only empty slots must not give inf − inf
            T.sync_threads()
            gather(KV, idx_s, rows, kv0, bz, 0, tx)
            for j in T.serial(n_pairs):
                gather(KV, idx_s, rows, kv1, bz, j * 2 + 1, tx)
                step(q_s, kv0, p_s, idx_s, j * 2, acc_s, acc_o, m, m_prev, l_part, alpha)
                gather(KV, idx_s, rows, kv0, bz, j * 2 + 2, tx)
                step(q_s, kv1, p_s, idx_s, j * 2 + 1, acc_s, acc_o, m, m_prev, l_part, alpha)
            if n_steps % 2 == 1:
                step(q_s, kv0, p_s, idx_s, n_steps - 1, acc_s, acc_o, m, m_prev, l_part, alpha, pending=0)

            if not with_math:  # probe "gather": no math gives l_part its layout; take acc_s's as the math does
                T.fill(acc_s, 0)
                for h, r in T.Parallel(HB, BI):
                    l_part[h, r] = acc_s[h, r]
            T.reduce_sum(l_part, l, dim=1)
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


if T is not None:  # TileLang macros shared by the backward kernels (tilelang is an optional dependency)

    @T.macro
    def _delta_rows(dO, O, bz, s_i, h0, dim, part, part_sum, delta_acc, delta_s, Delta, delta):
        # Δ = rowsum(dO·O) in fp32 over 64 heads, 64 columns at a time, written to Delta and kept in `delta`
        T.fill(delta_acc, 0)
        for cc in T.serial(dim // 64):
            for h, d in T.Parallel(HEADS_PER_BLOCK, 64):
                part[h, d] = T.Cast("float32", dO[bz, s_i, h0 + h, cc * 64 + d]) * T.Cast("float32", O[bz, s_i, h0 + h, cc * 64 + d])
            T.reduce_sum(part, part_sum, dim=1)
            for h in T.Parallel(HEADS_PER_BLOCK):
                delta_acc[h] = delta_acc[h] + part_sum[h]
        T.copy(delta_acc, delta_s)
        T.copy(delta_s, Delta[bz, s_i, h0 : h0 + HEADS_PER_BLOCK])
        T.copy(delta_s, delta)

    @T.macro
    def _probabilities_and_ds(acc_s, acc_dp, idx_s, slot0, lse, delta, c, scale):
        # acc_s: logits -> P = exp2(logit·c − lse2) (the sink is in lse2; empty slots get 0);
        # acc_dp: dP -> dS = P·(dP − Δ)·scale
        for h, r in T.Parallel(HEADS_PER_BLOCK, SLOTS_PER_BLOCK):
            acc_s[h, r] = T.if_then_else(idx_s[slot0 + r] >= 0, T.exp2(acc_s[h, r] * c - lse[h]), 0)
        for h, r in T.Parallel(HEADS_PER_BLOCK, SLOTS_PER_BLOCK):
            acc_dp[h, r] = acc_s[h, r] * (acc_dp[h, r] - delta[h]) * scale


def _build_attn_bwd_kv(batch, seq, n_kv, heads, dim, slots, scale, threads=256, stages=1):
    # Backward of DS41_SPARSE_BWD=atomic, first kernel: Δ, dS and dKV by fp32 atomics (dQ is left to
    # _build_attn_bwd_q, so no [64, d] accumulator competes for registers here).
    # Q, O, dO [b, s, H, d] bf16, KV [b, n, d] bf16, Idx [b, s, k] int32, Lse2 [b, s, H] fp32
    # -> Delta [b, s, H] fp32 (rowsum dO·O), dS [b, s, H, k] bf16 (times the softmax scale),
    #    dKV [b, n, d] fp32 (zero-initialised, accumulated with atomics: not bit-deterministic)
    HB, BI, DC = HEADS_PER_BLOCK, SLOTS_PER_BLOCK, 64
    n_hblk, n_steps = heads // HB, slots // BI
    c = scale * LOG2E
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def attn_bwd_kv(
        Q: T.Tensor([batch, seq, heads, dim], bf16),
        KV: T.Tensor([batch, n_kv, dim], bf16),
        O: T.Tensor([batch, seq, heads, dim], bf16),
        dO: T.Tensor([batch, seq, heads, dim], bf16),
        Idx: T.Tensor([batch, seq, slots], "int32"),
        Lse2: T.Tensor([batch, seq, heads], f32),
        Delta: T.Tensor([batch, seq, heads], f32),
        dS: T.Tensor([batch, seq, heads, slots], bf16),
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
            idx_s = T.alloc_shared([slots], "int32")
            delta_s = T.alloc_shared([HB], f32)
            acc_s = T.alloc_fragment([HB, BI], f32)
            acc_dp = T.alloc_fragment([HB, BI], f32)
            acc_dkv = T.alloc_fragment([BI, dim], f32)
            part = T.alloc_fragment([HB, DC], f32)
            part_sum = T.alloc_fragment([HB], f32)
            delta_acc = T.alloc_fragment([HB], f32)
            lse = T.alloc_fragment([HB], f32)
            delta = T.alloc_fragment([HB], f32)

            T.copy(Q[bz, s_i, h0 : h0 + HB, :], q_s)
            T.copy(dO[bz, s_i, h0 : h0 + HB, :], do_s)
            T.copy(Idx[bz, s_i, :], idx_s)
            T.copy(Lse2[bz, s_i, h0 : h0 + HB], lse)
            _delta_rows(dO, O, bz, s_i, h0, dim, part, part_sum, delta_acc, delta_s, Delta, delta)

            for it in T.Pipelined(n_steps, num_stages=stages):
                for r, d in T.Parallel(BI, dim):
                    kv_s[r, d] = KV[bz, T.max(idx_s[it * BI + r], 0), d]
                T.gemm(q_s, kv_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(do_s, kv_s, acc_dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                _probabilities_and_ds(acc_s, acc_dp, idx_s, it * BI, lse, delta, c, scale)
                T.copy(acc_s, p_s)
                T.copy(acc_dp, ds_s)
                T.copy(ds_s, dS[bz, s_i, h0 : h0 + HB, it * BI : it * BI + BI])
                T.gemm(ds_s, q_s, acc_dkv, transpose_A=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                for r, d in T.Parallel(BI, dim):
                    if idx_s[it * BI + r] >= 0:
                        T.atomic_add(dKV[bz, idx_s[it * BI + r], d], acc_dkv[r, d])

    return attn_bwd_kv


def _build_attn_bwd_slots(batch, seq, n_kv, heads, dim, slots, scale, threads=256):
    # The deterministic backward in one kernel: Δ, dQ, and each slot's kv gradient, one [k, d] tile per (query,
    # 64 heads), summed into rows afterwards by _reduce_slot_grads in a fixed order.
    # Q, O, dO [b, s, H, d] bf16, KV [b, n, d] bf16, Idx [b, s, k] int32, Lse2 [b, s, H] fp32
    # -> Delta [b, s, H] fp32 (rowsum dO·O), dQ [b, s, H, d] bf16,
    #    dKV [b, s·H/64, k, d] bf16: slot j of (query i, head block g) at [i·H/64 + g, j] holds dSᵀQ + PᵀdO of
    #    those 64 heads for the row idx[i, j].
    # Per block of 64 slots: S = Q·kvᵀ and dP = dO·kvᵀ, P and dS (shared memory), dQ += dS·kv; then the next
    # block's rows are gathered (cp.async into the same buffer, the only [64, d] buffer that fits next to Q and
    # dO) while the kv gradients dSᵀQ + PᵀdO are computed and stored `chunk` columns at a time through a small
    # swizzled staging tile.  A [64, chunk] accumulator (not [64, d]) leaves registers for the [64, d] dQ one.
    # Blocks after the query's last key are skipped and CTAs take the queries last first (see the comments below).
    # H200, V4.1 shape (s 4096, k 640, d 512): 2.50-2.51 ms at ratio 1 and 2.50 at ratio 2, against 2.60-2.62 for
    # the same kernel without the skip in the same runs (bit-identical outputs); 3.42 ms for a per-slot kernel that
    # staged its whole [64, d] tile through the gather buffer (no overlap) plus 0.71 ms for a separate dQ kernel
    # (examples/benchmarks/results/attention_h200.txt).
    HB, BI, DC = HEADS_PER_BLOCK, SLOTS_PER_BLOCK, 64
    n_hblk, n_steps = heads // HB, slots // BI
    chunk = 128 if dim % 128 == 0 else 64
    c = scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    gather, n_rows = _gather_macro(dim, threads, n_gathered=n_steps)

    @T.prim_func
    def attn_bwd_slots(
        Q: T.Tensor([batch, seq, heads, dim], bf16),
        KV: T.Tensor([batch, n_kv, dim], bf16),
        O: T.Tensor([batch, seq, heads, dim], bf16),
        dO: T.Tensor([batch, seq, heads, dim], bf16),
        Idx: T.Tensor([batch, seq, slots], "int32"),
        Lse2: T.Tensor([batch, seq, heads], f32),
        Delta: T.Tensor([batch, seq, heads], f32),
        dQ: T.Tensor([batch, seq, heads, dim], bf16),
        dKV: T.Tensor([batch, seq * n_hblk, slots, dim], bf16),
    ):
        with T.Kernel(seq * n_hblk, batch, threads=threads) as (bx, bz):
            # the last query first: queries near the start have fewer keys (trailing empty blocks are skipped), so
            # the short CTAs come last and fill the final wave
            s_i = seq - 1 - bx // n_hblk
            tile = s_i * n_hblk + bx % n_hblk  # this CTA's row of dKV
            h0 = (bx % n_hblk) * HB
            q_s = T.alloc_shared([HB, dim], bf16)
            do_s = T.alloc_shared([HB, dim], bf16)
            kv_s = T.alloc_shared([BI, dim], bf16)
            p_s = T.alloc_shared([HB, BI], bf16)
            ds_s = T.alloc_shared([HB, BI], bf16)
            st_s = T.alloc_shared([BI, chunk], bf16)  # staging of the kv-gradient stores
            idx_s = T.alloc_shared([slots], "int32")
            delta_s = T.alloc_shared([HB], f32)
            rows = T.alloc_local([n_rows], "int32")
            n_valid = T.alloc_local([1], "int32")
            acc_s = T.alloc_fragment([HB, BI], f32)
            acc_dp = T.alloc_fragment([HB, BI], f32)
            acc_dkv = T.alloc_fragment([BI, chunk], f32)
            acc_dq = T.alloc_fragment([HB, dim], f32)
            part = T.alloc_fragment([HB, DC], f32)
            part_sum = T.alloc_fragment([HB], f32)
            delta_acc = T.alloc_fragment([HB], f32)
            lse = T.alloc_fragment([HB], f32)
            delta = T.alloc_fragment([HB], f32)
            # swizzled: the fragment-to-shared copy is free of bank conflicts (a plain [64, 128] tile is not)
            T.annotate_layout({st_s: tilelang.layout.make_swizzled_layout(st_s)})

            tx = T.get_thread_binding()
            # the index row first, so that the first block's gather is in flight while Q and dO load
            T.copy(Idx[bz, s_i, :], idx_s)
            T.sync_threads()
            gather(KV, idx_s, rows, kv_s, bz, 0, tx)
            T.copy(Q[bz, s_i, h0 : h0 + HB, :], q_s)
            T.copy(dO[bz, s_i, h0 : h0 + HB, :], do_s)
            T.copy(Lse2[bz, s_i, h0 : h0 + HB], lse)
            # the blocks up to the last key: a block of empty slots adds nothing to dQ and has no kv gradient to
            # store (the row sum skips empty slots), so the trailing ones are skipped.  One barrier-vote per block
            # (the kernel's shared memory is at the 227 KB limit: no room for a shared counter)
            n_valid[0] = 0
            for blk in T.serial(n_steps):
                if T.call_extern("int32", "__syncthreads_or", T.Cast("int32", idx_s[blk * BI + tx % BI] >= 0)) != 0:
                    n_valid[0] = blk + 1
            _delta_rows(dO, O, bz, s_i, h0, dim, part, part_sum, delta_acc, delta_s, Delta, delta)
            T.fill(acc_dq, 0)

            for it in T.serial(n_steps):
                if it < n_valid[0]:
                    T.ptx_wait_group(0)  # this block's rows have landed
                    T.sync_threads()
                    T.gemm(q_s, kv_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                    T.gemm(do_s, kv_s, acc_dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                    _probabilities_and_ds(acc_s, acc_dp, idx_s, it * BI, lse, delta, c, scale)
                    T.copy(acc_s, p_s)
                    T.copy(acc_dp, ds_s)
                    T.gemm(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                    T.sync_threads()  # every warp is done with kv_s: the next block's rows may land there
                    if it + 1 < n_valid[0]:
                        gather(KV, idx_s, rows, kv_s, bz, it + 1, tx)
                    for cn in T.unroll(dim // chunk):
                        T.gemm(ds_s, q_s[:, cn * chunk : cn * chunk + chunk], acc_dkv, transpose_A=True,
                               clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                        T.gemm(p_s, do_s[:, cn * chunk : cn * chunk + chunk], acc_dkv, transpose_A=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        T.copy(acc_dkv, st_s)
                        T.copy(st_s, dKV[bz, tile, it * BI : it * BI + BI, cn * chunk : cn * chunk + chunk])
            T.ptx_wait_group(0)  # a query without keys still gathered (zeros into) block 0
            T.copy(acc_dq, q_s)
            T.copy(q_s, dQ[bz, s_i, h0 : h0 + HB, :])

    return attn_bwd_slots


def _build_attn_bwd_q(batch, seq, n_kv, heads, dim, slots, threads=256, stages=2):
    # Second half of the split backward: dQ = dS · K over the gathered rows (dS already scaled).
    HB, BI = HEADS_PER_BLOCK, SLOTS_PER_BLOCK
    n_hblk, n_steps = heads // HB, slots // BI
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def attn_bwd_q(
        KV: T.Tensor([batch, n_kv, dim], bf16),
        Idx: T.Tensor([batch, seq, slots], "int32"),
        dS: T.Tensor([batch, seq, heads, slots], bf16),
        dQ: T.Tensor([batch, seq, heads, dim], bf16),
    ):
        with T.Kernel(seq * n_hblk, batch, threads=threads) as (bx, bz):
            s_i = bx // n_hblk
            h0 = (bx % n_hblk) * HB
            kv_s = T.alloc_shared([BI, dim], bf16)
            ds_s = T.alloc_shared([HB, BI], bf16)
            o_s = T.alloc_shared([HB, dim], bf16)
            acc_dq = T.alloc_fragment([HB, dim], f32)
            T.fill(acc_dq, 0)
            for it in T.Pipelined(n_steps, num_stages=stages):
                for r, d in T.Parallel(BI, dim):
                    kv_s[r, d] = KV[bz, T.max(Idx[bz, s_i, it * BI + r], 0), d]
                T.copy(dS[bz, s_i, h0 : h0 + HB, it * BI : it * BI + BI], ds_s)
                T.gemm(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc_dq, o_s)
            T.copy(o_s, dQ[bz, s_i, h0 : h0 + HB, :])

    return attn_bwd_q


def _build_indexer(batch, seq, n_idx, heads, dim, ratio, block_q=4, block_t=64, tiles=8, threads=256):
    # Qi [b, s, H, D] bf16, W [b, s, H] fp32, K [b, T, D] bf16 -> Score [b, s, T] fp32.
    # A block holds block_q queries (block_q·H rows of Qi) and walks `tiles` key tiles of block_t.
    # Query i of the call is query query_offset + i of the sequence (a chunk of a long prefill): it sees entries
    # t < (query_offset + i + 1) // ratio.  A runtime scalar, so every chunk of one length shares one build.
    BQ, BT = block_q, block_t
    M = BQ * heads
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def indexer(
        Qi: T.Tensor([batch, seq, heads, dim], bf16),
        W: T.Tensor([batch, seq, heads], f32),
        K: T.Tensor([batch, n_idx, dim], bf16),
        Score: T.Tensor([batch, seq, n_idx], f32),
        query_offset: T.int32,
    ):
        with T.Kernel(T.ceildiv(n_idx, BT * tiles), T.ceildiv(seq, BQ), batch, threads=threads) as (bt, bq, bz):
            q_s = T.alloc_shared([M, dim], bf16)
            k_s = T.alloc_shared([BT, dim], bf16)
            w_s = T.alloc_shared([M], f32)
            r_s = T.alloc_shared([M, BT], f32)
            acc = T.alloc_fragment([M, BT], f32)
            out = T.alloc_fragment([BQ, BT], f32)
            i0 = bq * BQ
            visible = (query_offset + i0 + BQ) // ratio  # the block's last query sees entries t < visible
            for m_, d in T.Parallel(M, dim):
                q_s[m_, d] = T.if_then_else(i0 + m_ // heads < seq, Qi[bz, i0 + m_ // heads, m_ % heads, d], 0)
            for m_ in T.Parallel(M):
                w_s[m_] = T.if_then_else(i0 + m_ // heads < seq, W[bz, i0 + m_ // heads, m_ % heads], 0)
            for tt in T.serial(tiles):
                t0 = (bt * tiles + tt) * BT
                if t0 < visible:
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
                                t0 + t < (query_offset + i0 + i + 1) // ratio, out[i, t], -T.infinity(f32)
                            )
                else:
                    for i, t in T.Parallel(BQ, BT):
                        if i0 + i < seq and t0 + t < n_idx:
                            Score[bz, i0 + i, t0 + t] = -T.infinity(f32)

    return indexer


# ----------------------------------------------------------------------------------------------
# Compilation cache and launchers
# ----------------------------------------------------------------------------------------------

def _compile(program, fast_math: bool = False):
    # name the architecture: Hopper needs the "a" variant (sm_90a) for wgmma
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
    configs = {**_PASS_CONFIGS, "tl.enable_fast_math": True} if fast_math else _PASS_CONFIGS
    return tilelang.compile(program, target={"kind": "cuda", "arch": arch}, pass_configs=configs)


def _device_key(t: torch.Tensor):
    return (t.device.type, t.device.index if t.device.index is not None else torch.cuda.current_device())


def _attn_fwd_kernel(b, s, n, h, d, k, scale, device):
    """The TileLang forward kernel for one shape, built once per process."""
    shape = (b, s, n, h, d, k, float(scale))
    return _cached(("attn", shape, "bfloat16", device, "fwd"), lambda: _compile(_build_attn_fwd(*shape), fast_math=True))


def backward_mode() -> str:
    """``deterministic`` (default: per-slot kv gradients summed by row in a fixed order) or ``atomic``
    (``DS41_SPARSE_BWD=atomic``: fp32 atomics, faster at some shapes, not bit-deterministic)."""
    mode = os.environ.get("DS41_SPARSE_BWD", "deterministic")
    if mode not in ("deterministic", "atomic"):
        raise ValueError(f"DS41_SPARSE_BWD must be 'deterministic' or 'atomic', got {mode!r}")
    return mode


# The deterministic backward's per-slot kv gradients of one chunk of queries stay under this many bytes
# (2.7 GB holds s 4096 at the V4.1 shape, 640 slots x 512 in one chunk; longer rows run in several chunks).
SLOT_GRAD_BYTES = 3 << 30


def slot_chunk(s: int, h: int, k: int, d: int) -> int:
    """Queries per chunk of the deterministic backward: all ``s`` when their per-slot gradients
    ([s·h/64, k, d] bf16) fit in ``SLOT_GRAD_BYTES``, else the largest multiple of 64 that does."""
    per_query = (h // HEADS_PER_BLOCK) * k * d * 2
    fit = SLOT_GRAD_BYTES // per_query
    return s if fit >= s else max(64, fit // 64 * 64)


def slot_chunks(s: int, h: int, k: int, d: int) -> list:
    """The query ranges ``(q0, q1)`` of one batch row that the deterministic backward runs one at a time."""
    chunk = slot_chunk(s, h, k, d)
    return [(q0, min(q0 + chunk, s)) for q0 in range(0, s, chunk)]


def _attn_bwd_slot_kernels(b, s, n, h, d, k, scale, device) -> dict:
    """The deterministic backward's first kernel for one shape, built once per process: ``{queries: kernel}`` for
    each chunk length of ``slot_chunks``, called as ``kernel(q, kv, o, do, idx, lse2, delta, dq, slot_grads)`` on
    that many queries of one batch row.  At head dim 512 on Hopper the CUDA kernel of ``sparse_attention_cuda_bwd``
    (one for every length), else one TileLang ``_build_attn_bwd_slots`` kernel per length."""
    if cuda_backward_usable(d, k, torch.device(*device)):
        cuda_backward_kernel(k)  # built now (warm-up), found later
        run = functools.partial(sparse_attention_slot_grads_cuda, scale=float(scale))
        return {q1 - q0: run for q0, q1 in slot_chunks(s, h, k, d)}
    return {q1 - q0: _attn_bwd_slot_kernel_tilelang(q1 - q0, n, h, d, k, scale, device)
            for q0, q1 in slot_chunks(s, h, k, d)}


def _attn_bwd_slot_kernel_tilelang(queries, n, h, d, k, scale, device):
    """The TileLang ``_build_attn_bwd_slots`` kernel over ``queries`` queries of one batch row, built once per process."""
    row = (1, queries, n, h, d, k, float(scale))
    return _cached(("attn", row, "bfloat16", device, "bwd_slots"), lambda: _compile(_build_attn_bwd_slots(*row)))


def _attn_bwd_atomic_kernels(b, s, n, h, d, k, scale, device) -> tuple:
    """(Δ/dS/dKV-by-atomics kernel, dQ kernel) of ``DS41_SPARSE_BWD=atomic`` for one shape, built once per process."""
    shape = (b, s, n, h, d, k, float(scale))
    base = ("attn", shape, "bfloat16", device)
    return (_cached(base + ("bwd_kv",), lambda: _compile(_build_attn_bwd_kv(*shape))),
            _cached(base + ("bwd_q",), lambda: _compile(_build_attn_bwd_q(*shape[:6]))))


def _attn_bwd_kernels(b, s, n, h, d, k, scale, device, mode) -> list:
    """Every backward kernel of one shape in ``mode`` (``backward_mode()``), built once per process."""
    if mode == "deterministic":  # distinct kernels (the CUDA one serves every chunk length)
        return list({id(kernel): kernel for kernel in _attn_bwd_slot_kernels(b, s, n, h, d, k, scale, device).values()}.values())
    return list(_attn_bwd_atomic_kernels(b, s, n, h, d, k, scale, device))


if triton is not None:

    @triton.jit
    def _segment_sum_kernel(G, Order, Start, Out, n_rows, D: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_P: tl.constexpr, STAGES: tl.constexpr, ACCUMULATE: tl.constexpr):
        # one program per kv row of one batch row: Out[row] = Σ G[Order[p]] for p in [Start[row], Start[row + 1]).
        # acc[i] sums entries i, i + BLOCK_P, i + 2·BLOCK_P, ... in p order (the query order), elementwise, so the
        # loop has no cross-thread reduction and its loads pipeline (STAGES); one fixed tree over i at the end.
        # The same sums in the same order on every run.  ACCUMULATE: Out[row] (fp32, the earlier query chunks'
        # sum) plus this chunk's sum.
        row = tl.program_id(0)
        lo = tl.load(Start + row)
        hi = tl.load(Start + row + 1)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
        for step in tl.range(0, tl.cdiv(hi - lo, BLOCK_P), num_stages=STAGES):
            pp = lo + step * BLOCK_P + tl.arange(0, BLOCK_P)
            pmask = pp < hi
            src = tl.load(Order + pp, mask=pmask, other=0)
            tile = tl.load(G + src[:, None] * D + cols[None, :], mask=pmask[:, None] & cmask[None, :], other=0.0)
            acc += tile.to(tl.float32)
        total = tl.sum(acc, axis=0)
        if ACCUMULATE:
            total = tl.load(Out + row.to(tl.int64) * D + cols, mask=cmask, other=0.0).to(tl.float32) + total
        tl.store(Out + row.to(tl.int64) * D + cols, total.to(Out.dtype.element_ty), mask=cmask)


def _reduce_slot_grads(g: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, accumulate=False, block_p=8,
                       num_warps=4, stages=3) -> None:
    """out[r] = Σ g over every (query, head block, slot) whose idx is r, in query order (bit-deterministic).

    g [s·G, k, d] bf16 per-slot gradients of one batch row or query chunk (G head blocks per query), idx
    [s, k] int32 (-1 = empty slot, skipped), out [n, d] (written in its dtype; ``accumulate``: added to its
    fp32 values).  A stable sort of the row numbers gives each row its entries in query order (a counting
    sort by row), then one Triton program sums a row.  H200, s 4096 x 640 slots x 512 (2026-12-02, from a sweep
    of block_p 8-32, 4-8 warps, 1-3 stages and column splits): 8 entries a step, 4 warps, 3 stages read the
    per-slot rows at 4.3 TB/s (0.63 ms), against 2.4 TB/s for a sum across threads at every step."""
    s, k = idx.shape
    n, d = out.shape
    heads_blocks = g.shape[0] // s
    # 16-bit keys where the rows allow it: the radix sort then makes half the passes (H200, s 4096 x 640 slots,
    # 2026-12-02: 0.12 against 0.18 ms)
    key_dtype = torch.int16 if n < torch.iinfo(torch.int16).max else torch.int32
    keys = torch.where(idx >= 0, idx, n).to(key_dtype).unsqueeze(1).expand(s, heads_blocks, k).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    start = torch.searchsorted(sorted_keys, torch.arange(n + 1, device=idx.device, dtype=sorted_keys.dtype))
    _segment_sum_kernel[(n,)](g, order, start, out, n, D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_P=block_p,
                              STAGES=stages, ACCUMULATE=accumulate, num_warps=num_warps)


def _attention_forward(q, kv, idx, sink2, scale):
    """o, lse2 from padded inputs (H % 64 == 0, k % 64 == 0): the CUDA kernel at head dim 512 on Hopper
    (``sparse_attention_cuda``), the TileLang kernel otherwise or with ``DS41_SPARSE_FWD=tilelang``."""
    b, s, h, d = q.shape
    n, k = kv.shape[1], idx.shape[2]
    if cuda_forward_usable(d, k, q.device):
        return sparse_attention_forward_cuda(q, kv, idx, sink2, scale)
    o = torch.empty_like(q)
    lse2 = torch.empty((b, s, h), dtype=torch.float32, device=q.device)
    _attn_fwd_kernel(b, s, n, h, d, k, scale, _device_key(q))(q, kv, idx, sink2, o, lse2)
    return o, lse2


def _pad_heads(x: torch.Tensor, heads_padded: int) -> torch.Tensor:
    # x [b, s, h, ...] -> [b, s, heads_padded, ...] with zero heads (exact, see the module docstring)
    if x.shape[2] == heads_padded:
        return x.contiguous()
    pad = x.new_zeros(x.shape[:2] + (heads_padded - x.shape[2],) + x.shape[3:])
    return torch.cat([x, pad], dim=2).contiguous()


def _check_attn_inputs(q, kv, sink, idx):
    if q.dim() != 4 or kv.dim() != 3 or idx.dim() != 3 or sink.dim() != 1:
        raise ValueError(
            "sparse_attention_tilelang expects q [b, s, h, d], kv [b, n, d], sink [h], idx [b, s, k]; got "
            f"q {tuple(q.shape)}, kv {tuple(kv.shape)}, sink {tuple(sink.shape)}, idx {tuple(idx.shape)}"
        )
    b, s, h, d = q.shape
    if kv.shape[0] != b or kv.shape[2] != d or idx.shape[:2] != (b, s) or sink.shape[0] != h:
        raise ValueError(
            f"sparse_attention_tilelang: inconsistent shapes q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
            f"sink {tuple(sink.shape)}, idx {tuple(idx.shape)}"
        )
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise TypeError(
            f"sparse_attention_tilelang needs bfloat16 q and kv (got {q.dtype}, {kv.dtype}); "
            "cast them or use attn backend 'torch'"
        )
    if d % 64 != 0 or d > 512:
        raise ValueError(f"sparse_attention_tilelang needs a head dim that is a multiple of 64 and <= 512, got {d}")
    if not (q.is_cuda and kv.is_cuda and idx.is_cuda and sink.is_cuda):
        raise ValueError("sparse_attention_tilelang needs q, kv, sink and idx on the same CUDA device")


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, sink, idx, scale):
        b, s, h = q.shape[:3]
        k = idx.shape[2]
        hp = -(-h // HEADS_PER_BLOCK) * HEADS_PER_BLOCK
        kp = -(-k // SLOTS_PER_BLOCK) * SLOTS_PER_BLOCK
        qp = _pad_heads(q, hp)
        if kp == k:
            idxp = idx.to(torch.int32).contiguous()
        else:
            idxp = torch.full((b, s, kp), -1, dtype=torch.int32, device=q.device)
            idxp[:, :, :k] = idx
        sink2 = torch.zeros(hp, dtype=torch.float32, device=q.device)
        sink2[:h] = sink.float() * LOG2E
        kvc = kv.contiguous()
        o, lse2 = _attention_forward(qp, kvc, idxp, sink2, scale)
        ctx.save_for_backward(qp, kvc, sink, sink2, idxp, o, lse2)
        ctx.scale, ctx.h = scale, h
        return o[:, :, :h] if hp != h else o

    @staticmethod
    def backward(ctx, do):
        qp, kv, sink, sink2, idxp, o, lse2 = ctx.saved_tensors
        h = ctx.h
        b, s, hp, d = qp.shape
        n, kp = kv.shape[1], idxp.shape[2]
        mode = backward_mode()
        device = _device_key(qp)
        dop = _pad_heads(do.to(qp.dtype), hp)
        delta = torch.empty((b, s, hp), dtype=torch.float32, device=qp.device)  # Δ = rowsum(dO·O)
        dq = torch.empty_like(qp)
        if mode == "deterministic":
            # one batch row and at most `chunk` queries at a time bound the per-slot buffer (SLOT_GRAD_BYTES);
            # several chunks add up in an fp32 dkv, in chunk order
            kernels = _attn_bwd_slot_kernels(b, s, n, hp, d, kp, ctx.scale, device)
            chunks, groups = slot_chunks(s, hp, kp, d), hp // HEADS_PER_BLOCK
            dkv = torch.empty((b, n, d), dtype=kv.dtype if len(chunks) == 1 else torch.float32, device=qp.device)
            slot_grads = torch.empty((max(kernels) * groups, kp, d), dtype=qp.dtype, device=qp.device)
            for r in range(b):
                for q0, q1 in chunks:
                    sl, part, grads = slice(r, r + 1), slice(q0, q1), slot_grads[: (q1 - q0) * groups]
                    kernels[q1 - q0](qp[sl, part], kv[sl], o[sl, part], dop[sl, part], idxp[sl, part], lse2[sl, part],
                                     delta[sl, part], dq[sl, part], grads.unsqueeze(0))
                    _reduce_slot_grads(grads, idxp[r, part], dkv[r], accumulate=q0 > 0)
        else:
            bwd_kv, bwd_q = _attn_bwd_atomic_kernels(b, s, n, hp, d, kp, ctx.scale, device)
            ds = torch.empty((b, s, hp, kp), dtype=qp.dtype, device=qp.device)
            dkv = torch.zeros((b, n, d), dtype=torch.float32, device=qp.device)
            bwd_kv(qp, kv, o, dop, idxp, lse2, delta, ds, dkv)
            bwd_q(kv, idxp, ds, dq)
        # the sink's softmax probability p = exp2(sink·log2e − lse2) gets dlogit = p·(0 − Δ)
        p_sink = torch.exp2(sink2.view(1, 1, hp) - lse2)[..., :h]
        dsink = -(p_sink * delta[..., :h]).sum(dim=(0, 1))
        dq = dq[:, :, :h] if hp != h else dq
        return dq, dkv.to(kv.dtype), dsink.to(sink.dtype), None, None


def sparse_attention_tilelang(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> torch.Tensor:
    """TileLang version of ``sparse_attention_torch`` (same arguments, same result, differentiable).

    q [b, s, h, d] bf16, kv [b, n, d] bf16, sink [h] fp32, idx [b, s, k] int (-1 = empty slot,
    otherwise a row of kv in [0, n)), scale: softmax scale -> o [b, s, h, d] bf16.
    Gradients flow to q, kv and sink.
    """
    _require_tilelang()
    _check_attn_inputs(q, kv, sink, idx)
    return _SparseAttention.apply(q, kv, sink, idx, float(scale))


def indexer_scores_tilelang(
    q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, ratio: int, query_offset: int = 0
) -> torch.Tensor:
    """TileLang version of ``indexer_scores_torch`` (forward only: the indexer is frozen).

    q [b, s, H, D] bf16, weights [b, s, H], index_k [b, T, D] bf16 -> scores [b, s, T] fp32 with
    ``-inf`` where ``t >= (query_offset + i + 1) // ratio`` (``query_offset``: the first query's position when q
    is a chunk of a longer prefill's queries).
    """
    _require_tilelang()
    if q.dim() != 4 or weights.shape != q.shape[:3] or index_k.dim() != 3 or index_k.shape[::2] != q.shape[::3]:
        raise ValueError(
            "indexer_scores_tilelang expects q [b, s, H, D], weights [b, s, H], index_k [b, T, D]; got "
            f"{tuple(q.shape)}, {tuple(weights.shape)}, {tuple(index_k.shape)}"
        )
    if q.dtype != torch.bfloat16 or index_k.dtype != torch.bfloat16:
        raise TypeError(f"indexer_scores_tilelang needs bfloat16 q and index_k (got {q.dtype}, {index_k.dtype})")
    b, s, H, D = q.shape
    n_idx = index_k.shape[1]
    if not 0 <= query_offset < 2**31 - s:  # an int32 in the kernel
        raise ValueError(f"indexer_scores_tilelang: query_offset {query_offset} must be in [0, 2**31 - s)")
    if 128 % H != 0 or D % 16 != 0:
        raise ValueError(f"indexer_scores_tilelang needs 128 % heads == 0 and dim % 16 == 0, got H={H}, D={D}")
    kernel = _indexer_kernel(b, s, n_idx, H, D, int(ratio), _device_key(q))
    out = torch.empty((b, s, n_idx), dtype=torch.float32, device=q.device)
    kernel(q.contiguous(), weights.float().contiguous(), index_k.contiguous(), out, int(query_offset))
    return out


def _indexer_kernel(b, s, n_idx, H, D, ratio, device):
    shape = (b, s, n_idx, H, D, ratio)
    return _cached(
        ("indexer", shape, "bfloat16", device), lambda: _compile(_build_indexer(*shape, block_q=128 // H))
    )


def warmup_tilelang_kernels(shapes: list, device=None) -> int:
    """Compiles the kernels for the given shapes ahead of time; returns how many were built or found.

    Each entry is a dict.  Attention: ``{"b", "s", "n", "h", "d", "k", "scale"}`` (``k`` = index
    slots before padding) builds the forward and backward kernels.  Indexer:
    ``{"kind": "indexer", "b", "s", "T", "H", "D", "ratio"}``.
    """
    _require_tilelang()
    device = torch.device(device if device is not None else "cuda")
    with torch.cuda.device(device):
        dev = ("cuda", torch.cuda.current_device())
        count = 0
        for spec in shapes:
            if not isinstance(spec, dict):
                raise TypeError(
                    f"warmup_tilelang_kernels takes one dict per kernel shape, got {spec!r}; "
                    "tilelang_shapes_for(config, batch, seq) builds them from a text config"
                )
            if spec.get("kind", "attention") == "indexer":
                _indexer_kernel(spec["b"], spec["s"], spec["T"], spec["H"], spec["D"], int(spec["ratio"]), dev)
                count += 1
                continue
            hp = -(-spec["h"] // HEADS_PER_BLOCK) * HEADS_PER_BLOCK
            kp = -(-spec["k"] // SLOTS_PER_BLOCK) * SLOTS_PER_BLOCK
            shape = (spec["b"], spec["s"], spec["n"], hp, spec["d"], kp, spec["scale"])
            if cuda_forward_usable(spec["d"], kp, device):
                cuda_forward_kernel(padded_slots(kp))
            else:
                _attn_fwd_kernel(*shape, dev)
            count += 1 + len(_attn_bwd_kernels(*shape, dev, backward_mode()))
    return count


def tilelang_shapes_for(config, batch: int, seq: int) -> list:
    """The ``warmup_tilelang_kernels`` specs that a text config needs for one [batch, seq] micro-batch."""
    from .attention import indexer_query_chunk

    h, d = config.num_attention_heads, config.head_dim
    specs = []
    for ratio in sorted(set(config.compress_ratios[: config.num_hidden_layers])):
        n_comp = seq // ratio if ratio else 0
        k = config.sliding_window + min(config.index_topk, n_comp)
        specs.append({"b": batch, "s": seq, "n": seq + n_comp, "h": h, "d": d, "k": k, "scale": d**-0.5})
        if ratio and n_comp:  # a long prefill's indexer goes in chunks of queries, all of one length
            specs.append({"kind": "indexer", "b": batch, "s": indexer_query_chunk(batch, seq, n_comp), "T": n_comp,
                          "H": config.index_n_heads, "D": config.index_head_dim, "ratio": ratio})
    return specs
