"""Mixture of experts (architecture.md §8): fp32 router, stacked routed experts, one shared expert.

Routed experts are stored stacked per layer (``experts.w1`` [E, inter, dim], ``w3`` [E, inter, dim],
``w2`` [E, dim, inter]) for grouped GEMM and expert parallelism; the checkpoint adapter maps them to and
from the released per-expert names ``ffn.experts.{e}.w{1,2,3}.weight``.
"""

import torch
from torch import nn
from torch.nn import functional as F

from .kernels_triton import gather_sum_rows, triton_usable, weighted_swiglu_triton
from .layers import make_fp32_matmul, make_linear


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    # fp32 SwiGLU with the V4 clamps: up to [-limit, limit], gate to at most limit
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


def weighted_swiglu(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor:
    # gate, up [m, inter] (expert GEMM outputs), weights fp32 [m] -> [m, inter] in gate's dtype, math in fp32
    return (swiglu(gate.float(), up.float(), limit) * weights.unsqueeze(-1)).to(gate.dtype)


def fused_weighted_swiglu(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor:
    """``weighted_swiglu`` as one Triton kernel each way on CUDA (eager: eight passes over [m, inter] fp32
    tensors, about a quarter of the grouped experts' forward time at V4.1 sizes).  At [24576, 2304] on the H200
    the forward takes 0.15 ms and forward + backward 0.42 ms, against 0.35 / 0.82 ms for torch.compile's kernels
    (examples/benchmarks/elementwise.py).  Eager on CPU, and traced as plain ops inside a region that
    torch.compile is already tracing."""
    if triton_usable(gate) and not torch.compiler.is_compiling():
        return weighted_swiglu_triton(gate, up, weights, limit)
    return weighted_swiglu(gate, up, weights, limit)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """order [m] (a permutation of 0..m-1) -> inv [m] with inv[order[j]] = j: where each element went."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def _gather_slots(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    # token rows x [n, dim] -> [n·k, dim] in sorted order: row j is token order[j] // k
    return x[order // k]


def _sum_slots(y: torch.Tensor, order: torch.Tensor, k: int, dtype, add: torch.Tensor | None = None) -> torch.Tensor:
    # sorted rows y [n·k, dim] (+ add [n, dim]) -> [n, dim] in ``dtype``: each token's k rows summed in fp32 in
    # choice order (deterministic: no atomics), then add, one rounding.  CUDA: one gather-and-sum pass over y,
    # reading row src[slot] for each slot (src = the inverse permutation of order); eager: put back in slot
    # order, then sum an [n, k, dim] view
    if triton_usable(y):
        return gather_sum_rows(y, inverse_permutation(order), k, dtype, add)
    slots = y.new_empty(y.shape).index_copy_(0, order, y)
    total = slots.view(-1, k, y.shape[-1]).sum(1, dtype=torch.float32)
    return (total if add is None else total + add.float()).to(dtype)


class _GatherTokens(torch.autograd.Function):
    # The dispatch permutation and its adjoint: gradients summed per token like the combine, instead of the
    # index_put with accumulation (a sort) that autograd of x[order // k] would run
    @staticmethod
    def forward(ctx, x, order, k):
        ctx.save_for_backward(order)
        ctx.k = k
        return _gather_slots(x, order, k)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return _sum_slots(grad, order, ctx.k, grad.dtype), None, None


class _CombineTopK(torch.autograd.Function):
    # The combine (plus the shared expert's output) and its adjoint: the gradient is gathered from the [n, dim]
    # token gradient, not from a materialised [n, k, dim] expansion of it; the shared output's is that gradient
    @staticmethod
    def forward(ctx, y, order, k, shared):
        ctx.save_for_backward(order)
        ctx.k, ctx.dtype = k, y.dtype
        return _sum_slots(y, order, k, torch.float32 if shared is None else shared.dtype, shared)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        grad_shared = grad if ctx.needs_input_grad[3] else None
        return _gather_slots(grad.to(ctx.dtype), order, ctx.k), None, None, grad_shared


def combine_top_k(y: torch.Tensor, order: torch.Tensor, n: int, k: int, shared: torch.Tensor | None = None):
    """Expert outputs y [n·k, dim] in sorted order (row j is the (token, choice) slot ``order[j]``) -> fp32
    [n, dim], each token's k rows summed in fp32; with ``shared`` [n, dim] (the shared expert's output), the sum
    plus it in fp32, rounded once to its dtype.  Summed per token (as if put back in slot order first), the
    combine needs no atomics (deterministic) and no fp32 copy of y."""
    return _CombineTopK.apply(y, order, k, shared).view(n, y.shape[-1])


def sort_by_expert(expert_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [n, k] in [0, E) -> (order [n·k]: sorted row j holds (token, choice) slot order[j], counts [E])."""
    flat = expert_ids.flatten()
    order = flat.argsort(stable=True)
    # rows per expert: a scatter-add rather than bincount, whose CUDA kernel reads the ids' min and max back to the
    # host (a device sync in every MoE layer's forward); the ids are in [0, E) by construction
    return order, flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))


