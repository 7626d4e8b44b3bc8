"""Parity of deepseek_v41 with the official DeepSeek-V4.1-Flash inference code: same snapshot, same tokens.

    python conversion/compare_with_official.py --checkpoint SNAPSHOT --text "..." --seq-len 4096 \\
        [--inference-dir SNAPSHOT/inference] [--official-config CONFIG.json] [--official-arg KEY=JSON ...] \\
        [--dtype bf16|fp32] [--mode whole|streamed] [--device cuda|cpu] [--cpu-kernels] [--report out.json]

Both sides run one prefill (start_pos 0) of the same token ids; the official code is the reference.

* Official side: ``<inference-dir>/model.py`` is imported as the official generate script does (its folder
  first on ``sys.path``; ``--cpu-kernels`` first registers ``official_cpu_kernels`` as the module
  ``kernel``). ``ModelArgs`` is built from a json of its fields (``--official-config``, default: the one
  ``config*.json`` of the inference folder); ``--official-arg`` overrides fields (``dtype="bf16"`` and
  ``expert_dtype=null`` give the bf16-weight reference) and ``max_batch_size`` / ``max_seq_len`` grow to fit
  the input. Weights are loaded by name, since the released tensor names are the official module names:
  each ``Transformer.state_dict()`` entry gets the stored codes (FP8, packed FP4, UE8M0 scales, viewed as the
  entry's dtype) or, for a floating-point entry (bf16 weights, ``wo_a``, the fp32 head), the exactly decoded
  value. ``--official-loader MODULE:FUNCTION`` calls the official code's own loader as
  ``FUNCTION(model, checkpoint_dir)`` instead. The official ``forward`` returns last-position logits only, so
  a forward hook on ``Transformer.norm`` captures the head input at every position, and logits =
  ``hidden.float() @ head.weight.float().T`` (the snapshot's head); the returned logits are checked against
  that.
* Our side: ``AutoModelForCausalLM.from_pretrained(checkpoint, dtype)`` (``whole``) or block by block
  (``streamed``); the same head product.

``--mode streamed`` scales to the released model: one block in memory at a time on each side.
* Ours: the model is built on the meta device; embed / norm / head are materialized and loaded, then each
  block is materialized, loaded (``deepseek_v41.checkpoint``), run on the carried streams, pre-mix and
  ``CSA2State``, and sent back to meta. Engram tables are never materialized: only the rows the input
  hashes to are decoded.
* Official: ``Transformer(args)`` is built with every parameter swapped to the meta device as it is
  registered (buffers such as RoPE tables and caches stay real; ``Parameter`` objects keep their identity, so
  attributes like ``weight.scale`` stay valid). Everything outside ``layers`` is loaded up front; each
  ``layers[i]`` is materialized and loaded by a forward pre-hook and released by a forward hook.
  ASSUMPTION: the official ``forward`` runs embed → every ``layers[i]`` once, through ``__call__``, in order
  → ``norm`` → head, and a block's weights (its Engram table included) live under ``layers.{i}.``.

Metrics (``deepseek_v41.parity.logits_metrics``, reference = official): per-token KL(official ‖ ours) over
the full vocabulary (mean, p95, max), one global cosine in fp64, top-1 agreement, relative L2, max |Δ|. The
gates default to the V4.1 fixed gates (mean KL ≤ 1e-3, p95 KL ≤ 2e-3, cosine ≥ 0.999, top-1 ≥ 0.98); the exit
code is 1 when one fails. ``--report`` writes metrics, gates, failures, diagnostics and settings as JSON.

torch.distributed (optional, under ``torchrun``): every rank builds the official model (its code picks its
sharding from the process group) and feeds the same tokens, since tensor-parallel collectives need the same
shapes everywhere; a snapshot tensor ``world_size`` times larger than the entry along one dimension is
sliced to the rank's part. Our model runs on rank 0 only, which also captures the official hidden state
(replicated after the final norm), computes the metrics and writes the report.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from deepseek_v41.checkpoint import CheckpointError, ReleasedCheckpoint, load_checkpoint_into_model
from deepseek_v41.parity import GATES, gate_failures, logits_metrics

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Entry dtypes that hold stored codes (copied as bytes), never decoded values.
CODE_DTYPES = {
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.int8,
    torch.uint8,
}
# Official ModelArgs field -> released text_config field: both must describe the same model.
SHAPE_FIELDS = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "head_dim": "head_dim", "n_routed_experts": "n_routed_experts",
    "hc_mult": "hc_mult",
}
# Needed Engram rows further apart than this are read separately (a released table is ~100 GB).
ROW_GAP = 256


# ----------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------


def load_input_ids(opts, checkpoint_dir: Path) -> tuple[torch.Tensor, str]:
    """int64 [b, s] token ids and where they came from."""
    if opts.input_ids_file:
        path = opts.input_ids_file
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            ids = load_file(str(path))["input_ids"]
        else:
            ids = torch.tensor(json.loads(path.read_text()))
        ids = ids.long().reshape(-1, ids.shape[-1])
        if opts.seq_len:
            if ids.shape[1] < opts.seq_len:
                raise ValueError(f"{path} holds {ids.shape[1]} tokens per row, fewer than --seq-len "
                                 f"{opts.seq_len}")
            ids = ids[:, : opts.seq_len]
        return ids, str(path)
    from tokenizers import Tokenizer

    text = opts.text if opts.text is not None else opts.prompt_file.read_text()
    tokenizer = Tokenizer.from_file(str(checkpoint_dir / "tokenizer.json"))
    body = tokenizer.encode(text, add_special_tokens=False).ids
    if not body:
        raise ValueError("the prompt tokenizes to nothing: give a non-empty --text / --prompt-file")
    bos = json.loads((checkpoint_dir / "config.json").read_text()).get("bos_token_id", 0)
    head = [] if opts.no_bos else [bos]
    length = opts.seq_len or len(head) + len(body)
    # A passage shorter than --seq-len is repeated (the published 4,096-token run repeats a 145-token one).
    ids = (head + body * (1 + length // len(body)))[:length]
    return torch.tensor([ids]), "--text" if opts.text is not None else str(opts.prompt_file)


# ----------------------------------------------------------------------------------------------------
# Official code: import and ModelArgs
# ----------------------------------------------------------------------------------------------------


def cpu_kernels_module():
    """``conversion/official_cpu_kernels.py``, whether this file runs as a script or is imported."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.append(here)
    return importlib.import_module("official_cpu_kernels")


