"""Make the golden DSpark fixture `v41_tiny_dspark`: the text fixture's model plus three random DSpark draft stages,
and the official inference code's draft outputs on it.

    DS41_OFFICIAL_DIR=../shared/official_v41 python conversion/make_dspark_fixture.py --out GOLDEN \\
        [--base GOLDEN/v41_tiny_text]     # default: tests/fixtures' text fixture, materialized
    python tests/golden_fixtures.py pack GOLDEN --base v41_tiny_vision=v41_tiny_text --base v41_tiny_dspark=v41_tiny_text

The official ``model.py`` (with the CPU ``kernel.py`` beside it in DS41_OFFICIAL_DIR) is imported from that folder,
unmodified, as ``conversion/compare_with_official.py`` does; nothing of it is copied here. The snapshot is the
text fixture's tensors (byte-identical) plus the ``mtp.*`` stages written by ``make_tiny_checkpoint.dspark_tensors``
in the released formats; ``reference/README.md`` documents the runs and every stored tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import compare_with_official as official_tools
import golden_fixtures

from deepseek_v41.training.tiny_checkpoint import _Writer, dspark_tensors

NAME = "v41_tiny_dspark"
# Draft steps: for each odd position p in 49..63, a prefill of positions 0..p-1, then one decode step at p that
# drafts a block.  Only odd p: at a position that leaves a ratio-2 group open, the official decode step's ratio-2
# indexers score against a stale `shared_attn.index_k` (published only when a group completes: the last
# publisher's keys, another layer's), so its outputs there are not the model's (the prefill has no such path).
STEPS = range(49, 64, 2)
SEED = 41
# What the tiny text model gets on top (text_config fields, released names).
DSPARK = {
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 4,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [6, 7, 8],
    "dspark_markov_rank": 4,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 3,
}
# The same fields under the official ModelArgs names.
OFFICIAL_DSPARK = {
    "n_mtp_layers": 3,
    "dspark_block_size": 4,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [6, 7, 8],
    "dspark_markov_rank": 4,
    "dspark_n_routed_experts": 4,
    "dspark_n_activated_experts": 3,
}
RUNS = {  # tag: (ModelArgs overrides, torch default dtype)
    "bf16w_bf16": ({"dtype": "bf16", "expert_dtype": None}, torch.bfloat16),
    "fp8w_bf16": ({}, torch.bfloat16),
    "bf16w_fp32": ({"dtype": "bf16", "expert_dtype": None}, torch.float32),
}


def snapshot(base: Path, out: Path) -> dict:
    """Write out/snapshot: the base's config with DSpark stages, its shards renumbered, the stages in a 4th."""
    config = json.loads((base / "config.json").read_text())
    text = config["text_config"]
    text.update(DSPARK)
    text["compress_ratios"] = text["compress_ratios"] + [0] * DSPARK["num_nextn_predict_layers"]  # window-only
    writer = _Writer(SEED)
    dspark_tensors(writer, text, has_vision=False)
    index = json.loads((base / golden_fixtures.INDEX).read_text())["weight_map"]
    files = sorted(set(index.values()))
    total = len(files) + 1
    out.mkdir(parents=True)
    weight_map = {}
    for number, file in enumerate(files + [None], start=1):
        name = f"model-{number:05d}-of-{total:05d}.safetensors"
        tensors = writer.tensors if file is None else load_file(str(base / file))
        # as golden_fixtures rebuilds a based fixture's shards: the index's order, the originals' writer
        save_file(dict(sorted(tensors.items())), str(out / name), metadata=golden_fixtures.SHARD_METADATA)
        weight_map.update(dict.fromkeys(tensors, name))
    size = sum(t.numel() * t.element_size() for f in set(weight_map.values()) for t in load_file(str(out / f)).values())
    (out / golden_fixtures.INDEX).write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(base / name, out / name)
    return config


