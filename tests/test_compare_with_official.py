"""conversion/compare_with_official.py and its CPU kernel stand-ins (conversion/official_cpu_kernels.py).

The official inference code is not available here, so the end-to-end tests write a stand-in ``inference/``
folder with the official interface (``ModelArgs`` with the official field names, ``Transformer(args)``,
``forward(tokens, start_pos=0)`` returning last-position logits, ``embed``/``layers``/``norm``/``head``,
``from kernel import`` the six kernels, FP8 / packed-FP4 parameters with ``weight.scale`` attributes). Its
math delegates to deepseek_v41's blocks: it exercises the tool's plumbing, not DeepSeek. The tool runs on the
golden tiny text snapshot in both modes and its JSON must equal a direct computation of the same two logit
sets.
"""

import json
import sys
import textwrap

import pytest
import torch
from conftest import REPO, golden_dir
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import deepseek_v41  # noqa: F401  (registers the Auto classes)
from deepseek_v41.checkpoint import ReleasedCheckpoint
from deepseek_v41.mhc import hc_mix
from deepseek_v41.parity import logits_metrics
from deepseek_v41.quantization import fp4_e4m3_scale_qdq_reference, fp4_qdq_reference, fp8_qdq_reference
from deepseek_v41.release_format import (
    decode_fp4_packed,
    decode_fp8_blockwise,
    encode_fp4_packed,
    encode_fp8_blockwise,
)
from deepseek_v41.sparse_attention import sparse_attention_torch

sys.path.insert(0, str(REPO / "conversion"))
import compare_with_official as tool
import official_cpu_kernels as kernels

SEQ = 32  # covers every CSA2 kind of the tiny model: window 16, ratio-2 entries 16 > index_topk 8

# ----------------------------------------------------------------------------------------------------
# Kernel stand-ins against simple references
# ----------------------------------------------------------------------------------------------------


def test_act_quant_is_the_fp8_boundary_with_power_of_two_scales():
    x = (torch.randn(3, 5, 96) * torch.logspace(-3, 3, 96)).bfloat16()
    q, s = kernels.act_quant(x, 32, "ue8m0")
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.shape == (3, 5, 3) and s.dtype == torch.float32
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    dequantized = (q.float().unflatten(-1, (3, 32)) * s.unsqueeze(-1)).flatten(-2)
    assert torch.equal(dequantized.bfloat16(), fp8_qdq_reference(x))
    q8, s8 = kernels.act_quant(x, 32, "ue8m0", scale_dtype=torch.float8_e8m0fnu)
    assert torch.equal(q8.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s8.float(), s)
    y = x.clone()
    assert kernels.act_quant(y, 32, "ue8m0", inplace=True) is y and torch.equal(y, fp8_qdq_reference(x))
    q_plain, s_plain = kernels.act_quant(x, 32)  # no scale_fmt: plain amax / 448 scales
    expected = x.float().unflatten(-1, (3, 32)).abs().amax(-1).clamp(min=1e-4) / 448
    assert torch.equal(s_plain, expected) and q_plain.float().abs().amax() <= 448


def test_fp4_act_quant_both_scale_formats():
    x = (torch.randn(4, 64) * torch.logspace(-2, 2, 64)).bfloat16()
    packed, scale = kernels.fp4_act_quant(x, 32)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (4, 32)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (4, 2)
    decoded = decode_fp4_packed(packed.view(torch.uint8), scale, 32)
    assert torch.equal(decoded.bfloat16(), fp4_qdq_reference(x))
    packed16, scale16 = kernels.fp4_act_quant(x, 16, scale_dtype=torch.float8_e4m3fn)
    assert scale16.dtype == torch.float8_e4m3fn and scale16.shape == (4, 4)
    decoded = decode_fp4_packed(packed16.view(torch.uint8), scale16.float(), 16)
    assert torch.equal(decoded.bfloat16(), fp4_e4m3_scale_qdq_reference(x, 16))
    y = x.clone()
    kernels.fp4_act_quant(y, 16, inplace=True, scale_dtype=torch.float8_e4m3fn)
    assert torch.equal(y, fp4_e4m3_scale_qdq_reference(x, 16))


