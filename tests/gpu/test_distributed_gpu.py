"""The FSDP2 training path on 2 GPUs with NCCL: the CPU (gloo) checks of ``tests/test_training_parallel.py``
and ``tests/test_training_run.py``, run again with one GPU per rank.

* fp32 parity: FSDP2 + EP2 + Engram row owners, and FSDP2 + EP1, against one process holding the whole global
  batch on the same GPU type (loss to 1e-5, every gradient to a relative L2 error below 1e-4);
* the README's tiny recipe (100 updates, bf16, EP2, activation checkpointing) learns under NCCL.
"""

import math
from pathlib import Path

import pytest
import torch
from gpu_metrics import cpu_test_module

TESTS = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL training tests need 2 CUDA GPUs"),
]


def test_sharded_step_matches_single_process_on_two_gpus(tmp_path):
    parallel = cpu_test_module("test_training_parallel")
    ckpt = tmp_path / "ckpt"
    parallel.make_tiny_checkpoint(ckpt)
    # every rank must report both cases (and exit 0): one rank's line alone does not pass
    out = parallel.run_torchrun(TESTS / "test_training_parallel.py", "model_nccl", ckpt, tmp_path, timeout=300,
                                markers=("MODEL OK ep=2", "MODEL OK ep=1"))
    print(out)


def test_tiny_recipe_learns_on_two_gpus(tmp_path):
    run = cpu_test_module("test_training_run")
    out = tmp_path / "run"
    result = run.finetune(f"--model.config.pretrained_model_name_or_path={tmp_path / 'ckpt'}", f"--output_dir={out}",
                          "--distributed.backend=nccl", timeout=600)
    parallel = cpu_test_module("test_training_parallel")
    parallel.assert_every_rank(result, 2)
    steps, vals = run.read_metrics(out)
    assert len(steps) == 100 and [v["step"] for v in vals] == [50, 100]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    first, last = sum(r["loss"] for r in steps[:10]) / 10, sum(r["loss"] for r in steps[-10:]) / 10
    print(f"loss {first:.3f} -> {last:.3f}; val {vals[0]['val_loss']:.3f} -> {vals[1]['val_loss']:.3f}; "
          f"median tokens/s {sorted(r['tokens_per_s'] for r in steps)[50]:.0f}")
    assert last < first - 1.0, (first, last)
    assert vals[1]["val_loss"] < vals[0]["val_loss"]