def official_run(module, fields: dict, overrides: dict, dtype, snap, tokenizer, ids: torch.Tensor) -> dict:
    """At each STEPS position p: prefill ids[:, :p] and seed the stages (``forward_spec(next, main_hidden, 0)``), then
    decode ids[:, p] (teacher-forced) and draft a block with ``forward_spec(next, main_hidden, p)``."""
    args = module.ModelArgs(**{**fields, **overrides})
    window = fields["window_size"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = module.Transformer(args, tokenizer).eval()
        targets, _ = official_tools.split_official_state(model, snap)
        official_tools.load_official_tensors(targets, snap)
        if dtype == torch.float32:  # the same graph in fp32: bf16-valued weights widened (exact)
            with torch.no_grad():
                for param in model.parameters():
                    if param.dtype == torch.bfloat16:
                        param.data = param.data.float()
            for layer in model.layers:  # the Engram row lookup returns bf16 (exact values): widen it too
                if layer.engram is not None:
                    lookup = layer.engram.embed.forward
                    layer.engram.embed.forward = lambda idx, lookup=lookup: lookup(idx).float()
        last = model.mtp[-1]
        seen = {"stage_out": [], "head_in": [], "pre_head": [], "markov_embed": []}

        def keep(key, pick):  # a forward hook that stores pick(args, output) and returns None (output unchanged)
            return lambda module, args, output: seen[key].append(pick(args, output)) and None

        for stage in model.mtp:
            stage.register_forward_hook(keep("stage_out", lambda a, out: out))
        last.norm.register_forward_hook(keep("pre_head", lambda a, out: a[0]))
        last.norm.register_forward_hook(keep("head_in", lambda a, out: out))
        last.markov_head.register_forward_hook(keep("markov_embed", lambda a, out: out[1]))
        record = {key: [] for key in ("first_ids", "draft_ids", "logits", "confidence", "head_in", "pre_head",
                                      "markov_embed", "stage_out", "stage_pre_mix", "window_main_hidden",
                                      "step_main_hidden")}
        with torch.inference_mode():
            for pos in STEPS:
                out_ids, _, prefix_hidden = model(ids[:, :pos], 0)
                assert model.forward_spec(out_ids, prefix_hidden, 0) is None
                out_ids, _, main_hidden = model(ids[:, pos : pos + 1], pos)
                for value in seen.values():
                    value.clear()
                drafted, logits, confidence = model.forward_spec(out_ids, main_hidden, pos)
                record["window_main_hidden"].append(prefix_hidden[:, -window:])
                record["step_main_hidden"].append(main_hidden[:, 0])
                record["first_ids"].append(drafted[:, 0])
                record["draft_ids"].append(drafted[:, 1:])
                record["logits"].append(logits)
                record["confidence"].append(confidence)
                record["head_in"].append(seen["head_in"][0])
                record["pre_head"].append(seen["pre_head"][0])
                record["markov_embed"].append(torch.stack(seen["markov_embed"], 1))
                record["stage_out"].append(torch.stack([s[0] for s in seen["stage_out"]], 1))  # [b, stage, B, hc, d]
                record["stage_pre_mix"].append(torch.stack([s[1] for s in seen["stage_out"]], 1))
    finally:
        torch.set_default_dtype(previous)
    out = {key: torch.stack(value, 1) for key, value in record.items()}  # [b, step, ...]
    out["main_hidden"] = torch.cat([prefix_hidden, main_hidden], 1)  # the last step's: [b, 64, targets·dim]
    return out


def reference(config: dict, snapshot_dir: Path, base_golden: Path, official_dir: Path, out: Path) -> dict:
    official_tools.install_kernels(official_dir / "kernel.py")
    module = official_tools.import_official_model(official_dir)
    snap = official_tools.SnapshotTensors(snapshot_dir)
    tokenizer = official_tools.official_tokenizer(snapshot_dir)
    fields = json.loads((base_golden / "official_args.json").read_text())
    fields.update(OFFICIAL_DSPARK, compress_ratios=config["text_config"]["compress_ratios"])
    golden = load_file(str(base_golden / "golden.safetensors"))
    ids = golden["input_ids"]
    runs = {tag: official_run(module, fields, overrides, dtype, snap, tokenizer, ids)
            for tag, (overrides, dtype) in RUNS.items()}

    head = snap.rows("head.weight").float()
    markov = snap.rows("mtp.2.markov_head.head.weight").float()
    stored = {"input_ids": ids}
    drafted = torch.cat([r["draft_ids"].flatten() for r in runs.values()] + [r["first_ids"].flatten() for r in runs.values()])
    sample = torch.unique(torch.cat([golden["logits_vocab_sample_ids"][:256], drafted]))  # sorted
    stored["logits_vocab_sample_ids"] = sample
    for tag, r in runs.items():
        # the full logits are head_in x head + markov_embed x Markov head: check that against the returned ones
        rebuilt = r["head_in"].float() @ head.T + r["markov_embed"].float() @ markov.T
        error = ((rebuilt - r["logits"]).norm() / r["logits"].norm()).item()
        assert error < 1e-6, f"{tag}: logits are not head_in x head + markov_embed x markov head ({error:.1e})"
        assert torch.equal(r["logits"].argmax(-1), r["draft_ids"]), f"{tag}: the drafts are not the argmax"
        stored[f"{tag}.main_hidden"] = r["main_hidden"]
        stored[f"{tag}.window_main_hidden"] = r["window_main_hidden"]
        stored[f"{tag}.step_main_hidden"] = r["step_main_hidden"]
        stored[f"{tag}.block_first_ids"] = r["first_ids"]
        stored[f"{tag}.draft_ids"] = r["draft_ids"]
        stored[f"{tag}.head_in"] = r["head_in"]
        stored[f"{tag}.markov_embed"] = r["markov_embed"]
        stored[f"{tag}.confidence"] = r["confidence"]
        if tag == "bf16w_bf16":
            stored[f"{tag}.logits_vocab_sample"] = r["logits"][..., sample].contiguous()
            stored[f"{tag}.pre_head"] = r["pre_head"]
            stored[f"{tag}.stage_out"] = r["stage_out"]
            stored[f"{tag}.stage_pre_mix"] = r["stage_pre_mix"]
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out / "golden.safetensors"))
    (out / "official_args.json").write_text(json.dumps(fields, indent=1) + "\n")
    return runs