def import_official_model(inference_dir: Path, cpu_kernels: bool):
    """The official ``model.py``, imported fresh as the module ``model`` (its siblings resolve from its
    folder); with ``cpu_kernels`` the stand-ins are registered as ``kernel`` first."""
    model_py = inference_dir / "model.py"
    if not model_py.is_file():
        raise FileNotFoundError(f"{model_py} not found: point --inference-dir at the official inference/ "
                                "folder")
    if cpu_kernels:
        cpu_kernels_module().install()
    if str(inference_dir) not in sys.path:
        sys.path.insert(0, str(inference_dir))
    spec = importlib.util.spec_from_file_location("model", model_py)
    module = importlib.util.module_from_spec(spec)
    sys.modules["model"] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        hint = ("the CPU stand-ins (conversion/official_cpu_kernels.py) lack a name it imports: add it there"
                if cpu_kernels else "install its GPU dependencies (tilelang), or run with --cpu-kernels")
        raise ImportError(f"importing the official {model_py} failed ({error}); {hint}") from error
    for name in ("ModelArgs", "Transformer"):
        if not hasattr(module, name):
            raise AttributeError(f"{model_py} defines no {name}: not the official DeepSeek-V4.1 inference "
                                 "code")
    return module


def find_official_config(inference_dir: Path) -> Path:
    found = sorted(inference_dir.glob("config*.json"))
    if len(found) != 1:
        names = [p.name for p in found]
        raise FileNotFoundError(f"{len(found)} config*.json files in {inference_dir} ({names}): name the "
                                "ModelArgs json with --official-config")
    return found[0]


