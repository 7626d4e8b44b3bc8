"""CSA2 sparse attention backward, first kernel of the deterministic backward, for head dim 512 on Hopper (sm_90a).

Same contract as ``kernels_tilelang._build_attn_bwd_slots``, which the ``attn: tilelang`` backend runs for other
head dims, other GPUs, or with ``DS41_SPARSE_BWD_SLOTS=tilelang``: per (query, 64 heads) it writes
``Δ = rowsum(dO·O)`` (fp32), dQ (bf16) and each slot's kv gradient ``dSᵀQ + PᵀdO`` (bf16, one [k, 512] tile per
query and head block), which ``kernels_tilelang._reduce_slot_grads`` then sums into kv rows in a fixed order.
``P = exp2(logit·scale·log2e − lse2)`` is recomputed from the forward's ``lse2``; ``dS = P·(dP − Δ)·scale`` in fp32,
rounded to bf16 like P before the products.  No atomics: the same inputs give the same bits on every run.

Why CUDA: the TileLang kernel splits each 64 x 64 logit tile of a 64-slot block across its two warpgroups as two
64 x 32 halves, each read against the whole of Q or dO from shared memory, and synchronises every warp at each
step.  Here one CTA has three warpgroups:

* warpgroup 2 gathers the block's kv rows with cp.async, in two 256-column halves with their own ready / empty
  mbarriers, and refills a half for the next block as soon as the warpgroup that owns it has finished its dQ;
* warpgroup 0 computes S = Q·Kᵀ and warpgroup 1 dP = dO·Kᵀ, each as one 64 x 64 tile over all 512 columns
  (half the shared-memory reads per FLOP of a 64 x 32 tile); warpgroup 0 turns S into P in fp32 and hands it to
  warpgroup 1 through shared memory (the bytes of the bf16 P and dS tiles, free at that point), which forms dS;
* warpgroup w then owns columns 256w .. 256w + 255: dQ += dS·K for them (its accumulator stays in registers for
  the whole query), and the slots' kv gradients dSᵀQ + PᵀdO for them, 128 columns at a time, stored straight
  from the accumulators while the producer already gathers the next block.

Blocks after the query's last key are skipped (nothing to add to dQ, and the row sum never reads an empty slot's
tile) and CTAs take the queries last first, as in the TileLang kernel.  Shared memory: Q, dO and one kv block
(64 KB each), P and dS (8 KB each) and the index row.

H200, V4.1 shape (s 4096, 64 heads, 640 slots, FLOP 10·s·h·k·d over all slots): 2.22-2.27 ms, 379-386 TFLOP/s, against
2.49-2.52 ms for the TileLang kernel in the same process at ratio 1 (1.11x), 2.16-2.18 against 2.41-2.43 at ratio 2;
dQ and the slot gradients 1.5e-5 and 0.7-1.1e-5 apart (relative L2) (``attention_bwd_ab.py``, ``attention.py
--kernels``, three leases).  ncu: tensor pipe 38 % busy, shared memory 61 %: the warpgroups wait on each other's steps
and on the wgmma pipeline, not on bandwidth.  Issuing the next block's S while the last column tile is stored was
slower; probes and figures in ``examples/benchmarks/results/attention_h200.txt``.
"""

import ctypes
import os
import threading

import torch

from .cuda_module import CudaKernel, compile_cubin
from .sparse_attention_cuda import HEAD_DIM, HEADS_PER_CTA, HELPERS, LOG2E, _cutlass_include

SLOTS_PER_BLOCK = 64  # idx is padded to a multiple of 64 slots by the caller
# shared memory before the index row: Q, dO and K 3·64·512·2, P and dS 2·64·64·2, lse and Δ 2·64·4, 4 mbarriers,
# the count of slots up to the last key (16 bytes kept); 1 KB more aligns the buffers to 1024 bytes for the swizzle
_SMEM_FIXED = 3 * 65536 + 2 * 8192 + 512 + 32 + 16
_SMEM_MAX = 227 * 1024
MAX_SLOTS = (_SMEM_MAX - _SMEM_FIXED - 1024) // 4 // SLOTS_PER_BLOCK * SLOTS_PER_BLOCK

