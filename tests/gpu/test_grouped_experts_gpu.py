"""``experts: torch_mm`` (``torch._grouped_mm``, bf16) against ``experts: torch`` (a per-expert loop) on CUDA, both
measured against the loop in fp64.

Both are the model's own ``RoutedExperts`` with the same weights: routed SwiGLU with the clamp and
the fp32 routing weights, tokens sorted by expert, empty experts included.  Skips without a CUDA GPU.
"""

from types import SimpleNamespace

import pytest
import torch
from gpu_metrics import gate, rel_err, report

from deepseek_v41.moe import RoutedExperts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="grouped experts GPU test needs a CUDA GPU"),
    pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm"),
]


def routed_experts(backend, E, D, I, gen):
    config = SimpleNamespace(n_routed_experts=E, hidden_size=D, moe_intermediate_size=I, swiglu_limit=10.0)
    experts = RoutedExperts(config, {"experts": backend}).cuda()
    with torch.no_grad():
        for w, fan_in in ((experts.w1, D), (experts.w3, D), (experts.w2, I)):
            w.copy_(torch.randn(w.shape, device="cuda", generator=gen) * fan_in**-0.5)
    return experts.bfloat16()


@pytest.mark.parametrize("counts", [[0, 37, 128, 0, 5, 200, 1, 0], [64] * 8, [0] * 7 + [300]])
def test_grouped_experts_match_the_loop(counts):
    # `counts` rows go to each expert: token t's two choices are expert e(t) and the next non-empty expert
    gen = torch.Generator(device="cuda").manual_seed(sum(counts))
    E, D, I, k = len(counts), 256, 128, 2
    first = torch.repeat_interleave(torch.arange(E), torch.tensor(counts)).cuda()
    nonempty = [e for e, c in enumerate(counts) if c]
    second = torch.tensor([nonempty[(nonempty.index(e) + 1) % len(nonempty)] for e in first.tolist()]).cuda()
    expert_ids = torch.stack([first, second], dim=1)
    n = expert_ids.shape[0]
    weights = torch.rand(n, k, device="cuda", generator=gen)  # fp32, as the router gives them
    x = torch.randn(n, D, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(n, D, device="cuda", generator=gen)

    grouped = routed_experts("torch_mm", E, D, I, gen)
    loop = routed_experts("torch", E, D, I, gen)
    exact = routed_experts("torch", E, D, I, gen)
    loop.load_state_dict(grouped.state_dict())
    exact.load_state_dict(grouped.state_dict())
    exact.double()  # the same bf16 weights, fp64 GEMMs: the independent reference
    xg, xl, xe = x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()
    y, y_loop, y_exact = grouped(xg, expert_ids, weights), loop(xl, expert_ids, weights), exact(xe, expert_ids, weights)
    for out in (y, y_loop, y_exact):
        out.backward(dy.to(out.dtype))
    assert y.dtype == torch.float32 and y.shape == (n, D)

    # Per tensor: the grouped GEMMs are no further from fp64 than 2x the bf16 loop is (both round the GEMM
    # outputs to bf16; a dropped or misplaced group lands orders of magnitude outside). Was: rel. 1e-2 to the loop.
    used = [e for e in range(E) if (expert_ids == e).any()]
    pairs = {"out": (y, y_loop, y_exact), "dx": (xg.grad, xl.grad, xe.grad)}
    pairs.update({name: tuple(m.get_parameter(name).grad[used] for m in (grouped, loop, exact))
                  for name in ("w1", "w3", "w2")})
    errs = {name: (rel_err(g, ref), rel_err(l, ref)) for name, (g, l, ref) in pairs.items()}
    for name, (grouped_err, loop_err) in errs.items():
        report(f"{name}_loop_vs_fp64", loop_err)
        gate(f"{name}_vs_fp64", grouped_err, 2 * loop_err, inclusive=True)  # limit: 2x the loop's error
    for name in ("w1", "w3", "w2"):
        g = grouped.get_parameter(name).grad
        for e in range(E):  # an expert that got no token gets exactly zero gradient
            if e not in used:
                assert g[e].abs().max().item() == 0.0, (name, e)


def test_grouped_experts_forward_and_backward_do_not_sync_the_host():
    # the local (no expert parallelism) path: counting, sorting, dispatch, grouped GEMMs, SwiGLU and combine are
    # all queued on the device; a device-to-host read (bincount's, for one) would stall every MoE layer
    gen = torch.Generator(device="cuda").manual_seed(5)
    experts = routed_experts("torch_mm", 8, 256, 128, gen)
    x = torch.randn(300, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
    expert_ids = torch.randint(0, 8, (300, 2), device="cuda", generator=gen)
    weights = torch.rand(300, 2, device="cuda", generator=gen).requires_grad_()
    shared = torch.randn(300, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
    experts(x, expert_ids, weights, shared).sum().backward()  # warm-up: kernels compiled, caches filled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = experts(x, expert_ids, weights, shared)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.dtype == torch.bfloat16 and x.grad is not None and weights.grad is not None and shared.grad is not None
