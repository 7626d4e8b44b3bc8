"""CSA2 sparse attention forward for head dim 512 on Hopper, as a hand-written CUDA kernel (sm_90a).

The ``attn: tilelang`` backend uses it for its forward when the head dim is 512 (DeepSeek-V4.1's latent width)
and the GPU is a Hopper; other shapes, and ``DS41_SPARSE_FWD=tilelang``, take the TileLang forward.  Same
function and numerics contract as the TileLang forward (``kernels_tilelang._build_attn_fwd``): fp32 online
softmax in base 2, probabilities rounded to bf16 before P·V, the sink in the denominator only, and the
base-2 log-sum-exp ``lse2`` that the TileLang backward reuses.

Why CUDA: every per-warpgroup structure tried in TileLang was slower than its cooperative kernel
(``examples/benchmarks/results/attention_h200.txt``), which is bound by Q·Kᵀ split as two 64×32 tiles
(shared-memory bound) and by a softmax that both warpgroups wait for.  Here an item is 64 heads of one query, and
a CTA of three warpgroups computes its items one after the other:

* warpgroup 2 gathers the selected kv rows with cp.async, two 64-slot blocks at a time (one per math
  warpgroup), each block in two 256-column halves with their own empty mbarriers, and a ready mbarrier per
  64-column tile, so Q·Kᵀ starts on a half's first tile while the rest is in flight;
* warpgroup w computes S = Q·Kᵀ of its block as a 64×64 tile, the softmax of it, and O's half w
  (256 columns) for both blocks: P·V of its own block with P in registers, of the peer's block with the
  peer's P from shared memory.  Row maxima go through shared memory (warpgroup 0 first, then 1), so
  warpgroup 0 rescales its P once the pair's maximum is known;
* warpgroup 0 issues the next pair's Q·Kᵀ while its last P·V of the pair runs.

The kernel is persistent: one CTA per multiprocessor takes items x, x + CTAs, ... (the last query first, so the
short items of the first queries come last), and the producer runs ahead across items. While the math warpgroups
finish an item, it loads the next item's index row (which only the producer reads) and, into the second of two
buffers, its 64-slot blocks' masks of filled slots and its last key; the next Q as soon as both warpgroups' last
Q·Kᵀ of the item has completed, and the next item's first kv pair as soon as the last pair frees its buffers. O
goes from the accumulators to global memory as 16-byte rows after a quad shuffle-transpose. A kernel per item paid
its pipeline's ramp (index row, Q, first gather) at every item: ~7 µs of the ~27 µs an item took at 640 slots. The
synchronisation was checked before any GPU run with a randomised interleaving model
(``examples/benchmarks/attention_fwd_protocol.py``).

An item runs the pairs up to its last key only: a pair of empty slots adds nothing (P = 0, the running max
unchanged), so skipping the trailing ones (queries that see fewer compressed entries than top-k) changes no bit.

H200 (this kernel, 2026-12-03), V4.1 shape (s 4096, 64 heads, 640 slots; FLOP counted over all 640 slots), in one
process with the kernel whose gathers land a half at a time (4c5357e), bit-identical outputs (``attention_fwd_ab.py``,
ten rounds on two leases): at ratio 1 0.657-0.713 ms, mean 0.686 ms, 501 TFLOP/s (best rounds 523 and 518),
2.3-5.0 % faster than 4c5357e in every round; at ratio 2 the same within the noise (0.674-0.700 ms); at ratio 4
0-2 % faster (0.621-0.636 ms, up to 553).  1.47x the TileLang forward, 67 % of its gather-only probe's speed
(``attention.py --kernels --bounds``); the persistent kernel had been 1.09x the one of one CTA per item (e1c53b4).
What is left is the pair loop itself, ~2.3 µs per 64-slot block and multiprocessor, whose next Q·Kᵀ waits for
the halves freed by the pair's last P·V to refill from L2 (the gathers alone take 67 % of the kernel's time).
Registers: 224 per math thread, 56 for the producer (232 / 40, and the L2 prefetch hint at 256 bytes or none,
measured the same within the noise; a split above the launch's 384 × 168 never completes its setmaxnreg and hangs:
``examples/benchmarks/variants/attention_fwd_tuning.py``). Shared memory: the buffers (214,800 bytes), then the
index row and two items' slot masks (4¼ bytes a slot), so up to 3,840 slots.

The design follows the public description of DeepSeek's FlashMLA sparse prefill kernel; the code is ours
(CuTe from the CUTLASS headers that TileLang ships, compiled with nvcc on first use by ``cuda_module``).
The compiled kernel has no register spills and no serialised wgmma (ptxas reports both; a CPU test checks
where nvcc and the headers exist): the comments in the source say which constructs would bring them back.
"""

import ctypes
import os
import threading

import torch

