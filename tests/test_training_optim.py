"""RemainderAdamW (bf16 params + int16 remainders), the LR schedule and global clipping."""

import itertools
import math

import torch

from deepseek_v41.training.optim import RemainderAdamW, clip_grad_norm_, join_master, lr_at, split_master


def test_join_split_roundtrip_is_bit_exact():
    x = torch.randn(1000) * torch.logspace(-30, 30, 1000)
    high, low = split_master(x)
    assert torch.equal(join_master(high, low).view(torch.int32), x.view(torch.int32))
    assert torch.equal(high.view(torch.int16), (x.view(torch.int32) >> 16).to(torch.int16))


def test_remainder_master_matches_fp32_adamw_bit_exactly():
    torch.manual_seed(0)
    start = torch.randn(33, 7).bfloat16().float()  # a bf16 checkpoint value is an exact fp32 master
    ref_param = torch.nn.Parameter(start.clone())
    param = torch.nn.Parameter(start.clone().bfloat16())
    fp32_island = torch.nn.Parameter(torch.randn(5))
    island_ref = torch.nn.Parameter(fp32_island.detach().clone())
    kw = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ref = torch.optim.AdamW([ref_param, island_ref], foreach=False, **kw)
    ours = RemainderAdamW([param, fp32_island], **kw)
    for _ in range(12):
        g = torch.randn(33, 7).bfloat16()  # bf16 params get bf16 gradients
        g5 = torch.randn(5)
        ref_param.grad, param.grad = g.float(), g.clone()
        island_ref.grad, fp32_island.grad = g5.clone(), g5.clone()
        ref.step()
        ours.step()
        master = ours.master_weight(param)
        assert torch.equal(master.view(torch.int32), ref_param.detach().view(torch.int32))
        assert torch.equal(param.detach().view(torch.int16), split_master(master)[0].view(torch.int16))
        assert torch.equal(fp32_island.detach(), island_ref.detach())
    assert not torch.equal(param.detach().float(), start)  # the weights did move


def test_bf16_moments_keep_the_high_half_invariant():
    torch.manual_seed(1)
    param = torch.nn.Parameter(torch.randn(64).bfloat16())
    opt = RemainderAdamW([param], lr=1e-2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for _ in range(5):
        param.grad = torch.randn(64).bfloat16()
        opt.step()
        assert opt.state[param]["exp_avg"].dtype == torch.bfloat16
        high, _ = split_master(opt.master_weight(param))
        assert torch.equal(high.view(torch.int16), param.detach().view(torch.int16))


def test_warmup_then_cosine_schedule():
    cfg = {"lr_warmup_steps": 10, "lr_decay_steps": 100, "lr_decay_style": "cosine", "min_lr": 1e-6}
    assert lr_at(0, cfg, 1e-5) == 0.0  # warmup starts at 0
    assert math.isclose(lr_at(5, cfg, 1e-5), 5e-6)
    assert math.isclose(lr_at(10, cfg, 1e-5), 1e-5)
    assert math.isclose(lr_at(55, cfg, 1e-5), 1e-6 + 0.5 * (1e-5 - 1e-6))
    assert lr_at(100, cfg, 1e-5) == 1e-6 and lr_at(150, cfg, 1e-5) == 1e-6
    lrs = [lr_at(s, cfg, 1e-5) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_clip_uses_the_global_norm_and_replica_counts():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((4,), 1.0)
    norm = clip_grad_norm_([a, b], max_norm=1.0, replicas={b: 4})  # b counted once over 4 replicas
    assert math.isclose(float(norm), math.sqrt(12 + 1), rel_tol=1e-6)
    assert math.isclose(float(a.grad[0]), 2.0 / math.sqrt(13), rel_tol=1e-5)
