"""Checkpoint save/resume under torchrun (2 gloo ranks): a resumed run continues bit-identically."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepseek_v41.training import checkpointing
from deepseek_v41.training.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "configs" / "tiny_cpu.yaml"


def run_tiny(tmp, out, *overrides):
    """The tiny recipe on 2 gloo ranks, no validation (val_every_steps=0); -> the finished process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "examples" / "finetune.py"), str(RECIPE),
           f"--model.config.pretrained_model_name_or_path={tmp / 'ckpt'}", f"--output_dir={out}",
           "--step_scheduler.val_every_steps=0", *overrides]
    result = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def read_metrics(out: Path) -> list:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any("val_loss" in r for r in records)
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    straight, resumed = tmp / "straight", tmp / "resumed"
    run_tiny(tmp, straight, "--step_scheduler.max_steps=6")
    run_tiny(tmp, resumed, "--step_scheduler.max_steps=3", "--checkpoint.save_every_steps=3")
    second = run_tiny(tmp, resumed, "--step_scheduler.max_steps=6", "--checkpoint.resume_from=latest")
    return tmp, straight, resumed, second


def test_resumed_run_matches_the_straight_run_bit_exactly(runs):
    _, straight, resumed, second = runs
    assert "resumed from" in second.stdout and "at step 3" in second.stdout
    full, cont = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in full] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in cont] == [1, 2, 3, 4, 5, 6]  # steps 1..3 kept from the first part
    for a, b in zip(full, cont):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"]), (a, b)
    # only the first part saved: the resumed run had save_every_steps=0
    saved = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    assert saved == ["step_00000003"]
    folder = resumed / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "rank0-of2.pt", "rank1-of2.pt"]


def test_checkpoint_holds_local_shards_remainders_and_moments(runs):
    import torch

    _, _, resumed, _ = runs
    folder = resumed / "checkpoints" / "step_00000003"
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["step"], meta["world_size"], meta["ep_size"], meta["engram_owners"]) == (3, 2, 2, 2)
    ranks = [torch.load(folder / f"rank{r}-of2.pt", weights_only=True) for r in range(2)]
    states = [p["optimizer"]["by_name"] for p in ranks]
    remainders = [s for s in states[0].values() if "remainder" in s]
    assert remainders and all(s["remainder"].dtype == torch.int16 and s["step"] == 3 for s in remainders)
    assert any(bool(s["remainder"].any()) for s in remainders)  # the fp32 masters moved off the bf16 grid
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in remainders)
    experts = [n for n in ranks[0]["model"] if n.endswith("ffn.experts.w1")]
    assert experts and ranks[0]["model"][experts[0]].shape[0] == 4  # 8 experts over EP 2: the local half
    assert not torch.equal(ranks[0]["model"][experts[0]], ranks[1]["model"][experts[0]])


def test_other_layout_or_incomplete_folder_is_refused(runs, tmp_path):
    tmp, _, resumed, _ = runs
    folder = tmp_path / "step_00000003"
    shutil.copytree(resumed / "checkpoints" / "step_00000003", folder)
    recipe = load_recipe(RECIPE, {"model.config.pretrained_model_name_or_path": str(tmp / "ckpt")})
    assert checkpointing.verify_checkpoint(folder, checkpointing.layout_of(recipe, 2))["step"] == 3

    with pytest.raises(RecipeError, match="world_size 2 \\(now 4\\)"):
        checkpointing.verify_checkpoint(folder, checkpointing.layout_of(recipe, 4))
    recipe["distributed"]["ep_size"] = 1
    with pytest.raises(RecipeError, match="ep_size 2 \\(now 1\\)"):
        checkpointing.verify_checkpoint(folder, checkpointing.layout_of(recipe, 2))
    recipe["distributed"]["ep_size"] = 2
    recipe["optimizer"]["exp_avg_dtype"] = "float32"
    with pytest.raises(RecipeError, match="recipe_hash"):
        checkpointing.verify_checkpoint(folder, checkpointing.layout_of(recipe, 2))
    recipe["optimizer"]["exp_avg_dtype"] = "bfloat16"

    (folder / "rank1-of2.pt").unlink()
    with pytest.raises(RecipeError, match="incomplete: rank1-of2.pt missing"):
        checkpointing.verify_checkpoint(folder, checkpointing.layout_of(recipe, 2))
    (folder / "meta.json").unlink()
    with pytest.raises(RecipeError, match="no meta.json"):
        checkpointing.verify_checkpoint(folder, checkpointing.layout_of(recipe, 2))


def test_latest_ignores_unfinished_saves(tmp_path):
    assert checkpointing.latest_checkpoint(tmp_path / "absent") is None
    for name, complete in (("step_00000002", True), ("step_00000010", True), ("step_00000012.tmp", True),
                           ("step_00000011", False)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "meta.json").write_text("{}")
    assert checkpointing.latest_checkpoint(tmp_path).name == "step_00000010"


@pytest.mark.parametrize("key, value, message", [
    ("checkpoint.save_every_steps", -1, "whole number"),
    ("checkpoint.save_every_steps", 2.5, "whole number"),
    ("checkpoint.resume_from", 3, "step_\\* folder path, latest or null"),
])
def test_bad_checkpoint_keys(key, value, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(RECIPE, {"model.config.pretrained_model_name_or_path": "/x", key: value})
