"""The text model on a tiny config with every layer kind: causality, padding, loss, gradients, backends."""

import shutil

import pytest
import torch
from conftest import tiny_config, tiny_model
from torch.nn import functional as F

from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM


@pytest.fixture(scope="module")
def model(v4_tokenizer):
    return tiny_model(v4_tokenizer).eval()


def ids_batch(b=2, s=64, seed=1, vocab=1024):
    return torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def test_tiny_config_has_every_layer_kind(model):
    text = model.config.text_config
    modes = [text.attention_mode(i) for i in range(text.num_hidden_layers)]
    assert modes == ["window", "window", "full", "reuse", "full", "full", "reuse", "reindex", "reuse"]
    assert [text.compress_ratios[i] for i in (2, 5)] == [2, 1]
    assert text.candidate_source_layer_id == 5 and hasattr(model.layers[5].attn, "indexer")
    assert not hasattr(model.layers[7].attn.indexer, "wk"), "Reindex layers own no index-key projection"
    assert [i for i, layer in enumerate(model.layers) if layer.engram is not None] == [1, 4]


def test_causality(model):
    ids = ids_batch()
    changed = ids.clone()
    t = 40
    changed[:, t] = (changed[:, t] + 7) % 1024
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    # measured 0 (the prefix rows take the same ops); the slack is for GEMM blockings that see the later rows
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:]), "the changed token must change later logits"


def test_odd_lengths_are_prefixes_of_the_even_run(model):
    """A sequence of odd length (a trailing partial group of the ratio-2 compressor, fewer tokens than one
    indexer block) gives the logits of the same positions of a longer run: the compressor pools groups from the
    start and drops only the unfinished last one (pooling the trailing tokens instead shifts every group)."""
    ids = ids_batch()
    with torch.no_grad():
        full = model(ids).logits  # |logits| <= 0.5
        for s in (63, 37, 17, 5):
            # fp32 sums over other shapes, whose order depends on the CPU's GEMM kernels: measured 1.6e-7 on one
            # CPU and up to 2e-5 (length 5) on another, gate 5x the larger; trailing-group pooling errs by >= 7e-2
            torch.testing.assert_close(model(ids[:, :s]).logits, full[:, :s], rtol=0, atol=1e-4, msg=f"length {s}")


