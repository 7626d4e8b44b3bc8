"""Kept release formats on CPU (kept.py): a quantized snapshot loads with its FP8/FP4 codes and scales as stored,
computes what the dequantizing load computes (the tile-by-tile fallback), saves back byte for byte and refuses
what it cannot do.

Reference throughout: the same snapshot loaded with ``dequantize_base_checkpoint=True`` (release_format.py's exact
decode) and the snapshot's own stored bytes, read with ``ReleasedCheckpoint.read_raw``."""

import copy
import functools
import json
import shutil

import pytest
import torch
from conftest import GOLDEN_FIXTURES, golden_dir
from safetensors.torch import load_file, save_file

from deepseek_v41 import DeepseekV41ForCausalLM
from deepseek_v41 import kept as kept_module
from deepseek_v41.checkpoint import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    ReleasedCheckpoint,
    load_checkpoint_into_model,
    scale_name,
)
from deepseek_v41.engram import Engram
from deepseek_v41.kept import KeptFp4Experts, KeptFp8Linear, KeptTensor, held_dequantized, is_kept
from deepseek_v41.modeling_deepseek_v41 import materialize
from deepseek_v41.parity import logits_metrics, model_inputs, reference_logits, snapshot_head_weight
from deepseek_v41.quantization import fp8_qdq_reference


def snapshot(fixture="v41_tiny_text"):
    return golden_dir(fixture) / "snapshot"


@functools.cache
def load(fixture, dequantize, dtype=torch.bfloat16, engram_device=None):
    return DeepseekV41ForCausalLM.from_pretrained(snapshot(fixture), dtype=dtype,
                                                  dequantize_base_checkpoint=dequantize, engram_device=engram_device)


@functools.cache
def golden(fixture):
    return load_file(str(golden_dir(fixture) / "reference" / "golden.safetensors"))


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()


def quantized_tensors(fixture="v41_tiny_text"):
    checkpoint = ReleasedCheckpoint(snapshot(fixture))
    return checkpoint, [t for t in checkpoint.tensors.values() if t.fmt != "plain"]


def test_default_keeps_a_quantized_snapshot():
    model = load("v41_tiny_text", None)
    assert is_kept(model) and model.config.dequantize_base_checkpoint is None
    assert isinstance(model.layers[0].attn.wq_a, KeptFp8Linear)
    assert isinstance(model.layers[0].ffn.experts, KeptFp4Experts)
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert model.layers[1].engram.embed.kept and isinstance(model.layers[1].engram.wkv, KeptFp8Linear)
    assert model.layers[0].ffn.experts.w1.dtype == torch.int8
    assert not is_kept(load("v41_tiny_text", True))
    # no kept tensor is a parameter: optimizers, PEFT and model.dtype never see them
    assert all(p.dtype in (torch.bfloat16, torch.float32) for p in model.parameters())


@pytest.mark.parametrize("fixture, engram_device", [("v41_tiny_text", None), ("v41_tiny_vision", None),
                                                    ("v41_tiny_text", "cpu"), ("v41_tiny_vision", "cpu")])
def test_fallback_logits_equal_the_dequantizing_load(fixture, engram_device, monkeypatch):
    """The fallback decodes exactly and keeps each output's K-long dot product whole: the logits are the dequantized
    model's bit for bit (the gate, rel <= 1e-6, is met with 0). Small tiles (32 rows) so every weight takes several;
    every decode in the forward is one tile, never a whole weight. With engram_device="cpu" the kept tables stay in
    host memory and their rows come through the prefetch path: still bit for bit."""
    monkeypatch.setattr(kept_module, "TILE_BYTES", 2048)
    decoded_rows = []
    for name in ("decode_fp8_row_scaled", "decode_fp4_packed"):
        real = getattr(kept_module, name)

        def spy(codes, *args, real=real, **kwargs):
            decoded_rows.append(codes.shape[0])
            return real(codes, *args, **kwargs)

        monkeypatch.setattr(kept_module, name, spy)
    inputs = model_inputs(golden(fixture))
    with torch.no_grad():
        reference = load(fixture, True)(**inputs).logits
        model = load(fixture, None, engram_device=engram_device)
        logits = model(**inputs).logits
    tables = [layer.engram.embed for layer in model.layers if layer.engram is not None]
    assert tables and all(t.kept and t.held_on_host == (engram_device == "cpu") for t in tables)
    assert torch.equal(logits, reference), ((logits - reference).norm() / reference.norm()).item()
    assert decoded_rows and max(decoded_rows) <= 32


