"""RemainderAdamW's compiled fused update (``fused=True`` on CUDA) against its per-op path on the same GPU.

Inductor may contract a mul+add into an FMA and round a division differently from eager CUDA (which divides
by a scalar as a multiply by its reciprocal), so one step's fp32 masters agree to within a couple of ulps
rather than bit for bit, and bf16 moments to within one bf16 rounding of each other.  Each step starts both
optimizers from the same state: otherwise an occasional flipped bf16 moment rounding (2^-8 relative) feeds
later updates and the masters drift apart by much more than an ulp, which says nothing about the kernel.
Also checks that later steps (new LR, new bias corrections) reuse the compiled graphs.
"""

import pytest
import torch

from deepseek_v41.training.optim import RemainderAdamW

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="fused RemainderAdamW GPU test needs a CUDA GPU"),
]


def _params(device):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4096, 1024, device=device).bfloat16()),
            torch.nn.Parameter(torch.randn(1000, device=device))]  # an fp32 island: no remainder


def compare_fused_with_per_op(device, moment_dtype, steps=5):
    fused_ps, ref_ps = _params(device), _params(device)
    start = fused_ps[0].detach().clone()
    kw = {"betas": (0.9, 0.95), "weight_decay": 0.1, "exp_avg_dtype": moment_dtype, "exp_avg_sq_dtype": moment_dtype}
    fused, ref = RemainderAdamW(fused_ps, fused=True, **kw), RemainderAdamW(ref_ps, fused=False, **kw)
    for step in range(steps):
        lr = 1e-3 * (step + 1)  # a schedule: the scalars change every step
        for opt in (fused, ref):
            opt.param_groups[0]["lr"] = lr
        for p, q in zip(fused_ps, ref_ps):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
            if ref.state:  # the same starting state (see the module docstring)
                p.detach().copy_(q.detach())
                for key, value in ref.state[q].items():
                    fused.state[p][key] = value.clone() if torch.is_tensor(value) else value
        with torch._dynamo.config.patch(error_on_recompile=step > 0):  # step 0 compiles bf16 and fp32 graphs
            fused.step()
        ref.step()
        for p, q in zip(fused_ps, ref_ps):
            # A couple of ulps of the master, plus ~1e-6 of the update (lr) where it cancels the master to ~0.
            torch.testing.assert_close(fused.master_weight(p), ref.master_weight(q), rtol=3e-7, atol=lr * 1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = fused.state[p][key], ref.state[q][key]
                assert a.dtype == moment_dtype
                rtol = 2**-7 if moment_dtype == torch.bfloat16 else 3e-7  # bf16: one rounding step apart at most
                torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=1e-7)
    assert not torch.equal(fused_ps[0].detach(), start)  # the weights did move


@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32])
def test_compiled_fused_update_matches_per_op_path(moment_dtype):
    compare_fused_with_per_op("cuda", moment_dtype)