def test_right_padding_keeps_real_token_logits(model):
    ids = ids_batch(s=48)
    padded = torch.cat([ids, torch.full((2, 16), 2)], dim=1)
    mask = torch.cat([torch.ones(2, 48, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = model(ids).logits
        with_pad = model(padded, attention_mask=mask).logits
    # measured |err| 6.0e-8 / 8.9e-8 (1 / 2 threads), 8 % of the gate (~12x): kept, since fp32 sums over other
    # shapes vary with the CPU's GEMM kernels (see test_odd_lengths...: up to 2e-5 on another CPU)
    torch.testing.assert_close(with_pad[:, :48], plain, rtol=1e-6, atol=1e-6)


def test_loss_is_shifted_cross_entropy(model):
    ids = ids_batch()
    labels = ids.clone()
    labels[:, :10] = -100
    out = model(ids, labels=labels)
    manual = F.cross_entropy(out.logits[:, :-1].reshape(-1, 1024), labels[:, 1:].reshape(-1), ignore_index=-100)
    # measured 0 (1 and 2 threads); the default fp32 tolerance (rtol 1.3e-6) is for a mean reduced in another order
    torch.testing.assert_close(out.loss, manual)
    assert out.logits.dtype == torch.float32


def test_padding_positions_are_excluded_from_the_loss(model):
    ids = ids_batch(s=32)
    mask = torch.ones_like(ids)
    mask[:, 24:] = 0
    out = model(ids, labels=ids, attention_mask=mask)
    manual = F.cross_entropy(out.logits[:, :23].reshape(-1, 1024), ids[:, 1:24].reshape(-1))
    torch.testing.assert_close(out.loss, manual)  # measured 0; default tolerance as above


def test_every_trainable_parameter_gets_a_gradient(v4_tokenizer):
    model = tiny_model(v4_tokenizer, dtype=torch.bfloat16).train()
    ids = ids_batch(s=64)
    model(ids, labels=ids).loss.backward()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".indexer." in n for n in frozen), "exactly the indexer is frozen"
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert param.grad is None, name
            continue
        assert param.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{name} has a non-finite gradient"
        assert param.grad.abs().sum() > 0, f"{name} got an all-zero gradient"
    # The window-KV path and the compressors reach the loss only through FP8/FP4 quantize-dequantize.
    for name in ("layers.0.attn.wkv.weight", "layers.0.attn.kv_norm.weight", "layers.2.attn.compressor.wkv.weight",
                 "layers.2.attn.compressor.wgate.weight", "layers.5.attn.compressor.wkv.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name


def test_engram_gradients_reach_only_looked_up_rows(v4_tokenizer):
    model = tiny_model(v4_tokenizer).train()
    ids = ids_batch(s=32)
    model(ids, labels=ids).loss.backward()
    for layer in (1, 4):
        engram = model.layers[layer].engram
        rows = engram.hash(ids, None)  # [b, s, cols]
        used, predicting = (torch.zeros(engram.embed.num_embeddings, dtype=torch.bool) for _ in range(2))
        used[rows.flatten()] = True
        predicting[rows[:, :-1].flatten()] = True  # the last position predicts nothing: its rows get no gradient
        touched = engram.embed.weight.grad.abs().sum(-1) > 0
        assert not (touched & ~used).any(), f"layer {layer}: rows that were not looked up got gradient"
        assert not (predicting & ~touched).any(), f"layer {layer}: looked-up rows got no gradient"


def test_dtype_contract(v4_tokenizer):
    model = tiny_model(v4_tokenizer, dtype=torch.bfloat16)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    fp32 |= {n for n, b in model.named_buffers() if b.dtype == torch.float32}
    assert "head.weight" in fp32 and "layers.3.attn.attn_sink" in fp32 and "layers.0.ffn.gate.bias" in fp32
    assert {"layers.0.hc_attn_fn", "layers.0.hc_ffn_base", "layers.8.hc_ffn_scale"} <= fp32
    assert {"layers.2.attn.compressor.wkv.weight", "layers.2.attn.compressor.wgate.weight"} <= fp32
    assert model.get_parameter("layers.5.attn.compressor.wkv.weight").dtype == torch.bfloat16, "ratio 1 stays bf16"
    assert model.get_parameter("layers.0.attn.wq_a.weight").dtype == torch.bfloat16
    assert model.get_parameter("embed.weight").dtype == torch.bfloat16
    with torch.no_grad():
        assert model(ids_batch(s=16)).logits.dtype == torch.float32


def test_grouped_experts_equal_the_loop(v4_tokenizer):
    grouped = tiny_model(v4_tokenizer, backend={"experts": "torch_mm"})
    loop = tiny_model(v4_tokenizer, backend={"experts": "torch"})
    loop.load_state_dict(grouped.state_dict())
    ids = ids_batch()
    out_g, out_l = grouped(ids, labels=ids), loop(ids, labels=ids)
    # measured 0 here (the CPU grouped GEMM runs per expert); the slack is for a fused grouped kernel's sum order
    torch.testing.assert_close(out_g.logits, out_l.logits, rtol=1e-5, atol=1e-5)
    out_g.loss.backward()
    out_l.loss.backward()
    for name in ("layers.3.ffn.experts.w1", "layers.3.ffn.experts.w2", "layers.3.ffn.experts.w3"):
        # measured 0 (1 and 2 threads), as the logits; the slack is for a fused kernel's sum order over tokens
        torch.testing.assert_close(grouped.get_parameter(name).grad, loop.get_parameter(name).grad,
                                   rtol=1e-4, atol=1e-6)


def test_grouped_experts_name_misaligned_sizes_and_handle_no_tokens():
    from types import SimpleNamespace

    from deepseek_v41.moe import RoutedExperts

    def experts(backend, inter):
        cfg = SimpleNamespace(n_routed_experts=4, hidden_size=8, moe_intermediate_size=inter, swiglu_limit=10.0)
        m = RoutedExperts(cfg, {"experts": backend})
        for w in (m.w1, m.w3, m.w2):
            torch.nn.init.normal_(w)
        return m

    ids, w = torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2)
    with pytest.raises(ValueError, match="moe_intermediate_size \\(6\\) must be multiples of 4 in torch.float32"):
        experts("torch_mm", 6)(torch.randn(5, 8), ids, w)
    assert experts("torch", 6)(torch.randn(5, 8), ids, w).shape == (5, 8)  # the loop has no such limit
    for backend in ("torch_mm", "torch"):  # no token at all: an empty fp32 result, not a reshape error
        out = experts(backend, 8)(torch.randn(0, 8), ids[:0], w[:0])
        assert out.shape == (0, 8) and out.dtype == torch.float32


def test_stacked_experts_have_released_shapes(model):
    experts = model.layers[0].ffn.experts
    assert experts.w1.shape == (8, 64, 32) and experts.w3.shape == (8, 64, 32) and experts.w2.shape == (8, 32, 64)


def test_full_config_builds_on_meta_with_552b_backbone(v4_tokenizer):
    from deepseek_v41 import DeepseekV41Config

    config = DeepseekV41Config()
    assert config.text_config.num_hidden_layers == 40 and config.text_config.n_routed_experts == 384
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config, tokenizer=v4_tokenizer)
    counts = {"backbone": 0, "engram_tables": 0, "vision": 0, "dspark": 0}
    for name, param in model.named_parameters():
        assert param.device.type == "meta"
        if name.startswith("mtp."):
            counts["dspark"] += param.numel()
        elif ".engram.embed." in name:
            counts["engram_tables"] += param.numel()
        elif name.startswith(("vision.", "aligner.", "image_")):
            counts["vision"] += param.numel()
        elif ".engram." not in name:
            counts["backbone"] += param.numel()
    print({k: f"{v / 1e9:.3f}B" for k, v in counts.items()})
    # against the published figures, rounded to 3 digits (552B +-0.09 %, 14.2B +-0.35 %, 763B +-0.07 %): measured
    # -0.08 %, +0.18 %, -0.01 %; gates 0.3 %, 0.5 %, 0.1 % (~4x, ~3x, the rounding's 1.5x)
    assert abs(counts["backbone"] / 552e9 - 1) < 3e-3
    assert counts["engram_tables"] == (384006168 + 384016682) * 256
    # three DSpark stages: each a block with 128 routed experts (~4.7B), plus main_proj, the Markov head (2 x 129280
    # x 256) and the confidence head; with the vision tower they make up transformers' 763B in total
    assert len(model.mtp) == 3 and abs(counts["dspark"] / 14.2e9 - 1) < 5e-3
    assert abs(sum(counts.values()) / 763e9 - 1) < 1e-3


def test_backend_validation_errors():
    with pytest.raises(ValueError, match="registered attn backends"):
        tiny_config(backend={"attn": "flash"})
    with pytest.raises(ValueError, match="unknown backend kind"):
        tiny_config(backend={"attention": "torch"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_gpu_backend_on_cpu_names_the_missing_hardware(v4_tokenizer):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        tiny_model(v4_tokenizer, backend={"attn": "tilelang"})
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        tiny_model(v4_tokenizer, backend={"rms_norm": "te"})
    with pytest.raises(RuntimeError, match="rms_norm backend 'triton' needs a CUDA GPU"):
        tiny_model(v4_tokenizer, backend={"rms_norm": "triton"})
    for kind in ("mhc", "engram", "quant"):
        with pytest.raises(RuntimeError, match=f"{kind} backend 'tile_kernels' needs a CUDA GPU"):
            tiny_model(v4_tokenizer, backend={kind: "tile_kernels"})
    with pytest.raises(RuntimeError, match="decode_indexer backend 'triton' needs a CUDA GPU"):
        tiny_model(v4_tokenizer, backend={"decode_indexer": "triton"})


def test_rms_norm_backends_agree_in_fp32(v4_tokenizer):
    a = tiny_model(v4_tokenizer, backend={"rms_norm": "torch_fp32"})
    b = tiny_model(v4_tokenizer, backend={"rms_norm": "torch"})
    b.load_state_dict(a.state_dict())
    ids = ids_batch(s=32)
    with torch.no_grad():  # measured 0 (both compute in fp32 here); the slack is for a reordered reduction
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch_fp32", "torch"])
@pytest.mark.parametrize("scale", [1e-4, 1e-3, 1e-2, 1.0])
def test_rms_norm_matches_the_formula_at_small_magnitudes(backend, scale):
    """x / sqrt(mean(x²) + eps) · w against fp64, at magnitudes where eps = 1e-6 is comparable to mean(x²)
    (rms 1e-3) or dominates it (1e-4): eps added elsewhere (outside the root, to the rms, after the product)
    moves the output by >= 10 % there, while at unit scale (the model's usual inputs) it is invisible."""
    from deepseek_v41.layers import RMSNorm

    eps = 1e-6
    torch.manual_seed(0)
    x = torch.randn(4, 7, 64) * scale
    norm = RMSNorm(64, eps, backend=backend)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    xd = x.double()
    expected = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps) * norm.weight.double()
    # fp32 round-off only (measured <= 3e-7 relative); the misplaced eps variants err by 1e-1 or more at 1e-3
    torch.testing.assert_close(norm(x).double(), expected, rtol=2e-6, atol=0)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_the_complex_product_with_gradients(dtype):
    # apply_rope (its own backward: the inverse rotation) against autograd through the complex product
    from deepseek_v41.rope import apply_rope, rope_cis, rope_frequencies

    def reference(x, cis, inverse):
        rd = 2 * cis.shape[-1]
        c = (cis.conj() if inverse else cis).view([1, cis.shape[0]] + [1] * (x.dim() - 3) + [cis.shape[-1]])
        tail = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
        return torch.cat([x[..., :-rd], torch.view_as_real(tail * c).flatten(-2).to(x.dtype)], dim=-1)

    g = torch.Generator().manual_seed(4)
    cis = rope_cis(torch.arange(7) * 3, rope_frequencies(16, 10000.0, None))
    for shape in ((2, 7, 3, 48), (2, 7, 48)):
        for inverse in (False, True):
            x = torch.randn(shape, generator=g).to(dtype)
            dy = torch.randn(shape, generator=g).to(dtype)
            x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
            y1, y2 = apply_rope(x1, cis, inverse), reference(x2, cis, inverse)
            y1.backward(dy)
            y2.backward(dy)
            # measured 0 (fp32 and bf16, 1 and 2 threads); the ~8 fp32 ulp slack is for an FMA-contracted rotation
            # (in bf16 the gate is exact)
            torch.testing.assert_close(y1, y2, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)
            assert not torch.equal(y1[..., -16:], x[..., -16:]) and torch.equal(y1[..., :-16], x[..., :-16])


VIEW_COPY_NODES = {"CopySlices", "AsStridedBackward0"}  # backward of an in-place op on a view: whole-tensor copies


def graph_node_names(t: torch.Tensor) -> set:
    # the names of every autograd node behind t
    visited, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in visited:
            visited.add(node)
            stack.extend(fn for fn, _ in node.next_functions)
    return {node.name() for node in visited}


def test_rope_in_place_on_a_projection_output_matches_out_of_place():
    # q straight from its (bias-free) projection is rotated in place, per head of the flat [b, s, h·d] output
    # (head_dim), or as a [b, s, h, d] view of it: same values and gradients as the out-of-place rotation.
    # The flat form leaves no view-copy nodes (CopySlices / AsStrided: full gradient copies and a zero fill)
    # in the graph; an x that another op saved for its backward makes backward raise
    from deepseek_v41.rope import apply_rope, rope_cis, rope_frequencies

    g = torch.Generator().manual_seed(5)
    cis = rope_cis(torch.arange(6), rope_frequencies(16, 10000.0, None))
    lin = torch.nn.Linear(8, 3 * 32, bias=False, dtype=torch.bfloat16)
    inp = torch.randn(2, 6, 8, generator=g).bfloat16()
    dy = torch.randn(2, 6, 3, 32, generator=g).bfloat16()
    outs, grads = [], []
    for inplace, flat in ((False, False), (True, False), (True, True)):
        lin.zero_grad()
        x = lin(inp) if flat else lin(inp).unflatten(-1, (3, 32))
        y = apply_rope(x, cis, inplace=inplace, head_dim=32 if flat else None)
        assert (y is x) == inplace
        y = y.unflatten(-1, (3, 32)) if flat else y
        view_copies = VIEW_COPY_NODES & graph_node_names(y)
        assert not view_copies if flat or not inplace else view_copies
        y.backward(dy)
        outs.append(y.detach())
        grads.append(lin.weight.grad.clone())
    for out, grad in zip(outs[1:], grads[1:]):
        assert torch.equal(outs[0], out) and torch.equal(grads[0], grad)
    with pytest.raises(ValueError, match="contiguous"):
        apply_rope(torch.randn(2, 32, 6).transpose(1, 2), cis, inplace=True)
    with pytest.raises(ValueError, match="not a multiple of head_dim"):
        apply_rope(torch.randn(2, 6, 40), cis, head_dim=32)
    a = torch.randn(2, 6, 32, requires_grad=True)
    saved = a.exp()  # exp saves its output for the backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        apply_rope(saved, cis, inplace=True).sum().backward()


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_rotating_its_gradient_in_place_matches_the_copy(inverse):
    # grad_inplace: the backward rotates the incoming gradient's tail in place (that buffer becomes x's gradient)
    # instead of rotating a full copy; the same gradient either way, contiguous or not
    from deepseek_v41.rope import apply_rope, rope_cis, rope_frequencies

    g = torch.Generator().manual_seed(6)
    cis = rope_cis(torch.arange(6), rope_frequencies(16, 10000.0, None))
    x = torch.randn(2, 6, 3, 32, generator=g).bfloat16()
    for dy in (torch.randn(2, 6, 3, 32, generator=g).bfloat16(), torch.randn(2, 3, 6, 32, generator=g).bfloat16().transpose(1, 2)):
        grads = []
        for grad_inplace in (False, True):
            leaf = x.clone().requires_grad_()
            y = apply_rope(leaf, cis, inverse=inverse, grad_inplace=grad_inplace)
            incoming = dy.clone() if dy.is_contiguous() else dy.transpose(1, 2).clone().transpose(1, 2)
            y.backward(incoming)
            grads.append(leaf.grad)
            if grad_inplace and dy.is_contiguous():
                assert leaf.grad.data_ptr() == incoming.data_ptr()  # rotated where it was: no copy
        assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], dy)