def test_wo_a_multiplies_unquantized_activations(monkeypatch):
    """The official code decodes ``wo_a`` to bf16 and multiplies in bf16: the kept ``wo_a`` must never go through the
    FP8 linear (it rounds the activations to FP8). Where the kernels are usable it goes to the block-diagonal kernel
    with the activations as they are (that kernel is checked against fp64 in tests/gpu/test_quantized_kernels_gpu.py);
    the fallback's output equals the decoded weight's bf16 product per group, bit for bit."""
    calls = []

    class Kernels:
        def fp8_linear(self, *args, **kwargs):
            raise AssertionError("wo_a went through the FP8 GEMM (activations quantized)")

        def fp8_block_diagonal_linear(self, o, weight, scale):
            calls.append((o, weight, scale))
            return torch.zeros(o.shape[0], weight.shape[0], dtype=o.dtype)

    attn = load("v41_tiny_text", None).layers[0].attn
    wo_a, groups = attn.wo_a, attn.o_groups
    o = torch.randn(5, groups, wo_a.in_features, dtype=torch.bfloat16)
    weight = load("v41_tiny_text", True).layers[0].attn.wo_a.weight  # the dequantizing load's bf16 [groups·r, d]
    r = wo_a.out_features // groups
    expected = torch.cat([o[:, g] @ weight[g * r:(g + 1) * r].t() for g in range(groups)], dim=-1)
    with torch.no_grad():
        assert torch.equal(wo_a.grouped_forward(o, groups), expected)  # no kernels on the CPU: the fallback
        monkeypatch.setattr(kept_module, "quantized_kernels", lambda x: Kernels())
        wo_a.grouped_forward(o, groups)
    assert len(calls) == 1 and calls[0][0] is o and calls[0][1] is wo_a.weight and calls[0][2] is wo_a.scale


@pytest.mark.parametrize("fixture", GOLDEN_FIXTURES)
def test_activations_quantized_as_the_kernels_do_give_the_official_fp8_run(fixture, monkeypatch):
    """The FP8 path's semantics against the official FP8 run (golden ``fp8w_bf16``), on CPU: the fallback with its
    activations quantized as the GPU kernels quantize them (per 32 with UE8M0 scales, ``fp8_qdq_reference``, which
    the kernels match bit for bit in tests/gpu/test_quantized_kernels_gpu.py) before every FP8 linear and FP4
    expert GEMM (not ``wo_a``, which the official code multiplies in bf16). FP8 values are exact in bf16, so the
    bf16 tile GEMMs give the FP8 products exactly, summed in fp32 as the official CPU kernels sum them.  Measured
    mean / max KL: text 0 / 0 (bit-identical logits), vision 9.7e-7 / 4.8e-5; gates 1e-6 (room for another CPU's
    summation order) and ~5x vision's.  Without the quantization the fallback is 3.8e-4 / 9.0e-4 away (mean KL):
    a linear left unquantized, a wrong scale or the routing weight applied after w2 shows there."""
    inputs = model_inputs(golden(fixture))
    reference = reference_logits(golden(fixture), "fp8w_bf16", snapshot_head_weight(snapshot(fixture)))
    model = load(fixture, None)
    with torch.no_grad():
        unquantized = logits_metrics(reference, model(**inputs).logits.float())
    tiled_fp8, tiled_fp4 = kept_module.fp8_linear_tiled, kept_module.fp4_linear_tiled
    monkeypatch.setattr(KeptFp8Linear, "forward", lambda self, x: tiled_fp8(
        fp8_qdq_reference(x).to(x.dtype), self.weight, self.scale, self.block))
    monkeypatch.setattr(kept_module, "fp4_linear_tiled", lambda x, packed, scale, group=32: tiled_fp4(
        fp8_qdq_reference(x).to(x.dtype), packed, scale, group))
    with torch.no_grad():
        quantized = logits_metrics(reference, model(**inputs).logits.float())
    mean_gate, max_gate = {"v41_tiny_text": (1e-6, 1e-6), "v41_tiny_vision": (5e-6, 2.5e-4)}[fixture]
    assert quantized["mean_kl"] <= mean_gate and quantized["max_kl"] <= max_gate, quantized
    assert quantized["top1"] == 1.0 and unquantized["mean_kl"] > 1e-4, unquantized


