"""An FP8 block-scaled GEMM for Hopper in CUDA (wgmma + TMA) with the release's per-32 scales: the measured case
against an FP8 tensor-core path for prefill, kept beside the benchmarks, not in the package.

out[M, N] (bf16) = sum over 32-wide K blocks kb of (A_q[:, kb] @ B_q[:, kb]^T) * a_scale[kb, m] * b_scale[n/32, kb],
A_q float8_e4m3fn [M, K] (activations quantized per 32 along K), B_q float8_e4m3fn [N, K] (the stored weight, one
UE8M0 scale per 32x32 block).  One FP8 wgmma (m64nNk32) computes each 32-block's partial product in fp32; the
partial is then promoted into the fp32 accumulator with one FFMA per element and its two power-of-two scales.

Layout: a persistent grid; warpgroup 0 is the producer (one thread issues TMA loads of A, B and the activation
scales through a ring of STAGES shared-memory stages, 128-byte swizzle, the layout wgmma reads); warpgroups 1-2
each own 64 rows of the 128-row tile.  With two partials a warpgroup (DOUBLE) block kb+1's wgmma is issued before
block kb is promoted, so the FFMAs can run under the MMA.

Measured on an H100 at 8192 rows, the released shapes (examples/benchmarks/fp8_wgmma.py, docs/results.md): 0.5-0.67x
our bf16 GEMM, behind the package's prefill path (weight decoded to bf16 + cuBLAS, 0.48-0.94x) on all but wkv; the
same pipeline without the promotion reaches 1.09-1.14x (wo_b, shared w1/w3 at BLOCK_N 192).  The promotion is one
FFMA per accumulator per 32 inputs, as many CUDA-core issue slots as the tensor core spends on the block, so an exact
per-32 FP8 GEMM on Hopper sits near the bf16 tensor-core rate however it is scheduled; Blackwell's block-scaled
MMA takes these scales in the instruction.

    fp8_gemm_wgmma(a_codes [M, K], a_scale_t [ceil(K/32), M] fp32, weight [N, K], b_scale [ceil(N/32), ceil(K/32)]
                   uint8 E8M0 bytes) -> bf16 or fp32 [M, N]
"""

from __future__ import annotations

import ctypes
import functools

import torch

from deepseek_v41.cuda_module import (
    HOPPER_PTX,
    TMA_FLOAT32,
    TMA_SWIZZLE_128B,
    TMA_SWIZZLE_NONE,
    TMA_UINT8,
    CudaKernel,
    compile_cubin,
    sm_count,
    tensor_map_2d,
)

BLOCK_M, BLOCK_K = 128, 128  # CTA rows; BLOCK_K bytes of FP8 per row = the 128-byte swizzle span
CONFIG = (128, False, 6)  # (BLOCK_N, two partial accumulators a warpgroup, stages): fastest or near it on every shape
THREADS = 384  # warpgroup 0: the TMA producer (one thread issues); warpgroups 1-2: math, 64 rows each


def _wgmma(n: int) -> str:
    # wgmma m64nNk32 e4m3 x e4m3 -> f32 (N/2 registers a thread), both operands from shared memory; scale-d 0: a fresh
    # partial
    regs = ",".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    da, db, zero = n // 2, n // 2 + 1, n // 2 + 2
    ptx = (r"{\n.reg .pred p;\nsetp.ne.b32 p, %" + str(zero) + r", 0;\n"
           f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{regs}}}, %{da}, %{db}, p, 1, 1;" + r"\n}\n")
    return ("__device__ __forceinline__ void wgmma_mma(float* d, uint64_t da, uint64_t db, int accumulate) {\n"
            f'  asm volatile("{ptx}"\n    : {outs}\n    : "l"(da), "l"(db), "r"(accumulate));\n}}\n'
            "__device__ __forceinline__ void wgmma_fresh(float* d, uint64_t da, uint64_t db) {\n"
            "  wgmma_mma(d, da, db, 0);\n}\n")


def _source(bn: int, double: bool, stages: int, out_f32: bool, no_promote: bool = False) -> str:
    head = (f"#define BN {bn}\n#define DOUBLE {int(double)}\n#define STAGES {stages}\n#define OUT_F32 {int(out_f32)}\n"
            f"#define NO_PROMOTE {int(no_promote)}\n")
    return head + _DEFINES + HOPPER_PTX + _wgmma(bn) + _KERNEL


