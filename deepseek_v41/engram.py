"""Engram conditional memory (architecture.md §9.3): hashed n-gram table rows gated into every mHC stream.

Runs on the stream state before its block.  Hash ids come from ``engram_hashing`` (precomputed by the data
loader, or computed here from ``input_ids``); their constants (tokenizer compression map, multipliers,
primes, offsets) are non-persistent buffers derived from the tokenizer and the config, restored exactly
after meta-device materialization (``restore_derived_buffers``).  The table (``embed``, an ``EngramTable``)
can be held as the release stores it (FP8 rows, ``load_kept_table``) and/or in host memory
(``text_config.engram_device="cpu"``): see ``engram_host.py``.
"""

from pathlib import Path

import torch
from torch import nn

from .engram_hashing import (
    build_compression_map,
    engram_hash,
    engram_multipliers,
    engram_offsets,
    engram_primes,
)
from .engram_host import EngramTable, PrefetchedRows
from .layers import by_positions, make_linear

GATE_CLAMP = 1e-6  # |score| is clamped to at least this before its square root
# Without autograd (inference), the gate runs this many positions at a time: its fp32 temporaries are ~5 copies
# of the streams [b, s, hc, dim] (10.7 GB each at 128k tokens on one row), which a long prefill cannot hold at once
GATE_POSITIONS = 16384


class Engram(nn.Module):
    def __init__(self, config, layer: int, rows: int, constants: dict, backend: dict):
        super().__init__()
        self.layer = layer
        self.hc, self.dim = config.hc_mult, config.hidden_size
        self.max_ngram, self.n_heads = config.engram_max_ngram_size, config.engram_n_heads
        self.pad_id = config.engram_pad_token_id
        self.map_size = config.engram_compressed_vocab_size  # = cmap.max() + 1, checked by engram_constants
        self.eps = config.rms_norm_eps
        cols = (self.max_ngram - 1) * config.engram_n_heads
        self.embed = EngramTable(rows, config.engram_head_dim, on_host=getattr(config, "engram_device", None) == "cpu")
        self.wkv = make_linear(cols * config.engram_head_dim, (self.hc + 1) * self.dim, backend)
        # Only the product q_weight * k_weight is used; both are kept to match the released tensors.
        self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim))
        self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim))
        self.gate = engram_gate_tile_kernels if backend["engram"] == "tile_kernels" else engram_gate
        # Row-owner training replaces the local F.embedding lookup: hash ids [b, s, cols] -> rows [b, s, cols, d].
        self.table_lookup = None
        self._derived = {name: value.cpu() for name, value in constants.items()}
        # on the default device where that is a real one (a model built under torch.device("cuda") hashes on the GPU
        # without copying the constants over at every forward); under the meta device they stay filled on the host
        device = torch.get_default_device()
        for name, value in self._derived.items():
            self.register_buffer(name, value.to("cpu" if device.type == "meta" else device, copy=True), persistent=False)

    def restore_derived_buffers(self) -> None:
        """Re-fill the hash constants (garbage after ``to_empty``) from their host copies."""
        for name, value in self._derived.items():
            getattr(self, name).copy_(value)

    def hash(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None, on_host: bool = False) -> torch.Tensor:
        # input_ids [b, s] -> table rows [b, s, (max_ngram - 1) * n_heads]; on_host: with the constants' host copies
        # (input_ids on the host, the rows there: a host table's prefetch)
        c = self._derived if on_host else self._buffers
        return engram_hash(
            input_ids, c["cmap"], c["multipliers"], c["primes"], c["offsets"],
            max_ngram_size=self.max_ngram, pad_id=self.pad_id, image_mask=image_mask, map_size=self.map_size,
        )

    def load_kept_table(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """The table as the release stores it (the kept-format loader's hook): see ``EngramTable.load_kept_table``."""
        self.embed.load_kept_table(codes, scale)

    def keep_table_format(self, scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> None:
        """On the meta-device model, before materialization: hold the table as stored (``EngramTable.keep_format``)."""
        self.embed.keep_format(scale_dtype)

    def forward(self, x: torch.Tensor, hash_ids, image_mask: torch.Tensor | None) -> torch.Tensor:
        # x [b, s, hc, dim] streams, hash_ids [b, s, cols] (or this forward's PrefetchedRows) -> [b, s, hc, dim]
        if isinstance(hash_ids, PrefetchedRows):
            rows = hash_ids.wait()
        else:
            rows = self.embed(hash_ids) if self.table_lookup is None else self.table_lookup(hash_ids)
        dtype = self.wkv.weight.dtype
        if dtype.itemsize == 1:  # a kept FP8 wkv: its input is the activation dtype, the rows'
            dtype = rows.dtype
        kv = self.wkv(rows.flatten(2).to(dtype))  # [b, s, (hc + 1) * dim]
        return self.gate(x, kv, self.q_weight, self.k_weight, self.eps, image_mask)


def engram_gate(x, kv, q_weight, k_weight, eps: float, image_mask):
    """x [b, s, hc, dim] streams, kv [b, s, (hc + 1) * dim] (hc keys, then one value) -> [b, s, hc, dim]:
    x + sigmoid(signed_sqrt(<rms(x)·q_weight, rms(key)·k_weight> / sqrt(dim))) · value, in fp32, one rounding;
    the gate is closed (0) on image positions.  Each position's value depends on its own inputs only, so without
    autograd a long sequence goes ``GATE_POSITIONS`` at a time."""
    return by_positions(lambda x, kv, mask: _engram_gate(x, kv, q_weight, k_weight, eps, mask), x, kv, image_mask,
                        block=GATE_POSITIONS)


def _engram_gate(x, kv, q_weight, k_weight, eps: float, image_mask):
    hc, dim = x.shape[-2:]
    key = kv[..., : hc * dim].unflatten(-1, (hc, dim)).float()
    value = kv[..., hc * dim :].float()
    h = x.float()
    w = q_weight.float() * k_weight.float()  # [hc, dim]
    dot = (h * w * key).sum(-1)
    dot = dot * torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = dot * dim**-0.5  # [b, s, hc]
    gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=GATE_CLAMP).sqrt())
    if image_mask is not None:
        gate = gate.masked_fill(image_mask.unsqueeze(-1), 0.0)
    return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)


