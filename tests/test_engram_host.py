"""Engram tables held as stored (FP8 rows + scales, ``load_kept_table``) and in host memory (``engram_device="cpu"``),
on the golden tiny text fixture (Engram at layers 1 and 4, tables stored F8_E4M3 with F8_E8M0 scales).

The reference for a kept row is an independent decode (codes as fp32 times each 32-column group's scale) and the
dequantizing loader's table; the reference for the host path is the model with its tables in the model."""

import copy
import json

import pytest
import torch
from conftest import golden_dir
from safetensors import safe_open

from deepseek_v41.engram_host import EngramTable, PrefetchedRows
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype, materialize

IDS = torch.randint(3, 1024, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def snapshot():
    return golden_dir("v41_tiny_text") / "snapshot"


def read_stored_tables(snapshot) -> dict:
    """{layer: (codes F8_E4M3, scale F8_E8M0)} read straight from the fixture's shards."""
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    tables = {}
    for layer in (1, 4):
        name = f"layers.{layer}.engram.embed"
        with safe_open(snapshot / index[f"{name}.weight"], "pt") as f:
            codes = f.get_tensor(f"{name}.weight")
        with safe_open(snapshot / index[f"{name}.scale"], "pt") as f:
            scale = f.get_tensor(f"{name}.scale")
        tables[layer] = codes, scale
    return tables


@pytest.fixture(scope="module")
def stored_tables(snapshot):
    return read_stored_tables(snapshot)


def load(snapshot, **options):
    return DeepseekV41ForCausalLM.from_pretrained(snapshot, dtype=torch.bfloat16, dequantize_base_checkpoint=True,
                                                  **options)


def keep_tables(model, stored_tables):
    for layer, (codes, scale) in stored_tables.items():
        model.layers[layer].engram.load_kept_table(codes.clone(), scale.clone())
    return model


@pytest.fixture(scope="module")
def reference(snapshot):
    """The dequantizing load (tables on the model's device) and its logits / decode-step logits."""
    model = load(snapshot)
    return model, *prefill_and_step(model)


@pytest.fixture(scope="module")
def host(snapshot):
    """The dequantizing load with engram_device="cpu" (bf16 tables in host memory)."""
    return load(snapshot, engram_device="cpu")


def prefill_and_step(model):
    with torch.no_grad():
        out = model(IDS, use_cache=True)
        return out.logits, model(IDS[:, :1], past_key_values=out.past_key_values).logits


def independent_decode(codes, scale):
    # E4M3 value times 2^(e-127) per 32 columns, in fp32 (exact), rounded once to bf16
    factor = torch.ldexp(torch.ones(scale.shape), scale.view(torch.uint8).int() - 127)
    return (codes.float() * factor.repeat_interleave(32, 1)[:, : codes.shape[1]]).to(torch.bfloat16)


def test_kept_rows_equal_the_dequantized_tables_rows(reference, stored_tables):
    model = reference[0]
    for layer, (codes, scale) in stored_tables.items():
        dequantized = model.layers[layer].engram.embed.weight.detach()
        assert torch.equal(dequantized, independent_decode(codes, scale))  # the loader's table, checked independently
        rows = codes.shape[0]
        ids = torch.tensor([[0, rows - 1, 5], [5, 7, rows // 2]])  # repeats and both ends
        for stored_scale in (scale, scale.float()):  # UE8M0, and the F32 scales of older releases
            with torch.device("meta"), default_dtype(torch.bfloat16):  # the table of a bf16 model
                table = EngramTable(rows, codes.shape[1]).eval()
            table.load_kept_table(codes, stored_scale)
            assert table.weight.dtype == torch.float8_e4m3fn and not isinstance(table.weight, torch.nn.Parameter)
            got = table(ids)
            assert got.dtype == torch.bfloat16 and got.shape == (2, 3, codes.shape[1])
            assert torch.equal(got.view(torch.int16), dequantized[ids].view(torch.int16))  # bit for bit
            assert table.rows_gathered == 6


def test_kept_and_host_tables_give_the_same_logits(reference, host, stored_tables):
    _, logits, step = reference
    assert host.config.text_config.engram_device == "cpu"
    kept = keep_tables(copy.deepcopy(reference[0]), stored_tables)
    kept_host = keep_tables(copy.deepcopy(host), stored_tables)
    for model in (host, kept, kept_host):
        got_logits, got_step = prefill_and_step(model)
        assert torch.equal(got_logits, logits) and torch.equal(got_step, step)  # bit-equal on the CPU


def test_a_prefill_gathers_each_row_once_and_a_decode_step_only_its_new_tokens(host, stored_tables, monkeypatch):
    waits = []  # the prefill's rows come prefetched (before layer 0), one PrefetchedRows per Engram layer
    monkeypatch.setattr(PrefetchedRows, "wait", lambda self, wait=PrefetchedRows.wait: waits.append(self) or wait(self))
    model = keep_tables(copy.deepcopy(host), stored_tables)
    tables = [model.layers[i].engram.embed for i in (1, 4)]
    for table in tables:
        table.rows_gathered = 0  # the copied model's earlier forwards
    cols = (4 - 1) * 4  # (max_ngram_size - 1) * n_heads columns per token
    with torch.no_grad():
        out = model(IDS, use_cache=True)
        assert [t.rows_gathered for t in tables] == [IDS.numel() * cols] * 2
        assert [w.table for w in waits] == tables and all(w.stream is None for w in waits)  # CPU: no stream
        model(IDS[:, :1], past_key_values=out.past_key_values)  # one new token per row
    assert [t.rows_gathered for t in tables] == [(IDS.numel() + IDS.shape[0]) * cols] * 2
    assert len(waits) == 2  # the step looked its rows up in the forward


def test_state_dict_holds_the_stored_bytes_under_the_released_names(host, stored_tables):
    model = keep_tables(copy.deepcopy(host), stored_tables)
    state = model.state_dict()
    for layer, (codes, scale) in stored_tables.items():
        name = f"layers.{layer}.engram.embed"
        assert state[f"{name}.weight"].dtype == torch.float8_e4m3fn and state[f"{name}.scale"].dtype == scale.dtype
        assert torch.equal(state[f"{name}.weight"].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(state[f"{name}.scale"].view(torch.uint8), scale.view(torch.uint8))
    assert not any(n.startswith("layers.1.engram.embed") for n, _ in model.named_parameters())


def test_moves_and_casts_leave_host_tables_on_the_host_and_kept_codes_as_stored(reference, host, stored_tables):
    model = keep_tables(copy.deepcopy(host), stored_tables)
    model.to(torch.float32).to("meta")  # a cast, then a move (meta stands in for a GPU here)
    table = model.layers[1].engram.embed
    assert model.layers[1].engram.wkv.weight.is_meta and model.embed.weight.is_meta
    assert table.weight.device.type == "cpu" and table.weight.dtype == torch.float8_e4m3fn
    assert table.scale.dtype == torch.float8_e8m0fnu and table.compute_dtype == torch.float32
    assert torch.equal(table.weight.view(torch.uint8), stored_tables[1][0].view(torch.uint8))
    # a device_map placement (materialize's per-tensor path) allocates host tables on the host
    with torch.device("meta"):
        fresh = DeepseekV41ForCausalLM(host.config, tokenizer=host.engram_tokenizer)
    materialize(fresh, {"layers.0": torch.device("meta"), "": torch.device("meta")})
    assert fresh.layers[4].engram.embed.weight.device.type == "cpu" and fresh.layers[4].attn.wq_a.weight.is_meta
    kept = keep_tables(copy.deepcopy(reference[0]), stored_tables)  # kept, with the model: a cast leaves it FP8
    kept.to(torch.float32)
    assert kept.layers[4].engram.embed.weight.dtype == torch.float8_e4m3fn
    assert kept.layers[4].engram.embed.compute_dtype == torch.float32
    kept.layers[4].engram.embed.hold_on_host()  # a loaded model's table sent to the host, to stay there
    kept.to("meta")
    assert kept.layers[4].engram.embed.scale.device.type == "cpu" and kept.layers[1].engram.embed.weight.is_meta


def test_training_a_kept_table_is_refused(reference, host, stored_tables):
    for model in (reference[0], host):
        kept = keep_tables(copy.deepcopy(model), stored_tables).train()
        with pytest.raises(RuntimeError, match="dequantize_base_checkpoint=True"):
            kept(IDS[:, :8], labels=IDS[:, :8])

def test_bad_tables_and_settings_are_refused(stored_tables, snapshot):
    codes, scale = stored_tables[1]
    table = EngramTable(*codes.shape)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        table.load_kept_table(codes.float(), scale)
    with pytest.raises(ValueError, match=r"scales must be .* \[1464, 1\]"):
        table.load_kept_table(codes, scale[:, :0])
    broken = scale.clone()
    broken.view(torch.uint8)[3, 0] = 255
    with pytest.raises(ValueError, match="NaN"):
        table.load_kept_table(codes, broken)
    with pytest.raises(ValueError, match="engram_device"):
        load(snapshot, engram_device="cuda")
