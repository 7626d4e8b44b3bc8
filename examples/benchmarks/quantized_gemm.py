"""GEMMs on the released formats (``deepseek_v41/kernels_quantized.py``) against our bf16 GEMMs in the same run.

    python examples/benchmarks/quantized_gemm.py                       # dense linears + routed experts
    python examples/benchmarks/quantized_gemm.py --official DIR        # also the official TileLang fp8/fp4_gemm
    python examples/benchmarks/quantized_gemm.py --sweep               # time the kernel configurations
    python examples/benchmarks/quantized_gemm.py --ptxas               # no GPU: compile them for sm_90, report
    python examples/benchmarks/quantized_gemm.py --decode-sweep        # decode sizes, replayed from CUDA graphs
    python examples/benchmarks/quantized_gemm.py --weight-decode       # prefill's FP4 / FP8 decodes to bf16

Dense: the released FP8 linears' shapes (architecture.md §12) at prefill (``--tokens``) and decode (``--decode``)
row counts.  ``fp8_linear`` (activation quantization + block-scaled FP8 GEMM) and its GEMM alone (activations
quantized beforehand) against ``torch.matmul`` in bf16 on the decoded weight.  TFLOP/s = 2·M·N·K / time;
GB/s = (weight + activation + output bytes) / time, the weight in its own format (FP8: N·K, bf16: 2·N·K).

Routed experts: ``--experts`` experts of 5120 -> 2304 -> 5120 (examples/benchmarks/experts.py's shapes),
``--expert-tokens`` x top-6 rows sorted by expert with balanced or Zipf routing, and decode batches.
``fp4_grouped_experts`` (FP4 weights, FP8 activations, SwiGLU fused into the gate/up GEMM) against the model's
bf16 ``RoutedExperts.grouped_forward`` (``torch._grouped_mm``); FLOPs 2·S·3·5120·2304.

``--official DIR``: DIR/kernel.py is the official DeepSeek-V4 TileLang kernel file (not in this repository; the
PyPI tilelang on the path).  Its ``fp8_gemm`` takes 128-wide blocks (V4) unless it accepts ``block_size=``
(V4.1), its ``fp4_gemm`` 128-wide activation blocks unless it accepts ``act_block_size=``; the official experts
run one ``Expert.forward`` per expert (act_quant + fp4_gemm three times, SwiGLU in eager PyTorch), as
the official ``MoE.forward`` does.  CUDA-event medians.

``--decode-sweep``: the decode step's GEMMs as a captured decode step runs them (``gpu_timing.graph_time_us``:
kernel time without the host's launch cost): the dense linears and ``wo_a`` (block-diagonal, bf16 activations)
at ``--decode`` rows, the routed experts (``--experts``, top-``--topk``) for ``--decode`` tokens, each candidate
configuration (``DECODE_SWEEP``) against the bf16 path on the decoded weights; GB/s counts the weight bytes read.

``--ptxas`` needs Triton but no GPU: each ``SWEEP`` configuration compiled for sm_90 as a launch would (16-byte
aligned pointers, K and N multiples of 16), with ptxas' registers and spill stack per thread, the shared memory,
and the instructions per thread in the main loop (one step of SUB 32-blocks) read off the SASS.
"""

import argparse
import importlib.util
import inspect
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from gpu_timing import graph_time_us, report, time_ms

from deepseek_v41 import kernels_quantized as kq
from deepseek_v41.modeling_deepseek_v41 import default_dtype
from deepseek_v41.moe import RoutedExperts
from deepseek_v41.release_format import (
    decode_fp4_packed,
    decode_fp8_blockwise,
    encode_fp4_packed,
    encode_fp8_blockwise,
)