def test_fallback_logits_equal_in_fp32():
    ids = golden("v41_tiny_text")["input_ids"][:1, :32]
    with torch.no_grad():
        reference = load("v41_tiny_text", True, torch.float32)(ids).logits
        logits = load("v41_tiny_text", None, torch.float32)(ids).logits
    assert torch.equal(logits, reference)


def test_state_dict_holds_the_snapshot_bytes_under_released_names():
    checkpoint, tensors = quantized_tensors()
    model = load("v41_tiny_text", None)
    state = model.state_dict()
    assert {t.fmt for t in tensors} == {"fp8_block", "fp4", "fp8_rows"}  # Engram tables and wkv among them
    for t in tensors:  # every one kept, none held dequantized
        assert not held_dequantized(model, t.name), t.name
        for record in (t.record, t.scale):
            assert state[record.name].dtype == SAFETENSORS_DTYPES[record.dtype], record.name
            assert raw_bytes(state[record.name]) == raw_bytes(checkpoint.read_raw(record)), record.name
    assert not any(".ffn.experts.w" in name for name in state)  # per-expert released names only


def test_load_state_dict_takes_the_released_names():
    model = load("v41_tiny_text", None)
    experts = model.layers[3].ffn.experts
    state = {k.removeprefix("layers.3.ffn.experts."): v.clone() for k, v in model.state_dict().items()
             if k.startswith("layers.3.ffn.experts.")}
    saved = experts.w2.clone()
    try:
        experts.w2.zero_()
        experts.load_state_dict(state)
        assert torch.equal(experts.w2, saved)
    finally:
        experts.w2.copy_(saved)


def test_memory_is_the_snapshot_bytes():
    """Parameter + buffer bytes of the kept model = the snapshot's tensor bytes, tensor by tensor (Engram tables and
    their scales included, at their stored size), with one documented exception held wider: the fp32 islands the
    release stores in BF16 (the head, the ratio-2 compressors: +0.6 % of the released model, +46 % of this tiny one,
    whose 129k x 32 head is half its bytes)."""
    checkpoint, _ = quantized_tensors()
    model = load("v41_tiny_text", None)
    state = model.state_dict()
    assert set(state) == set(checkpoint.records)
    stored = sum(r.nbytes for r in checkpoint.records.values())
    islands = 0  # extra bytes held
    for name, record in checkpoint.records.items():
        held = state[name].numel() * state[name].element_size()
        if state[name].dtype == SAFETENSORS_DTYPES[record.dtype]:
            assert held == record.nbytes, name
        else:
            assert (state[name].dtype, record.dtype) == (torch.float32, "BF16"), name
            islands += held - record.nbytes
    weights = sum(v.numel() * v.element_size() for v in state.values())
    assert weights == stored + islands
    bf16_model = sum(v.numel() * v.element_size() for v in load("v41_tiny_text", True).state_dict().values())
    assert bf16_model - weights > 1_000_000  # what keeping saves here (a tiny model: mostly bf16 embeddings)