@pytest.mark.parametrize("out_features", [64, 48])  # 48: a partial 32-row scale block
def test_fp8_and_fp4_gemm_equal_matmul_of_dequantized_inputs(out_features):
    torch.manual_seed(0)
    a = torch.randn(2, 3, 96).bfloat16()
    qa, sa = kernels.act_quant(a, 32, "ue8m0")
    a_deq = (qa.float().unflatten(-1, (3, 32)) * sa.unsqueeze(-1)).flatten(-2).double()
    w = torch.randn(out_features, 96)
    qw, sw = encode_fp8_blockwise(w, 32)
    out = kernels.fp8_gemm(qa, sa, qw, sw)
    expected = a_deq @ decode_fp8_blockwise(qw, sw, 32).double().T
    assert out.dtype == torch.get_default_dtype() and out.shape == (2, 3, out_features)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-6
    packed, s4 = encode_fp4_packed(w, 32)
    out4 = kernels.fp4_gemm(qa, sa, packed.view(torch.float4_e2m1fn_x2), s4)
    expected4 = a_deq @ decode_fp4_packed(packed, s4, 32).double().T
    assert ((out4.double() - expected4).norm() / expected4.norm()).item() < 1e-6


def test_kernels_accept_zero_rows():  # an expert that no token chose
    a = torch.zeros(0, 64).bfloat16()
    qa, sa = kernels.act_quant(a, 32, "ue8m0")
    assert qa.shape == (0, 64) and sa.shape == (0, 2)
    packed, scale = encode_fp4_packed(torch.randn(16, 64), 32)
    assert kernels.fp4_gemm(qa, sa, packed.view(torch.float4_e2m1fn_x2), scale).shape == (0, 16)
    assert kernels.fp8_gemm(qa, sa, *encode_fp8_blockwise(torch.randn(16, 64), 32)).shape == (0, 16)
    packed16, scale16 = kernels.fp4_act_quant(a, 16, scale_dtype=torch.float8_e4m3fn)
    assert packed16.shape == (0, 32) and scale16.shape == (0, 4)


def test_sparse_attn_and_hc_split_sinkhorn_match_the_package():
    torch.manual_seed(0)
    q, kv = torch.randn(2, 5, 4, 64).bfloat16(), torch.randn(2, 9, 64).bfloat16()
    idx = torch.randint(-1, 9, (2, 5, 6))
    sink = torch.randn(4)
    expected = sparse_attention_torch(q, kv, sink, idx, 0.125)
    assert torch.equal(kernels.sparse_attn(q, kv, sink, idx, 0.125), expected)
    x, fn = torch.randn(2, 3, 4, 16).bfloat16(), torch.randn(24, 64) * 0.1
    base, scale = torch.randn(24), torch.rand(3) + 0.5
    flat = x.flatten(-2).float()
    mixes = torch.nn.functional.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-20)
    for mine, ours in zip(kernels.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6),
                          hc_mix(x, fn, base, scale, 4, 20, 1e-6, 1e-20)):
        assert torch.equal(mine, ours)


def test_install_registers_exactly_the_six_kernels(monkeypatch):
    monkeypatch.delitem(sys.modules, "kernel", raising=False)
    kernels.CALLS["sparse_attn"] = 5
    module = kernels.install()
    assert sys.modules["kernel"] is module and not kernels.CALLS
    assert sorted(n for n in vars(module) if not n.startswith("__")) == sorted(kernels.KERNELS)