# released FP8 linears (name, N = out, K = in)
DENSE = [
    ("attn.wq_a", 1280, 5120),
    ("attn.wq_b", 32768, 1280),
    ("attn.wkv", 512, 5120),
    ("attn.wo_b", 5120, 8192),
    ("indexer.wq_b", 4096, 1280),
    ("shared.w1/w3", 2304, 5120),
    ("shared.w2", 5120, 2304),
]
SWEEP = {  # (BLOCK_M, BLOCK_N, SUB, warps, stages, SPLIT_K, MMA): MMA 0 FP8, 1 bf16, 2 bf16 with the weight on the left
    "dense_prefill": [(256, 128, 2, 8, 3, 1, 1), (128, 128, 2, 8, 4, 1, 1), (128, 256, 1, 8, 4, 1, 1),
                      (256, 128, 1, 8, 4, 1, 1), (128, 128, 1, 8, 6, 1, 0), (128, 128, 2, 8, 4, 1, 0),
                      (128, 128, 2, 8, 3, 1, 2), (256, 128, 2, 8, 3, 1, 2), (128, 256, 2, 8, 3, 1, 2),
                      (128, 128, 4, 4, 3, 1, 2), (64, 128, 2, 4, 4, 1, 2)],
    "dense_decode": [(64, 64, 2, 4, 6, 0, 1), (64, 32, 2, 4, 6, 0, 1), (64, 128, 2, 4, 4, 0, 1),
                     (64, 64, 2, 4, 6, 1, 1), (64, 64, 2, 4, 6, 0, 0), (16, 64, 2, 4, 4, 0, 2),
                     (16, 128, 2, 4, 4, 0, 2), (32, 64, 4, 4, 4, 0, 2), (16, 64, 4, 4, 3, 0, 2)],
    "swiglu_prefill": [(256, 64, 2, 8, 3, 1, 1), (128, 64, 2, 8, 4, 1, 1), (128, 128, 1, 8, 4, 1, 1),
                       (128, 64, 1, 8, 6, 1, 0), (128, 128, 2, 8, 3, 1, 2), (128, 64, 2, 4, 3, 1, 2)],
    "grouped_prefill": [(256, 128, 2, 8, 3, 1, 1), (128, 128, 2, 8, 4, 1, 1), (256, 128, 1, 8, 4, 1, 1),
                        (128, 128, 1, 8, 6, 1, 0), (128, 128, 2, 8, 3, 1, 2), (256, 128, 2, 8, 3, 1, 2),
                        (128, 256, 2, 8, 3, 1, 2)],
}