def test_kept_load_decodes_no_kept_tensor(monkeypatch):
    """Loading kept copies codes: no quantized tensor is decoded (Engram tables and wkv included)."""
    decoded = []
    real = ReleasedCheckpoint.decode

    def spy(self, name, *args, **kwargs):
        decoded.append(name)
        return real(self, name, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("an FP4 expert was decoded during a kept load")

    monkeypatch.setattr(ReleasedCheckpoint, "decode", spy)
    monkeypatch.setattr("deepseek_v41.checkpoint.decode_fp4_packed", refuse)
    DeepseekV41ForCausalLM.from_pretrained(snapshot(), dtype=torch.bfloat16)
    _, tensors = quantized_tensors()
    assert not {n for n in decoded if n in {t.name for t in tensors}}


@pytest.mark.parametrize("engram_device", [None, "cpu"])
def test_save_pretrained_writes_the_snapshot_back(tmp_path, engram_device):
    """Every tensor of the snapshot is written back byte for byte under its name, dtype and shape: FP8/FP4 codes
    and scales as held, the Engram tables (also from host memory) and their scales, the Engram wkv, and the plain
    tensors (the fp32 islands narrowed back to the BF16 they were stored in, exactly); the config keeps the
    snapshot's quantization_config."""
    checkpoint, _ = quantized_tensors()
    model = load("v41_tiny_text", None, engram_device=engram_device)
    model.save_pretrained(tmp_path / "out")
    saved = ReleasedCheckpoint(tmp_path / "out")
    assert set(saved.records) == set(checkpoint.records)
    for name, record in checkpoint.records.items():
        got = saved.records[name]
        assert (got.dtype, list(got.shape)) == (record.dtype, list(record.shape)), name
        assert raw_bytes(saved.read_raw(got)) == raw_bytes(checkpoint.read_raw(record)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    released = json.loads((snapshot() / "config.json").read_text())
    assert config["quantization_config"] == released["quantization_config"]
    ids = golden("v41_tiny_text")["input_ids"][:1, :16]
    with torch.no_grad():
        again = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
        assert is_kept(again) and torch.equal(again(ids).logits, model(ids).logits)


def test_greedy_generation_with_the_cache_equals_the_dequantized_model():
    ids = golden("v41_tiny_text")["input_ids"][:1, :12]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "use_cache": True}
    with torch.no_grad():
        reference = load("v41_tiny_text", True).generate(ids, **kwargs)
        tokens = load("v41_tiny_text", None).generate(ids, **kwargs)
    assert tokens.shape[1] == ids.shape[1] + 6 and torch.equal(tokens, reference)


# ----------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------


def test_training_a_kept_model_is_refused():
    model = load("v41_tiny_text", None)
    ids = golden("v41_tiny_text")["input_ids"][:, :16]
    model.train()
    try:
        with pytest.raises(RuntimeError, match=r"dequantize_base_checkpoint=True"):
            model(ids, labels=ids).loss.backward()
    finally:
        model.eval()


@pytest.mark.parametrize("tensor", ["fp8", "fp4", "scale"])
def test_requires_grad_on_a_kept_tensor_is_refused(tensor):
    model = load("v41_tiny_text", None)
    target = {"fp8": model.layers[0].attn.wq_b.weight, "fp4": model.layers[0].ffn.experts.w1,
              "scale": model.layers[0].attn.wq_b.scale}[tensor]
    assert isinstance(target, KeptTensor)
    with pytest.raises(RuntimeError, match=r"dequantize_base_checkpoint=True"):
        target.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"dequantize_base_checkpoint=True"):
        target.requires_grad = True
    with pytest.raises(RuntimeError, match=r"dequantize_base_checkpoint=True"):
        model.layers[0].attn.wq_b.requires_grad_(True)
    assert not target.requires_grad


def test_kept_tensors_survive_moves_casts_and_copies():
    """Moves keep kept tensors KeptTensors; dtype casts of the model (to(bf16), float(), half()) leave their stored
    dtypes alone (a float8 code cast to bf16 would hold the code's number, not the weight)."""
    model = copy.deepcopy(load("v41_tiny_text", None)).to("cpu")
    assert isinstance(model.layers[0].attn.wq_b.weight, KeptTensor)
    assert isinstance(model.layers[0].ffn.experts.w2_scale, KeptTensor)
    before = {n: raw_bytes(t) for n, t in model.named_buffers() if isinstance(t, KeptTensor)}
    model.float().half().to(torch.bfloat16)
    after = dict(model.named_buffers())
    assert all(isinstance(after[n], KeptTensor) and raw_bytes(after[n]) == b for n, b in before.items())
    assert model.embed.weight.dtype == torch.bfloat16 and model.layers[0].attn.wq_b.scale.dtype == torch.float8_e8m0fnu


