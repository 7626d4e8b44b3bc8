"""Compile a CUDA C++ source string with nvcc and launch its kernels through the CUDA driver API.

Hand-written CUDA kernels ship as source strings inside this package, so ``save_pretrained`` copies them along
with the Python files and a ``trust_remote_code`` checkpoint needs nothing else.  They are compiled on first use
with the toolkit's nvcc to a cubin, cached on disk under a hash of the source, the include dirs, the arch, the
flags and nvcc's version (``$DS41_CUDA_CACHE``, else ``~/.cache/deepseek_v41/cubin``), and launched with
``cuLaunchKernel`` through ctypes (``libcuda.so.1``): no C++ extension build, no dependency beyond torch.

    cubin = compile_cubin(SOURCE, include_dirs=[])
    kernel = CudaKernel(cubin, "add_one")
    kernel.launch((blocks, 1, 1), (256, 1, 1), [x, ctypes.c_int32(x.numel())])

Scalars must be ctypes objects (``ctypes.c_int32``, ``c_int64``, ``c_float``...) matching the kernel's
parameter types; a plain Python int or float is refused since guessing its width would silently break kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["HOPPER_PTX", "CudaKernel", "TensorMap", "compile_cubin", "find_nvcc", "hopper_usable", "sm_count",
           "tensor_map_2d"]

_DEFAULT_NVCC = "/usr/local/cuda/bin/nvcc"
_STATIC_SMEM_LIMIT = 48 * 1024  # above this, dynamic shared memory must be opted into per function

# CUfunction_attribute values (cuda.h)
_FUNC_ATTRIBUTES = {
    "max_threads_per_block": 0,
    "shared_size_bytes": 1,
    "const_size_bytes": 2,
    "local_size_bytes": 3,
    "num_regs": 4,
    "max_dynamic_shared_size_bytes": 8,
}

_cubins: dict[str, bytes] = {}
_cubins_lock = threading.Lock()
_nvcc_versions: dict[str, str] = {}


# ----------------------------------------------------------------------------------------------- compiling


def _executable(path: str | os.PathLike) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_nvcc() -> str:
    """nvcc's path: ``$DS41_NVCC``, ``$CUDA_HOME/bin/nvcc``, ``$CUDA_PATH/bin/nvcc``, ``nvcc`` on PATH, then
    ``/usr/local/cuda/bin/nvcc``."""
    explicit = os.environ.get("DS41_NVCC")
    if explicit:
        if not _executable(explicit):
            raise RuntimeError(f"DS41_NVCC={explicit!r} is not an executable file")
        return explicit
    looked = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            candidate = os.path.join(root, "bin", "nvcc")
            if _executable(candidate):
                return candidate
            looked.append(f"${var}/bin/nvcc ({candidate})")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    looked.append("nvcc on PATH")
    if _executable(_DEFAULT_NVCC):
        return _DEFAULT_NVCC
    looked.append(_DEFAULT_NVCC)
    raise RuntimeError(
        "compiling deepseek_v41's CUDA kernels (on first use) needs the CUDA toolkit's nvcc; none found (looked at "
        f"{', '.join(looked)}). Install the CUDA toolkit, or set CUDA_HOME or DS41_NVCC."
    )


def _nvcc_version(nvcc: str) -> str:
    version = _nvcc_versions.get(nvcc)
    if version is None:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"`{nvcc} --version` failed (exit {proc.returncode}): {proc.stderr[-4000:]}")
        version = _nvcc_versions[nvcc] = proc.stdout
    return version


def _cache_dir() -> Path:
    root = os.environ.get("DS41_CUDA_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "deepseek_v41" / "cubin"


def _compute_arch(arch: str) -> str:
    if not arch.startswith("sm_") or len(arch) <= 3:
        raise ValueError(f"arch must look like 'sm_90a', got {arch!r}")
    return "compute_" + arch[3:]


def compile_cubin(source: str, include_dirs: list[str], arch: str = "sm_90a", flags: tuple[str, ...] = ()) -> bytes:
    """Compile ``source`` (one translation unit) to a cubin for ``arch`` with nvcc, cached in-process and on disk.

    The key hashes the source, the include dirs (in order: it is the search order), the arch, the flags and
    ``nvcc --version``; headers under the include dirs are not hashed.  Raises RuntimeError with nvcc's
    output and the command line when the compile fails.
    """
    compute = _compute_arch(arch)
    include_dirs = [str(d) for d in include_dirs]
    flags = tuple(flags)
    nvcc = find_nvcc()
    h = hashlib.sha256()
    for part in (source, "\0".join(include_dirs), arch, "\0".join(flags), _nvcc_version(nvcc)):
        h.update(part.encode())
        h.update(b"\x00\x01")
    key = h.hexdigest()

    with _cubins_lock:
        cubin = _cubins.get(key)
    if cubin is not None:
        return cubin

    path = _cache_dir() / f"{key}.cubin"
    try:
        cubin = path.read_bytes()
    except OSError:
        cubin = b""
    if not cubin:
        cubin = _run_nvcc(nvcc, source, include_dirs, arch, compute, flags)
        _write_atomic(path, cubin)
    with _cubins_lock:
        _cubins[key] = cubin
    return cubin


def _run_nvcc(nvcc: str, source: str, include_dirs: list[str], arch: str, compute: str, flags) -> bytes:
    with tempfile.TemporaryDirectory(prefix="ds41_nvcc_") as tmp:
        src, out = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        cmd = [nvcc, "-cubin", "-std=c++17", "-O3", "-gencode", f"arch={compute},code={arch}", "-DNDEBUG",
               "--expt-relaxed-constexpr"]
        cmd += [f"-I{d}" for d in include_dirs]
        cmd += [*flags, "-o", out, src]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not os.path.isfile(out):
            log = (proc.stdout + proc.stderr)[-4000:]
            raise RuntimeError(f"nvcc failed (exit {proc.returncode}): {shlex.join(cmd)}\n{log}")
        with open(out, "rb") as f:
            return f.read()


def _write_atomic(path: Path, data: bytes) -> None:
    # a read-only or full cache dir only costs a recompile next time
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


# ----------------------------------------------------------------------------------------------- driver API

_driver = None
_driver_lock = threading.Lock()

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_U = ctypes.c_uint
_I = ctypes.c_int
_SIGNATURES = {
    "cuGetErrorName": [_I, ctypes.POINTER(ctypes.c_char_p)],
    "cuGetErrorString": [_I, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(_I), _I],
    "cuDevicePrimaryCtxRetain": [_PP, _I],
    "cuCtxGetCurrent": [_PP],
    "cuCtxSetCurrent": [_P],
    "cuCtxGetDevice": [ctypes.POINTER(_I)],
    "cuModuleLoadData": [_PP, ctypes.c_char_p],
    "cuModuleGetFunction": [_PP, _P, ctypes.c_char_p],
    "cuFuncSetAttribute": [_P, _I, _I],
    "cuFuncGetAttribute": [ctypes.POINTER(_I), _I, _P],
    "cuLaunchKernel": [_P, _U, _U, _U, _U, _U, _U, _U, _P, _PP, _PP],
}


def _lib():
    global _driver
    if _driver is None:
        with _driver_lock:
            if _driver is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as e:
                    raise RuntimeError(f"cannot load the CUDA driver library libcuda.so.1: {e}") from e
                for name, argtypes in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = argtypes, _I
                _driver = lib
    return _driver


def _check(name: str, result: int) -> None:
    if result == 0:
        return
    lib, err_name, err_str = _lib(), ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(result, ctypes.byref(err_name))
    lib.cuGetErrorString(result, ctypes.byref(err_str))
    text = f"{(err_name.value or b'?').decode()}: {(err_str.value or b'unknown error').decode()}"
    raise RuntimeError(f"{name} failed with CUresult {result} ({text})")


def _call(name: str, *args) -> None:
    _check(name, getattr(_lib(), name)(*args))


_contexts: dict[int, int] = {}  # device index -> torch's (primary) CUcontext


def _make_current(device: int) -> None:
    """Make ``device``'s primary context (the one torch uses) current on this thread."""
    ctx = _contexts.get(device)
    if ctx is None:
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.cuda.current_device()
            cur, cur_dev = ctypes.c_void_p(), ctypes.c_int(-1)
            _call("cuCtxGetCurrent", ctypes.byref(cur))
            if cur.value:
                _call("cuCtxGetDevice", ctypes.byref(cur_dev))
            if cur.value and cur_dev.value == device:
                ctx = cur.value
            else:
                dev = ctypes.c_int()
                _call("cuDeviceGet", ctypes.byref(dev), device)
                primary = ctypes.c_void_p()
                _call("cuDevicePrimaryCtxRetain", ctypes.byref(primary), dev)  # kept for the process's life
                ctx = primary.value
        _contexts[device] = ctx
    cur = ctypes.c_void_p()
    _call("cuCtxGetCurrent", ctypes.byref(cur))
    if cur.value != ctx:
        _call("cuCtxSetCurrent", ctypes.c_void_p(ctx))


