"""The released formats kept in memory: FP8 block-scaled linears and FP4 routed experts hold the snapshot's bytes.

``from_pretrained`` of a quantized snapshot (one with a ``quantization_config``) replaces, on the meta-device
model and before anything is allocated, every module whose weight the snapshot stores quantized by its kept
counterpart here, and the loader then copies the stored bytes into them shard by shard (``checkpoint.py``):

* ``KeptFp8Linear``: ``weight`` F8_E4M3 [out, in] and ``scale`` [ceil(out/32), ceil(in/32)] (UE8M0, or F32 in
  older releases), both buffers under the released names ``X.weight`` / ``X.scale``;
* ``KeptFp4Experts``: the routed experts of a layer as packed E2M1 codes ``w1`` / ``w3`` int8 [E, inter, dim/2],
  ``w2`` [E, dim, inter/2] plus ``w1_scale`` ... [E, out, in/32], stacked for grouped GEMMs and shown in
  ``state_dict()`` under the released per-expert names ``...experts.{e}.w1.weight`` / ``.scale``.

Engram tables (FP8 rows) are held by the Engram module's ``EngramTable`` (``engram_host.py``): here they are
put in the kept format too (``Engram.keep_table_format``, empty E4M3 codes and scales on the meta model, so no
floating-point table is ever allocated) and the loader hands them their stored codes and scales
(``Engram.load_kept_table``). An Engram module without those hooks keeps its table and ``wkv`` dequantized.

Forward: on a CUDA GPU with FP8 (sm_89+), ``kernels_quantized.fp8_linear`` / ``fp4_grouped_experts`` compute on
the stored formats. Elsewhere the fallback decodes one tile of weight rows at a time (all of K, ``TILE_BYTES`` of
output) into a small buffer of the activation dtype and multiplies: decoding is exact and every output element
is the same K-long dot product as with the whole decoded weight, so the result equals the dequantizing load's.

A kept model is for inference: training it (a forward in train mode with autograd on) or ``requires_grad`` on a
kept tensor is refused; load with ``dequantize_base_checkpoint=True`` to train.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .engram_host import EngramTable
from .moe import (
    RoutedExperts,
    combine_top_k,
    dispatch_top_k,
    fused_weighted_swiglu,
    sort_by_expert,
    weighted_swiglu,
)
from .release_format import ceil_div, decode_fp4_packed, decode_fp8_row_scaled, take_rows

logger = logging.getLogger(__name__)

# Decoded bytes of one weight tile in the fallback: big enough for an efficient GEMM, small beside the weight.
TILE_BYTES = 8 << 20
KEPT_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu)

TRAINING_REFUSED = ("{what}: this model holds the released FP8/FP4 weights as stored (kept formats, for inference); "
                    "to train or fine-tune, load it with from_pretrained(..., dequantize_base_checkpoint=True), "
                    "which decodes them exactly to floating point")


# ----------------------------------------------------------------------------------------------------
# Kept tensors: buffers that refuse gradients
# ----------------------------------------------------------------------------------------------------


class KeptTensor(torch.Tensor):
    """A stored FP8/FP4 code or scale tensor. Operations on it return plain tensors; asking it for gradients
    raises (a code tensor cannot be trained)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def requires_grad_(self, requires_grad: bool = True):
        if requires_grad:
            raise RuntimeError(TRAINING_REFUSED.format(what="requires_grad on a kept FP8/FP4 tensor"))
        return self

    @property
    def requires_grad(self) -> bool:
        return torch._C.TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = self.detach().clone().as_subclass(type(self))
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return _rebuild_kept, (self.detach().as_subclass(torch.Tensor),)


def _rebuild_kept(tensor: torch.Tensor) -> KeptTensor:
    return tensor.as_subclass(KeptTensor)


class _KeptBuffers(dict):
    # A module's ``_buffers``: every tensor put in (registration, .to()/to_empty, meta materialization) is kept a
    # KeptTensor, so no path hands out a code tensor that would accept requires_grad
    def __setitem__(self, name, value):
        if value is not None and not isinstance(value, KeptTensor):
            value = value.as_subclass(KeptTensor)
        super().__setitem__(name, value)


def _refuse_training(module: nn.Module) -> None:
    if module.training and torch.is_grad_enabled():
        raise RuntimeError(TRAINING_REFUSED.format(
            what=f"a training forward through {type(module).__name__} (train mode with autograd on)"))