from .cuda_module import CudaKernel, compile_cubin

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x·log2 e)
HEAD_DIM = 512
HEADS_PER_CTA = 64
SLOTS_PER_PAIR = 128  # two 64-slot blocks, one per math warpgroup: idx is padded to a multiple with empty slots
# shared memory before the index row: Q 64·512·2 + K 2·64·512·2 + P 2·64·64·2 + maxima 2·64·4 + two items' row sums
# 2·2·64·4 + 26 mbarriers + two items' output rows, first heads and last keys + the CTA's item count, padded to 16
# bytes = offsetof(Smem, idx), which the kernel asserts; 1 KB more lets it align its buffers to 1024 bytes (the
# swizzle is on address bits).  Per slot: the index row (4 bytes) and two items' slot masks (2 bits)
_SMEM_FIXED = 65536 + 131072 + 16384 + 512 + 1024 + 208 + 16 + 8 + 32 + 4 + 4 + 1024
_SMEM_MAX = 227 * 1024  # Hopper's per-block opt-in limit


def _smem_bytes(slots: int) -> int:
    return _SMEM_FIXED + 4 * slots + slots // 4


# the most whole pairs of blocks whose index row and masks still fit
MAX_SLOTS = max(k for k in range(0, _SMEM_MAX, SLOTS_PER_PAIR) if _smem_bytes(k) <= _SMEM_MAX)
_FLAGS: tuple[str, ...] = ()  # cuda_module compiles with -O3 -DNDEBUG --expt-relaxed-constexpr

_kernels: dict = {}
_lock = threading.Lock()

# device helpers shared with the backward kernel (sparse_attention_cuda_bwd)
HELPERS = r"""
#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

using namespace cute;
using bf16 = cute::bfloat16_t;

namespace csa2 {

constexpr int D = 512;      // latent width: K = V = kv[idx]
constexpr int BH = 64;      // heads per CTA (one wgmma M)
constexpr int BK = 64;      // index slots per block; blocks go in pairs, one per math warpgroup
constexpr int HALF = D / 2; // each math warpgroup owns half of O's columns

// 64 x 256 bf16, K-major, 128-byte swizzle, as four 64 x 64 tiles one after the other
using LayoutHalf = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{}, Shape<_64, _256>{}, Step<_1, _2>{}));
// the same bytes read as V^T: (256 latent columns, 64 slots), latent column contiguous
using LayoutHalfT =
    decltype(composition(LayoutHalf{}, make_layout(Shape<_256, _64>{}, Stride<_64, _1>{})));
using LayoutP = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{}, Shape<_64, _64>{}, Step<_1, _2>{}));

using MmaQK = decltype(make_tiled_mma(GMMA::MMA_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{}));
using MmaPVreg = decltype(make_tiled_mma(GMMA::MMA_64x256x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>{}));
using MmaPVsmem = decltype(make_tiled_mma(GMMA::MMA_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{}));

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred P;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n @!P bra WAIT;\n}\n" ::"r"(
          smem_u32(b)),
      "r"(parity)
      : "memory");
}
// the barrier counts this thread's arrival once all of its earlier cp.async copies have landed
__device__ __forceinline__ void cp_async_arrive(uint64_t* b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(b)) : "memory");
}
// 16 bytes global -> shared; an invalid source reads nothing and fills zeros
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// element offset of (row, col) in a K-major 128-byte-swizzled buffer of 64-column tiles (1024-byte aligned)
__device__ __forceinline__ int swz(int row, int col) {
  return (col >> 6) * (64 * 64) + row * 64 + ((((col & 63) >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// Four 8 x 8 bf16 matrices of a warpgroup's wgmma accumulator -> a K-major swizzled buffer, one stmatrix: column
// blocks cb and cb + 1 (8 columns each) of the warp's 16 rows.  p0..p3: this thread's two adjacent values of
// matrix 0..3 (rows +0 / +8 of block cb, then of block cb + 1), which is the accumulator's own order; lane l
// gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void stsm_x4(bf16* dst, int t, int cb, uint32_t p0, uint32_t p1, uint32_t p2, uint32_t p3) {
  const int lane = t % 32, m = lane / 8;
  const int row = 16 * (t / 32) + (m % 2) * 8 + lane % 8, col = 8 * (cb + m / 2);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_u32(dst + swz(row, col))),
               "r"(p0), "r"(p1), "r"(p2), "r"(p3)
               : "memory");
}

// a shared tensor whose address the compiler cannot see through: otherwise it hoists the wgmma descriptors of
// every k-step out of the loop, keeps them in registers and spills
template <class Layout>
__device__ __forceinline__ auto smem_tensor(const bf16* p, Layout layout) {
  asm volatile("" : "+l"(p));
  return make_tensor(make_smem_ptr(p), layout);
}

// k-steps [k0, k1) of a x b (all of them by default); zero: the first k-step of all overwrites c
template <class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma(Mma& mma, TA const& a, TB const& b, TC& c, bool zero, int k0 = 0,
                                      int k1 = -1) {
  warpgroup_arrive();
  CUTE_UNROLL
  for (int k = k0; k < (k1 < 0 ? int(size<2>(a)) : k1); ++k) {
    mma.accumulate_ = (zero && k == 0) ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
  }
}

// One half (256 latent columns) of the kv rows of index block blk -> a K-major 128-byte-swizzled 64 x 256 buffer,
// by cp.async, one 64-column tile after the other, calling tile_done(tile) after each tile's copies (the forward
// arrives on the tile's barrier, so Q K^T starts on the first tile that lands): producer thread (g = t / 8, j = t % 8)
// copies 16-byte chunk j of each 128-byte tile row of rows g, g + 16, g + 32, g + 48; an empty slot (-1) fills
// zeros.  kv_b: the batch's kv plus 8 j columns; idx: the index row in shared memory
template <class TileDone>
__device__ __forceinline__ void gather_half(bf16* dst, const bf16* kv_b, const int* idx, int blk, int g, int j,
                                            int half, TileDone tile_done) {
  const bf16* src[4];
  bool valid[4];
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int row = idx[blk * BK + g + 16 * i];
    src[i] = kv_b + (int64_t)max(row, 0) * D + half * HALF;
    valid[i] = row >= 0;
  }
  CUTE_UNROLL
  for (int tile = 0; tile < 4; ++tile) {
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) cp_async16(dst + swz(g + 16 * i, tile * 64 + j * 8), src[i] + tile * 64, valid[i]);
    tile_done(tile);
  }
}

// Four 32-bit words per lane of a quad, A[lane][k] -> A[k][lane] (two butterfly stages of two shuffles each): the
// quad's words of four 8-column groups become one group's 16 contiguous bytes per lane
__device__ __forceinline__ void quad_transpose(uint32_t& a0, uint32_t& a1, uint32_t& a2, uint32_t& a3, int lane) {
  const bool hi2 = lane & 2, hi1 = lane & 1;
  uint32_t r0 = __shfl_xor_sync(0xffffffff, hi2 ? a0 : a2, 2), r1 = __shfl_xor_sync(0xffffffff, hi2 ? a1 : a3, 2);
  if (hi2) { a0 = r0; a1 = r1; } else { a2 = r0; a3 = r1; }
  r0 = __shfl_xor_sync(0xffffffff, hi1 ? a0 : a1, 1);
  r1 = __shfl_xor_sync(0xffffffff, hi1 ? a2 : a3, 1);
  if (hi1) { a0 = r0; a2 = r1; } else { a1 = r0; a3 = r1; }
}

}  // namespace csa2
"""

