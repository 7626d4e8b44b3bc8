"""What verifying a DSpark draft costs: one forward over ``dspark_block_size`` + 1 tokens against a one-token decode
step, in the same run (issue 42).

GPU: the 4-layer released-width proxy of ``train_step.py`` plus three DSpark stages of the released shape (128
experts top-3, blocks of 5, Markov rank 256, reading layers 1-3), random weights, bf16: acceptance means nothing
here, so the step times are measured and the speed-up is derived from them.  At each ``--contexts`` length, after a
prefill into a static cache that can undo a block:

* ``step``: one decode step as ``generate`` runs it (``decode.py``'s call; ``--mode cuda_graph``: replayed graph);
* ``verify``: the forward over [last token, B drafts] with the stages' input (``output_dspark_hidden=True``, what
  ``generate(use_dspark=True)`` runs): one multi-token step (``--mode cuda_graph``: its own replayed graph, one per
  block width), then rolled back (untimed);
* ``verify_columns``: the same forward as before the multi-token step (``decode_at_once = False``): B + 1 eager
  one-token steps;
* ``draft``: ``dspark.draft_block`` (the stages once over the block, the Markov chain over its B positions).

Printed: milliseconds of each (mean over ``--reps``), verify / step (issue 42's target: <= 1.5) and verify_columns /
step, kernels per call (CPU: top-level aten ops) and GPU-busy share (torch.profiler; ``decode.py``'s definition) of
``step``, ``verify`` (and kernels of ``verify_columns``), and the tokens/s a real checkpoint would reach at SGLang's
acceptance (``--accepted``, 5.4 tokens per step): accepted / (draft + verify) against 1 / step.

CPU (``--device cpu``): ``decode.py``'s tiny config (``--cpu-size mid``: the same structure at mid widths) plus three
stages, fp32, the growing cache ``generate(use_dspark=True)`` uses there, eager (no graphs), one thread, timed as
that thread's CPU time (a shared host's waits do not count).

    python examples/benchmarks/dspark_verify.py [--contexts 4096 32768] [--out examples/benchmarks/results/dspark_verify_h200.txt]
    python examples/benchmarks/dspark_verify.py --torch-attention     # a GPU without TileLang's kernels
    python examples/benchmarks/dspark_verify.py --device cpu --mode off [--cpu-size mid]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from deepseek_v41.dspark import DSparkState, draft_block
from deepseek_v41.modeling_deepseek_v41 import GENERATE_DECODE_STEP, DeepseekV41ForCausalLM, default_dtype

sys.path.insert(0, str(Path(__file__).parent))
from decode import (
    add_backend_arguments,
    head_as_released,
    profile_steps,
    synchronize,
    proxy_backend,
    time_steps,
    tiny_text_config,
    tokenizer,
    write_kernel_table,
)

DSPARK = {"num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
          "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3}


# --cpu-size mid: the tiny CPU config at widths where a step's arithmetic starts to count next to its op overhead
MID = {"hidden_size": 512, "moe_intermediate_size": 512, "num_attention_heads": 8, "head_dim": 128,
       "qk_rope_head_dim": 32, "q_lora_rank": 256, "o_lora_rank": 128, "o_groups": 4, "n_routed_experts": 16,
       "sliding_window": 128, "index_n_heads": 16, "index_head_dim": 64, "index_topk": 64, "candidate_block_size": 16,
       "engram_head_dim": 64}


def build_model(device, args):
    from deepseek_v41 import DeepseekV41Config

    torch.manual_seed(0)
    if device.type == "cpu":
        text = tiny_text_config()
        if args.cpu_size == "mid":
            text.update(MID)
        text.update(DSPARK, dspark_markov_rank=8, dspark_n_routed_experts=8, dspark_target_layer_ids=[1, 2, 3],
                    compress_ratios=text["compress_ratios"] + [0, 0, 0])
        config, dtype = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}), torch.float32
    else:
        from train_step import proxy_config

        config = proxy_config(proxy_backend(args))
        text = config.text_config
        for key, value in DSPARK.items():
            setattr(text, key, value)
        text.dspark_target_layer_ids = list(range(1, text.num_hidden_layers))[-3:]
        text.compress_ratios = text.compress_ratios[: text.num_hidden_layers] + [0] * 3
        dtype = torch.bfloat16
    with torch.device(device), default_dtype(dtype):
        model = DeepseekV41ForCausalLM(config, tokenizer=tokenizer())
    head_as_released(model, args)
    return model.eval()


@torch.inference_mode()
def measure(model, ids, block, args, device) -> str:
    """One table row: the calls at context ids.shape[1] (see the module docstring)."""
    text, B = model.config.text_config, block.shape[1] - 1
    if device.type == "cuda" and model.config.backend["attn"] == "tilelang":
        model(ids, logits_to_keep=1)  # TileLang builds its kernels for this prefill shape
    # the timed calls leave their positions in the cache (it has room): a few hundred positions past the context
    # by the end, which changes nothing measurable; rollback (generate(use_dspark=True) runs it after each
    # verification: a host read of the counts) is timed on its own
    cache = model.dspark_cache(1, ids.shape[1] + 16 * args.reps + 128, B)
    out = model(ids, cache=cache, logits_to_keep=1, output_dspark_hidden=True)
    state = DSparkState(model.mtp, text.sliding_window)
    state.add(model.mtp, out.dspark_hidden)
    token = out.logits[:, -1:].argmax(-1)
    model.decode_graph = args.mode

    def columns():  # the verification as before the multi-token step: B + 1 one-token steps
        model.decode_at_once = False
        try:
            return model(block, cache=cache, output_dspark_hidden=True)
        finally:
            model.decode_at_once = True

    calls = {
        "step": lambda: model(token, cache=cache, **{GENERATE_DECODE_STEP: True}),
        "verify": lambda: model(block, cache=cache, output_dspark_hidden=True, **{GENERATE_DECODE_STEP: True}),
        "verify_columns": columns,
        "draft": lambda: draft_block(model, state, token[:, 0]),
        "rollback": lambda: cache.rollback(0),
    }
    for call in calls.values():  # warm-up (a graph mode captures its graph here)
        call()
        call()
    timer = time_steps if device.type == "cuda" else cpu_seconds
    ms = {name: 1e3 * timer(call, args.reps, device) for name, call in calls.items()}
    k_step, busy_step, _ = profile_steps(calls["step"], 3, device)
    k_verify, busy_verify, _ = profile_steps(calls["verify"], 3, device)
    k_columns, _, _ = profile_steps(calls["verify_columns"], 3, device)
    if args.profile_table:  # where each call's time goes: the top ops by self time (CPU) or kernels (CUDA)
        op_table(calls, args.profile_table, f"context {ids.shape[1]}", device)
    plain = 1e3 / ms["step"]
    spec = args.accepted * 1e3 / (ms["draft"] + ms["verify"] + ms["rollback"])
    return (f"{ids.shape[1]:7d} {ms['step']:8.2f} {ms['verify']:10.2f} {ms['verify_columns']:18.2f} "
            f"{ms['draft']:9.2f} {ms['rollback']:12.3f} {ms['verify'] / ms['step']:12.2f} "
            f"{ms['verify_columns'] / ms['step']:20.2f} {k_step:8.0f}/{k_verify:.0f}/{k_columns:<8.0f} "
            f"{100 * busy_step:10.1f}/{100 * busy_verify:<9.1f} {plain:12.1f} {spec:14.1f}")


def cpu_seconds(call, n: int, device) -> float:
    """Mean CPU time of the calling thread per call (CPU runs use one thread): unlike wall time it does not count
    the waits of a host shared with other processes."""
    start = time.thread_time()
    for _ in range(n):
        call()
    return (time.thread_time() - start) / n


def op_table(calls, path, title, device, reps=3, rows=12):
    """Append where each call's time goes: its kernels by time per call (CUDA, decode.py's table) or its top ops by
    self CPU time (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name in ("step", "verify", "verify_columns"):
        with profile(activities=activities) as prof:
            for _ in range(reps):
                calls[name]()
            synchronize(device)
        if device.type == "cuda":
            write_kernel_table(prof.events(), reps, path, f"{title}, {name}")
            continue
        with open(path, "a") as f:
            f.write(f"\n## {title}, {name} ({reps} calls)\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--mode", default="cuda_graph", help="decode step mode (decode.py): cuda_graph or off")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--accepted", type=float, default=5.4, help="tokens per step at the projection (SGLang)")
    parser.add_argument("--out", type=Path, help="append the table to this file")
    parser.add_argument("--profile-table", type=Path, help="append each call's top ops (torch.profiler) to this file")
    add_backend_arguments(parser)
    parser.add_argument("--cpu-size", choices=["tiny", "mid"], default="tiny", help="CPU: decode.py's tiny config or "
                        "the same structure at mid widths (hidden 512, head_dim 128, window 128)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # timed as the thread's CPU time (cpu_seconds)
    model = build_model(device, args)
    text = model.config.text_config
    B = text.dspark_block_size
    what = "proxy" if device.type == "cuda" else f"{args.cpu_size} CPU config (hidden {text.hidden_size})"
    title = (f"{text.num_hidden_layers}-layer {what} + {len(model.mtp)} DSpark stages (blocks of {B}, "
             f"{text.dspark_n_routed_experts} experts top-{text.dspark_num_experts_per_tok}), {model.embed.weight.dtype}, "
             f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, step mode {args.mode}, head values {'fp32' if args.fp32_head_values else 'bf16 (as released)'}")
    header = ("context  step ms  verify ms  verify_columns ms  draft ms  rollback ms  verify/step  verify_columns/step  "
              f"kernels step/verify/columns  GPU busy % step/verify  tok/s plain  tok/s at {args.accepted} accepted")
    lines = [title, header]
    print("\n".join(lines), flush=True)
    generator = torch.Generator().manual_seed(0)
    for ctx in args.contexts:
        ids = torch.randint(3, 129000, (1, ctx), generator=generator).to(device)
        block = torch.randint(3, 129000, (1, B + 1), generator=generator).to(device)
        line = measure(model, ids, block, args, device)
        print(line, flush=True)
        lines.append(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
