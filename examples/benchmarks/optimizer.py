"""RemainderAdamW's one-pass update on one GPU: the Triton kernel (``adamw_triton_``, now) against the
torch.compile'd ``fused_adamw_`` (one Inductor kernel per tensor, the previous code), same run.

    python examples/benchmarks/optimizer.py [--expert-tensors 2] [--sweep 1024x4,2048x8,4096x8,4096x16,8192x16]
        [--warmup 3] [--reps 20] [--no-compiled] [--no-per-op] [--out results/optimizer_h200.txt]

Tensors, the 4-layer proxy's classes (``train_step.py``) with fewer expert tensors so that the state fits in
~22 GB: ``--expert-tensors`` x [32, 2304, 5120] bf16 expert weights, the [129280, 5120] bf16 embedding, the
[129280, 5120] fp32 head, and small ones (norm scales, mHC, compressor and sink islands: launch-bound).  bf16
parameters have bf16 gradients and an int16 remainder, fp32 parameters fp32 gradients; moments are bf16 (the
recipe's).  Bytes moved count each state tensor read once and written once and the gradient read once: 18 bytes
an element for a bf16 parameter, 20 for an fp32 one.

Reported: per tensor class and in total, milliseconds, GB moved and TB/s of the compiled update and of the Triton
kernel at every ``--sweep`` (BLOCK x num_warps) option (the default launch is marked), against the bandwidth of a
plain device copy; one whole ``RemainderAdamW(fused=True).step()`` with each (and the per-op path's,
``fused=False``); and whether each class's update is bit-identical to the per-op path (first 2^20 elements).
CUDA-event medians of ``--reps`` after ``--warmup``.
"""

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import report, time_ms

from deepseek_v41.training import adamw_triton, optim
from deepseek_v41.training.optim import RemainderAdamW, _adamw_scalars, fused_adamw_


def tensor_classes(expert_tensors: int) -> dict:
    """class name -> [(shape, dtype), ...]"""
    bf16, fp32 = torch.bfloat16, torch.float32
    return {
        "experts bf16": [((32, 2304, 5120), bf16)] * expert_tensors,
        "embedding bf16": [((129280, 5120), bf16)],
        "head fp32": [((129280, 5120), fp32)],
        "small (52)": [((5120,), bf16)] * 32 + [((24, 20480), fp32)] * 8 + [((512, 5120), fp32)] * 8
                      + [((64,), fp32)] * 4,
    }


def bytes_moved(tensors) -> int:
    param, remainder, grad, avg, sq = tensors
    state = [t for t in (param, remainder, avg, sq) if t is not None]
    return sum(2 * t.numel() * t.element_size() for t in state) + grad.numel() * grad.element_size()


def per_op_matches(update, tensors, scalars, scalars_dev, n=1 << 20) -> int:
    """Elements of the first ``n`` whose master or moments differ between ``update`` and the per-op path."""
    head = [None if t is None else t.detach().view(-1)[:n].clone() for t in tensors]
    ours = [None if t is None else t.clone() for t in head]
    param, remainder, grad, avg, sq = head
    RemainderAdamW._per_op_update(param, remainder, grad.float(), {"exp_avg": avg, "exp_avg_sq": sq}, scalars)
    update(*ours, scalars_dev)

    def bits(t):
        return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])

    def master(p, r):
        return optim.join_master(p, r) if r is not None else p

    differ = bits(master(*ours[:2])) != bits(master(param, remainder))
    differ |= (bits(ours[3]) != bits(avg)) | (bits(ours[4]) != bits(sq))
    return int(differ.sum().item())


def copy_bandwidth(warmup, reps) -> str:
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, reps)
    return f"copy_ of 2 GiB (read + write 4 GiB): {ms:.3f} ms, {4 * 2**30 / ms / 1e9:.2f} TB/s"


