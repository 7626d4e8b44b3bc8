"""The one export path (deepseek_v41.hf_export): save_pretrained's arguments, the released-format re-encoding,
folder safety (refusals, atomic replacement, SIGKILL at any moment), progress bars, and the trainer's sharded
export on 2 gloo ranks (equal to save_pretrained, memory near one block per rank)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, golden_dir, official_dir, tiny_model
from safetensors.torch import load_file
from torchrun_launch import NO_GLOO_LEFT, assert_every_rank, ranks_with, torchrun, torchrun_env

from deepseek_v41 import hf_export
from deepseek_v41.checkpoint import ReleasedCheckpoint
from deepseek_v41.hf_export import EXPORT_MARKER, ExportError, local_source, write_export
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM
from deepseek_v41.release_format import (
    RELEASED_QUANTIZATION_CONFIG,
    decode_fp4_packed,
    decode_fp8_blockwise,
    decode_fp8_rows,
    encode_fp4_packed,
    encode_fp8_blockwise,
    encode_fp8_rows,
    released_format,
)

IDS = torch.randint(3, 1024, (1, 24), generator=torch.Generator().manual_seed(1))


def tensors_of(folder: Path) -> dict:
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        out.update(load_file(str(folder / file)))
    assert set(out) == set(weight_map)
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for name, value in a.items():
        assert value.dtype == b[name].dtype and value.shape == b[name].shape, name
        assert torch.equal(value.view(torch.uint8), b[name].view(torch.uint8)), name  # byte for byte


@pytest.fixture(scope="module")
def model(v4_tokenizer):
    return tiny_model(v4_tokenizer, dtype=torch.bfloat16).eval()


# ----------------------------------------------------------------------------------------------------
# save_pretrained: transformers' arguments, the released format
# ----------------------------------------------------------------------------------------------------


def test_released_format_matches_the_golden_snapshots():
    for fixture in ("v41_tiny_text", "v41_tiny_vision"):
        checkpoint = ReleasedCheckpoint(golden_dir(fixture) / "snapshot")
        for name, stored in checkpoint.tensors.items():
            fmt, dtype = released_format(name, stored.shape)
            assert fmt == stored.fmt, name
            assert dtype == {"F32": torch.float32, "BF16": torch.bfloat16, "I8": torch.int8,
                             "F8_E4M3": torch.float8_e4m3fn}[stored.record.dtype], name


def test_save_pretrained_takes_transformers_arguments(model, tmp_path):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["norm.weight"] += 1  # the given state_dict is what gets written
    model.save_pretrained(tmp_path / "a", state_dict=state, max_shard_size="200KB", safe_serialization=True,
                          save_peft_format=True, save_original_format=True)
    written = tensors_of(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "generation_config.json").read_text())["eos_token_id"] == model.config.eos_token_id
    assert torch.equal(written["norm.weight"], state["norm.weight"])
    assert torch.equal(written["layers.3.ffn.experts.5.w2.weight"], state["layers.3.ffn.experts.w2"][5])
    assert len(set(json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())["weight_map"].values())) > 3
    model.save_pretrained(tmp_path / "b", is_main_process=False)
    assert not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="only safetensors"):
        model.save_pretrained(tmp_path / "c", safe_serialization=False)
    with pytest.raises(TypeError, match="bogus"):
        model.save_pretrained(tmp_path / "c", bogus=1)
    with pytest.raises(ValueError, match="no tensor for"):
        model.save_pretrained(tmp_path / "c", state_dict={"not.a.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="not a size"):
        model.save_pretrained(tmp_path / "c", max_shard_size="lots")
    with pytest.raises(ExportError, match="quantize='fp8'"):
        model.save_pretrained(tmp_path / "c", quantize="fp8")
    assert not (tmp_path / "c").exists()


def _qdq(name: str, w: torch.Tensor) -> torch.Tensor:
    # the released format's quantize -> dequantize of one released tensor (floating point out)
    fmt, dtype = released_format(name, tuple(w.shape))
    if fmt == "fp8_block":
        return decode_fp8_blockwise(*encode_fp8_blockwise(w.float()))
    if fmt == "fp4":
        return decode_fp4_packed(*encode_fp4_packed(w.float()))
    if fmt == "fp8_rows":
        return decode_fp8_rows(*encode_fp8_rows(w.float()))
    return w.to(dtype)


def test_quantize_release_reloads_to_the_quantize_dequantize_of_the_weights(model, tmp_path):
    out = tmp_path / "release"
    model.save_pretrained(out, quantize="release")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == RELEASED_QUANTIZATION_CONFIG and "auto_map" in config
    checkpoint = ReleasedCheckpoint(out)
    assert checkpoint.is_quantized
    assert {t.fmt for t in checkpoint.tensors.values()} == {"plain", "fp8_block", "fp4", "fp8_rows"}
    reloaded = DeepseekV41ForCausalLM.from_pretrained(out, dtype=torch.bfloat16, dequantize_base_checkpoint=True)
    for name, value in model.state_dict().items():
        got = reloaded.state_dict()[name]
        if name.endswith(tuple(f"experts.w{k}" for k in (1, 2, 3))):
            expected = torch.stack([_qdq(f"{name.rsplit('.', 1)[0]}.{e}.{name[-2:]}.weight", value[e])
                                    for e in range(value.shape[0])])
        else:
            expected = _qdq(name, value)
        assert torch.equal(got, expected.to(got.dtype)), name
    assert not torch.equal(reloaded.layers[2].attn.wq_a.weight, model.layers[2].attn.wq_a.weight)  # it was re-encoded


OFFICIAL = textwrap.dedent("""
    # The official model.py (CPU kernels of its folder), built from ModelArgs json, weights loaded by released
    # name: FP8 / FP4 codes and UE8M0 scales as stored, floating-point entries (wo_a, head) decoded.
    import json, sys, torch
    from deepseek_v41.checkpoint import ReleasedCheckpoint
    from transformers import AutoTokenizer
    official_dir, args_json, ids = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
    sys.path.insert(0, official_dir)
    import model as official
    codes = (torch.float8_e4m3fn, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu)
    logits = []
    for snapshot in sys.argv[4:]:
        checkpoint = ReleasedCheckpoint(snapshot)
        fields = {**json.loads(open(args_json).read()), "max_batch_size": ids.shape[0]}
        torch.set_default_dtype(torch.bfloat16)
        model = official.Transformer(official.ModelArgs(**fields), AutoTokenizer.from_pretrained(snapshot)).eval()
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, target in model.state_dict(keep_vars=True).items():
                if name not in checkpoint.records:
                    assert name not in params, f"official parameter {name} is not in {snapshot}"
                    continue
                stored = checkpoint.tensors.get(name)
                if target.dtype in codes:
                    target.copy_(checkpoint.read_raw(checkpoint.records[name]).view(target.dtype))
                else:
                    target.copy_(checkpoint.decode(name, dtype=target.dtype) if stored is not None
                                 else checkpoint.read_raw(checkpoint.records[name]).to(target.dtype))
        with torch.inference_mode():
            logits.append(model(ids, start_pos=0)[1].float())
        torch.set_default_dtype(torch.float32)
    assert torch.isfinite(logits[0]).all()
    print("MAXDIFF", float((logits[0] - logits[1]).abs().max()), flush=True)