def test_peft_lora_on_a_kept_model_infers_and_refuses_training():
    """Decided: LoRA adapters attach to the unquantized linears and run in inference; training them would
    backpropagate through the kept weights, which is refused (load dequantized to train adapters)."""
    peft = pytest.importorskip("peft")

    model = copy.deepcopy(load("v41_tiny_text", None))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    wrapped = [n for n, m in lora.named_modules() if hasattr(m, "lora_A")]
    assert wrapped and not any(isinstance(m, (KeptFp8Linear, KeptFp4Experts)) for m in lora.modules()
                               if hasattr(m, "lora_A"))
    ids = golden("v41_tiny_text")["input_ids"][:1, :16]
    with torch.no_grad():
        assert torch.equal(lora.eval()(input_ids=ids).logits, load("v41_tiny_text", None)(ids).logits)
    lora.train()
    with pytest.raises(RuntimeError, match=r"dequantize_base_checkpoint=True"):
        lora(input_ids=ids, labels=ids)


def test_trainer_load_with_dequantize_false_is_refused():
    from deepseek_v41.training.sharded_load import load_sharded_checkpoint

    with pytest.raises(NotImplementedError, match="dequantize_base_checkpoint"):
        load_sharded_checkpoint(torch.nn.Module(), snapshot(), dequantize=False)


def test_a_missing_scale_refuses_to_load_kept(tmp_path):
    folder = tmp_path / "snapshot"
    shutil.copytree(snapshot(), folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = scale_name("layers.2.attn.wq_b.weight")
    shard = folder / index["weight_map"].pop(victim)
    tensors = load_file(str(shard))
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'layers\.2\.attn\.wq_b\.weight'.*scale 'layers\.2\.attn\.wq_b\.scale' is missing"):
        DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)


def test_a_nan_scale_byte_is_refused_when_kept(tmp_path):
    folder = tmp_path / "snapshot"
    shutil.copytree(snapshot(), folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = "layers.4.ffn.experts.3.w2.scale"
    shard = folder / index["weight_map"][victim]
    tensors = load_file(str(shard))
    tensors[victim].view(torch.uint8)[5, 1] = 255
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'layers\.4\.ffn\.experts\.3\.w2\.weight'.*NaN UE8M0.*\[5, 1\]"):
        DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)


def test_loading_kept_into_a_model_without_kept_modules_is_refused():
    model = load("v41_tiny_text", True)
    with pytest.raises(CheckpointError, match=r"keep_release_formats.*dequantize_base_checkpoint=True"):
        load_checkpoint_into_model(model, snapshot(), dequantize_base_checkpoint=False)


def test_engram_tables_stream_into_their_stored_format_buffers(monkeypatch):
    """A kept load streams each Engram table into the buffers keep_release_formats allocated in the stored format,
    block by block like every kept tensor (no whole-table read, no second copy): the held codes and scales are the
    snapshot's bytes, and its ``wkv`` is kept too."""
    import deepseek_v41.checkpoint as checkpoint_module
    from deepseek_v41.checkpoint import ReleasedCheckpoint

    def whole_read(self, name):
        raise AssertionError(f"{name} read whole")

    reads = []
    read_raw = ReleasedCheckpoint.read_raw

    def counting_read_raw(self, record, rows=None):
        reads.append((record.shape, rows))
        return read_raw(self, record, rows)

    monkeypatch.setattr(ReleasedCheckpoint, "read_stored", whole_read)
    monkeypatch.setattr(ReleasedCheckpoint, "read_raw", counting_read_raw)
    monkeypatch.setattr(checkpoint_module, "LOAD_BLOCK_BYTES", 4096)  # several blocks per table
    model = DeepseekV41ForCausalLM.from_pretrained(snapshot(), dtype=torch.bfloat16)
    checkpoint, _ = quantized_tensors()
    for layer in (1, 4):
        table = model.layers[layer].engram.embed
        t = checkpoint.tensors[f"layers.{layer}.engram.embed.weight"]
        assert table.weight.dtype == torch.float8_e4m3fn and table.scale.dtype == torch.float8_e8m0fnu
        assert raw_bytes(table.weight) == raw_bytes(read_raw(checkpoint, t.record))
        assert raw_bytes(table.scale) == raw_bytes(read_raw(checkpoint, t.scale))
        blocks = [rows for shape, rows in reads if tuple(shape) == tuple(t.record.shape)]
        assert len(blocks) > 1 and all(rows is not None for rows in blocks), blocks
        assert isinstance(model.layers[layer].engram.wkv, KeptFp8Linear)


