"""DCP training checkpoints on a CUDA GPU under NCCL (one rank): the asynchronous save, which stages CUDA
tensors to host memory in a background thread while training goes on, and a resume from it.

The CPU (gloo) version of these checks, with resharding and kill -9, is ``tests/test_training_resume.py``.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _resume_module():
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    spec = importlib.util.spec_from_file_location("_cpu_test_training_resume", TESTS / "test_training_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_async_save_on_cuda_commits_prunes_and_resumes(tmp_path):
    from deepseek_v41.training.checkpointing import verify_folder

    resume = _resume_module()
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