def test_rank_part_slices_the_one_sharded_dimension():
    assert tool.rank_part((8, 4), (8, 4), 1, 2, "w") == (None, slice(None))
    assert tool.rank_part((8, 4), (8, 2), 1, 2, "w") == (1, slice(2, 4))
    with pytest.raises(ValueError, match="not a 2-way shard"):
        tool.rank_part((8, 4), (3, 4), 0, 2, "w")


# ----------------------------------------------------------------------------------------------------
# End to end on the golden tiny snapshot, against a stand-in with the official interface
# ----------------------------------------------------------------------------------------------------

STANDIN = '''
"""Stand-in with the official DeepSeek-V4.1 inference interface; the math is deepseek_v41's."""
import json
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kernel import act_quant, fp4_act_quant, fp8_gemm, fp4_gemm, sparse_attn, hc_split_sinkhorn
from deepseek_v41 import DeepseekV41Config
from deepseek_v41.attention import CSA2State
from deepseek_v41.mhc import hc_pre
from deepseek_v41.moe import swiglu
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM


@dataclass
class ModelArgs:
{fields}


class Linear(nn.Module):  # FP8 weight, UE8M0 32x32 block scales; activations quantized per 32
    def __init__(self, in_features, out_features, fp4=False):
        super().__init__()
        self.in_features, self.out_features, self.fp4 = in_features, out_features, fp4
        cols, scale_shape = (in_features // 2, (out_features, in_features // 32)) if fp4 else \\
            (in_features, (-(-out_features // 32), -(-in_features // 32)))
        dtype = torch.float4_e2m1fn_x2 if fp4 else torch.float8_e4m3fn
        self.weight = nn.Parameter(torch.empty(out_features, cols, dtype=dtype), requires_grad=False)
        self.weight.scale = self.scale = nn.Parameter(
            torch.empty(*scale_shape, dtype=torch.float8_e8m0fnu), requires_grad=False)

    def forward(self, x):
        q, s = act_quant(x, 32, "ue8m0")
        return (fp4_gemm if self.fp4 else fp8_gemm)(q, s, self.weight, self.weight.scale)


class Expert(nn.Module):
    def __init__(self, dim, inter, fp4, limit):
        super().__init__()
        make = (lambda i, o: Linear(i, o, fp4=True)) if fp4 else (lambda i, o: nn.Linear(i, o, bias=False))
        self.w1, self.w3, self.w2, self.limit = make(dim, inter), make(dim, inter), make(inter, dim), limit

    def forward(self, x, weights):
        h = swiglu(self.w1(x).float(), self.w3(x).float(), self.limit) * weights
        return self.w2(h.to(x.dtype))


class Experts(nn.ModuleList):
    def forward(self, x, expert_ids, weights, shared=None):  # -> fp32 [n, dim]; + shared: in shared's dtype
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self):
            token, slot = (expert_ids == e).nonzero(as_tuple=True)
            out[token] += expert(x[token], weights[token, slot, None]).float()  # one pick per token
        return out if shared is None else (out + shared.float()).to(shared.dtype)


def mix(block, x, sub):
    flat = x.flatten(-2).float()
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + block.norm_eps)
    mixes = F.linear(flat, getattr(block, f"hc_{{sub}}_fn")) * inv_rms
    return hc_split_sinkhorn(mixes, getattr(block, f"hc_{{sub}}_scale"), getattr(block, f"hc_{{sub}}_base"),
                             block.hc, block.sinkhorn_iters, block.hc_eps)


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        snapshot = json.loads(Path(__file__).with_name("standin.json").read_text())["snapshot"]
        config = DeepseekV41Config.from_pretrained(snapshot)
        config._name_or_path = snapshot
        text = config.text_config
        assert (args.dim, args.n_layers) == (text.hidden_size, text.num_hidden_layers)
        self.max_batch_size, self.max_seq_len = args.max_batch_size, args.max_seq_len
        inner = DeepseekV41ForCausalLM(config)
        for layer in inner.layers:
            attn, ffn = layer.attn, layer.ffn
            if args.dtype == "fp8":
                owners = [(attn, "wq_a"), (attn, "wq_b"), (attn, "wkv"), (attn, "wo_b")]
                owners += [(ffn.shared_experts, w) for w in ("w1", "w2", "w3")]
                owners += [(attn.indexer, "wq_b")] if hasattr(attn, "indexer") else []
                for owner, name in owners:
                    old = getattr(owner, name)
                    setattr(owner, name, Linear(old.in_features, old.out_features))
            fp4 = args.expert_dtype == "fp4"
            ffn.experts = Experts(Expert(text.hidden_size, text.moe_intermediate_size, fp4, text.swiglu_limit)
                                  for _ in range(text.n_routed_experts))
            attn.sparse_attention = sparse_attn
            layer.mix = types.MethodType(mix, layer)
        self.hc = text.hc_mult
        self.embed, self.layers, self.norm, self.head = inner.embed, inner.layers, inner.norm, inner.head

    @torch.inference_mode()
    def forward(self, tokens, start_pos=0):
        b, s = tokens.shape
        assert start_pos == 0 and b <= self.max_batch_size and s <= self.max_seq_len
        h = self.embed(tokens)
        x = h.unsqueeze(2).expand(b, s, self.hc, h.shape[-1]).contiguous()
        pre = torch.zeros(b, s, self.hc, dtype=torch.float32, device=h.device)
        pre[..., 0] = 1.0
        state = CSA2State()
        for layer in self.layers:
            x, pre = layer(x, pre, state, input_ids=tokens)
        return F.linear(self.norm(hc_pre(x, pre))[:, -1].float(), self.head.weight.float())
'''