def parse_overrides(items: list[str]) -> dict:
    """``KEY=VALUE`` strings -> {KEY: json value}; a VALUE that is not json stays a string."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--official-arg {item!r}: expected KEY=VALUE, e.g. dtype=\"bf16\" or "
                             "expert_dtype=null")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def official_model_args(module, config_path: Path, overrides: dict, batch: int, seq: int, text_config: dict):
    """(``ModelArgs``, its fields): the json of its fields plus overrides, grown to hold [batch, seq], checked
    against the snapshot's text_config."""
    fields = {**json.loads(config_path.read_text()), **overrides}
    if dataclasses.is_dataclass(module.ModelArgs):
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(module.ModelArgs)})
        if unknown:
            raise ValueError(f"{config_path} / --official-arg set {unknown}, which the official ModelArgs "
                             "does not have: wrong config for this model.py")
    for key, needed in (("max_batch_size", batch), ("max_seq_len", seq)):  # the caches must hold the input
        current = fields.get(key, getattr(module.ModelArgs, key, None))  # else the dataclass default
        if isinstance(current, int) and current < needed:
            fields[key] = needed
    for official, released in SHAPE_FIELDS.items():
        if official in fields and released in text_config and fields[official] != text_config[released]:
            raise ValueError(f"official {official} = {fields[official]} but the snapshot's text_config."
                             f"{released} = {text_config[released]}: the ModelArgs json describes another "
                             "model")
    return module.ModelArgs(**fields), fields


# ----------------------------------------------------------------------------------------------------
# Official weights, by name from the snapshot
# ----------------------------------------------------------------------------------------------------


def rank_part(stored: tuple, target: tuple, rank: int, world: int, name: str) -> tuple[int | None, slice]:
    """(dim, slice) of the stored tensor this rank's entry holds: (None, everything) when the shapes agree,
    else the one dimension that is ``world`` times larger."""
    if tuple(stored) == tuple(target):
        return None, slice(None)
    differ = [d for d, (s, t) in enumerate(zip(stored, target)) if s != t]
    if len(stored) != len(target) or len(differ) != 1 or stored[differ[0]] != target[differ[0]] * world:
        raise CheckpointError(f"snapshot tensor {name!r} has shape {list(stored)} but the official entry has "
                              f"{list(target)} (world size {world}): not a {world}-way shard of it")
    d = differ[0]
    return d, slice(rank * target[d], (rank + 1) * target[d])


def _read(checkpoint: ReleasedCheckpoint, name: str, target: torch.Tensor, rows: slice | None):
    # rows of `name` in the form `target` holds: stored codes (viewed as its dtype) or decoded values
    stored = checkpoint.tensors.get(name)  # None for `.scale` tensors
    if target.dtype not in CODE_DTYPES and stored is not None and stored.fmt != "plain":
        return checkpoint.decode(name, rows, dtype=target.dtype)
    raw = checkpoint.read_raw(checkpoint.records[name], rows)
    if target.dtype not in CODE_DTYPES:
        return raw.to(target.dtype)
    if raw.dtype not in CODE_DTYPES or raw.element_size() != target.element_size():
        raise CheckpointError(f"snapshot tensor {name!r} is {raw.dtype} but the official entry holds "
                              f"{target.dtype} codes: the ModelArgs dtype settings do not match this "
                              "snapshot")
    return raw.view(target.dtype)


@torch.no_grad()
def load_released_tensors(targets: dict, checkpoint: ReleasedCheckpoint, rank: int = 0, world: int = 1):
    """Fill each ``{name: tensor}`` entry from the snapshot tensor of the same name, in row blocks
    (this rank's part of it under tensor parallelism)."""
    for name, target in targets.items():
        stored = checkpoint.tensors.get(name)
        codes = target.dtype in CODE_DTYPES or stored is None or stored.fmt == "plain"
        shape = checkpoint.records[name].shape if codes else stored.shape
        dim, part = rank_part(shape, tuple(target.shape), rank, world, name)
        if target.dim() == 0:
            target.copy_(_read(checkpoint, name, target, None).reshape(()))
            continue
        rows = range(*part.indices(shape[0])) if dim == 0 else range(shape[0])
        blocks = (checkpoint.row_slices(name, target.element_size(), rows) if stored is not None
                  else [slice(rows.start, rows.stop)])  # a `.scale` tensor: small, one read
        for block in blocks:
            value = _read(checkpoint, name, target, block)
            if dim not in (None, 0):
                value = value.narrow(dim, part.start, part.stop - part.start)
            target[block.start - rows.start : block.stop - rows.start].copy_(value)


