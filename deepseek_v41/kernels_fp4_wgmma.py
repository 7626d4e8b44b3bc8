"""A grouped GEMM on the release's FP4 experts for Hopper in CUDA: the weights decoded to bf16 in registers and fed to
the bf16 tensor cores as wgmma's register operand, the activations streamed by TMA.

out[r, n] (bf16 or fp32) = sum_k x[r, k] * W_g[n, k] for the rows r of group g (rows sorted by group, ``counts[g]``
each), W_g[n, k] = E2M1(code) * 2^(scale[g, n, k/32] - 127): codes uint8 [G, N, K/2] (low nibble = even k), scales
uint8 E8M0 [G, N, K/32].  x holds the activations' FP8 values as bf16 (``kernels_quantized._act_quant_t(x,
qdq=True)``): every product is exact, as in the FP8 x FP4 GEMM the official code runs, and one fp32 MMA chain sums
over all of K with no per-32 promotion (a weight's scale is applied when its code is decoded, which is exact too).

The tile is swapped: the weights are wgmma's A (64 rows a warpgroup, from registers, where they are decoded), the
tokens its N (``TM`` = 64, 128 or 256 rows of one group), so a decoded weight value serves ``TM`` tokens.  Decoding
four code bytes (8 weights) takes byte permutes on two 8-entry tables (the magnitudes' low and high bf16 bytes), one
to interleave them and one plus a logic op per pair for the signs, and a bf16x2 multiply by the scale per pair: about
23 instructions.  A thread's A fragment for four k16 steps then comes from
eight consecutive code bytes of each of its two rows if the activations' columns are permuted within each 64:
``permute_k64(x)`` (column 16s + 8h + 2t + l holds input 16t + 4s + 2h + l), so the sum is the same and a thread's
16 inputs share one 32-wide scale block.

Layout: a persistent grid over (group, token tile, 128 weight rows) tiles, found on the GPU from the per-group tile
offsets (no host sync); warpgroup 0 is the TMA producer (activation tile [TM, 64] bf16 in the 128-byte swizzle,
code tile [128, 32] bytes), warpgroups 1-2 decode their 64 rows and multiply.  A warpgroup holds two A buffers, so a
stage's decode runs while its previous stage's MMAs do (and the other warpgroup's).  The bf16 epilogue transposes
each 8 x 8 block of the accumulators in registers (movmatrix) so a thread stores 4 consecutive rows of one token.

    fp4_grouped_gemm_wgmma(x_perm bf16 [M, K], codes uint8 [G, N, K/2], scales uint8 [G, N, K/32], counts [G])
        -> bf16 or fp32 [M, N]
    fp4_grouped_experts_wgmma(...): kernels_quantized.fp4_grouped_experts on it (gate, up, SwiGLU fused with w2's
        activation quantization, down)

Measured on an H100 (examples/benchmarks/fp4_wgmma.py, CUDA-graph replays, the w1/w3 shape 5120 -> 2304): 1.44x /
1.04x / 0.95x / 0.87x the bf16 ``torch._grouped_mm`` at 128 / 256 / 512 / 1,024 rows per expert (32 experts), 1.39x at
128 rows over 384 experts, 1.43x / 1.67x at decode sizes (6 rows over 32 experts / 1 row over 384); in the same runs
decoding the experts to bf16 first reaches 0.21-0.74x and the Triton kernels 0.39-0.83x (1.39x / 1.40x at the decode
sizes).  The whole experts block at the released model's prefill (384 experts, 64 rows each): 1.66x bf16.  The
decode costs about 23 issue slots per 8 weights a token tile, so below 128 rows per tile the MMAs wait on it.  The
second A buffer (against waiting for each stage's MMAs before the next decode), same run, random codes: 702 -> 733
TFLOP/s (w1/w3, 1,536 rows per expert), 644 -> 652 (w2), 304 -> 337 (64 rows over 384 experts); without the decode
the pipeline reaches 780, without the epilogue 750.  The transposed epilogue stores (against one 2-byte store per
value), same run, 1,536 rows per expert: w1/w3 621 -> 638 TFLOP/s, w2 554 -> 582.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .cuda_module import (
    HOPPER_PTX,
    TMA_SWIZZLE_128B,
    TMA_SWIZZLE_NONE,
    TMA_UINT8,
    TMA_UINT16,
    CudaKernel,
    compile_cubin,
    sm_count,
    tensor_map_2d,
)
from .kernels_quantized import _act_quant_t, group_starts, rows_per_expert

BLOCK_N, BLOCK_K = 128, 64  # weight rows a CTA (two math warpgroups); K a stage (64 bf16 = one 128-byte row)
STAGES = {64: 10, 128: 8, 256: 5}  # token tile -> pipeline stages (shared memory: TM * 128 + 4096 bytes each)
THREADS = 384


def _wgmma(tm: int) -> str:
    # wgmma m64nTMk16 bf16 x bf16 -> f32, A (the decoded weights) from four registers, B (the tokens) K-major in shared
    # memory
    n = tm // 2
    regs = ",".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    ptx = (f"wgmma.mma_async.sync.aligned.m64n{tm}k16.f32.bf16.bf16 {{{regs}}}, "
           f"{{%{n},%{n + 1},%{n + 2},%{n + 3}}}, %{n + 4}, 1, 1, 1, 0;")
    return ("__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t db) {\n"
            f'  asm volatile("{ptx}"\n    : {outs}\n'
            '    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));\n}\n')


def _source(tm: int, stages: int, out_f32: bool) -> str:
    head = f"#define TM {tm}\n#define STAGES {stages}\n#define OUT_F32 {int(out_f32)}\n"
    return head + _DEFINES + HOPPER_PTX + _wgmma(tm) + _KERNEL


_DEFINES = r"""
#include <cuda_bf16.h>
#include <stdint.h>

