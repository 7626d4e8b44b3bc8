"""Candidates against the per-CTA ramp of the CSA2 sparse-attention forward (head dim 512, Hopper).

    python examples/benchmarks/attention_fwd_ab.py --variants examples/benchmarks/variants/attention_fwd_ramp.py

"early Q": the tree's kernel with Q's copies issued before the index row is read, so the two latencies overlap
(ptxas: a 16-byte spill, in the prologue and epilogue only).

"persistent": the tree's forward runs one CTA per (query, 64 heads) and pays its pipeline's ramp at every CTA (~7 us of the
~27 us a CTA takes at 640 slots: ``sparse_attention_cuda``'s docstring).  Here one CTA per multiprocessor
walks its items (x, x + CTAs, ..., the last query first) and the producer warpgroup runs ahead across items:

* it loads the next item's index row into the other of two buffers (with its last key per producer warp and
  where the item's outputs go) while the math warpgroups finish the current item;
* it loads the next item's Q as soon as both math warpgroups' last Q K^T of the current item has completed
  (``q_free``), and gathers the next item's first pair as soon as the current item's last pair frees its
  buffers, so Q, the index row and the first kv rows are in flight during the last pair's P V and the
  epilogue;
* O goes from the accumulators to global memory directly, as 16-byte rows after a quad shuffle-transpose (as
  the backward's slot gradients): Q's buffer, which the tree's kernel stages O in, holds the next item's Q
  by then.

The per-pair math is the tree's unchanged, so the outputs must be bit-identical to the tree's kernel (the A/B
script checks it, on edge cases too). Before any GPU run, the synchronisation went through a randomised
interleaving model, attention_fwd_ramp_protocol.py: 3,000 schedules of 1-7 items of 0-5 pairs each, no
deadlock, every modelled read saw the item and pair it expects; the model fails each of five mutations (an
idx_free parity, Q loaded without q_free, one row-sum buffer, a doubled q_free arrival, the ready phase not
carried over items). Issuing the next item's first S before the current item's O stores (to overlap them) made
ptxas serialise every wgmma (C7515 or C7518) in each arrangement tried, so it is not here. An earlier
persistent attempt (``results/attention_h200.txt``) read the index row from global memory in the gather loop
and stored O with 4-byte stores, and was no faster.

Registers (ptxas, CUDA 13.0): the math loops are at their limit; at 232 math / 48 producer registers ptxas
spills 56 bytes: per item (the epilogue's addresses, the producer's index-row load) and in the masking of
blocks with empty slots (a query's last block), none in the pair loop's wgmma path; at 224 / 64, 136 bytes.
Shared memory: 214,700 bytes before the two index rows (2 x 4 x slots; 640 slots: 220,844 with the 1 KB
alignment slack), so at most 2,048 slots.
"""

from deepseek_v41 import sparse_attention_cuda_bwd  # the backward's quad_transpose, reused
from deepseek_v41.sparse_attention_cuda import _SOURCE as BASE
from deepseek_v41.sparse_attention_cuda import HELPERS

_bwd = sparse_attention_cuda_bwd._SOURCE
_start = _bwd.index("// Four 32-bit words per lane of a quad")
QUAD_TRANSPOSE = _bwd[_start : _bwd.index("\n}\n", _start) + 3]


def _from_base(start: str, end: str, include_end: bool = False) -> str:
    a = BASE.index(start)
    return BASE[a : BASE.index(end, a) + (len(end) if include_end else 0)]


def _edit(text: str, *pairs: tuple[str, str]) -> str:
    for old, new in pairs:
        assert text.count(old) == 1, f"the tree's forward changed: update this variant ({old!r})"
        text = text.replace(old, new)
    return text


