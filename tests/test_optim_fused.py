"""``fused_adamw_`` (the one-kernel RemainderAdamW update) against the per-op path, run eagerly on CPU."""

import pytest
import torch
from conftest import REPO

from deepseek_v41.training.optim import (
    RemainderAdamW,
    _adamw_scalars,
    build_optimizer,
    fused_adamw_,
    split_master,
)
from deepseek_v41.training.recipe import RecipeError, load_recipe

CONFIGS = REPO / "examples" / "configs"
BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1


def _start(param_dtype, moment_dtype, shape=(9, 37)):
    # An odd numel exercises the CPU kernels' vector tails; full-range int16 remainders include negative ones
    # (low half >= 0x8000), so the sign handling of the int32 join/split is checked.
    torch.manual_seed(0)
    master = torch.randn(shape) * torch.logspace(-6, 3, shape[-1])
    if param_dtype == torch.bfloat16:
        param, remainder = split_master(master)
        param, remainder = param.clone(), remainder.clone()
        assert (remainder < 0).any()
    else:
        param, remainder = master, None
    state = {"exp_avg": (torch.randn(shape) * 1e-3).to(moment_dtype),
             "exp_avg_sq": (torch.rand(shape) * 1e-6).to(moment_dtype)}
    return param, remainder, state


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("param_dtype,moment_dtype", [(torch.bfloat16, torch.bfloat16),
                                                      (torch.bfloat16, torch.float32),
                                                      (torch.float32, torch.float32)])
def test_fused_update_is_bit_identical_to_the_per_op_path(param_dtype, moment_dtype):
    ref = _start(param_dtype, moment_dtype)
    ours = _start(param_dtype, moment_dtype)
    param_ptr = ours[0].data_ptr()
    for step in range(1, 11):
        grad = torch.randn(ref[0].shape, dtype=param_dtype) * 10.0 ** (step % 4 - 2)
        scalars = _adamw_scalars(1e-3 * step, *BETAS, EPS, WD, float(step))  # the LR changes every step
        RemainderAdamW._per_op_update(ref[0], ref[1], grad.float(), ref[2], scalars)
        fused_adamw_(ours[0], ours[1], grad, ours[2]["exp_avg"], ours[2]["exp_avg_sq"],
                     torch.tensor(scalars, dtype=torch.float32))
        assert torch.equal(_bits(ours[0]), _bits(ref[0]))
        if param_dtype == torch.bfloat16:
            assert torch.equal(ours[1], ref[1])
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours[2][key].dtype == moment_dtype and torch.equal(_bits(ours[2][key]), _bits(ref[2][key]))
    assert ours[0].data_ptr() == param_ptr  # written in place


def _model():
    torch.manual_seed(1)
    model = torch.nn.Linear(13, 7).bfloat16()
    model.island = torch.nn.Parameter(torch.randn(5))  # an fp32 parameter: no remainder
    model.gain = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))  # one element: the per-op path
    return model


def test_optimizer_fused_true_on_cpu_equals_fused_false():
    models = [_model(), _model()]
    opts = [RemainderAdamW(m.parameters(), lr=3e-3, betas=BETAS, weight_decay=WD, fused=fused,
                           exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
            for m, fused in zip(models, (True, False))]
    for _ in range(4):
        x = torch.randn(3, 13)
        for m, opt in zip(models, opts):
            (m(x.bfloat16() * m.gain).float().square().sum() + m.island.square().sum()).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(_bits(opts[0].master_weight(a)), _bits(opts[1].master_weight(b))), name
        sa, sb = opts[0].state[a], opts[1].state[b]
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"] == 4
        for key in ("exp_avg", "exp_avg_sq", "remainder"):
            if key in sa:
                assert torch.equal(sa[key], sb[key]), (name, key)
    assert (opts[0].state[models[0].weight]["remainder"] < 0).any()  # negative low halves came up


def test_fused_function_traces_as_one_graph_for_every_shape():
    # What torch.compile(fullgraph=True, dynamic=True) sees on CUDA, checked with the eager backend (no compiler).
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(fused_adamw_, backend=backend, fullgraph=True, dynamic=True)
    scalars = torch.tensor(_adamw_scalars(1e-3, *BETAS, EPS, WD, 1.0), dtype=torch.float32)
    for numel in (64, 1000, 37):
        for param_dtype in (torch.bfloat16, torch.float32):
            eager = _start(param_dtype, torch.bfloat16, shape=(numel,))
            ours = _start(param_dtype, torch.bfloat16, shape=(numel,))
            grad = torch.randn(numel, dtype=param_dtype)
            fused_adamw_(eager[0], eager[1], grad, eager[2]["exp_avg"], eager[2]["exp_avg_sq"], scalars)
            compiled(ours[0], ours[1], grad, ours[2]["exp_avg"], ours[2]["exp_avg_sq"], scalars)
            assert torch.equal(_bits(ours[0]), _bits(eager[0]))
            assert torch.equal(ours[2]["exp_avg_sq"], eager[2]["exp_avg_sq"])
    assert len(graphs) == 2  # bf16+remainder and fp32: no recompile per shape or per step


def test_fused_option_is_validated_and_passed_through():
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="fused='yes'"):
        RemainderAdamW([param], fused="yes")
    with pytest.raises(ValueError, match="fused=1"):
        RemainderAdamW([param], fused=1)
    with pytest.raises(RecipeError, match="optimizer.fused='auto'"):
        load_recipe(CONFIGS / "tiny_cpu.yaml", {"optimizer.fused": "auto"})
    cfg = load_recipe(CONFIGS / "tiny_cpu.yaml", {"optimizer.impl": "torch_remainder"})["optimizer"]
    assert cfg["fused"] is None and build_optimizer([param], cfg, "cpu").fused is None
    assert build_optimizer([param], {**cfg, "fused": True}, "cpu").fused is True