def dispatch_top_k(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """Token rows x [n, dim] -> [n·k, dim] in sorted order (row j holds token ``order[j] // k``)."""
    return _GatherTokens.apply(x, order, k)


class Router(nn.Module):
    """Scores in fp32, selects with the fixed correction bias (``bias_vl`` on image tokens), weighs unbiased."""

    def __init__(self, config, backend: dict, has_image_bias: bool):
        super().__init__()
        self.score_matmul = make_fp32_matmul(backend)  # fp32 x·Wᵀ: IEEE, or emulated on bf16 tensor cores
        self.top_k = config.num_experts_per_tok
        self.score_func = config.scoring_func
        self.gate_temp = config.gate_temp
        self.norm_topk_prob = config.norm_topk_prob
        self.route_scale = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        # Correction biases are fixed in fine-tuning (gate_bias_update_factor 0): fp32 buffers, never trained.
        self.register_buffer("bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))
        if has_image_bias:
            self.register_buffer("bias_vl", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None):
        # x [n, dim], image_mask [n] bool | None -> weights fp32 [n, k], expert ids int64 [n, k]
        logits = self.score_matmul(x, self.weight) / self.gate_temp
        if self.score_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            raise ValueError(f"unknown scoring_func {self.score_func!r}; use sqrtsoftplus, softmax or sigmoid")
        bias = self.bias
        if image_mask is not None and hasattr(self, "bias_vl"):
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl, self.bias)
        with torch.no_grad():  # the choice is discrete; gradients reach the router through the weights
            experts = (scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, experts


@torch.compiler.disable  # eager inside a compiled model: traced, each new split of rows would be a recompile
def expert_loop(x, counts, weights, w1, w3, w2, limit: float) -> torch.Tensor:
    """``experts: torch``: one SwiGLU per expert over its rows of x [m, dim] (sorted by expert, ``counts`` [E]
    rows each, routing weights fp32 [m]) -> [m, dim]."""
    outputs, start = [], 0
    for e, count in enumerate(counts.tolist()):
        rows = x[start : start + count]
        h = weighted_swiglu(F.linear(rows, w1[e]), F.linear(rows, w3[e]), weights[start : start + count], limit)
        outputs.append(F.linear(h, w2[e]))
        start += count
    return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])