def engram_gate_tile_kernels(x, kv, q_weight, k_weight, eps: float, image_mask):
    """``engram_gate`` as tile-kernels' fused gate (backend ``engram: tile_kernels``; bf16 CUDA tensors)."""
    try:  # in try: an optional GPU dependency that remote-code loading must not require
        from tile_kernels.modeling.engram import engram_gate as fused_gate
    except ImportError as error:
        raise RuntimeError("engram backend 'tile_kernels' needs the package tile_kernels") from error

    if x.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16 or not x.is_cuda:
        raise TypeError(
            f"engram backend 'tile_kernels' needs bf16 CUDA streams and kv, got {x.dtype}/{kv.dtype} on {x.device}; "
            "use engram backend 'torch'"
        )
    mask = None if image_mask is None else image_mask.contiguous()
    return fused_gate(x.contiguous(), kv.contiguous(), q_weight, k_weight, GATE_CLAMP, eps, mask)


def read_tokenizer_file(path):
    """``tokenizers.Tokenizer`` of a tokenizer.json; a truncated or corrupted file is named in the error."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for unreadable JSON
        raise ValueError(f"{path} is not a readable tokenizer.json (truncated or corrupted? {error}); "
                         "re-download or re-save it") from error


def resolve_engram_tokenizer(config, tokenizer=None):
    """The fast tokenizer Engram's compression map is built from: the one given, else the checkpoint's
    (``config._name_or_path`` at its resolved revision ``config._commit_hash``)."""
    if tokenizer is not None:
        return tokenizer
    source = getattr(config, "_name_or_path", "") or ""
    layers = config.text_config.engram_layer_ids
    how = (
        "pass tokenizer=... (a fast tokenizer or tokenizers.Tokenizer) to from_pretrained / the model "
        "constructor, point config.name_or_path at a folder holding tokenizer.json, or disable Engram with "
        "text_config.engram_layer_ids=[]"
    )
    if not source:
        raise ValueError(f"Engram layers {layers} need the checkpoint's fast tokenizer to build the hash map; {how}")
    local = Path(source) / "tokenizer.json"
    if local.is_file():
        return read_tokenizer_file(local)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, revision=getattr(config, "_commit_hash", None))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"Engram layers {layers} need the checkpoint's fast tokenizer, and none could be loaded from "
            f"{source!r} ({error}); {how}"
        ) from error


def engram_constants(text_config, tokenizer) -> dict:
    """{layer: {cmap, multipliers, primes, offsets}} from the tokenizer and the config, checked against it."""
    cmap = build_compression_map(tokenizer)
    size = int(cmap.max()) + 1
    if size != text_config.engram_compressed_vocab_size:
        raise ValueError(
            f"the tokenizer's Engram compression map has {size} entries but the config says "
            f"engram_compressed_vocab_size={text_config.engram_compressed_vocab_size}: wrong tokenizer for this checkpoint"
        )
    primes = engram_primes(
        text_config.engram_layer_ids, text_config.engram_max_ngram_size, text_config.engram_n_heads,
        text_config.engram_vocab_size,
    )
    constants = {}
    for k, layer in enumerate(text_config.engram_layer_ids):
        rows = int(primes[layer].sum())
        if rows != text_config.engram_num_embeddings[k]:
            raise ValueError(
                f"Engram layer {layer}: the hash primes address {rows} rows but engram_num_embeddings[{k}] = "
                f"{text_config.engram_num_embeddings[k]}; engram_layer_ids, engram_n_heads, engram_vocab_size and "
                "engram_num_embeddings must describe the same tables"
            )
        constants[layer] = {
            "cmap": cmap,
            "multipliers": engram_multipliers(
                layer, text_config.engram_max_ngram_size, text_config.engram_compressed_vocab_size
            ),
            "primes": primes[layer],
            "offsets": engram_offsets(primes[layer]),
        }
    return constants