_DEFINES = r"""
#include <cuda_bf16.h>
#include <stdint.h>

#define BM 128
#define BK 128
#define GROUP_M 8
#define ACC (BN / 2)   // accumulator registers a thread: 64 rows x BN columns over 128 threads
#define WB (BN / 32)   // weight scale blocks across the tile
#define PROMOTES (DOUBLE || !NO_PROMOTE)  // the stage loop scales partials (all but the --no-promote diagnostic)
#if OUT_F32
#define OUT_T float
#else
#define OUT_T __nv_bfloat16
#endif
"""

_KERNEL = r"""
__device__ __forceinline__ float e8m0(uint32_t e) {  // UE8M0 byte -> 2^(e-127); 0 -> 2^-127 (a subnormal)
  return e ? __uint_as_float(e << 23) : __uint_as_float(0x400000u);
}

// promote a 64x128 partial into the accumulator: rows r (elements 0,1 of each n8 fragment) and r+8 (2,3),
// fragment f's columns in weight block f/4
__device__ __forceinline__ void promote(float* acc, const float* t, float sa0, float sa1, const float* sw) {
#pragma unroll
  for (int f = 0; f < BN / 8; ++f) {
    const float c0 = sa0 * sw[f >> 2], c1 = sa1 * sw[f >> 2];
    acc[4 * f + 0] = fmaf(t[4 * f + 0], c0, acc[4 * f + 0]);
    acc[4 * f + 1] = fmaf(t[4 * f + 1], c0, acc[4 * f + 1]);
    acc[4 * f + 2] = fmaf(t[4 * f + 2], c1, acc[4 * f + 2]);
    acc[4 * f + 3] = fmaf(t[4 * f + 3], c1, acc[4 * f + 3]);
  }
}

// one stage's weight scales: word b holds blocks kb..kb+3 of weight row block n0/32 + b (E8M0 bytes)
__device__ __forceinline__ void load_wscales(uint32_t* w, const unsigned char* __restrict__ b_scale, int stage_k,
                                             int n0, int NB, int KB4, int bs_stride) {
#pragma unroll
  for (int b = 0; b < WB; ++b) {
    const int nb = n0 / 32 + b;
    w[b] = (stage_k < KB4 && nb < NB) ? __ldg((const uint32_t*)(b_scale + (size_t)nb * bs_stride) + stage_k) : 0u;
  }
}
__device__ __forceinline__ void wscale(float* sw, const uint32_t* w, int kb) {
#pragma unroll
  for (int b = 0; b < WB; ++b) sw[b] = e8m0((w[b] >> (8 * kb)) & 0xFF);
}

// the tile's first row and column: GROUP_M row tiles at a time sweep the columns (the weight tiles stay in L2)
__device__ __forceinline__ void tile_origin(int tile, int tiles_m, int tiles_n, int& m0, int& n0) {
  const int per_group = GROUP_M * tiles_n, first_m = (tile / per_group) * GROUP_M;
  const int gm = min(tiles_m - first_m, GROUP_M);
  m0 = (first_m + (tile % per_group) % gm) * BM;
  n0 = ((tile % per_group) / gm) * BN;
}

// a pair of adjacent outputs, or one
__device__ __forceinline__ void store_pair(float* d, float x, float y) {
  *reinterpret_cast<float2*>(d) = make_float2(x, y);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* d, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void store_one(float* d, float x) { *d = x; }
__device__ __forceinline__ void store_one(__nv_bfloat16* d, float x) { *d = __float2bfloat16_rn(x); }

extern "C" __global__ void __launch_bounds__(384, 1)
fp8_gemm_wgmma(const __grid_constant__ TensorMap tma_a, const __grid_constant__ TensorMap tma_b,
               const __grid_constant__ TensorMap tma_as, const unsigned char* __restrict__ b_scale,
               OUT_T* __restrict__ out, int M, int N, int K, int bs_stride) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  unsigned char* sA = smem;                                  // [STAGES][BM rows][BK bytes], swizzled
  unsigned char* sB = sA + STAGES * BM * BK;                 // [STAGES][BN rows][BK bytes], swizzled
  float* sAS = (float*)(sB + STAGES * BN * BK);              // [STAGES][4 blocks][BM rows] activation scales
  uint64_t* full = (uint64_t*)(sAS + STAGES * 4 * BM);
  uint64_t* empty = full + STAGES;

  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN, tiles = tiles_m * tiles_n;
  const int k_stages = (K + BK - 1) / BK, NB = (N + 31) / 32;
  const int wg = threadIdx.x / 128;

  init_stage_barriers(full, empty, STAGES);

  if (wg == 0) {  // producer: one thread streams the stages of every tile this CTA takes
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int j = 0;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int m0, n0;
        tile_origin(tile, tiles_m, tiles_n, m0, n0);
        for (int ks = 0; ks < k_stages; ++ks, ++j) {
          const int s = j % STAGES;
          if (j >= STAGES) mbar_wait(&empty[s], ((j / STAGES) - 1) & 1);
          mbar_expect_tx(&full[s], (BM + BN) * BK + 4 * BM * 4);
          tma_load(sA + s * BM * BK, &tma_a, &full[s], ks * BK, m0);
          tma_load(sB + s * BN * BK, &tma_b, &full[s], ks * BK, n0);
          tma_load(sAS + s * 4 * BM, &tma_as, &full[s], m0, ks * 4);
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

  const int mw = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int row = mw * 64 + warp * 16 + lane / 4;  // this thread's rows in the tile: row, row + 8
  float acc[ACC], t0[ACC];
#if DOUBLE
  float t1[ACC];
#endif
  uint32_t wcur[WB], wnxt[WB];
  float sw[WB];
  int j = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int m0, n0;
    tile_origin(tile, tiles_m, tiles_n, m0, n0);
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
    load_wscales(wcur, b_scale, 0, n0, NB, k_stages, bs_stride);
    for (int ks = 0; ks < k_stages; ++ks, ++j) {
      const int s = j % STAGES;
      const unsigned char* a_tile = sA + s * BM * BK + mw * 64 * BK;
      const unsigned char* b_tile = sB + s * BN * BK;
#if PROMOTES
      const float* as = sAS + s * 4 * BM + row;
      if (ks + 1 < k_stages) load_wscales(wnxt, b_scale, ks + 1, n0, NB, k_stages, bs_stride);
#endif
      mbar_wait(&full[s], (j / STAGES) & 1);
#if DOUBLE
      // issue block b into one partial, then promote block b-1 from the other while it runs; the stage ends with
      // no MMA in flight (a wgmma's registers must not cross the loop's back edge)
      wgmma_fence(); wgmma_fresh(t0, smem_desc(a_tile), smem_desc(b_tile)); wgmma_commit();
      wgmma_fence(); wgmma_fresh(t1, smem_desc(a_tile + 32), smem_desc(b_tile + 32)); wgmma_commit();
      wgmma_wait<1>(); fence_regs(t0);
      wscale(sw, wcur, 0); promote(acc, t0, as[0], as[8], sw);
      wgmma_fence(); wgmma_fresh(t0, smem_desc(a_tile + 64), smem_desc(b_tile + 64)); wgmma_commit();
      wgmma_wait<1>(); fence_regs(t1);
      wscale(sw, wcur, 1); promote(acc, t1, as[BM], as[BM + 8], sw);
      wgmma_fence(); wgmma_fresh(t1, smem_desc(a_tile + 96), smem_desc(b_tile + 96)); wgmma_commit();
      wgmma_wait<1>(); fence_regs(t0);
      wscale(sw, wcur, 2); promote(acc, t0, as[2 * BM], as[2 * BM + 8], sw);
      const float a30 = as[3 * BM], a31 = as[3 * BM + 8];
      wgmma_wait<0>(); fence_regs(t1);
      if (lane == 0) mbar_arrive(&empty[s]);  // every block of stage s is read: the producer may refill it
      wscale(sw, wcur, 3); promote(acc, t1, a30, a31, sw);
#elif NO_PROMOTE  // a diagnostic for the benchmark only: one scale-free MMA chain, the pipeline's own ceiling
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) wgmma_mma(acc, smem_desc(a_tile + 32 * kb), smem_desc(b_tile + 32 * kb), 1);
      wgmma_commit();
      wgmma_wait<0>(); fence_regs(acc);
      if (lane == 0) mbar_arrive(&empty[s]);
#else
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        wgmma_fence(); wgmma_fresh(t0, smem_desc(a_tile + 32 * kb), smem_desc(b_tile + 32 * kb)); wgmma_commit();
        const float sa0 = as[kb * BM], sa1 = as[kb * BM + 8];
        wgmma_wait<0>(); fence_regs(t0);
        if (kb == 3 && lane == 0) mbar_arrive(&empty[s]);
        wscale(sw, wcur, kb); promote(acc, t0, sa0, sa1, sw);
      }
#endif
#if PROMOTES
#pragma unroll
      for (int b = 0; b < WB; ++b) wcur[b] = wnxt[b];
#endif
    }
    // epilogue: pairs of columns straight to global memory
#pragma unroll
    for (int f = 0; f < BN / 8; ++f) {
      const int col = n0 + f * 8 + (lane % 4) * 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = m0 + row + h * 8;
        if (r < M && col < N) {
          OUT_T* dst = out + (size_t)r * N + col;
          const float x = acc[4 * f + 2 * h], y = acc[4 * f + 2 * h + 1];
          if (col + 1 < N && (N % 2 == 0)) {
            store_pair(dst, x, y);
          } else {
            store_one(dst, x);
            if (col + 1 < N) store_one(dst + 1, y);
          }
        }
      }
    }
  }
}
"""


