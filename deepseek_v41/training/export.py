"""Floating-point export of the fine-tuned weights (``checkpoint.export_dir``), loadable by ``from_pretrained``.

Every rank takes part in gathering each tensor (FSDP ``full_tensor``, EP experts over the ``ep`` axis,
Engram row blocks over the owners); rank 0 writes released names, fp32 islands kept in fp32, no
quantization metadata, plus the modeling files and the source checkpoint's tokenizer files.  This gathers
whole tensors on rank 0: meant for models that fit one host's memory (the tiny demo, reduced configs).
"""

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from deepseek_v41.checkpoint import save_floating_point_checkpoint
from deepseek_v41.modeling_deepseek_v41 import remote_code_files


def _gather_dim0(local: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def full_state_items(trainer):
    """(name, full tensor) for every parameter and persistent buffer, gathered collectively."""
    experts = {id(p) for p in trainer.expert_params}
    tables = {id(m.embed.weight): m.table_rows[1] for m in trainer.model.modules() if hasattr(m, "table_rows")}
    ep = trainer.ep_mesh["ep"]
    for name, tensor in trainer.model.state_dict(keep_vars=True).items():
        value = tensor.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        elif id(tensor) in experts and ep.size() > 1:
            value = _gather_dim0(value, ep.get_group())
        elif id(tensor) in tables:
            value = _gather_dim0(value, trainer.engram_group)[: tables[id(tensor)]]
        yield name, value.cpu()


def export_floating_point(trainer, out_dir) -> None:
    items = list(full_state_items(trainer))  # collective: every rank iterates
    if dist.get_rank() == 0:
        config = trainer.model.config.to_dict()
        config["architectures"] = ["DeepseekV41ForCausalLM"]
        config["dtype"] = str(trainer.model.embed.weight.dtype).removeprefix("torch.")
        source = Path(trainer.path)
        extra = [source / f for f in ("tokenizer.json", "tokenizer_config.json") if (source / f).is_file()]
        save_floating_point_checkpoint(items, out_dir, config, list(remote_code_files()) + extra)
        print(f"[finetune] exported floating-point weights to {out_dir}", flush=True)
    dist.barrier()
