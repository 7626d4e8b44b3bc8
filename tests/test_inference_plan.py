"""The inference planner (deepseek_v41/training/inference_plan.py): the released model's bytes by stored format
against the issue's figures and the formats' own arithmetic, the cache against a real static cache, the placement
against the model's own device_map planner, the verdicts per machine, bad input and the command line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepseek_v41.training import inference_plan as ip
from deepseek_v41.training.plan import meta_model, read_config

REPO = Path(__file__).resolve().parents[1]
EXPERTS = 40 * 384 * 3 * 2304 * 5120  # routed expert elements of the release (architecture.md §12)
ENGRAM_ROWS = 384006168 + 384016682


@pytest.fixture(scope="module")
def released():
    """The released config's meta model swapped to kept formats, and one in bf16 (built once each)."""
    config, source = read_config(None)
    assert "released" in source
    kept, bf16 = meta_model(config), meta_model(config)
    return config, kept, ip.prepare_model(kept, "kept"), bf16, ip.prepare_model(bf16, "bf16")


def _group(table, group, category=None):
    return sum(size for c, g, size in table.values() if g == group and (category is None or c == category))


def test_weight_totals_match_the_issue_and_the_formats(released):
    _, _, kept, _, bf16 = released
    # bf16 backbone (everything but the Engram tables and DSpark) 1.10 TB = 552B params (+ the fp32 islands' 2 B)
    backbone_bf16 = _group(bf16, "backbone") + _group(bf16, "vision")
    assert round(backbone_bf16 / 1e12, 2) == 1.11 and 1.10e12 < backbone_bf16 < 1.11e12
    assert round(_group(bf16, "Engram tables") / 1e12, 2) == 0.39  # 196.6B params in bf16
    # FP4 experts: half a byte per element plus one UE8M0 byte per 32 (released [out, in/2] I8 + [out, in/32])
    assert _group(kept, "backbone", ip.FORMATS[0]) == EXPERTS // 2 + EXPERTS // 32
    assert round(EXPERTS / 1e9, 1) == 543.6
    # Engram tables: one E4M3 byte per element and one scale byte per 32 of the 256 columns
    assert _group(kept, "Engram tables") == ENGRAM_ROWS * (256 + 8)
    assert round(_group(kept, "Engram tables") / 1e12, 2) == 0.20
    kept_backbone = _group(kept, "backbone") + _group(kept, "vision")
    assert round(kept_backbone / 1e12, 2) == 0.30
    # one FP8 linear exactly: wq_b [32768, 1280] E4M3 + [1024, 40] scales, per layer
    assert kept["layers.0.attn.wq_b.weight"] == ("FP8 linears (E4M3 + UE8M0 32x32)", "backbone", 32768 * 1280 + 1024 * 40)
    assert kept["head.weight"][0] == "fp32"  # held in fp32 in both modes


def test_cache_bytes_match_a_real_static_cache(v4_tokenizer):
    from conftest import tiny_model

    from deepseek_v41.cache_deepseek_v41 import DeepseekV41StaticCache

    model = tiny_model(v4_tokenizer, dtype=torch.bfloat16).eval()
    text = model.config.text_config
    batch, length = 2, 40
    cache = DeepseekV41StaticCache(model.config, length)
    with torch.no_grad():
        model(torch.randint(3, 1000, (batch, 12)), cache=cache)
    planned = sum(ip.layer_cache_bytes(text, i, batch, length) for i in range(text.num_hidden_layers))
    assert planned + ip.cache_extra_bytes(text, batch) == cache.nbytes()