def test_the_training_graph_has_no_view_copy_nodes(model):
    # every layer kind's backward: no in-place op on a view (its CopySlices / AsStrided backward copies and
    # zero-fills whole gradients), e.g. RoPE on a [b, s, h, d] view of the q projection
    loss = model(ids_batch(), labels=ids_batch()).loss
    assert not VIEW_COPY_NODES & graph_node_names(loss)


def test_hand_written_backwards_match_autograd_of_the_plain_ops():
    # wo_a's grouped projection against einsum, and the MoE dispatch / combine against plain indexing and
    # an [n, k, dim] sum: values and gradients (fp32: to rounding of a different summation order)
    from deepseek_v41.attention import _GroupedProjection
    from deepseek_v41.moe import combine_top_k, dispatch_top_k

    g = torch.Generator().manual_seed(8)
    o = torch.randn(10, 4, 24, generator=g, requires_grad=True)
    w = torch.randn(4, 6, 24, generator=g, requires_grad=True)
    dy = torch.randn(10, 24, generator=g)
    y = _GroupedProjection.apply(o, w)
    grads = torch.autograd.grad(y, (o, w), dy)
    ref = torch.einsum("ngd,grd->ngr", o, w).reshape(10, 24)
    ref_grads = torch.autograd.grad(ref, (o, w), dy)
    torch.testing.assert_close(y, ref)  # measured 0 (1 and 2 threads); default fp32 tolerance for another sum order
    for a, b in zip(grads, ref_grads):  # |grads| <= 13: measured <= 9.5e-7 (fp32 round-off); gate ~3x
        torch.testing.assert_close(a, b, rtol=0, atol=3e-6)

    n, k, dim = 7, 3, 16
    x = torch.randn(n, dim, generator=g, requires_grad=True)
    order = torch.randint(0, 5, (n * k,), generator=g).argsort(stable=True)  # a routing's sort order
    dz = torch.randn(n, dim, generator=g)
    scale = torch.randn(n * k, 1, generator=g)  # stands in for the experts, so each copy's gradient differs
    out = combine_top_k(dispatch_top_k(x, order, k) * scale, order, n, k)
    (gx,) = torch.autograd.grad(out, x, dz)
    slots = torch.empty(n * k, dim).index_copy(0, order, x[order // k] * scale)
    ref_out = slots.view(n, k, dim).sum(1)
    (ref_gx,) = torch.autograd.grad(ref_out, x, dz)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref_out)  # measured 0 (1 and 2 threads); default tolerance as above
    torch.testing.assert_close(gx, ref_gx, rtol=0, atol=2e-6)  # measured 4.8e-7; gate ~4x

    # with the shared expert's output folded in: the fp32 sum plus it, rounded once to its dtype; its gradient
    # is the output's, and the experts' the same as without it
    y = (x[order // k] * scale).bfloat16().detach().requires_grad_()
    shared = torch.randn(n, dim, generator=g).bfloat16().requires_grad_()
    out = combine_top_k(y, order, n, k, shared)
    dz = torch.randn(n, dim, generator=g).bfloat16()
    grads = torch.autograd.grad(out, (y, shared), dz)
    ref_out = (combine_top_k(y, order, n, k) + shared.float()).to(torch.bfloat16)
    ref_grads = torch.autograd.grad(ref_out, (y, shared), dz)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)


def test_bf16_split_rounds_like_the_cast_and_survives_torch_compile():
    # the bf16x3 split's hi is x rounded to bf16 (ties to even; inf, NaN, signed zeros, subnormals, overflow to
    # inf), computed on the bits; so a plain torch.compile (Inductor, no precision-cast emulation: e.g. the
    # whole model compiled) keeps lo = x − hi instead of folding it to zero, and matches eager bit for bit
    from deepseek_v41.layers import _hi_lo_cat, _round_to_bf16

    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 64, generator=g) * torch.logspace(-40, 38, 64)
    x[0, :8] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-45, -1e-42, 3.4028235e38])
    x[1] = ((torch.randint(-(2**30), 2**30, (64,), generator=g, dtype=torch.int32) & -65536) | 0x8000).view(
        torch.float32)  # exact ties
    rounded, cast = _round_to_bf16(x), x.to(torch.bfloat16).float()
    assert torch.equal(rounded.isnan(), cast.isnan())
    assert torch.equal(rounded.nan_to_num().view(torch.int32), cast.nan_to_num().view(torch.int32))
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("torch.compile's CPU backend needs a C++ compiler")
    compiled = torch.compile(lambda w: _hi_lo_cat(w, 1), fullgraph=True)(x[2:])
    eager = _hi_lo_cat(x[2:], 1)
    assert (eager[:, 64:] != 0).any() and torch.equal(compiled.view(torch.int16), eager.view(torch.int16))


