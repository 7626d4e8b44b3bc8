"""Write a tiny random DeepSeek-V4.1 checkpoint in the exact released (FP8/FP4) format.

The tensor set, dtypes and shard layout match the golden tiny snapshot (the repository's
`tests/fixtures/v41_tiny_text/snapshot`, or `v41_tiny_vision` with `--vision-layers 2`): FP8 E4M3 linears
with 32x32 UE8M0 block scales, packed FP4 routed experts with per-32 scales, FP8 Engram tables with
per-row scales, F32 `hc_*` / `attn_sink` / gate biases, BF16 everything else. Weights are random with
sensible scales: norm weights 1 +- 0.1, projections fan-in^-0.5, residual-branch outputs (`attn.wo_b`,
every expert's `w2`) 0.1x that.

Part of the package (not only of the repository) so that the CPU demo's `model.make_tiny_checkpoint_if_missing`
works from a plain `pip install`; `conversion/make_tiny_checkpoint.py` is the same command.

    python -m deepseek_v41.training.tiny_checkpoint --out /tmp/tiny [--seed 0] [--vision-layers 0]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import torch

from deepseek_v41.checkpoint import INDEX_FILE, write_safetensors
from deepseek_v41.release_format import (
    RELEASED_QUANTIZATION_CONFIG,
    encode_fp4_packed,
    encode_fp8_blockwise,
    encode_fp8_rows,
)
from deepseek_v41.training.data import packaged_tokenizer_dir

# The golden tiny model's config (released structure, tiny sizes). Engram rows come from the prime rule
# for engram_vocab_size 97, 4 heads, n-grams 2..4 (architecture.md §9.2).
TINY_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": RELEASED_QUANTIZATION_CONFIG,
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280,
        "hidden_size": 32,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 9,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 64,
        "o_lora_rank": 32,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        },
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 16,
        "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1],
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 4, 5],
        "index_source_layer_ids": [2, 4, 5, 7],
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 8,
        "candidate_source_layer_id": 5,
        "candidate_topk_blocks": 4,
        "candidate_block_size": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "engram_layer_ids": [1, 4],
        "engram_num_embeddings": [1464, 2234],
        "engram_max_ngram_size": 4,
        "engram_vocab_size": 97,
        "engram_n_heads": 4,
        "engram_head_dim": 32,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 0,
        "dspark_block_size": 0,
        "dspark_noise_token_id": 0,
        "dspark_target_layer_ids": [],
        "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 0,
        "dspark_num_experts_per_tok": 0,
    },
    "vision_config": {
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 0,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "patch_size": 14,
        "rope_theta": 10000,
        "downsample_ratio": 3,
        "max_image_tokens": 64,
        "min_pixels": 1,
        "max_wh_ratio": None,
    },
}


def tiny_config(vision_layers: int = 0, **text_overrides) -> dict:
    """The tiny config with `vision_config.num_hidden_layers` and any `text_config` fields replaced."""
    config = copy.deepcopy(TINY_CONFIG)
    unknown = set(text_overrides) - set(config["text_config"])
    if unknown:
        raise ValueError(f"unknown text_config fields: {sorted(unknown)}")
    config["text_config"].update(text_overrides)
    config["vision_config"]["num_hidden_layers"] = vision_layers
    return config


class _Writer:
    """Random tensors in released formats, collected as {released name: stored tensor}."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}

    def normal(self, shape, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator) * std + mean

    def bf16(self, name: str, shape, std: float, mean: float = 0.0) -> None:
        self.tensors[name] = self.normal(shape, std, mean).to(torch.bfloat16)

    def f32(self, name: str, shape, std: float, mean: float = 0.0) -> None:
        self.tensors[name] = self.normal(shape, std, mean)

    def norm(self, name: str, size: int) -> None:
        self.bf16(name, (size,), 0.1, mean=1.0)

    def linear(self, name: str, out_features: int, in_features: int, fmt: str, gain: float = 1.0) -> None:
        # `name` without `.weight`; fmt "bf16" | "fp8" (32x32 blocks) | "fp4" (packed, per-32 scales)
        w = self.normal((out_features, in_features), gain * in_features**-0.5)
        if fmt == "bf16":
            self.tensors[f"{name}.weight"] = w.to(torch.bfloat16)
            return
        q, scale = encode_fp8_blockwise(w) if fmt == "fp8" else encode_fp4_packed(w)
        self.tensors[f"{name}.weight"], self.tensors[f"{name}.scale"] = q, scale


