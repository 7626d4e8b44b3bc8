"""Inference planner: does a config run on a machine for generation, and how does ``device_map="auto"`` split it?

    python -m deepseek_v41.training.inference_plan [--config PATH] (--machine 8xH200 | --gpus N --gpu-memory 141GB)
        [--weights kept|bf16] [--engram gpu|cpu] [--batch B] [--context T] [--prefill-tokens P] [--attn tilelang|torch]
    python -m deepseek_v41.training.inference_plan --table   # the README's machine table

Everything is counted from the model built on the meta device (``plan.meta_model``; ``--config`` a checkpoint
folder or config.json, default the released DeepSeek-V4.1-Flash config with its vision tower and DSpark stages):

* weights: ``--weights kept`` holds each tensor in the release's stored format (``release_format.released_format``):
  FP4 experts as packed E2M1 codes [out, in/2] + UE8M0 scales [out, in/32], FP8 linears as E4M3 codes + UE8M0
  32x32 block scales, Engram tables as E4M3 rows + UE8M0 scales per 32; the rest in the dtype the model holds it
  (bf16, the fp32 islands and head).  ``bf16`` is today's dequantizing load: every weight in bf16 (fp32 islands in
  fp32).  Buffers (router biases, Engram hash constants) are counted too.
* placement: accelerate's planner as ``from_pretrained(device_map="auto")`` calls it (``get_balanced_memory`` then
  ``infer_auto_device_map`` over whole ``DeepseekV41Block``s) on the meta model with its tensors swapped for the
  kept codes and scales, and ``max_memory`` per GPU = memory - ``RESERVED_GIB`` - the activation peak - that GPU's
  share of the cache (what the plan prints, to pass to ``from_pretrained``).  ``--engram cpu`` takes the Engram
  tables out of the device map: their rows stay in (pinned) host memory, and each forward copies the rows it reads.
* decode cache: the static cache ``generate`` builds on CUDA (``DeepseekV41StaticCache``) for ``batch`` rows of
  ``context`` positions rounded up to ``static_cache_granularity``: every layer's window ring [b, W, head_dim]
  (model dtype), the Full layers' compressed KV [b, ceil(T/r), head_dim] (model dtype) and index keys
  [b, ceil(T/r), index_head_dim] in fp32, and the ratio-2 compressor's fp32 carries [b, r, head_dim] x 2; each on
  its layer's GPU.
* activations: an estimate of the peak of the prefill forward of ``prefill_tokens`` (default the whole context) on
  each GPU: the 4-stream state entering and leaving a block, the largest block's live tensors
  (``plan.BLOCK_ACTIVATION_FACTOR`` x the per-token block width in bf16, the training planner's factor) plus the
  attention's (``attention.torch_attention_bytes`` for ``--attn torch``: the gathered rows; for ``tilelang`` only
  the indexer's score chunk, the kernels never form the rest), the Engram layer's live tensors where it runs
  (gathered rows, the key/value projection, fp32 per-stream temporaries x ``ENGRAM_FP32_COPIES``), the CSA2 state
  the source layers publish (compressed KV, index keys, top-k ids), and on the head's GPU ``generate``'s fp32
  logits of the last position.  Prefill is one forward over the prompt (the model does not chunk it).
* verdict: every weight placed on a GPU, and on every GPU weights + cache + activations, plus
  ``plan.FRAGMENTATION``, within memory - ``RESERVED_GIB``; with ``--engram cpu`` the host needs the tables' bytes.
"""

import argparse
import contextlib
import logging
import math
import re
import sys
import warnings

import torch

from deepseek_v41.training.plan import (
    BLOCK_ACTIVATION_FACTOR,
    FRAGMENTATION,
    GIB,
    RESERVED_GIB,
    block_token_width,
    meta_model,
    positive_int,
    read_config,
)

# GPU memory as torch reports it (nvidia-smi MiB): H200 143771 MiB, H100 80GB 81559 MiB
GPU_MEMORY = {"H200": 143771 * 2**20, "H100": 81559 * 2**20}
MACHINES = ("8xH200", "8xH100", "4xH200")  # the README table's machines (any NxH200 / NxH100 is accepted)
ENGRAM_FP32_COPIES = 3  # fp32 [b, s, hc, dim] tensors the Engram gate holds at once (keys, products, normalized)
_UNITS = {"": GIB, "gib": GIB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40, "tb": 10**12}
FORMATS = ("FP4 experts (E2M1 + UE8M0 per 32)", "FP8 linears (E4M3 + UE8M0 32x32)",
           "Engram tables (E4M3 + UE8M0 per 32)", "bf16", "fp32", "buffers")