_kernels: dict = {}
_lock = threading.Lock()

_SOURCE = HELPERS + r"""
namespace csa2 {

// The query's index row -> shared memory (all 384 threads), and 1 + its last slot holding a key (0: none) ->
// *n_valid, a shared int that thread 0 zeroed before the kernel's first __syncthreads.
__device__ __forceinline__ void load_index_row(const int* idx_row, int* dst, int slots, int* n_valid, int tid) {
  int last = 0;
  for (int i = tid; i < slots; i += 384) {
    const int row = idx_row[i];
    dst[i] = row;
    if (row >= 0) last = i + 1;
  }
  __syncthreads();
  if (last > 0) atomicMax(n_valid, last);
  __syncthreads();
}

// A warpgroup's 64 x 256 bf16 half staged in shared memory (K-major, swizzled) -> 64 global rows of stride D from
// dst, one 16-byte store per chunk (the accumulators' own layout would give 4-byte stores)
__device__ __forceinline__ void store_staged_half(bf16* dst, const bf16* stage, int t) {
  for (int u = t; u < BH * HALF / 8; u += 128) {
    const int r = u / (HALF / 8), col = (u % (HALF / 8)) * 8;
    *reinterpret_cast<uint4*>(dst + r * D + col) = *reinterpret_cast<const uint4*>(stage + swz(r, col));
  }
}

// a 64 x 64 K-major tile (P, dS, or one 64-column tile of Q or dO) read as its transpose, the row index contiguous:
// the operands of dS^T Q and P^T dO, whose contraction runs over the heads
using LayoutPT = decltype(composition(LayoutP{}, make_layout(Shape<_64, _64>{}, Stride<_64, _1>{})));
using MmaKV = decltype(make_tiled_mma(GMMA::MMA_64x64x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{}));

struct alignas(1024) SmemBwd {
  bf16 q[BH * D];     // Q as two 64 x 256 halves; warpgroup w stages its half of dQ in half w at the end
  bf16 dout[BH * D];  // dO, the same layout
  bf16 k[BK * D];     // the block's gathered kv rows, two halves
  bf16 p[BH * BK];    // P in bf16 (heads x slots); with ds: P in fp32 from warpgroup 0 to warpgroup 1
  bf16 ds[BH * BK];   // dS in bf16
  float lse[BH];      // lse2 of the forward
  float delta[BH];    // rowsum(dO O)
  uint64_t ready[2];  // [half]: the gather landed
  uint64_t empty[2];  // [half]: warpgroup `half` has finished its dQ, the producer may refill
  int n_valid;        // 1 + the last slot that holds a key (0: none)
  int idx[1];         // the query's index row, `slots` entries (dynamic tail)
};
static_assert(offsetof(SmemBwd, idx) <= SMEM_FIXED, "the launch's shared-memory size is too small");

// named barriers between the two math warpgroups (0 is __syncthreads)
enum : int { BB_Q = 1, BB_FREE = 2, BB_PF = 3, BB_X = 4, BB_PD = 5, BB_DQ0 = 6, BB_DQ1 = 7 };

}  // namespace csa2

using namespace csa2;

// q, o, dout [b, s, H, 512] bf16, kv [b, n, 512] bf16, idx [b, s, slots] int32 (-1: empty), lse2 [b, s, H] fp32
// -> delta [b, s, H] fp32, dq [b, s, H, 512] bf16, dkv [b, s * H / 64, slots, 512] bf16 (tile s_i * H / 64 + g holds
// the slots of query s_i and heads 64 g .. 64 g + 63).  grid (s * H / 64, b), 384 threads: warpgroups 0 and 1
// compute, warpgroup 2 gathers.  slots % 64 == 0; c = scale * log2 e.
extern "C" __global__ void __launch_bounds__(384, 1)
    csa2_sparse_attn_bwd_slots_d512(const bf16* __restrict__ q, const bf16* __restrict__ kv, const bf16* __restrict__ o,
                                    const bf16* __restrict__ dout, const int* __restrict__ idx,
                                    const float* __restrict__ lse2, float* __restrict__ delta, bf16* __restrict__ dq,
                                    bf16* __restrict__ dkv, int seq, int n_kv, int heads, int slots, float c,
                                    float scale) {
  extern __shared__ __align__(1024) char smem_raw[];
  SmemBwd& sm = *reinterpret_cast<SmemBwd*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int n_hblk = heads / BH;
  // the last query first: the first queries have fewer keys (trailing empty blocks are skipped), so the short CTAs
  // come last and fill the final wave
  const int s_i = seq - 1 - (int)blockIdx.x / n_hblk, hb = blockIdx.x % n_hblk, b = blockIdx.y;
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffff, tid / 128, 0), t = tid % 128;
  const int64_t row_qh = ((int64_t)b * seq + s_i) * heads + hb * BH;  // this CTA's first (query, head) row
  const int* idx_row = idx + ((int64_t)b * seq + s_i) * slots;
  bf16* dkv_tile = dkv + (((int64_t)b * seq + s_i) * n_hblk + hb) * slots * D;

  if (tid == 0) {
    for (int h = 0; h < 2; ++h) {
      mbar_init(&sm.ready[h], 128);
      mbar_init(&sm.empty[h], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    sm.n_valid = 0;
  }
  load_index_row(idx_row, sm.idx, slots, &sm.n_valid, tid);
  // blocks up to the last key, warp-uniform through a shuffle
  const int n_blocks = __shfl_sync(0xffffffff, (sm.n_valid + BK - 1) / BK, 0);

  if (wg == 2) {
    // producer: thread t copies 16-byte chunk j of a 128-byte tile row, for rows g, g + 16, g + 32, g + 48
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    const int j = t % 8, g = t / 8;
    const bf16* kv_b = kv + (int64_t)b * n_kv * D + j * 8;
    for (int blk = 0; blk < n_blocks; ++blk) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        mbar_wait(&sm.empty[half], (blk & 1) ^ 1);  // a fresh barrier passes the wait on parity 1
        gather_half(sm.k + half * (BK * HALF), kv_b, sm.idx, blk, g, j, half, [](int) {});
        cp_async_arrive(&sm.ready[half]);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const bf16* q_blk = q + row_qh * D;
  const bf16* do_blk = dout + row_qh * D;
  // Q and dO -> shared, swizzled; 256 threads x 2 x 16 chunks of 16 bytes
  for (int u = tid; u < BH * D / 8; u += 256) {
    const int r = u / (D / 8), col = (u % (D / 8)) * 8, at = (col / HALF) * (BH * HALF) + swz(r, col % HALF);
    cp_async16(sm.q + at, q_blk + r * D + col, true);
    cp_async16(sm.dout + at, do_blk + r * D + col, true);
  }
  {  // delta = rowsum(dO O) in fp32: thread = (head tid / 4, columns 128 (tid % 4) ..), then the quad, in a fixed order
    const int r = tid / 4, c0 = (tid % 4) * 128;
    const uint4* pd = reinterpret_cast<const uint4*>(do_blk + r * D + c0);
    const uint4* po = reinterpret_cast<const uint4*>(o + (row_qh + r) * D + c0);
    float acc = 0.f;
    CUTE_UNROLL
    for (int u = 0; u < 16; ++u) {
      const uint4 x = pd[u], y = po[u];
      const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
      const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(&y);
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const float2 xf = __bfloat1622float2(x2[e]), yf = __bfloat1622float2(y2[e]);
        acc = fmaf(xf.x, yf.x, acc);
        acc = fmaf(xf.y, yf.y, acc);
      }
    }
    acc += __shfl_xor_sync(0xffffffff, acc, 1);
    acc += __shfl_xor_sync(0xffffffff, acc, 2);
    if (tid % 4 == 0) {
      sm.delta[r] = acc;
      delta[row_qh + r] = acc;
      sm.lse[r] = lse2[row_qh + r];
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  fence_async_smem();
  bar_sync(BB_Q, 256);

  MmaQK mma_s;        // S = Q K^T (warpgroup 0) or dP = dO K^T (warpgroup 1), 64 x 64
  MmaPVsmem mma_dq;   // dQ half += dS K half, 64 x 256
  MmaKV mma_kv;       // slot gradients of 64 columns, 64 x 64
  auto thr_s = mma_s.get_slice(t);
  auto thr_dq = mma_dq.get_slice(t);
  auto thr_kv = mma_kv.get_slice(t);
  Tensor acc_s = partition_fragment_C(mma_s, Shape<_64, _64>{});     // 32 fp32: S -> P, or dP -> dS
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<_64, _256>{});  // 128 fp32: this warpgroup's dQ columns
  Tensor acc_kv0 = partition_fragment_C(mma_kv, Shape<_64, _64>{});  // 32 fp32 each: one column tile's slot
  Tensor acc_kv1 = partition_fragment_C(mma_kv, Shape<_64, _64>{});  // gradients while the other is stored
  Tensor coord = thr_s.partition_C(make_identity_tensor(Shape<_64, _64>{}));  // (head row, slot column) of i
  clear(acc_dq);
  // element i of a 64 x N accumulator is on row row0 + 8 ((i / 2) % 2), column 2 (t % 4) + 8 (i / 4) + i % 2
  const int row0 = get<0>(coord(0)), row1 = row0 + 8;
  const bf16* a_src = wg == 0 ? sm.q : sm.dout;
  float* xchg = reinterpret_cast<float*>(sm.p);  // P in fp32, element i of thread t at [i * 128 + t]

  // acc_s = A K^T over the two halves as they land
  auto s_or_dp = [&](int blk) __attribute__((always_inline)) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      mbar_wait(&sm.ready[half], blk & 1);
      Tensor tA = thr_s.partition_fragment_A(smem_tensor(a_src + half * (BH * HALF), LayoutHalf{}));
      Tensor tK = thr_s.partition_fragment_B(smem_tensor(sm.k + half * (BK * HALF), LayoutHalf{}));
      wgmma(mma_s, tA, tK, acc_s, half == 0);
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
  };
  // acc_s -> bf16 -> a K-major 64 x 64 tile in shared memory (P or dS), for the wgmma that read it next
  auto store_tile = [&](bf16* dst) __attribute__((always_inline)) {
    uint32_t pairs[16];
    CUTE_UNROLL
    for (int i = 0; i < 16; ++i) {
      __nv_bfloat162 v = __floats2bfloat162_rn(acc_s(2 * i), acc_s(2 * i + 1));
      pairs[i] = reinterpret_cast<uint32_t&>(v);
    }
    CUTE_UNROLL
    for (int cb = 0; cb < BK / 8; cb += 2)
      stsm_x4(dst, t, cb, pairs[2 * cb], pairs[2 * cb + 1], pairs[2 * cb + 2], pairs[2 * cb + 3]);
    fence_async_smem();
  };
  // the slots' kv gradients dS^T Q + P^T dO of this warpgroup's column tile c (64 columns) into acc
  auto dkv_mma = [&](auto& acc, int c) __attribute__((always_inline)) {
    const int at = wg * (BH * HALF) + c * (BH * 64);
    Tensor tDS = thr_kv.partition_fragment_A(smem_tensor(sm.ds, LayoutPT{}));
    Tensor tQ = thr_kv.partition_fragment_B(smem_tensor(sm.q + at, LayoutPT{}));
    Tensor tP = thr_kv.partition_fragment_A(smem_tensor(sm.p, LayoutPT{}));
    Tensor tDO = thr_kv.partition_fragment_B(smem_tensor(sm.dout + at, LayoutPT{}));
    warpgroup_fence_operand(acc);
    wgmma(mma_kv, tDS, tQ, acc, true);
    wgmma(mma_kv, tP, tDO, acc, false);
    warpgroup_commit_batch();
  };
  // acc (64 slots x 64 columns) -> bf16 -> global: each quad's words of four 8-column groups transposed so that a
  // lane stores one group's 16 bytes (a warp's store fills whole 64-byte row pieces, not half sectors)
  auto dkv_store = [&](auto& acc, int blk, int c) __attribute__((always_inline)) {
    warpgroup_fence_operand(acc);
    bf16* dst = dkv_tile + ((int64_t)blk * BK + row0) * D + wg * HALF + c * 64 + 8 * (t % 4);
    CUTE_UNROLL
    for (int m = 0; m < 2; ++m)  // groups 4m .. 4m + 3
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {  // row0, row0 + 8
        uint32_t w[4];
        CUTE_UNROLL
        for (int k = 0; k < 4; ++k) {
          __nv_bfloat162 v = __floats2bfloat162_rn(acc(16 * m + 4 * k + 2 * h), acc(16 * m + 4 * k + 2 * h + 1));
          w[k] = reinterpret_cast<uint32_t&>(v);
        }
        quad_transpose(w[0], w[1], w[2], w[3], t % 4);
        *reinterpret_cast<uint4*>(dst + h * 8 * D + 32 * m) = make_uint4(w[0], w[1], w[2], w[3]);
      }
  };
  // dQ of this warpgroup's columns += dS K, and the slot gradients of its four column tiles, each tile's products
  // running while the previous tile is stored; the kv half is released as soon as dQ has read it
  auto dq_and_dkv = [&](int blk) __attribute__((always_inline)) {
    warpgroup_fence_operand(acc_dq);
    Tensor tDS = thr_dq.partition_fragment_A(smem_tensor(sm.ds, LayoutP{}));
    Tensor tK = thr_dq.partition_fragment_B(smem_tensor(sm.k + wg * (BK * HALF), LayoutHalfT{}));
    wgmma(mma_dq, tDS, tK, acc_dq, false);
    warpgroup_commit_batch();
    dkv_mma(acc_kv0, 0);
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc_dq);
    mbar_arrive(&sm.empty[wg]);
    dkv_mma(acc_kv1, 1);
    warpgroup_wait<1>();
    dkv_store(acc_kv0, blk, 0);
    dkv_mma(acc_kv0, 2);
    warpgroup_wait<1>();
    dkv_store(acc_kv1, blk, 1);
    dkv_mma(acc_kv1, 3);
    warpgroup_wait<1>();
    dkv_store(acc_kv0, blk, 2);
    warpgroup_wait<0>();
    dkv_store(acc_kv1, blk, 3);
  };

  // one loop per warpgroup (a loop that switched roles inside makes the compiler serialise the wgmma)
  if (wg == 0) {
    const float lse_r[2] = {sm.lse[row0], sm.lse[row1]};
    for (int blk = 0; blk < n_blocks; ++blk) {
      s_or_dp(blk);
      // P = exp2(S c - lse2), 0 for an empty slot; bit j of `valid`: slot j of the block holds a key
      const int* slot_idx = sm.idx + blk * BK;
      const uint64_t valid = (uint64_t)__ballot_sync(0xffffffff, slot_idx[t % 32] >= 0) |
                             ((uint64_t)__ballot_sync(0xffffffff, slot_idx[32 + t % 32] >= 0) << 32);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i)
        acc_s(i) = ((valid >> get<1>(coord(i))) & 1) ? exp2f(fmaf(acc_s(i), c, -lse_r[(i >> 1) & 1])) : 0.f;
      if (blk > 0) bar_sync(BB_FREE, 256);  // warpgroup 1's products of the previous block no longer read P, dS
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) xchg[i * 128 + t] = acc_s(i);
      bar_arrive(BB_PF, 256);
      bar_sync(BB_X, 256);  // warpgroup 1 has read it
      store_tile(sm.p);
      bar_sync(BB_PD, 256);  // P and dS are in place
      dq_and_dkv(blk);
    }
  } else {
    const float delta_r[2] = {sm.delta[row0], sm.delta[row1]};
    for (int blk = 0; blk < n_blocks; ++blk) {
      s_or_dp(blk);
      bar_sync(BB_PF, 256);  // P in fp32 from warpgroup 0
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) = xchg[i * 128 + t] * (acc_s(i) - delta_r[(i >> 1) & 1]) * scale;
      bar_sync(BB_X, 256);
      store_tile(sm.ds);
      bar_sync(BB_PD, 256);
      dq_and_dkv(blk);
      if (blk + 1 < n_blocks) bar_arrive(BB_FREE, 256);
    }
  }

  // dQ -> bf16 -> shared (this warpgroup's half of Q: only its own products read it) -> global in 16-byte rows
  bf16* stage = sm.q + wg * (BH * HALF);
  Tensor coord_dq = thr_dq.partition_C(make_identity_tensor(Shape<_64, _256>{}));
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += 2) {
    const int r = get<0>(coord_dq(i)), col = get<1>(coord_dq(i));
    *reinterpret_cast<__nv_bfloat162*>(stage + swz(r, col)) = __floats2bfloat162_rn(acc_dq(i), acc_dq(i + 1));
  }
  bar_sync(wg ? BB_DQ1 : BB_DQ0, 128);
  store_staged_half(dq + row_qh * D + wg * HALF, stage, t);
}
""".replace("SMEM_FIXED", str(_SMEM_FIXED))


