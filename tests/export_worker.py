"""torchrun worker of tests/test_export.py: the trainer's model (FSDP2 + EP 2 + Engram owners 2 on 2 gloo ranks)
exported by ``deepseek_v41.training.export``, and rank 0's ``save_pretrained`` of the same checkpoint's weights;
then the refusals: NaN weights in the export, a damaged shard in the trainer's load.

    torchrun --nproc_per_node 2 tests/export_worker.py CHECKPOINT OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torchrun_launch import mark, say

REPO = Path(__file__).resolve().parents[1]


def main(checkpoint: str, out: Path) -> None:
    from deepseek_v41.checkpoint import CheckpointError, ReleasedCheckpoint
    from deepseek_v41.hf_export import ExportError
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM
    from deepseek_v41.training.export import export_model
    from deepseek_v41.training.loop import Trainer
    from deepseek_v41.training.recipe import load_recipe
    from deepseek_v41.training.sharded_load import load_sharded_checkpoint

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
        reference = DeepseekV41ForCausalLM.from_pretrained(checkpoint, dtype=dtype, tokenizer=trainer.tokenizer,
                                                           dequantize_base_checkpoint=True)  # as the trainer loads
        reference.save_pretrained(out / "reference_fp")
        reference.save_pretrained(out / "reference_release", quantize="release")
        mark("REFERENCES SAVED")
    dist.barrier()
    # a NaN in one expert row held by rank 1 only: every rank refuses before anything is gathered or written
    experts = trainer.model.layers[0].ffn.experts
    if dist.get_rank() == 1:
        with torch.no_grad():
            local = experts.w1.to_local() if hasattr(experts.w1, "to_local") else experts.w1
            local[0, 0, 0] = float("nan")
    try:
        export_model(trainer, out / "nan_export", None)
    except ExportError as error:
        say(f"NAN REFUSED on rank {dist.get_rank()}: {error}")
    dist.barrier()
    # a multi-shard export of ours with one shard damaged (same size) that rank 1 verifies: the trainer's load
    # stops every rank naming it, before any tensor is read (each shard is compared by one rank)
    if dist.get_rank() == 0:
        reference.save_pretrained(out / "damaged", max_shard_size="300KB")
        files = ReleasedCheckpoint(out / "damaged").files
        damaged = files[1::2][0]  # the first shard of rank 1's share
        data = bytearray(damaged.read_bytes())
        header = 8 + int.from_bytes(data[:8], "little")
        data[header + 64 : header + 72] = bytes(b ^ 0xFF for b in data[header + 64 : header + 72])
        damaged.write_bytes(data)
        say(f"DAMAGED {damaged} of {len(files)} shards")
    dist.barrier()
    embed = trainer.model.embed.weight
    before = (embed.to_local() if hasattr(embed, "to_local") else embed).clone()
    try:
        load_sharded_checkpoint(trainer.model, out / "damaged")
    except CheckpointError as error:
        after = embed.to_local() if hasattr(embed, "to_local") else embed
        say(f"DAMAGED SHARD REFUSED on rank {dist.get_rank()} (weights untouched: {torch.equal(before, after)}): "
            f"{error}")
    dist.barrier()


if __name__ == "__main__":
    # imported before the default group exists: torch.distributed.nn, which it pulls in, would keep that
    # group in its functions' defaults for the life of the process
    from deepseek_v41.training.loop import release_process_groups

    dist.init_process_group("gloo")
    try:
        main(sys.argv[1], Path(sys.argv[2]))
    except BaseException:
        dist.destroy_process_group()
        raise
    release_process_groups()  # main() returned: its trainer goes with the groups, their gloo workers joined
    torch.set_num_threads(1)