def test_bf16x3_matmul_is_fp32_accurate_and_plain_bf16_is_not():
    from deepseek_v41.layers import mm_bf16x3

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 512, generator=g), torch.randn(512, 96, generator=g)
    exact = a.double() @ b.double()
    assert rel_err(mm_bf16x3(a, b), exact) < 2e-5  # measured 4e-6
    assert rel_err(a.bfloat16().float() @ b.bfloat16().float(), exact) > 1e-3  # what the low halves buy


def test_bf16_copy_of_the_head_only_when_every_value_is_a_bf16_value():
    # the check behind inference's bf16 head copy (head_logits): row slices of 8192, so use more rows than one
    from deepseek_v41.layers import bf16_copy_if_exact

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(8192 + 40, 16, generator=g).bfloat16().float()
    copy = bf16_copy_if_exact(weight)
    assert copy.dtype == torch.bfloat16 and torch.equal(copy.float(), weight)
    reused = torch.empty_like(copy)
    assert bf16_copy_if_exact(weight, reused) is reused and torch.equal(reused, copy)
    for row in (3, 8192 + 39):  # one value bf16 cannot hold, in the first or the last slice
        bad = weight.clone()
        bad[row, 5] += bad[row, 5].abs() * 2**-12 + 1e-30
        assert bf16_copy_if_exact(bad) is None
    bad = weight.clone()
    bad[7, 0] = float("nan")
    assert bf16_copy_if_exact(bad) is None