_SOURCE = HELPERS + r"""
namespace csa2 {

struct alignas(1024) Smem {
  bf16 q[BH * D];      // Q of the current item as two 64 x 256 halves
  bf16 k[2][BK * D];   // gathered kv rows of the pair's two blocks, each as two halves
  bf16 p[2][BH * BK];  // P of warpgroup w, for the other warpgroup's P.V
  float max_a[BH];     // row max after warpgroup 0's block, for warpgroup 1
  float max_b[BH];     // row max after both blocks, for warpgroup 0
  float row_sum[2][2][BH];  // [item % 2][warpgroup]: partial row sums (an item without keys skips every barrier
                           // but BAR_SUM, so a warpgroup may write the next item's sums while the peer reads)
  uint64_t ready[2][2][4];  // [block of the pair][half][64-column tile]: the gather landed
  uint64_t empty[2][2];  // [block][half]: every reader is done, the producer may refill
  uint64_t q_ready;      // the item's Q landed
  uint64_t q_free;       // both math warpgroups' last Q K^T of the item completed: the next Q may land
  uint64_t idx_ready[2]; // [item % 2]: the item's slot masks, last keys, row and h0 are in shared memory
  uint64_t idx_free[2];  // [item % 2]: the math warpgroups are done with them
  int64_t row[2];        // [item % 2]: the item's first row of o / lse2, (b * seq + s_i) * heads + h0
  int h0[2];             // [item % 2]: its first head
  int n_valid[2][4];     // [item % 2][producer warp]: 1 + the last slot that holds a key among the warp's slots
  int n_items;           // this CTA's items
  // dynamic tail: the index row of the item the producer gathers (slots ints; only the producer reads it), then
  // valid[2][slots / 64] (uint64: [item % 2][block], bit j: slot j of the block holds a key) for the math
  alignas(16) int idx[1];
};

// the launch's shared-memory size (_SMEM_FIXED, MAX_SLOTS) is computed from this offset
static_assert(offsetof(Smem, idx) == SMEM_IDX_OFFSET, "update _SMEM_FIXED in sparse_attention_cuda.py");

// named barriers (0 is __syncthreads): the producer warpgroup's own, then those between the two math warpgroups
enum : int { BAR_PRODUCER = 1, BAR_MAX_A = 2, BAR_MAX_B = 3, BAR_P0 = 4, BAR_P1 = 5, BAR_SUM = 6 };

}  // namespace csa2

using namespace csa2;

// q [b, s, H, 512] bf16, kv [b, n, 512] bf16, idx [b, s, slots] int32 (-1: empty), sink2 [H] fp32 (sink * log2 e)
// -> o [b, s, H, 512] bf16, lse2 [b, s, H] fp32 (base-2 log-sum-exp of the scaled logits and the sink).
// Persistent: grid (CTAs, 1), 384 threads; CTA x takes items x, x + CTAs, ... (item: one query's 64 heads), the last
// query first.  Warpgroups 0 and 1 compute, warpgroup 2 gathers and loads each item's index row and Q ahead of the
// math.  slots % 128 == 0.
extern "C" __global__ void __launch_bounds__(384, 1)
    csa2_sparse_attn_fwd_d512(const bf16* __restrict__ q, const bf16* __restrict__ kv, const int* __restrict__ idx,
                              const float* __restrict__ sink2, bf16* __restrict__ o, float* __restrict__ lse2, int seq,
                              int n_kv, int heads, int slots, float c, int batch) {
  // the 128-byte swizzle is on address bits, so the buffers need 1024-byte alignment: the launch asks for 1 KB extra
  extern __shared__ __align__(1024) char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int n_hblk = heads / BH, per_query = n_hblk * batch;
  const int n_items = (seq * per_query - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;  // this CTA's
  // item `it` of this CTA: the last query first (queries near the start have fewer keys and trailing empty pairs are
  // skipped, so the short items come last), then batch, then head block
  auto item = [&](int it, int& b, int& s_i, int& h0) __attribute__((always_inline)) {
    const int j = (int)blockIdx.x + it * (int)gridDim.x, r = j % per_query;
    s_i = seq - 1 - j / per_query;
    b = r / n_hblk;
    h0 = (r % n_hblk) * BH;
  };
  // the warpgroup index through a shuffle, so the compiler knows it is uniform across each warp
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffff, tid / 128, 0), t = tid % 128;

  if (tid == 0) {
    for (int i = 0; i < 2; ++i) {
      for (int h = 0; h < 2; ++h) {
        for (int tile = 0; tile < 4; ++tile) mbar_init(&sm.ready[i][h][tile], 128);
        mbar_init(&sm.empty[i][h], 128);
      }
      mbar_init(&sm.idx_ready[i], 128);
      mbar_init(&sm.idx_free[i], 256);
    }
    mbar_init(&sm.q_ready, 128);
    mbar_init(&sm.q_free, 256);
    sm.n_items = n_items;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // the item's pairs up to its last key: a pair of empty slots adds nothing (P = 0, the running max unchanged), so
  // the trailing ones (queries with fewer visible keys than top-k) are skipped.  Through a shuffle, so the compiler
  // knows it is warp-uniform
  auto pairs_of = [&](int it) __attribute__((always_inline)) {
    const int* nv = sm.n_valid[it & 1];
    const int last = max(max(nv[0], nv[1]), max(nv[2], nv[3]));
    return __shfl_sync(0xffffffff, (last + 2 * BK - 1) / (2 * BK), 0);
  };

  if (wg == 2) {
    // producer: thread t copies 16-byte chunk j of a 128-byte tile row, for rows g, g + 16, g + 32, g + 48
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    const int j = t % 8, g = t / 8;
    // item it's index row -> sm.idx, once every producer warp has issued the previous item's gathers from it; its
    // slot masks and each producer warp's last key -> buffer it % 2, once the math of item it - 2 is done with it
    auto load_idx = [&](int it) __attribute__((always_inline)) {
      int b, s_i, h0;
      item(it, b, s_i, h0);
      const int* row = idx + ((int64_t)b * seq + s_i) * slots;
      uint32_t* valid = reinterpret_cast<uint32_t*>(sm.idx + slots) + (it & 1) * (slots / 32);
      bar_sync(BAR_PRODUCER, 128);
      mbar_wait(&sm.idx_free[it & 1], ((it >> 1) & 1) ^ 1);  // a fresh barrier passes the wait on parity 1
      int last = 0;
      for (int i = t; i < slots; i += 128) {  // warp w: slots i - t + 32 w .. + 31, one mask word
        const int v = row[i];
        sm.idx[i] = v;
        const uint32_t word = __ballot_sync(0xffffffff, v >= 0);
        if (t % 32 == 0) valid[i / 32] = word;
        if (v >= 0) last = i + 1;
      }
      last = __reduce_max_sync(0xffffffff, last);
      if (t % 32 == 0) sm.n_valid[it & 1][t / 32] = last;
      if (t == 0) {  // where the math warpgroups write the item's outputs (divisions kept out of their loops)
        sm.row[it & 1] = ((int64_t)b * seq + s_i) * heads + h0;
        sm.h0[it & 1] = h0;
      }
      bar_sync(BAR_PRODUCER, 128);  // this warpgroup's gathers read the whole row
      mbar_arrive(&sm.idx_ready[it & 1]);
    };
    uint32_t gp = 0;  // pairs gathered so far, over all items: the ready / empty phase
    if (n_items > 0) load_idx(0);
    for (int it = 0; it < n_items; ++it) {
      int b, s_i, h0;
      item(it, b, s_i, h0);
      const bf16* kv_b = kv + (int64_t)b * n_kv * D + j * 8;
      auto fill = [&](int blk, int buf, int half) __attribute__((always_inline)) {
        gather_half(sm.k[buf] + half * (BK * HALF), kv_b, sm.idx, blk, g, j, half,
                    [&](int tile) __attribute__((always_inline)) { cp_async_arrive(&sm.ready[buf][half][tile]); });
      };
      // Q of the item, swizzled, once the previous item's last Q K^T has completed
      mbar_wait(&sm.q_free, (it & 1) ^ 1);
      {  // thread t copies 16-byte chunk t % 64 of rows t / 64, t / 64 + 2, ... (its addresses in few registers)
        const int col = (t % 64) * 8;
        bf16* dst = sm.q + (col / HALF) * (BH * HALF);
        const bf16* src = q + (((int64_t)b * seq + s_i) * heads + h0) * D + col;
#pragma unroll 1
        for (int r = t / 64; r < BH; r += 2) cp_async16(dst + swz(r, col % HALF), src + r * D, true);
      }
      cp_async_arrive(&sm.q_ready);
      const int n_pairs = pairs_of(it);
      for (int p = 0; p < n_pairs; ++p, ++gp) {
        const uint32_t par = (gp & 1) ^ 1;
        mbar_wait(&sm.empty[0][0], par);
        fill(2 * p, 0, 0);
        mbar_wait(&sm.empty[1][1], par);
        fill(2 * p + 1, 1, 1);
        mbar_wait(&sm.empty[0][1], par);
        fill(2 * p, 0, 1);
        mbar_wait(&sm.empty[1][0], par);
        fill(2 * p + 1, 1, 0);
      }
      if (it + 1 < n_items) load_idx(it + 1);
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
  MmaQK mma_qk;
  MmaPVreg mma_pv_reg;
  MmaPVsmem mma_pv_smem;
  auto thr_qk = mma_qk.get_slice(t);
  auto thr_pv_reg = mma_pv_reg.get_slice(t);
  auto thr_pv_smem = mma_pv_smem.get_slice(t);

  Tensor acc_s = partition_fragment_C(mma_qk, Shape<_64, _64>{});       // 32 fp32: S, then P in fp32
  Tensor acc_o = partition_fragment_C(mma_pv_reg, Shape<_64, _256>{});  // 128 fp32: this warpgroup's O columns
  // P in bf16 as the A operand of P.V: the accumulator's element order is the operand's, so element i = P(i)
  Tensor reg_p = make_tensor<bf16>(partition_shape_A(mma_pv_reg, Shape<_64, _64>{}));
  Tensor coord = thr_qk.partition_C(make_identity_tensor(Shape<_64, _64>{}));  // (head row, slot column) of i

  const int row0 = get<0>(coord(0)), row1 = row0 + 8;  // element i is on row0 + 8 * ((i / 2) % 2)
  float run_max[2], run_sum[2];  // running max of the scaled logits (finite: no inf - inf); partial row sums
  // the current item (bits 1..) and the ready / empty phase of its first pair (bit 0: pairs so far, mod 2)
  uint32_t it_phase = 0;

  // acc_s (+)= Q_half K_half^T for this warpgroup's block of pair p, each 64-column tile (4 k-steps) as soon as the
  // producer has landed it
  auto qk_half = [&](int p, int half, bool zero) __attribute__((always_inline)) {
    Tensor tQ = thr_qk.partition_fragment_A(smem_tensor(sm.q + half * (BH * HALF), LayoutHalf{}));
    Tensor tK = thr_qk.partition_fragment_B(smem_tensor(sm.k[wg] + half * (BK * HALF), LayoutHalf{}));
    // no operand fence on acc_s here: inside an open wgmma stage a fence counts as a write, and the compiler
    // then serialises every wgmma; the first k-step of a block zeroes acc_s
    CUTE_UNROLL
    for (int tile = 0; tile < 4; ++tile) {  // 4 k-steps of 16 columns a tile
      mbar_wait(&sm.ready[wg][half][tile], (it_phase + p) & 1);
      wgmma(mma_qk, tQ, tK, acc_s, zero, 4 * tile, 4 * tile + 4);
    }
    warpgroup_commit_batch();
  };
  // V^T operands: this warpgroup's O columns of its own block and of the peer's block; the peer's P
  auto own_v = [&]() __attribute__((always_inline)) {
    return thr_pv_reg.partition_fragment_B(smem_tensor(sm.k[wg] + wg * BK * HALF, LayoutHalfT{}));
  };
  auto peer_v = [&]() __attribute__((always_inline)) {
    return thr_pv_smem.partition_fragment_B(smem_tensor(sm.k[wg ^ 1] + wg * BK * HALF, LayoutHalfT{}));
  };
  auto peer_p = [&]() __attribute__((always_inline)) {
    return thr_pv_smem.partition_fragment_A(smem_tensor(sm.p[wg ^ 1], LayoutP{}));
  };
  // empty slots to -inf; returns the scaled row maxima of the block (quad-reduced)
  auto mask_and_max = [&](int blk, float out[2]) __attribute__((always_inline)) {
    // bit j: slot j of the block holds a key (the producer's ballots over the item's index row)
    const uint64_t* masks = reinterpret_cast<const uint64_t*>(sm.idx + slots) + ((it_phase >> 1) & 1) * (slots / 64);
    const uint64_t valid = masks[blk];
    if (valid != ~uint64_t(0)) {
      // one variable shift to this thread's first column; the others are constant offsets from it (32 hoisted
      // 64-bit masks, one per column, would spill)
      const uint64_t v = valid >> get<1>(coord(0));
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i)
        if (!((v >> (get<1>(coord(i)) - get<1>(coord(0)))) & 1)) acc_s(i) = -INFINITY;
    }
    out[0] = out[1] = -INFINITY;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) out[(i >> 1) & 1] = fmaxf(out[(i >> 1) & 1], acc_s(i));
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      out[h] = fmaxf(out[h], __shfl_xor_sync(0xffffffff, out[h], 1));
      out[h] = fmaxf(out[h], __shfl_xor_sync(0xffffffff, out[h], 2));
      out[h] *= c;
    }
  };
  // acc_o *= per-row factor
  auto rescale_o = [&](const float f[2]) __attribute__((always_inline)) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= f[(i >> 1) & 1];
  };
  // P = exp2(S c - new_max) in fp32 (acc_s) and bf16 (reg_p); O and the sums rescaled to new_max
  auto softmax = [&](const float new_max[2]) __attribute__((always_inline)) {
    float scale[2];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      scale[h] = exp2f(run_max[h] - new_max[h]);
      run_sum[h] *= scale[h];
      run_max[h] = new_max[h];
    }
    rescale_o(scale);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) {
      const int h = (i >> 1) & 1;
      acc_s(i) = exp2f(fmaf(acc_s(i), c, -new_max[h]));
      run_sum[h] += acc_s(i);
      reg_p(i) = bf16(acc_s(i));
    }
  };
  // reg_p -> shared (K-major 64 x 64, swizzled), four 8 x 8 matrices per stmatrix (a quarter of the instructions
  // of 32-bit stores: 5 % of the forward at the V4.1 shape, results/attention_h200.txt)
  auto store_p = [&](bf16* dst) __attribute__((always_inline)) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(&reg_p(0));  // elements i, i + 1 = pair i / 2
    CUTE_UNROLL
    for (int cb = 0; cb < BK / 8; cb += 2)
      stsm_x4(dst, t, cb, pairs[2 * cb], pairs[2 * cb + 1], pairs[2 * cb + 2], pairs[2 * cb + 3]);
    fence_async_smem();
  };
  // the block's softmax against the running max `prev` (this warpgroup's, or warpgroup 0's from shared
  // memory), its max published for the peer, and O += P V of this warpgroup's own block (P from registers)
  auto softmax_publish_own_pv = [&](const float prev[2], const float blk_max[2], float* publish, int bar)
      __attribute__((always_inline)) {
    float new_max[2] = {fmaxf(prev[0], blk_max[0]), fmaxf(prev[1], blk_max[1])};
    softmax(new_max);
    if (t % 4 == 0) {
      publish[row0] = new_max[0];
      publish[row1] = new_max[1];
    }
    bar_arrive(bar, 256);
    warpgroup_fence_operand(reg_p);
    warpgroup_fence_operand(acc_o);
    wgmma(mma_pv_reg, reg_p, own_v(), acc_o, false);
    warpgroup_commit_batch();
  };

  // one loop per warpgroup: a loop that switched roles inside would let the compiler see a path with an
  // accumulator written while the other role's wgmma is in flight, and it then serialises every wgmma
  float blk_max[2];
  // an item's start: its index row and Q have landed; returns its pair count
  auto start_item = [&](int it) __attribute__((always_inline)) {
    mbar_wait(&sm.idx_ready[it & 1], (it >> 1) & 1);
    clear(acc_o);
    run_max[0] = run_max[1] = -1.0e30f;
    run_sum[0] = run_sum[1] = 0.f;
    mbar_wait(&sm.q_ready, it & 1);
    return pairs_of(it);
  };
  // an item's end: the phase moves on by its pairs, its index row is released, O and lse2 are written
  auto finish_item = [&](int it, int n_pairs) __attribute__((always_inline)) {
    it_phase ^= n_pairs & 1;
    // (warpgroup 0's last S was waited for inside the loop; the final wait<0> drained its P.V)
    // row sums: over the quad, then over the two warpgroups; the sink joins the denominator only
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      run_sum[h] += __shfl_xor_sync(0xffffffff, run_sum[h], 1);
      run_sum[h] += __shfl_xor_sync(0xffffffff, run_sum[h], 2);
    }
    if (t % 4 == 0) {
      sm.row_sum[it & 1][wg][row0] = run_sum[0];
      sm.row_sum[it & 1][wg][row1] = run_sum[1];
    }
    bar_sync(BAR_SUM, 256);
    const int64_t out_row = sm.row[it & 1];
    const int h0 = sm.h0[it & 1];
    mbar_arrive(&sm.idx_free[it & 1]);  // the item's masks, row and h0 are read
    float out_scale[2];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = h ? row1 : row0;
      const float l = sm.row_sum[it & 1][0][r] + sm.row_sum[it & 1][1][r], s2 = sink2[h0 + r];
      const float top = fmaxf(run_max[h], s2), a = exp2f(run_max[h] - top);
      const float total = l * a + exp2f(s2 - top);
      out_scale[h] = a / total;
      if (wg == 1 && t % 4 == 0) lse2[out_row + r] = top + log2f(total);
    }
    // O -> bf16 -> global from the accumulators: each quad's words of four 8-column groups transposed so that a lane
    // stores one group's 16 bytes (no staging in shared memory: Q's buffer already holds the next item's Q)
    bf16* o_row = o + (out_row + row0) * D + wg * HALF + 8 * (t % 4);
    CUTE_UNROLL
    for (int m = 0; m < 8; ++m)  // groups 4m .. 4m + 3 of the warpgroup's 32
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {  // row0, row0 + 8
        uint32_t w[4];
        CUTE_UNROLL
        for (int k = 0; k < 4; ++k) {
          const int i = 16 * m + 4 * k + 2 * h;
          __nv_bfloat162 v = __floats2bfloat162_rn(acc_o(i) * out_scale[h], acc_o(i + 1) * out_scale[h]);
          w[k] = reinterpret_cast<uint32_t&>(v);
        }
        quad_transpose(w[0], w[1], w[2], w[3], t % 4);
        *reinterpret_cast<uint4*>(o_row + h * 8 * D + 32 * m) = make_uint4(w[0], w[1], w[2], w[3]);
      }
  };
  if (wg == 0) {
    for (; (int)(it_phase >> 1) < sm.n_items; it_phase += 2) {
      const int it = it_phase >> 1;
      const int n_pairs = start_item(it);
      if (n_pairs > 0) {
        qk_half(0, 0, true);
        qk_half(0, 1, false);
        warpgroup_wait<0>();
      }
      if (n_pairs <= 1) mbar_arrive(&sm.q_free);  // the item's last Q K^T has completed
      for (int p = 0; p < n_pairs; ++p) {
        warpgroup_fence_operand(acc_s);  // S of block 2p
        mask_and_max(2 * p, blk_max);
        softmax_publish_own_pv(run_max, blk_max, sm.max_a, BAR_MAX_A);  // O_left += P0 V0_left
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        mbar_arrive(&sm.empty[0][0]);
        bar_sync(BAR_MAX_B, 256);  // warpgroup 1 has the pair's max
        float fix[2];
        fix[0] = exp2f(run_max[0] - sm.max_b[row0]);
        fix[1] = exp2f(run_max[1] - sm.max_b[row1]);
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) reg_p(i) = bf16(acc_s(i) * fix[(i >> 1) & 1]);
        store_p(sm.p[0]);
        bar_arrive(BAR_P0, 256);
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          run_sum[h] *= fix[h];
          run_max[h] = sm.max_b[h ? row1 : row0];
        }
        rescale_o(fix);
        bar_sync(BAR_P1, 256);
        warpgroup_fence_operand(acc_o);
        wgmma(mma_pv_smem, peer_p(), peer_v(), acc_o, false);  // O_left += P1 V1_left
        warpgroup_commit_batch();
        if (p + 1 < n_pairs) {  // the next pair's S, its left half while P1 V1_left runs
          qk_half(p + 1, 0, true);
          warpgroup_wait<1>();
          mbar_arrive(&sm.empty[1][0]);
          qk_half(p + 1, 1, false);
        } else {
          warpgroup_wait<0>();
          mbar_arrive(&sm.empty[1][0]);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        if (p + 2 == n_pairs) mbar_arrive(&sm.q_free);  // pair p + 1's S, the item's last Q K^T, has completed
      }
      warpgroup_fence_operand(acc_o);
      finish_item(it, n_pairs);
    }
  } else {
    for (; (int)(it_phase >> 1) < sm.n_items; it_phase += 2) {
      const int it = it_phase >> 1;
      const int n_pairs = start_item(it);
      if (n_pairs == 0) mbar_arrive(&sm.q_free);
      for (int p = 0; p < n_pairs; ++p) {
        qk_half(p, 1, true);  // the producer lands warpgroup 1's right half first
        qk_half(p, 0, false);
        warpgroup_wait<0>();
        if (p + 1 == n_pairs) mbar_arrive(&sm.q_free);
        warpgroup_fence_operand(acc_s);
        mask_and_max(2 * p + 1, blk_max);
        bar_sync(BAR_MAX_A, 256);
        const float max_a[2] = {sm.max_a[row0], sm.max_a[row1]};
        softmax_publish_own_pv(max_a, blk_max, sm.max_b, BAR_MAX_B);  // O_right += P1 V1_right
        store_p(sm.p[1]);
        bar_arrive(BAR_P1, 256);
        bar_sync(BAR_P0, 256);
        wgmma(mma_pv_smem, peer_p(), peer_v(), acc_o, false);  // O_right += P0 V0_right
        warpgroup_commit_batch();
        warpgroup_wait<1>();
        mbar_arrive(&sm.empty[1][1]);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        mbar_arrive(&sm.empty[0][1]);
      }
      finish_item(it, n_pairs);
    }
  }
}
""".replace("SMEM_IDX_OFFSET", str(_SMEM_FIXED - 1024))


