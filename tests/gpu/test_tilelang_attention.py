"""TileLang sparse attention and indexer kernels against the PyTorch numerics contract.

Needs a CUDA GPU (Hopper) and the package tilelang; otherwise every GPU test skips with the reason.
"""

import pytest
import torch
from gpu_metrics import gate, report

from deepseek_v41 import kernels_tilelang as kt
from deepseek_v41.sparse_attention import indexer_scores_torch, sparse_attention_torch

AVAILABLE, REASON = kt.tilelang_available()

WINDOW = 128


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    # relative L2 error; NaN anywhere fails
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def csa2_indices(b, s, ratio, topk, device, gen):
    """V4.1-style idx [b, s, 128 + topk]: the causal window, then compressed entries offset by s.

    Query 0 sees only itself (its window is {0} and no compressed entry is visible at ratio >= 2);
    early queries have many -1 slots; the last query of batch 0 has none at all (all -1).
    """
    pos = torch.arange(s, device=device)
    window = pos.view(s, 1) - torch.arange(WINDOW - 1, -1, -1, device=device).view(1, WINDOW)
    window = torch.where(window >= 0, window, torch.full_like(window, -1))
    n_comp = s // ratio
    visible = (pos + 1) // ratio  # compressed entries t < visible[i]
    scores = torch.rand(b, s, n_comp, device=device, generator=gen)
    scores = scores.masked_fill(torch.arange(n_comp, device=device).view(1, 1, -1) >= visible.view(1, s, 1), -1.0)
    k = min(topk, n_comp)
    top = scores.topk(k, dim=-1)
    comp = torch.where(top.values >= 0, top.indices + s, torch.full_like(top.indices, -1))
    comp = torch.cat([comp, comp.new_full((b, s, topk - k), -1)], dim=-1)
    idx = torch.cat([window.expand(b, s, WINDOW), comp], dim=-1).int()
    idx[0, -1] = -1
    return idx


