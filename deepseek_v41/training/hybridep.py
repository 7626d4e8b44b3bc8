"""``dispatcher: hybridep``: DeepEP's HybridEP buffer moves the tokens (NVLink TMA kernels), permutation fused in.

Same contract as ``AllToAllDispatcher`` (``RoutedExperts.dispatcher``: x [n, dim] bf16 CUDA, global expert ids
[n, k], fp32 weights [n, k] -> fp32 [n, dim]), built on ``HybridEPBuffer`` from DeepEP's ``hybrid-ep`` branch
(docs/install.md says how to build it), as Megatron-core / NeMo AutoModel's HybridEP dispatcher uses it:

1. the routes as a dense bool map [n, E] and the weights as dense fp32 probs [n, E];
2. ``dispatch_with_permute``: routing maps all-gathered over the EP group, metadata preprocessing, token rows
   sent to the ranks that hold their experts and laid out grouped by local expert -> rows [m, dim], their
   probs [m] fp32 and rows per local expert (one host sync, for m);
3. ``RoutedExperts.grouped_forward`` on those rows;
4. ``combine_with_unpermute``: each token's rows summed (fp32 accumulation, bf16 result) and sent home.

Backward is the same pair reversed: the dispatch's adjoint is the combine (which also returns the probs'
gradient as a dense [n, E] map), the combine's adjoint the dispatch without probs.

Numerics against ``torch``: HybridEP hands back the routed sum in bf16 (a rank's rows are summed in fp32 and
rounded once; at EP > 1 the ranks' partial sums are added in bf16), where the all-to-all path keeps it in fp32
until the shared expert is added.  The MoE output therefore differs by about one bf16 rounding.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

# HybridEP's TMA loads want the per-rank token count aligned (16 B of int32 per chunk remainder): pad to 16
_TOKEN_ALIGN = 16


def hybrid_ep_buffer_class():
    """``deep_ep.HybridEPBuffer``, or a RuntimeError saying how to get it."""
    try:
        from deep_ep import HybridEPBuffer
    except ImportError as e:
        raise RuntimeError(
            "dispatcher 'hybridep' needs DeepEP's HybridEP (`deep_ep.HybridEPBuffer`, built from the hybrid-ep "
            "branch of github.com/deepseek-ai/DeepEP; docs/install.md has the build steps, and CUDA_HOME must point "
            f"at the nvcc it JIT-compiles its kernels with); import failed: {e}. "
            "Or use --model.config.backend.dispatcher=torch (all-to-all, same semantics)"
        ) from e
    return HybridEPBuffer


class _DispatchPermute(torch.autograd.Function):
    # x [n, dim], weights fp32 [n, k] -> rows [m, dim] grouped by local expert, their weights fp32 [m], rows per
    # local expert int64 [E_local] (host), the route handle.  The tokens are padded to `n_pad` rows that route
    # nowhere (HybridEP wants the same, aligned token count on every rank).
    @staticmethod
    def forward(ctx, x, weights, expert_ids, buffer, n_experts, e_local, n_pad):
        n = x.shape[0]
        routes = torch.zeros(n_pad, n_experts, dtype=torch.bool, device=x.device)
        probs = torch.zeros(n_pad, n_experts, device=x.device)
        routes[:n].scatter_(1, expert_ids, True)
        probs[:n].scatter_(1, expert_ids, weights.float())
        rows, row_probs, _, counts, handle = buffer.dispatch_with_permute(
            hidden=F.pad(x, (0, 0, 0, n_pad - n)).contiguous(),
            routing_map=routes,
            probs=probs,
            num_of_experts_per_rank=e_local,
        )
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(expert_ids)
        ctx.mark_non_differentiable(counts)
        return rows, row_probs, counts, handle

    @staticmethod
    def backward(ctx, grad_rows, grad_row_probs, _counts, _handle):
        (expert_ids,) = ctx.saved_tensors
        n = expert_ids.shape[0]
        grad_x, grad_probs = ctx.buffer.combine_with_unpermute(
            hidden=grad_rows.contiguous(),
            probs=None if grad_row_probs is None else grad_row_probs.float().contiguous(),
            handle=ctx.handle,
        )
        grad_weights = None if grad_probs is None else grad_probs[:n].gather(1, expert_ids)
        return grad_x[:n], grad_weights, None, None, None, None, None


class _UnpermuteCombine(torch.autograd.Function):
    # rows [m, dim] (expert outputs in the dispatch's layout) -> [n_pad, dim] in their dtype: each token's rows summed
    @staticmethod
    def forward(ctx, rows, buffer, handle, e_local):
        ctx.buffer, ctx.handle, ctx.shape = buffer, handle, (rows.shape[0], e_local)
        out, _ = buffer.combine_with_unpermute(hidden=rows.contiguous(), handle=handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        m, e_local = ctx.shape
        grad_rows = ctx.buffer.dispatch_with_permute(
            hidden=grad.contiguous(), handle=ctx.handle, num_permuted_tokens=m, num_of_experts_per_rank=e_local
        )[0]
        return grad_rows, None, None, None


class HybridEPDispatcher:
    """``RoutedExperts.dispatcher`` for ``dispatcher: hybridep``: one HybridEP buffer per EP group, made at first
    use (DeepEP grows it when a later batch has more tokens)."""

    def __init__(self, group):
        self.buffer_class = hybrid_ep_buffer_class()
        self.group = group
        self.size = dist.get_world_size(group)
        self.buffer = None

    def __call__(self, experts, x, expert_ids, weights):
        # x [n, dim] bf16, expert_ids [n, k] global, weights fp32 [n, k] -> fp32 [n, dim]
        if not x.is_cuda or x.dtype != torch.bfloat16:
            raise ValueError(
                f"dispatcher 'hybridep' moves bf16 CUDA tokens (DeepEP's unpermute kernel is bf16-only), got "
                f"{x.dtype} on {x.device}; train in bf16 on GPUs or use dispatcher 'torch'"
            )
        n, dim = x.shape
        e_local = experts.w1.shape[0]
        n_pad = -(-n // _TOKEN_ALIGN) * _TOKEN_ALIGN
        if self.size > 1:  # every rank must present the same token count
            n_max = torch.tensor([n_pad], device=x.device)
            dist.all_reduce(n_max, op=dist.ReduceOp.MAX, group=self.group)
            n_pad = int(n_max.item())
        if self.buffer is None:
            self.buffer = self.buffer_class(
                group=self.group, hidden_dim=dim, max_num_of_tokens_per_rank=n_pad, num_local_experts=e_local
            )
        rows, row_probs, counts, handle = _DispatchPermute.apply(
            x, weights, expert_ids, self.buffer, experts.n_experts, e_local, n_pad
        )
        y = experts.grouped_forward(rows, counts.to(rows.device), row_probs)  # [m, dim] bf16
        return _UnpermuteCombine.apply(y, self.buffer, handle, e_local)[:n].float()