#define BN 128
#define BK 64
#define ACC (TM / 2)  // accumulator registers a thread: 64 weight rows x TM tokens over 128 threads
#if OUT_F32
#define OUT_T float
#else
#define OUT_T __nv_bfloat16
#endif
"""

_KERNEL = r"""
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
// two fp32 -> a bf16 pair (a in the low half)
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(b), "f"(a));
  return d;
}
// an 8 x 8 matrix of 16-bit values over a warp (lane holds row lane / 4, columns 2 (lane % 4), +1) -> its transpose
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t a) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// an E8M0 scale byte as a bf16 pair: 2^(e-127) (e = 0: 2^-127, a bf16 subnormal)
__device__ __forceinline__ uint32_t scale_pair(uint32_t e) {
  const uint32_t h = e ? (e << 7) : 0x40u;
  return h | (h << 16);
}
// four code bytes (two E2M1 codes each, low nibble first) -> four bf16 pairs times the scale.  The magnitude (3 bits)
// indexes two 8-byte tables, the low and the high byte of its bf16 value (0, .5, 1, 1.5, 2, 3, 4, 6); the sign
// (bit 3) goes to bit 15 or 31.
__device__ __forceinline__ void decode4(uint32_t w, uint32_t scale, uint32_t* v) {
  const uint32_t m = w & 0x77777777u, w4 = w << 4;
  const uint32_t lo01 = prmt(0xC0800000u, 0xC0804000u, m), hi01 = prmt(0x3F3F3F00u, 0x40404040u, m);
  const uint32_t lo23 = prmt(0xC0800000u, 0xC0804000u, m >> 16), hi23 = prmt(0x3F3F3F00u, 0x40404040u, m >> 16);
  v[0] = mul_bf16x2(prmt(lo01, hi01, 0x5140) | (prmt(w4, w, 0x4000) & 0x80008000u), scale);
  v[1] = mul_bf16x2(prmt(lo01, hi01, 0x7362) | (prmt(w4, w, 0x5111) & 0x80008000u), scale);
  v[2] = mul_bf16x2(prmt(lo23, hi23, 0x5140) | (prmt(w4, w, 0x6222) & 0x80008000u), scale);
  v[3] = mul_bf16x2(prmt(lo23, hi23, 0x7362) | (prmt(w4, w, 0x7333) & 0x80008000u), scale);
}