def _block_tensors(w: _Writer, p: str, text: dict, i: int, n_experts: int, has_vision: bool) -> None:
    """One block's released tensors under prefix `p` (`layers.{i}` or a DSpark stage `mtp.{k}`; a stage's layer
    index i is past the backbone, so it owns no compressor, indexer or Engram)."""
    d, m = text["hidden_size"], text["hc_mult"]
    heads, head_dim, q_rank = text["num_attention_heads"], text["head_dim"], text["q_lora_rank"]
    groups, o_rank, inter = text["o_groups"], text["o_lora_rank"], text["moe_intermediate_size"]
    index_dim, index_heads = text["index_head_dim"], text["index_n_heads"]
    engram_width = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"] * text["engram_head_dim"]
    w.norm(f"{p}.attn_norm.weight", d)
    w.norm(f"{p}.ffn_norm.weight", d)
    for mix in ("attn", "ffn"):  # mHC: [pre m | post m | residual m x m] coefficients
        w.f32(f"{p}.hc_{mix}_fn", ((2 + m) * m, m * d), (m * d) ** -0.5)
        base = w.normal(((2 + m) * m,), 0.5)
        base[2 * m:] += 3.0 * torch.eye(m).reshape(-1)  # near-identity residual mix
        w.tensors[f"{p}.hc_{mix}_base"] = base
        w.tensors[f"{p}.hc_{mix}_scale"] = torch.rand(3, generator=w.generator) * 0.5 + 0.2
    w.linear(f"{p}.attn.wq_a", q_rank, d, "fp8")
    w.norm(f"{p}.attn.q_norm.weight", q_rank)
    w.linear(f"{p}.attn.wq_b", heads * head_dim, q_rank, "fp8")
    w.linear(f"{p}.attn.wkv", head_dim, d, "fp8")
    w.norm(f"{p}.attn.kv_norm.weight", head_dim)
    w.linear(f"{p}.attn.wo_a", groups * o_rank, heads * head_dim // groups, "fp8")
    w.linear(f"{p}.attn.wo_b", d, groups * o_rank, "fp8", gain=0.1)
    w.f32(f"{p}.attn.attn_sink", (heads,), 0.4, mean=1.0)
    if i in text["kv_source_layer_ids"]:  # Full layer: own compressor and index keys
        w.linear(f"{p}.attn.compressor.wkv", head_dim, d, "bf16")
        if text["compress_ratios"][i] == 2:
            w.linear(f"{p}.attn.compressor.wgate", head_dim, d, "bf16")
        w.norm(f"{p}.attn.compressor.norm.weight", head_dim)
        w.linear(f"{p}.attn.indexer.wk", index_dim, head_dim, "bf16")
        w.norm(f"{p}.attn.indexer.k_norm.weight", index_dim)
    if i in text["index_source_layer_ids"]:  # Full or Reindex layer: own indexer queries
        w.linear(f"{p}.attn.indexer.wq_b", index_heads * index_dim, q_rank, "fp8")
        w.linear(f"{p}.attn.indexer.weights_proj", index_heads, d, "bf16")
    if i in text["engram_layer_ids"]:
        rows = text["engram_num_embeddings"][text["engram_layer_ids"].index(i)]
        table = w.normal((rows, text["engram_head_dim"]), 0.5)
        w.tensors[f"{p}.engram.embed.weight"], w.tensors[f"{p}.engram.embed.scale"] = encode_fp8_rows(table)
        w.linear(f"{p}.engram.wkv", (m + 1) * d, engram_width, "fp8")
        w.bf16(f"{p}.engram.q_weight", (m, d), 0.2, mean=1.0)
        w.bf16(f"{p}.engram.k_weight", (m, d), 0.2, mean=1.0)
    w.linear(f"{p}.ffn.gate", n_experts, d, "bf16")
    w.f32(f"{p}.ffn.gate.bias", (n_experts,), 0.3)
    if has_vision:
        w.f32(f"{p}.ffn.gate.bias_vl", (n_experts,), 0.3)
    shared = inter * text["n_shared_experts"]
    w.linear(f"{p}.ffn.shared_experts.w1", shared, d, "fp8")
    w.linear(f"{p}.ffn.shared_experts.w2", d, shared, "fp8", gain=0.1)
    w.linear(f"{p}.ffn.shared_experts.w3", shared, d, "fp8")
    for e in range(n_experts):
        w.linear(f"{p}.ffn.experts.{e}.w1", inter, d, "fp4")
        w.linear(f"{p}.ffn.experts.{e}.w2", d, inter, "fp4", gain=0.1)
        w.linear(f"{p}.ffn.experts.{e}.w3", inter, d, "fp4")


def dspark_tensors(w: _Writer, text: dict, has_vision: bool) -> None:
    """The DSpark draft stages `mtp.{k}` in released formats (none unless `num_nextn_predict_layers` and
    `dspark_block_size` are set): full blocks with their own routed experts, stage 0's FP8 `main_proj` over the
    target layers' concatenated stream means plus `main_norm`, and on the last stage the final `norm`, the BF16
    Markov head (`embed` / `head` [vocab, dspark_markov_rank]) and the confidence head (`proj` [1, dim + rank])."""
    n_stages = text["num_nextn_predict_layers"] if text["dspark_block_size"] else 0
    d, rank = text["hidden_size"], text["dspark_markov_rank"]
    for k in range(n_stages):
        p = f"mtp.{k}"
        _block_tensors(w, p, text, text["num_hidden_layers"] + k, text["dspark_n_routed_experts"], has_vision)
        if k == 0:
            w.linear(f"{p}.main_proj", d, d * len(text["dspark_target_layer_ids"]), "fp8")
            w.norm(f"{p}.main_norm.weight", d)
        if k == n_stages - 1:
            w.norm(f"{p}.norm.weight", d)
            w.bf16(f"{p}.markov_head.embed.weight", (text["vocab_size"], rank), 1.0)
            w.linear(f"{p}.markov_head.head", text["vocab_size"], rank, "bf16", gain=0.5)
            w.linear(f"{p}.confidence_head.proj", 1, d + rank, "bf16")


def released_tensors(config: dict, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """Random released-format tensors for `config` and their grouping into shards (golden layout)."""
    text, vision = config["text_config"], config["vision_config"]
    d, n_experts = text["hidden_size"], text["n_routed_experts"]
    has_vision = vision["num_hidden_layers"] > 0
    w = _Writer(seed)
    layer_names = []
    for i in range(text["num_hidden_layers"]):
        before = set(w.tensors)
        _block_tensors(w, f"layers.{i}", text, i, n_experts, has_vision)
        layer_names.append(sorted(set(w.tensors) - before))

    w.bf16("embed.weight", (text["vocab_size"], d), 1.0)
    w.linear("head", text["vocab_size"], d, "bf16")
    w.norm("norm.weight", d)
    if has_vision:
        vd, patch = vision["hidden_size"], vision["patch_size"]
        w.linear("vision.patch_embed.proj", vd, 3 * patch * patch, "bf16")
        w.bf16("vision.patch_embed.proj.bias", (vd,), 0.02)
        for b in range(vision["num_hidden_layers"]):
            p = f"vision.blocks.{b}"
            w.norm(f"{p}.norm1.weight", vd)
            w.norm(f"{p}.norm2.weight", vd)
            w.linear(f"{p}.attn.wqkv", 3 * vd, vd, "bf16")
            w.bf16(f"{p}.attn.wqkv.bias", (3 * vd,), 0.02)
            w.linear(f"{p}.attn.wo", vd, vd, "bf16")
            w.bf16(f"{p}.attn.wo.bias", (vd,), 0.02)
            w.linear(f"{p}.mlp.w1", 2 * vision["intermediate_size"], vd, "bf16")
            w.linear(f"{p}.mlp.w2", vd, vision["intermediate_size"], "bf16")
        w.norm("vision.norm.weight", vd)
        w.linear("aligner.w1", d, vd * vision["downsample_ratio"] ** 2, "bf16")
        w.bf16("aligner.w1.bias", (d,), 0.02)
        w.linear("aligner.w2", d, d, "bf16")
        w.bf16("aligner.w2.bias", (d,), 0.02)
        for name in ("image_start", "image_end", "image_newline"):
            w.bf16(name, (d,), 1.0)
    dspark_tensors(w, text, has_vision)  # after everything else: the backbone's random values stay the same

    # Golden layout: embed + the first half of the layers, the other half, then head/norm/vision.
    half = (len(layer_names) + 1) // 2
    shards = [
        ["embed.weight"] + [n for names in layer_names[:half] for n in names],
        [n for names in layer_names[half:] for n in names],
    ]
    placed = {n for shard in shards for n in shard}
    shards.append(sorted(set(w.tensors) - placed))
    return w.tensors, shards


def make_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, vision_layers: int = 0, **text_overrides) -> Path:
    """Write config.json, shards, index and tokenizer files of a tiny released-format model to `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(vision_layers, **text_overrides)
    tensors, shards = released_tensors(config, seed)
    weight_map = {}
    for index, names in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out_dir / file, {name: tensors[name] for name in sorted(names)})
        weight_map.update(dict.fromkeys(names, file))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer_dir = packaged_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer_dir / name, out_dir / name)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vision-layers", type=int, default=0, help="ViT blocks (0: text-only, like v41_tiny_text)")
    parser.add_argument("--hidden-size", type=int, help="override text_config.hidden_size (default 32)")
    parser.add_argument("--n-routed-experts", type=int, help="override text_config.n_routed_experts (default 8)")
    parser.add_argument("--moe-intermediate-size", type=int, help="override (default 64)")
    args = parser.parse_args(argv)
    overrides = {key: value for key, value in (("hidden_size", args.hidden_size),
                                               ("n_routed_experts", args.n_routed_experts),
                                               ("moe_intermediate_size", args.moe_intermediate_size))
                 if value is not None}
    out = make_tiny_checkpoint(args.out, seed=args.seed, vision_layers=args.vision_layers, **overrides)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