@pytest.fixture(scope="module", autouse=True)
def engram_constants_once():
    # Every model here uses the same snapshot tokenizer: derive Engram's hash constants once (~2 s each).
    from deepseek_v41 import modeling_deepseek_v41

    cache = {}

    def cached(text_config, tokenizer):
        key = tuple(text_config.engram_layer_ids)
        if key not in cache:
            cache[key] = derive(text_config, tokenizer)
        return cache[key]

    derive = modeling_deepseek_v41.engram_constants
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_deepseek_v41, "engram_constants", cached)
        yield


@pytest.fixture(scope="module", autouse=True)
def restore_import_state():
    # The tool puts the stand-in folder on sys.path and registers the modules `model` and `kernel`.
    path, saved = list(sys.path), {name: sys.modules.get(name) for name in ("model", "kernel")}
    yield
    sys.path[:] = path
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


@pytest.fixture(scope="module")
def fixture_paths(tmp_path_factory):
    golden = golden_dir("v41_tiny_text")
    snapshot = golden / "snapshot"
    official_args = json.loads((golden / "reference" / "official_args.json").read_text())
    inference = tmp_path_factory.mktemp("snapshot") / "inference"
    inference.mkdir()
    fields = "\n".join(f"    {name}: object = None" for name in official_args)
    (inference / "model.py").write_text(textwrap.dedent(STANDIN).format(fields=fields))
    (inference / "config.json").write_text(json.dumps(official_args))
    (inference / "standin.json").write_text(json.dumps({"snapshot": str(snapshot)}))
    golden_ids = load_file(str(golden / "reference" / "golden.safetensors"))["input_ids"]
    ids_file = inference.parent / "input_ids.json"  # golden row 0: BOS + English prose, 64 tokens
    ids_file.write_text(json.dumps(golden_ids[0].tolist()))
    return snapshot, inference, ids_file


@pytest.fixture(scope="module")
def input_ids(fixture_paths):
    return torch.tensor([json.loads(fixture_paths[2].read_text())[:SEQ]])


