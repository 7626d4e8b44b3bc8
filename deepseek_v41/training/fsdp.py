"""FSDP2 wrapping of DeepSeek-V4.1: dtype-pure units, fp32 islands, the fp32 head, activation checkpointing.

FSDP2 all-gathers a unit as one flat group, so a unit must hold a single parameter dtype
(training_recipe.md §3).  The bf16 units use ``MixedPrecisionPolicy(bf16, fp32, None, False)``: no
output or input casts, because mHC hands fp32 coefficients across module boundaries.  Units, per block:

* ``attn.compressor.wkv`` / ``wgate`` of ratio-2 layers: fp32 islands, one unit each;
* ``attn``: bf16 (``Attention.forward`` reads ``wo_a.weight`` directly, so all of attention's bf16 weights
  must be gathered together).  ``attn.attn_sink`` (fp32, ``n_heads`` values) is therefore left out of the
  unit and replicated; its gradient is averaged with one all-reduce (``replicated_params``);
* ``attn_norm``, ``ffn_norm``, ``engram`` (table excluded) and ``ffn`` (routed experts excluded): bf16;
* the block itself: the fp32 mHC ``hc_*`` island.

The DSpark draft stages (``mtp.*``, present when the recipe trains them: ``model.dspark_loss_weight``) are
wrapped like blocks, their routed experts EP-sharded like the backbone's, plus their own modules
(``shard_stage_extras``).

At the root, ``embed`` and ``norm`` are bf16 units and the root unit holds only ``head.weight`` with
``MixedPrecisionPolicy(fp32, fp32, fp32)``: the fp32 LM head as its own unit (``lm_head_precision``).
Engram tables (row owners) are ``ignored_params`` everywhere, and so are the routed experts (EP-sharded on
dim 0 over ``ep``) unless ``ep_shard > 1``: then each layer's expert block ``[E_local, ...]`` is its own bf16
unit on the ``ep_shard`` mesh (``expert_mesh``), dim-0 sharded (``E_local / ep_shard`` experts per rank at
rest), gathered for the forward and reduce-scattered in fp32 as a *sum*: an expert's gradient on its EP
rank is already a sum over the EP group's tokens (all-to-all backward), summed over ``ep_shard`` it is the
sum over every rank's, divided by ``W`` once with the other summed gradients (``loop.average_summed_gradients``).

Activation checkpointing wraps each block's forward (non-reentrant).  Recomputation reproduces routing and
the CSA2 top-k because both are deterministic functions of the block's saved inputs and the per-forward,
immutable ``CSA2State``.  (A selective policy saving every ``topk`` is not usable here: the bf16 units
nested inside a block run FSDP hooks during recompute, which selective checkpointing rejects.)
"""

import functools

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from deepseek_v41.training.expert_parallel import routed_expert_modules

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _policies(fsdp_cfg: dict, lm_head_precision: str) -> dict:
    reduce = _DTYPES[fsdp_cfg["reduce_dtype"]]
    head = _DTYPES[lm_head_precision]
    return {
        "bf16": MixedPrecisionPolicy(param_dtype=_DTYPES[fsdp_cfg["param_dtype"]], reduce_dtype=reduce,
                                     output_dtype=None, cast_forward_inputs=False),
        "fp32": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                     output_dtype=None, cast_forward_inputs=False),
        "head": MixedPrecisionPolicy(param_dtype=head, reduce_dtype=head, output_dtype=head,
                                     cast_forward_inputs=False),
    }


def checkpoint_block(block: nn.Module) -> None:
    """Replace ``block.forward`` by a non-reentrant checkpoint of itself (names and hooks unchanged)."""
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


def shard_expert_block(experts: nn.Module, expert_mesh, fsdp_cfg: dict, policy: MixedPrecisionPolicy) -> None:
    """One layer's routed experts as an FSDP2 unit over ``expert_mesh`` (``ep_shard``), gradients summed over it."""
    fully_shard(experts, mesh=expert_mesh, reshard_after_forward=fsdp_cfg["reshard_after_forward"], mp_policy=policy)
    experts.set_gradient_divide_factor(1.0)
    experts.set_force_sum_reduction_for_comms(True)  # a plain SUM (no PREMUL_SUM: gloo has none)


def trained_blocks(model: nn.Module) -> list:
    """The backbone's blocks, then the DSpark stages when the model trains them (``model.dspark_loss_weight``)."""
    return list(model.layers) + list(getattr(model, "mtp", []))


def shard_stage_extras(stage: nn.Module, shard, policy: dict) -> None:
    """A DSpark stage's own modules, dtype-pure units: ``main_proj``, ``main_norm``, ``norm`` and the Markov
    embedding bf16; the Markov head's fp32 ``head`` and the confidence head fp32 islands.  Their forwards read
    ``head.weight`` / ``proj.weight`` directly, so the unit is the head module itself.  A backbone block has none."""
    for name in ("main_proj", "main_norm", "norm"):
        if hasattr(stage, name):
            shard(getattr(stage, name), mp_policy=policy["bf16"])
    if hasattr(stage, "markov_head"):
        shard(stage.markov_head.embed, mp_policy=policy["bf16"])
        shard(stage.markov_head, mp_policy=policy["fp32"])
        shard(stage.confidence_head, mp_policy=policy["fp32"])


def parallelize(model: nn.Module, mesh, fsdp_cfg: dict, lm_head_precision: str, ignored: set,
                expert_mesh=None) -> list:
    """Wrap ``model`` in place (meta or real); ``ignored`` = EP experts + Engram tables.

    ``expert_mesh``: the ``ep_shard`` mesh when it has more than one rank; the routed experts are then sharded
    over it (``shard_expert_block``) instead of being ignored.

    Returns the replicated (non-FSDP, non-EP) parameters whose gradients need an all-reduce mean.
    """
    policy = _policies(fsdp_cfg, lm_head_precision)
    blocks = trained_blocks(model)
    replicated = [block.attn.attn_sink for block in blocks]
    # Every unit must skip all of them: a unit otherwise adopts any parameter of its subtree that no
    # inner unit manages (ignored by an inner unit does not mean ignored by the outer one).
    skip = set(ignored) | set(replicated)
    shard = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=fsdp_cfg["reshard_after_forward"],
                              ignored_params=skip)
    for block in blocks:
        if fsdp_cfg["activation_checkpointing"]:
            checkpoint_block(block)
        compressor = getattr(block.attn, "compressor", None)
        if compressor is not None:
            for name in ("wkv", "wgate"):
                linear = getattr(compressor, name, None)
                if linear is not None and linear.weight.dtype == torch.float32:
                    shard(linear, mp_policy=policy["fp32"])
        shard(block.attn, mp_policy=policy["bf16"])
        shard(block.attn_norm, mp_policy=policy["bf16"])
        shard(block.ffn_norm, mp_policy=policy["bf16"])
        if expert_mesh is not None:
            for experts in routed_expert_modules(block):
                shard_expert_block(experts, expert_mesh, fsdp_cfg, policy["bf16"])
        if block.engram is not None:
            shard(block.engram, mp_policy=policy["bf16"])
        shard(block.ffn, mp_policy=policy["bf16"])
        shard_stage_extras(block, shard, policy)
        shard(block, mp_policy=policy["fp32"])
    shard(model.embed, mp_policy=policy["bf16"])
    shard(model.norm, mp_policy=policy["bf16"])
    shard(model, mp_policy=policy["head"])
    return replicated