@pytest.mark.parametrize("use", ["loss", "loss+logits", "logits"])
def test_bf16x3_head_fused_loss_matches_head_then_cross_entropy(use):
    # The loss fused into the bf16x3 head's backward (what a labels= forward runs) against the unfused head
    # followed by F.cross_entropy: the same loss, logits and gradients, with ignored targets, with the logits
    # also used by another term (their gradient is added), and with the loss unused.
    from deepseek_v41.layers import head_bf16x3, head_bf16x3_cross_entropy

    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 9, 32, generator=g).bfloat16()
    w = torch.randn(100, 32, generator=g) * 0.3
    targets = torch.randint(0, 100, (2, 9), generator=g)
    targets[0, 3] = targets[1, -1] = -100
    probe = torch.randn(2, 9, 100, generator=g)
    results = []
    for fused in (True, False):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            logits, total = head_bf16x3_cross_entropy(xg, wg, targets)
        else:
            logits = head_bf16x3(xg, wg)
            total = torch.nn.functional.cross_entropy(logits.view(-1, 100), targets.view(-1), reduction="sum")
        objective = {"loss": total, "loss+logits": total + (logits * probe).sum(), "logits": (logits * probe).sum()}
        objective[use].backward()
        results.append((logits.detach(), total.detach(), xg.grad, wg.grad))
    (l1, t1, gx1, gw1), (l2, t2, gx2, gw2) = results
    assert torch.equal(l1, l2)
    torch.testing.assert_close(t1, t2, rtol=1e-6, atol=1e-5)  # measured 0; the same sums in another order may differ
    # grad_w measured <= 3.4e-7 (gate ~6x); grad_x measured 0, but it is rounded to bf16, so a near-tie that
    # flips rounds a whole bf16 step (4e-3) away
    assert rel_err(gw1, gw2) < 2e-6 and rel_err(gx1.float(), gx2.float()) < 1e-2
    assert gx1.dtype == torch.bfloat16 and gw1.dtype == torch.float32


