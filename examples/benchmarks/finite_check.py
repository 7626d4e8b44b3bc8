"""Cost of the loader's finite check: `ReleasedCheckpoint.decode` into a preallocated bf16 parameter (as
`load_checkpoint_into_model` does) with `check_finite` on and off, on CPU, at released shapes.

Each tensor is written to a one-tensor checkpoint (FP8 `attn.wo_b` [5120, 8192], FP4 routed expert `w1`
[2304, 5120], BF16 `embed.weight` rows [8192, 5120]) and decoded whole, row block by row block, best of
`--repeats`. "GB/s per CPU-s" divides the decoded bytes by the CPU time the process used (robust when
other jobs share the cores); the overhead column compares the CPU times.

    python examples/benchmarks/finite_check.py [--repeats 5] [--out results/finite_check_cpu.txt]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from deepseek_v41.checkpoint import ReleasedCheckpoint, write_safetensors
from deepseek_v41.release_format import encode_fp4_packed, encode_fp8_blockwise

CASES = [
    ("FP8", "layers.0.attn.wo_b.weight", (5120, 8192)),
    ("FP4", "layers.0.ffn.experts.0.w1.weight", (2304, 5120)),
    ("BF16", "embed.weight", (8192, 5120)),
]


def write_case(folder: Path, fmt: str, name: str, shape) -> None:
    w = torch.randn(shape) * 0.02
    if fmt == "BF16":
        tensors = {name: w.bfloat16()}
    else:
        q, scale = encode_fp8_blockwise(w) if fmt == "FP8" else encode_fp4_packed(w)
        tensors = {name: q, name.removesuffix(".weight") + ".scale": scale}
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors)


def time_load(checkpoint: ReleasedCheckpoint, name: str, out: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Best (wall, CPU) seconds to decode tensor `name` into `out` in the loader's row blocks."""
    wall, cpu = [], []
    for _ in range(repeats + 1):  # the first is a warm-up (page cache, code tables)
        c0, t0 = time.process_time(), time.perf_counter()
        for block in checkpoint.row_slices(name, out.element_size()):
            checkpoint.decode(name, block, out=out[block])
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall[1:]), min(cpu[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "finite_check_cpu.txt")
    args = parser.parse_args(argv)
    lines = [f"CPU: {os.cpu_count()} cores, torch {torch.__version__}, intra-op threads {torch.get_num_threads()}",
             "load average at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
             "",
             f"ReleasedCheckpoint.decode into a bf16 parameter, best of {args.repeats}",
             f"{'format':6} {'shape':>14} {'check':>6} {'ms':>8} {'CPU ms':>8} {'GB/s per CPU-s':>15} {'overhead':>9}"]
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, name, shape in CASES:
            write_case(Path(tmp) / fmt, fmt, name, shape)
            out = torch.empty(shape, dtype=torch.bfloat16)
            results = {}
            for check in (False, True):
                checkpoint = ReleasedCheckpoint(Path(tmp) / fmt, check_finite=check)
                results[check] = time_load(checkpoint, name, out, args.repeats)
            for check in (False, True):
                wall, cpu = results[check]
                overhead = f"{cpu / results[False][1] - 1:+.1%}" if check else ""
                row = (f"{fmt:6} {list(shape)!s:>14} {'on' if check else 'off':>6} {wall * 1e3:>8.1f} "
                       f"{cpu * 1e3:>8.1f} {out.numel() * 2 / cpu / 1e9:>15.2f} {overhead:>9}")
                lines.append(row)
                print(row, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