def split_official_state(model: nn.Module, checkpoint: ReleasedCheckpoint) -> tuple[dict, dict]:
    """({name: entry} to load, diagnostics). Every parameter must be in the snapshot; buffers may be absent
    (caches, tables the constructor computes)."""
    state = model.state_dict(keep_vars=True)
    params = {name for name, _ in model.named_parameters()}
    missing = sorted(n for n in state if n not in checkpoint.records and n in params)
    if missing:
        raise CheckpointError(f"official parameter {missing[0]!r} ({len(missing)} in all) is not in the "
                              "snapshot: the snapshot and the official ModelArgs describe different models")
    unused = sorted(n for n in checkpoint.tensors if n not in state)
    info = {
        "loaded": sum(n in checkpoint.records for n in state),
        "official_buffers_not_in_snapshot": sorted(n for n in state if n not in checkpoint.records),
        "snapshot_tensors_unused": len(unused),
        "snapshot_tensors_unused_examples": unused[:5],
    }
    return {n: t for n, t in state.items() if n in checkpoint.records}, info


# ----------------------------------------------------------------------------------------------------
# Official model with meta placeholders (streamed mode)
# ----------------------------------------------------------------------------------------------------


def swap_parameter(param: nn.Parameter, device) -> None:
    """Move ``param`` to ``device`` (uninitialized), keeping its Python identity and attributes."""
    moved = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, moved)