def _keep_dtypes(fn):
    # ``module._apply`` function that moves kept tensors but never casts them: model.to(torch.bfloat16), .float(),
    # .half() would turn FP8 codes and UE8M0 scales (floating dtypes to torch) into the numbers they encode
    def apply(t):
        probe = fn(t.new_empty(0))
        return fn(t) if probe.dtype == t.dtype else t.to(device=probe.device)
    return apply


class _KeptModule(nn.Module):
    def __init__(self):
        super().__init__()
        self._buffers = _KeptBuffers()

    def requires_grad_(self, requires_grad: bool = True):
        if requires_grad:
            raise RuntimeError(TRAINING_REFUSED.format(what=f"requires_grad_ on {type(self).__name__}"))
        return self

    def _apply(self, fn, recurse=True):
        return super()._apply(_keep_dtypes(fn), recurse)


# ----------------------------------------------------------------------------------------------------
# Quantized GEMMs: the GPU kernels, or the tile-by-tile fallback
# ----------------------------------------------------------------------------------------------------

_kernels = None  # the kernels_quantized module, False when it does not import, None before the first try
_kernels_error = ""
_fallback_logged = False


def quantized_kernels(x: torch.Tensor):
    """``kernels_quantized`` where its FP8/FP4 GEMMs run for ``x`` (bf16 on a CUDA device with FP8, sm_89+, with
    the module importable), else None: the tile-by-tile fallback (also for fp32 activations: a model loaded in
    fp32 computes in fp32). On a CUDA GPU where the kernels cannot run, logs once that the fallback is used."""
    global _kernels, _kernels_error, _fallback_logged
    if x.device.type != "cuda":
        return None
    if _kernels is None:
        try:  # optional (Triton), imported so that remote-code exports do not require it
            from . import kernels_quantized

            _kernels = kernels_quantized
        except ImportError as error:
            _kernels, _kernels_error = False, f"deepseek_v41.kernels_quantized does not import ({error})"
    if _kernels and _kernels.quantized_gemm_usable(x):
        return _kernels if x.dtype == torch.bfloat16 else None
    if not _fallback_logged:
        _fallback_logged = True
        major, minor = torch.cuda.get_device_capability(x.device)
        reason = _kernels_error or (f"{torch.cuda.get_device_name(x.device)} (sm_{major}{minor}) cannot run the "
                                    "FP8/FP4 kernels (they need FP8 tensor cores, sm_89+, and Triton)")
        logger.warning("kept FP8/FP4 weights: %s; using the tile-by-tile fallback (one weight tile at a time is "
                       "decoded to %s for a dense GEMM: correct, slower)", reason, x.dtype)
    return None