# The tree's math (operands and lambdas) and pair loops, with the persistent kernel's changes: the running max and
# sums start per item, the ready phase and the index row's buffer follow the item, and each math warpgroup tells
# the producer when the item's last Q K^T has completed (q_free), so that the next item's Q may land.
_MATH = _edit(
    _from_base("  MmaQK mma_qk;", "  // one loop per warpgroup"),
    ("  clear(acc_o);\n\n", "\n"),
    ("  float run_max[2] = {-1.0e30f, -1.0e30f};  // running max of the scaled logits (finite: no inf - inf)\n"
     "  float run_sum[2] = {0.f, 0.f};            // this warpgroup's partial row sums, relative to run_max\n",
     "  float run_max[2], run_sum[2];  // running max of the scaled logits (finite: no inf - inf); partial row sums\n"
     "  // the current item (bits 1..) and the ready / empty phase of its first pair (bit 0: pairs so far, mod 2)\n"
     "  uint32_t it_phase = 0;\n"),
    ("mbar_wait(&sm.ready[wg][half], p & 1);", "mbar_wait(&sm.ready[wg][half], (it_phase + p) & 1);"),
    ("const int* slot_idx = sm.idx + blk * BK;",
     "const int* slot_idx = sm.idx + ((it_phase >> 1) & 1) * slots + blk * BK;"),
)
_WG0_PAIRS = _from_base(
    "    for (int p = 0; p < n_pairs; ++p) {\n      warpgroup_fence_operand(acc_s);  // S of block 2p",
    "\n    }\n    warpgroup_fence_operand(acc_o);\n",
) + "\n      if (p + 2 == n_pairs) mbar_arrive(&sm.q_free);  // pair p + 1's S, the item's last Q K^T, has completed"
_WG1_PAIRS = _edit(
    _from_base("    for (int p = 0; p < n_pairs; ++p) {\n      qk_half(p, 1, true);",
               "      mbar_arrive(&sm.empty[0][1]);\n    }\n", include_end=True),
    ("      qk_half(p, 0, false);\n      warpgroup_wait<0>();\n",
     "      qk_half(p, 0, false);\n      warpgroup_wait<0>();\n      if (p + 1 == n_pairs) mbar_arrive(&sm.q_free);\n"),
)
_SUMS = _edit(
    _from_base("  // row sums: over the quad", "  bar_sync(BAR_SUM, 256);\n", include_end=True),
    ("sm.row_sum[wg][row0]", "sm.row_sum[it & 1][wg][row0]"),
    ("sm.row_sum[wg][row1]", "sm.row_sum[it & 1][wg][row1]"),
)
# the producer's fill order of a pair (the halves the math warpgroups need first come first), two levels deeper
_FILLS = "".join("  " + line for line in _from_base(
    "      mbar_wait(&sm.empty[0][0], par);\n", "      fill(2 * p + 1, 1, 0);\n", include_end=True).splitlines(True))

