"""DCP training checkpoints on a CUDA GPU under NCCL (one rank): the asynchronous save, which stages CUDA
tensors to host memory in a background thread while training goes on, and a resume from it.

The CPU (gloo) version of these checks, with resharding and kill -9, is ``tests/test_training_resume.py``.
"""

import pytest
import torch
from gpu_metrics import cpu_test_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_async_save_on_cuda_commits_prunes_and_resumes(tmp_path):
    from deepseek_v41.training.checkpointing import verify_folder

    resume = cpu_test_module("test_training_resume")
    nccl = ["--distributed.backend=nccl", "--step_scheduler.max_steps=4"]
    resume.launch(tmp_path, tmp_path / "A", *nccl, "--checkpoint.save_every_steps=1", "--checkpoint.async_save=true",
                  "--checkpoint.keep_last=2", world=1)
    root = tmp_path / "A" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]
    for step in (3, 4):
        meta = verify_folder(root / f"step_{step:08d}")
        assert (meta["step"], meta["world_size"]) == (step, 1)
    result = resume.launch(tmp_path, tmp_path / "B", *nccl, f"--checkpoint.resume_from={root / 'step_00000003'}",
                           world=1)
    assert "at step 3" in result.stdout
    got, ref = resume.losses(tmp_path / "B"), resume.losses(tmp_path / "A")
    print(f"step 4 loss: straight {ref[4]!r}, resumed {got[4]!r}")
    # the first update after the resume is computed from the loaded state: same loss (CUDA scatter-adds in
    # the backward of the earlier updates do not enter it)
    assert sorted(got) == [4] and abs(got[4] - ref[4]) < 1e-5
