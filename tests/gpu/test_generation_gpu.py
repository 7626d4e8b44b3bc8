"""Decode on the GPU: a TileLang prefill, then cached decode steps, against full TileLang forwards.

Needs a CUDA GPU and tilelang; skips with the reason otherwise.
"""

import pytest
import torch
from gpu_metrics import gate

from deepseek_v41 import kernels_tilelang as kt

AVAILABLE, REASON = kt.tilelang_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not AVAILABLE, reason=REASON)]


@torch.no_grad()
def test_tilelang_prefill_then_cached_decode_matches_full_forwards(v4_tokenizer):
    from conftest import tiny_model

    from deepseek_v41.modeling_deepseek_v41 import returned_cache
    from deepseek_v41.parity import logits_metrics

    heads = {"head_dim": 512, "qk_rope_head_dim": 64, "index_n_heads": 32, "index_head_dim": 128}
    model = tiny_model(v4_tokenizer, dtype=torch.bfloat16, text=heads, backend={"attn": "tilelang"}).cuda().eval()
    ids = torch.randint(3, 1024, (2, 61), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    prompt = 21
    out = model(ids[:, :prompt], use_cache=True)
    cache, cached = returned_cache(out), [out.logits[:, -1]]
    for t in range(prompt, ids.shape[1] - 1):
        cached.append(model(ids[:, t : t + 1], cache=cache).logits[:, -1])
    cached = torch.stack(cached, 1)
    full = model(ids[:, :-1]).logits[:, prompt - 1 :]
    metrics = logits_metrics(full, cached)
    print(f"GPU decode vs full forward: {metrics}")
    # The bf16 KL gates.  Top-1 is not gated here: this random tiny model's logits are nearly flat (on the
    # H200 only 1 of 80 positions led by more than twice the largest logit difference between the two
    # attention paths), so argmax flips on rounding; tests/test_generation.py gates top-1 on the golden model.
    # measured on an H100 (2026-12-07): mean 1.3e-5, max 1.1e-4; gates ~8x and ~5x (another GPU picks other kernels)
    gate("mean_kl", metrics["mean_kl"], 1e-4, inclusive=True)
    gate("max_kl", metrics["max_kl"], 5e-4, inclusive=True)