SOURCE = r"""
namespace csa2 {

QUAD_TRANSPOSE
struct alignas(1024) Smem {
  bf16 q[BH * D];      // Q of the current item as two 64 x 256 halves
  bf16 k[2][BK * D];   // gathered kv rows of the pair's two blocks, each as two halves
  bf16 p[2][BH * BK];  // P of warpgroup w, for the other warpgroup's P.V
  float max_a[BH];     // row max after warpgroup 0's block, for warpgroup 1
  float max_b[BH];     // row max after both blocks, for warpgroup 0
  float row_sum[2][2][BH];  // [item % 2][warpgroup]: partial row sums (an item without keys skips every barrier
                           // but BAR_SUM, so a warpgroup may write the next item's sums while the peer reads)
  uint64_t ready[2][2];  // [block of the pair][half]: the gather landed
  uint64_t empty[2][2];  // [block][half]: every reader is done, the producer may refill
  uint64_t q_ready;      // the item's Q landed
  uint64_t q_free;       // both math warpgroups' last Q K^T of the item completed: the next Q may land
  uint64_t idx_ready[2]; // [item % 2]: the item's index row and last keys are in shared memory
  uint64_t idx_free[2];  // [item % 2]: the math warpgroups are done with that index row
  int n_valid[2][4];     // [item % 2][producer warp]: 1 + the last slot that holds a key among the warp's slots
  int64_t row[2];        // [item % 2]: the item's first row of o / lse2, (b * seq + s_i) * heads + h0
  int h0[2];             // [item % 2]: its first head
  int n_items;           // this CTA's items
  int idx[1];            // [2][slots]: the index rows of two consecutive items (dynamic tail)
};

static_assert(offsetof(Smem, idx) == 214700, "the docstring's shared-memory figures");

// named barriers between the two math warpgroups (0 is __syncthreads)
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
        mbar_init(&sm.ready[i][h], 128);
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
    asm volatile("setmaxnreg.dec.sync.aligned.u32 48;");
    const int j = t % 8, g = t / 8;
    // item it's index row -> buffer it % 2, with each producer warp's last key; the buffer's previous item (it - 2)
    // must be done with it
    auto load_idx = [&](int it) __attribute__((always_inline)) {
      int b, s_i, h0;
      item(it, b, s_i, h0);
      mbar_wait(&sm.idx_free[it & 1], ((it >> 1) & 1) ^ 1);  // a fresh barrier passes the wait on parity 1
      const int* row = idx + ((int64_t)b * seq + s_i) * slots;
      int* dst = sm.idx + (it & 1) * slots;
      int last = 0;
      for (int i = t; i < slots; i += 128) {
        const int v = row[i];
        dst[i] = v;
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
      const int* idx_it = sm.idx + (it & 1) * slots;
      const bf16* kv_b = kv + (int64_t)b * n_kv * D + j * 8;
      auto fill = [&](int blk, int buf, int half) __attribute__((always_inline)) {
        gather_half(sm.k[buf] + half * (BK * HALF), kv_b, idx_it, blk, g, j, half);
        cp_async_arrive(&sm.ready[buf][half]);
      };
      // Q of the item, swizzled, once the previous item's last Q K^T has completed
      mbar_wait(&sm.q_free, (it & 1) ^ 1);
      const bf16* q_blk = q + (((int64_t)b * seq + s_i) * heads + h0) * D;
      for (int u = t; u < BH * D / 8; u += 128) {
        const int r = u / (D / 8), col = (u % (D / 8)) * 8;
        cp_async16(sm.q + (col / HALF) * (BH * HALF) + swz(r, col % HALF), q_blk + r * D + col, true);
      }
      cp_async_arrive(&sm.q_ready);
      const int n_pairs = pairs_of(it);
      for (int p = 0; p < n_pairs; ++p, ++gp) {
        const uint32_t par = (gp & 1) ^ 1;
@FILLS@      }
      if (it + 1 < n_items) load_idx(it + 1);
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
@MATH@  // one loop per warpgroup: a loop that switched roles inside would let the compiler see a path with an
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

@SUMS@  const int64_t out_row = sm.row[it & 1];
  const int h0 = sm.h0[it & 1];
  mbar_arrive(&sm.idx_free[it & 1]);  // the item's index row, row and h0 are read
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
@WG0_PAIRS@
    }
    warpgroup_fence_operand(acc_o);
    finish_item(it, n_pairs);
   }
  } else {
   for (; (int)(it_phase >> 1) < sm.n_items; it_phase += 2) {
    const int it = it_phase >> 1;
    const int n_pairs = start_item(it);
    if (n_pairs == 0) mbar_arrive(&sm.q_free);
@WG1_PAIRS@    finish_item(it, n_pairs);
   }
  }
}
"""
for _name, _part in (("QUAD_TRANSPOSE", QUAD_TRANSPOSE), ("@MATH@", _MATH), ("@WG0_PAIRS@", _WG0_PAIRS),
                     ("@WG1_PAIRS@", _WG1_PAIRS), ("@SUMS@", _SUMS), ("@FILLS@", _FILLS)):
    assert SOURCE.count(_name) == 1, _name
    SOURCE = SOURCE.replace(_name, _part)

# the tree's kernel with Q's copies issued first (by the math warpgroups, waited for where they waited before)
_Q_COPY = """    const bf16* q_blk = q + (((int64_t)b * seq + s_i) * heads + h0) * D;
    for (int u = tid; u < BH * D / 8; u += 256) {
      const int r = u / (D / 8), col = (u % (D / 8)) * 8;
      cp_async16(sm.q + (col / HALF) * (BH * HALF) + swz(r, col % HALF), q_blk + r * D + col, true);
    }
"""
_INIT = "  if (tid == 0) {\n    for (int i = 0; i < 2; ++i)"
assert BASE.count(_Q_COPY) == 1 and BASE.count(_INIT) == 1, "the tree's forward changed: update this variant"
EARLY_Q = BASE.replace(_Q_COPY, "").replace(_INIT, "  if (tid < 256) {\n" + _Q_COPY + "  }\n" + _INIT)

VARIANTS = {
    "early Q": (EARLY_Q, False),  # BASE carries HELPERS already
    "persistent 232/48": (HELPERS + SOURCE, True),
    "persistent 224/64": (HELPERS + SOURCE.replace("u32 232;", "u32 224;").replace("u32 48;", "u32 64;"), True),
}