@functools.cache
def _kernel(bn: int, double: bool, stages: int, out_f32: bool, no_promote: bool = False) -> CudaKernel:
    smem = stages * ((BLOCK_M + bn) * BLOCK_K + 4 * BLOCK_M * 4) + 2 * stages * 8 + 1024
    source = _source(bn, double, stages, out_f32, no_promote)
    return CudaKernel(compile_cubin(source, [], arch="sm_90a"), "fp8_gemm_wgmma", smem)


def fp8_gemm_wgmma(a: torch.Tensor, a_scale_t: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   config=CONFIG, out_dtype=torch.bfloat16, _no_promote: bool = False) -> torch.Tensor:
    """a float8_e4m3fn [M, K], a_scale_t fp32 [ceil(K/32), M] (powers of two), b float8_e4m3fn [N, K], b_scale uint8
    [ceil(N/32), ceil(K/32)] (E8M0 bytes) -> bf16 [M, N]."""
    m, k = a.shape
    n = b.shape[0]
    if k % 16:
        raise ValueError(f"fp8_gemm_wgmma needs K a multiple of 16 (TMA row strides), got {k}")
    k_stages = -(-k // BLOCK_K)
    if a_scale_t.stride(0) % 4 or a_scale_t.stride(1) != 1:  # TMA rows: 16-byte strides
        padded = a_scale_t.new_zeros(a_scale_t.shape[0], -(-m // 4) * 4)
        padded[:, :m] = a_scale_t
        a_scale_t = padded[:, :m]
    if b_scale.shape[1] != 4 * k_stages or b_scale.stride(0) != 4 * k_stages:  # one 32-bit word per stage and row
        padded = b_scale.new_zeros(b_scale.shape[0], 4 * k_stages)
        padded[:, :b_scale.shape[1]] = b_scale
        b_scale = padded
    a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"fp8_gemm_wgmma writes bf16 or fp32, not {out_dtype}")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    bn, double, stages = config
    tiles = -(-m // BLOCK_M) * -(-n // bn)
    kernel = _kernel(bn, double, stages, out_dtype == torch.float32, _no_promote)
    kernel.launch((min(tiles, sm_count(a.device.index)),), (THREADS,), [
        tensor_map_2d(a, (BLOCK_K, BLOCK_M), TMA_UINT8, TMA_SWIZZLE_128B),
        tensor_map_2d(b, (BLOCK_K, bn), TMA_UINT8, TMA_SWIZZLE_128B),
        tensor_map_2d(a_scale_t, (BLOCK_M, 4), TMA_FLOAT32, TMA_SWIZZLE_NONE), b_scale, out,
        ctypes.c_int32(m), ctypes.c_int32(n), ctypes.c_int32(k), ctypes.c_int32(b_scale.stride(0))])
    return out
