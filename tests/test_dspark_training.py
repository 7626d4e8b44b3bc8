"""The tiny CPU recipe with the DSpark stages' loss on (``model.dspark_loss_weight``): 2 gloo ranks, FSDP2 + EP 2,
a tiny released-format checkpoint with 3 DSpark stages.  This file is also the torchrun worker (``__main__``): each
rank trains the same 2 updates with the switch off, then on, and checks them itself (``torchrun_launch.mark``)."""

import math
import sys
from pathlib import Path

import pytest
from torchrun_launch import NO_GLOO_LEFT, assert_every_rank, mark, torchrun

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "configs" / "tiny_cpu.yaml"
# the tiny config plus 3 window-only stages of 4 experts (top 3) over the inputs of layers 6-8, as v41_tiny_dspark
DSPARK = {"num_nextn_predict_layers": 3, "dspark_block_size": 4, "dspark_noise_token_id": 128799,
          "dspark_target_layer_ids": [6, 7, 8], "dspark_markov_rank": 4, "dspark_n_routed_experts": 4,
          "dspark_num_experts_per_tok": 3, "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0]}
# 2 updates at the full rate, the flagship's activation checkpointing (the stages are checkpointed like blocks)
RUN = ["--step_scheduler.val_every_steps=0", "--step_scheduler.max_steps=2", "--checkpoint.reload_export=false",
       "--lr_scheduler.lr_warmup_steps=0", "--fsdp.activation_checkpointing=true"]


def test_two_gloo_ranks_train_the_stages_and_leave_the_backbone_as_it_was(tmp_path):
    """Every rank: the stages' experts EP-sharded (2 of 4 per rank), the stage metrics in the records, finite and
    beside the main loss, the stage loss falling; the main loss and the backbone's gradient norm equal the
    switch-off run's bit for bit (the stages read detached inputs and are clipped on their own); the stages'
    weights moved, the training checkpoint restores them and the export holds them."""
    from deepseek_v41.training.tiny_checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", **DSPARK)
    result = torchrun(Path(__file__), RECIPE, f"--model.config.pretrained_model_name_or_path={ckpt}",
                      f"--output_dir={tmp_path / 'run'}", *RUN, timeout=400)
    assert_every_rank(result, 2, "DSPARK TRAINING OK", *NO_GLOO_LEFT)
    assert "dspark_loss" in (tmp_path / "run" / "on" / "metrics.jsonl").read_text()
    assert "dspark_loss" not in (tmp_path / "run" / "off" / "metrics.jsonl").read_text()
    # the export carries the trained stages (the switch itself stays with the run)
    import torch

    from deepseek_v41.checkpoint import ReleasedCheckpoint
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "run" / "on" / "model")
    assert len(model.mtp) == 3 and model.config.text_config.dspark_loss_weight == 0.0
    base = ReleasedCheckpoint(ckpt).decode("mtp.2.confidence_head.proj.weight").float()
    assert not torch.equal(model.mtp[2].confidence_head.proj.weight.float(), base)


def test_recipe_switch_is_checked(tmp_path):
    from deepseek_v41.training.model_setup import build_config
    from deepseek_v41.training.recipe import RecipeError, load_recipe
    from deepseek_v41.training.tiny_checkpoint import make_tiny_checkpoint

    with pytest.raises(RecipeError, match=r"model.dspark_loss_weight=-0.1 is not valid: expected a finite number >= 0"):
        load_recipe(RECIPE, {"model.dspark_loss_weight": -0.1})
    plain = make_tiny_checkpoint(tmp_path / "plain")
    recipe = load_recipe(RECIPE, {"model.dspark_loss_weight": 0.3, "model.config.pretrained_model_name_or_path": str(plain)})
    with pytest.raises(RecipeError, match="checkpoint's config has none .*set model.dspark_loss_weight=0"):
        build_config(recipe, plain)
    recipe["model"]["config"]["text_config"] = {"dspark_loss_weight": 0.3}
    with pytest.raises(RecipeError, match="set model.dspark_loss_weight instead"):
        build_config(recipe, plain)


# ---- torchrun worker -----------------------------------------------------------------------------------


def _worker(argv: list) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from deepseek_v41.training.checkpointing import verify_folder
    from deepseek_v41.training.loop import Trainer

    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p
    from deepseek_v41.training.recipe import load_recipe, parse_overrides

    overrides = parse_overrides(argv[1:])
    runs = {}
    for name, weight in (("off", 0.0), ("on", 0.5)):
        out = overrides["output_dir"]
        recipe = load_recipe(argv[0], {**overrides, "output_dir": f"{out}/{name}", "model.dspark_loss_weight": weight,
                                       "checkpoint.export_dir": f"{out}/{name}/model" if weight else None,
                                       "checkpoint.save_every_steps": 2 if weight else 0})
        trainer = Trainer(recipe)
        stages = getattr(trainer.model, "mtp", None)
        before = [p.detach().clone() for p in trainer.stage_params] if stages is not None else []
        runs[name] = trainer.fit()
        if weight:
            assert len(stages) == 3 and stages[0].ffn.experts.w1.shape[0] == 2  # 4 experts over EP 2
            assert all(not torch.equal(b, p.detach()) for b, p in zip(before, trainer.stage_params))
            # the training checkpoint holds the stages: wiped, they come back from it bit for bit
            trained = [local(p).clone() for p in trainer.stage_params]
            with torch.no_grad():
                for p in trainer.stage_params:
                    local(p).zero_()
            folder = Path(recipe["output_dir"]) / "checkpoints" / "step_00000002"
            trainer.checkpointer.load(folder, verify_folder(folder))
            assert all(torch.equal(t, local(p)) for t, p in zip(trained, trainer.stage_params))
        else:
            assert stages is None and not trainer.stage_params
    for off, on in zip(runs["off"], runs["on"], strict=True):
        assert on["loss"] == off["loss"] and on["grad_norm"] == off["grad_norm"], (on, off)
        for key in ("dspark_loss", "dspark_confidence_loss", "dspark_accuracy", "dspark_grad_norm"):
            assert math.isfinite(on[key]) and key not in off, (key, on)
        assert on["dspark_loss"] > 0 and on["dspark_grad_norm"] > 0
    # measured: 12.89, then 12.41 (the stages learn; each update sees other rows)
    assert runs["on"][-1]["dspark_loss"] < runs["on"][0]["dspark_loss"] - 0.3, runs["on"]
    dist.barrier()
    mark("DSPARK TRAINING OK")


if __name__ == "__main__":
    from deepseek_v41.training.loop import release_process_groups

    _worker(sys.argv[1:])
    release_process_groups()  # _worker returned: its trainers go with the groups, their gloo workers joined