def test_placement_is_the_models_own_device_map(released):
    from deepseek_v41.engram_host import EngramTable
    from deepseek_v41.modeling_deepseek_v41 import plan_device_map

    config, _, _, bf16, table = released
    plan = ip.plan_inference(bf16, config, gpus=8, gpu_memory=400 * 2**30, weights="bf16", engram="cpu",
                             prepared=table)
    tables = [m for m in bf16.modules() if isinstance(m, EngramTable)]
    try:  # the tables as engram_device="cpu" builds them: from_pretrained's own plan leaves them out by itself
        for t in tables:
            t.held_on_host = True
        with ip._quiet_accelerate():
            ours = plan_device_map(bf16, "auto", torch.bfloat16, dict(plan["max_memory"]))
    finally:
        for t in tables:
            t.held_on_host = False
    assert plan["device_map"] == ours and plan["fits"]
    assert all(t.weight.is_meta for t in tables)  # put back after planning
    tables = sum(s for _, g, s in table.values() if g == "Engram tables")
    assert sum(g["weights"] for g in plan["per_gpu"].values()) == sum(s for _, _, s in table.values()) - tables


@pytest.mark.parametrize("machine, engram, fits", [
    ("8xH200", "gpu", False), ("8xH200", "cpu", True),
    ("8xH100", "gpu", False), ("8xH100", "cpu", False),
    ("4xH200", "gpu", False), ("4xH200", "cpu", True),
])
def test_verdicts_at_batch_1_and_32k(released, machine, engram, fits):
    config, model, table, _, _ = released
    gpus, memory = ip.parse_machine(machine)
    plan = ip.plan_inference(model, config, gpus=gpus, gpu_memory=memory, engram=engram, prepared=table)
    assert plan["fits"] is fits
    if engram == "gpu":  # an Engram table's block (~101 GiB) fits no GPU's room once the 32k prefill is set aside
        assert plan["first_unplaced"][0] == "layers.1" and plan["first_unplaced"][1] > 94 * 2**30
    else:
        assert plan["host"]["Engram tables (pinned)"] == ENGRAM_ROWS * 264
    if fits:
        assert plan["unplaced"] == 0 and min(g["free"] for g in plan["per_gpu"].values()) > 0
        assert "verdict: fits" in ip.format_inference_plan(plan, "released")


def test_bigger_batches(released):
    config, model, table, _, _ = released
    gpus, memory = ip.parse_machine("8xH200")
    # 32 rows of 32k positions after 512-token prompts: 32 static caches (about 3.5 GiB) fit beside the weights
    plan = ip.plan_inference(model, config, gpus=gpus, gpu_memory=memory, engram="cpu", batch=32, context=32768,
                             prefill_tokens=512, prepared=table)
    assert plan["fits"] and 3 * 2**30 < plan["cache"] < 4 * 2**30
    # 8 rows prefilling 128k each: the activations alone exceed a GPU
    plan = ip.plan_inference(model, config, gpus=gpus, gpu_memory=memory, engram="cpu", batch=8, context=131072,
                             prepared=table)
    assert not plan["fits"] and "activations and the cache alone" in ip.verdict_line(plan)


def test_bad_input(capsys):
    for argv, message in ((["--machine", "8xA100"], "unknown machine '8xA100'"),
                          (["--gpus", "8", "--gpu-memory=-80GB"], "must be positive"),
                          (["--gpus", "8", "--gpu-memory", "lots"], "is not a size"),
                          (["--gpus", "8"], "give --machine"),
                          (["--gpus", "0", "--gpu-memory", "80GB"], "must be at least 1")):
        with pytest.raises(SystemExit) as exit_info:
            ip.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
    assert ip.parse_memory("141GB") == 141 * 10**9 and ip.parse_memory("80") == 80 * 2**30
    assert ip.parse_machine("4xH200") == (4, 143771 * 2**20)


def test_readme_table_is_the_commands_output():
    config, _ = read_config(None)
    table = ip.machine_table(meta_model(config), config)  # what `inference_plan --table` prints
    assert table in (REPO / "README.md").read_text()


def test_command_line(tmp_path):
    from conftest import tiny_config

    tiny_config().save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-m", "deepseek_v41.training.inference_plan", "--config", str(tmp_path),
                          "--gpus", "2", "--gpu-memory", "8GiB", "--context", "1024"], check=False, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "FP4 experts" in out.stdout and "verdict: fits" in out.stdout and str(tmp_path) in out.stdout
