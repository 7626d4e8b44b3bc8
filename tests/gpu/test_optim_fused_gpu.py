"""RemainderAdamW's one-pass CUDA update (the Triton kernel ``adamw_triton.adamw_triton_``: ``fused=True``, and the
default on CUDA) against its per-op path (``fused=False``) on the same GPU, bit for bit.

The kernel performs the eager CUDA per-op path's operations with the same roundings (``adamw_triton``'s
docstring: the FMAs of ATen's lerp / addcmul / addcdiv kernels, IEEE sqrt and division, the division by a Python
float as a multiply by its reciprocal taken in double and rounded to fp32), so masters, remainders and moments are compared with
``torch.equal`` on their bits after every step: every dtype combination (bf16 / fp32 param, grad and each
moment), numels that are not a multiple of the block, both branches of lerp's formula (weight < 0.5 or not)
and addcmul's ``value == 1`` case, the optimizer itself (the kernel is called, and compiled once per dtype
combination, not per step or learning rate), and a tensor past 2^31 elements (64-bit offsets).

A second check compares the kernel with an exact CPU emulation of that documented formula (fp32 FMA emulated in
float64 with round-to-odd): if the per-op comparison fails while this one passes, eager PyTorch on this build
rounds differently from what the docstring says (e.g. nvcc not contracting lerp's multiply-add).
"""

import itertools

import pytest
import torch

from deepseek_v41.training import adamw_triton, optim
from deepseek_v41.training.optim import RemainderAdamW, _adamw_scalars, join_master, split_master

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="fused RemainderAdamW GPU test needs a CUDA GPU"),
    pytest.mark.skipif(adamw_triton.triton is None, reason="the fused CUDA update needs Triton"),
]

BF16, FP32 = torch.bfloat16, torch.float32
BETAS = [(0.9, 0.95), (0.3, 0.0)]  # the second: lerp weight 0.7 (the other branch), addcmul value 1
DTYPES = list(itertools.product([BF16, FP32], repeat=4))  # param, grad, exp_avg, exp_avg_sq


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _diff(name, a, b):
    a, b = _bits(a), _bits(b)
    n = (a != b).sum().item()
    ulps = (a.long() - b.long()).abs().max().item() if n else 0
    return f"{name}: {n} of {a.numel()} differ (max {ulps} ulps)" if n else ""


def _start(n, param_dtype, avg_dtype, sq_dtype, device="cuda", seed=0):
    # magnitudes over 9 decades; full-range remainders (negative low halves included)
    g = torch.Generator(device=device).manual_seed(seed)
    master = torch.randn(n, device=device, generator=g) * torch.logspace(-6, 3, n, device=device)
    if param_dtype == BF16:
        param, remainder = (t.clone() for t in split_master(master))
        assert (remainder < 0).any()
    else:
        param, remainder = master, None
    avg = (torch.randn(n, device=device, generator=g) * 1e-3).to(avg_dtype)
    sq = (torch.rand(n, device=device, generator=g) * 1e-6).to(sq_dtype)
    return param, remainder, avg, sq


def _master(param, remainder):
    return join_master(param, remainder) if remainder is not None else param


@pytest.mark.parametrize("betas", BETAS)
@pytest.mark.parametrize("param_dtype,grad_dtype,avg_dtype,sq_dtype", DTYPES)
def test_kernel_is_bit_identical_to_the_per_op_path(param_dtype, grad_dtype, avg_dtype, sq_dtype, betas):
    n = 5 * 4096 + 1234  # not a multiple of the block: unmasked blocks and a masked tail
    ours = _start(n, param_dtype, avg_dtype, sq_dtype)
    ref = [t if t is None else t.clone() for t in ours]
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(1, 6):
        grad = (torch.randn(n, device="cuda", generator=g) * 10.0 ** (step % 4 - 2)).to(grad_dtype)
        scalars = _adamw_scalars(1e-3 * step, *betas, 1e-8, 0.1, float(step))  # the LR changes every step
        RemainderAdamW._per_op_update(ref[0], ref[1], grad.float(), {"exp_avg": ref[2], "exp_avg_sq": ref[3]},
                                      scalars)
        adamw_triton.adamw_triton_(ours[0], ours[1], grad, ours[2], ours[3],
                                   torch.tensor(scalars, dtype=torch.float32, device="cuda"))
        problems = [_diff("master", _master(*ours[:2]), _master(*ref[:2])),
                    _diff("exp_avg", ours[2], ref[2]), _diff("exp_avg_sq", ours[3], ref[3])]
        assert not any(problems), f"step {step}: " + "; ".join(p for p in problems if p)
    assert ours[2].dtype == avg_dtype and ours[3].dtype == sq_dtype


