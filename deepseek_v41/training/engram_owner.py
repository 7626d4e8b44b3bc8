"""Row-owner Engram tables: each rank keeps one contiguous row block; lookups travel to the owners.

An Engram table (~384M rows x 256 in the release) is never gathered (training_recipe.md §1):

* rank ``r`` of ``W`` owners keeps rows ``[r * local, (r + 1) * local)``, ``local = ceil(rows / W)``; the
  last block is padded with zero rows that no valid id reaches;
* forward: every rank sorts its hash ids by owner, all-gathers the ``[W, W]`` send-count matrix, sends the ids
  to their owners (``all_to_all_single``), the owners check them and look them up locally, and a
  differentiable all-to-all brings the rows back;
* backward runs the last exchange in reverse, so a row's gradient is accumulated by its owner only.

The owner gradients are sums over every rank's tokens while FSDP gradients are means over ranks, so the
training step divides them by the owner count once before clipping (``loop.py``).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from deepseek_v41.moe import inverse_permutation
from deepseek_v41.training.expert_parallel import all_to_all


def engram_modules(model: nn.Module) -> list:
    """Every Engram module (duck-typed: an ``embed`` table and a ``table_lookup`` hook)."""
    return [m for m in model.modules() if hasattr(m, "table_lookup") and isinstance(getattr(m, "embed", None), nn.Embedding)]


class RowOwnerLookup:
    """``Engram.table_lookup``: hash ids [b, s, cols] -> rows [b, s, cols, d] from the owners' blocks."""

    def __init__(self, embed: nn.Embedding, rows: int, group):
        self.embed = embed  # weight [local, d]: this rank's block
        self.rows = rows
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local = embed.weight.shape[0]

    def __call__(self, hash_ids: torch.Tensor) -> torch.Tensor:
        flat = hash_ids.flatten()
        owner = torch.div(flat, self.local, rounding_mode="floor")
        order = owner.argsort(stable=True)
        send = torch.bincount(owner, minlength=self.size)[: self.size]
        if int(send.sum()) != flat.numel():
            bad = flat[(flat < 0) | (flat >= self.rows)]
            raise ValueError(f"Engram hash ids outside [0, {self.rows}): {bad[:8].tolist()}")
        matrix = [torch.empty_like(send) for _ in range(self.size)]
        dist.all_gather(matrix, send, group=self.group)  # matrix[src][dst] = ids src sends to dst
        recv = torch.stack(matrix)[:, self.rank]
        send_splits, recv_splits = send.tolist(), recv.tolist()
        with torch.no_grad():
            ids_in = all_to_all(flat[order], send_splits, recv_splits, self.group)  # [m] global ids
        local_ids = ids_in - self.rank * self.local
        if ids_in.numel() and (int(local_ids.min()) < 0 or int(local_ids.max()) >= self.local
                               or int(ids_in.max()) >= self.rows):
            raise RuntimeError(
                f"rank {self.rank} received Engram ids outside its rows [{self.rank * self.local}, "
                f"{min(self.rows, (self.rank + 1) * self.local)}): the id exchange is corrupted "
                "(on H100 clusters with the HPC-X NCCL plugin set NCCL_PXN_DISABLE=1)"
            )
        found = F.embedding(local_ids, self.embed.weight)  # [m, d]
        back = all_to_all(found, recv_splits, send_splits, self.group)  # [n, d], in `order`
        return back[inverse_permutation(order)].view(*hash_ids.shape, -1)


def shard_engram_table(engram: nn.Module, rank: int, owners: int) -> tuple:
    """Replace ``engram.embed.weight`` by this rank's zero-padded row block; -> (first row, global rows)."""
    full = engram.embed.weight
    rows, dim = full.shape
    local = -(-rows // owners)
    start, stop = rank * local, min(rows, (rank + 1) * local)
    block = torch.zeros((local, dim), dtype=full.dtype, device=full.device)
    if stop > start:
        block[: stop - start] = full.detach()[start:stop]
    engram.embed.weight = nn.Parameter(block, requires_grad=full.requires_grad)
    engram.embed.num_embeddings = local
    return start, rows


def apply_row_owner_engram(model: nn.Module, group) -> list:
    """Shard every Engram table over ``group`` and install ``RowOwnerLookup``; returns the table params."""
    owners, rank = dist.get_world_size(group), dist.get_rank(group)
    tables = []
    for engram in engram_modules(model):
        start, rows = shard_engram_table(engram, rank, owners)
        engram.table_rows = (start, rows)  # read by the checkpoint loader: which global rows are local
        engram.table_lookup = RowOwnerLookup(engram.embed, rows, group)
        tables.append(engram.embed.weight)
    return tables
