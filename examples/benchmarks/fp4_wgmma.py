"""The CUDA FP4 grouped GEMM (``deepseek_v41/kernels_fp4_wgmma.py``) against the bf16 grouped GEMM in the same run.

    python examples/benchmarks/fp4_wgmma.py --check [--cases 32:49152:balanced 384:24576:balanced] [--out FILE]
    python examples/benchmarks/fp4_wgmma.py --gemms --graph --w1-only --gemm-cases 32:8192:balanced 32:192:random

A case is ``experts:rows:routing`` (rows = tokens x top-6, sorted by expert; routing balanced, zipf or random).
For each ``--cases`` case, the whole routed-expert block (gate/up, SwiGLU, down): the model's bf16
``grouped_forward`` (the baseline), the package's ``fp4_grouped_experts`` as configured, and the same on the wgmma
kernel, also with the SwiGLU and w2's activation quantization as two passes (before their fusion) and with the
activations quantized before the top-k copy (a sixth of the rows, as ``KeptFp4Experts`` does on this route); each
output's distance to bf16 (the FP8 activation rounding, ~4.7e-2) is printed too.  ``--gemms``: for each
``--gemm-cases`` case and routed-expert GEMM shape (w1/w3: 5120 -> 2304, w2: 2304 -> 5120), ``torch._grouped_mm`` in
bf16 on the decoded weights (the baseline), the weights decoded to bf16 first and the same GEMM, the Triton FP4
kernel at its default configuration for the rows, the wgmma kernel at its token tile for the rows (``--all-tiles``:
at each) on activations already in its column order, and with the activation quantization that writes that order.
TFLOP/s = 2·rows·N·K / time: CUDA-event medians, or CUDA-graph replays with ``--graph`` (no host launch cost).
``--check`` first compares every token tile with an fp64 product of the same operands on ragged groups (empty ones,
one row, partial tiles, N not a multiple of 128) and fails unless the bf16 output is within one rounding (2e-3, L2
relative; measured 1.63-1.66e-3) and the fp32 output within fp32 summation (1e-5; measured <= 1.3e-7).
"""

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
from gpu_timing import graph_time_us, report, time_ms
from quantized_gemm import route

from deepseek_v41 import kernels_fp4_wgmma as kw
from deepseek_v41 import kernels_quantized as kq
from deepseek_v41.cuda_module import hopper_usable
from deepseek_v41.release_format import decode_fp4_packed, encode_fp4_packed

SHAPES = [("w1/w3", 2304, 5120), ("w2", 5120, 2304)]
TILES = (64, 128, 256)