def describe(runs: dict) -> str:
    """Facts of the runs for the README: how the three runs differ, and the drafts' top-1 margins."""
    lines = []
    ref = runs["bf16w_bf16"]
    top2 = ref["logits"].topk(2, -1).values
    margin = (top2[..., 0] - top2[..., 1]).flatten()
    lines.append(f"reference draft logits: top-1 margin median {margin.median():.2f}, 10th percentile "
                 f"{margin.quantile(0.1):.2f}, min {margin.min():.3f}")
    for tag in ("fp8w_bf16", "bf16w_fp32"):
        agree = (runs[tag]["draft_ids"] == ref["draft_ids"]).float().mean().item()
        first = (runs[tag]["first_ids"] == ref["first_ids"]).float().mean().item()
        rel = ((runs[tag]["logits"] - ref["logits"]).norm() / ref["logits"].norm()).item()
        conf = ((runs[tag]["confidence"] - ref["confidence"]).norm() / ref["confidence"].norm()).item()
        lines.append(f"{tag} vs bf16w_bf16: drafts agree {agree:.1%}, block first ids {first:.1%}, draft logits "
                     f"rel. L2 {rel:.1e}, confidence rel. L2 {conf:.1e}")
    return "\n".join(lines)


README = """# DeepSeek-V4.1-Flash DSpark reference outputs: `v41_tiny_dspark`

The model of `v41_tiny_text` (its tensors byte-identical; see that fixture's README for the backbone) plus three
random DSpark draft stages `mtp.0-2` in the released formats, and the official inference code's outputs with
them: `model.py` of Hugging Face `deepseek-ai/DeepSeek-V4.1-Flash`, `inference/` at revision
`dba1be0a40aa45a94ad051997016db3960a90277`, unmodified, on CPU with the pure-PyTorch kernels of the text fixture.
Made by `conversion/make_dspark_fixture.py`.

## Model

text_config as `v41_tiny_text` plus: `num_nextn_predict_layers` 3, `dspark_block_size` 4, `dspark_noise_token_id`
128799, `dspark_target_layer_ids` [6, 7, 8], `dspark_markov_rank` 4, `dspark_n_routed_experts` 4,
`dspark_num_experts_per_tok` 3, `compress_ratios` with three 0 entries appended (the stages are window-only,
RoPE theta 10000 without YaRN). Stage k (layer index 9 + k) is a full block (mHC, window attention, MoE with 4
routed experts top-3 and a shared expert, `gate.bias`); stage 0 adds `main_proj` (FP8 [32, 96]) and `main_norm`;
stage 2 adds the final `norm`, `markov_head.embed.weight` / `markov_head.head.weight` (BF16 [129280, 4]) and
`confidence_head.proj.weight` (BF16 [1, 36]; the official code holds it, like the Markov head, in fp32). Random
values as the backbone's (seed 41). `official_args.json`: the official `ModelArgs` (`n_mtp_layers` 3,
`dspark_n_activated_experts` 3, temperature 0: drafts are argmax).

## Runs

Each run, at each of the 8 draft positions pos = 49, 51, ..., 63: a prefill of `input_ids[:, :pos]`
(`Transformer.forward(ids, 0)`) and `forward_spec(next, main_hidden, 0)` (seeds each stage's window with the main
model's positions), then one decode step `forward(input_ids[:, pos], pos)` (teacher-forced: the input's own token)
and `forward_spec(next, main_hidden, pos)`, which drafts one block: token 0 = the backbone's argmax `next` (position pos + 1), tokens 1..3 = the noise id; logits i of the
block predict the token after block token i (position pos + 2 + i) and get the Markov head's bias of the
previously drafted token (token 0 = `next`); drafts are their argmax, chained.

Why one decode step per prefill, at odd positions only: the official decode step at a position that leaves a
ratio-2 compression group open (even positions) lets the ratio-2 indexers (layers 2, 4) score against a stale
`shared_attn.index_k` (it is published only when the group completes, so it still holds the last publisher's keys:
another layer's); the main model's decode outputs there differ from its prefill (up to 5e-2 relative in the
stages' input at the tiny model), and every later step inherits the error through the caches. A prefill has no
such path, and a decode step at an odd position completes the group, so every output here is the model's.

| tag | weights | numerics |
|---|---|---|
| `bf16w_bf16` | THE reference: FP8/FP4 decoded to bf16 (`dtype` bf16, `expert_dtype` null) | official bf16 |
| `fp8w_bf16` | as released | official FP8 path |
| `bf16w_fp32` | as `bf16w_bf16` | the same graph in fp32 (bf16-valued weights widened, Engram lookup widened): not official numerics |

## Keys of `golden.safetensors` (step = draft step 0..7 at position pos = 49 + 2·step, B = 4)

| key | shape | dtype | meaning |
|---|---|---|---|
| `input_ids` | [2, 64] | I64 | the text fixture's input ids |
| `logits_vocab_sample_ids` | [n] | I64 | sorted: ids 0..255 of the text fixture's sample and every id drafted in any run |
| `{tag}.main_hidden` | [2, 64, 96] | BF16 / F32 | the stages' input (per target layer 6, 7, 8 the mean over the 4 streams of the block's input, concatenated) of the last step: its prefill (0..62) and decode (63) |
| `{tag}.window_main_hidden` | [2, 8, 16, 96] | BF16 / F32 | per step, the stages' input at positions pos-16 .. pos-1 from that step's prefill (what the stages' windows hold) |
| `{tag}.step_main_hidden` | [2, 8, 96] | BF16 / F32 | per step, the stages' input at pos (the decode step) |
| `{tag}.block_first_ids` | [2, 8] | I64 | block token 0 (the backbone's argmax at pos) |
| `{tag}.draft_ids` | [2, 8, 4] | I64 | the drafted tokens (argmax of the block's logits) |
| `{tag}.head_in` | [2, 8, 4, 32] | BF16 / F32 | `norm(hc_pre(stage 2 streams, its ffn pre-mix))`, the head's input |
| `{tag}.markov_embed` | [2, 8, 4, 4] | BF16 / F32 | Markov embedding of the previous token of each block position |
| `{tag}.confidence` | [2, 8, 4] | F32 | confidence head output (`proj(cat(hc_pre(...), markov_embed))`, a logit) |
| `bf16w_bf16.logits_vocab_sample` | [2, 8, 4, n] | F32 | draft logits (head + Markov bias) at the sample ids |
| `bf16w_bf16.pre_head` | [2, 8, 4, 32] | BF16 | `hc_pre(...)` before the norm |
| `bf16w_bf16.stage_out` | [2, 8, 3, 4, 4, 32] | BF16 | each stage's output streams [b, step, stage, B, hc, dim] |
| `bf16w_bf16.stage_pre_mix` | [2, 8, 3, 4, 4] | F32 | each stage's FFN pre-mix handed on |

Full draft logits = `head_in.float() @ head.weight.float().T + markov_embed.float() @
mtp.2.markov_head.head.weight.float().T` (checked against the returned logits in every run, rel. L2 < 1e-6).

## Measured

{facts}
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder that receives v41_tiny_dspark/")
    parser.add_argument("--base", type=Path, help="the complete v41_tiny_text fixture (default: materialized)")
    opts = parser.parse_args(argv)
    official_dir = os.environ.get("DS41_OFFICIAL_DIR")
    if not official_dir or not (Path(official_dir) / "model.py").is_file():
        sys.exit("set DS41_OFFICIAL_DIR to the official DeepSeek-V4.1 inference folder (model.py + a CPU kernel.py)")
    target = opts.out / NAME
    if target.exists():
        sys.exit(f"{target} exists: remove it first")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = opts.base or golden_fixtures.materialize("v41_tiny_text", Path(tmp))
        config = snapshot(base / "snapshot", target / "snapshot")
        runs = reference(config, target / "snapshot", base / "reference", Path(official_dir), target / "reference")
    facts = describe(runs)
    (target / "reference" / "README.md").write_text(README.replace("{facts}", facts))
    print(facts)


if __name__ == "__main__":
    main()
