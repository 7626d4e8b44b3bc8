"""``deepseek_v41.cuda_module`` on a CUDA GPU: kernels compiled with nvcc and launched through the driver API.

Skips without a CUDA GPU or without nvcc.  Compiles for the GPU's own arch (``sm_90a`` on Hopper).
"""

import ctypes

import pytest
import torch

from deepseek_v41.cuda_module import CudaKernel, compile_cubin, find_nvcc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_module GPU tests need a CUDA GPU"),
]

ADD_ONE = r"""
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""

SCALE = r"""
extern "C" __global__ void scale(const float* x, float* y, float a, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}
"""

# every block stages `n` floats of x through dynamic shared memory and writes them back reversed
REVERSE_SMEM = r"""
extern "C" __global__ void reverse_through_smem(const float* x, float* y, int n) {
    extern __shared__ float buf[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[blockIdx.x * n + i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[blockIdx.x * n + i] = buf[n - 1 - i];
}
"""


@pytest.fixture(scope="module")
def arch():
    try:
        find_nvcc()
    except RuntimeError as e:
        pytest.skip(str(e))
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def test_add_one(arch):
    kernel = CudaKernel(compile_cubin(ADD_ONE, [], arch=arch), "add_one")
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    kernel.launch(((x.numel() + 255) // 256, 1, 1), (256, 1, 1), [x, ctypes.c_int32(x.numel())])
    torch.testing.assert_close(x, torch.arange(1000, device="cuda", dtype=torch.float32) + 1, rtol=0, atol=0)
    assert kernel.num_regs() > 0
    assert kernel.local_bytes() == 0


def test_scalars_and_a_side_stream(arch):
    kernel = CudaKernel(compile_cubin(SCALE, [], arch=arch), "scale")
    x = torch.randn(5000, device="cuda")
    y = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    kernel.launch((20, 1, 1), (256, 1, 1), [x, y, ctypes.c_float(-2.5), ctypes.c_int64(x.numel())], stream=stream)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(y, -2.5 * x, rtol=0, atol=0)


def test_more_than_48kb_of_dynamic_shared_memory(arch):
    n = 100 * 1024 // 4  # 100 KiB of floats
    kernel = CudaKernel(compile_cubin(REVERSE_SMEM, [], arch=arch), "reverse_through_smem", dynamic_smem=n * 4)
    x = torch.randn(3, n, device="cuda")
    y = torch.empty_like(x)
    kernel.launch((3, 1, 1), (512, 1, 1), [x, y, ctypes.c_int32(n)])
    torch.testing.assert_close(y, x.flip(1), rtol=0, atol=0)


def test_driver_errors_name_the_call(arch):
    kernel = CudaKernel(compile_cubin(ADD_ONE, [], arch=arch), "no_such_kernel")
    x = torch.zeros(4, device="cuda")
    with pytest.raises(RuntimeError, match="cuModuleGetFunction.*CUDA_ERROR_NOT_FOUND"):
        kernel.launch((1, 1, 1), (32, 1, 1), [x, ctypes.c_int32(4)])


def test_launch_from_a_new_thread_and_in_a_cuda_graph(arch):
    import threading

    kernel = CudaKernel(compile_cubin(ADD_ONE, [], arch=arch), "add_one")
    x = torch.zeros(256, device="cuda")
    errors = []

    def work():
        try:
            kernel.launch((1, 1, 1), (256, 1, 1), [x, ctypes.c_int32(256)])
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured on torch's capture stream, the current one inside
        kernel.launch((1, 1, 1), (256, 1, 1), [x, ctypes.c_int32(256)])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert (x == 4).all()
