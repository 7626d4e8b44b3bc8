"""Kernel-backend registry: which implementations exist for each backend kind, and whether they can run here.

``config.backend`` is a dict ``{kind: name}`` over the kinds below.  A name that is not registered is a
``ValueError`` listing the registered ones; a registered name whose package or hardware is missing is a
``RuntimeError`` that names what is missing.  The model asks this module for implementations once, at
construction, and never branches on backend names inside a forward.
"""

import importlib.util

import torch

DEFAULT_BACKEND = {
    "attn": "torch",
    "linear": "torch",
    "rms_norm": "torch_fp32",
    "experts": "torch_mm",
    "dispatcher": "local",
    "head": "fp32",
    "fp32_linear": "fp32",
    "mhc": "torch",
    "engram": "torch",
    "quant": "torch",
    "decode_indexer": "auto",
}

# kind -> name -> (python packages needed, needs CUDA)
_REGISTRY = {
    "attn": {"torch": ((), False), "tilelang": (("tilelang",), True)},
    "linear": {"torch": ((), False), "te": (("transformer_engine",), True)},
    "rms_norm": {
        "torch_fp32": ((), False), "torch": ((), False), "triton": (("triton",), True),
        "te": (("transformer_engine",), True),
    },
    "experts": {"torch_mm": ((), False), "torch": ((), False)},
    # "local": every expert on this process. "torch" (all-to-all) / "hybridep" (DeepEP's HybridEP): expert
    # parallelism, installed by the training code (deepseek_v41.training) after the process group exists.
    "dispatcher": {"local": ((), False), "torch": ((), False), "hybridep": (("deep_ep",), True)},
    # the fp32 head GEMM: "fp32" IEEE, or "bf16x3" (fp32 emulated on bf16 tensor cores; layers.head_bf16x3)
    "head": {"fp32": ((), False), "bf16x3": ((), False)},
    # the fp32 GEMMs inside the blocks (the router's scores, the ratio-2 compressor's wkv/wgate): "fp32" IEEE,
    # or "bf16x3" (emulated on bf16 tensor cores; layers.linear_bf16x3)
    "fp32_linear": {"fp32": ((), False), "bf16x3": ((), False)},
    # mHC mixing: eager fp32 ops, or tile-kernels' fused kernels (bf16 streams; mhc_tile_kernels.py)
    "mhc": {"torch": ((), False), "tile_kernels": (("tile_kernels",), True)},
    # the Engram gate and the KV/index quantize->dequantize boundaries, eager or as tile-kernels' fused kernels
    "engram": {"torch": ((), False), "tile_kernels": (("tile_kernels",), True)},
    "quant": {"torch": ((), False), "tile_kernels": (("tile_kernels",), True)},
    # a decode step's indexer scores: one Triton kernel (kernels_triton.index_scores_triton) where it runs
    # (CUDA inference; "auto" falls back to eager elsewhere, "triton" asks for CUDA), or always eager ("torch":
    # the reference the kernel is tested against; both round a bf16 model's scores as the official Indexer does)
    "decode_indexer": {"auto": ((), False), "torch": ((), False), "triton": (("triton",), True)},
}

_INSTALL_HINT = {
    "tilelang": "pip install 'deepseek_v41[gpu]'",
    "tile_kernels": "pip install 'deepseek_v41[gpu]'",
    "triton": "install a CUDA build of PyTorch, which brings triton",
    "transformer_engine": "pip install transformer-engine[pytorch]",
    "deep_ep": "build DeepEP's hybrid-ep branch (HybridEP), docs/install.md",
}


def resolve_backend(overrides=None) -> dict:
    """Defaults updated with ``overrides``; unknown kinds or names raise ``ValueError``."""
    backend = dict(DEFAULT_BACKEND)
    for kind, name in (overrides or {}).items():
        if kind not in _REGISTRY:
            raise ValueError(f"unknown backend kind {kind!r}; the kinds are {sorted(_REGISTRY)}")
        if name not in _REGISTRY[kind]:
            raise ValueError(
                f"unknown {kind} backend {name!r}; registered {kind} backends: {sorted(_REGISTRY[kind])}"
            )
        backend[kind] = name
    return backend


def check_available(backend: dict) -> None:
    """Raise ``RuntimeError`` naming the missing package or hardware for any backend that cannot run here."""
    for kind, name in backend.items():
        packages, needs_cuda = _REGISTRY[kind][name]
        if needs_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"{kind} backend {name!r} needs a CUDA GPU, and none is available here")
        for package in packages:
            if importlib.util.find_spec(package) is None:
                raise RuntimeError(
                    f"{kind} backend {name!r} needs the package {package!r}, which is not installed "
                    f"({_INSTALL_HINT.get(package, 'install it')})"
                )
