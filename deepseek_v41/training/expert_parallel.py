"""Expert parallelism: routed experts sharded on dim 0 over an ``ep`` mesh axis, tokens moved by all-to-all.

Mesh (training_recipe.md §1): the ranks are unflattened into ``("ep_shard", "ep")`` with
``ep_shard = world / ep``.  Rank ``r`` of the ``ep`` axis owns experts ``[r * E_local, (r + 1) * E_local)``
of every layer (``shard_experts``); with ``ep_shard > 1`` that block is sharded further on dim 0 over the
``ep_shard`` axis by its own FSDP2 unit (``fsdp.parallelize``, as torchtitan does), so a rank keeps
``E_local / ep_shard`` experts at rest, all-gathers the block for the forward and reduce-scatters (sums) its
gradient.  Token dispatch stays on the ``ep`` axis.  Globally, the ``E`` experts are split over ``ep`` first,
then over ``ep_shard`` (``expert_global_mesh``): rank ``(i, r)`` of ``("ep_shard", "ep")`` holds experts
``r * E_local + i * E_local / ep_shard + [0, E_local / ep_shard)``.

The ``torch`` dispatcher follows the Megatron "alltoall" pattern, all differentiable:

1. sort the ``n * k`` token copies by global expert (= by destination rank, then local expert);
2. exchange the per-(rank, local expert) counts;
3. ``all_to_all_single`` the token rows (x dtype) and their routing weights (fp32);
4. regroup the received rows by local expert and run ``RoutedExperts.grouped_forward``;
5. undo the regrouping, send the rows home with the reverse all-to-all;
6. sum the ``k`` copies of each token in fp32 (``combine_top_k``, as the local path does).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..moe import combine_top_k, dispatch_top_k, inverse_permutation
from .hybridep import HybridEPDispatcher


class _AllToAll(torch.autograd.Function):
    """Variable-size ``all_to_all_single`` on dim 0; the backward sends gradients along the reverse route."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send_splits: list, recv_splits: list, group) -> torch.Tensor:
    """Rows ``x[sum(send[:j]) : sum(send[:j+1])]`` go to rank ``j``; returns the rows received, by source rank."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [W, c] (what this rank sends to each rank) -> [W, c] (what each rank sends to this one)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


class AllToAllDispatcher:
    """``RoutedExperts.dispatcher`` for ``dispatcher: torch``: a plain ``all_to_all_single`` exchange."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(self, experts, x, expert_ids, weights):
        # x [n, dim], expert_ids [n, k] global, weights fp32 [n, k] -> fp32 [n, dim]
        n, k = expert_ids.shape
        e_local = experts.w1.shape[0]
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)  # by global expert = by (destination rank, local expert)
        counts = torch.bincount(flat, minlength=experts.n_experts).view(self.size, e_local)  # [W, E_local]
        received = exchange_counts(counts, self.group)  # [W, E_local]: rows per (source rank, my expert)
        send, recv = counts.sum(1).tolist(), received.sum(1).tolist()
        x_in = all_to_all(dispatch_top_k(x, order, k), send, recv, self.group)  # [m, dim]: by source, local expert
        w_in = all_to_all(weights.flatten()[order], send, recv, self.group)  # [m] fp32
        local_expert = torch.arange(e_local, device=x.device).repeat(self.size)
        local_expert = local_expert.repeat_interleave(received.flatten())  # [m]
        regroup = local_expert.argsort(stable=True)
        y = experts.grouped_forward(x_in[regroup], received.sum(0), w_in[regroup])  # [m, dim] x dtype
        y_home = all_to_all(y[inverse_permutation(regroup)], recv, send, self.group)  # [n * k, dim], in `order`
        return combine_top_k(y_home, order, n, k)


def make_dispatcher(name: str, group):
    """``torch``: the all-to-all above.  ``hybridep``: DeepEP's HybridEP buffer (hybridep.py; GPU, NVLink domain)."""
    if name == "torch":
        return AllToAllDispatcher(group)
    if name == "hybridep":
        return HybridEPDispatcher(group)
    raise ValueError(f"unknown expert dispatcher {name!r}; use torch or hybridep")