def cuda_backward_usable(d: int, slots: int, device: torch.device) -> bool:
    """Whether ``sparse_attention_slot_grads_cuda`` handles this shape on this device (else: the TileLang kernel)."""
    if os.environ.get("DS41_SPARSE_BWD_SLOTS", "cuda") == "tilelang":
        return False
    if device.type != "cuda" or d != HEAD_DIM or slots % SLOTS_PER_BLOCK or slots > MAX_SLOTS:
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def cuda_backward_kernel(slots: int) -> CudaKernel:
    """The compiled kernel for index rows of ``slots`` slots (a multiple of 64), built once per process."""
    with _lock:
        kernel = _kernels.get(slots)
        if kernel is None:
            cubin = compile_cubin(_SOURCE, [_cutlass_include()], arch="sm_90a")
            kernel = CudaKernel(cubin, "csa2_sparse_attn_bwd_slots_d512", _SMEM_FIXED + 1024 + 4 * slots)
            _kernels[slots] = kernel
        return kernel


def sparse_attention_slot_grads_cuda(q, kv, o, do, idx, lse2, delta, dq, dkv_slots, scale: float) -> None:
    """The deterministic backward's first kernel, in place: ``delta`` [b, s, H] fp32, ``dq`` [b, s, H, 512] bf16 and
    ``dkv_slots`` [b, s·H/64, k, 512] bf16 from q, o, do [b, s, H, 512] bf16 (H a multiple of 64), kv [b, n, 512]
    bf16, idx [b, s, k] int32 (k a multiple of 64, -1 = empty slot) and the forward's lse2 [b, s, H] fp32; all
    contiguous on one GPU.  Tiles of trailing blocks with no key are not written."""
    b, s, h, d = q.shape
    k = idx.shape[2]
    tensors = (q, kv, o, do, idx, lse2, delta, dq, dkv_slots)
    if d != HEAD_DIM or h % HEADS_PER_CTA or k % SLOTS_PER_BLOCK or k > MAX_SLOTS:
        raise ValueError(f"sparse_attention_slot_grads_cuda needs q [b, s, H, 512] with H % 64 == 0 and idx [b, s, k] "
                         f"with k % 64 == 0, k <= {MAX_SLOTS}; got q {tuple(q.shape)}, idx {tuple(idx.shape)}")
    if idx.dtype != torch.int32 or not all(x.is_contiguous() for x in tensors):
        raise ValueError("sparse_attention_slot_grads_cuda needs contiguous tensors and an int32 idx")
    if tuple(dkv_slots.shape) != (b, s * h // HEADS_PER_CTA, k, d):
        raise ValueError(f"dkv_slots must be [b, s·H/64, k, 512] = {(b, s * h // HEADS_PER_CTA, k, d)}, "
                         f"got {tuple(dkv_slots.shape)}")
    if b * s == 0:
        return
    args = [q, kv, o, do, idx, lse2, delta, dq, dkv_slots, ctypes.c_int32(s), ctypes.c_int32(kv.shape[1]),
            ctypes.c_int32(h), ctypes.c_int32(k), ctypes.c_float(scale * LOG2E), ctypes.c_float(scale)]
    cuda_backward_kernel(k).launch((s * (h // HEADS_PER_CTA), b, 1), (384, 1, 1), args)
