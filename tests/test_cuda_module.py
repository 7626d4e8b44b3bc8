"""``deepseek_v41.cuda_module`` on CPU: finding nvcc, compiling a cubin and its disk cache, and the checks on
kernel arguments that run before any CUDA call.  The compile tests skip where no nvcc is installed."""

import ctypes
import os
import stat
import subprocess

import pytest
import torch

from deepseek_v41 import cuda_module
from deepseek_v41.cuda_module import CudaKernel, _pack_args, compile_cubin, find_nvcc

ADD_ONE = r"""
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""


def fake_executable(path):
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def no_nvcc_env(monkeypatch, tmp_path):
    for var in ("DS41_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cuda_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(cuda_module, "_DEFAULT_NVCC", str(tmp_path / "missing" / "nvcc"))


@pytest.fixture
def nvcc():
    try:
        return find_nvcc()
    except RuntimeError as e:
        pytest.skip(f"no nvcc: {e}")


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    path = tmp_path / "cubin_cache"
    monkeypatch.setenv("DS41_CUDA_CACHE", str(path))
    monkeypatch.setattr(cuda_module, "_cubins", {})
    return path


def test_find_nvcc_honours_ds41_nvcc(monkeypatch, tmp_path):
    nvcc = fake_executable(tmp_path / "my_nvcc")
    monkeypatch.setenv("DS41_NVCC", str(nvcc))
    assert find_nvcc() == str(nvcc)


def test_find_nvcc_rejects_a_bad_ds41_nvcc(monkeypatch, tmp_path):
    monkeypatch.setenv("DS41_NVCC", str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="DS41_NVCC"):
        find_nvcc()


def test_find_nvcc_uses_cuda_home(no_nvcc_env, monkeypatch, tmp_path):
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    nvcc = fake_executable(tmp_path / "cuda" / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert find_nvcc() == str(nvcc)


def test_find_nvcc_without_a_toolkit_says_what_to_set(no_nvcc_env):
    with pytest.raises(RuntimeError, match="needs the CUDA toolkit's nvcc.*set CUDA_HOME or DS41_NVCC"):
        find_nvcc()


def test_compile_cubin_is_cached_on_disk(nvcc, cache_dir, monkeypatch):
    cubin = compile_cubin(ADD_ONE, include_dirs=[])
    assert cubin[:4] == b"\x7fELF"
    files = list(cache_dir.glob("*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == cubin
    assert not [p for p in cache_dir.iterdir() if p.suffix == ".tmp"]

    def no_nvcc(*args, **kwargs):
        raise AssertionError(f"nvcc ran again: {args}")

    monkeypatch.setattr(subprocess, "run", no_nvcc)
    cuda_module._cubins.clear()  # the second call must come from the disk
    assert compile_cubin(ADD_ONE, include_dirs=[]) == cubin
    assert compile_cubin(ADD_ONE, include_dirs=[]) == cubin  # and then from memory


def test_compile_cubin_keys_on_flags_and_arch(nvcc, cache_dir):
    compile_cubin(ADD_ONE, include_dirs=[])
    compile_cubin(ADD_ONE, include_dirs=[], flags=("-DUNUSED=1",))
    compile_cubin(ADD_ONE, include_dirs=[], arch="sm_80")
    assert len(list(cache_dir.glob("*.cubin"))) == 3


def test_compile_cubin_passes_include_dirs(nvcc, cache_dir, tmp_path):
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "ds41_test_step.cuh").write_text("#define DS41_STEP 2.0f\n")
    source = '#include "ds41_test_step.cuh"\n' + ADD_ONE.replace("1.0f", "DS41_STEP")
    assert compile_cubin(source, include_dirs=[str(tmp_path / "inc")])[:4] == b"\x7fELF"


def test_compile_error_reports_nvcc_output(nvcc, cache_dir):
    bad = ADD_ONE.replace("x[i] += 1.0f;", "x[i] += ds41_undeclared_name;")
    with pytest.raises(RuntimeError, match="ds41_undeclared_name") as info:
        compile_cubin(bad, include_dirs=[])
    assert "-cubin" in str(info.value) and "nvcc failed" in str(info.value)
    assert not list(cache_dir.glob("*.cubin"))


def test_compile_rejects_a_bad_arch():
    with pytest.raises(ValueError, match="sm_90a"):
        compile_cubin(ADD_ONE, include_dirs=[], arch="hopper")


@pytest.mark.parametrize("value", [3, 2.5, True])
def test_pack_args_rejects_python_scalars(value):
    with pytest.raises(TypeError, match="ctypes"):
        _pack_args([ctypes.c_int32(1), value], None)


def test_pack_args_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="not on a CUDA device"):
        _pack_args([torch.zeros(4)], 0)


def test_pack_args_points_at_the_ctypes_values():
    args = [ctypes.c_int32(-7), ctypes.c_int64(1 << 40), ctypes.c_float(1.5)]
    params, keep = _pack_args(args, None)
    assert ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int32)).contents.value == -7
    assert ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int64)).contents.value == 1 << 40
    assert ctypes.cast(params[2], ctypes.POINTER(ctypes.c_float)).contents.value == 1.5
    assert keep == args


def test_launch_checks_arguments_before_any_cuda_call(monkeypatch):
    monkeypatch.setattr(cuda_module, "_lib", lambda: pytest.fail("the driver was touched"))
    kernel = CudaKernel(b"not a cubin", "add_one")
    with pytest.raises(TypeError, match="wrap it in the ctypes type"):
        kernel.launch((1, 1, 1), (32, 1, 1), [ctypes.c_void_p(0), 5])
    with pytest.raises(ValueError, match="not on a CUDA device"):
        kernel.launch((1, 1, 1), (32, 1, 1), [torch.zeros(4), ctypes.c_int32(4)])
    with pytest.raises(ValueError, match="grid"):
        kernel.launch((0, 1, 1), (32, 1, 1), [ctypes.c_int32(4)])


def test_cache_dir_default(monkeypatch):
    monkeypatch.delenv("DS41_CUDA_CACHE", raising=False)
    assert cuda_module._cache_dir() == cuda_module.Path.home() / ".cache" / "deepseek_v41" / "cubin"
    assert os.fspath(cuda_module._cache_dir()).endswith(os.path.join("deepseek_v41", "cubin"))
