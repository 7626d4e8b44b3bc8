"""The deterministic sparse-attention backward's slot kernel: this tree's CUDA kernel against the TileLang kernel of
the same contract (and, optionally, CUDA variants), in one process, at the V4.1 shape.

Each kernel runs on the same inputs (the CUDA forward's O and lse2), alternately, at each compression ratio, and its
dQ and written slot gradients are compared with the TileLang kernel's (relative L2 difference).  The row sum that
follows every slot kernel (``kernels_tilelang._reduce_slot_grads``) is timed once per ratio and added, giving the
deterministic backward's kernel time.

    python examples/benchmarks/attention_bwd_ab.py [--ratios 1 2] [--reps 30] [--variants FILE]

``--variants FILE``: a Python file that defines ``VARIANTS = {name: cuda_source}``, given this tree's source as
``BASE`` (development A/B of kernel changes).  FLOP convention as attention.py: 10·b·s·h·k·d with k = 640.
"""

import argparse
import ctypes
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from attention import csa2_indices
from gpu_timing import time_ms

from deepseek_v41 import kernels_tilelang as kt
from deepseek_v41 import sparse_attention_cuda_bwd as bwd
from deepseek_v41.cuda_module import CudaKernel, compile_cubin
from deepseek_v41.sparse_attention_cuda import _cutlass_include, sparse_attention_forward_cuda

S, HEADS, DIM, TOPK = 4096, 64, 512, 512


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the kernels this many times per ratio")
    ap.add_argument("--variants", type=Path, help="a file defining VARIANTS = {name: CUDA source}, given BASE")
    args = ap.parse_args()
    sources = {"CUDA (this tree)": bwd._SOURCE}
    if args.variants:
        scope = {"BASE": bwd._SOURCE}
        exec(args.variants.read_text(), scope)
        sources.update(scope["VARIANTS"])
    start = time.time()
    with ThreadPoolExecutor(8) as pool:
        cubins = dict(zip(sources, pool.map(lambda src: compile_cubin(src, [_cutlass_include()], arch="sm_90a"),
                                            sources.values())))
    print(f"# {torch.cuda.get_device_name()}; {len(cubins)} CUDA kernel(s) built in {time.time() - start:.0f} s; "
          f"s={S} h={HEADS} d={DIM} k={128 + TOPK}; best of {args.rounds} medians of {args.reps}", flush=True)
    h, d, k = HEADS, DIM, 128 + TOPK
    scale, flop = d**-0.5, 2.5 * 4 * S * h * k * d
    dev = ("cuda", torch.cuda.current_device())
    for ratio in args.ratios:
        torch.manual_seed(0)
        n = S + S // ratio
        q = torch.randn(1, S, h, d, device="cuda").bfloat16()
        kv = torch.randn(1, n, d, device="cuda").bfloat16()
        idx = csa2_indices(1, S, ratio, TOPK, "cuda")
        do = torch.randn_like(q)
        o, lse2 = sparse_attention_forward_cuda(q, kv, idx, torch.randn(h, device="cuda") * kt.LOG2E, scale)

        def outputs():  # delta, dq, per-slot kv gradients
            return (torch.empty(1, S, h, device="cuda"), torch.empty_like(q),
                    torch.zeros(1, S * h // 64, k, d, device="cuda", dtype=torch.bfloat16))

        tilelang = kt._attn_bwd_slot_kernel_tilelang(S, n, h, d, k, scale, dev)
        ref = outputs()
        runs = {"TileLang": lambda: tilelang(q, kv, o, do, idx, lse2, *ref)}
        outs = {}
        for name, cubin in cubins.items():
            kernel = CudaKernel(cubin, "csa2_sparse_attn_bwd_slots_d512", bwd._SMEM_FIXED + 1024 + 4 * k)
            outs[name] = outputs()
            launch_args = [q, kv, o, do, idx, lse2, *outs[name], ctypes.c_int32(S), ctypes.c_int32(n),
                           ctypes.c_int32(h), ctypes.c_int32(k), ctypes.c_float(scale * kt.LOG2E), ctypes.c_float(scale)]
            runs[name] = lambda kernel=kernel, a=launch_args: kernel.launch((S * h // 64, 1, 1), (384, 1, 1), a)
        for run in runs.values():
            run()
        summed = torch.empty(1, n, d, device="cuda", dtype=torch.bfloat16)
        ms_sum = time_ms(lambda: kt._reduce_slot_grads(ref[2][0], idx[0], summed[0]), 3, args.reps)
        times = {name: [time_ms(run, 3, args.reps) for _ in range(args.rounds)] for name, run in runs.items()}
        written = (idx[0] >= 0).unsqueeze(0)
        print(f"ratio {ratio}: row sum {ms_sum:.3f} ms")
        for name, ts in times.items():
            ms = min(ts)
            line = (f"ratio {ratio}  {name:18s} {', '.join(f'{t:.3f}' for t in ts)} ms  {flop / ms / 1e9:6.1f} TFLOP/s; "
                    f"with the row sum {ms + ms_sum:.3f} ms, {flop / (ms + ms_sum) / 1e9:6.1f} TFLOP/s")
            if name in outs:
                _, dq, slots = outs[name]
                line += f"; vs TileLang: dq {rel(dq, ref[1]):.1e}, slot dkv {rel(slots[written], ref[2][written]):.1e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
