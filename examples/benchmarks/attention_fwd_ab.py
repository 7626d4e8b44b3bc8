"""The CUDA sparse-attention forward of this tree against the same kernel at another git revision, or
against variants of it, in one process.

All kernels run on the same inputs, alternately, at each compression ratio (the ratio sets how many of a
query's 640 slots are empty: a query i sees (i + 1) // ratio compressed entries), and their outputs are
compared with this tree's bit for bit.  Kernel-to-kernel ratios from one process are steadier than figures
from separate runs (the forward varies by a few per cent between processes and machines).

    python examples/benchmarks/attention_fwd_ab.py [--baseline REV] [--variants FILE] [--ratios 1 2 4]

``--variants FILE``: a Python file that defines ``VARIANTS = {name: (cuda_source, persistent)}`` (it imports
what it builds on, e.g. ``sparse_attention_cuda._SOURCE``).  A persistent kernel (this tree's, and any
revision's whose kernel takes the batch size as its last argument) runs on min(items, multiprocessors) CTAs;
the others (revisions before it) on one CTA per (query, 64 heads).  Before timing, every kernel is checked
bit for bit against this tree's on small inputs with empty index rows, repeated rows, two batches, 128 heads
and few CTAs (many items each).

FLOP convention as attention.py: 4·b·s·h·k·d with k = 640 (empty slots included).
"""

import argparse
import ctypes
import faulthandler
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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
    source = (raw_string("HELPERS") if "\nHELPERS = " in text else "") + raw_string("_SOURCE")
    if "SMEM_IDX_OFFSET" in source:  # the persistent kernel asserts its layout against the launcher's constant
        fixed = text[text.index("\n_SMEM_FIXED = ") + len("\n_SMEM_FIXED = ") :].split("\n", 1)[0]
        source = source.replace("SMEM_IDX_OFFSET", str(eval(fixed) - 1024))  # a sum of integers
    return source


def is_persistent(source: str) -> bool:
    """Whether a forward's source is the persistent kernel (its last argument: the batch size)."""
    return "float c, int batch)" in source