def _fma32(a, b, c):
    # fp32 fma(a, b, c) rounded once: the product is exact in float64; the float64 sum is made round-to-odd
    # (TwoSum error term), after which rounding to fp32 is correct
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    p = a * b
    s = p + c
    t = s - p
    err = (p - (s - t)) + (c - t)
    inf = torch.full_like(s, float("inf"))
    odd = torch.where((err != 0) & ((s.view(torch.int64) & 1) == 0), torch.nextafter(s, torch.where(err > 0, inf, -inf)), s)
    return odd.float()


def _emulate(param, remainder, grad, avg, sq, scalars):
    # adamw_triton's documented formula on the CPU, each step rounded explicitly
    decay, w1, beta2, w2, eps, _, step_size, inv_bc2 = (torch.tensor(v, dtype=FP32) for v in scalars)
    m, g, a, s = _master(param, remainder).cpu() * decay, grad.cpu().float(), avg.cpu().float(), sq.cpu().float()
    d = g - a
    a = _fma32(w1, d, a) if w1.abs() < 0.5 else _fma32(-d, 1 - w1, g)
    s = _fma32(g, g, s * beta2) if w2 == 1 else _fma32(w2, g * g, s * beta2)
    denom = s.double().sqrt().float() * inv_bc2 + eps  # float64 sqrt rounded once = IEEE fp32 sqrt
    m = _fma32(step_size, a / denom, m)
    return m, a.to(avg.dtype), s.to(sq.dtype)


@pytest.mark.parametrize("betas", BETAS)
@pytest.mark.parametrize("param_dtype,grad_dtype,avg_dtype,sq_dtype", [(BF16, BF16, BF16, BF16), (BF16, FP32, FP32, FP32),
                                                                       (FP32, FP32, BF16, BF16)])
def test_kernel_matches_an_exact_emulation_of_its_formula(param_dtype, grad_dtype, avg_dtype, sq_dtype, betas):
    n = 3 * 4096 + 77
    param, remainder, avg, sq = _start(n, param_dtype, avg_dtype, sq_dtype)
    g = torch.Generator(device="cuda").manual_seed(2)
    for step in range(1, 4):
        grad = (torch.randn(n, device="cuda", generator=g) * 10.0 ** (step % 4 - 2)).to(grad_dtype)
        scalars = _adamw_scalars(1e-3 * step, *betas, 1e-8, 0.1, float(step))
        want = _emulate(param, remainder, grad, avg, sq, scalars)
        adamw_triton.adamw_triton_(param, remainder, grad, avg, sq, torch.tensor(scalars, dtype=FP32, device="cuda"))
        problems = [_diff(name, got.cpu(), w) for name, got, w in
                    (("master", _master(param, remainder), want[0]), ("exp_avg", avg, want[1]), ("exp_avg_sq", sq, want[2]))]
        assert not any(problems), f"step {step}: " + "; ".join(p for p in problems if p)


def _compiled_variants():
    # how many compiled specializations Triton holds for the kernel (None where this Triton keeps them elsewhere)
    caches = getattr(adamw_triton._adamw_kernel, "device_caches", None)
    if isinstance(caches, dict):
        return sum(len(entry[0]) for entry in caches.values())
    return None


def _params(device):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(1000, 1037, device=device).bfloat16()),
            torch.nn.Parameter(torch.randn(1000, device=device)),  # an fp32 island: no remainder
            torch.nn.Parameter(torch.ones(1, device=device).bfloat16())]  # one element: the per-op path