def _dims(name: str, dims) -> tuple[int, int, int]:
    dims = tuple(dims)
    if not 1 <= len(dims) <= 3 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"{name} must be 1 to 3 positive ints, got {dims!r}")
    return dims + (1,) * (3 - len(dims))


def _pack_args(args, device: int | None):
    """``(void** kernelParams, keepalive)`` for ``args``: CUDA tensors on ``device`` become their data pointer,
    ctypes objects are passed as they are.  Makes no CUDA call.  ``keepalive`` must outlive the launch."""
    keep = []
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            if not arg.is_cuda:
                raise ValueError(f"kernel argument {i} is a tensor on {arg.device}, not on a CUDA device")
            if arg.device.index != device:
                where = "an unknown device" if device is None else f"cuda:{device}"
                raise ValueError(f"kernel argument {i} is on {arg.device}, but the kernel launches on {where}")
            keep.append(ctypes.c_void_p(arg.data_ptr()))
        elif isinstance(arg, (ctypes._SimpleCData, ctypes.Structure, ctypes.Union, ctypes.Array)):
            keep.append(arg)
        elif isinstance(arg, (bool, int, float)):
            raise TypeError(
                f"kernel argument {i} is a Python {type(arg).__name__} ({arg!r}); wrap it in the ctypes type of "
                "the kernel's parameter (ctypes.c_int32, c_int64, c_uint32, c_float, ...)"
            )
        else:
            raise TypeError(f"kernel argument {i} has unsupported type {type(arg).__name__}; pass a CUDA tensor "
                            "or a ctypes object")
    params = (ctypes.c_void_p * max(len(keep), 1))(*[ctypes.addressof(a) for a in keep])
    return params, keep


