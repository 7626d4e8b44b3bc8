"""The README's Python snippets run as written, on the tiny released-format checkpoint.

Each ```python block of README.md runs in its own namespace, in a scratch folder, with the README's placeholder
paths pointed at local files: ``/path/to/DeepSeek-V4.1-Flash`` at the tiny released-format snapshot (what the
main job trains), ``runs/tiny_cpu/model`` at an export of it (what the main job leaves). Nothing else of a block
is changed, so a README example that stops working fails here.
"""

import os
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
RELEASED_PLACEHOLDER = "/path/to/DeepSeek-V4.1-Flash"
EXPORT_FOLDER = "runs/tiny_cpu/model"  # the main job's export, relative to the repository root


def python_blocks(text: str) -> list:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


BLOCKS = python_blocks(README.read_text())


def test_readme_has_the_snippets_this_file_runs():
    joined = "\n".join(BLOCKS)
    assert len(BLOCKS) >= 4, BLOCKS
    for needle in (RELEASED_PLACEHOLDER, EXPORT_FOLDER, "DeepseekV41Config(", "save_pretrained(", "pipeline("):
        assert needle in joined, f"README lost its snippet using {needle!r}"


@pytest.fixture(scope="module")
def scratch(tiny_checkpoint, tmp_path_factory):
    """A working folder holding the main job's export at ``runs/tiny_cpu/model``."""
    import deepseek_v41  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("readme")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16)
    model.save_pretrained(root / EXPORT_FOLDER)
    return root


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index, scratch, tiny_checkpoint, monkeypatch, capsys):
    code = BLOCKS[index].replace(RELEASED_PLACEHOLDER, str(tiny_checkpoint))
    monkeypatch.chdir(scratch)
    torch.manual_seed(0)
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": f"readme_block_{index}"})
    printed = capsys.readouterr().out
    if "print(" in code:
        assert printed.strip(), f"block {index} printed nothing"
    if "save_pretrained(" in code:
        for folder in re.findall(r"save_pretrained\(\"([^\"]+)\"", code):
            assert (scratch / folder / "config.json").is_file(), folder
            assert any((scratch / folder).glob("*.safetensors")), folder
    assert os.getcwd() == str(scratch)