def _tile_rows(in_features: int, element_size: int, align: int = 1) -> int:
    rows = max(1, TILE_BYTES // max(1, in_features * element_size))
    return max(align, rows // align * align)


def fp8_linear_tiled(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int] = (32, 32)) -> torch.Tensor:
    """x [..., in] @ W.T -> [..., out] in x.dtype, W decoded from FP8 ``weight`` [out, in] and block ``scale``
    [ceil(out/bo), ceil(in/bi)] one tile of output rows (all of K) at a time into a reused buffer."""
    out_features, in_features = weight.shape
    bo, bi = block
    x2 = x.reshape(-1, in_features)
    y = x2.new_empty(x2.shape[0], out_features)
    step = min(_tile_rows(in_features, x.element_size(), bo), out_features)
    buffer = torch.empty(step, in_features, dtype=x.dtype, device=x.device)
    block_of_row = torch.arange(out_features, device=weight.device) // bo
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        tile = buffer[: stop - start]
        # the loader checked the scales once: no host read here (a captured decode step cannot read back)
        decode_fp8_row_scaled(weight[start:stop], take_rows(scale, block_of_row[start:stop]), bi, x.dtype, tile,
                              check=False)
        y[:, start:stop] = torch.mm(x2, tile.t())
    return y.view(*x.shape[:-1], out_features)


def fp4_linear_tiled(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x [m, in] @ W.T -> [m, out] in x.dtype, W decoded from packed E2M1 ``packed`` [out, in/2] and ``scale``
    [out, ceil(in/group)] one tile of output rows at a time."""
    out_features, in_features = packed.shape[0], 2 * packed.shape[1]
    y = x.new_empty(x.shape[0], out_features)
    step = min(_tile_rows(in_features, x.element_size()), out_features)
    buffer = torch.empty(step, in_features, dtype=x.dtype, device=x.device)
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        tile = buffer[: stop - start]
        decode_fp4_packed(packed[start:stop], scale[start:stop], group, out=tile, check=False)
        y[:, start:stop] = torch.mm(x, tile.t())
    return y


# ----------------------------------------------------------------------------------------------------
# Kept modules
# ----------------------------------------------------------------------------------------------------


class KeptFp8Linear(_KeptModule):
    """y = x · Wᵀ with W held as the release stores it: ``weight`` F8_E4M3 [out, in], ``scale`` [ceil(out/32),
    ceil(in/32)] UE8M0 (or F32). Not an ``nn.Linear``: PEFT's ``all-linear`` leaves it alone."""

    def __init__(self, in_features: int, out_features: int, scale_dtype: torch.dtype = torch.float8_e8m0fnu,
                 block: tuple[int, int] = (32, 32)):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        grid = (ceil_div(out_features, block[0]), ceil_div(in_features, block[1]))
        self.register_buffer("scale", torch.empty(grid, dtype=scale_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _refuse_training(self)
        kernels = quantized_kernels(x)
        if kernels is not None and self.block == (32, 32):
            return kernels.fp8_linear(x, self.weight, self.scale)
        return fp8_linear_tiled(x, self.weight, self.scale, self.block)

    def grouped_forward(self, o: torch.Tensor, groups: int) -> torch.Tensor:
        """Block-diagonal product (attention's ``wo_a``): o [n, groups, d] -> [n, groups·r], group g through rows
        g·r..(g+1)·r. Each group's rows are whole scale blocks when r is a multiple of the block (the release:
        r = 1024); otherwise every group goes through all rows and keeps its own block (the diagonal).
        The activations are not quantized: the official code decodes ``wo_a`` to bf16 at conversion and
        multiplies in bf16.  On an FP8 GPU one grouped kernel reads the stored weight (``fp8_block_diagonal_linear``,
        bf16 activations); elsewhere the tile-by-tile product."""
        _refuse_training(self)
        r = self.out_features // groups
        kernels = quantized_kernels(o)
        if kernels is not None and self.block == (32, 32) and r % self.block[0] == 0:
            return kernels.fp8_block_diagonal_linear(o, self.weight, self.scale)
        if r % self.block[0]:
            y = fp8_linear_tiled(o, self.weight, self.scale, self.block).unflatten(-1, (groups, r))
            return y.diagonal(dim1=1, dim2=2).transpose(1, 2).flatten(1)
        blocks = r // self.block[0]
        y = o.new_empty(o.shape[0], groups, r)
        for g in range(groups):
            weight = self.weight[g * r:(g + 1) * r]
            scale = self.scale[g * blocks:(g + 1) * blocks]
            y[:, g] = fp8_linear_tiled(o[:, g], weight, scale, self.block)
        return y.view(o.shape[0], -1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, FP8 E4M3 with "
                f"{self.block[0]}x{self.block[1]} {self.scale.dtype} block scales (kept release format)")


_PROJECTIONS = ("w1", "w2", "w3")


class KeptFp4Experts(RoutedExperts):
    """The routed experts of a layer as the release stores them: packed E2M1 codes (two per byte, low nibble
    first) ``w1`` / ``w3`` int8 [E, inter, dim/2], ``w2`` [E, dim, inter/2] and per-32 scales ``w1_scale`` ...
    [E, out, in/32]. ``state_dict()`` names them per expert as the release does (``{e}.w1.weight`` /
    ``{e}.w1.scale``); ``load_state_dict`` takes those names."""

    def __init__(self, config, backend: dict, scale_dtype: torch.dtype = torch.float8_e8m0fnu, group: int = 32):
        nn.Module.__init__(self)
        self._buffers = _KeptBuffers()
        n, dim, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.n_experts, self.expert_offset, self.limit, self.group = n, 0, config.swiglu_limit, group
        self.grouped, self.dispatcher = backend["experts"] == "torch_mm", None
        for proj, (out, k) in zip(_PROJECTIONS, ((inter, dim), (dim, inter), (inter, dim))):
            if k % 2:
                raise ValueError(f"FP4 experts pack two columns per byte: {proj} has {k} columns")
            self.register_buffer(proj, torch.empty(n, out, k // 2, dtype=torch.int8))
            self.register_buffer(f"{proj}_scale", torch.empty(n, out, ceil_div(k, group), dtype=scale_dtype))
        self.register_state_dict_post_hook(_released_expert_names)
        self.register_load_state_dict_pre_hook(_stacked_expert_names)

    def requires_grad_(self, requires_grad: bool = True):
        return _KeptModule.requires_grad_(self, requires_grad)

    def _apply(self, fn, recurse=True):
        return super()._apply(_keep_dtypes(fn), recurse)

    def forward(self, x, expert_ids, weights, shared=None) -> torch.Tensor:
        # RoutedExperts.forward; where the experts run on the wgmma kernel, x [n, dim] is quantized (FP8 values in
        # the kernel's column order) before its rows are copied to their k experts: k times fewer rows to quantize
        kernels = quantized_kernels(x)
        if (self.dispatcher is not None or kernels is None
                or not kernels.fp4_experts_on_wgmma(x, expert_ids.numel(), self.w1, self.w1_scale, self.w2_scale)):
            return super().forward(x, expert_ids, weights, shared)
        _refuse_training(self)
        n, k = expert_ids.shape
        order, counts = sort_by_expert(expert_ids, self.n_experts)
        y = kernels.fp4_grouped_experts(dispatch_top_k(kernels.quantize_for_wgmma(x), order, k), counts,
                                        weights.flatten()[order], self.w1, self.w1_scale, self.w3, self.w3_scale,
                                        self.w2, self.w2_scale, self.limit, x_quantized=True)
        return combine_top_k(y, order, n, k, shared)

    def grouped_forward(self, x: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x [m, dim] sorted by expert, counts [E], weights fp32 [m] -> [m, dim] in x.dtype
        _refuse_training(self)
        kernels = quantized_kernels(x)
        if kernels is not None:
            return kernels.fp4_grouped_experts(x, counts, weights, self.w1, self.w1_scale, self.w3, self.w3_scale,
                                               self.w2, self.w2_scale, self.limit)
        y = x.new_empty(x.shape[0], self.w2.shape[1])
        swiglu = fused_weighted_swiglu if self.grouped else weighted_swiglu  # as the dequantized model's path
        start = 0
        for e, count in enumerate(counts.tolist()):  # only the experts that got tokens are decoded
            if count:
                rows = slice(start, start + count)
                gate = fp4_linear_tiled(x[rows], self.w1[e], self.w1_scale[e], self.group)
                up = fp4_linear_tiled(x[rows], self.w3[e], self.w3_scale[e], self.group)
                h = swiglu(gate, up, weights[rows], self.limit)
                y[rows] = fp4_linear_tiled(h, self.w2[e], self.w2_scale[e], self.group)
            start += count
        return y

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, packed FP4 E2M1 with per-{self.group} {self.w1_scale.dtype} scales "
                "(kept release format)")


def _released_expert_names(module, state_dict, prefix, local_metadata) -> None:
    # stacked w1 [E, ...] and w1_scale -> released {prefix}{e}.w1.weight / {prefix}{e}.w1.scale (views)
    for proj in _PROJECTIONS:
        codes, scales = state_dict.pop(prefix + proj), state_dict.pop(f"{prefix}{proj}_scale")
        for e in range(codes.shape[0]):
            state_dict[f"{prefix}{e}.{proj}.weight"] = codes[e]
            state_dict[f"{prefix}{e}.{proj}.scale"] = scales[e]


def _stacked_expert_names(module, state_dict, prefix, *args) -> None:
    # released per-expert names -> the stacked buffers (copied into their rows), which then stand as loaded
    for proj in _PROJECTIONS:
        for suffix, stacked in (("weight", getattr(module, proj)), ("scale", getattr(module, f"{proj}_scale"))):
            found = False
            for e in range(stacked.shape[0]):
                key = f"{prefix}{e}.{proj}.{suffix}"
                if key in state_dict:
                    with torch.no_grad():
                        stacked[e].copy_(state_dict.pop(key))
                    found = True
            if found:
                state_dict[prefix + (proj if suffix == "weight" else f"{proj}_scale")] = stacked


# ----------------------------------------------------------------------------------------------------
# Building a kept model
# ----------------------------------------------------------------------------------------------------


def is_kept(model: nn.Module) -> bool:
    """Whether ``model`` holds kept (stored-format) weights: FP8 linears (the Engram ``wkv`` among them), FP4
    experts or Engram tables held as stored. Such a model saves in the released format and cannot be trained."""
    return any(isinstance(m, (KeptFp8Linear, KeptFp4Experts)) or (isinstance(m, EngramTable) and m.kept)
               for m in model.modules())


def engram_keeps_formats(engram: nn.Module) -> bool:
    """Whether an Engram module holds its table as stored (``keep_table_format`` before materialization,
    ``load_kept_table`` at load); without both its table and its ``wkv`` (whose weight dtype it casts the
    looked-up rows to) stay dequantized in a kept model."""
    return hasattr(engram, "load_kept_table") and hasattr(engram, "keep_table_format")


def held_dequantized(model: nn.Module, name: str) -> bool:
    """Whether released quantized tensor ``name`` is deliberately held dequantized in a kept model (an Engram
    table or Engram ``wkv`` of an Engram module that does not keep formats)."""
    for suffix in (".embed.weight", ".wkv.weight"):
        if name.endswith(suffix) and ".engram." in name:
            try:
                engram = model.get_submodule(name.removesuffix(suffix))
            except AttributeError:  # not in this model: the loader's plan names it
                return False
            return not engram_keeps_formats(engram)
    return False


def keep_release_formats(model: nn.Module, checkpoint) -> list[str]:
    """Replace, in the meta-device ``model`` before it is materialized, each module whose weight ``checkpoint``
    (a ``ReleasedCheckpoint``) stores as FP8 blocks or packed FP4 experts by its kept counterpart, and puts each
    Engram table the checkpoint stores as FP8 rows in its stored format (``Engram.keep_table_format``), so no
    floating-point copy of those weights is ever allocated. Returns the replaced (or re-held) module names."""
    modules = dict(model.named_modules())
    replaced, experts = [], {}
    for name, stored in checkpoint.tensors.items():
        if stored.fmt == "fp8_rows":  # layers.{i}.engram.embed.weight
            engram_name = name.removesuffix(".embed.weight")
            engram = modules.get(engram_name)
            if engram is None or held_dequantized(model, name):
                continue  # not in this model (the strict plan names it), or an Engram without kept tables
            table = engram.embed
            if (table.num_embeddings, table.embedding_dim) != tuple(stored.shape):
                raise ValueError(f"{engram_name}.embed [{table.num_embeddings}, {table.embedding_dim}] cannot hold "
                                 f"the Engram table {name!r} {list(stored.shape)}: build the model from this "
                                 "checkpoint's config")
            engram.keep_table_format(_scale_dtype(stored))
            replaced.append(engram_name + ".embed")
        elif stored.fmt == "fp8_block":
            module_name = name.removesuffix(".weight")
            module = modules.get(module_name)
            if module is None or held_dequantized(model, name):
                continue  # not in this model (the strict plan names it), or deliberately dequantized
            weight = getattr(module, "weight", None)
            if weight is None or tuple(weight.shape) != tuple(stored.shape) or getattr(module, "bias", None) is not None:
                raise ValueError(f"{module_name} ({type(module).__name__}) cannot hold the FP8 weight {name!r} "
                                 f"{list(stored.shape)}: expected a bias-free linear of that shape")
            with torch.device(weight.device):
                kept = KeptFp8Linear(stored.shape[1], stored.shape[0], _scale_dtype(stored), checkpoint.block)
            model.set_submodule(module_name, kept)
            replaced.append(module_name)
        elif stored.fmt == "fp4":
            prefix = name.rsplit(".", 3)[0]  # layers.{i}.ffn.experts
            experts.setdefault(prefix, set()).add(_scale_dtype(stored))
    for prefix, scale_dtypes in experts.items():
        module = modules.get(prefix)
        if not isinstance(module, RoutedExperts):
            continue
        if len(scale_dtypes) > 1:
            raise ValueError(f"the routed experts of {prefix} store scales in several dtypes {sorted(map(str, scale_dtypes))}:"
                             " load with dequantize_base_checkpoint=True")
        with torch.device(module.w1.device):
            kept = KeptFp4Experts(_ExpertSizes(module), {"experts": "torch_mm" if module.grouped else "torch"},
                                  scale_dtypes.pop(), checkpoint.group)
        model.set_submodule(prefix, kept)
        replaced.append(prefix)
    return replaced


class _ExpertSizes:
    # the sizes of the experts being replaced, read off the module (a DSpark stage's may differ from the backbone's)
    def __init__(self, module: RoutedExperts):
        self.n_routed_experts, self.moe_intermediate_size, self.hidden_size = module.w1.shape
        self.swiglu_limit = module.limit


def _scale_dtype(stored) -> torch.dtype:
    from .checkpoint import SAFETENSORS_DTYPES

    return SAFETENSORS_DTYPES[stored.scale.dtype]