def weights(groups, n, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pairs = []
    for _ in range(groups):
        w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
        # spread the 32-blocks' exponents, as released weights have them
        w = w * torch.exp2(torch.randint(-3, 4, (n, k // 32), device="cuda", generator=gen).float()
                          ).repeat_interleave(32, 1)
        pairs.append(encode_fp4_packed(w))
    return torch.stack([p[0] for p in pairs]).view(torch.uint8), torch.stack([p[1] for p in pairs]).view(torch.uint8)


def activations(m, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen) * torch.exp2(
        torch.randint(-4, 5, (m, 1), device="cuda", generator=gen).float())
    return kq._act_quant_t(x.bfloat16(), qdq=True)[0]  # the FP8 values as bf16, as the kernels multiply them


def check(lines):
    cases = [(4, 256, 512, [0, 1, 300, 77]), (3, 200, 320, [257, 0, 64]), (8, 2304, 5120, [129] * 4 + [1, 63, 64, 65]),
             (2, 5120, 2304, [511, 256])]
    for g, n, k, counts in cases:
        codes, scales = weights(g, n, k, seed=g + n + k)
        m = sum(counts) + 5  # rows past the groups' stay unwritten
        xq = activations(m, k, seed=m)
        ref = torch.empty(sum(counts), n, dtype=torch.float64, device="cuda")
        start = 0
        for e, c in enumerate(counts):
            w = decode_fp4_packed(codes[e], scales[e].view(torch.float8_e8m0fnu), dtype=torch.float64)
            ref[start : start + c] = xq[start : start + c].double() @ w.t()
            start += c
        c = torch.tensor(counts, device="cuda")
        for tm in TILES:
            outs = (kw.fp4_grouped_gemm_wgmma(kw.permute_k64(xq), codes, scales, c, tm, dtype)[: sum(counts)].double()
                    for dtype in (torch.bfloat16, torch.float32))
            err16, err32 = (((out - ref).norm() / ref.norm()).item() for out in outs)
            lines.append(f"check G={g} N={n} K={k} counts={counts} TM={tm}: bf16 out {err16:.2e}, fp32 out {err32:.2e}")
            print(lines[-1], flush=True)
            if not (err16 < 2e-3 and err32 < 1e-5):
                raise SystemExit(f"FAILED: {lines[-1]} (gates 2e-3 / 1e-5)")


def implementations(xq, codes, scales, counts, all_tiles):
    """name -> callable for one GEMM's operands; the first is the baseline."""
    n, k = codes.shape[1], 2 * codes.shape[2]
    wb = kq.decode_fp4_weights(codes, scales.view(torch.float8_e8m0fnu))
    offs = counts.cumsum(0).to(torch.int32)
    rows = kq.rows_per_expert(xq.shape[0], codes.shape[0])
    config = kq._config("grouped", rows, None)
    a, a_scale = kq._act_quant_t(xq, qdq=bool(config[6]))
    xp = kw.permute_k64(xq)
    impls = {"bf16 grouped_mm": lambda: torch._grouped_mm(xq, wb.transpose(-2, -1), offs=offs),
             "decode + grouped_mm": lambda: torch._grouped_mm(
                 xq, kq.decode_fp4_weights(codes, scales.view(torch.float8_e8m0fnu)).transpose(-2, -1), offs=offs),
             f"triton fp4 {config[0]}x{config[1]}": partial(
                 kq._launch, a, a_scale, codes, scales, torch.bfloat16, n=n, k=k, b_fp4=True, bs_e8m0=True, bs_rows=1,
                 config=config, strides=kq._fp4_strides(codes, scales), counts=counts.int())}
    tm = kw.token_tile(rows)
    for t in TILES if all_tiles else [tm]:
        impls[f"wgmma TM={t}"] = partial(kw.fp4_grouped_gemm_wgmma, xp, codes, scales, counts, t)
    impls[f"act quant + wgmma {tm}"] = lambda: kw.fp4_grouped_gemm_wgmma(
        kq._act_quant_t(xq, qdq=True, permute=True)[0], codes, scales, counts, tm)
    return impls


def bench(args, lines):
    lines.append(f"{'experts':>7s} {'rows':>6s} {'routing':8s} {'gemm':6s} {'impl':22s} {'ms':>8s} {'TFLOP/s':>8s} "
                 f"{'vs bf16':>7s}")
    gen = torch.Generator().manual_seed(0)
    for case in args.gemm_cases:
        experts, rows, kind = case.split(":")
        experts, rows = int(experts), int(rows)
        counts = torch.tensor(route(rows, experts, kind, gen), device="cuda")
        for name, n, k in SHAPES[: 1 if args.w1_only else 2]:
            codes, scales = weights(experts, n, k, seed=n)
            base = None
            impls = implementations(activations(rows, k, seed=rows), codes, scales, counts, args.all_tiles)
            for impl, fn in impls.items():
                # replayed from a CUDA graph (no host launch cost in the figure), or CUDA events around the calls
                ms = graph_time_us(fn) / 1e3 if args.graph else time_ms(fn, args.warmup, args.reps)
                base = ms if base is None else base
                lines.append(f"{experts:7d} {rows:6d} {kind:8s} {name:6s} {impl:22s} {ms:8.4f} "
                             f"{2 * rows * n * k / ms / 1e9:8.1f} {base / ms:6.2f}x")
                print(lines[-1], flush=True)
            del codes, scales
            torch.cuda.empty_cache()


def expert_blocks(experts, counts, limit):
    """name -> callable for the routed-expert block on one routing; the first is the baseline."""
    from types import SimpleNamespace

    from deepseek_v41.moe import RoutedExperts

    rows = int(counts.sum())
    packed = [weights(experts, 2304, 5120, 1), weights(experts, 2304, 5120, 2), weights(experts, 5120, 2304, 3)]
    e8 = [(c, s.view(torch.float8_e8m0fnu)) for c, s in packed]
    config = SimpleNamespace(n_routed_experts=experts, hidden_size=5120, moe_intermediate_size=2304,
                             swiglu_limit=limit)
    model = RoutedExperts(config, {"experts": "torch_mm"}).cuda().bfloat16()
    with torch.no_grad():
        for name, (c, s) in zip(("w1", "w3", "w2"), e8, strict=True):
            getattr(model, name).copy_(kq.decode_fp4_weights(c, s))
    x = torch.randn(rows, 5120, device="cuda").bfloat16()
    wts = torch.rand(rows, device="cuda")
    fp4 = (x, counts, wts, *e8[0], *e8[1], *e8[2], limit)
    tokens = x[: max(1, rows // 6)]  # top-6 routing: the tokens whose copies x holds
    xq = kq.quantize_for_wgmma(x)
    return {"bf16 grouped_forward": lambda: model.grouped_forward(x, counts, wts),
            "fp4_grouped_experts": lambda: kq.fp4_grouped_experts(*fp4),
            "wgmma experts": lambda: kw.fp4_grouped_experts_wgmma(*fp4),
            "  SwiGLU, quant apart": partial(swiglu_apart, *fp4),
            "  quant before top-k": lambda: (kq.quantize_for_wgmma(tokens),
                                             kw.fp4_grouped_experts_wgmma(xq, *fp4[1:], x_quantized=True))[1]}


def swiglu_apart(x, counts, wts, w1, w1s, w3, w3s, w2, w2s, limit):
    # the wgmma experts block with the weighted SwiGLU and w2's activation quantization as two passes (the
    # composition before they were fused)
    from deepseek_v41.kernels_triton import weighted_swiglu_triton

    u8 = [t.view(torch.uint8) for t in (w1, w1s, w3, w3s, w2, w2s)]
    tm = kw.token_tile(kq.rows_per_expert(x.shape[0], w1.shape[0]))
    starts = kq.group_starts(counts, tm)
    a = kq._act_quant_t(x, qdq=True, permute=True)[0]
    gate = kw.fp4_grouped_gemm_wgmma(a, u8[0], u8[1], counts, tm, starts=starts)
    up = kw.fp4_grouped_gemm_wgmma(a, u8[2], u8[3], counts, tm, starts=starts)
    h = kq._act_quant_t(weighted_swiglu_triton(gate, up, wts.float(), limit), qdq=True, permute=True)[0]
    return kw.fp4_grouped_gemm_wgmma(h, u8[4], u8[5], counts, tm, starts=starts)


def bench_experts(args, lines):
    # the whole routed-expert block (gate/up, SwiGLU, down) as quantized_gemm.py times it: the model's bf16
    # grouped_forward, the package's fp4_grouped_experts, and the same on the wgmma kernel
    gen = torch.Generator().manual_seed(1)
    lines.append(f"{'experts':>7s} {'rows':>6s} {'routing':8s} {'experts block':22s} {'ms':>8s} {'TFLOP/s':>8s} "
                 f"{'vs bf16':>7s}")
    for case in args.cases:
        experts, rows, kind = case.split(":")
        experts, rows = int(experts), int(rows)
        counts = torch.tensor(route(rows, experts, kind, gen), device="cuda")
        impls = expert_blocks(experts, counts, limit=10.0)
        ref, base = impls["bf16 grouped_forward"]().float(), None
        for impl, fn in impls.items():
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            ms = time_ms(fn, args.warmup, args.reps)
            base = ms if base is None else base
            lines.append(f"{experts:7d} {rows:6d} {kind:8s} {impl:22s} {ms:8.4f} "
                         f"{2 * rows * 3 * 5120 * 2304 / ms / 1e9:8.1f} {base / ms:6.2f}x  (vs bf16 out: {err:.1e})")
            print(lines[-1], flush=True)
        del impls
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["32:49152:balanced", "32:49152:zipf", "384:24576:balanced"])
    p.add_argument("--check", action="store_true")
    p.add_argument("--gemms", action="store_true", help="also time each GEMM shape alone against its alternatives")
    p.add_argument("--gemm-cases", nargs="+", default=["32:49152:balanced", "384:24576:balanced", "32:192:random"])
    p.add_argument("--w1-only", action="store_true", help="--gemms: only the w1/w3 shape")
    p.add_argument("--all-tiles", action="store_true", help="--gemms: every token tile, not only the one chosen")
    p.add_argument("--graph", action="store_true", help="--gemms: time CUDA-graph replays (no host launch cost)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available() or not hopper_usable(torch.empty(0, device="cuda")):
        sys.exit("the wgmma FP4 GEMM needs a Hopper GPU (sm_90) and nvcc")
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {' '.join(sys.argv[1:])}"]
    if args.check:
        check(lines)
    bench_experts(args, lines)
    if args.gemms:
        bench(args, lines)
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