def _cutlass_include() -> str:
    # CuTe / CUTLASS headers: TileLang's wheel carries them (the backend needs TileLang anyway)
    try:
        import tilelang
    except ImportError as err:
        raise RuntimeError("the CUDA sparse-attention kernels need the CUTLASS headers that tilelang ships: "
                           "pip install 'deepseek_v41[gpu]'") from err
    path = os.path.join(os.path.dirname(tilelang.__file__), "3rdparty", "cutlass", "include")
    if not os.path.isfile(os.path.join(path, "cute", "tensor.hpp")):
        raise RuntimeError(f"the CUDA sparse-attention kernels need CuTe headers; none under {path}")
    return path


def padded_slots(k: int) -> int:
    """Index slots the kernel runs on for ``k`` slots: a whole number of pairs of 64-slot blocks."""
    return -(-k // SLOTS_PER_PAIR) * SLOTS_PER_PAIR


def cuda_forward_usable(d: int, slots: int, device: torch.device) -> bool:
    """Whether ``sparse_attention_forward_cuda`` handles this shape on this device (else: TileLang)."""
    if os.environ.get("DS41_SPARSE_FWD", "cuda") == "tilelang":
        return False
    if device.type != "cuda" or d != HEAD_DIM or padded_slots(slots) > MAX_SLOTS:
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def cuda_forward_kernel(slots_padded: int) -> CudaKernel:
    """The compiled kernel for index rows of ``slots_padded`` slots (a multiple of 128), built once."""
    with _lock:
        kernel = _kernels.get(slots_padded)
        if kernel is None:
            cubin = compile_cubin(_SOURCE, [_cutlass_include()], arch="sm_90a", flags=_FLAGS)
            kernel = CudaKernel(cubin, "csa2_sparse_attn_fwd_d512", _smem_bytes(slots_padded))
            _kernels[slots_padded] = kernel
        return kernel


def sparse_attention_forward_cuda(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink2: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """o [b, s, H, 512] bf16 and lse2 [b, s, H] fp32 for q [b, s, H, 512] bf16 (H a multiple of 64),
    kv [b, n, 512] bf16, idx [b, s, k] int32 (-1 = empty slot, else a row of kv in [0, n)),
    sink2 [H] fp32 (the sink times log2 e), softmax scale ``scale``; all contiguous on one GPU."""
    b, s, h, d = q.shape
    k = idx.shape[2]
    if d != HEAD_DIM or h % HEADS_PER_CTA or kv.shape[2] != d or not (q.is_contiguous() and kv.is_contiguous()):
        raise ValueError(
            f"sparse_attention_forward_cuda needs contiguous q [b, s, H, 512] with H % 64 == 0 and kv [b, n, 512]; "
            f"got q {tuple(q.shape)}, kv {tuple(kv.shape)}"
        )
    kp = padded_slots(k)
    if kp > MAX_SLOTS:
        raise ValueError(f"sparse_attention_forward_cuda takes at most {MAX_SLOTS} index slots, got {k}")
    if kp == k and idx.dtype == torch.int32 and idx.is_contiguous():
        idxp = idx
    else:  # empty slots up to a whole pair of blocks (exact: they get P = 0)
        idxp = torch.full((b, s, kp), -1, dtype=torch.int32, device=q.device)
        idxp[:, :, :k] = idx
    o = torch.empty_like(q)
    lse2 = torch.empty((b, s, h), dtype=torch.float32, device=q.device)
    if b * s == 0:
        return o, lse2
    args = [q, kv, idxp, sink2.float().contiguous(), o, lse2, ctypes.c_int32(s), ctypes.c_int32(kv.shape[1]),
            ctypes.c_int32(h), ctypes.c_int32(kp), ctypes.c_float(scale * LOG2E), ctypes.c_int32(b)]
    cuda_forward_kernel(kp).launch(forward_grid(b, s, h, q.device), (384, 1, 1), args)
    return o, lse2


def forward_grid(b: int, s: int, h: int, device: torch.device) -> tuple[int, int, int]:
    """The persistent forward's grid: one CTA per multiprocessor, or one per item when there are fewer items
    (an item is one query's 64 heads)."""
    items = b * s * (h // HEADS_PER_CTA)
    return (min(items, torch.cuda.get_device_properties(device).multi_processor_count), 1, 1)