class PlanError(ValueError):
    """An inference plan that cannot be made as asked; the message names the problem and the fix."""


def parse_memory(text: str) -> int:
    """'141GB', '80GiB', '143771MiB' or a plain number of GiB -> bytes (> 0)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match[2].lower()
    if not match or unit not in _UNITS:
        raise PlanError(f"GPU memory {text!r} is not a size: give a number with GB, GiB, MiB, MB, TB or TiB "
                        "(e.g. 141GB, 80GiB; a plain number is GiB)")
    try:
        value = float(match[1]) * _UNITS[unit]
    except ValueError:
        raise PlanError(f"GPU memory {text!r} is not a number of {match[2] or 'GiB'}") from None
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"GPU memory {text!r} must be positive (e.g. 141GB for an H200, 80GB for an H100)")
    return int(value)


def parse_machine(text: str) -> tuple:
    """'8xH200' -> (8, bytes per GPU)."""
    match = re.fullmatch(r"(\d+)\s*[xX×]\s*(H200|H100)(-80GB)?", str(text).strip(), flags=re.IGNORECASE)
    if not match or int(match[1]) < 1:
        raise PlanError(f"unknown machine {text!r}: use NxH200 or NxH100 (e.g. {', '.join(MACHINES)}), or give "
                        "--gpus N --gpu-memory SIZE")
    return int(match[1]), GPU_MEMORY[match[2].upper()]


# ---- weights -------------------------------------------------------------------------------------------------


def _format_of(name: str, tensor: torch.Tensor) -> str:
    """The stored format of model parameter ``name`` in the release (stacked experts: one expert's released name)."""
    from deepseek_v41.checkpoint import _MODEL_EXPERT, model_to_released_name
    from deepseek_v41.release_format import released_format

    released = model_to_released_name(name, 0) if _MODEL_EXPERT.match(name) else name
    return released_format(released, tuple(tensor.shape[-2:]))[0]


def _kept_tensors(tensor: torch.Tensor, fmt: str) -> tuple:
    """(codes, scale) meta tensors of the stored format for a [..., out, in] weight (stacked experts keep dim 0)."""
    *lead, rows, cols = tensor.shape
    if fmt == "fp4":
        codes, scale = (*lead, rows, cols // 2), (*lead, rows, -(-cols // 32))
        dtype = torch.int8
    elif fmt == "fp8_block":
        codes, scale, dtype = (*lead, rows, cols), (*lead, -(-rows // 32), -(-cols // 32)), torch.float8_e4m3fn
    else:  # fp8_rows
        codes, scale, dtype = (*lead, rows, cols), (*lead, rows, -(-cols // 32)), torch.float8_e4m3fn
    return (torch.empty(codes, dtype=dtype, device="meta"),
            torch.empty(scale, dtype=torch.float8_e8m0fnu, device="meta"))


def _category(name: str, fmt: str, dtype: torch.dtype) -> str:
    if fmt == "fp4":
        return FORMATS[0]
    if fmt == "fp8_block":
        return FORMATS[1]
    if fmt == "fp8_rows":
        return FORMATS[2]
    return "fp32" if dtype == torch.float32 else "bf16"


def prepare_model(model, weights: str) -> dict:
    """Swap ``model``'s (meta) parameters for what a ``weights`` load holds, in place -> {parameter name: (category,
    group, bytes)} with group "backbone", "Engram tables", "DSpark" or "vision".

    kept: quantized parameters become their codes, with the scales as a buffer beside them (``<name>_scale``);
    bf16: floating-point parameters stay as built (bf16, fp32 islands fp32)."""
    if weights not in ("kept", "bf16"):
        raise PlanError(f"--weights {weights!r}: use kept (the release's FP8/FP4 formats) or bf16 (dequantized)")
    table = {}
    for module_name, module in list(model.named_modules()):
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            name = f"{module_name}.{pname}" if module_name else pname
            fmt = _format_of(name, param)
            size = param.numel() * param.element_size()
            if weights == "kept" and fmt != "plain":
                codes, scale = _kept_tensors(param, fmt)
                module._parameters[pname] = torch.nn.Parameter(codes, requires_grad=False)
                module.register_buffer(f"{pname}_scale", scale)
                size = codes.numel() * codes.element_size() + scale.numel() * scale.element_size()
            group = ("Engram tables" if ".engram.embed." in name else "DSpark" if name.startswith("mtp.")
                     else "vision" if name.startswith(("vision.", "aligner.", "image_")) else "backbone")
            category = _category(name, fmt if weights == "kept" else "plain", param.dtype)
            table[name] = (category, group, size)
    for name, buffer in model.named_buffers():
        if not name.endswith("_scale"):
            table[name] = ("buffers", "backbone", buffer.numel() * buffer.element_size())
    return table


def engram_tables_removed(model):
    """The Engram tables taken out of ``model`` (what the device map then places), restored after: the helper
    ``from_pretrained``'s ``plan_device_map`` uses for tables held in host memory, here for every table (the
    planner's ``--engram cpu`` holds them all on the host), so both plans leave out the same tensors."""
    from deepseek_v41.engram_host import tables_left_out

    return tables_left_out(model, host_only=False)


# ---- cache and activations ------------------------------------------------------------------------------------


def cache_len(model, context: int) -> int:
    """The static cache's positions for ``context``: rounded up as ``generate``'s ``static_cache`` does."""
    step = type(model).static_cache_granularity
    return -(-context // step) * step


def layer_cache_bytes(text, layer: int, batch: int, positions: int, element: int = 2) -> int:
    """Bytes of ``DeepseekV41StaticCache``'s buffers for one layer (see the module docstring)."""
    total = batch * text.sliding_window * text.head_dim * element
    ratio = text.compress_ratios[layer]
    if text.attention_mode(layer) == "full":
        entries = -(-positions // ratio)
        total += batch * entries * (text.head_dim * element + text.index_head_dim * 4)
        if ratio > 1:
            total += 2 * batch * ratio * text.head_dim * 4
    return total


def cache_extra_bytes(text, batch: int) -> int:
    """The cache's per-row tensors outside the layers: lengths (int64) and the Engram look-back ring (int64 + bool)."""
    ring = text.engram_max_ngram_size - 1 if text.engram_layer_ids else 0
    return batch * 8 + batch * ring * 9


def activation_parts(text, layers: list, batch: int, tokens: int, attn: str, head: bool) -> dict:
    """Estimated activation bytes at the prefill peak on a GPU that runs ``layers`` (and the head when ``head``)."""
    from deepseek_v41.attention import indexer_query_chunk, torch_attention_bytes

    bt = batch * tokens
    streams = 2 * bt * text.hc_mult * text.hidden_size * 2 + bt * text.hc_mult * 4  # in + out bf16, fp32 pre-mix
    block = BLOCK_ACTIVATION_FACTOR * block_token_width(text) * 2 * bt
    attention = 0
    for layer in layers:
        if attn == "torch":
            attention = max(attention, torch_attention_bytes(text, layer, batch, tokens, 2))
        elif text.compress_ratios[layer] and text.attention_mode(layer) in ("full", "reindex"):
            entries = tokens // text.compress_ratios[layer]
            chunk = indexer_query_chunk(batch, tokens, entries)
            attention = max(attention, batch * chunk * max(entries, 1) * 4 * 3)
    engram = 0
    if any(layer in text.engram_layer_ids for layer in layers):
        columns = (text.engram_max_ngram_size - 1) * text.engram_n_heads
        engram = bt * (columns * text.engram_head_dim * 2 + (text.hc_mult + 1) * text.hidden_size * 2
                       + ENGRAM_FP32_COPIES * text.hc_mult * text.hidden_size * 4)
    state = 0
    for layer in range(text.num_hidden_layers):
        if text.attention_mode(layer) == "full" and text.compress_ratios[layer]:
            state += batch * (tokens // text.compress_ratios[layer]) * (text.head_dim + text.index_head_dim) * 2
    state += 2 * bt * text.index_topk * 8  # the published top-k ids of a Full and a Reindex layer (int64)
    parts = {"streams": streams, "block (largest)": max(block + attention, engram), "CSA2 state": state}
    if head:
        from deepseek_v41.modeling_deepseek_v41 import GENERATE_LOGIT_COPIES

        parts["head logits (last position)"] = GENERATE_LOGIT_COPIES * batch * text.vocab_size * 4
        parts["head weight's bf16 copy (CUDA inference)"] = text.vocab_size * text.hidden_size * 2
    return parts


# ---- the plan -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_accelerate():
    # accelerate warns that the planned GPUs are not on this machine: planning for another machine is the point
    logger = logging.getLogger("accelerate.utils.modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():  # and about buffers for offloaded layers: the verdict reports offloading
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        logger.setLevel(level)


def _layer_of(module_name: str):
    match = re.match(r"layers\.(\d+)(\.|$)", module_name)
    return int(match[1]) if match else None


def plan_inference(model, config, *, gpus: int, gpu_memory: int, weights: str = "kept", engram: str = "gpu",
                   batch: int = 1, context: int = 32768, prefill_tokens: int | None = None,
                   attn: str = "tilelang", prepared: dict | None = None) -> dict:
    """The inference plan of ``model`` (a meta model from ``plan.meta_model``; ``prepared``: ``prepare_model``'s
    table when it was already swapped to ``weights``) on ``gpus`` GPUs of ``gpu_memory`` bytes."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    from deepseek_v41.modeling_deepseek_v41 import placement_of

    for label, value in (("--gpus", gpus), ("--gpu-memory", gpu_memory), ("--batch", batch), ("--context", context)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{label} must be a positive whole number, got {value!r}")
    if engram not in ("gpu", "cpu"):
        raise PlanError(f"--engram {engram!r}: use gpu (tables in the device map) or cpu (tables in host memory)")
    if attn not in ("tilelang", "torch"):
        raise PlanError(f"--attn {attn!r}: use tilelang (the Hopper kernels) or torch")
    prefill = context if prefill_tokens is None else prefill_tokens
    if not 1 <= prefill <= context:
        raise PlanError(f"--prefill-tokens {prefill} must be between 1 and the context ({context})")
    text = config.text_config
    table = prepared if prepared is not None else prepare_model(model, weights)
    positions = cache_len(model, context)
    per_layer_cache = [layer_cache_bytes(text, i, batch, positions) for i in range(text.num_hidden_layers)]
    cache_total = sum(per_layer_cache) + cache_extra_bytes(text, batch)
    all_layers = list(range(text.num_hidden_layers))
    act_budget = sum(activation_parts(text, all_layers, batch, prefill, attn, head=True).values())
    usable = gpu_memory - RESERVED_GIB * GIB
    headroom = int((act_budget + cache_total / gpus) * (1 + FRAGMENTATION))
    max_memory = {i: max(int(usable / (1 + FRAGMENTATION)) - headroom, 0) for i in range(gpus)}
    host = {}
    tables = sum(size for name, (_, group, size) in table.items() if group == "Engram tables")
    context_manager = engram_tables_removed(model) if engram == "cpu" else contextlib.nullcontext()
    no_split = list(model._no_split_modules)
    with context_manager, _quiet_accelerate():
        balanced = get_balanced_memory(model, dict(max_memory), no_split_module_classes=no_split)
        device_map = infer_auto_device_map(model, balanced, no_split_module_classes=no_split)
    if engram == "cpu":
        host["Engram tables (pinned)"] = tables
    per_gpu = {i: {"weights": 0, "cache": 0, "activations": 0, "layers": []} for i in range(gpus)}
    unplaced = 0
    for name, (_, _, size) in table.items():
        if engram == "cpu" and ".engram.embed." in name:
            continue
        device = placement_of(name, device_map)
        if device in per_gpu:
            per_gpu[device]["weights"] += size
        else:
            unplaced += size
    for key, device in device_map.items():
        layer = _layer_of(key)
        if device in per_gpu and layer is not None and key == f"layers.{layer}":
            per_gpu[device]["layers"].append(layer)
    head_device = placement_of("head.weight", device_map)
    for i, gpu in per_gpu.items():
        gpu["cache"] = sum(per_layer_cache[layer] for layer in gpu["layers"])
        if i == 0:
            gpu["cache"] += cache_extra_bytes(text, batch)
        runs = gpu["layers"] or (i == head_device)
        parts = activation_parts(text, gpu["layers"], batch, prefill, attn, head=i == head_device)
        gpu["activations"] = sum(parts.values()) if runs else 0
        if engram == "cpu" and any(layer in text.engram_layer_ids for layer in gpu["layers"]):
            columns = (text.engram_max_ngram_size - 1) * text.engram_n_heads
            gpu["activations"] += batch * prefill * columns * (text.engram_head_dim + text.engram_head_dim // 32)
        gpu["need"] = int((gpu["weights"] + gpu["cache"] + gpu["activations"]) * (1 + FRAGMENTATION))
        gpu["free"] = int(usable - gpu["need"])
    gpu_fit = all(gpu["free"] >= 0 for gpu in per_gpu.values())
    fits = unplaced == 0 and gpu_fit
    short = unplaced or max(0, -min(gpu["free"] for gpu in per_gpu.values()))
    first = next((key for key, device in device_map.items() if device not in per_gpu), None)
    first_bytes = sum(size for name, (_, _, size) in table.items()
                      if first is not None and (name == first or name.startswith(first + "."))
                      and not (engram == "cpu" and ".engram.embed." in name))
    return {
        "table": table, "device_map": device_map, "max_memory": max_memory, "headroom": headroom, "per_gpu": per_gpu, "host": host,
        "unplaced": unplaced, "first_unplaced": (first, first_bytes), "fits": fits, "short": short, "cache": cache_total, "cache_len": positions,
        "activations": activation_parts(text, all_layers, batch, prefill, attn, head=True),
        "gpus": gpus, "gpu_memory": gpu_memory, "usable": usable, "weights": weights, "engram": engram,
        "batch": batch, "context": context, "prefill": prefill, "attn": attn,
    }


def weight_totals(table: dict) -> dict:
    """{(group, category): bytes} and {group: bytes} of ``prepare_model``'s table."""
    by = {}
    for category, group, size in table.values():
        by[(group, category)] = by.get((group, category), 0) + size
    return by


def _gib(value) -> str:
    return f"{value / GIB:9.2f} GiB"


def format_inference_plan(plan: dict, source: str) -> str:
    held = "stored FP8/FP4 formats" if plan["weights"] == "kept" else "dequantized"
    lines = [f"model: {source}",
             (f"weights: {plan['weights']} ({held}), Engram tables on {plan['engram']}, batch {plan['batch']} x "
              f"context {plan['context']} (static cache of {plan['cache_len']} positions), prefill {plan['prefill']} "
              f"tokens, attn {plan['attn']}"),
             "weights by format:"]
    by = weight_totals(plan["table"])
    for group in ("backbone", "vision", "DSpark", "Engram tables"):
        rows = [(c, by[(group, c)]) for c in FORMATS if (group, c) in by]
        if not rows:
            continue
        total = sum(v for _, v in rows)
        lines.append(f"  {group:<52s} {total / 1e9:9.1f} GB {_gib(total)}")
        for category, value in rows:
            lines.append(f"    {category:<50s} {value / 1e9:9.2f} GB {_gib(value)}")
    total = sum(size for _, _, size in plan["table"].values())
    lines.append(f"  {'all weights':<52s} {total / 1e9:9.1f} GB {_gib(total)}")
    lines.append(f"decode cache (static, all layers): {plan['cache'] / GIB:.2f} GiB")
    acts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan["activations"].items())
    lines.append(f"prefill activation peak (estimate, GiB): {acts}")
    for part, value in plan["host"].items():
        lines.append(f"host memory: {part} {value / 1e9:.1f} GB ({value / GIB:.1f} GiB)")
    lines.append(f"per GPU (device_map='auto', {plan['gpus']} x {plan['gpu_memory'] / GIB:.1f} GiB, "
                 f"{plan['usable'] / GIB:.1f} GiB usable after {RESERVED_GIB:g} GiB reserved; needs include "
                 f"{int(FRAGMENTATION * 100)} % fragmentation):")
    lines.append(f"  {'gpu':>3s} {'layers':<12s} {'weights':>13s} {'cache':>13s} {'activations':>13s} "
                 f"{'need':>13s} {'free':>13s}")
    for i, gpu in plan["per_gpu"].items():
        layers = f"{min(gpu['layers'])}-{max(gpu['layers'])}" if gpu["layers"] else "-"
        lines.append(f"  {i:>3d} {layers:<12s} {_gib(gpu['weights'])} {_gib(gpu['cache'])} "
                     f"{_gib(gpu['activations'])} {_gib(gpu['need'])} {_gib(gpu['free'])}")
    lines.append("  max_memory for from_pretrained: {" + ", ".join(
        f"{i}: \"{v / GIB:.0f}GiB\"" for i, v in plan["max_memory"].items()) + "}")
    lines.append(verdict_line(plan))
    return "\n".join(lines)


def verdict_line(plan: dict) -> str:
    if plan["fits"]:
        tight = min(gpu["free"] for gpu in plan["per_gpu"].values())
        return f"verdict: fits ({tight / GIB:.1f} GiB free on the fullest GPU)"
    if plan["unplaced"] and not max(plan["max_memory"].values()):
        return (f"verdict: does NOT fit: the activations and the cache alone ({plan['headroom'] / GIB:.1f} GiB per GPU) "
                f"exceed a GPU's usable {plan['usable'] / GIB:.1f} GiB; use a smaller --batch or --prefill-tokens")
    if plan["unplaced"]:
        first, size = plan["first_unplaced"]
        return (f"verdict: does NOT fit: {plan['unplaced'] / GIB:.1f} GiB of weights find no GPU: device_map places "
                f"whole blocks in order, and {first} ({size / GIB:.1f} GiB) is the first that fits in none of the "
                f"GPUs' max_memory ({max(plan['max_memory'].values()) / GIB:.1f} GiB at most, after the activations "
                "and the cache); it and everything after it would be offloaded")
    return f"verdict: does NOT fit: the fullest GPU is {plan['short'] / GIB:.1f} GiB short"


def machine_table(model, config, batch: int = 1, context: int = 32768) -> str:
    """The README table: kept weights on ``MACHINES``, Engram tables on GPU vs in host memory."""
    table = prepare_model(model, "kept")
    lines = ["| machine | Engram tables on GPU | Engram tables in host memory |", "|---|---|---|"]
    for machine in MACHINES:
        gpus, memory = parse_machine(machine)
        cells = []
        for engram in ("gpu", "cpu"):
            plan = plan_inference(model, config, gpus=gpus, gpu_memory=memory, engram=engram, batch=batch,
                                  context=context, prepared=table)
            if plan["fits"]:
                tight = min(gpu["free"] for gpu in plan["per_gpu"].values())
                cell = f"fits ({tight / GIB:.0f} GiB free on the fullest GPU)"
            elif plan["unplaced"] and not max(plan["max_memory"].values()):
                cell = f"no: activations and cache alone need {plan['headroom'] / GIB:.0f} GiB per GPU"
            elif plan["unplaced"]:
                first, size = plan["first_unplaced"]
                cell = f"no: from `{first}` ({size / GIB:.0f} GiB) on, {plan['unplaced'] / GIB:.0f} GiB find no GPU"
            else:
                cell = f"no: {plan['short'] / GIB:.0f} GiB short on the fullest GPU"
            if engram == "cpu":
                cell += f", host {plan['host']['Engram tables (pinned)'] / GIB:.0f} GiB"
            cells.append(cell)
        label = machine.replace("H100", "H100-80GB")
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="checkpoint folder or config.json (default: the release)")
    parser.add_argument("--machine", default=None, help=f"NxH200 or NxH100 ({', '.join(MACHINES)})")
    parser.add_argument("--gpus", type=positive_int, default=None)
    parser.add_argument("--gpu-memory", default=None, help="per GPU: 141GB, 80GiB, 143771MiB (a number: GiB)")
    parser.add_argument("--weights", choices=("kept", "bf16"), default="kept")
    parser.add_argument("--engram", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--context", type=positive_int, default=32768, help="positions per row (prompt + new)")
    parser.add_argument("--prefill-tokens", type=positive_int, default=None, help="prompt length (default: context)")
    parser.add_argument("--attn", choices=("tilelang", "torch"), default="tilelang")
    parser.add_argument("--table", action="store_true", help="print the README table (kept weights, batch x "
                        "context, each machine of MACHINES with Engram on GPU and on host)")
    args = parser.parse_args(argv)
    try:
        if args.table:
            config, source = read_config(args.config)
            print(machine_table(meta_model(config), config, args.batch, args.context))
            return 0
        if args.machine is not None:
            if args.gpus is not None or args.gpu_memory is not None:
                raise PlanError("give --machine or --gpus/--gpu-memory, not both")
            gpus, memory = parse_machine(args.machine)
        else:
            if args.gpus is None or args.gpu_memory is None:
                raise PlanError(f"give --machine ({', '.join(MACHINES)}) or both --gpus and --gpu-memory")
            gpus, memory = args.gpus, parse_memory(args.gpu_memory)
        config, source = read_config(args.config)
        plan = plan_inference(meta_model(config), config, gpus=gpus, gpu_memory=memory, weights=args.weights,
                              engram=args.engram, batch=args.batch, context=args.context,
                              prefill_tokens=args.prefill_tokens, attn=args.attn)
    except PlanError as err:
        parser.error(str(err))
    print(format_inference_plan(plan, source))
    return 0 if plan["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
