"""The CUDA sparse-attention forward of this tree against the same kernel at another git revision, in one process.

Both kernels run on the same inputs, alternately, at each compression ratio (the ratio sets how many of a query's
640 slots are empty: a query i sees (i + 1) // ratio compressed entries), and their outputs are compared bit for
bit.  Kernel-to-kernel ratios from one process are steadier than figures from separate runs (the forward varies by
a few per cent between processes and machines).

    python examples/benchmarks/attention_fwd_ab.py --baseline c44b7b4 [--ratios 1 2 4] [--reps 30]

FLOP convention as attention.py: 4·b·s·h·k·d with k = 640 (empty slots included).
"""

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from attention import csa2_indices
from gpu_timing import time_ms

from deepseek_v41 import sparse_attention_cuda as sac
from deepseek_v41.cuda_module import CudaKernel, compile_cubin

SLOTS, HEADS, DIM = 640, 64, 512


def kernel_source_at(rev: str) -> str:
    """The CUDA source string (``_SOURCE``) of sparse_attention_cuda.py at git revision ``rev``."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:deepseek_v41/sparse_attention_cuda.py"],
                          capture_output=True, text=True, check=True).stdout

    def raw_string(name):  # the body of `name = ... r"""..."""`
        start = text.index('r"""', text.index(f"\n{name} = ")) + len('r"""')
        return text[start : text.index('"""', start)]

    # later revisions keep the device helpers (shared with the backward) in HELPERS, prefixed to _SOURCE
    return (raw_string("HELPERS") if "\nHELPERS = " in text else "") + raw_string("_SOURCE")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="git revision whose kernel is the baseline")
    ap.add_argument("--ratios", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the kernels this many times per ratio")
    args = ap.parse_args()
    kp = sac.padded_slots(SLOTS)
    sources = {"this tree": sac._SOURCE, f"baseline {args.baseline}": kernel_source_at(args.baseline)}
    # this tree's shared-memory request, the larger one, serves both (a kernel reads only what its own layout needs)
    kernels = {name: CudaKernel(compile_cubin(src, [sac._cutlass_include()], arch="sm_90a", flags=sac._FLAGS),
                                "csa2_sparse_attn_fwd_d512", sac._SMEM_FIXED + 4 * kp)
               for name, src in sources.items()}
    b, s, flop = 1, args.s, 4 * args.s * HEADS * SLOTS * DIM
    print(f"# {torch.cuda.get_device_name()}, b={b} s={s} h={HEADS} d={DIM} k={SLOTS}; median of {args.reps}")
    for ratio in args.ratios:
        n = s + s // ratio
        torch.manual_seed(0)
        q = torch.randn(b, s, HEADS, DIM, device="cuda").bfloat16()
        kv = torch.randn(b, n, DIM, device="cuda").bfloat16()
        idx = csa2_indices(b, s, ratio, SLOTS - 128, "cuda")
        sink2 = torch.randn(HEADS, device="cuda")
        outs, times = {}, {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name, kernel in kernels.items():
                o, lse2 = torch.empty_like(q), torch.empty(b, s, HEADS, device="cuda")
                launch_args = [q, kv, idx, sink2, o, lse2, ctypes.c_int32(s), ctypes.c_int32(n), ctypes.c_int32(HEADS),
                               ctypes.c_int32(kp), ctypes.c_float(DIM**-0.5 * sac.LOG2E)]
                times[name].append(time_ms(lambda kernel=kernel, a=launch_args: kernel.launch(
                    (s * HEADS // sac.HEADS_PER_CTA, b, 1), (384, 1, 1), a), 5, args.reps))
                outs[name] = (o, lse2)
        (o1, l1), (o2, l2) = outs.values()
        same = torch.equal(o1, o2) and torch.equal(l1, l2)
        for name, ms in times.items():
            spread = ", ".join(f"{t:.3f}" for t in ms)
            print(f"ratio {ratio}  {name:22s} {spread} ms  {flop / min(ms) / 1e9:6.1f} TFLOP/s (best)")
        print(f"ratio {ratio}  outputs bit-identical: {same}")


if __name__ == "__main__":
    main()