def make_case(b, s, h, d, topk, ratio, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = s + s // ratio
    q = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(b, n, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(h, device="cuda", generator=gen)
    idx = csa2_indices(b, s, ratio, topk, "cuda", gen)
    do = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    return q, kv, sink, idx, do


SHAPES = [
    # (b, s, h, d, topk, ratio): k = 128 window slots + topk
    pytest.param(1, 256, 16, 512, 64, 2, id="b1_s256_h16_k192"),
    pytest.param(2, 512, 64, 512, 512, 1, id="b2_s512_h64_k640"),
    # d = 192 (24 copy chunks a row), 80 heads (two head blocks, padded), k = 328 padded to 384
    pytest.param(1, 200, 80, 192, 200, 4, id="b1_s200_h80_d192_k328"),
]


def test_availability_reason_names_missing_piece():
    ok, reason = kt.tilelang_available()
    if ok:
        assert reason == ""
    else:
        assert "attn backend 'tilelang' needs" in reason
        assert ("CUDA GPU" in reason) or ("pip install 'deepseek_v41[gpu]'" in reason) or ("Hopper" in reason)


@pytest.mark.parametrize("b,s,h,d,topk,ratio", SHAPES)
@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
def test_sparse_attention_matches_torch(b, s, h, d, topk, ratio):
    q, kv, sink, idx, do = make_case(b, s, h, d, topk, ratio, seed=s + h)
    scale = d**-0.5

    # reference in fp32 from the same bf16 values
    qr, kvr, sr = (t.detach().float().requires_grad_() for t in (q, kv, sink))
    out_ref = sparse_attention_torch(qr, kvr, sr, idx, scale)
    out_ref.backward(do.float())

    qt, kvt, st = (t.detach().clone().requires_grad_() for t in (q, kv, sink))
    out = kt.sparse_attention_tilelang(qt, kvt, st, idx, scale)
    out.backward(do)

    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.isfinite(out).all()
    # the query whose only slot is itself, and the row with no slot at all
    gate("out_query0", rel_err(out[:, 0], out_ref[:, 0]), 1e-2)
    assert out[0, -1].abs().max().item() == 0.0
    errs = {
        "out": rel_err(out, out_ref),
        "dq": rel_err(qt.grad, qr.grad),
        "dkv": rel_err(kvt.grad, kvr.grad),
        "dsink": rel_err(st.grad, sr.grad),
    }
    print(errs)
    for k, e in errs.items():
        gate(k, e, 1e-2)


def _grads(q, kv, sink, idx, do, scale):
    qt, kvt, st = (t.detach().clone().requires_grad_() for t in (q, kv, sink))
    kt.sparse_attention_tilelang(qt, kvt, st, idx, scale).backward(do)
    return qt.grad, kvt.grad, st.grad


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
def test_backward_is_bit_deterministic_at_v41_shape(monkeypatch):
    # V4.1 shape: 64 heads x 512, k = 128 window + 512 compressed slots, s = 4096 (ratio 1: 4096 compressed rows)
    b, s, h, d, topk, ratio = 1, 4096, 64, 512, 512, 1
    q, kv, sink, idx, do = make_case(b, s, h, d, topk, ratio, seed=11)
    scale = d**-0.5
    monkeypatch.delenv("DS41_SPARSE_BWD", raising=False)
    first = _grads(q, kv, sink, idx, do, scale)
    # the atomic opt-in in between (other work, other allocations), then the default again on a side stream
    monkeypatch.setenv("DS41_SPARSE_BWD", "atomic")
    atomic = _grads(q, kv, sink, idx, do, scale)
    monkeypatch.delenv("DS41_SPARSE_BWD")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        second = _grads(q, kv, sink, idx, do, scale)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for name, x, y in zip(("dq", "dkv", "dsink"), first, second):
        assert torch.equal(x, y), f"{name} differs between two runs of the default backward"
    # measured on an H100 (2026-12-07): dq 1.7e-5, dkv 2.6e-3 (the atomic sum's order), dsink 1.4e-7
    for name, x, y in zip(("dq", "dkv", "dsink"), first, atomic):
        gate(f"{name}_vs_atomic", rel_err(x, y), {"dq": 1e-4, "dkv": 5e-3, "dsink": 1e-6}[name])

    qr, kvr, sr = (t.detach().float().requires_grad_() for t in (q, kv, sink))
    sparse_attention_torch(qr, kvr, sr, idx, scale).backward(do.float())
    errs = {name: rel_err(x, ref.grad) for name, x, ref in zip(("dq", "dkv", "dsink"), first, (qr, kvr, sr))}
    print(errs)
    for k, e in errs.items():
        gate(f"{k}_vs_fp32", e, 1e-2)
    with pytest.raises(ValueError, match="DS41_SPARSE_BWD"):
        monkeypatch.setenv("DS41_SPARSE_BWD", "fast")
        _grads(q[:, :128], kv, sink, idx[:, :128], do[:, :128], scale)


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
def test_empty_blocks_before_between_and_after_keys():
    # Both kernels skip the blocks after a query's last key.  Queries here have keys only in the last block of
    # 64 slots (after empty blocks: none may be skipped), only in the first (the rest skipped), in the first and the
    # last (an empty block between), or none; against fp32, and bit-identical with 256 more empty slots appended
    gen = torch.Generator(device="cuda").manual_seed(9)
    b, s, h, n, d, k = 2, 160, 64, 300, 512, 256
    q = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(b, n, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(h, device="cuda", generator=gen)
    do = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    idx = torch.randint(0, n, (b, s, k), device="cuda", generator=gen, dtype=torch.int32)
    pattern = torch.arange(s, device="cuda") % 5
    blocks = idx.view(b, s, k // 64, 64)
    blocks[:, pattern == 0, :3] = -1  # keys in the last block only
    blocks[:, pattern == 1, 1:] = -1  # the first block only
    blocks[:, pattern == 2, 1:3] = -1  # the first and the last
    blocks[:, pattern == 3] = -1  # no key at all
    blocks[:, :, :, 50:][torch.rand(b, s, k // 64, 14, device="cuda", generator=gen) < 0.5] = -1  # holes in blocks
    scale = d**-0.5

    qt, kvt, st = (t.detach().clone().requires_grad_() for t in (q, kv, sink))
    out = kt.sparse_attention_tilelang(qt, kvt, st, idx, scale)
    out.backward(do)
    qr, kvr, sr = (t.detach().float().requires_grad_() for t in (q, kv, sink))
    out_ref = sparse_attention_torch(qr, kvr, sr, idx, scale)
    out_ref.backward(do.float())
    errs = {"out": rel_err(out, out_ref), "dq": rel_err(qt.grad, qr.grad), "dkv": rel_err(kvt.grad, kvr.grad),
            "dsink": rel_err(st.grad, sr.grad)}
    # measured on an H100 (2026-12-07): out 2.1e-3, dq 2.4e-3, dkv 2.9e-3 (bf16 rounding), dsink 9.0e-4
    for k, e in errs.items():
        gate(k, e, 5e-3 if k == "dsink" else 1e-2)
    assert out[:, pattern == 3].abs().max().item() == 0.0

    padded = torch.cat([idx, torch.full_like(idx, -1)], dim=-1)
    qp, kvp, sp = (t.detach().clone().requires_grad_() for t in (q, kv, sink))
    out_p = kt.sparse_attention_tilelang(qp, kvp, sp, padded, scale)
    out_p.backward(do)
    for name, x, y in (("out", out, out_p), ("dq", qt.grad, qp.grad), ("dkv", kvt.grad, kvp.grad),
                       ("dsink", st.grad, sp.grad)):
        assert torch.equal(x, y), f"{name} changed when empty slots were appended"


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
@pytest.mark.parametrize("chunk", [None, 64])
def test_backward_sums_repeated_rows(monkeypatch, chunk):
    # idx rows may name one kv row in several slots (the model never does): each slot's gradient counts.
    # chunk 64: the per-slot buffer limited to 64 queries, so each batch row runs as chunks of 64 + 32 queries
    # summed into an fp32 dkv (what rows longer than SLOT_GRAD_BYTES allow do)
    if chunk:
        monkeypatch.setattr(kt, "SLOT_GRAD_BYTES", chunk * 128 * 512 * 2)
        assert kt.slot_chunk(96, 64, 128, 512) == chunk
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, s, h, n, d, k = 2, 96, 64, 40, 512, 128
    q = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(b, n, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(h, device="cuda", generator=gen)
    idx = torch.randint(0, n, (b, s, k), device="cuda", generator=gen, dtype=torch.int32)
    idx[torch.rand(b, s, k, device="cuda", generator=gen) < 0.2] = -1
    do = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    dq, dkv, dsink = _grads(q, kv, sink, idx, do, d**-0.5)
    assert all(torch.equal(x, y) for x, y in zip((dq, dkv, dsink), _grads(q, kv, sink, idx, do, d**-0.5)))
    qr, kvr, sr = (t.detach().float().requires_grad_() for t in (q, kv, sink))
    sparse_attention_torch(qr, kvr, sr, idx, d**-0.5).backward(do.float())
    errs = {"dq": rel_err(dq, qr.grad), "dkv": rel_err(dkv, kvr.grad), "dsink": rel_err(dsink, sr.grad)}
    for k, e in errs.items():
        gate(k, e, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
@pytest.mark.parametrize("d,groups", [(512, 1), (192, 2)])
def test_slot_gradient_sum_matches_fp32_scatter(d, groups):
    # the deterministic backward's row sum on its own: rows with thousands of entries (many loop steps), rows
    # with none (written as zeros), empty slots skipped, a head dim that is not a power of two, two head blocks
    # per query; bf16 out is the fp32 sum rounded once; fp32 out with accumulate adds to what it holds
    gen = torch.Generator(device="cuda").manual_seed(11)
    s, k, n = 300, 192, 50
    idx = torch.randint(0, n - 3, (s, k), device="cuda", generator=gen, dtype=torch.int32)  # rows n-3.. get none
    idx[torch.rand(s, k, device="cuda", generator=gen) < 0.1] = -1
    g = torch.randn(s * groups, k, d, device="cuda", generator=gen).bfloat16()
    rows = torch.where(idx >= 0, idx, n).long().unsqueeze(1).expand(s, groups, k).reshape(-1)
    ref = torch.zeros(n + 1, d, device="cuda", dtype=torch.float64).index_add_(0, rows, g.reshape(-1, d).double())[:n]
    out = torch.full((n, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    kt._reduce_slot_grads(g, idx, out)
    assert torch.equal(out[n - 3:], torch.zeros_like(out[n - 3:]))
    # allclose passes where |out - ref| <= atol + rtol |ref|: the excess over rtol |ref| is what atol covers
    report("bf16_sum_maxabs", (out.double() - ref).abs().max().item())
    report("bf16_sum_excess_over_rtol", ((out.double() - ref).abs() - 2**-8 * ref.abs()).max().item())
    assert torch.allclose(out.double(), ref, rtol=2**-8, atol=1e-3), (out.double() - ref).abs().max()
    again = torch.empty_like(out)
    kt._reduce_slot_grads(g, idx, again)
    assert torch.equal(out, again)
    prior = torch.randn(n, d, device="cuda", generator=gen)
    acc = prior.clone()
    kt._reduce_slot_grads(g, idx, acc, accumulate=True)
    acc_ref = prior.double() + ref
    acc_diff = (acc.double() - acc_ref).abs()
    report("fp32_accumulate_maxabs", acc_diff.max().item())
    report("fp32_accumulate_excess_over_rtol", (acc_diff - 1e-5 * acc_ref.abs()).max().item())
    assert torch.allclose(acc.double(), prior.double() + ref, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
def test_public_entry_point_and_input_errors():
    # k = 128 + 40 slots (padded inside to 192) and int64 indices, as the model passes them
    q, kv, sink, idx, _ = make_case(1, 128, 64, 512, 40, 2, seed=3)
    idx = idx.long()
    out = kt.sparse_attention_tilelang(q, kv, sink, idx, 512**-0.5)
    ref = sparse_attention_torch(q, kv, sink, idx, 512**-0.5)
    gate("out_vs_torch", rel_err(out, ref), 1e-2)
    with pytest.raises(TypeError, match="bfloat16"):
        kt.sparse_attention_tilelang(q.float(), kv, sink, idx, 512**-0.5)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        kt.sparse_attention_tilelang(q, kv[:, :, :256], sink, idx, 512**-0.5)


@pytest.mark.parametrize("b,s,ratio", [(1, 512, 1), (2, 384, 2)])
@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
def test_indexer_scores_match_torch(b, s, ratio):
    gen = torch.Generator(device="cuda").manual_seed(s)
    H, D, T_ = 32, 128, s // ratio
    q = torch.randn(b, s, H, D, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(b, s, H, device="cuda", generator=gen) * (D**-0.5 * H**-0.5)).bfloat16()
    k = torch.randn(b, T_, D, device="cuda", generator=gen).bfloat16()
    out = kt.indexer_scores_tilelang(q, w, k, ratio)
    ref = indexer_scores_torch(q, w, k, ratio)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite)
    assert (out[~finite] == float("-inf")).all()
    gate("scores_vs_torch", rel_err(out[finite], ref[finite]), 1e-6)  # measured 1.7e-7 (fp32 sums, H100)


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
def test_indexer_query_chunks_match_one_call():
    # A long prefill scores its queries in chunks, each call told its first query's position (query_offset).
    # Chunks of 301 queries (not a multiple of the kernel's 4-query blocks; odd offsets at ratio 2) against one
    # call over all 903: each score is the same per-element GEMM and head sum, so the bits must agree.
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, s, chunk, ratio, H, D = 2, 903, 301, 2, 32, 128
    q = torch.randn(b, s, H, D, device="cuda", generator=gen).bfloat16()
    w = torch.randn(b, s, H, device="cuda", generator=gen) * (D**-0.5 * H**-0.5)
    k = torch.randn(b, s // ratio, D, device="cuda", generator=gen).bfloat16()
    one = kt.indexer_scores_tilelang(q, w, k, ratio)
    parts = [kt.indexer_scores_tilelang(q[:, q0 : q0 + chunk], w[:, q0 : q0 + chunk], k, ratio, query_offset=q0)
             for q0 in range(0, s, chunk)]
    assert torch.equal(torch.cat(parts, 1), one)
    tail = torch.cat(parts[1:], 1)  # queries 301.. against the contract, told the same offset
    ref = indexer_scores_torch(q[:, chunk:], w[:, chunk:], k, ratio, query_offset=chunk)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(tail), finite)
    gate("tail_vs_torch", rel_err(tail[finite], ref[finite]), 1e-6)  # as the unchunked test above (1.7e-7)
    with pytest.raises(ValueError, match="query_offset"):
        kt.indexer_scores_tilelang(q, w, k, ratio, query_offset=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
def test_warmup_builds_and_caches():
    spec = {"b": 1, "s": 128, "n": 192, "h": 64, "d": 512, "k": 192, "scale": 512**-0.5}
    indexer = {"kind": "indexer", "b": 1, "s": 128, "T": 64, "H": 32, "D": 128, "ratio": 2}
    from deepseek_v41 import sparse_attention_cuda, sparse_attention_cuda_bwd

    def cached():  # TileLang's kernels and the CUDA ones (head dim 512 on Hopper)
        return len(kt._KERNELS) + len(sparse_attention_cuda._kernels) + len(sparse_attention_cuda_bwd._kernels)

    built = kt.warmup_tilelang_kernels([spec, indexer])
    size = cached()
    assert built >= 3 and size >= 3
    kt.warmup_tilelang_kernels([spec])
    assert cached() == size  # second call hits the in-process cache
    with pytest.raises(TypeError, match="one dict per kernel shape"):
        kt.warmup_tilelang_kernels([(1, 128)])


# ---- the CUDA forward (head dim 512 on Hopper) ----

def _cuda_fwd_usable() -> bool:
    return AVAILABLE and torch.cuda.get_device_capability() == (9, 0)


def _lse2_torch(q, kv, sink, idx, scale):
    # base-2 log-sum-exp over [selected logits ; sink] in fp32: what the forward kernels save for the backward
    b, s, h, d = q.shape
    rows = torch.gather(kv.float(), 1, idx.clamp(min=0).long().reshape(b, -1, 1).expand(-1, -1, d)).view(b, s, -1, d)
    logits = torch.einsum("bshd,bskd->bshk", q.float(), rows) * scale
    logits = logits.masked_fill(~(idx >= 0).unsqueeze(2), float("-inf"))
    full = torch.cat([logits, sink.float().view(1, 1, h, 1).expand(b, s, h, 1)], dim=-1)
    return torch.logsumexp(full, dim=-1) * kt.LOG2E


@pytest.mark.parametrize(
    "b,s,h,n,k,empty",
    [
        pytest.param(2, 256, 128, 300, 256, 0.3, id="b2_h128_k256_empty30"),
        pytest.param(1, 200, 64, 150, 192, 0.5, id="k192_padded_to_256"),  # odd number of 64-slot blocks
        pytest.param(1, 130, 64, 5000, 640, 0.0, id="k640_full"),  # fewer items than multiprocessors
        pytest.param(1, 24, 64, 5000, 3840, 0.2, id="k3840_max_slots"),  # the largest index row shared memory takes
    ],
)
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fwd_usable(), reason=REASON or "the CUDA forward needs a Hopper GPU")
def test_cuda_forward_matches_tilelang_forward_and_fp32(b, s, h, n, k, empty):
    from deepseek_v41.sparse_attention_cuda import sparse_attention_forward_cuda

    gen = torch.Generator(device="cuda").manual_seed(k + h)
    d, scale = 512, 512**-0.5
    q = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(b, n, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(h, device="cuda", generator=gen)
    idx = torch.randint(0, n, (b, s, k), device="cuda", generator=gen, dtype=torch.int32)
    idx[torch.rand(b, s, k, device="cuda", generator=gen) < empty] = -1
    idx[0, 1] = -1  # a query with no key at all: O = 0, lse2 = the sink alone
    sink2 = (sink * kt.LOG2E).contiguous()

    o, lse2 = sparse_attention_forward_cuda(q, kv, idx, sink2, scale)
    kp = -(-k // 64) * 64
    idx64 = torch.full((b, s, kp), -1, dtype=torch.int32, device="cuda")
    idx64[:, :, :k] = idx
    o_tl, lse2_tl = torch.empty_like(q), torch.empty(b, s, h, device="cuda")
    kt._attn_fwd_kernel(b, s, n, h, d, kp, scale, ("cuda", torch.cuda.current_device()))(
        q, kv, idx64, sink2, o_tl, lse2_tl
    )
    o_ref = sparse_attention_torch(q.float(), kv.float(), sink, idx, scale)
    lse2_ref = _lse2_torch(q, kv, sink, idx, scale)

    assert o.dtype == torch.bfloat16 and o.shape == q.shape and torch.isfinite(o).all()
    assert o[0, 1].abs().max().item() == 0.0
    torch.testing.assert_close(lse2[0, 1], sink2, rtol=0, atol=1e-6)
    errs = {
        "o_vs_fp32": rel_err(o, o_ref),
        "o_tilelang_vs_fp32": rel_err(o_tl, o_ref),
        "o_vs_tilelang": rel_err(o, o_tl),
        "lse2_vs_fp32": (lse2 - lse2_ref).abs().max().item(),
        "lse2_vs_tilelang": (lse2 - lse2_tl).abs().max().item(),
    }
    print(errs)
    gate("o_vs_fp32", errs["o_vs_fp32"], 1e-2)
    gate("o_vs_tilelang", errs["o_vs_tilelang"], 5e-3)
    # P is rounded to bf16 after the softmax in both kernels: no worse than the TileLang forward, within noise
    report("o_tilelang_vs_fp32", errs["o_tilelang_vs_fp32"])
    gate("o_vs_fp32_within_1p2x_tilelang", errs["o_vs_fp32"], 1.2 * errs["o_tilelang_vs_fp32"])
    gate("lse2_vs_fp32", errs["lse2_vs_fp32"], 1.5e-5)  # measured 2.9e-6 (H100)
    gate("lse2_vs_tilelang", errs["lse2_vs_tilelang"], 1e-5)  # measured 1.9e-6


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fwd_usable(), reason=REASON or "the CUDA forward needs a Hopper GPU")
def test_backend_forward_uses_cuda_at_d512_unless_told_otherwise(monkeypatch):
    from deepseek_v41 import sparse_attention_cuda

    calls = []

    def counting(*args):
        calls.append(args[0].shape)
        return sparse_attention_cuda.sparse_attention_forward_cuda(*args)

    monkeypatch.setattr(kt, "sparse_attention_forward_cuda", counting)
    q, kv, sink, idx, _do = make_case(1, 128, 64, 512, 64, 2, seed=3)
    kt.sparse_attention_tilelang(q, kv, sink, idx, 512**-0.5)
    assert len(calls) == 1
    q2, kv2, sink2, idx2, _ = make_case(1, 128, 64, 192, 64, 2, seed=3)
    kt.sparse_attention_tilelang(q2, kv2, sink2, idx2, 192**-0.5)  # head dim 192: the TileLang forward
    monkeypatch.setenv("DS41_SPARSE_FWD", "tilelang")
    out_tl = kt.sparse_attention_tilelang(q, kv, sink, idx, 512**-0.5)
    assert len(calls) == 1
    monkeypatch.delenv("DS41_SPARSE_FWD")
    out_cuda = kt.sparse_attention_tilelang(q, kv, sink, idx, 512**-0.5)
    assert len(calls) == 2
    gate("cuda_vs_tilelang", rel_err(out_cuda, out_tl), 2e-3)  # measured 4.1e-4 (H100)
    kernel = sparse_attention_cuda.cuda_forward_kernel(256)
    assert kernel.local_bytes() == 0, "the CUDA forward spills registers"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fwd_usable(), reason=REASON or "the CUDA forward needs a Hopper GPU")
def test_cuda_forward_gives_the_same_bits_on_any_number_of_ctas(monkeypatch):
    # the forward is persistent: CTA x computes items x, x + CTAs, ... while its producer loads the next item's index
    # row and Q ahead.  An item's result must not depend on the CTA that computes it or on the items before it
    # there: index rows of every length (queries without keys, a single block, repeated rows), two batches, 128 heads
    from deepseek_v41 import sparse_attention_cuda as sac

    gen = torch.Generator(device="cuda").manual_seed(7)
    b, s, h, n, k, d = 2, 67, 128, 400, 384, 512
    q = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(b, n, d, device="cuda", generator=gen).bfloat16()
    sink2 = torch.randn(h, device="cuda", generator=gen)
    rows = torch.randint(0, n, (b, s, k), device="cuda", generator=gen, dtype=torch.int32)
    lengths = torch.randint(0, k + 1, (b, s, 1), device="cuda", generator=gen)
    lengths[:, ::7] = 0
    lengths[:, 3::7] = 64
    idx = torch.where(torch.arange(k, device="cuda") < lengths, rows, -1).int()
    idx[:, 2::5, :64] = idx[:, 2::5, :1]  # one row repeated over a block
    runs = []
    for ctas in (None, 1, 3, 7, 1000):
        if ctas is not None:
            monkeypatch.setattr(sac, "forward_grid", lambda b, s, h, device, c=ctas: (min(c, b * s * h // 64), 1, 1))
        runs.append(sac.sparse_attention_forward_cuda(q, kv, idx, sink2, d**-0.5))
    o_ref = sparse_attention_torch(q.float(), kv.float(), sink2 / kt.LOG2E, idx, d**-0.5)
    gate("o_vs_fp32", rel_err(runs[0][0], o_ref), 1e-2)
    for o, lse2 in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(lse2, runs[0][1])


# ---- the CUDA backward's slot kernel (head dim 512 on Hopper) ----


@pytest.mark.parametrize(
    "b,s,h,n,k,empty",
    [
        pytest.param(2, 160, 128, 300, 256, 0.3, id="b2_h128_k256_empty30"),
        pytest.param(1, 130, 64, 5000, 640, 0.0, id="k640_full"),
    ],
)
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fwd_usable(), reason=REASON or "the CUDA backward needs a Hopper GPU")
def test_cuda_slot_kernel_matches_tilelang_and_fp32(b, s, h, n, k, empty):
    # Δ, dQ and every written slot gradient against the TileLang kernel of the same contract, and the summed dkv
    # against fp32 autograd; queries with keys in the first block only (later blocks skipped, never written), none at
    # all, or only in the last block; twice bit-identical; no register spills
    from deepseek_v41 import sparse_attention_cuda_bwd as bwd
    from deepseek_v41.sparse_attention_cuda import sparse_attention_forward_cuda

    gen = torch.Generator(device="cuda").manual_seed(k + h + 1)
    d, scale, g = 512, 512**-0.5, h // 64
    q = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(b, n, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(h, device="cuda", generator=gen)
    do = torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16()
    idx = torch.randint(0, n, (b, s, k), device="cuda", generator=gen, dtype=torch.int32)
    idx[torch.rand(b, s, k, device="cuda", generator=gen) < empty] = -1
    idx[0, 3, 64:] = -1  # the first block only
    idx[0, 4] = -1  # no key
    idx[-1, 5, : k - 64] = -1  # the last block only
    o, lse2 = sparse_attention_forward_cuda(q, kv, idx, (sink * kt.LOG2E).contiguous(), scale)

    def cuda_run():
        out = (torch.full((b, s, h), float("nan"), device="cuda"), torch.full_like(q, float("nan")),
               torch.full((b, s * g, k, d), float("nan"), device="cuda", dtype=torch.bfloat16))
        bwd.sparse_attention_slot_grads_cuda(q, kv, o, do, idx, lse2, *out, scale)
        return out

    delta, dq, slots = cuda_run()
    tl_out = (torch.empty(b, s, h, device="cuda"), torch.empty_like(q),
              torch.zeros(b, s * g, k, d, device="cuda", dtype=torch.bfloat16))
    kt._compile(kt._build_attn_bwd_slots(b, s, n, h, d, k, scale))(q, kv, o, do, idx, lse2, *tl_out)
    delta_tl, dq_tl, slots_tl = tl_out

    written = (idx >= 0).unsqueeze(2).expand(b, s, g, k).reshape(b, s * g, k)
    blocks = (idx.view(b, s, k // 64, 64) >= 0).any(-1)  # blocks up to the last key are written
    last = torch.where(blocks, torch.arange(1, k // 64 + 1, device="cuda"), 0).amax(-1)
    in_run = (torch.arange(k, device="cuda") // 64 < last.unsqueeze(-1)).unsqueeze(2).expand(b, s, g, k)
    in_run = in_run.reshape(b, s * g, k)
    assert torch.isfinite(slots[in_run]).all() and slots[~in_run].isnan().all()
    assert torch.equal(slots[in_run & ~written], torch.zeros_like(slots[in_run & ~written]))
    errs = {
        "delta": rel_err(delta, (do.float() * o.float()).sum(-1)),
        "delta_vs_tilelang": rel_err(delta, delta_tl),
        "dq_vs_tilelang": rel_err(dq, dq_tl),
        "slots_vs_tilelang": rel_err(slots[written], slots_tl[written]),
    }
    dkv = torch.empty(b, n, d, device="cuda", dtype=torch.bfloat16)
    for r in range(b):
        kt._reduce_slot_grads(slots[r], idx[r], dkv[r])
    qr, kvr = (t.detach().float().requires_grad_() for t in (q, kv))
    sparse_attention_torch(qr, kvr, sink, idx, scale).backward(do.float())
    errs |= {"dq_vs_fp32": rel_err(dq, qr.grad), "dkv_vs_fp32": rel_err(dkv, kvr.grad)}
    print(errs)
    # measured on an H100 (2026-12-07): delta 1.0e-7 both, dq vs TileLang 2.3e-5, slots 1.3e-5
    gate("delta", errs["delta"], 5e-7)
    gate("delta_vs_tilelang", errs["delta_vs_tilelang"], 5e-7)
    gate("dq_vs_tilelang", errs["dq_vs_tilelang"], 1e-4)
    gate("slots_vs_tilelang", errs["slots_vs_tilelang"], 6e-5)
    gate("dq_vs_fp32", errs["dq_vs_fp32"], 1e-2)
    gate("dkv_vs_fp32", errs["dkv_vs_fp32"], 1e-2)
    assert dq[0, 4].abs().max().item() == 0.0  # no key: no gradient
    again = cuda_run()
    assert all(torch.equal(x[m], y[m]) for x, y, m in zip(again, (delta, dq, slots), (..., ..., in_run)))
    assert bwd.cuda_backward_kernel(k).local_bytes() == 0, "the CUDA backward spills registers"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fwd_usable(), reason=REASON or "the CUDA backward needs a Hopper GPU")
def test_backend_backward_uses_cuda_slots_at_d512_unless_told_otherwise(monkeypatch):
    from deepseek_v41 import sparse_attention_cuda_bwd

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return sparse_attention_cuda_bwd.sparse_attention_slot_grads_cuda(*args, **kwargs)

    monkeypatch.setattr(kt, "sparse_attention_slot_grads_cuda", counting)
    q, kv, sink, idx, do = make_case(2, 128, 64, 512, 64, 2, seed=4)
    monkeypatch.delenv("DS41_SPARSE_BWD", raising=False)
    cuda = _grads(q, kv, sink, idx, do, 512**-0.5)
    assert len(calls) == 2  # one batch row at a time
    monkeypatch.setenv("DS41_SPARSE_BWD_SLOTS", "tilelang")
    tile = _grads(q, kv, sink, idx, do, 512**-0.5)
    assert len(calls) == 2
    # measured on an H100 (2026-12-07): dq 8.0e-6, dkv 1.9e-5, dsink 1.4e-7
    for name, x, y in zip(("dq", "dkv", "dsink"), cuda, tile):
        gate(f"{name}_cuda_vs_tilelang", rel_err(x, y), {"dq": 4e-5, "dkv": 1e-4, "dsink": 1e-6}[name])