@pytest.fixture(scope="module")
def our_logits(fixture_paths, input_ids):
    model = AutoModelForCausalLM.from_pretrained(fixture_paths[0], dtype=torch.bfloat16)
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def standin_logits(fixture_paths, input_ids, overrides):
    """The stand-in's all-position logits, built and loaded here without the tool's loader."""
    from deepseek_v41.modeling_deepseek_v41 import default_dtype

    snapshot, inference, _ = fixture_paths
    module = tool.import_official_model(inference, cpu_kernels=True)
    fields = {**json.loads((inference / "config.json").read_text()), **overrides}
    checkpoint, raw = ReleasedCheckpoint(snapshot), {}
    for shard in sorted(snapshot.glob("*.safetensors")):
        raw.update(load_file(str(shard)))
    with default_dtype(torch.bfloat16):
        model = module.Transformer(module.ModelArgs(**fields))
    with torch.no_grad():
        for name, target in model.state_dict(keep_vars=True).items():
            if target.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2):
                target.copy_(raw[name].view(target.dtype))
            elif name in raw:
                target.copy_(checkpoint.decode(name).to(target.dtype))
    captured = []
    model.norm.register_forward_hook(lambda m, a, out: captured.append(out))
    with default_dtype(torch.bfloat16):
        model(input_ids, start_pos=0)
    return captured[-1].float() @ raw["head.weight"].float().T


def run_tool(tmp_path, fixture_paths, *extra):
    snapshot, inference, ids_file = fixture_paths
    report = tmp_path / "report.json"
    code = tool.main([
        "--checkpoint", str(snapshot), "--inference-dir", str(inference), "--input-ids-file", str(ids_file),
        "--seq-len", str(SEQ), "--dtype", "bf16", "--device", "cpu", "--cpu-kernels", "--report", str(report),
        *extra,
    ])
    return code, json.loads(report.read_text())


def assert_metrics_equal(reported, expected):
    for name, value in expected.items():
        assert reported[name] == pytest.approx(value, rel=1e-5, abs=1e-9), name


BF16_WEIGHTS = {"dtype": "bf16", "expert_dtype": None}  # the README's `bf16w` reference: decoded weights


def test_whole_mode_bf16_official_weights(tmp_path, fixture_paths, input_ids, our_logits):
    # dtype bf16 / no expert_dtype: every FP8 / FP4 tensor is decoded into the stand-in's bf16 parameters.
    overrides = ["--official-arg", 'dtype="bf16"', "--official-arg", "expert_dtype=null"]
    code, report = run_tool(tmp_path, fixture_paths, "--mode", "whole", *overrides)
    expected = logits_metrics(standin_logits(fixture_paths, input_ids, BF16_WEIGHTS), our_logits)
    assert_metrics_equal(report["metrics"], expected)
    assert code == 0 and report["passed"] and not report["failures"]
    diagnostics = report["diagnostics"]
    assert diagnostics["positions"] == "all" and diagnostics["official_return_max_abs_diff"] < 1e-3
    assert diagnostics["official_load"]["snapshot_tensors_unused"] == 0
    calls = diagnostics["kernel_calls"]
    assert calls["sparse_attn"] == 9 and calls["hc_split_sinkhorn"] == 18  # once per layer / per sublayer
    assert calls["fp8_gemm"] == calls["fp4_gemm"] == 0
    assert report["settings"]["official_args"]["dtype"] == "bf16" and report["settings"]["seq_len"] == SEQ