def main():
    # the compiled A/B specializes per dtype combination and per 0/1-sized small tensor: allow them all
    torch._dynamo.config.recompile_limit = 64
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--expert-tensors", type=int, default=2, help="[32, 2304, 5120] bf16 expert tensors")
    parser.add_argument("--sweep", default="1024x4,2048x8,4096x8,4096x16,8192x16",
                        help="Triton launches to time, BLOCKxNUM_WARPS, comma-separated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-compiled", action="store_true", help="skip the torch.compile'd update (saves its compile)")
    parser.add_argument("--no-per-op", action="store_true", help="skip the per-op optimizer step")
    parser.add_argument("--out", type=Path, help="also append the report to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("optimizer.py needs a CUDA GPU (it times the CUDA optimizer update)")
    if adamw_triton.triton is None:
        sys.exit("optimizer.py needs Triton (it comes with CUDA builds of PyTorch)")
    launches = [tuple(int(v) for v in item.split("x")) for item in args.sweep.split(",")]
    default = (adamw_triton.DEFAULT_BLOCK, adamw_triton.DEFAULT_NUM_WARPS)
    if default not in launches:
        launches.append(default)

    torch.manual_seed(0)
    classes, params = {}, []
    for name, specs in tensor_classes(args.expert_tensors).items():
        classes[name] = []
        for shape, dtype in specs:
            p = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=dtype).mul_(0.02))
            p.grad = torch.randn_like(p).mul_(1e-3)
            params.append(p)
            classes[name].append(p)
    optimizer = RemainderAdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, exp_avg_dtype=torch.bfloat16,
                               exp_avg_sq_dtype=torch.bfloat16, fused=True)
    optimizer.step()  # creates the state (and compiles the kernels for these dtypes)
    state = {name: [(p, optimizer.state[p].get("remainder"), p.grad, optimizer.state[p]["exp_avg"],
                     optimizer.state[p]["exp_avg_sq"]) for p in ps] for name, ps in classes.items()}
    scalars = _adamw_scalars(1e-4, 0.9, 0.95, 1e-8, 0.1, 10.0)
    scalars_dev = torch.tensor(scalars, dtype=torch.float32, device="cuda")
    total_bytes = {name: sum(bytes_moved(t) for t in ts) for name, ts in state.items()}
    gib = sum(total_bytes.values()) / 2**30
    lines = [(f"RemainderAdamW update, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {adamw_triton.triton.__version__}; {gib:.1f} GiB moved per step; medians of {args.reps}"),
             copy_bandwidth(args.warmup, args.reps)]

    def compiled_update(*tensors):
        *state_tensors, sc = tensors
        compiled(*[t if t is None else t.detach().view(-1) for t in state_tensors], sc)

    rows = {}  # label -> {class: ms}
    compiled = None
    if not args.no_compiled:
        compiled = torch.compile(fused_adamw_, dynamic=True, fullgraph=True)
        rows["compiled fused_adamw_ (old)"] = {
            name: time_ms(lambda ts=ts: [compiled_update(*t, scalars_dev) for t in ts], args.warmup, args.reps)
            for name, ts in state.items()}
    for block, warps in launches:
        def update(*tensors, block=block, warps=warps):
            adamw_triton.adamw_triton_(*tensors, block=block, num_warps=warps)

        label = f"triton {block}x{warps}" + (" (default)" if (block, warps) == default else "")
        rows[label] = {name: time_ms(lambda ts=ts, update=update: [update(*t, scalars_dev) for t in ts],
                                     args.warmup, args.reps) for name, ts in state.items()}

    width = max(len(label) for label in rows) + 2
    header = "".join(f"{name:>24s}" for name in state) + f"{'total':>24s}"
    lines.append(f"{'ms, TB/s':{width}s}{header}")
    lines.append(f"{'GB moved':{width}s}" + "".join(f"{b / 1e9:>24.2f}" for b in total_bytes.values())
                 + f"{sum(total_bytes.values()) / 1e9:>24.2f}")
    for label, times in rows.items():
        cells = [f"{ms:8.3f} ms {b / ms / 1e9:5.2f} TB/s" for ms, b in zip(times.values(), total_bytes.values())]
        total = sum(times.values())
        cells.append(f"{total:8.3f} ms {sum(total_bytes.values()) / total / 1e9:5.2f} TB/s")
        lines.append(f"{label:{width}s}" + "".join(f"{c:>24s}" for c in cells))
    best = min((label for label in rows if label.startswith("triton")), key=lambda label: sum(rows[label].values()))
    lines.append(f"fastest Triton launch over all classes: {best}")

    # whole optimizer steps (Python dispatch, the scalars' host->device copy and every launch included)
    def compiled_step():
        with mock.patch.object(optim, "adamw_triton_", compiled_update):
            optimizer.step()

    steps = [("RemainderAdamW(fused=True).step(), triton (default)", True, optimizer.step)]
    if not args.no_compiled:
        steps.append(("RemainderAdamW(fused=True).step(), compiled (old)", True, compiled_step))
    if not args.no_per_op:
        steps.append(("RemainderAdamW(fused=False).step(), per-op", False, optimizer.step))
    for label, fused, step in steps:
        optimizer.fused = fused
        lines.append(f"{label:54s} {time_ms(step, args.warmup, min(args.reps, 10)):8.3f} ms")
    optimizer.fused = True

    def triton_default(*tensors):
        adamw_triton.adamw_triton_(*tensors)

    checks = [("triton", triton_default)] + ([] if args.no_compiled else [("compiled", compiled_update)])
    for name, ts in state.items():
        found = ", ".join(f"{label} {per_op_matches(fn, ts[0], scalars, scalars_dev)}" for label, fn in checks)
        lines.append(f"{name:16s} elements (of the first 2^20) differing from the per-op path: {found}")
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