def test_engram_without_stored_format_buffers_gets_its_table_whole(monkeypatch):
    """The other side of the contract: an Engram whose table is not held in the stored format before the load
    receives the table's codes (float8 [rows, d]) and scales ([rows, d/32]) as stored through load_kept_table."""
    from deepseek_v41.engram_host import EngramTable

    received = {}

    def load_kept_table(self, codes, scale):
        received[self.layer] = (codes, scale)

    monkeypatch.setattr(Engram, "load_kept_table", load_kept_table, raising=False)
    monkeypatch.setattr(EngramTable, "keep_format", lambda self, scale_dtype=None: None)  # tables stay floating
    DeepseekV41ForCausalLM.from_pretrained(snapshot(), dtype=torch.bfloat16)
    checkpoint, _ = quantized_tensors()
    assert sorted(received) == [1, 4]
    for layer, (codes, scale) in received.items():
        t = checkpoint.tensors[f"layers.{layer}.engram.embed.weight"]
        assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
        assert raw_bytes(codes) == raw_bytes(checkpoint.read_raw(t.record))
        assert raw_bytes(scale) == raw_bytes(checkpoint.read_raw(t.scale))


# ----------------------------------------------------------------------------------------------------
# Placement
# ----------------------------------------------------------------------------------------------------


def meta_kept(engram_device=None):
    """The tiny text model built on the meta device (engram_device as given) with its kept modules and Engram
    tables put in the stored formats: what from_pretrained plans its device_map on."""
    from deepseek_v41.kept import keep_release_formats

    config = copy.deepcopy(load("v41_tiny_text", None).config)
    config.text_config.engram_device = engram_device
    with torch.device("meta"):
        meta = DeepseekV41ForCausalLM(config, tokenizer=load("v41_tiny_text", None).engram_tokenizer)
    keep_release_formats(meta, ReleasedCheckpoint(snapshot()))
    return meta


def test_device_map_counts_the_kept_bytes():
    """accelerate's sizes of a kept meta-device model are its real bytes (FP8/FP4 codes and scales at their
    size, not the model dtype's; Engram tables and their scales at the stored bytes), so a max_memory just above
    the kept size places everything, which the bf16 size would not fit."""
    from accelerate.utils import compute_module_sizes

    from deepseek_v41.modeling_deepseek_v41 import device_map_dtypes, plan_device_map

    config = load("v41_tiny_text", None).config
    with torch.device("meta"):
        dense = sum(t.numel() * t.element_size() for t in [*DeepseekV41ForCausalLM(config).parameters(),
                                                            *DeepseekV41ForCausalLM(config).buffers()])
    meta = meta_kept()
    actual = sum(t.numel() * t.element_size() for t in [*meta.parameters(), *meta.buffers()])
    sizes = compute_module_sizes(meta, dtype=torch.bfloat16, special_dtypes=device_map_dtypes(meta))
    assert sizes[""] <= actual
    checkpoint = ReleasedCheckpoint(snapshot())
    for layer in (1, 4):  # an Engram table: its stored codes and scales, byte for byte
        t = checkpoint.tensors[f"layers.{layer}.engram.embed.weight"]
        assert sizes[f"layers.{layer}.engram.embed"] == t.record.nbytes + t.scale.nbytes
    room = {"cpu": int(actual * 1.01), "disk": 10 * dense}
    assert dense > room["cpu"]
    assert set(plan_device_map(meta, "sequential", torch.bfloat16, room).values()) == {"cpu"}