def test_bf16x3_head_matches_the_fp32_head_with_gradients(v4_tokenizer):
    ref = tiny_model(v4_tokenizer, dtype=torch.float32).train()
    emu = tiny_model(v4_tokenizer, dtype=torch.float32, backend={"head": "bf16x3"}).train()
    emu.load_state_dict(ref.state_dict())
    ids = ids_batch(s=32)
    out_ref, out_emu = ref(ids, labels=ids), emu(ids, labels=ids)
    assert out_emu.logits.dtype == torch.float32
    assert rel_err(out_emu.logits, out_ref.logits) < 3e-5  # measured 5e-6
    out_ref.loss.backward()
    out_emu.loss.backward()
    for name in ("head.weight", "norm.weight", "layers.8.ffn.shared_experts.w2.weight"):
        grad_ref, grad_emu = ref.get_parameter(name).grad, emu.get_parameter(name).grad
        assert rel_err(grad_emu, grad_ref) < 3e-5, name  # measured <= 4e-6


def test_emulated_fp32_linear_is_fp32_accurate_with_gradients():
    # linear_bf16x3 (the fp32_linear: bf16x3 backend) against float64: a bf16 input with an fp32 weight (the
    # ratio-2 compressor) and with a bf16 weight (the router); each gradient comes back in its operand's dtype
    from deepseek_v41.layers import linear_bf16x3

    g = torch.Generator().manual_seed(4)
    for w_dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 40, 256, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(48, 256, generator=g) * 0.05).to(w_dtype).requires_grad_()
        dy = torch.randn(3, 40, 48, generator=g)
        y = linear_bf16x3(x, w)
        y.backward(dy)
        x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
        assert y.dtype == torch.float32 and y.shape == (3, 40, 48)
        # measured (1 and 2 threads): y 2.5e-6, grad_w 2.5e-6 (fp32) / 1.7e-3 (bf16: its own rounding), grad_x
        # 1.4e-4 (rounded once to bf16, a few near-ties); gates ~4x, ~2.4x
        assert rel_err(y, x64 @ w64.t()) < 1e-5
        assert w.grad.dtype == w_dtype and x.grad.dtype == torch.bfloat16
        grad_w = torch.einsum("bsv,bsd->vd", dy64, x64)
        assert rel_err(w.grad, grad_w) < (1e-5 if w_dtype == torch.float32 else 4e-3)
        assert rel_err(x.grad, (dy64 @ w64).bfloat16()) < 5e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_linear_backend_matches_the_ieee_fp32_islands_with_gradients(v4_tokenizer, dtype):
    # backend fp32_linear: bf16x3 reaches the routers' scores and the ratio-2 compressor, and on the model's own
    # activations their products stay within 3e-5 of the IEEE GEMM; the loss and the gradients stay close to the
    # IEEE backend's, though not that close: a near-tied indexer or router top-k choice downstream may flip
    # (measured up to 1.1e-4 with one thread, and 5e-6 or 1.1e-4 with two on other runs; the gate stays ~20x
    # above since which ties flip, and so the error's size, changes with the thread count and the CPU's kernels)
    from deepseek_v41.layers import Fp32Linear, linear_bf16x3, linear_fp32
    from deepseek_v41.moe import Router

    ref = tiny_model(v4_tokenizer, dtype=dtype).train()
    emu = tiny_model(v4_tokenizer, dtype=dtype, backend={"fp32_linear": "bf16x3"}).train()
    emu.load_state_dict(ref.state_dict())
    assert emu.state_dict().keys() == ref.state_dict().keys()
    compressors = [m for m in emu.modules() if type(m) is Fp32Linear]
    routers = [m for m in emu.modules() if isinstance(m, Router)]
    assert compressors and routers and all(m.weight.dtype == torch.float32 for m in compressors)
    assert all(m.matmul is linear_bf16x3 for m in compressors) and all(r.score_matmul is linear_bf16x3 for r in routers)
    product_errs = []

    def check(module, args, out):
        x = args[0]
        with torch.no_grad():
            got = out if type(module) is Fp32Linear else module.score_matmul(x, module.weight)
            product_errs.append(rel_err(got, linear_fp32(x, module.weight)))

    hooks = [m.register_forward_hook(check) for m in compressors + routers]
    ids = ids_batch(s=32)
    out_ref, out_emu = ref(ids, labels=ids), emu(ids, labels=ids)
    for hook in hooks:
        hook.remove()
    # measured <= 5.9e-6 (1 and 2 threads); gate ~5x
    assert len(product_errs) == len(compressors) + len(routers) and max(product_errs) < 3e-5, product_errs
    errs = {"loss": abs(out_emu.loss.item() / out_ref.loss.item() - 1), "logits": rel_err(out_emu.logits, out_ref.logits)}
    out_ref.loss.backward()
    out_emu.loss.backward()
    for name in ("layers.2.attn.compressor.wkv.weight", "layers.8.ffn.gate.weight"):
        grad_ref, grad_emu = ref.get_parameter(name).grad, emu.get_parameter(name).grad
        assert grad_emu is not None and grad_emu.dtype == grad_ref.dtype
        errs[name] = rel_err(grad_emu, grad_ref)
    assert all(e < 2e-3 for e in errs.values()), errs


