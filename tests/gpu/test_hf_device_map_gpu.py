"""from_pretrained(device_map=...) on GPUs: one device, and the blocks spread over two GPUs for inference
(explicit dict and accelerate's "auto" plan under max_memory); the logits match the single-device model."""

import pytest
import torch
from conftest import tiny_model

from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
IDS = torch.randint(3, 1024, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def folder(tmp_path_factory, v4_tokenizer):
    model = tiny_model(v4_tokenizer, dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cuda:0")
    assert model.embed.weight.device == torch.device("cuda:0") and model.hf_device_map == {"": "cuda:0"}
    with torch.no_grad():
        return model(IDS.cuda()).logits.cpu()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_blocks_spread_over_two_gpus(folder, reference):
    device_map = {"embed": 0, **{f"layers.{i}": 0 if i < 4 else 1 for i in range(9)}, "norm": 1, "head": 1}
    model = DeepseekV41ForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map=device_map)
    assert model.layers[3].attn.wq_a.weight.device.index == 0 and model.layers[4].attn.wq_a.weight.device.index == 1
    with torch.no_grad():
        logits = model(IDS.cuda(0)).logits
    assert logits.device.index == 1
    # not yet measured (no two-GPU machine lent since the gates were reviewed): fp32 on two GPUs of one type runs the
    # same kernels as on one, so equal logits are expected; 1e-5 leaves fp32 rounding room for a library picking
    # another GEMM algorithm on the second device, far below what a block on the wrong device or skipped would give
    torch.testing.assert_close(logits.cpu(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_auto_plan_under_max_memory_uses_both_gpus(folder, reference):
    model = DeepseekV41ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, device_map="sequential", max_memory={0: "3MB", 1: "1GB"}
    )
    assert set(model.hf_device_map.values()) == {"cuda:0", "cuda:1"}
    with torch.no_grad():
        torch.testing.assert_close(model(IDS.cuda(0)).logits.cpu(), reference, rtol=1e-5, atol=1e-5)
