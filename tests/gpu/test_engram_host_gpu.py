"""Engram tables in host memory (engram_device="cpu") on a GPU: the same logits and generated tokens as the tables
on the GPU (kept FP8 and bf16 tables), the rows copied on a side stream, the tables never on the GPU."""

import json

import pytest
import torch
from conftest import golden_dir
from test_engram_host import keep_tables, load, read_stored_tables

from deepseek_v41.engram_host import PrefetchedRows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
IDS = torch.randint(3, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
COLS = (4 - 1) * 4  # the fixture's (max_ngram_size - 1) * n_heads


@pytest.fixture(scope="module")
def snapshot():
    return golden_dir("v41_tiny_text") / "snapshot"


@pytest.fixture(scope="module")
def stored_tables(snapshot):
    return read_stored_tables(snapshot)


def models(snapshot, stored_tables, kept: bool):
    on_gpu = load(snapshot, device="cuda")
    on_host = load(snapshot, device="cuda", engram_device="cpu")
    if kept:
        keep_tables(on_gpu, stored_tables)
        keep_tables(on_host, stored_tables)
    table = on_host.layers[1].engram.embed
    assert table.weight.device.type == "cpu" and on_host.layers[1].engram.wkv.weight.is_cuda
    assert on_gpu.layers[1].engram.embed.weight.is_cuda and table.kept == kept
    return on_gpu, on_host


@pytest.mark.parametrize("kept", [True, False], ids=["kept_fp8", "bf16"])
def test_host_tables_give_the_logits_and_tokens_of_gpu_tables(snapshot, stored_tables, kept):
    on_gpu, on_host = models(snapshot, stored_tables, kept)
    ids = IDS.cuda()
    with torch.no_grad():
        reference = on_gpu(ids).logits
        noise = (on_gpu(ids).logits - reference).abs().max().item()  # 0 where the kernels are deterministic
        got = on_host(ids).logits
    if noise == 0:  # the same rows, so the same logits bit for bit
        assert torch.equal(got, reference)
    else:  # run-to-run variation of the kernels themselves: the host path may differ by no more (4x margin)
        assert (got - reference).abs().max().item() <= 4 * noise
    generated = on_gpu.generate(ids[:, :16], max_new_tokens=6, do_sample=False)
    if noise == 0:
        assert torch.equal(on_host.generate(ids[:, :16], max_new_tokens=6, do_sample=False), generated)


def test_rows_are_copied_on_a_side_stream(snapshot, stored_tables, monkeypatch, tmp_path):
    _, on_host = models(snapshot, stored_tables, kept=True)
    waits = []
    monkeypatch.setattr(PrefetchedRows, "wait", lambda self, wait=PrefetchedRows.wait: waits.append(self) or wait(self))
    ids = IDS.cuda()
    with torch.no_grad():
        on_host(ids)  # warm-up (pinned buffers, kernels)
        waits.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profile:
            on_host(ids)
            torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    assert len(waits) == 2 and all(w.stream is not None and w.stream != compute for w in waits)
    profile.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    kernels = [e["args"]["stream"] for e in events if e.get("cat") == "kernel"]
    main = max(set(kernels), key=kernels.count)  # the compute stream: most kernels run there
    n = IDS.numel() * COLS  # one layer's rows: codes (32 bytes each, 16-byte aligned) then one UE8M0 scale each
    packed = -(-n * 32 // 16) * 16 + n
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and e["args"].get("bytes") == packed]
    assert len(copies) == 2, [e["name"] for e in copies]  # one copy per Engram layer
    assert all("HtoD" in e["name"] and e["args"]["stream"] != main for e in copies)


def test_a_table_kept_before_materialization_is_filled_in_place(stored_tables):
    from deepseek_v41.engram_host import EngramTable
    from deepseek_v41.modeling_deepseek_v41 import default_dtype

    codes, scale = stored_tables[1]
    with torch.device("meta"), default_dtype(torch.bfloat16):
        table = EngramTable(*codes.shape).eval()
    table.keep_format()  # what a kept-format load does on the meta model: no bf16 table is ever allocated
    table.to_empty(device="cuda")
    where = table.weight.data_ptr()
    table.load_kept_table(codes, scale)  # host tensors, as read from the shards
    assert table.weight.data_ptr() == where and table.weight.is_cuda
    ids = torch.arange(codes.shape[0], device="cuda")
    reference = codes.float() * torch.ldexp(torch.ones(scale.shape), scale.view(torch.uint8).int() - 127) \
        .repeat_interleave(32, 1)
    assert torch.equal(table(ids).cpu(), reference.to(torch.bfloat16))
