"""The CUDA sparse-attention kernels' dispatch rules, shared-memory limits, input errors and compiled code (CPU;
the kernels themselves are tested in tests/gpu/test_tilelang_attention.py)."""

import pytest
import torch

from deepseek_v41 import sparse_attention_cuda as sac
from deepseek_v41 import sparse_attention_cuda_bwd as sacb


def test_usable_only_for_head_dim_512_on_a_gpu_and_not_when_told_otherwise(monkeypatch):
    cpu = torch.device("cpu")
    assert not sac.cuda_forward_usable(512, 640, cpu)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        gpu = torch.device("cuda")
        assert sac.cuda_forward_usable(512, 640, gpu)
        assert not sac.cuda_forward_usable(192, 640, gpu)
        assert not sac.cuda_forward_usable(512, sac.MAX_SLOTS + 128, gpu)
        monkeypatch.setenv("DS41_SPARSE_FWD", "tilelang")
        assert not sac.cuda_forward_usable(512, 640, gpu)


def test_slot_limit_follows_the_shared_memory_budget():
    # the index row (4 bytes a slot) and two items' slot masks (2 bits) follow the fixed part, within Hopper's 227 KB
    assert sac.MAX_SLOTS % sac.SLOTS_PER_PAIR == 0
    assert sac._smem_bytes(sac.MAX_SLOTS) <= 227 * 1024 < sac._smem_bytes(sac.MAX_SLOTS + sac.SLOTS_PER_PAIR)
    assert sac._smem_bytes(640) == sac._SMEM_FIXED + 640 * 4 + 2 * 640 // 8
    assert sac.MAX_SLOTS >= 128 + 2048  # a window plus a top-k of 2048 fits
    # the kernel asserts (static_assert) that its layout starts the index row where the launcher's size assumes
    assert f"offsetof(Smem, idx) == {sac._SMEM_FIXED - 1024}," in sac._SOURCE
    assert [sac.padded_slots(k) for k in (128, 192, 640, 641)] == [128, 256, 640, 768]


def test_bad_shapes_are_refused_with_the_reason():
    q = torch.zeros(1, 2, 64, 256, dtype=torch.bfloat16)
    kv = torch.zeros(1, 3, 256, dtype=torch.bfloat16)
    idx = torch.zeros(1, 2, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="H % 64 == 0"):
        sac.sparse_attention_forward_cuda(q, kv, idx, torch.zeros(64), 0.1)
    q = torch.zeros(1, 2, 48, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q \(1, 2, 48, 512\)"):
        sac.sparse_attention_forward_cuda(q, torch.zeros(1, 3, 512, dtype=torch.bfloat16), idx, torch.zeros(48), 0.1)
    q = torch.zeros(1, 2, 64, 512, dtype=torch.bfloat16)
    big = torch.zeros(1, 2, sac.MAX_SLOTS + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most"):
        sac.sparse_attention_forward_cuda(q, torch.zeros(1, 3, 512, dtype=torch.bfloat16), big, torch.zeros(64), 0.1)


def test_backward_usable_only_for_head_dim_512_and_whole_blocks_on_a_gpu(monkeypatch):
    assert not sacb.cuda_backward_usable(512, 640, torch.device("cpu"))
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        gpu = torch.device("cuda")
        assert sacb.cuda_backward_usable(512, 640, gpu)
        assert not sacb.cuda_backward_usable(192, 640, gpu)
        assert not sacb.cuda_backward_usable(512, 600, gpu)
        assert not sacb.cuda_backward_usable(512, sacb.MAX_SLOTS + 64, gpu)
        monkeypatch.setenv("DS41_SPARSE_BWD_SLOTS", "tilelang")
        assert not sacb.cuda_backward_usable(512, 640, gpu)


def test_backward_slot_limit_follows_the_shared_memory_budget():
    # Q, dO and one kv block (64 KB each), P and dS, then the index row; 1 KB for the 1024-byte alignment
    assert sacb.MAX_SLOTS % sacb.SLOTS_PER_BLOCK == 0
    assert sacb._SMEM_FIXED + 1024 + 4 * sacb.MAX_SLOTS <= 227 * 1024 < sacb._SMEM_FIXED + 1024 + 4 * (sacb.MAX_SLOTS + 64)
    assert sacb.MAX_SLOTS >= 128 + 2048


def test_backward_bad_shapes_are_refused_with_the_reason():
    q = torch.zeros(1, 2, 64, 512, dtype=torch.bfloat16)
    kv = torch.zeros(1, 3, 512, dtype=torch.bfloat16)
    lse2, delta = torch.zeros(1, 2, 64), torch.zeros(1, 2, 64)

    def call(q=q, idx=torch.zeros(1, 2, 128, dtype=torch.int32), slots=None):
        slots = torch.zeros(1, 2, 128, 512, dtype=torch.bfloat16) if slots is None else slots
        sacb.sparse_attention_slot_grads_cuda(q, kv, q, q, idx, lse2, delta, q, slots, 0.1)

    with pytest.raises(ValueError, match="k % 64 == 0"):
        call(idx=torch.zeros(1, 2, 100, dtype=torch.int32))
    with pytest.raises(ValueError, match="H % 64 == 0"):
        call(q=torch.zeros(1, 2, 48, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int32"):
        call(idx=torch.zeros(1, 2, 128, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"dkv_slots must be \[b, s·H/64, k, 512\]"):
        call(slots=torch.zeros(1, 1, 128, 512, dtype=torch.bfloat16))


@pytest.mark.parametrize("module", [sac, sacb], ids=["forward", "backward"])
def test_the_source_compiles_without_spills_or_serialised_wgmma(tmp_path, module):
    # needs nvcc and the CUTLASS headers tilelang ships; ptxas reports spills and wgmma serialisation
    import subprocess

    from deepseek_v41.cuda_module import find_nvcc

    try:
        nvcc, include = find_nvcc(), sac._cutlass_include()
    except RuntimeError as err:
        pytest.skip(str(err))
    src = tmp_path / "kernel.cu"
    src.write_text(module._SOURCE)
    cmd = [nvcc, "-cubin", "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", *sac._FLAGS,
           "-gencode", "arch=compute_90a,code=sm_90a", f"-I{include}", "-Xptxas", "-v",
           "-o", str(tmp_path / "kernel.cubin"), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "0 bytes spill stores" in res.stderr, res.stderr[-3000:]
    assert "Potential Performance Loss" not in res.stderr, res.stderr[-3000:]
