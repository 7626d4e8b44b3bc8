"""The fp32 GEMMs inside the decoder blocks on one GPU, each next to the code it replaced (same run).

    python examples/benchmarks/fp32_islands.py [--tokens 16384]

- The router's scores, x bf16 [tokens, 5120] · W bf16 [384, 5120]ᵀ in fp32, and the ratio-2 compressor's
  ``wkv`` and ``wgate``, x bf16 · W fp32 [512, 5120]ᵀ each: the IEEE fp32 GEMM of the upcast operands
  (``layers.linear_fp32``, backend ``fp32_linear: fp32``) against its bf16 tensor-core emulation
  (``layers.linear_bf16x3``, ``fp32_linear: bf16x3``), forward and forward + backward, with the emulation's
  error against float64.
- mHC's mix-GEMM input gradient dx = g_y [tokens, 24] · fn [24, 20480] − coef·x [tokens, 20480]: one Triton
  pass (``kernels_triton.mix_dx_triton``) against the bf16x3 product written in fp32 and a compiled
  subtract-and-round pass (the code before the kernel); then the kernel's launches and dot precisions side by
  side (IEEE fp32 FMAs, the earlier launch; 3xTF32 on tensor cores, the current one; plain TF32, which misses
  the accuracy gate of ``tests/gpu/test_fused_elementwise_gpu.py``: within one bf16 step of the
  exact value plus 2^-20 of the terms' magnitude).
CUDA-event medians of 20 after 3 warm-up; TFLOP/s count the fp32 products once (2·m·n·k each).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import time_ms

from deepseek_v41 import layers
from deepseek_v41.kernels_triton import _mix_dx_kernel, mix_dx_triton


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def linears(tokens: int, g: torch.Generator) -> None:
    x = torch.randn(tokens, 5120, device="cuda", generator=g).bfloat16().requires_grad_()
    cases = [("router 384 experts, bf16 W", (torch.randn(384, 5120, device="cuda", generator=g) * 0.02).bfloat16()),
             ("compressor wkv, fp32 W", torch.randn(512, 5120, device="cuda", generator=g) * 0.02)]
    for name, w in cases:
        w.requires_grad_()
        dy = torch.randn(tokens, w.shape[0], device="cuda", generator=g)
        flop = 2 * tokens * w.shape[0] * w.shape[1]
        times = {}
        for label, fn in [("IEEE fp32 (old)", layers.linear_fp32), ("bf16x3 (new)", layers.linear_bf16x3)]:
            fwd = time_ms(lambda fn=fn, w=w: fn(x, w), 3, 20)
            both = time_ms(lambda fn=fn, w=w, dy=dy: torch.autograd.grad(fn(x, w), (x, w), dy), 3, 20)
            times[label] = (fwd, both)
            print(f"{name:28s} {label:16s} forward {fwd:.3f} ms ({flop / fwd / 1e9:6.1f} TFLOP/s), "
                  f"forward + backward {both:.3f} ms ({3 * flop / both / 1e9:6.1f} TFLOP/s)", flush=True)
        (fo, bo), (fn_, bn) = times.values()
        print(f"{name:28s} speed-up: forward {fo / fn_:.2f}x, forward + backward {bo / bn:.2f}x")
        y = layers.linear_bf16x3(x, w)
        gx, gw = torch.autograd.grad(y, (x, w), dy)
        x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
        print(f"{name:28s} bf16x3 rel err vs float64: y {rel_err(y, x64 @ w64.t()):.1e}, "
              f"grad_w {rel_err(gw, dy64.t() @ x64):.1e}, grad_x {rel_err(gx, dy64 @ w64):.1e} (bf16 out)")


def mix_dx_inputs(tokens: int, g: torch.Generator) -> tuple:
    # (g_y fp32 [tokens, 24], fn fp32 [24, 20480], coef fp32 [tokens, 1], x bf16 [tokens, 20480])
    k, n = 20480, 24
    return (torch.randn(tokens, n, device="cuda", generator=g), torch.randn(n, k, device="cuda", generator=g) * 0.02,
            torch.randn(tokens, 1, device="cuda", generator=g) * 1e-2,
            torch.randn(tokens, k, device="cuda", generator=g).bfloat16())


def mix_dx(tokens: int, g: torch.Generator) -> None:
    g_y, fn, coef, x = mix_dx_inputs(tokens, g)
    k = x.shape[1]
    subtract = layers.compiled_on_cuda(lambda a, c, xx: torch.addcmul(a, c, xx, value=-1.0).to(xx.dtype), dynamic=True)

    def previous():
        return subtract(layers.mm_bf16x3(g_y, fn), coef, x)

    gb = 2 * x.numel() * 2 / 1e9  # read x, write dx
    old = time_ms(previous, 3, 20)
    new = time_ms(lambda: mix_dx_triton(g_y, fn, coef, x), 3, 20)
    exact = g_y.double() @ fn.double() - coef.double() * x.double()
    print(f"mHC mix dx [{tokens}, {k}]: GEMM + compiled subtract (old) {old:.3f} ms, Triton one pass (new) {new:.3f} ms "
          f"({gb / new:.2f} TB/s reading x and writing dx), {old / new:.2f}x; rel err vs float64: old "
          f"{rel_err(previous(), exact):.1e}, new {rel_err(mix_dx_triton(g_y, fn, coef, x), exact):.1e}")


def mix_dx_launches(tokens: int, g: torch.Generator) -> None:
    import triton

    g_y, fn, coef, x = mix_dx_inputs(tokens, g)
    k, n = x.shape[1], g_y.shape[1]
    rows = slice(0, 2048)  # the gate on the first rows (float64 products of all of them would not fit)
    exact = g_y[rows].double() @ fn.double() - coef[rows].double() * x[rows].double()
    scale = g_y[rows].double().abs() @ fn.double().abs() + (coef[rows].double() * x[rows].double()).abs()
    for precision, br, bc, warps, note in [("ieee", 128, 256, 8, "earlier launch"), ("ieee", 64, 256, 4, ""),
                                          ("tf32x3", 128, 64, 4, "current launch"), ("tf32x3", 128, 128, 4, ""),
                                          ("tf32x3", 64, 64, 4, ""), ("tf32x3", 128, 32, 4, ""),
                                          ("tf32", 128, 128, 4, "")]:
        def launch(precision=precision, br=br, bc=bc, warps=warps):
            dx = torch.empty_like(x)
            _mix_dx_kernel[(triton.cdiv(tokens, br), triton.cdiv(k, bc))](
                g_y, fn, coef, x, dx, tokens, k, N=n, N_PAD=32, BLOCK_R=br, BLOCK_C=bc, PRECISION=precision,
                num_warps=warps)
            return dx

        ms = time_ms(launch, 3, 20)
        err = (launch()[rows].double() - exact).abs()
        gate = bool((err <= exact.abs() * 2.0**-7 + scale * 2.0**-20).all())
        print(f"mix dx kernel {precision:7s} {br:4d} x {bc:<4d} {warps} warps: {ms:.3f} ms "
              f"({2 * x.numel() * 2 / ms / 1e9:.2f} TB/s), accuracy gate {'met' if gate else 'MISSED'}"
              + (f"  ({note})" if note else ""), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch (4 x 4096 by default)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp32_islands.py needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens")
    g = torch.Generator(device="cuda").manual_seed(0)
    linears(args.tokens, g)
    mix_dx(args.tokens, g)
    mix_dx_launches(args.tokens, g)


if __name__ == "__main__":
    main()