""")


@pytest.fixture(scope="module")
def golden_released_again(tmp_path_factory):
    """The golden text snapshot -> floating point -> ``--quantize release``: (golden snapshot, result)."""
    sys.path.insert(0, str(REPO / "conversion"))
    import convert_checkpoint

    golden, tmp = golden_dir("v41_tiny_text") / "snapshot", tmp_path_factory.mktemp("convert")
    convert_checkpoint.main([str(golden), str(tmp / "fp")])
    convert_checkpoint.main([str(tmp / "fp"), str(tmp / "release"), "--quantize", "release"])
    return golden, tmp / "release"


def test_convert_quantize_release_reproduces_the_golden_values(golden_released_again):
    """Every tensor decodes to the golden value (re-encoding exactly decoded FP8/FP4 values is lossless)."""
    golden, release_dir = golden_released_again
    source, release = ReleasedCheckpoint(golden), ReleasedCheckpoint(release_dir)
    assert release.quantization_config == source.quantization_config
    for name, stored in source.tensors.items():
        assert release.tensors[name].fmt == stored.fmt and release.tensors[name].record.dtype == stored.record.dtype
        assert torch.equal(release.decode(name), source.decode(name)), name


@pytest.fixture(scope="module")
def official():
    return official_dir()


def test_convert_quantize_release_is_served_by_the_official_code(official, golden_released_again, tmp_path):
    """The official model.py (DS41_OFFICIAL_DIR) loads the re-released snapshot and gives the same logits as on
    the golden snapshot."""
    golden, release_dir = golden_released_again
    ids = json.dumps(IDS[:, :16].tolist())
    env = {**torchrun_env(), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", OFFICIAL, str(official),
                             str(golden.parent / "reference" / "official_args.json"), ids,
                             str(release_dir), str(golden)],
                            check=False, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert float(result.stdout.split("MAXDIFF")[1]) == 0.0, result.stdout


# ----------------------------------------------------------------------------------------------------
# Folder safety
# ----------------------------------------------------------------------------------------------------


def export(out, value=1.0, **kwargs):
    return write_export([local_source("w", torch.full((4,), value))], out, {"v": value}, **kwargs)


def siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name != folder.name)


def test_refusals_touch_nothing(tmp_path):
    target = tmp_path / "dest"
    target.write_text("a file")
    with pytest.raises(ExportError, match="not a folder"):
        export(target)
    assert target.read_text() == "a file" and siblings(target) == []
    target.unlink()
    (target / "notes").mkdir(parents=True)
    (target / "notes" / "x.md").write_text("mine")
    with pytest.raises(ExportError, match="not a deepseek_v41 export"):
        export(target)
    assert (target / "notes" / "x.md").read_text() == "mine" and siblings(target) == []
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ExportError, match="symbolic link"):
        export(tmp_path / "link")
    # a previous export of ours plus a file it did not write
    export(tmp_path / "ours")
    (tmp_path / "ours" / "README.md").write_text("notes")
    with pytest.raises(ExportError, match="README.md"):
        export(tmp_path / "ours", 2.0)
    assert (tmp_path / "ours" / "README.md").read_text() == "notes"
    assert json.loads((tmp_path / "ours" / "config.json").read_text()) == {"v": 1.0}


@pytest.mark.parametrize("quantize", [None, "release"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_before_anything_is_written(v4_tokenizer, tmp_path, quantize, bad):
    """Issue 43: a model holding NaN/Inf weights exported (plain and released format) without complaint, and
    ``release`` stored Inf as 448.0, which reloads.  Now: refused, naming the tensor, and nothing is written (no
    destination, no staging sibling)."""
    model = tiny_model(v4_tokenizer, dtype=torch.bfloat16)
    with torch.no_grad():
        model.layers[2].attn.wq_a.weight[3, 5] = bad
    out = tmp_path / "export"
    with pytest.raises(ExportError, match=rf"tensor 'layers.2.attn.wq_a.weight' holds {bad} at \[3, 5\] \(1 non-finite"):
        model.save_pretrained(out, quantize=quantize)
    assert list(tmp_path.iterdir()) == []


def test_release_encoders_refuse_instead_of_saturating(tmp_path):
    """The FP8 / FP4 encoders clamped Inf to the format's largest value (448, 6) and NaN to a NaN code; a source
    the up-front check cannot see (no ``local`` values: rows produced on demand) is refused while it is encoded,
    named, and the export folder is never created."""
    w = torch.randn(64, 64)
    w[7, 9] = float("inf")
    for encode, fmt in ((encode_fp8_blockwise, "FP8 E4M3"), (encode_fp8_rows, "FP8 E4M3"), (encode_fp4_packed, "FP4")):
        with pytest.raises(ValueError, match=rf"holds inf at \[7, 9\].*{fmt}.*largest finite value"):
            encode(w)
    name = "layers.0.attn.wq_a.weight"  # FP8 32x32 blocks in the released format
    lazy = hf_export.TensorSource(name, (64, 64), torch.float32, lambda start, stop: w[start:stop])
    with pytest.raises(ExportError, match=rf"tensor '{name}' cannot be encoded as fp8_block: it holds inf at"):
        write_export([lazy], tmp_path / "out", {}, quantize="release")
    with pytest.raises(ExportError, match=rf"tensor '{name}' holds inf"):  # plain: every written block is checked
        write_export([lazy], tmp_path / "out", {})
    assert list(tmp_path.iterdir()) == []


def test_shard_checksums_are_recorded_and_verified(model, tmp_path, monkeypatch):
    """Each shard's checksum (computed while writing) is in the index; bytes changed without changing the size
    fail the load (``load_checkpoint_into_model`` and ``from_pretrained``) naming the shard, before any tensor is
    read from it; ``verify_checksums=False`` or DEEPSEEK_V41_VERIFY_CHECKSUMS=0 skip the check."""
    from deepseek_v41.checkpoint import CheckpointError, load_checkpoint_into_model
    from deepseek_v41.checksums import checksum_of_file

    out = tmp_path / "export"
    model.save_pretrained(out, max_shard_size="300KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(index["metadata"]["checksums"]) == shards
    for shard in shards:
        assert checksum_of_file(out / shard) == index["metadata"]["checksums"][shard]
    # swap two 8-byte words inside the second shard's data: same size, same header, finite values
    damaged = out / shards[1]
    data = bytearray(damaged.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    a, b = header + 64, header + 4096
    data[a : a + 8], data[b : b + 8] = data[b : b + 8], data[a : a + 8]
    damaged.write_bytes(data)
    reloaded = DeepseekV41ForCausalLM._from_config(model.config, tokenizer=model.engram_tokenizer)
    named = rf"shard {damaged} has checksum xxh3_64:\w+ but model.safetensors.index.json recorded xxh3_64:\w+"
    with pytest.raises(CheckpointError, match=named):
        load_checkpoint_into_model(reloaded, out)
    load_checkpoint_into_model(reloaded, out, verify_checksums=False)  # the bytes are read as they are
    with pytest.raises(CheckpointError, match=named):
        DeepseekV41ForCausalLM.from_pretrained(out)
    skipped = DeepseekV41ForCausalLM.from_pretrained(out, verify_checksums=False)
    monkeypatch.setenv("DEEPSEEK_V41_VERIFY_CHECKSUMS", "0")
    by_env = DeepseekV41ForCausalLM.from_pretrained(out)
    for name, value in skipped.state_dict().items():  # the swapped words are loaded as they are, both ways
        assert torch.equal(value, by_env.state_dict()[name]), name
    assert any(not torch.equal(value, model.state_dict()[name]) for name, value in skipped.state_dict().items())
    monkeypatch.setenv("DEEPSEEK_V41_VERIFY_CHECKSUMS", "no")
    with pytest.raises(ValueError, match=r"DEEPSEEK_V41_VERIFY_CHECKSUMS='no': use 1 \(verify checksums\) or 0"):
        DeepseekV41ForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("exchange", [True, False])
def test_replaces_an_empty_folder_or_a_previous_export(tmp_path, monkeypatch, exchange):
    if not exchange:  # filesystems without renameat2(RENAME_EXCHANGE): two renames
        monkeypatch.setattr(hf_export, "_exchange", lambda a, b: False)
    out = tmp_path / "dest"
    out.mkdir()
    export(out, 1.0)
    export(out, 2.0)
    assert json.loads((out / "config.json").read_text()) == {"v": 2.0}
    assert torch.equal(tensors_of(out)["w"], torch.full((4,), 2.0))
    assert json.loads((out / EXPORT_MARKER).read_text())["files"] == sorted(
        p.name for p in out.iterdir() if p.name != EXPORT_MARKER)
    assert siblings(out) == []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_are_cleaned_and_a_left_aside_export_restored(tmp_path):
    out = tmp_path / "dest"
    export(out, 1.0)
    dead = _dead_pid()
    stale = tmp_path / f".dest.deepseek_v41-tmp-{dead}-0abc"
    (stale / "x").mkdir(parents=True)
    live = tmp_path / f".dest.deepseek_v41-tmp-{os.getppid()}-0abd"  # a live process may still be writing it
    live.mkdir()
    export(out, 2.0)
    assert siblings(out) == [live.name]
    # the fallback swap was killed between its renames: the destination is missing, the old one aside
    out.rename(tmp_path / f".dest.deepseek_v41-old-{dead}-0abe")
    export(out, 3.0)
    assert json.loads((out / "config.json").read_text()) == {"v": 3.0} and siblings(out) == [live.name]


KILL_POINTS = {  # (function patched in the child, SIGKILL before or after calling it)
    "mid_write": ("write_safetensors", "after"),
    "before_swap": ("_swap_into_place", "before"),
    "after_exchange": ("_exchange", "after"),
    "fallback_between_renames": ("os.rename", "after"),
}


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_sigkill_at_any_moment_leaves_a_complete_export(tmp_path, point):
    out = tmp_path / "dest"
    export(out, 1.0)
    name, when = KILL_POINTS[point]
    pid = os.fork()
    if pid == 0:  # child: export 2.0 and die by SIGKILL at the chosen moment
        try:
            if point == "fallback_between_renames":
                hf_export._exchange = lambda a, b: False
                real = os.rename

                def rename(a, b):  # the first of the two renames moves the old export aside
                    real(a, b)
                    os.kill(os.getpid(), signal.SIGKILL)
                os.rename = rename
            else:
                real = getattr(hf_export, name)

                def wrapped(*args, **kwargs):
                    if when == "before":
                        os.kill(os.getpid(), signal.SIGKILL)
                    result = real(*args, **kwargs)
                    os.kill(os.getpid(), signal.SIGKILL)
                    return result
                setattr(hf_export, name, wrapped)
            write_export([local_source("w", torch.full((4,), 2.0)), local_source("u", torch.ones(8))], out,
                         {"v": 2.0}, max_shard_bytes=16)
        finally:
            os._exit(3)  # only reached if the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    # the destination holds the old or the new export, complete (or, in the fallback, the old one aside)
    if point == "fallback_between_renames":
        assert not out.exists() and any("-old-" in s for s in siblings(out))
    else:
        value = json.loads((out / "config.json").read_text())["v"]
        assert value == (2.0 if point == "after_exchange" else 1.0)
        assert torch.equal(tensors_of(out)["w"], torch.full((4,), value)) and hf_export.is_our_export(out)
    assert siblings(out), "the interrupted export left its temporary folder (cleaned next time)"
    export(out, 3.0)  # the next export cleans up (and restores the fallback's old folder first)
    assert json.loads((out / "config.json").read_text()) == {"v": 3.0} and siblings(out) == []


# ----------------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------------


def test_progress_bars_follow_transformers_setting(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    two = [local_source("w", torch.ones(4)), local_source("u", torch.zeros(4))]
    try:
        write_export(two, tmp_path / "a", {}, max_shard_bytes=16)
        DeepseekV41ForCausalLM.from_pretrained(golden_dir("v41_tiny_text") / "snapshot")
        err = capfd.readouterr().err
        assert "Writing a" in err and "shard 2/2" in err and "Loading checkpoint shards" in err and "shard 3/3" in err
        hf_logging.disable_progress_bar()
        write_export(two, tmp_path / "b", {}, max_shard_bytes=16)
        DeepseekV41ForCausalLM.from_pretrained(golden_dir("v41_tiny_text") / "snapshot")
        err = capfd.readouterr().err
        assert "Writing" not in err and "Loading checkpoint shards" not in err
    finally:
        hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------------------------------
# The trainer's sharded export (2 gloo ranks)
# ----------------------------------------------------------------------------------------------------


def test_recipe_refuses_an_export_dir_overlapping_the_run(tmp_path):
    from deepseek_v41.training.recipe import RecipeError, load_recipe, validate_recipe

    base = {"model.config.pretrained_model_name_or_path": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "run")}

    def recipe(**overrides):
        validate_recipe(load_recipe(REPO / "examples" / "configs" / "tiny_cpu.yaml", {**base, **overrides}))

    # (a subfolder of the run such as run/model is allowed: test_training_recipe.py has the whole rule)
    for export_dir in (tmp_path / "run", tmp_path, tmp_path / "run" / "checkpoints" / "x"):
        with pytest.raises(RecipeError, match="checkpoint.export_dir"):
            recipe(**{"checkpoint.export_dir": str(export_dir)})
    recipe(**{"checkpoint.export_dir": str(tmp_path / "export"), "checkpoint.export_quantize": "release"})
    (tmp_path / "export" / "notes").mkdir(parents=True)  # a folder the export would refuse: refused up front
    with pytest.raises(RecipeError, match="not a deepseek_v41 export"):
        recipe(**{"checkpoint.export_dir": str(tmp_path / "export")})
    with pytest.raises(RecipeError, match="export_quantize"):
        recipe(**{"checkpoint.export_quantize": "fp4"})


WORKER = Path(__file__).resolve().parent / "export_worker.py"


def test_two_rank_export_equals_save_pretrained(tiny_checkpoint, tmp_path):
    """FSDP2 + EP 2 + Engram owners 2 as the trainer builds them; the export, floating point and released
    format, equals save_pretrained of the same weights tensor for tensor, byte for byte."""
    result = torchrun(WORKER, tiny_checkpoint, tmp_path, nproc=2, timeout=600)
    assert_every_rank(result, 2, "EXPORTED", *NO_GLOO_LEFT)  # both ranks wrote their part of both exports
    assert ranks_with(result.stdout, "REFERENCES SAVED") == {0}
    out = result.stdout
    # a NaN in rank 1's expert rows: refused on both ranks, naming the tensor, before anything is written
    for rank in (0, 1):
        assert (f"NAN REFUSED on rank {rank}: tensor 'layers.0.ffn.experts.w1' holds nan at [0, 0, 0] (1 non-finite"
                in out), out[-3000:]
    assert "(index within rank 1's rows)" in out and not (tmp_path / "nan_export").exists()
    # a shard of our export damaged (same size), compared by rank 1: every rank stops naming it, nothing loaded
    damaged, shards = re.search(r"DAMAGED (\S+) of (\d+) shards", out).groups()
    assert int(shards) > 1
    for rank in (0, 1):
        assert (f"DAMAGED SHARD REFUSED on rank {rank} (weights untouched: True): shard {damaged} has checksum "
                in out), out[-3000:]
    for kind in ("fp", "release"):
        assert_same_tensors(tensors_of(tmp_path / f"sharded_{kind}"), tensors_of(tmp_path / f"reference_{kind}"))
        sharded = json.loads((tmp_path / f"sharded_{kind}" / "config.json").read_text())
        assert "auto_map" in sharded and (tmp_path / f"sharded_{kind}" / "processor_config.json").is_file()


def test_sharded_export_memory_stays_near_one_block(tmp_path):
    """A 256 MiB Engram table over 2 owners, 8 MiB blocks: every rank grows by far less than the table (the
    former export grew by at least the whole table on every rank). The benchmark's numbers are in
    examples/benchmarks/results/export_memory_cpu.txt."""
    script = REPO / "examples" / "benchmarks" / "export_memory.py"
    result = torchrun(script, "--table-mib", "256", "--shard-mib", "16", "--block-mib", "8", "--out", tmp_path,
                      nproc=2, timeout=300)
    assert_every_rank(result, 2)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(row["rank"] for row in rows) == [0, 1]  # one measurement from each rank
    for row in rows:
        # live: one 8 MiB block plus a few MiB (11-17 MiB measured, also on a loaded machine); gathering one
        # owner's half of the table would add 128, the former whole-table gathers >= 256 on every rank
        assert row["peak_increase_mib"] < 48, row
