"""``sparse_attention_torch`` (the reference the GPU kernels are tested against) on CPU, against a dense fp64
attention written out per query: empty slots (-1) anywhere in the row, queries with no key at all, the sink."""

import pytest
import torch

from deepseek_v41.sparse_attention import sparse_attention_torch


def dense_reference(q, kv, sink, idx, scale):
    # per query: softmax over [its valid keys ; the sink], the sink carrying no value; fp64
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    for i in range(b):
        for t in range(s):
            keys = idx[i, t][idx[i, t] >= 0].long()
            rows = kv[i, keys]  # [m, d]
            logits = torch.cat([q[i, t] @ rows.T * scale, sink.view(h, 1)], dim=1)  # [h, m + 1]
            out[i, t] = torch.softmax(logits, dim=1)[:, :-1] @ rows
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_empty_slots_and_keyless_queries_match_dense_attention(seed):
    gen = torch.Generator().manual_seed(seed)
    b, s, h, n, d, k = 2, 9, 3, 12, 8, 6
    q, kv = torch.randn(b, s, h, d, generator=gen), torch.randn(b, n, d, generator=gen)
    sink, do = torch.randn(h, generator=gen), torch.randn(b, s, h, d, generator=gen)
    idx = torch.randint(0, n, (b, s, k), generator=gen, dtype=torch.int32)
    idx[torch.rand(b, s, k, generator=gen) < 0.4] = -1  # holes anywhere in the row
    idx[0, 0] = -1  # no key at all: the output is 0, only the sink's gradient sees it
    idx[1, 2, :3] = -1  # keys in the last slots only
    idx[1, 3, 1:] = -1  # one key, then empty slots
    idx[1, 4] = torch.tensor([5, 5, -1, 7, -1, 5])  # a repeated key counts once per slot
    scale = d**-0.5

    leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
    out = sparse_attention_torch(*leaves[:2], leaves[2], idx, scale)
    out.backward(do)
    refs = [t.double().requires_grad_() for t in (q, kv, sink)]
    expected = dense_reference(*refs[:2], refs[2], idx, scale)
    expected.backward(do.double())
    # fp32 against fp64; an empty slot read as row 0, or a sink left out, errs by > 1e-1.  Measured |err| (1 and 2
    # threads, worst of the two seeds; the blockwise form's rescaled sums): out 7.0e-7, dq 4.4e-7, dkv 6.7e-7, dsink
    # 3.9e-7 (over 12 seeds: 7.0e-7, 1.7e-6, 1.5e-6, 5.3e-7); gates 4-5x: out 3e-6, dq / dkv 3e-6, dsink 2e-6
    torch.testing.assert_close(out.double(), expected, rtol=3e-6, atol=3e-6)
    for name, ours, ref, tol in zip(("dq", "dkv", "dsink"), leaves, refs, (3e-6, 3e-6, 2e-6)):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=tol, atol=tol, msg=name)
    assert torch.equal(out[0, 0], torch.zeros(h, d)) and torch.equal(leaves[0].grad[0, 0], torch.zeros(h, d))
    used = torch.zeros(b, n, dtype=torch.bool)
    for i in range(b):
        used[i, idx[i][idx[i] >= 0].long()] = True
    assert torch.equal(leaves[1].grad[~used], torch.zeros(int((~used).sum()), d))  # no row that only -1 names

    # appending empty slots changes nothing but the fp32 rounding of the longer reductions (their SIMD grouping):
    # measured <= 4.8e-7 (1 ulp at |x| ~ 3; bit-identical on some CPUs); an appended slot read as row 0 errs by > 1e-1
    padded = torch.cat([idx, torch.full_like(idx, -1)], dim=-1)
    again = [t.clone().requires_grad_() for t in (q, kv, sink)]
    out_p = sparse_attention_torch(*again[:2], again[2], padded, scale)
    out_p.backward(do)
    torch.testing.assert_close(out_p, out, rtol=0, atol=1e-6)
    for name, a, b in zip(("dq", "dkv", "dsink"), again, leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("k", [6, 150])
def test_blockwise_inference_path_matches_dense_attention(k):
    # The reference runs the official kernel's blockwise online softmax (64 slots a block,
    # unnormalised probabilities rounded to the KV dtype): fp32 inputs against the dense fp64 reference, one block
    # and three (k = 150, the first block of one query empty), a keyless query giving 0
    gen = torch.Generator().manual_seed(k)
    b, s, h, n, d = 2, 9, 3, 200, 8
    q, kv = torch.randn(b, s, h, d, generator=gen), torch.randn(b, n, d, generator=gen)
    sink = torch.randn(h, generator=gen)
    idx = torch.randint(0, n, (b, s, k), generator=gen, dtype=torch.int32)
    idx[torch.rand(b, s, k, generator=gen) < 0.4] = -1
    idx[0, 0] = -1
    idx[1, 1, : min(k, 70)] = -1
    with torch.no_grad():
        out = sparse_attention_torch(q, kv, sink, idx, d**-0.5)
    expected = dense_reference(q.double(), kv.double(), sink.double(), idx, d**-0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[0, 0], torch.zeros(h, d))
    # bf16: the same bits with and without autograd (training and evaluation forwards agree)
    qb, kvb = q.bfloat16(), kv.bfloat16()
    with torch.no_grad():
        plain = sparse_attention_torch(qb, kvb, sink, idx, d**-0.5)
    tracked = sparse_attention_torch(qb.clone().requires_grad_(), kvb, sink, idx, d**-0.5)
    assert torch.equal(plain, tracked.detach())
