"""CUDA-event timing shared by the GPU benchmarks."""

import statistics

import torch


def time_ms(fn, warmup, reps):
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def report(text: str, out) -> None:
    """Print a benchmark table and append it to ``out`` (a Path, or None)."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(text + "\n\n")