def test_streamed_mode_fp8_official_weights(tmp_path, fixture_paths, input_ids, our_logits, monkeypatch):
    # The released ModelArgs (dtype fp8, expert_dtype fp4): stored FP8 / FP4 codes and UE8M0 scales go into
    # the stand-in's quantized parameters, layer by layer; an impossible mean-KL gate must give exit code 1.
    loaded, engram_tables = [], []
    load_block, lookup = tool.load_our_modules, tool.engram_rows_lookup

    def spy_load(holder, checkpoint_dir, device):  # our side: every earlier block is back on meta
        assert all(p.is_meta for earlier in loaded[1:] for p in earlier.parameters())
        loaded.append(holder)
        load_block(holder, checkpoint_dir, device)

    def spy_lookup(checkpoint, name, hash_ids, dtype, device):
        engram_tables.append((hash_ids.unique().numel(), checkpoint.tensors[name].shape[0]))
        return lookup(checkpoint, name, hash_ids, dtype, device)

    monkeypatch.setattr(tool, "load_our_modules", spy_load)
    monkeypatch.setattr(tool, "engram_rows_lookup", spy_lookup)
    code, report = run_tool(tmp_path, fixture_paths, "--mode", "streamed", "--max-mean-kl", "0")
    expected = logits_metrics(standin_logits(fixture_paths, input_ids, {}), our_logits)
    assert_metrics_equal(report["metrics"], expected)
    assert code == 1 and not report["passed"] and report["failures"][0].startswith("mean_kl")
    assert 0 < expected["mean_kl"] < 1e-3 and expected["top1"] > 0.98  # FP8 activations: close, not equal
    calls = report["diagnostics"]["kernel_calls"]
    for name in ("act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn", "hc_split_sinkhorn"):
        assert calls[name] > 0, calls
    assert report["diagnostics"]["official_return_max_abs_diff"] < 1e-3
    assert len(loaded) == 1 + 9  # embed/norm/head, then one block at a time
    assert len(engram_tables) == 2 and all(rows < table for rows, table in engram_tables)


def test_official_model_args_grow_and_check_against_the_snapshot(fixture_paths):
    snapshot, inference, _ = fixture_paths
    module = tool.import_official_model(inference, cpu_kernels=True)
    text_config = json.loads((snapshot / "config.json").read_text())["text_config"]
    config = inference / "config.json"
    args, _ = tool.official_model_args(module, config, {"dtype": "bf16"}, 3, 300, text_config)
    assert (args.max_batch_size, args.max_seq_len, args.dtype) == (3, 300, "bf16")
    with pytest.raises(ValueError, match="does not have"):
        tool.official_model_args(module, config, {"n_experts": 8}, 1, 8, text_config)
    with pytest.raises(ValueError, match="describes another model"):
        tool.official_model_args(module, config, {"dim": 64}, 1, 8, text_config)
    assert tool.parse_overrides(['expert_dtype=null', 'dtype="bf16"', "score_func=softmax"]) == {
        "expert_dtype": None, "dtype": "bf16", "score_func": "softmax"}


def test_streamed_official_parameters_are_placeholders_outside_their_layer(fixture_paths):
    from deepseek_v41.modeling_deepseek_v41 import default_dtype

    snapshot, inference, _ = fixture_paths
    module = tool.import_official_model(inference, cpu_kernels=True)
    with default_dtype(torch.bfloat16), tool.parameters_on_meta():
        model = module.Transformer(module.ModelArgs(**json.loads((inference / "config.json").read_text())))
    assert all(p.is_meta for p in model.parameters())
    linear = model.layers[3].attn.wq_a
    assert linear.weight.scale is linear.scale  # attributes set after registration survive the swap
    streamer = tool.OfficialStreamer(model, ReleasedCheckpoint(snapshot), "cpu", 0, 1)
    streamer.load("layers.3.")
    live = {name for name, p in model.named_parameters() if not p.is_meta}
    assert live == {name for name, _ in model.named_parameters() if name.startswith("layers.3.")}
    stored = load_file(str(snapshot / ReleasedCheckpoint(snapshot).records["layers.3.attn.wq_a.weight"].file))
    assert linear.weight.scale is linear.scale and not linear.scale.is_meta
    assert torch.equal(linear.weight.view(torch.uint8), stored["layers.3.attn.wq_a.weight"].view(torch.uint8))
    streamer.release(model.layers[3])
    assert all(p.is_meta for p in model.parameters())