@pytest.mark.parametrize("fused", [True, None])
@pytest.mark.parametrize("moment_dtype", [BF16, FP32])
def test_optimizer_uses_the_kernel_and_equals_the_per_op_path(moment_dtype, fused, monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return adamw_triton.adamw_triton_(*args, **kwargs)

    monkeypatch.setattr(optim, "adamw_triton_", spy)
    ours_ps, ref_ps = _params("cuda"), _params("cuda")
    start = ours_ps[0].detach().clone()
    kw = {"betas": (0.9, 0.95), "weight_decay": 0.1, "exp_avg_dtype": moment_dtype, "exp_avg_sq_dtype": moment_dtype}
    ours, ref = RemainderAdamW(ours_ps, fused=fused, **kw), RemainderAdamW(ref_ps, fused=False, **kw)
    variants = None
    for step in range(5):
        lr = 1e-3 * (step + 1)  # a schedule: the scalars change every step
        for opt in (ours, ref):
            opt.param_groups[0]["lr"] = lr
        for p, q in zip(ours_ps, ref_ps):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
        assert calls == [BF16, FP32] * (step + 1)  # the kernel for both big tensors, not for the 1-element one
        if step == 0:
            variants = _compiled_variants()
        else:  # new LR and bias corrections: no new compilation
            assert _compiled_variants() == variants
        for i, (p, q) in enumerate(zip(ours_ps, ref_ps)):
            assert torch.equal(_bits(ours.master_weight(p)), _bits(ref.master_weight(q))), (step, i)
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = ours.state[p][key], ref.state[q][key]
                assert a.dtype == moment_dtype and torch.equal(_bits(a), _bits(b)), (step, i, key)
    assert not torch.equal(ours_ps[0].detach(), start)  # the weights did move


@pytest.mark.parametrize("param_dtype,n", [(BF16, 2**31 + 3 * 4096 + 77), (FP32, 600_000_001)],
                         ids=["bf16-2^31+-elements", "fp32-2.4GB"])
def test_kernel_addresses_tensors_past_2_31(param_dtype, n):
    # bf16: more than 2^31 elements (10 bytes each over five tensors, ~21.5 GB); fp32: more than 2^31 bytes per
    # tensor (~7.2 GB).  The update is elementwise, so slices around the 2^29 / 2^30 / 2^31-element marks and
    # the tail are checked against the per-op path run on copies of those slices.
    if torch.cuda.mem_get_info()[0] < 40e9:
        pytest.skip("needs ~40 GB of free GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(3)
    grad_dtype = param_dtype
    param = torch.randn(n, device="cuda", dtype=param_dtype, generator=gen)
    remainder = torch.randn(n, device="cuda", dtype=BF16, generator=gen).view(torch.int16) \
        if param_dtype == BF16 else None  # random bit patterns, negative ones included
    grad = torch.randn(n, device="cuda", dtype=grad_dtype, generator=gen)
    avg = torch.randn(n, device="cuda", dtype=BF16, generator=gen).mul_(1e-3)
    sq = torch.rand(n, device="cuda", dtype=BF16, generator=gen).mul_(1e-6)
    marks = [0, 2**29, 2**30, 2**31, n - 4096]
    slices = [slice(max(0, m - 5000), min(n, m + 5000)) for m in marks if m < n]
    before = [[t if t is None else t[s].clone() for t in (param, remainder, grad, avg, sq)] for s in slices]
    scalars = _adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 3.0)
    adamw_triton.adamw_triton_(param, remainder, grad, avg, sq, torch.tensor(scalars, dtype=FP32, device="cuda"))
    for s, (p, r, gr, a, q) in zip(slices, before):
        RemainderAdamW._per_op_update(p, r, gr.float(), {"exp_avg": a, "exp_avg_sq": q}, scalars)
        problems = [_diff("master", _master(param[s], None if remainder is None else remainder[s]), _master(p, r)),
                    _diff("exp_avg", avg[s], a), _diff("exp_avg_sq", sq[s], q)]
        assert not any(problems), f"elements {s.start}..{s.stop}: " + "; ".join(x for x in problems if x)