class CudaKernel:
    """One ``extern "C" __global__`` function of a cubin, loaded lazily into each device's primary context."""

    def __init__(self, cubin: bytes, name: str, dynamic_smem: int = 0):
        self.cubin = bytes(cubin)
        self.name = name
        self.dynamic_smem = int(dynamic_smem)
        self._loaded: dict[int, tuple[int, int]] = {}  # device index -> (CUmodule, CUfunction)
        self._lock = threading.Lock()

    def _function(self, device: int) -> int:
        """The CUfunction on ``device``, with that device's context made current."""
        _make_current(device)
        loaded = self._loaded.get(device)
        if loaded is None:
            with self._lock:
                loaded = self._loaded.get(device)
                if loaded is None:
                    module, func = ctypes.c_void_p(), ctypes.c_void_p()
                    _call("cuModuleLoadData", ctypes.byref(module), self.cubin)
                    _call("cuModuleGetFunction", ctypes.byref(func), module, self.name.encode())
                    if self.dynamic_smem > _STATIC_SMEM_LIMIT:
                        _call("cuFuncSetAttribute", func, _FUNC_ATTRIBUTES["max_dynamic_shared_size_bytes"],
                              self.dynamic_smem)
                    loaded = self._loaded[device] = (module.value, func.value)
        return loaded[1]

    def launch(self, grid, block, args: list, stream=None) -> None:
        """Launch on ``grid`` x ``block`` with ``args`` (CUDA tensors and ctypes scalars, in the kernel's order).

        The device is the stream's (a ``torch.cuda.Stream``), else the first CUDA tensor argument's, else the
        current one; ``stream`` defaults to torch's current stream there and may be a raw ``cudaStream_t`` int.
        """
        grid, block = _dims("grid", grid), _dims("block", block)
        if isinstance(stream, torch.cuda.Stream):
            device = stream.device.index
        else:
            device = next((a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        params, keep = _pack_args(args, device)  # before any CUDA call: bad arguments fail on CPU too
        if device is None:
            device = torch.cuda.current_device()
        with torch.cuda.device(device):
            func = self._function(device)
            if stream is None:
                handle = torch.cuda.current_stream(device).cuda_stream
            elif isinstance(stream, torch.cuda.Stream):
                handle = stream.cuda_stream
            elif isinstance(stream, int):
                handle = stream
            else:
                raise TypeError(f"stream must be a torch.cuda.Stream, a raw stream handle or None, not {stream!r}")
            _call("cuLaunchKernel", func, *grid, *block, self.dynamic_smem, ctypes.c_void_p(handle), params, None)
        del keep  # the driver has copied the argument values

    def attribute(self, name: str | int, device: int | None = None) -> int:
        """``cuFuncGetAttribute`` on ``device`` (default: the current one); ``name`` is a CUfunction_attribute
        value or one of ``num_regs``, ``local_size_bytes``, ``shared_size_bytes``, ``const_size_bytes``,
        ``max_threads_per_block``, ``max_dynamic_shared_size_bytes``."""
        attr = _FUNC_ATTRIBUTES[name] if isinstance(name, str) else int(name)
        if device is None:
            device = torch.cuda.current_device()
        with torch.cuda.device(device):
            value = ctypes.c_int()
            _call("cuFuncGetAttribute", ctypes.byref(value), attr, ctypes.c_void_p(self._function(device)))
        return value.value

    def num_regs(self, device: int | None = None) -> int:
        """Registers per thread."""
        return self.attribute("num_regs", device)

    def local_bytes(self, device: int | None = None) -> int:
        """Local memory per thread in bytes (non-zero means register spills or local arrays)."""
        return self.attribute("local_size_bytes", device)


# ------------------------------------------------------------------------------------- Hopper building blocks

# CUDA source for sm_90a kernels (prepended to theirs): mbarriers, TMA loads, K-major 128-byte-swizzle shared-memory
# descriptors, wgmma fences; a kernel passes its TMA descriptors (``tensor_map_2d``) as ``const __grid_constant__
# TensorMap`` parameters
HOPPER_PTX = r"""
struct __align__(64) TensorMap { unsigned long long opaque[16]; };

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile("{\n.reg .pred P;\nWAIT_%=:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
               "@!P bra WAIT_%=;\n}\n" :: "r"(smem_u32(bar)), "r"(parity) : "memory");
}
// a producer/consumer ring of `stages` buffers: full[s] completes on the producer's one arrival plus the TMA bytes,
// empty[s] on one arrival per math warp (two warpgroups); made visible to the async proxy before any thread uses them
__device__ __forceinline__ void init_stage_barriers(uint64_t* full, uint64_t* empty, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 8); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
}
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, uint64_t* bar, int x, int y) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
               :: "r"(smem_u32(dst)), "l"((uint64_t)map), "r"(smem_u32(bar)), "r"(x), "r"(y) : "memory");
}
// K-major operand tile with 128-byte swizzle: rows of 128 bytes, 8-row (1024-byte) swizzle atoms
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
template <int R> __device__ __forceinline__ void fence_regs(float (&d)[R]) {  // keep d's registers in place
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
"""


class TensorMap(ctypes.Structure):
    """A CUtensorMap (TMA descriptor), passed to a kernel by value."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


TMA_UINT8, TMA_UINT16, TMA_FLOAT32 = 0, 1, 7  # CUtensorMapDataType
TMA_SWIZZLE_NONE, TMA_SWIZZLE_128B = 0, 3


def tensor_map_2d(t: torch.Tensor, box: tuple[int, int], dtype_code: int, swizzle: int) -> TensorMap:
    """A TMA descriptor over a row-major 2-D tensor: boxes of box = (inner, outer) elements, zeros outside."""
    fn = _lib().cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    rows, inner = t.shape
    raw = (ctypes.c_uint8 * (ctypes.sizeof(TensorMap) + 64))()  # the driver writes to a 64-byte aligned address
    aligned = (ctypes.addressof(raw) + 63) // 64 * 64
    # interleave none (0), L2 promotion 256B (3), out-of-bounds fill zeros (0)
    _check("cuTensorMapEncodeTiled", fn(
        ctypes.c_void_p(aligned), ctypes.c_int(dtype_code), ctypes.c_uint32(2), ctypes.c_void_p(t.data_ptr()),
        (ctypes.c_uint64 * 2)(inner, rows), (ctypes.c_uint64 * 1)(t.stride(0) * t.element_size()),
        (ctypes.c_uint32 * 2)(*box), (ctypes.c_uint32 * 2)(1, 1), ctypes.c_int(0), ctypes.c_int(swizzle),
        ctypes.c_int(3), ctypes.c_int(0)))
    out = TensorMap()
    ctypes.memmove(ctypes.addressof(out), aligned, ctypes.sizeof(TensorMap))
    return out


@functools.cache
def _hopper_device(index: int) -> bool:
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False
    try:
        find_nvcc()
    except RuntimeError:
        return False
    return True


def hopper_usable(x: torch.Tensor) -> bool:
    """True where an sm_90a kernel (wgmma, TMA) runs for tensors like ``x``: a Hopper GPU and nvcc to compile it on
    first use."""
    return x.is_cuda and _hopper_device(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def sm_count(device: int) -> int:
    """The GPU's multiprocessors (a persistent grid's size)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