def test_bf16x3_skips_the_zero_low_half_of_a_bf16_operand(monkeypatch):
    from deepseek_v41 import layers

    work = []  # multiply-adds of each bf16 GEMM
    real = layers._mm_bf16_fp32_out
    monkeypatch.setattr(
        layers,
        "_mm_bf16_fp32_out",
        lambda a, b: work.append(a.shape[0] * a.shape[1] * b.shape[1]) or real(a, b),
    )
    g = torch.Generator().manual_seed(1)
    a16, b = torch.randn(64, 512, generator=g).bfloat16(), torch.randn(512, 96, generator=g)
    wide = torch.randn(512, 2048, generator=g)
    cases = [  # (a, b, products): an operand given in bf16 has no low half
        (a16, b, 2),  # narrow output: b's halves side by side
        (b.t(), a16.t(), 2),  # the same on the left (as in grad_w)
        (a16, wide, 2),  # wide output: along the inner dimension
        (a16.float(), b, 3),
    ]
    for a, bb, products in cases:
        work.clear()
        out = layers.mm_bf16x3(a, bb)
        exact = a.double() @ bb.double()
        assert sum(work) == products * a.shape[0] * a.shape[1] * bb.shape[1]
        assert out.dtype == torch.float32 and rel_err(out, exact) < 1e-5  # measured <= 2.5e-6; gate ~4x
        if a.dtype == torch.bfloat16:  # the same sum as with the widened operand, in another order
            assert rel_err(out, layers.mm_bf16x3(a.float(), bb)) < 5e-7  # measured 1.2e-7; gate ~4x



def test_bf16x3_head_products_and_gradients(monkeypatch):
    # the head's own layout of the bf16x3 products: forward and grad_w take 2 with a bf16 input, 3 with an
    # fp32 one; grad_x always 3.  All three stay fp32-accurate against float64.
    from deepseek_v41 import layers

    work = []
    real = layers._mm_bf16_fp32_out
    monkeypatch.setattr(
        layers, "_mm_bf16_fp32_out", lambda a, b: work.append(a.shape[0] * a.shape[1] * b.shape[1]) or real(a, b)
    )
    g = torch.Generator().manual_seed(3)
    n, d, v = 24, 64, 320
    weight = torch.randn(v, d, generator=g) * 0.05
    dy = torch.randn(n, v, generator=g)
    for dtype, products in ((torch.bfloat16, (2, 3, 2)), (torch.float32, (3, 3, 3))):
        x = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
        w = weight.clone().requires_grad_()
        work.clear()
        y = layers.head_bf16x3(x, w)
        assert sum(work) == products[0] * n * d * v
        work.clear()
        y.backward(dy)
        assert sum(work) == (products[1] + products[2]) * n * d * v
        x64, w64, dy64 = x.detach().double(), weight.double(), dy.double()
        # measured <= 4.5e-6 and 4.4e-6 (1 and 2 threads); gates ~4.5x
        assert y.dtype == torch.float32 and rel_err(y, x64 @ w64.t()) < 2e-5
        assert rel_err(w.grad, dy64.t() @ x64) < 2e-5
        assert x.grad.dtype == dtype
        # grad_x is rounded to x's dtype: bf16 rounding (~2e-3) is all the error there is
        assert rel_err(x.grad, dy64 @ w64) < (4e-3 if dtype == torch.bfloat16 else 2e-5)
        # measured 5.6e-5 (bf16: a few near-ties round the other way) and 4.5e-6 (fp32); gates ~4x
        assert rel_err(x.grad, (dy64 @ w64).to(dtype)) < (2e-4 if dtype == torch.bfloat16 else 2e-5)


