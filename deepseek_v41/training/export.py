"""Export of the fine-tuned weights (``checkpoint.export_dir``) as a Hugging Face folder, shard by shard.

The same writer as ``save_pretrained`` (``deepseek_v41.hf_export``), fed with sources that read rows of
the sharded tensors: every rank walks the same plan, and for each row block (``hf_export.BLOCK_BYTES``)
the ranks holding rows of it put them into a zero-filled buffer that is ``reduce``d onto rank 0, the
writer. Exactly one rank contributes each row (FSDP ``Shard(0)`` slices, the rank holding an expert at rest:
its EP block's ``ep_shard`` slice, the Engram row owner), so the sum over an integer view of the bytes is a
bitwise copy.
No rank ever holds more than one block beyond its own shards: an Engram table (~98 GB at the released
size) is never gathered whole. Replicated tensors are read by rank 0 from its own copy.

``checkpoint.export_quantize: release`` re-encodes to the released FP8/FP4/Engram format on the way out.
A NaN/Inf anywhere in the weights (any rank's rows) is refused, named, before anything is written.
"""

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from deepseek_v41.hf_export import (
    TensorSource,
    export_config,
    nonfinite_error,
    nonfinite_tensors,
    write_export,
)
from deepseek_v41.modeling_deepseek_v41 import AUTO_MAP, remote_code_files, support_files
from deepseek_v41.training.engram_owner import engram_modules
from deepseek_v41.training.expert_parallel import expert_rows, routed_expert_modules

WRITER = 0


def _dtensor_part(name: str, tensor: DTensor) -> tuple[torch.Tensor, int, bool]:
    # (local rows, first global row, whether this rank is the one that contributes them)
    if any(not isinstance(p, (Shard, Replicate)) or isinstance(p, Shard) and p.dim != 0 for p in tensor.placements):
        raise NotImplementedError(f"exporting {name!r} with placements {tensor.placements}: only dim-0 sharding "
                                  "(FSDP2) and replication are supported")
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    first_replica = all(tensor.device_mesh.get_local_rank(d) == 0
                        for d, p in enumerate(tensor.placements) if isinstance(p, Replicate))
    return tensor.to_local(), (offset[0] if offset else 0), first_replica


def _rows_source(name: str, shape: tuple, dtype: torch.dtype, local: torch.Tensor, offset: int,
                 contributes: bool) -> TensorSource:
    """Rows of a tensor whose dim-0 rows are spread over the ranks (`local` = rows [offset, offset + len))."""
    rank = dist.get_rank()

    def read(start: int, stop: int):
        buffer = torch.zeros((stop - start, *shape[1:]), dtype=dtype, device=local.device)
        lo, hi = max(start, offset), min(stop, offset + local.shape[0])
        if contributes and hi > lo:
            buffer[lo - start : hi - start] = local[lo - offset : hi - offset]
        raw = buffer.view(-1).view(torch.uint8)
        dist.reduce(raw.view(torch.int32) if raw.numel() % 4 == 0 else raw, dst=WRITER)
        return buffer.cpu() if rank == WRITER else None

    return TensorSource(name, tuple(shape), dtype, read, local if contributes else None)


def _replicated_source(name: str, tensor: torch.Tensor) -> TensorSource:
    tensor = tensor.detach()
    writer = dist.get_rank() == WRITER

    def read(start: int, stop: int):
        if not writer:
            return None
        return (tensor if tensor.dim() == 0 else tensor[start:stop]).cpu()

    return TensorSource(name, tuple(tensor.shape), tensor.dtype, read, tensor if writer else None)


def sharded_sources(trainer) -> list[TensorSource]:
    """One source per parameter and persistent buffer of the sharded training model, in state_dict order."""
    model, ep_mesh = trainer.model, trainer.ep_mesh
    experts = {id(getattr(m, p)): m for m in routed_expert_modules(model) for p in ("w1", "w2", "w3")}
    tables = {id(m.embed.weight): m for m in engram_modules(model) if hasattr(m, "table_rows")}
    if tables and dist.get_world_size(trainer.engram_group) != dist.get_world_size():
        raise NotImplementedError("exporting Engram tables owned by a subgroup of the ranks is not supported")
    if ep_mesh["ep_shard"].size() > 1 and not all(isinstance(m.w1, DTensor) for m in experts.values()):
        raise RuntimeError("routed experts must be sharded over ep_shard (fsdp.parallelize) to be exported: "
                           "replicas would be summed")
    sources = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        value = tensor.detach()
        if id(tensor) in experts:  # every expert is held by exactly one rank (its EP block's ep_shard slice)
            module = experts[id(tensor)]
            local, first = expert_rows(module, value)
            shape = (module.n_experts, *value.shape[1:])
            sources.append(_rows_source(name, shape, value.dtype, local, first, True))
        elif id(tensor) in tables:
            start, rows = tables[id(tensor)].table_rows
            local = value[: max(0, min(value.shape[0], rows - start))]  # the last owner's padding stays out
            sources.append(_rows_source(name, (rows, value.shape[1]), value.dtype, local, start, True))
        elif isinstance(value, DTensor):
            local, offset, contributes = _dtensor_part(name, value)
            sources.append(_rows_source(name, tuple(value.shape), value.dtype, local, offset, contributes))
        else:
            sources.append(_replicated_source(name, value))
    return sources


def _sync(message):
    box = [message]
    dist.broadcast_object_list(box, src=WRITER)
    return box[0]


def export_model(trainer, out_dir, quantize=None) -> None:
    """Collective: every rank calls it; rank 0 writes `out_dir` (floating point, or `quantize="release"`)."""
    model = trainer.model
    config = export_config(model.config.to_dict(), architectures=["DeepseekV41ForCausalLM"],
                           dtype=model.embed.weight.dtype, auto_map=AUTO_MAP, quantize=quantize)
    config["text_config"]["dspark_loss_weight"] = 0.0  # the run's training switch, not the exported model's
    writer = dist.get_rank() == WRITER
    sources = sharded_sources(trainer)
    # Every rank checks the rows it holds (no communication but one all-gather of the findings), so NaN/Inf
    # weights are refused on every rank before anything is gathered or written.
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, nonfinite_tensors(sources))
    problems = [f"{p} (index within rank {r}'s rows)" for r, rank_problems in enumerate(found) for p in rank_problems]
    if problems:
        raise nonfinite_error(problems)
    with tempfile.TemporaryDirectory() as scratch:
        files = (remote_code_files() + support_files(model.config, model.engram_tokenizer, Path(scratch),
                                                     getattr(model, "generation_config", None)) if writer else [])
        write_export(sources, out_dir, config, files, quantize=quantize, writer=writer, sync=_sync,
                     check_finite=False)
    if writer:
        kind = "released FP8/FP4" if quantize == "release" else "floating-point"
        print(f"[finetune] exported the {kind} weights to {out_dir}", flush=True)
