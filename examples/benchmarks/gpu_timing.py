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


def graph_time_us(fn, reps=20, launches=10):
    """Median microseconds of one ``fn()`` replayed from a CUDA graph holding ``launches`` calls (``reps`` replays):
    the GPU time a decode step's captured graph spends on it, without the host's launch cost.  ``fn`` must have
    run once (compiled, cached) and be capturable."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)