@contextlib.contextmanager
def parameters_on_meta():
    """While active, every parameter registered on a module is swapped to the meta device right away."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and not param.is_meta:
            swap_parameter(param, "meta")

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


class OfficialStreamer:
    """Materializes and loads the official parameters of one name prefix at a time (model built under
    ``parameters_on_meta``); ``hook_layers`` does it around each ``layers[i]`` call."""

    def __init__(self, model: nn.Module, checkpoint: ReleasedCheckpoint, device, rank: int, world: int):
        self.model, self.checkpoint, self.device = model, checkpoint, device
        self.rank, self.world = rank, world
        self.targets, self.info = split_official_state(model, checkpoint)
        self.layer_runs = 0

    def load(self, prefix: str, exclude: str | None = None) -> None:
        def chosen(name):
            return name.startswith(prefix) and not (exclude and name.startswith(exclude))

        with torch.inference_mode(False), torch.no_grad():  # hooks run inside the official inference_mode
            for name, param in self.model.named_parameters():
                if chosen(name):
                    swap_parameter(param, self.device)
            targets = {name: t for name, t in self.targets.items() if chosen(name)}
            load_released_tensors(targets, self.checkpoint, self.rank, self.world)

    def release(self, module: nn.Module) -> None:
        with torch.inference_mode(False):
            for param in module.parameters():
                swap_parameter(param, "meta")

    def hook_layers(self) -> None:
        if not isinstance(getattr(self.model, "layers", None), (nn.ModuleList, nn.Sequential)):
            raise TypeError("the official Transformer has no `layers` ModuleList: use --mode whole")
        for i, layer in enumerate(self.model.layers):
            layer.register_forward_pre_hook(lambda module, args, i=i: self.load(f"layers.{i}."))
            layer.register_forward_hook(lambda module, args, out: self._ran(module))

    def _ran(self, layer: nn.Module) -> None:
        self.release(layer)
        self.layer_runs += 1


# ----------------------------------------------------------------------------------------------------
# The two runs
# ----------------------------------------------------------------------------------------------------


def head_logits(hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    # hidden [b, s, dim] -> fp32 logits [b, s, vocab] on the CPU (the golden README's definition)
    return (hidden.float() @ head_weight.float().to(hidden.device).T).cpu()


def run_official(opts, ids: torch.Tensor, checkpoint: ReleasedCheckpoint, rank: int, world: int) -> dict:
    """Official prefill: {hidden (norm output), returned (forward's value), args, load info, kernel calls}."""
    from deepseek_v41.modeling_deepseek_v41 import default_dtype

    module = import_official_model(opts.inference_dir, opts.cpu_kernels)
    text_config = (checkpoint.config or {}).get("text_config", checkpoint.config or {})
    args, fields = official_model_args(module, opts.official_config, parse_overrides(opts.official_arg),
                                       *ids.shape, text_config)
    dtype, streamed = DTYPES[opts.dtype], opts.mode == "streamed"
    placeholders = parameters_on_meta() if streamed else contextlib.nullcontext()
    with default_dtype(dtype), torch.device(opts.device), placeholders:
        model = module.Transformer(args)
    model.eval()
    if not isinstance(getattr(model, "norm", None), nn.Module):
        raise TypeError("the official Transformer has no `norm` module: its hidden states cannot be captured")
    captured = []
    model.norm.register_forward_hook(lambda m, a, out: captured.append(out.detach()))
    streamer = None
    if streamed:
        streamer = OfficialStreamer(model, checkpoint, opts.device, rank, world)
        streamer.load("", exclude="layers.")
        streamer.hook_layers()
        load_info = streamer.info
    elif opts.official_loader:
        module_name, _, function = opts.official_loader.partition(":")
        getattr(importlib.import_module(module_name), function)(model, str(opts.checkpoint))
        load_info = {"loader": opts.official_loader}
    else:
        targets, load_info = split_official_state(model, checkpoint)
        load_released_tensors(targets, checkpoint, rank, world)
    with default_dtype(dtype), torch.inference_mode():
        returned = model(ids.to(opts.device), start_pos=0)
    if streamer is not None and streamer.layer_runs != len(model.layers):
        raise RuntimeError(f"the official forward ran {streamer.layer_runs} of {len(model.layers)} layers "
                           "through their __call__: --mode streamed needs each called once; use --mode whole")
    if not captured:
        raise RuntimeError("the official forward never called Transformer.norm: its hidden state is unknown")
    kernels = cpu_kernels_module() if opts.cpu_kernels else None
    calls = {name: kernels.CALLS[name] for name in kernels.KERNELS} if kernels else None  # reset by install()
    return {"hidden": captured[-1], "returned": returned, "args": fields, "load": load_info,
            "kernel_calls": calls}


def load_our_modules(holder: nn.Module, checkpoint_dir: Path, device) -> None:
    """Materialize the modules under ``holder`` (attribute paths = released names) on ``device`` and load
    them from the snapshot."""
    from deepseek_v41.engram import Engram

    holder.to_empty(device=device)
    for module in holder.modules():
        if isinstance(module, Engram):  # its derived hash constants are garbage after to_empty
            module.restore_derived_buffers()
    report = load_checkpoint_into_model(holder, checkpoint_dir, strict=False)
    if report.missing:
        raise CheckpointError(f"{len(report.missing)} tensors missing from {checkpoint_dir}, "
                              f"e.g. {report.missing[:3]}")


def engram_rows_lookup(checkpoint: ReleasedCheckpoint, name: str, hash_ids: torch.Tensor, dtype, device):
    """An Engram ``table_lookup`` for hash ids [b, s, cols] that decodes only the table rows they address."""
    wanted = hash_ids.flatten().unique().cpu()  # sorted
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (wanted.diff() > ROW_GAP).nonzero().flatten() + 1])
    stops = torch.cat([starts[1:], torch.tensor([len(wanted)])])
    rows = []
    for start, stop in zip(starts.tolist(), stops.tolist()):
        first, last = int(wanted[start]), int(wanted[stop - 1])
        window = checkpoint.decode(name, slice(first, last + 1), dtype=dtype)
        rows.append(window[wanted[start:stop] - first])
    table, wanted = torch.cat(rows).to(device), wanted.to(device)
    return lambda ids: table[torch.searchsorted(wanted, ids)]  # -> [b, s, cols, engram_head_dim]