class Kernel:
    """One compiled forward and how it is launched."""

    def __init__(self, cubin: bytes, persistent: bool):
        # the largest shared-memory request serves every kernel (each reads only what its layout needs)
        self.kernel = CudaKernel(cubin, "csa2_sparse_attn_fwd_d512", 227 * 1024)
        self.persistent = persistent

    def launcher(self, q, kv, idx, sink2, ctas=None):
        """(o, lse2, launch) for these inputs: launch() writes o and lse2."""
        b, s, h, _ = q.shape
        o, lse2 = torch.empty_like(q), torch.empty(b, s, h, device=q.device)
        args = [q, kv, idx, sink2, o, lse2, ctypes.c_int32(s), ctypes.c_int32(kv.shape[1]), ctypes.c_int32(h),
                ctypes.c_int32(idx.shape[2]), ctypes.c_float(DIM**-0.5 * sac.LOG2E)]
        items = s * (h // sac.HEADS_PER_CTA) * b
        if self.persistent:
            grid, args = sac.forward_grid(b, s, h, q.device), args + [ctypes.c_int32(b)]
            if ctas:
                grid = (min(items, ctas), 1, 1)
        else:
            grid = (s * (h // sac.HEADS_PER_CTA), b, 1)
        return o, lse2, lambda: self.kernel.launch(grid, (384, 1, 1), args)


def edge_inputs():
    """(b, s, h, n, ctas, inputs) cases: index rows empty, short, repeated, of every length."""
    torch.manual_seed(1)
    for b, s, h, n, ctas in [(2, 203, 128, 700, None), (1, 64, 64, 300, 5), (3, 50, 64, 90, 1)]:
        q = torch.randn(b, s, h, DIM, device="cuda").bfloat16()
        kv = torch.randn(b, n, DIM, device="cuda").bfloat16()
        rows = torch.randint(0, n, (b, s, SLOTS), device="cuda", dtype=torch.int32)
        lengths = torch.randint(0, SLOTS + 1, (b, s, 1), device="cuda")
        lengths[:, ::7] = 0  # queries without a key
        idx = torch.where(torch.arange(SLOTS, device="cuda") < lengths, rows, -1)
        idx[:, 1::5, 300:] = -1
        idx[:, 2::5, :64] = idx[:, 2::5, :1]  # one row repeated over a block
        yield b, s, h, n, ctas, (q, kv, idx.int().contiguous(), torch.randn(h, device="cuda"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="git revision whose kernel is the baseline")
    ap.add_argument("--variants", type=Path, help="a file defining VARIANTS = {name: (source, persistent)}")
    ap.add_argument("--ratios", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the kernels this many times per ratio")
    args = ap.parse_args()
    if not (args.baseline or args.variants):
        ap.error("give --baseline REV and/or --variants FILE")
    sources = {"this tree": (sac._SOURCE, True)}
    if args.baseline:
        source = kernel_source_at(args.baseline)
        sources[f"baseline {args.baseline}"] = (source, is_persistent(source))
    if args.variants:
        scope = {}
        exec(args.variants.read_text(), scope)
        sources.update(scope["VARIANTS"])
    start = time.time()
    with ThreadPoolExecutor(8) as pool:
        def build(src):
            return compile_cubin(src, [sac._cutlass_include()], arch="sm_90a", flags=sac._FLAGS)

        cubins = pool.map(build, [src for src, _ in sources.values()])
        kernels = {name: Kernel(cubin, persistent)
                   for (name, (_, persistent)), cubin in zip(sources.items(), cubins)}
    print(f"# {torch.cuda.get_device_name()}; {len(kernels)} kernels built in {time.time() - start:.0f} s")
    tree = kernels["this tree"]
    for b, s, h, n, ctas, inputs in edge_inputs():
        o0, l0, launch = tree.launcher(*inputs)
        launch()
        for name, kernel in kernels.items():
            o1, l1, launch = kernel.launcher(*inputs, ctas=ctas)
            # a kernel that hangs (a variant's synchronisation bug) ends the run with a traceback
            faulthandler.dump_traceback_later(60, exit=True)
            launch()
            torch.cuda.synchronize()
            faulthandler.cancel_dump_traceback_later()
            same = torch.equal(o0, o1) and torch.equal(l0, l1)
            print(f"edge b={b} s={s} h={h} n={n} ctas={ctas or 'all'}  {name:22s} "
                  f"bit-identical to this tree: {same}", flush=True)

    b, s, flop = 1, args.s, 4 * args.s * HEADS * SLOTS * DIM
    print(f"# b={b} s={s} h={HEADS} d={DIM} k={SLOTS}; median of {args.reps}")
    for ratio in args.ratios:
        n = s + s // ratio
        torch.manual_seed(0)
        q = torch.randn(b, s, HEADS, DIM, device="cuda").bfloat16()
        kv = torch.randn(b, n, DIM, device="cuda").bfloat16()
        idx = csa2_indices(b, s, ratio, SLOTS - 128, "cuda")
        sink2 = torch.randn(HEADS, device="cuda")
        runs = {name: kernel.launcher(q, kv, idx, sink2) for name, kernel in kernels.items()}
        times = {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name, (_, _, launch) in runs.items():
                times[name].append(time_ms(launch, 5, args.reps))
        o0, l0, _ = runs["this tree"]
        for name, ms in times.items():
            o1, l1, _ = runs[name]
            same = torch.equal(o0, o1) and torch.equal(l0, l1)
            spread = ", ".join(f"{t:.3f}" for t in ms)
            print(f"ratio {ratio}  {name:22s} {spread} ms  {flop / min(ms) / 1e9:6.1f} TFLOP/s (best)  "
                  f"bit-identical to this tree: {same}")


if __name__ == "__main__":
    main()