def test_device_map_leaves_host_engram_tables_out():
    """With engram_device="cpu" the (kept) tables take no device's memory in from_pretrained's plan, as the inference
    planner assumes: over two fake GPUs, the least room on device 0 that holds the whole model (the rest spills
    onto device 1) is exactly the tables' stored bytes smaller when they are in host memory."""
    from accelerate.utils import compute_module_sizes

    from deepseek_v41.engram_host import tables_left_out
    from deepseek_v41.modeling_deepseek_v41 import device_map_dtypes, plan_device_map

    host, on_gpu = meta_kept("cpu"), meta_kept()
    checkpoint = ReleasedCheckpoint(snapshot())
    tables = sum(t.record.nbytes + t.scale.nbytes for t in checkpoint.tensors.values() if t.fmt == "fp8_rows")
    with tables_left_out(host):
        host_sizes = compute_module_sizes(host, dtype=torch.bfloat16, special_dtypes=device_map_dtypes(host))
    gpu_sizes = compute_module_sizes(on_gpu, dtype=torch.bfloat16, special_dtypes=device_map_dtypes(on_gpu))
    assert gpu_sizes[""] - host_sizes[""] == tables

    def least_room(model) -> int:  # bisection on device 0's room (the plan is monotone in it)
        low, high = 0, 2 * gpu_sizes[""]
        while high - low > 1:
            room = (low + high) // 2
            plan = plan_device_map(model, "sequential", torch.bfloat16, {0: room, 1: 2 * gpu_sizes[""]})
            low, high = (low, room) if set(plan.values()) == {0} else (room, high)
        return high

    assert least_room(on_gpu) - least_room(host) == tables
    assert host.layers[1].engram.embed.weight.dtype == torch.float8_e4m3fn  # put back after planning
    materialize(host, {"layers.0": torch.device("meta"), "": torch.device("meta")})  # meta stands in for a GPU
    assert host.layers[1].engram.embed.weight.device.type == "cpu" and host.layers[1].attn.wq_a.weight.is_meta


def test_a_kept_load_allocates_no_floating_point_engram_table():
    """keep_release_formats puts the Engram tables in the stored format on the meta model: no tensor of a table's
    shape in a floating-point dtype other than FP8 is ever created (watched at the dispatcher), whichever way the
    model is materialized (one device, a device_map placing tensor by tensor, tables in host memory)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    checkpoint = ReleasedCheckpoint(snapshot())
    shapes = {tuple(t.shape) for t in checkpoint.tensors.values() if t.fmt == "fp8_rows"}

    created = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(t, torch.Tensor) and not t.is_meta and tuple(t.shape) in shapes
                        and t.dtype.is_floating_point and t.dtype.itemsize > 1):
                    created.append((str(func), t.dtype, tuple(t.shape)))
            return out

    for options in ({}, {"device_map": {"layers.1": "cpu", "": "cpu"}}, {"engram_device": "cpu"}):
        with Watch():
            model = DeepseekV41ForCausalLM.from_pretrained(snapshot(), dtype=torch.bfloat16, **options)
        assert model.layers[1].engram.embed.kept and not created, (options, created[:3])
    # the watch sees such a table: the dequantizing load's
    with Watch():
        DeepseekV41ForCausalLM.from_pretrained(snapshot(), dtype=torch.bfloat16, dequantize_base_checkpoint=True)
    assert created


def test_is_kept_counts_kept_engram_tables():
    """A model whose only stored-format part is an Engram table is kept: it saves in the released format and refuses
    training (the table's own refusal)."""
    model = copy.deepcopy(load("v41_tiny_text", True))
    assert not is_kept(model)
    codes, scale = ReleasedCheckpoint(snapshot()).read_stored("layers.4.engram.embed.weight")
    model.layers[4].engram.load_kept_table(codes, scale)
    assert is_kept(model)
    ids = golden("v41_tiny_text")["input_ids"][:1, :8]
    model.train()
    with pytest.raises(RuntimeError, match=r"dequantize_base_checkpoint=True"):
        model(ids, labels=ids)


@pytest.mark.parametrize("device_map", [{"": "cpu"}, "auto"])
def test_device_map_on_cpu(device_map):
    kwargs = {"max_memory": {"cpu": 10**9}} if device_map == "auto" else {}
    model = DeepseekV41ForCausalLM.from_pretrained(snapshot(), dtype=torch.bfloat16, device_map=device_map, **kwargs)
    assert is_kept(model) and set(model.hf_device_map.values()) == {"cpu"}
    ids = golden("v41_tiny_text")["input_ids"][:1, :16]
    with torch.no_grad():  # = the default kept load (= the dequantized model: test_fallback_logits_equal_...)
        assert torch.equal(model(ids).logits, load("v41_tiny_text", None)(ids).logits)