def test_mhc_mix_logits_on_bf16_tensor_cores_match_the_fp32_reference():
    # the tile-kernels mHC backend's mix GEMM (bf16 streams, fp32 fn) against mhc.hc_mix_logits, with gradients
    from deepseek_v41.mhc import hc_mix_logits
    from deepseek_v41.mhc_tile_kernels import hc_mix_logits_bf16x3

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, 4, 256, generator=g).bfloat16()
    fn = torch.randn(24, 4 * 256, generator=g) * 0.02
    dy = torch.randn(2, 16, 24, generator=g)
    (x_ref, fn_ref), (x_new, fn_new) = [(x.clone().requires_grad_(), fn.clone().requires_grad_()) for _ in range(2)]
    ref = hc_mix_logits(x_ref, fn_ref, 1e-6)
    new = hc_mix_logits_bf16x3(x_new, fn_new, 1e-6)
    assert new.dtype == torch.float32 and rel_err(new, ref) < 1e-5  # measured 2.6e-6 (1 and 2 threads); gate ~4x
    ref.backward(dy)
    new.backward(dy)
    assert rel_err(fn_new.grad, fn_ref.grad) < 1e-5  # measured 2.7e-6; gate ~4x
    # dx is summed in fp32 and rounded once, like the reference (measured 1.3e-4: a few bf16 ties)
    assert x_new.grad.dtype == torch.bfloat16 and rel_err(x_new.grad, x_ref.grad) < 1e-3



def test_bf16x3_head_in_a_bf16_model(v4_tokenizer):
    # bf16 training: the head input is bf16 (exact), the head weight fp32; logits stay fp32 and close to
    # the IEEE fp32 head, and the input gradient comes back in bf16
    ref = tiny_model(v4_tokenizer, dtype=torch.bfloat16).train()
    emu = tiny_model(v4_tokenizer, dtype=torch.bfloat16, backend={"head": "bf16x3"}).train()
    emu.load_state_dict(ref.state_dict())
    assert emu.head.weight.dtype == torch.float32
    ids = ids_batch(s=32)
    out_ref, out_emu = ref(ids, labels=ids), emu(ids, labels=ids)
    assert out_emu.logits.dtype == torch.float32
    assert rel_err(out_emu.logits, out_ref.logits) < 1e-5  # measured 2.4e-6 (1 and 2 threads); gate ~4x
    out_ref.loss.backward()
    out_emu.loss.backward()
    assert rel_err(emu.head.weight.grad, ref.head.weight.grad) < 1.5e-6  # measured 3.4e-7; gate ~4x
    assert emu.norm.weight.grad.dtype == ref.norm.weight.grad.dtype
    assert rel_err(emu.norm.weight.grad, ref.norm.weight.grad) < 2e-4  # bf16 backward: measured 3.7e-5; gate ~5x


def test_activation_checkpointing_gives_identical_gradients(v4_tokenizer):
    plain = tiny_model(v4_tokenizer).train()
    checkpointed = tiny_model(v4_tokenizer).train()
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.gradient_checkpointing_enable()
    ids = ids_batch()
    plain(ids, labels=ids).loss.backward()
    checkpointed(ids, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name
    with pytest.raises(ValueError, match="non-reentrant"):
        checkpointed.gradient_checkpointing_enable({"use_reentrant": True})


def test_labels_outside_the_vocabulary_are_rejected_before_the_forward(model):
    ids = ids_batch(s=16)
    labels = ids.clone()
    labels[0, 3] = 1024  # the tiny vocabulary is 1024
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 1024\)"):
        model(ids, labels=labels)


def test_mhc_reads_and_writes_go_a_block_of_positions_at_a_time_without_autograd(monkeypatch):
    # a long prefill's mHC (mix logits, collapse, post-mix) in blocks of MHC_POSITIONS (bounded fp32 temporaries):
    # the same values as in one pass; with autograd on, one pass
    from deepseek_v41 import mhc
    from deepseek_v41.layers import by_positions

    g = torch.Generator().manual_seed(0)
    b, s, hc, d = 2, 37, 4, 64
    x = torch.randn(b, s, hc, d, generator=g).bfloat16()
    y = torch.randn(b, s, d, generator=g).bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * d, generator=g)
    pre, post, comb = torch.rand(b, s, hc, generator=g), torch.rand(b, s, hc, generator=g), torch.rand(b, s, hc, hc, generator=g)
    whole = (mhc.hc_mix_logits(x, fn, 1e-6), mhc.hc_pre(x, pre), mhc.hc_post(y, x, post, comb))
    sizes = []
    inner = mhc._hc_pre
    monkeypatch.setattr(mhc, "_hc_pre", lambda x, pre: sizes.append(x.shape[1]) or inner(x, pre))
    monkeypatch.setattr(mhc, "MHC_POSITIONS", 16)
    with torch.no_grad():
        blocks = (mhc.hc_mix_logits(x, fn, 1e-6), mhc.hc_pre(x, pre), mhc.hc_post(y, x, post, comb))
    assert sizes == [16, 16, 5]
    for one, blocked in zip(whole, blocks):
        assert blocked.dtype == one.dtype and blocked.shape == one.shape
    # the mix logits' GEMM may sum in another order for fewer rows (fp32; measured 4.2e-8 relative, gate ~3.6x);
    # collapse and post-mix are per position: bit-equal
    assert ((blocks[0] - whole[0]).norm() / whole[0].norm()).item() < 1.5e-7
    assert torch.equal(blocks[1], whole[1]) and torch.equal(blocks[2], whole[2])
    sizes.clear()
    mhc.hc_pre(x, pre)  # autograd on: one pass
    assert sizes == [s]
    assert by_positions(lambda x, none: x.sum(-1), x, None, block=16).shape == (b, s, hc)  # None args pass through