class RoutedExperts(nn.Module):
    """Stacked SwiGLU experts.  ``experts: torch_mm`` runs grouped GEMMs, ``torch`` a per-expert loop.

    Expert parallelism (training code) keeps only the local experts here (``expert_offset`` = global id of
    the first) and sets ``dispatcher``, which then owns the token exchange and calls ``grouped_forward``.
    """

    def __init__(self, config, backend: dict):
        super().__init__()
        n, dim, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.n_experts = n
        self.expert_offset = 0
        self.limit = config.swiglu_limit
        self.grouped = backend["experts"] == "torch_mm"
        self.dispatcher = None
        self.w1 = nn.Parameter(torch.empty(n, inter, dim))
        self.w3 = nn.Parameter(torch.empty(n, inter, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, inter))

    def grouped_forward(self, x: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x [m, dim] sorted by local expert, counts [E_local], weights fp32 [m] -> [m, dim] in x.dtype.
        # torch.compile traces _grouped_mm only in bf16 (its meta kernel refuses other dtypes): other dtypes take
        # the per-expert loop there, as eager code
        if self.grouped and (x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()):
            inter, dim = self.w1.shape[1], self.w1.shape[2]
            if (inter * x.element_size()) % 16 or (dim * x.element_size()) % 16:
                raise ValueError(
                    f"experts backend 'torch_mm' (torch._grouped_mm) needs rows of 16-byte multiples: "
                    f"hidden_size ({dim}) and moe_intermediate_size ({inter}) must be multiples of "
                    f"{16 // x.element_size()} in {x.dtype}; change them or use experts backend 'torch'"
                )
            offs = counts.cumsum(0).to(torch.int32)
            gate = torch._grouped_mm(x, self.w1.to(x.dtype).transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(x, self.w3.to(x.dtype).transpose(-2, -1), offs=offs)
            h = fused_weighted_swiglu(gate, up, weights, self.limit)
            return torch._grouped_mm(h, self.w2.to(x.dtype).transpose(-2, -1), offs=offs)
        return expert_loop(x, counts, weights, self.w1, self.w3, self.w2, self.limit)

    def forward(self, x, expert_ids, weights, shared=None) -> torch.Tensor:
        # x [n, dim], expert_ids [n, k] (global ids), weights fp32 [n, k] -> fp32 [n, dim] (sum over k); with
        # shared [n, dim] (the shared expert's output): sum + shared in fp32, rounded once to shared's dtype
        if self.dispatcher is not None:
            routed = self.dispatcher(self, x, expert_ids, weights)
            return routed if shared is None else (routed + shared.float()).to(shared.dtype)
        n, k = expert_ids.shape
        order, counts = sort_by_expert(expert_ids, self.w1.shape[0])
        y = self.grouped_forward(dispatch_top_k(x, order, k), counts, weights.flatten()[order])  # [n·k, dim]
        return combine_top_k(y, order, n, k, shared)


class Expert(nn.Module):
    """The shared expert: the same clamped SwiGLU, no routing weight."""

    def __init__(self, dim: int, inter: int, limit: float, backend: dict):
        super().__init__()
        self.limit = limit
        self.w1 = make_linear(dim, inter, backend)
        self.w3 = make_linear(dim, inter, backend)
        self.w2 = make_linear(inter, dim, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [n, dim] -> [n, dim].  The SwiGLU is the routed experts' (fp32 math, one rounding) with unit weights
        # (× 1.0 is exact): on CUDA one Triton kernel each way instead of ~10 eager passes over [n, inter]
        gate, up = self.w1(x), self.w3(x)
        ones = torch.ones(gate.shape[:-1], dtype=torch.float32, device=gate.device)
        return self.w2(fused_weighted_swiglu(gate, up, ones, self.limit).to(x.dtype))


class MoE(nn.Module):
    def __init__(self, config, backend: dict, has_image_bias: bool):
        super().__init__()
        self.gate = Router(config, backend, has_image_bias)
        self.experts = RoutedExperts(config, backend)
        self.shared_experts = Expert(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit, backend
        )

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
        # x [n, dim] tokens, image_mask [n] | None -> [n, dim]: routed sum in fp32 + shared, one rounding
        weights, experts = self.gate(x, image_mask)
        return self.experts(x, experts, weights, self.shared_experts(x).to(x.dtype))
