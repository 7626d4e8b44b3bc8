"""The CUDA FP8 block-scaled GEMM (``variants/fp8_wgmma_kernel.py``) against our bf16 GEMM in the same run.

    python examples/benchmarks/fp8_wgmma.py --check [--tokens 8192 1024] [--configs 96,1,7 128,1,6] [--out FILE]
    python examples/benchmarks/fp8_wgmma.py --no-promote --shapes attn.wo_b   # also the pipeline's own ceiling

For each released FP8 linear (architecture.md §12) at each ``--tokens`` row count: the GEMM alone on quantized
activations (each configuration ``(BLOCK_N, two partials, stages)``), ``fp8_linear`` as the model calls it (activation
quantization + GEMM), the former prefill path (the weight decoded to bf16, cuBLAS on the quantized activations'
bf16 values), and ``torch.matmul`` in bf16 on the decoded weight, the baseline.  TFLOP/s = 2·M·N·K / time, CUDA-event
medians.  ``--check`` first compares every configuration with an fp64 product of the same FP8 operands on ragged
shapes and fails unless every output is within one bf16 rounding (2e-3, L2 relative; measured 1.66e-3) and its fp32
output within the FP8 MMA's floor (1e-4; measured 4.6e-5).  ``--no-promote`` adds the same kernel without its
promotion step (wrong numbers, timing only): what the pipeline itself reaches.
"""

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
from gpu_timing import report, time_ms
from quantized_gemm import DENSE
from variants import fp8_wgmma_kernel as kw

from deepseek_v41 import kernels_quantized as kq
from deepseek_v41.cuda_module import hopper_usable
from deepseek_v41.release_format import decode_fp8_blockwise, encode_fp8_blockwise


def operands(m, n, k, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    # spread the weight blocks' exponents, as released weights have them
    w = w * torch.exp2(torch.randint(-3, 4, (-(-n // 32), -(-k // 32)), device="cuda", generator=gen).float()
                      ).repeat_interleave(32, 0).repeat_interleave(32, 1)[:n, :k]
    wq, ws = encode_fp8_blockwise(w)
    x = (torch.randn(m, k, device="cuda", generator=gen) * torch.exp2(torch.randint(-4, 5, (m, 1), device="cuda",
                                                                                  generator=gen).float())).bfloat16()
    return x, wq, ws


def reference(a, a_scale_t, wq, ws):
    # fp64 product of the same FP8 operands: codes x scales, exact in fp64
    k = a.shape[1]
    xa = a.double() * a_scale_t.t().double().repeat_interleave(32, 1)[:, :k]
    wb = decode_fp8_blockwise(wq, ws, dtype=torch.float64)
    return xa @ wb.t()


def check(configs, lines):
    # every configuration against fp64 on the same FP8 operands: bf16 output within one rounding, fp32 output within
    # the FP8 MMA's floor (test_quantized_kernels_gpu.FP32_FLOOR["fp8_mma"])
    shapes = [(1000, 1280, 5120), (300, 200, 1280), (4096, 512, 1024), (129, 2304, 2320), (257, 5120, 2304)]
    for m, n, k in shapes:
        x, wq, ws = operands(m, n, k, seed=m + n + k)
        a, a_scale_t = kq._act_quant_t(x)
        ref = reference(a, a_scale_t, wq, ws)
        for cfg in configs:
            out16, out32 = (kw.fp8_gemm_wgmma(a, a_scale_t, wq, ws.view(torch.uint8), cfg, out_dtype=dtype).double()
                            for dtype in (torch.bfloat16, torch.float32))
            err16, err32 = (((out - ref).norm() / ref.norm()).item() for out in (out16, out32))
            lines.append(f"check M={m} N={n} K={k} config={cfg}: bf16 out {err16:.2e}, fp32 out {err32:.2e}")
            print(lines[-1], flush=True)
            if not (err16 < 2e-3 and err32 < 1e-4):
                raise SystemExit(f"FAILED: {lines[-1]} (gates 2e-3 / 1e-4)")


def implementations(x, wq, ws, configs, no_promote):
    """name -> callable for one linear's operands; the first is the baseline."""
    wb = decode_fp8_blockwise(wq, ws, dtype=torch.bfloat16)
    a, a_scale_t = kq._act_quant_t(x)
    scale = ws.view(torch.uint8)
    impls = {"bf16 matmul": lambda: torch.matmul(x, wb.t()),
             "fp8_linear (default)": lambda: kq.fp8_linear(x, wq, ws),
             "decode + bf16 matmul": lambda: torch.matmul(kq._act_quant_t(x, qdq=True)[0],
                                                          kq._decode_fp8(wq, scale, True).t())}
    for cfg in configs:
        impls[f"wgmma {cfg[0]},{int(cfg[1])},{cfg[2]}"] = partial(kw.fp8_gemm_wgmma, a, a_scale_t, wq, scale, cfg)
    if no_promote:  # the same pipeline without the per-32 promotion (wrong results): its ceiling
        for cfg in [(128, False, 6), (192, False, 5)]:
            impls[f"no promotion {cfg[0]},0,{cfg[2]}"] = partial(kw.fp8_gemm_wgmma, a, a_scale_t, wq, scale, cfg,
                                                                 _no_promote=True)
    impls["act_quant + wgmma"] = lambda: kw.fp8_gemm_wgmma(*kq._act_quant_t(x), wq, scale, configs[0])
    return impls


def bench(args, configs, lines):
    lines.append(f"{'linear':14s} {'N':>6s} {'K':>5s} {'M':>5s} {'impl':22s} {'ms':>8s} {'TFLOP/s':>8s} "
                 f"{'vs bf16':>7s}")
    dense = [d for d in DENSE if not args.shapes or d[0] in args.shapes]
    for (name, n, k), m in [(shape, m) for shape in dense for m in args.tokens]:
        base = None
        for impl, fn in implementations(*operands(m, n, k), configs, args.no_promote).items():
            ms = time_ms(fn, args.warmup, args.reps)
            base = ms if base is None else base
            lines.append(f"{name:14s} {n:6d} {k:5d} {m:5d} {impl:22s} {ms:8.4f} {2 * m * n * k / ms / 1e9:8.1f} "
                         f"{base / ms:6.2f}x")
            print(lines[-1], flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--configs", nargs="+", default=["128,0,6", "192,0,5", "128,1,6", "96,1,7"])
    p.add_argument("--check", action="store_true")
    p.add_argument("--no-promote", action="store_true", help="also time the kernel without its promotion step")
    p.add_argument("--shapes", nargs="+", help="only these linears (names as in DENSE)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available() or not hopper_usable(torch.empty(0, device="cuda")):
        sys.exit("the wgmma FP8 GEMM needs a Hopper GPU (sm_90) and nvcc")
    configs = [(int(c.split(",")[0]), bool(int(c.split(",")[1])), int(c.split(",")[2])) for c in args.configs]
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {' '.join(sys.argv[1:])}"]
    if args.check:
        check(configs, lines)
    bench(args, configs, lines)
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
