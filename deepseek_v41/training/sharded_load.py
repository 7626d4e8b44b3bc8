"""Load a released (FP8/FP4) or floating-point checkpoint into the already-sharded training model.

Each rank decodes only the rows it stores, straight from the safetensors byte ranges
(``deepseek_v41.checkpoint.ReleasedCheckpoint.decode(name, rows)``):

* FSDP2 parameters (``DTensor`` ``Shard(0)``): the rank's contiguous dim-0 slice;
* routed experts (EP blocks, dim-0 sharded again over ``ep_shard``): the released
  ``ffn.experts.{e}.w{1,2,3}.weight`` of the rank's own experts only;
* row-owner Engram tables: rows ``[start, start + local)`` of the FP8 table (padding rows stay zero);
* replicated parameters and persistent buffers: whole.

Every model tensor must be found and every released tensor used, except the DSpark ``mtp.*`` stages and,
when the vision tower is disabled (``vision_config.num_hidden_layers: 0``), the vision tensors.

Shard checksums recorded by an export of ours are compared first, each shard by one rank (the ranks share
the reads), and a damaged shard stops every rank naming it.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from deepseek_v41.checkpoint import CheckpointError, ReleasedCheckpoint, model_to_released_name
from deepseek_v41.training.engram_owner import engram_modules
from deepseek_v41.training.expert_parallel import expert_rows, routed_expert_modules

_VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
_SKIPPED_PREFIXES = ("mtp.",)


def _copy_rows(checkpoint, name: str, local: torch.Tensor, start: int) -> None:
    # rows [start, start + len(local)) of released tensor `name`, decoded into `local` in its dtype
    if local.dim() == 0:
        local.copy_(checkpoint.decode(name, dtype=local.dtype, device=local.device).reshape(()))
    elif local.shape[0]:
        decoded = checkpoint.decode(name, slice(start, start + local.shape[0]), dtype=local.dtype, device=local.device)
        local.copy_(decoded.view(local.shape))


def _check_shape(checkpoint, name: str, shape: tuple, target: str) -> None:
    if name not in checkpoint.tensors:
        raise CheckpointError(f"tensor {name!r} (for {target}) is missing from {checkpoint.path}")
    stored = tuple(checkpoint.tensors[name].shape)
    if stored != tuple(shape):
        raise CheckpointError(f"tensor {name!r} in {checkpoint.path} has shape {list(stored)}, {target} needs {list(shape)}")


def _verify_shared(checkpoint) -> None:
    # each shard's checksum compared by one rank; every rank learns every problem (one all-gather)
    files = checkpoint.files
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = checkpoint.verify_files(files[rank::world])
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = [p for rank_problems in gathered for p in rank_problems]
    if problems:
        raise CheckpointError(problems[0] + (f" ({len(problems) - 1} more damaged shards)" if len(problems) > 1 else ""))
    checkpoint.mark_verified(files)


@torch.no_grad()
def load_sharded_checkpoint(model: torch.nn.Module, path, *, dequantize: bool = True) -> list:
    """Fill every parameter and persistent buffer of the sharded ``model``; returns the released names used."""
    checkpoint = ReleasedCheckpoint(path)
    if checkpoint.is_quantized and not dequantize:
        raise NotImplementedError("training needs dequantized weights: set model.dequantize_base_checkpoint: true")
    _verify_shared(checkpoint)
    special = {}
    for experts in routed_expert_modules(model):
        for proj in ("w1", "w2", "w3"):
            special[id(getattr(experts, proj))] = ("experts", experts, proj)
    for engram in engram_modules(model):
        special[id(engram.embed.weight)] = ("engram", engram, None)

    used = []
    for name, target in model.state_dict(keep_vars=True).items():
        kind = special.get(id(target))
        if kind and kind[0] == "experts":
            local, first = expert_rows(kind[1], target)
            for local_index in range(local.shape[0]):
                released = model_to_released_name(name, first + local_index)
                _check_shape(checkpoint, released, local.shape[1:], f"{name}[{first + local_index}]")
                _copy_rows(checkpoint, released, local[local_index], 0)
                used.append(released)
            continue
        if kind and kind[0] == "engram":
            start, rows = getattr(kind[1], "table_rows", (0, target.shape[0]))
            _check_shape(checkpoint, name, (rows, target.shape[1]), name)
            target.zero_()
            _copy_rows(checkpoint, name, target[: max(0, min(target.shape[0], rows - start))], start)
            used.append(name)
            continue
        if isinstance(target, DTensor):
            _check_shape(checkpoint, name, target.shape, name)
            _, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
            _copy_rows(checkpoint, name, target.to_local(), offset[0] if offset else 0)
        else:
            _check_shape(checkpoint, name, target.shape, name)
            _copy_rows(checkpoint, name, target, 0)
        used.append(name)

    skipped = _SKIPPED_PREFIXES + (() if getattr(model, "has_vision", True) else _VISION_PREFIXES)
    expert_released = set(used)
    unused = [n for n in checkpoint.tensors if n not in expert_released and not n.startswith(skipped)]
    # EP ranks read only their experts: the others' expert tensors are legitimately unused here.
    unused = [n for n in unused if ".ffn.experts." not in n]
    if unused:
        raise CheckpointError(f"{len(unused)} tensors of {checkpoint.path} have no model parameter, e.g. {unused[:3]}")
    return used
