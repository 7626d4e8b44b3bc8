"""Peak host memory per rank of the sharded export (``deepseek_v41.training.export``) with a large Engram table.

    torchrun --standalone --nproc_per_node 2 examples/benchmarks/export_memory.py \\
        [--table-mib 512] [--shard-mib 64] [--block-mib 64] [--out DIR] [--log examples/benchmarks/results/export_memory_cpu.txt]

Each rank builds the same model-shaped module: an Engram table of ``--table-mib`` (fp32, 32 columns)
split over the ranks as row owners (``apply_row_owner_engram``), an FSDP2-sharded linear and a stack of
routed experts split over an EP axis, then exports it with the trainer's path (``sharded_sources`` →
``write_export``, ``--shard-mib`` output shards). A thread samples each rank's RSS (psutil, every 2 ms);
the script prints, per rank, the RSS before the export and the peak increase during it, next to the
table size and the shard size. The previous export (every rank all-gathering each table) grew by at least
the whole table on every rank.

glibc raises its mmap threshold to the size of the largest block freed so far (up to 32 MiB), after which
freed row blocks stay in the heap: RSS then grew by 40-140 MiB of retained, dead blocks, depending on thread
timing. The script pins the threshold at 1 MiB (``mallopt``) so RSS follows the live tensors;
``--glibc-default`` measures with glibc's own policy.
"""

import argparse
import ctypes
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from deepseek_v41 import hf_export
from deepseek_v41.hf_export import write_export
from deepseek_v41.training.engram_owner import apply_row_owner_engram
from deepseek_v41.training.export import sharded_sources


class PeakRSS:
    """Largest RSS of this process while active (sampled every `interval` seconds)."""

    def __init__(self, interval=0.002):
        self.process, self.interval, self.peak, self._stop = psutil.Process(), interval, 0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self.before = self.process.memory_info().rss
        self.peak = self.before
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


class Experts(nn.Module):  # duck-typed RoutedExperts: stacked w1/w2/w3 [E, ...], expert_offset, dispatcher
    def __init__(self, n, dim, inter):
        super().__init__()
        self.n_experts, self.expert_offset, self.dispatcher = n, 0, None
        for name, shape in (("w1", (n, inter, dim)), ("w2", (n, dim, inter)), ("w3", (n, inter, dim))):
            setattr(self, name, nn.Parameter(torch.randn(shape)))

    def grouped_forward(self, *args):
        raise NotImplementedError


class Engram(nn.Module):  # duck-typed Engram: an `embed` table and a `table_lookup` hook
    def __init__(self, rows, dim):
        super().__init__()
        self.embed = nn.Embedding(rows, dim)
        self.table_lookup = None


def build(table_rows: int, world: int):
    torch.manual_seed(0)  # the same weights on every rank, as after loading a checkpoint
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    block = model.layers[0]
    block.engram = Engram(table_rows, 32)
    block.ffn = nn.Module()
    block.ffn.experts = Experts(4, 64, 128)
    block.attn = nn.Module()
    block.attn.wq_a = nn.Linear(64, 256, bias=False)
    ep_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ep_shard", "ep"))
    from deepseek_v41.training.expert_parallel import shard_experts

    shard_experts(block.ffn.experts, ep_mesh["ep"].get_local_rank(), world)
    apply_row_owner_engram(model, dist.group.WORLD)
    fully_shard(block.attn.wq_a, mesh=init_device_mesh("cpu", (world,)))
    return SimpleNamespace(model=model, ep_mesh=ep_mesh, engram_group=dist.group.WORLD)


def pin_mmap_threshold(nbytes: int = 1 << 20) -> None:
    # M_MMAP_THRESHOLD (-3): blocks above nbytes are mmapped and returned to the OS when freed
    try:
        pinned = ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)
    except (OSError, AttributeError):  # not glibc
        pinned = 0
    if not pinned:
        raise RuntimeError("could not pin glibc's mmap threshold (mallopt); run with --glibc-default")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-mib", type=float, default=512)
    parser.add_argument("--shard-mib", type=float, default=64)
    parser.add_argument("--block-mib", type=float, default=hf_export.BLOCK_BYTES / 2**20,
                        help="rows gathered and written at once (hf_export.BLOCK_BYTES)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/export_memory"))
    parser.add_argument("--log", type=Path)
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold")
    args = parser.parse_args()
    if not args.glibc_default:
        pin_mmap_threshold()
    hf_export.BLOCK_BYTES = int(args.block_mib * 2**20)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = int(args.table_mib * 2**20 / (32 * 4))
    trainer = build(rows, world)
    dist.barrier()
    start = time.perf_counter()
    with PeakRSS() as rss:
        write_export(sharded_sources(trainer), args.out / "export", {"model_type": "deepseek_v41"},
                     max_shard_bytes=int(args.shard_mib * 2**20), writer=rank == 0,
                     sync=lambda m: (box := [m], dist.broadcast_object_list(box, src=0))[0][0])
    seconds = time.perf_counter() - start
    row = {"rank": rank, "block_mib": args.block_mib, "rss_before_mib": rss.before / 2**20, "peak_increase_mib": (rss.peak - rss.before) / 2**20,
           "table_mib": rows * 32 * 4 / 2**20, "shard_mib": args.shard_mib, "seconds": seconds,
           "allocator": "glibc default" if args.glibc_default else "mmap above 1 MiB"}
    rows_all = [None] * world
    dist.all_gather_object(rows_all, row)
    if rank == 0:
        lines = [json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}) for r in rows_all]
        print("\n".join(lines), flush=True)
        if args.log:
            args.log.parent.mkdir(parents=True, exist_ok=True)
            with open(args.log, "a") as handle:
                handle.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