// tile -> (group, its first row, rows left from there, first weight row); tiles run token-tile major, so the CTAs
// running together share a group's weight tiles (in L2)
__device__ __forceinline__ bool tile_of(int tile, int n_tiles, int G, const int* __restrict__ tile_start,
                                        const int* __restrict__ row_start, int& g, int& r0, int& rows, int& n0) {
  const int q = tile / n_tiles;
  if (q >= __ldg(tile_start + G)) return false;
  int lo = 0, hi = G - 1;  // the last group whose first tile is <= q (empty groups share their successor's start)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(tile_start + mid) <= q) lo = mid; else hi = mid - 1;
  }
  g = lo;
  const int tt = q - __ldg(tile_start + g);
  r0 = __ldg(row_start + g) + tt * TM;
  rows = __ldg(row_start + g + 1) - r0;
  n0 = (tile % n_tiles) * BN;
  return true;
}

extern "C" __global__ void __launch_bounds__(384, 1)
fp4_grouped_wgmma(const __grid_constant__ TensorMap tma_x, const __grid_constant__ TensorMap tma_c,
                  const unsigned char* __restrict__ scales, OUT_T* __restrict__ out,
                  const int* __restrict__ tile_start, const int* __restrict__ row_start,
                  int N, int K, int G, int tiles_upper) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  unsigned char* sX = smem;                        // [STAGES][TM rows][128 bytes], swizzled
  unsigned char* sC = sX + STAGES * TM * 128;      // [STAGES][BN rows][32 code bytes]
  uint64_t* full = (uint64_t*)(sC + STAGES * BN * 32);
  uint64_t* empty = full + STAGES;

  const int n_tiles = (N + BN - 1) / BN, k_stages = K / BK, KB = K / 32;
  const int wg = threadIdx.x / 128;

  init_stage_barriers(full, empty, STAGES);

  if (wg == 0) {  // producer: one thread streams the stages of every tile this CTA takes
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int j = 0, g, r0, rows, n0;
      for (int tile = blockIdx.x; tile < tiles_upper; tile += gridDim.x) {
        if (!tile_of(tile, n_tiles, G, tile_start, row_start, g, r0, rows, n0)) break;
        for (int ks = 0; ks < k_stages; ++ks, ++j) {
          const int s = j % STAGES;
          if (j >= STAGES) mbar_wait(&empty[s], ((j / STAGES) - 1) & 1);
          mbar_expect_tx(&full[s], TM * 128 + BN * 32);
          tma_load(sX + s * TM * 128, &tma_x, &full[s], ks * BK, r0);
          tma_load(sC + s * BN * 32, &tma_c, &full[s], ks * 32, g * N + n0);
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

  const int mw = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, t = lane % 4;
  const int row = mw * 64 + warp * 16 + lane / 4;  // this thread's weight rows in the tile: row, row + 8
  float acc[ACC];
  uint32_t a0[16], a1[16];  // two A buffers: a stage's decode writes one while the previous stage's MMAs read the other
  int j = 0, g, r0, rows, n0;
  for (int tile = blockIdx.x; tile < tiles_upper; tile += gridDim.x) {
    if (!tile_of(tile, n_tiles, G, tile_start, row_start, g, r0, rows, n0)) break;
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
    // this thread's scale bytes: rows row and row + 8 (clamped inside the group), block 2 ks + t / 2 of stage ks,
    // read two stages ahead of their use (e: this stage's, f: the next one's)
    const unsigned char* sc0 = scales + ((size_t)g * N + min(n0 + row, N - 1)) * KB + t / 2;
    const unsigned char* sc1 = scales + ((size_t)g * N + min(n0 + row + 8, N - 1)) * KB + t / 2;
    uint32_t e0 = __ldg(sc0), e1 = __ldg(sc1), f0 = e0, f1 = e1;
    if (k_stages > 1) { f0 = __ldg(sc0 + 2); f1 = __ldg(sc1 + 2); }
    int ks = 0, prev = -1;
    // one stage: decode into a, issue its four MMAs, then wait for the previous stage's (whose buffer the next
    // stage's decode overwrites) and hand that stage's shared memory back to the producer
    auto stage = [&](uint32_t (&a)[16]) {
      const int s = j % STAGES;
      const uint32_t scale0 = scale_pair(e0), scale1 = scale_pair(e1);
      e0 = f0; e1 = f1;
      if (ks + 2 < k_stages) { f0 = __ldg(sc0 + 2 * (ks + 2)); f1 = __ldg(sc1 + 2 * (ks + 2)); }
      mbar_wait(&full[s], (j / STAGES) & 1);
      // this thread's 8 code bytes of rows row and row + 8 -> the four k16 steps' A fragments (row, cols 2t..;
      // row + 8, cols 2t..; row, cols 2t + 8..; row + 8, cols 2t + 8..)
      const unsigned char* c = sC + s * BN * 32 + row * 32 + 8 * t;
      const uint2 cg = *reinterpret_cast<const uint2*>(c), ch = *reinterpret_cast<const uint2*>(c + 8 * 32);
      uint32_t vg[8], vh[8];
      decode4(cg.x, scale0, vg); decode4(cg.y, scale0, vg + 4);
      decode4(ch.x, scale1, vh); decode4(ch.y, scale1, vh + 4);
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16) {
        a[4 * k16 + 0] = vg[2 * k16]; a[4 * k16 + 1] = vh[2 * k16];
        a[4 * k16 + 2] = vg[2 * k16 + 1]; a[4 * k16 + 3] = vh[2 * k16 + 1];
      }
      wgmma_fence();
      const unsigned char* x = sX + s * TM * 128;
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16) wgmma_rs(acc, a + 4 * k16, smem_desc(x + 32 * k16));
      wgmma_commit();
      wgmma_wait<1>();
      if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
      prev = s; ++ks; ++j;
    };
    // the buffers alternate in a loop unrolled by two (a register array cannot be picked at run time)
    while (ks + 2 <= k_stages) { stage(a0); stage(a1); }
    if (ks < k_stages) stage(a0);
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(&empty[prev]);
    fence_regs(acc);
    // epilogue: D[weight row, token] -> out[token, weight row]
#if !OUT_F32
    if ((N & 3) == 0) {
      // bf16 rows of 8 bytes: per 8 tokens, the two 8 x 8 blocks (rows +0..7, +8..15 of the warp's 16) transposed in
      // registers (movmatrix: this thread then holds token lane / 4, rows 2t, 2t + 1 of each) and one exchange with
      // the neighbouring lane give each thread 4 consecutive rows of one token, so a warp's store writes 8 tokens x
      // 32 bytes (whole sectors) instead of 32 scattered 2-byte values
      const int n = n0 + mw * 64 + warp * 16 + ((t & 1) ? 8 + 2 * (t - 1) : 2 * t);
#pragma unroll
      for (int f = 0; f < TM / 8; ++f) {
        const uint32_t b0 = movmatrix_t(pack_bf16(acc[4 * f + 0], acc[4 * f + 1]));
        const uint32_t b1 = movmatrix_t(pack_bf16(acc[4 * f + 2], acc[4 * f + 3]));
        const uint32_t got = __shfl_xor_sync(0xffffffffu, (t & 1) ? b0 : b1, 1);
        const int tok = f * 8 + lane / 4;
        if (tok < rows && n < N)
          *reinterpret_cast<uint2*>(out + (size_t)(r0 + tok) * N + n) = (t & 1) ? make_uint2(got, b1)
                                                                               : make_uint2(b0, got);
      }
      continue;
    }
#endif
#pragma unroll
    for (int f = 0; f < TM / 8; ++f) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = f * 8 + 2 * t + (i & 1), n = n0 + row + 8 * (i >> 1);
        if (tok < rows && n < N) {
          const float v = acc[4 * f + i];
#if OUT_F32
          out[(size_t)(r0 + tok) * N + n] = v;
#else
          out[(size_t)(r0 + tok) * N + n] = __float2bfloat16_rn(v);
#endif
        }
      }
    }
  }
}
"""


@functools.cache
def _kernel(tm: int, out_f32: bool) -> CudaKernel:
    stages = STAGES[tm]
    smem = stages * (tm * 128 + BLOCK_N * 32) + 2 * stages * 8 + 1024
    return CudaKernel(compile_cubin(_source(tm, stages, out_f32), [], arch="sm_90a"), "fp4_grouped_wgmma", smem)


def permute_k64(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> the column order the kernel reads: within each 64 columns, column 16s + 8h + 2t + l holds input
    16t + 4s + 2h + l (s, t in 0..3; h, l in 0..1)."""
    m, k = x.shape
    return x.view(m, k // 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k)


def token_tile(rows_per_group: int) -> int:
    """The token tile for this many rows per group: the smallest of 64, 128, 256 that holds them."""
    return 64 if rows_per_group <= 64 else 128 if rows_per_group <= 128 else 256


def fp4_grouped_gemm_wgmma(x_perm: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor,
                           tm: int = 256, out_dtype=torch.bfloat16, starts=None) -> torch.Tensor:
    """x_perm bf16 [M, K] (``permute_k64`` of the activations' FP8 values, rows sorted by group), codes uint8
    [G, N, K/2], scales uint8 E8M0 [G, N, K/32], counts int [G] -> [M, N] (rows past sum(counts) left unwritten).
    ``starts``: ``group_starts(counts, tm)`` when the caller already has it (several GEMMs on one routing)."""
    m, k = x_perm.shape
    g, n = codes.shape[0], codes.shape[1]
    if k % 64 or tuple(codes.shape) != (g, n, k // 2) or tuple(scales.shape) != (g, n, k // 32):
        raise ValueError(f"fp4_grouped_gemm_wgmma: K={k} (a multiple of 64), codes {tuple(codes.shape)} and scales "
                         f"{tuple(scales.shape)} must be [G, N, K/2] and [G, N, K/32]")
    if x_perm.dtype != torch.bfloat16 or codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError("fp4_grouped_gemm_wgmma takes bf16 activations, uint8 codes and uint8 E8M0 scales")
    if tm not in STAGES:
        raise ValueError(f"token tile {tm} is not one of {sorted(STAGES)}")
    out = torch.empty(m, n, dtype=out_dtype, device=x_perm.device)
    row_start, tile_start = starts if starts is not None else group_starts(counts.to(x_perm.device), tm)
    n_tiles = -(-n // BLOCK_N)
    upper = (-(-m // tm) + g) * n_tiles  # a bound on the tiles without a host sync
    x_perm, codes, scales = x_perm.contiguous(), codes.contiguous(), scales.contiguous()
    kernel = _kernel(tm, out_dtype == torch.float32)
    kernel.launch((max(1, min(upper, sm_count(x_perm.device.index))),), (THREADS,), [
        tensor_map_2d(x_perm.view(torch.int16), (BLOCK_K, tm), TMA_UINT16, TMA_SWIZZLE_128B),
        tensor_map_2d(codes.view(g * n, k // 2), (32, BLOCK_N), TMA_UINT8, TMA_SWIZZLE_NONE),
        scales, out, tile_start, row_start, ctypes.c_int32(n), ctypes.c_int32(k), ctypes.c_int32(g),
        ctypes.c_int32(upper)])
    return out


def fp4_grouped_experts_wgmma(x, counts, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, limit: float,
                              x_quantized: bool = False):
    """``kernels_quantized.fp4_grouped_experts`` with the three GEMMs on this kernel: x bf16 [m, dim] sorted by
    expert (x_quantized: already ``kernels_quantized.quantize_for_wgmma``'s values), counts [E], routing weights
    fp32 [m], codes/scales as stored -> bf16 [m, dim]."""
    tm = token_tile(rows_per_expert(x.shape[0], w1.shape[0]))
    starts = group_starts(counts.to(x.device), tm)  # one routing, three GEMMs
    u8 = [t.view(torch.uint8) for t in (w1, w1_scale, w3, w3_scale, w2, w2_scale)]
    a = x if x_quantized else _act_quant_t(x, qdq=True, permute=True)[0]
    gate = fp4_grouped_gemm_wgmma(a, u8[0], u8[1], counts, tm, starts=starts)
    up = fp4_grouped_gemm_wgmma(a, u8[2], u8[3], counts, tm, starts=starts)
    # the weighted SwiGLU and w2's activation quantization in one pass over gate and up
    h, _ = _act_quant_t(gate, qdq=True, permute=True, swiglu=(up, weights, limit))
    return fp4_grouped_gemm_wgmma(h, u8[4], u8[5], counts, tm, starts=starts)