def _holder(**modules) -> nn.Module:
    holder = nn.Module()
    for name, module in modules.items():
        setattr(holder, name, module)
    return holder


@torch.no_grad()
def run_ours_streamed(checkpoint_dir: Path, ids: torch.Tensor, dtype, device):
    """(final hidden [b, s, dim], head weight [vocab, dim]) with one block materialized at a time."""
    from deepseek_v41.attention import CSA2State
    from deepseek_v41.configuration_deepseek_v41 import DeepseekV41Config
    from deepseek_v41.mhc import hc_pre
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype

    config = DeepseekV41Config.from_pretrained(checkpoint_dir)
    config._name_or_path = str(checkpoint_dir)  # Engram's tokenizer comes from the snapshot
    with torch.device("meta"), default_dtype(dtype):
        model = DeepseekV41ForCausalLM(config)
    checkpoint = ReleasedCheckpoint(checkpoint_dir)
    load_our_modules(_holder(embed=model.embed, norm=model.norm, head=model.head), checkpoint_dir, device)
    ids = ids.to(device)
    b, s = ids.shape
    h = model.embed(ids)  # [b, s, dim]
    x = h.unsqueeze(2).expand(b, s, model.hc, h.shape[-1]).contiguous()  # [b, s, hc, dim] streams
    pre = torch.zeros(b, s, model.hc, dtype=torch.float32, device=device)
    pre[..., 0] = 1.0  # block 0 collapses with a one-hot pre-mix on stream 0
    state = CSA2State()
    for i, block in enumerate(model.layers):
        if block.engram is not None:
            del block.engram.embed  # never materialized: engram_rows_lookup decodes the needed rows
        load_our_modules(_holder(layers=nn.ModuleDict({str(i): block})), checkpoint_dir, device)
        if block.engram is not None:
            block.engram.table_lookup = engram_rows_lookup(
                checkpoint, f"layers.{i}.engram.embed.weight", block.engram.hash(ids, None), dtype, device)
        x, pre = block(x, pre, state, input_ids=ids, image_mask=None)
        block.to_empty(device="meta")
    return model.norm(hc_pre(x, pre)), model.head.weight


@torch.no_grad()
def run_ours_whole(checkpoint_dir: Path, ids: torch.Tensor, dtype, device):
    """(final hidden [b, s, dim], head weight [vocab, dim]) of the model loaded the public way."""
    from transformers import AutoModelForCausalLM

    import deepseek_v41  # noqa: F401  (registers the Auto classes)
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41Model

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype, device=device)
    hidden = DeepseekV41Model.forward(model, input_ids=ids.to(device)).last_hidden_state  # the head input
    return hidden, model.head.weight


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    gates = GATES["bf16"]  # the V4.1 fixed gates
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=os.environ.get("DS41_CHECKPOINT"),
                   help="released snapshot folder (default: $DS41_CHECKPOINT)")
    p.add_argument("--inference-dir", type=Path,
                   help="official inference/ folder (default: <checkpoint>/inference)")
    p.add_argument("--official-config", type=Path,
                   help="json of ModelArgs fields (default: the config*.json of the inference folder)")
    p.add_argument("--official-arg", action="append", default=[], metavar="KEY=JSON",
                   help="override a ModelArgs field, e.g. dtype=\"bf16\" or expert_dtype=null (repeatable)")
    p.add_argument("--official-loader", metavar="MODULE:FUNCTION",
                   help="the official code's own loader, called as FUNCTION(model, checkpoint_dir) "
                        "(whole mode)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="prompt text (the snapshot's tokenizer, BOS first)")
    source.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    source.add_argument("--input-ids-file", type=Path,
                        help="token ids: json [s] or [b, s], or a safetensors file with `input_ids`")
    p.add_argument("--seq-len", type=int,
                   help="tokens per row (a text is repeated to fill; ids are truncated)")
    p.add_argument("--no-bos", action="store_true", help="no BOS token before --text / --prompt-file")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="our model's dtype and the official default dtype")
    p.add_argument("--mode", choices=["whole", "streamed"], default="whole")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cpu-kernels", action="store_true",
                   help="run the official code on our pure-PyTorch kernel stand-ins "
                        "(conversion/official_cpu_kernels.py)")
    p.add_argument("--max-mean-kl", type=float, default=gates["mean_kl"])
    p.add_argument("--max-p95-kl", type=float, default=gates["p95_kl"])
    p.add_argument("--min-cosine", type=float, default=gates["cosine"])
    p.add_argument("--min-top1", type=float, default=gates["top1"])
    p.add_argument("--report", type=Path, help="write the JSON report here")
    return p