def load_official(folder):
    spec = importlib.util.spec_from_file_location("official_kernel", Path(folder) / "kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def takes(fn, name):
    return name in inspect.signature(fn).parameters


def official_fp8(official, x, n, k):
    """A callable running the official act_quant + fp8_gemm on an [n, k] weight (block 32 where it takes one)."""
    block = 32 if takes(official.fp8_gemm, "block_size") else 128
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    ws = torch.rand(-(-n // block), k // block, device="cuda") + 0.5
    kw = {"block_size": block} if block == 32 else {}

    @default_dtype(torch.bfloat16)  # as the official generate.py runs: its wrappers allocate outputs in it
    def run():
        a, s = official.act_quant(x, block, "ue8m0", torch.float32)
        return official.fp8_gemm(a, s, w, ws, torch.float32, **kw)

    return run, block


def pick(impls, official):
    # the official pass runs after ours (a failing kernel there cannot take our numbers with it): bf16 + official
    return impls if official is None else {k: v for k, v in impls.items() if k.startswith(("bf16", "official"))}


def dense_impls(x, wq, ws, wb, official):
    """name -> (callable, weight bytes) for one dense shape."""
    (n, k), m = wq.shape, x.shape[0]
    scale_bytes, e8m0 = kq._scale_arg(ws, "scale")
    config = kq._config("dense", m, None)
    a, a_scale = kq._act_quant_t(x, qdq=bool(config[6]))
    impls = {
        "bf16 matmul": (lambda: x @ wb.T, 2 * n * k),
        "fp8_linear": (lambda: kq.fp8_linear(x, wq, ws), n * k),
        "fp8 GEMM only": (lambda: kq._launch(a, a_scale, wq, scale_bytes, torch.bfloat16, n=n, k=k, b_fp4=False,
                                             bs_e8m0=e8m0, bs_rows=32, config=config,
                                             strides=(0, k, 0, scale_bytes.shape[1])), n * k),
    }
    if official is not None:
        run, block = official_fp8(official, x, n, k)
        impls[f"official{block}"] = (run, n * k)
    return impls


def bench_dense(args, official):
    lines = [f"{'linear':14s} {'N':>6s} {'K':>5s} {'M':>5s} {'impl':16s} {'ms':>8s} {'TFLOP/s':>8s} {'GB/s':>7s} "
             + f"{'vs bf16':>7s}"]
    for name, n, k in DENSE:
        w = torch.randn(n, k, device="cuda") * k**-0.5
        wq, ws = encode_fp8_blockwise(w)
        wb = decode_fp8_blockwise(wq, ws, dtype=torch.bfloat16)
        for m in args.decode + args.tokens:
            x = torch.randn(m, k, device="cuda").bfloat16()
            reps = args.reps * (5 if m <= 64 else 1)
            base = None
            for impl, (fn, wbytes) in pick(dense_impls(x, wq, ws, wb, official), official).items():
                try:
                    ms = time_ms(fn, args.warmup, reps)
                except Exception as e:  # noqa: BLE001 (an official kernel that fails here: say so, keep going)
                    lines.append(f"{name:14s} {n:6d} {k:5d} {m:5d} {impl:16s} failed: {type(e).__name__}: {e}"[:200])
                    continue
                base = ms if base is None else base
                tflops = 2 * m * n * k / ms / 1e9
                gbs = (wbytes + 2 * m * k + 2 * m * n) / ms / 1e6
                lines.append(f"{name:14s} {n:6d} {k:5d} {m:5d} {impl:16s} {ms:8.4f} {tflops:8.1f} {gbs:7.0f} "
                             f"{base / ms:6.2f}x")
                print(lines[-1], flush=True)
    return lines


def route(rows, experts, kind, gen):
    # rows per expert summing to `rows`: balanced, Zipf (expert r gets a share ~ 1/(r+1)) or random (decode)
    if kind == "random":
        return torch.bincount(torch.randint(0, experts, (rows,), generator=gen), minlength=experts).tolist()
    share = torch.ones(experts) if kind == "balanced" else 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    counts = (share / share.sum() * rows).floor().long()
    counts[0] += rows - counts.sum()
    return counts.tolist()


def official_experts(official, x, counts, weights, w1, w3, w2, limit):
    """The official MoE's expert loop: one Expert.forward per non-empty expert on its rows."""
    block = 32 if takes(official.fp4_gemm, "act_block_size") else 128
    kw = {"act_block_size": block} if block == 32 else {}

    def linear(rows, codes, scales):
        a, s = official.act_quant(rows, block, "ue8m0", torch.float32)
        return official.fp4_gemm(a, s, codes.view(torch.float4_e2m1fn_x2), scales, torch.float32, **kw)

    @default_dtype(torch.bfloat16)  # as the official generate.py runs: its wrappers allocate outputs in it
    def run():
        out, start = [], 0
        for e, c in enumerate(counts):
            if c:
                rows = x[start : start + c]
                gate, up = linear(rows, *w1[e]).float(), linear(rows, *w3[e]).float()
                h = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
                out.append(linear((weights[start : start + c, None] * h).bfloat16(), *w2[e]))
            start += c
        return out

    return run, block


def expert_impls(model, packed, x, counts, weights, limit, official):
    """name -> (callable, bytes per weight element) for one routing of the rows."""
    E, dim, inter = len(counts), packed["w2"][0].shape[1], packed["w2"][0].shape[2] * 2
    c = torch.tensor(counts, device="cuda")
    config = kq._config("grouped", x.shape[0] // E, None)
    a, a_scale = kq._act_quant_t(x[:, :inter], qdq=bool(config[6]))  # w2's input shape
    u8 = packed["w2"][0].view(torch.uint8), packed["w2"][1].view(torch.uint8)
    impls = {
        "bf16 grouped_mm": (lambda: model.grouped_forward(x, c, weights), 2),
        "fp4_grouped_experts": (lambda: kq.fp4_grouped_experts(x, c, weights, *packed["w1"], *packed["w3"],
                                                               *packed["w2"], limit), 0.5),
        "fp4 w2 GEMM only x3": (partial(kq._launch, a, a_scale, *u8, torch.bfloat16, n=dim, k=inter, b_fp4=True,
                                        bs_e8m0=True, bs_rows=1, config=config, strides=kq._fp4_strides(*u8),
                                        counts=c.int()), 0.5),
    }
    if official is not None:
        per = {k: [(v[0][e], v[1][e].float()) for e in range(E)] for k, v in packed.items()}
        run, block = official_experts(official, x, counts, weights, per["w1"], per["w3"], per["w2"], limit)
        impls[f"official{block} loop"] = (run, 0.5)
    return impls


def bench_experts(args, official):
    E, D, I, limit = args.experts, args.hidden, args.inter, 10.0
    gen = torch.Generator().manual_seed(0)
    packed = {}
    for name, (n, k) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
        pairs = [encode_fp4_packed(torch.randn(n, k, device="cuda") * k**-0.5) for _ in range(E)]
        packed[name] = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
    config = SimpleNamespace(n_routed_experts=E, hidden_size=D, moe_intermediate_size=I, swiglu_limit=limit)
    model = RoutedExperts(config, {"experts": "torch_mm"}).cuda().bfloat16()
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            codes, scales = packed[name]
            getattr(model, name).copy_(torch.stack([decode_fp4_packed(codes[e], scales[e]) for e in range(E)]))
    lines = [f"# routed experts: E={E}, {D}->{I}->{D}, limit {limit}",
             f"{'rows':>6s} {'routing':8s} {'min/max':>11s} {'impl':22s} {'ms':>8s} {'TFLOP/s':>8s} {'GB/s':>7s} "
             + f"{'vs bf16':>7s}"]
    cases = [(t * args.topk, kind) for t in args.expert_tokens for kind in ("balanced", "zipf")]
    cases += [(t * args.topk, "random") for t in args.decode]
    for S, kind in cases:
        counts = route(S, E, kind, gen)
        x = torch.randn(S, D, device="cuda").bfloat16()
        weights = torch.rand(S, device="cuda")
        active = sum(1 for n in counts if n)
        flop = 2 * S * 3 * D * I
        base = None
        impls = pick(expert_impls(model, packed, x, counts, weights, limit, official), official)
        for impl, (fn, bytes_per_weight) in impls.items():
            try:
                ms = time_ms(fn, args.warmup, args.reps)
            except Exception as e:  # noqa: BLE001 (an official kernel that fails here: say so, keep going)
                lines.append(f"{S:6d} {kind:8s} {impl:22s} failed: {type(e).__name__}: {e}"[:200])
                continue
            if impl.endswith("x3"):
                ms *= 3  # one of the three GEMMs (w2's shape), times three: the GEMM time without the rest
            base = ms if base is None else base
            wbytes = active * 3 * D * I * bytes_per_weight
            lines.append(f"{S:6d} {kind:8s} {min(counts):5d}/{max(counts):5d} {impl:22s} {ms:8.3f} "
                         f"{flop / ms / 1e9:8.1f} {(wbytes + 4 * S * D) / ms / 1e6:7.0f} {base / ms:6.2f}x")
            print(lines[-1], flush=True)
    return lines


def sweep_fns(kind, S, n, k, c, E):
    """config -> callable for one grouped kernel (random FP4 weights)."""
    pairs = [encode_fp4_packed(torch.randn(n, k, device="cuda") * k**-0.5) for _ in range(E)]
    codes, scales = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    x = torch.randn(S, k, device="cuda").bfloat16()
    acts = {mma: kq._act_quant_t(x, qdq=bool(mma)) for mma in (0, 1, 2)}
    ones = torch.ones(S, device="cuda")
    u8 = codes.view(torch.uint8), scales.view(torch.uint8)
    swiglu = (*u8, ones, 10.0) if kind == "swiglu_prefill" else None
    return {cfg: partial(kq._launch, *acts[cfg[6]], *u8, torch.bfloat16, n=n, k=k, b_fp4=True, bs_e8m0=True,
                         bs_rows=1, config=cfg, strides=kq._fp4_strides(*u8), counts=c.int(), swiglu=swiglu)
            for cfg in SWEEP[kind]}


def sweep(args):
    """Time each candidate configuration of the kernels on representative shapes -> (lines, best per kind)."""
    lines = ["# config sweep: (BLOCK_M, BLOCK_N, SUB, warps, stages, SPLIT_K) -> ms"]
    total = {}  # kind -> config -> summed ms over the kind's shapes
    shapes = {name: (n, k) for name, n, k in DENSE}
    cases = [(name, max(args.tokens), "dense_prefill") for name in ("shared.w1/w3", "attn.wo_b", "attn.wq_b")]
    cases += [("attn.wq_a", 1, "dense_decode"), ("attn.wo_b", max(args.decode), "dense_decode")]
    for name, m, kind in cases:
        n, k = shapes[name]
        wq, ws = encode_fp8_blockwise(torch.randn(n, k, device="cuda") * k**-0.5)
        x = torch.randn(m, k, device="cuda").bfloat16()
        for config in SWEEP[kind]:
            ms = time_ms(partial(kq.fp8_linear, x, wq, ws, config=config), args.warmup, args.reps)
            total.setdefault(kind, {}).setdefault(config, 0.0)
            total[kind][config] += ms
            lines.append(f"{kind} {name} M={m} {config} {ms:.4f} ms {2 * m * n * k / ms / 1e9:.1f} TFLOP/s")
            print(lines[-1], flush=True)
    E, D, I = args.experts, args.hidden, args.inter
    S = args.expert_tokens[0] * args.topk
    c = torch.tensor(route(S, E, "balanced", None), device="cuda")
    for kind, (n, k), gemms in (("swiglu_prefill", (I, D), 2), ("grouped_prefill", (D, I), 1)):
        for config, fn in sweep_fns(kind, S, n, k, c, E).items():
            ms = time_ms(fn, args.warmup, args.reps)
            total.setdefault(kind, {})[config] = ms
            lines.append(f"{kind} S={S} {config} {ms:.4f} ms {2 * gemms * S * n * k / ms / 1e9:.1f} TFLOP/s")
            print(lines[-1], flush=True)
    best = {kind: min(times, key=times.get) for kind, times in total.items()}
    lines.append(f"# fastest: {best}")
    return lines, best


# decode candidates (BLOCK_M 0 = the rows per weight rounded up to a power of two, at most 8).  No MMA 3: on an H200
# (347249f, 2026-12-07) it was 1.5-3.8x slower than MMA 4 on every dense shape at one row, and at 32 rows took
# 0.2-1.7 ms per call (wq_a: 14x MMA 1/2), which spent the sweep's time before it reached the experts.
DECODE_SWEEP = {
    "dense": [(64, 64, 2, 4, 6, 0, 1), (16, 64, 4, 4, 3, 0, 2), (32, 64, 4, 4, 4, 0, 2), (0, 16, 8, 4, 2, 0, 4),
              (0, 32, 8, 4, 2, 0, 4), (0, 32, 4, 4, 3, 0, 4), (0, 64, 4, 8, 2, 0, 4), (0, 16, 16, 8, 2, 0, 4),
              # the FP8 MMA (MMA 0): the stored codes unconverted, one fp32 promotion per 32-block and tile
              (16, 64, 4, 4, 3, 0, 0), (32, 64, 4, 4, 4, 0, 0), (64, 64, 4, 4, 4, 0, 0), (32, 128, 2, 4, 4, 0, 0)],
    "grouped": [(64, 64, 2, 4, 6, 1, 1), (16, 64, 4, 4, 3, 1, 2), (0, 16, 8, 4, 2, 1, 4), (0, 32, 8, 4, 2, 1, 4),
                (0, 32, 4, 4, 3, 1, 4), (0, 64, 4, 8, 2, 1, 4), (0, 16, 16, 8, 2, 1, 4), (16, 64, 4, 4, 3, 1, 0)],
    "swiglu": [(64, 32, 2, 4, 6, 1, 1), (16, 32, 4, 4, 3, 1, 2), (0, 16, 8, 4, 2, 1, 4), (0, 32, 8, 4, 2, 1, 4),
               (0, 16, 4, 4, 3, 1, 4), (0, 32, 4, 8, 2, 1, 4), (0, 16, 16, 8, 2, 1, 4), (16, 32, 4, 4, 3, 1, 0)],
}
WO_A = (16, 1024, 4096)  # released wo_a: 16 groups of 4096 inputs -> 1024 outputs each


def decode_sweep(args):
    """Each decode-size GEMM per candidate configuration, in replayed CUDA graphs -> (lines, fastest per kind and
    tier, as ``kq.config_tier`` keys ``kq.CONFIGS``)."""
    lines = ["# decode sweep: us per call replayed from a CUDA graph (no launch cost); GB/s of weight bytes read"]
    total = {}  # "kind tier" -> config -> summed us over its cases

    def row(kind, label, config, us, wbytes, rows_per_weight=1):
        if config is not None:
            key = f"{kind} {kq.config_tier(rows_per_weight)}"
            total.setdefault(key, {}).setdefault(config, 0.0)
            total[key][config] += us
        lines.append(f"{kind:8s} {label:34s} {config!s:28s} {us:9.1f} us {wbytes / us / 1e3:8.0f} GB/s")
        print(lines[-1], flush=True)

    for m in args.decode:
        for name, n, k in DENSE:
            wq, ws = encode_fp8_blockwise(torch.randn(n, k, device="cuda") * k**-0.5)
            wb = decode_fp8_blockwise(wq, ws, dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda").bfloat16()
            label = f"{name} M={m} {n}x{k}"
            row("dense", label + " bf16", None, graph_time_us(partial(torch.matmul, x, wb.T)), 2 * n * k)
            for config in DECODE_SWEEP["dense"]:
                fn = partial(kq.fp8_linear, x, wq, ws, config=config)
                fn()
                row("dense", label, config, graph_time_us(fn), n * k, m)
        groups, r, d = WO_A
        wq, ws = encode_fp8_blockwise(torch.randn(groups * r, d, device="cuda") * d**-0.5)
        wb = decode_fp8_blockwise(wq, ws, dtype=torch.bfloat16).view(groups, r, d)
        o = torch.randn(m, groups, d, device="cuda").bfloat16()
        label = f"wo_a M={m} {groups}x{r}x{d}"
        row("wo_a", label + " bf16", None, graph_time_us(partial(torch.bmm, o.transpose(0, 1), wb.transpose(1, 2))),
            2 * groups * r * d)
        for config in [c for c in DECODE_SWEEP["grouped"] if c[6]]:  # bf16 activations: no FP8 MMA
            fn = partial(kq.fp8_block_diagonal_linear, o, wq, ws, config=config)
            fn()
            row("wo_a", label, config, graph_time_us(fn), groups * r * d, m)
    E, D, I = args.experts, args.hidden, args.inter
    model = RoutedExperts(SimpleNamespace(n_routed_experts=E, hidden_size=D, moe_intermediate_size=I,
                                          swiglu_limit=10.0), {"experts": "torch_mm"}).cuda()
    packed = {}
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            w = getattr(model, name)
            pairs = [encode_fp4_packed(w[e].float().normal_(0, w.shape[-1] ** -0.5)) for e in range(E)]
            packed[name] = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
            w.copy_(torch.stack([decode_fp4_packed(*p) for p in pairs]))
    model = model.bfloat16()
    gen = torch.Generator().manual_seed(0)
    for tokens in args.decode:
        # each token picks topk distinct experts
        picks = torch.stack([torch.randperm(E, generator=gen)[: args.topk] for _ in range(tokens)]).flatten()
        counts = torch.bincount(picks, minlength=E).cuda()
        rows = tokens * args.topk
        x = torch.randn(rows, D, device="cuda").bfloat16()
        weights = torch.rand(rows, device="cuda")
        live = int((counts > 0).sum())
        wbytes = live * 3 * D * I  # bf16 reads 2 bytes per weight, FP4 half a byte (+ a scale byte per 32)
        label = f"experts {tokens} tok x top{args.topk} of {E} ({live} live)"
        with torch.no_grad():
            row("experts", label + " bf16", None, graph_time_us(partial(model.grouped_forward, x, counts, weights)),
                2 * wbytes)
        for up, down in zip(DECODE_SWEEP["swiglu"], DECODE_SWEEP["grouped"]):
            fn = partial(kq.fp4_grouped_experts, x, counts, weights, *packed["w1"], *packed["w3"], *packed["w2"], 10.0,
                         configs=(up, down))
            fn()
            row("experts", label, (up, down), graph_time_us(fn), wbytes * (0.5 + 1 / 32), kq.rows_per_expert(rows, E))
    best = {kind: min(times, key=times.get) for kind, times in total.items()}
    lines.append(f"# fastest (summed over the cases): {best}")
    return lines, best


FP4_DECODE_CANDIDATES = [(16, 256, 4), (8, 512, 4), (32, 256, 8), (4, 1024, 4), (16, 512, 8), (64, 128, 8)]


def weight_decode(args):
    """The transient bf16 decodes of prefill (``decode_fp4_weights`` per expert chunk, ``decode_fp8_weight`` per
    dense linear at DECODED_GEMM_ROWS rows and more): each FP4 kernel configuration against a bf16 device copy of
    the decoded tensor (the same bytes written, four times the bytes read), bit-equal to the reference decode."""
    E, D, I = args.experts, args.hidden, args.inter
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = ["## weight decode to bf16 (GB/s = bytes read + written / time; bf16 copy = a device copy of the output)"]
    default = kq.FP4_DECODE_CONFIG
    for name, n, k in [("experts w1/w3", I, D), ("experts w2", D, I)]:
        codes = torch.randint(0, 256, (E, n, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
        scales = torch.randint(120, 130, (E, n, k // 32), device="cuda", dtype=torch.uint8, generator=gen)
        scales = scales.view(torch.float8_e8m0fnu)
        ref = torch.stack([decode_fp4_packed(codes[e], scales[e]) for e in range(E)]).bfloat16()
        moved = codes.numel() + scales.numel() + 2 * ref.numel()
        copy_ms = time_ms(lambda: ref.clone(), args.warmup, args.reps)
        lines.append(f"{name} [{E}, {n}, {k}]: bf16 copy {copy_ms * 1e3:8.1f} us {4 * ref.numel() / copy_ms / 1e6:7.0f} GB/s")
        for config in FP4_DECODE_CANDIDATES:
            kq.FP4_DECODE_CONFIG = config
            equal = torch.equal(kq.decode_fp4_weights(codes, scales), ref)
            ms = time_ms(lambda: kq.decode_fp4_weights(codes, scales), args.warmup, args.reps)
            lines.append(f"  fp4 decode {config}: {ms * 1e3:8.1f} us {moved / ms / 1e6:7.0f} GB/s "
                         f"({copy_ms / ms:.2f}x the copy){'' if equal else '  NOT EQUAL to the reference'}")
        kq.FP4_DECODE_CONFIG = default
    for name, n, k in DENSE:
        wq, ws = encode_fp8_blockwise(torch.randn(n, k, device="cuda", generator=gen))
        ref = decode_fp8_blockwise(wq, ws, dtype=torch.bfloat16)
        equal = torch.equal(kq.decode_fp8_weight(wq, ws), ref)
        ms = time_ms(lambda: kq.decode_fp8_weight(wq, ws), args.warmup, args.reps)
        copy_ms = time_ms(lambda: ref.clone(), args.warmup, args.reps)
        lines.append(f"{name} fp8 decode [{n}, {k}]: {ms * 1e3:7.1f} us {(3 * wq.numel()) / ms / 1e6:6.0f} GB/s "
                     f"(bf16 copy {copy_ms * 1e3:.1f} us){'' if equal else '  NOT EQUAL to the reference'}")
    return lines


def compile_sm90(fn, sig, constexprs, aligned, warps, stages, mma=True):
    """Compile a Triton kernel for sm_90 without a GPU -> (registers, spill stack bytes per thread, shared bytes,
    the opcodes of its main loop: the MMA loop, or the longest loop with ``mma=False``)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    sig = {**sig, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    kernel = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    cuobjdump = Path(triton_path()) / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], check=True, capture_output=True,
                               text=True)
        sass = subprocess.run([cuobjdump, "-sass", f.name], check=True, capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    return int(regs[1]), int(regs[2]), kernel.metadata.shared, main_loop(sass, mma)


def weight_arguments(fp4: bool) -> dict:
    """The Triton signature of the arguments both quantized kernels take after their activation pointers."""
    weight = "*u8" if fp4 else "*fp8e4nv"
    return {"b_ptr": weight, "bs_ptr": "*u8", "b2_ptr": weight, "bs2_ptr": "*u8", "c_ptr": "*bf16", "w_ptr": "*fp32",
            "tile_start_ptr": "*i32", "row_start_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "n_groups": "i32",
            "stride_bg": "i32", "stride_bn": "i32", "stride_bsg": "i32", "stride_bsn": "i32", "limit": "fp32"}


def opcode_mix(loop, top):
    from collections import Counter

    return ", ".join(f"{op} {n}" for op, n in Counter(op.split(".")[0] for op in loop).most_common(top))


def ptxas_report():
    """Compile the SWEEP configurations for sm_90 without a GPU and report what ptxas made of them."""
    lines = [(f"# ptxas for sm_90 (Triton {triton_version()}): registers, spill stack (bytes/thread), shared memory, "
              "main-loop instructions per thread per step (mix); (BLOCK_M, BLOCK_N, SUB, warps, stages, SPLIT_K, "
              "MMA_BF16)")]
    for kind, configs in SWEEP.items():
        fp4, swiglu = not kind.startswith("dense"), kind.startswith("swiglu")
        for bm, bn, sub, warps, stages, split, mma in configs:
            sig = {"a_ptr": "*bf16" if mma else "*fp8e4nv", "as_ptr": "*bf16" if mma else "*fp32",
                   **weight_arguments(fp4)}
            aligned = [i for i, (name, ty) in enumerate(sig.items())
                       if ty.startswith("*") or name in ("M", "N", "K", "stride_bg", "stride_bn", "stride_bsg")]
            constexprs = {"B_FP4": fp4, "BS_E8M0": True, "BS_ROWS": 1 if fp4 else 32, "GROUPED": fp4,
                          "SWIGLU": swiglu, "BLOCK_M": bm, "BLOCK_N": bn, "SUB": sub, "SPLIT_K": max(split, 1),
                          "MMA": int(mma), "EVEN": True, "GROUP_M": 8}
            regs, stack, shared, loop = compile_sm90(kq._scaled_gemm_kernel, sig, constexprs, aligned, warps, stages)
            lines.append(f"{kind:16s} {(bm, bn, sub, warps, stages, split, mma)}: registers {regs}, stack "
                         f"{stack}, shared {shared // 1024} KiB, loop {len(loop)} ({opcode_mix(loop, 5)})")
            print(lines[-1], flush=True)
    lines += gemv_ptxas_report()
    return lines


def gemv_ptxas_report():
    """The GEMV kernel (MMA 4) of the decode sweep's candidates at one and eight rows, compiled for sm_90: registers,
    spills, shared memory and its K loop per step, with the weight bytes each thread loads per step."""
    lines = [("# GEMV kernel (MMA 4), sm_90: (ROWS, BLOCK_N, SUB, warps, stages); loop = instructions per thread per "
              "step of BLOCK_N x SUB*32 weights")]
    for kind in ("dense", "grouped", "swiglu"):
        fp4, swiglu = kind != "dense", kind == "swiglu"
        sig = {"a_ptr": "*bf16", **weight_arguments(fp4)}
        aligned = [i for i, (name, ty) in enumerate(sig.items())
                   if ty.startswith("*") or name in ("K", "stride_bg", "stride_bn", "stride_bsg")]
        for _, bn, sub, warps, stages, _, mma in DECODE_SWEEP[kind]:
            if mma != 4:
                continue
            for rows in (1, 8):
                constexprs = {"B_FP4": fp4, "BS_E8M0": True, "BS_ROWS": 1 if fp4 else 32, "GROUPED": fp4,
                              "SWIGLU": swiglu, "ROWS": rows, "BLOCK_N": bn, "SUB": sub, "SPLIT_K": 1 if fp4 else 4,
                              "EVEN": True}
                regs, stack, shared, loop = compile_sm90(kq._gemv_kernel, sig, constexprs, aligned, warps, stages,
                                                         mma=False)
                step_bytes = bn * sub * 32 * (2 if swiglu else 1) // (2 if fp4 else 1) // (32 * warps)
                lines.append(f"gemv {kind:8s} {(rows, bn, sub, warps, stages)!s:22s} registers {regs}, stack "
                             f"{stack}, shared {shared} B, loop {len(loop)} per {step_bytes} weight "
                             f"bytes per thread ({opcode_mix(loop, 4)})")
                print(lines[-1], flush=True)
    return lines


def triton_path():
    import triton

    return triton.__path__[0]


def triton_version():
    import triton

    return triton.__version__


def main_loop(sass: str, mma: bool = True) -> list[str]:
    """Opcodes of the longest backward-branch loop in a SASS dump that issues tensor-core MMAs (HGMMA / QGMMA), or
    of the longest loop at all (``mma=False``)."""
    import re

    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            ops.append((int(m[1], 16), m[2], m[3]))
    best = []
    for addr, op, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target[1], 16) < addr:
            body = [o for a, o, _ in ops if int(target[1], 16) <= a <= addr]
            if (not mma or any(o.startswith(("HGMMA", "QGMMA")) for o in body)) and len(body) > len(best):
                best = body
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    def ints(s):
        return [int(v) for v in s.split(",")]

    ap.add_argument("--tokens", type=ints, default=[4096, 8192], help="prefill rows for the dense linears")
    ap.add_argument("--decode", type=ints, default=[1, 16, 64], help="decode rows (dense) / tokens (experts)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--expert-tokens", type=ints, default=[8192])
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--inter", type=int, default=2304)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--official", type=Path, help="folder holding the official TileLang kernel.py")
    ap.add_argument("--sweep", action="store_true", help="only time the kernel configurations")
    ap.add_argument("--decode-sweep", action="store_true", help="only the decode-size GEMMs, from CUDA graphs")
    ap.add_argument("--weight-decode", action="store_true", help="only the FP4 / FP8 weight decodes to bf16")
    ap.add_argument("--tune", action="store_true", help="time the configurations, then benchmark the fastest")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: dense, experts")
    ap.add_argument("--ptxas", action="store_true", help="no GPU: compile the configurations for sm_90, report")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.ptxas:
        report("\n".join(ptxas_report()), args.out)
        return
    if not torch.cuda.is_available() or not kq.quantized_gemm_usable(torch.empty(0, device="cuda")):
        sys.exit("quantized GEMM benchmark needs a CUDA GPU with FP8 tensor cores and Triton")
    torch.manual_seed(0)
    head = f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; median of {args.reps} after {args.warmup}"
    lines = [head]
    if args.weight_decode:
        report("\n".join(lines + weight_decode(args)), args.out)
        return
    if args.decode_sweep:
        lines += decode_sweep(args)[0]
        report("\n".join(lines), args.out)
        return
    if args.sweep or args.tune:
        swept, best = sweep(args)
        lines += swept
        if args.sweep:
            report("\n".join(lines), args.out)
            return
        kq.CONFIGS.update(best)
    if "dense" not in args.skip:
        lines += bench_dense(args, None)
    if "experts" not in args.skip:
        lines += bench_experts(args, None)
    report("\n".join(lines), args.out)
    if args.official:
        official = load_official(args.official)
        lines = [f"{head}; official TileLang kernels from {args.official}"]
        if "dense" not in args.skip:
            lines += bench_dense(args, official)
        if "experts" not in args.skip:
            lines += bench_experts(args, official)
        report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
