"""torchrun worker of tests/test_export.py: the trainer's model (FSDP2 + EP 2 + Engram owners 2 on 2 gloo ranks)
exported by ``deepseek_v41.training.export``, and rank 0's ``save_pretrained`` of the same checkpoint's weights.

    torchrun --nproc_per_node 2 tests/export_worker.py CHECKPOINT OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torchrun_launch import mark

REPO = Path(__file__).resolve().parents[1]


def main(checkpoint: str, out: Path) -> None:
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM
    from deepseek_v41.training.export import export_model
    from deepseek_v41.training.loop import Trainer
    from deepseek_v41.training.recipe import load_recipe

    recipe = load_recipe(REPO / "examples" / "configs" / "tiny_cpu.yaml", {
        "model.config.pretrained_model_name_or_path": checkpoint,
        "distributed.backend": "gloo",
        "distributed.ep_size": 2,
        "model.config.backend": {"dispatcher": "torch"},
        "output_dir": str(out / "run"),
    })
    trainer = Trainer(recipe)
    assert trainer.ep_mesh["ep"].size() == 2 and trainer.model.layers[1].engram.table_rows[0] == dist.get_rank() * 732
    for quantize, kind in ((None, "fp"), ("release", "release")):
        export_model(trainer, out / f"sharded_{kind}", quantize)
    mark("EXPORTED")
    if dist.get_rank() == 0:  # the same weights, whole in one process
        dtype = trainer.model.embed.weight.dtype
        reference = DeepseekV41ForCausalLM.from_pretrained(checkpoint, dtype=dtype, tokenizer=trainer.tokenizer)
        reference.save_pretrained(out / "reference_fp")
        reference.save_pretrained(out / "reference_release", quantize="release")
        mark("REFERENCES SAVED")
    dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        main(sys.argv[1], Path(sys.argv[2]))
    finally:
        dist.destroy_process_group()
    torch.set_num_threads(1)