def resolve_paths(opts) -> None:
    if opts.checkpoint is None:
        raise SystemExit("--checkpoint (or $DS41_CHECKPOINT) is required: the released snapshot folder")
    opts.checkpoint = opts.checkpoint.resolve()
    opts.inference_dir = (opts.inference_dir or opts.checkpoint / "inference").resolve()
    opts.official_config = opts.official_config or find_official_config(opts.inference_dir)
    if opts.official_loader and opts.mode == "streamed":
        raise SystemExit("--official-loader loads the whole model: use it with --mode whole")


def distributed(device: str) -> tuple[int, int]:
    """(rank, world size); starts the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), world


def returned_max_abs_diff(returned, reference: torch.Tensor) -> float | None:
    """Max |official forward's return - logits of the captured hidden state| (last position, or every
    position if it returned them all); None when the return has neither shape."""
    returned = torch.as_tensor(returned).float().cpu()
    for expected in (reference[:, -1], reference):
        if returned.numel() == expected.numel():
            return (returned.reshape(expected.shape) - expected).abs().max().item()
    return None


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    resolve_paths(opts)
    rank, world = distributed(opts.device)
    checkpoint = ReleasedCheckpoint(opts.checkpoint)
    ids, source = load_input_ids(opts, opts.checkpoint)
    official = run_official(opts, ids, checkpoint, rank, world)
    gc.collect()  # the official model is gone: free its memory before ours is built
    if opts.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if rank != 0:
        return 0
    hidden, positions = official["hidden"], "all"
    if hidden.dim() == 2:  # the official code kept only the last position before its norm
        hidden, positions = hidden.unsqueeze(1), "last"
    reference = head_logits(hidden, checkpoint.decode("head.weight", dtype=torch.float32))
    run_ours = run_ours_streamed if opts.mode == "streamed" else run_ours_whole
    ours_hidden, ours_head = run_ours(opts.checkpoint, ids, DTYPES[opts.dtype], opts.device)
    if positions == "last":
        ours_hidden = ours_hidden[:, -1:]
    candidate = head_logits(ours_hidden, ours_head)

    metrics = logits_metrics(reference, candidate)
    gates = {"mean_kl": opts.max_mean_kl, "p95_kl": opts.max_p95_kl, "cosine": opts.min_cosine,
             "top1": opts.min_top1}
    failures = gate_failures(metrics, gates)
    hidden, ours_hidden = hidden.float().cpu(), ours_hidden.float().cpu()
    report = {
        "passed": not failures,
        "failures": failures,
        "metrics": metrics,
        "gates": gates,
        "diagnostics": {
            "positions": positions,
            "hidden_rel_l2": ((ours_hidden - hidden).norm() / hidden.norm()).item(),
            "official_return_max_abs_diff": returned_max_abs_diff(official["returned"], reference),
            "kernel_calls": official["kernel_calls"],
            "official_load": official["load"],
        },
        "settings": {
            "checkpoint": str(opts.checkpoint), "inference_dir": str(opts.inference_dir),
            "official_config": str(opts.official_config), "official_args": official["args"],
            "mode": opts.mode, "dtype": opts.dtype, "device": opts.device, "cpu_kernels": opts.cpu_kernels,
            "input": source, "batch": ids.shape[0], "seq_len": ids.shape[1], "world_size": world,
        },
    }
    text = json.dumps(report, indent=2, default=str)
    if opts.report:
        opts.report.write_text(text + "\n")
    print(text)
    print("PASS" if not failures else f"FAIL: {'; '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