def routed_expert_modules(model: nn.Module) -> list:
    """Every module holding stacked routed experts (duck-typed: ``grouped_forward`` + ``dispatcher``)."""
    return [m for m in model.modules() if hasattr(m, "grouped_forward") and hasattr(m, "dispatcher")]


def shard_experts(experts: nn.Module, ep_rank: int, ep_size: int) -> None:
    """Keep experts ``[ep_rank * E_local, (ep_rank + 1) * E_local)`` (works on meta tensors too)."""
    total = experts.n_experts
    if total % ep_size:
        raise ValueError(f"{total} routed experts cannot be split evenly over ep_size={ep_size}")
    e_local = total // ep_size
    start = ep_rank * e_local
    for name in ("w1", "w2", "w3"):
        full = getattr(experts, name)
        if full.shape[0] != total:
            raise ValueError(f"experts.{name} has {full.shape[0]} rows, expected {total}: already sharded?")
        local = nn.Parameter(full.detach()[start : start + e_local].clone(), requires_grad=full.requires_grad)
        setattr(experts, name, local)
    experts.expert_offset = start


def check_expert_layout(n_experts: int, world: int, ep_size: int) -> None:
    """Every rank keeps whole experts: ``E / ep_size`` per EP rank, split on dim 0 over ``ep_shard = world / ep_size``,
    so ``world`` must divide ``E`` (and ``ep_size`` divide ``world``, ``recipe.validate_world``)."""
    if n_experts % world == 0:
        return
    near = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
    below, above = max(d for d in near if d < world), min((d for d in near if d > world), default=None)
    raise ValueError(
        f"{n_experts} routed experts cannot be spread over {world} ranks at distributed.ep_size={ep_size}: each rank "
        f"keeps whole experts ({n_experts / ep_size:g} per EP rank, sharded on dim 0 over ep_shard = {world // ep_size}), "
        f"so the number of ranks must divide {n_experts}: use {below}" + (f" or {above}" if above else "") + " ranks")


def apply_expert_parallel(model: nn.Module, ep_mesh, dispatcher: str) -> list:
    """Shard every ``RoutedExperts`` over ``ep_mesh['ep']`` and install the dispatcher; returns the expert params.

    With a single EP rank the local path is kept (the reference's "any EP dispatcher falls back to local").
    The ``ep_shard`` split happens later, in ``fsdp.parallelize``.
    """
    ep = ep_mesh["ep"]
    ep_size, ep_rank = ep.size(), ep.get_local_rank()
    modules = routed_expert_modules(model)
    for experts in modules:
        check_expert_layout(experts.n_experts, ep_mesh.size(), ep_size)
    if ep_size > 1:
        router = make_dispatcher(dispatcher, ep.get_group())
        for experts in modules:
            shard_experts(experts, ep_rank, ep_size)
            experts.dispatcher = router
    return [p for m in modules for p in m.parameters()]


def expert_global_mesh(ep_mesh) -> DeviceMesh:
    """``ep_mesh`` transposed to ``("ep", "ep_shard")`` (same groups): with ``[Shard(0), Shard(0)]`` on it, dim 0
    is split over ``ep`` first and each EP block over ``ep_shard``, the experts' global layout (module docstring)."""
    return DeviceMesh.from_group([ep_mesh["ep"].get_group(), ep_mesh["ep_shard"].get_group()], ep_mesh.device_type,
                                 mesh=ep_mesh.mesh.t().contiguous(), mesh_dim_names=("ep", "ep_shard"))


def expert_rows(experts: nn.Module, param: torch.Tensor) -> tuple:
    """(the rank-local experts of ``param`` [n, ...], global id of the first): the EP block's ``expert_offset``
    plus, for an ``ep_shard``-sharded block (FSDP2 ``DTensor``), this rank's dim-0 offset inside it."""
    if not isinstance(param, DTensor):
        return param, experts.expert_offset
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), experts.expert_offset + offset[0]


def global_expert_view(ep_global_mesh: DeviceMesh, n_experts: int, local: torch.Tensor) -> DTensor:
    """A tensor shaped like this rank's experts of one stacked weight [n, ...] -> its global [E, ...] DTensor."""
    shape = (n_experts, *local.shape[1:])
    return DTensor.from_local(local, ep_global_mesh, [Shard(0), Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())
