"""Checkpoint decoding on CPU: decode throughput and peak memory of streaming a checkpoint.

1. Throughput of the FP8 / FP4 decoders at released shapes ([32768, 1280] `attn.wq_b`, [5120, 8192]
   `attn.wo_b`, [2304, 5120] routed expert `w1`), to fp32 and to bf16, with one thread and with all
   threads. "GB/s" counts decoded output bytes per wall second; "GB/s/core" divides by the threads;
   "GB/s per CPU-s" divides by the CPU time the process used (robust when other jobs share the cores).
   "new" decodes into a fresh tensor (its first-touch page faults count), "out=" into a preallocated one,
   as the loader does into the model's parameters.
2. Peak resident memory (VmHWM, measured in a fresh subprocess) while (a) converting a multi-shard
   tiny checkpoint made larger (hidden 256, 64 experts of width 256) to floating point, and (b) loading
   it into a bf16 model whose parameters follow the naming contract, compared with its largest shard.

    python examples/benchmarks/decode_checkpoint.py [--repeats 5] [--out results/decode_checkpoint_cpu.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepseek_v41.release_format import (
    decode_fp4_packed,
    decode_fp8_blockwise,
    encode_fp4_packed,
    encode_fp8_blockwise,
)

REPO = Path(__file__).resolve().parents[2]
SHAPES = [("FP8", (32768, 1280)), ("FP8", (5120, 8192)), ("FP4", (2304, 5120))]
BIG_TINY = {"hidden_size": 256, "n_routed_experts": 64, "moe_intermediate_size": 256}


def time_decode(fmt: str, shape, dtype: torch.dtype, threads: int, repeats: int, into_out: bool = False) -> dict:
    """Best-of-`repeats` decode time; `into_out` decodes into a preallocated tensor (as the loader does into
    parameters), else into a fresh one (whose first-touch page faults then count too)."""
    torch.set_num_threads(threads)
    w = torch.randn(shape) * 0.02
    encoded = encode_fp8_blockwise(w) if fmt == "FP8" else encode_fp4_packed(w)
    decode = decode_fp8_blockwise if fmt == "FP8" else decode_fp4_packed
    out = torch.empty(shape, dtype=dtype) if into_out else None
    decode(*encoded, dtype=dtype, out=out)  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        decode(*encoded, dtype=dtype, out=out)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    out_bytes = w.numel() * dtype.itemsize
    best_wall, best_cpu = min(wall), min(cpu)
    return {"gbps": out_bytes / best_wall / 1e9, "per_core": out_bytes / best_wall / 1e9 / threads,
            "per_cpu_s": out_bytes / best_cpu / 1e9, "ms": best_wall * 1e3}


# The child process: build what is measured, then report VmHWM (peak RSS) and the baseline RSS.
_CHILD = r"""
import json, sys, torch
from pathlib import Path
from torch import nn
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
mode, src, dst = sys.argv[1:4]
sys.path.insert(0, str(Path(sys.argv[4]) / "conversion"))
from deepseek_v41.checkpoint import ReleasedCheckpoint, load_checkpoint_into_model, released_to_model_name
if mode == "convert":
    import convert_checkpoint
    base = status("VmRSS")
    convert_checkpoint.convert(src, dst, build_model=None)  # the model check reads no data
    extra = 0
else:
    checkpoint = ReleasedCheckpoint(src)
    model, shapes = nn.Module(), {}
    for name, stored in checkpoint.tensors.items():
        model_name, expert = released_to_model_name(name)
        shape = stored.shape if expert is None else (expert + 1, *stored.shape)
        previous = shapes.get(model_name)
        shapes[model_name] = shape if previous is None or previous[0] < shape[0] else previous
    for name, shape in shapes.items():
        module = model
        *path, leaf = name.split(".")
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=torch.bfloat16).fill_(0)))
    extra = sum(p.numel() * p.element_size() for p in model.parameters())
    base = status("VmRSS") - extra  # the zero-filled model is resident; count it separately
    load_checkpoint_into_model(model, src)
print(json.dumps({"peak": status("VmHWM"), "base": base, "model": extra}))
"""


def peak_rss(mode: str, src: Path, dst: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", _CHILD, mode, str(src), str(dst), str(REPO)],
                            check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode_checkpoint_cpu.txt")
    args = parser.parse_args(argv)
    all_threads = torch.get_num_threads()
    header = (f"{'format':6} {'shape':>14} {'out':>5} {'into':>7} {'threads':>7} {'ms':>8} {'GB/s':>7} "
              f"{'GB/s/core':>10} {'GB/s per CPU-s':>15}")
    lines = [f"CPU: {os.cpu_count()} cores, torch {torch.__version__}, intra-op threads 1 and {all_threads}",
             "load average at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
             "",
             f"Decode throughput (output bytes; best of {args.repeats})",
             header]
    for fmt, shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for into_out in (False, True):
                for threads in sorted({1, all_threads}):
                    r = time_decode(fmt, shape, dtype, threads, args.repeats, into_out)
                    row = (f"{fmt:6} {list(shape)!s:>14} {str(dtype)[6:]:>5} {'out=' if into_out else 'new':>7} "
                           f"{threads:>7} {r['ms']:>8.1f} {r['gbps']:>7.2f} {r['per_core']:>10.2f} "
                           f"{r['per_cpu_s']:>15.2f}")
                    lines.append(row)
                    print(row, flush=True)
    torch.set_num_threads(all_threads)

    sys.path.insert(0, str(REPO / "conversion"))
    import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny_checkpoint.make_tiny_checkpoint(Path(tmp) / "released", **BIG_TINY)
        shards = sorted(src.glob("*.safetensors"))
        largest = max(p.stat().st_size for p in shards)
        total = sum(p.stat().st_size for p in shards)
        converted = peak_rss("convert", src, Path(tmp) / "converted")
        out_total = sum(p.stat().st_size for p in (Path(tmp) / "converted").glob("*.safetensors"))
        loaded = peak_rss("load", src, Path(tmp) / "unused")
    mib = 1 << 20
    convert_extra = converted["peak"] - converted["base"]
    load_extra = loaded["peak"] - loaded["base"] - loaded["model"]
    sizes = ", ".join(f"{k} {v}" for k, v in BIG_TINY.items())
    lines += [
        "",
        f"Peak RSS streaming a tiny checkpoint made larger ({sizes}):",
        (f"  released: {len(shards)} shards, {total / mib:.1f} MiB, largest shard {largest / mib:.1f} MiB; "
         f"floating-point output {out_total / mib:.1f} MiB"),
        (f"  convert to floating point: peak RSS {converted['peak'] / mib:.1f} MiB = process baseline "
         f"{converted['base'] / mib:.1f} MiB (after imports) + {convert_extra / mib:.1f} MiB "
         f"= {convert_extra / largest:.2f} x the largest shard"),
        (f"  load into a bf16 model: peak RSS {loaded['peak'] / mib:.1f} MiB = baseline {loaded['base'] / mib:.1f} "
         f"MiB + model {loaded['model'] / mib:.1f} MiB + {load_extra / mib:.1f} MiB "
         f"= {load_extra / largest:.2f} x the largest shard"),
    ]
    print("\n".join(lines[-4:]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
