"""transformers' entry points by folder path, as users call them: ``AutoTokenizer`` / ``pipeline("text-generation")``
with chat messages and ``AutoModelForImageTextToText`` / ``pipeline("image-text-to-text")`` with a PIL image, on a
released-format snapshot (no chat template, no ``auto_map`` in its files) and on an export, with and without
``trust_remote_code`` (an export also in a fresh interpreter where ``deepseek_v41`` cannot be imported)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, pipeline

from deepseek_v41 import DeepseekV41ForCausalLM, DeepseekV41Processor, DeepseekV41Tokenizer
from deepseek_v41.processing_deepseek_v41 import CHAT_TEMPLATE, IMAGE_PLACEHOLDER

REPO = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "hi"}]
# what the DeepSeek-V4 chat format makes of MESSAGES (chat mode: thinking closed after <｜Assistant｜>)
MESSAGES_RENDERED = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
NEW_TOKENS = 4


def _make_tiny_checkpoint(out: Path, **kwargs) -> Path:
    spec = importlib.util.spec_from_file_location("conversion_make_tiny", REPO / "conversion" / "make_tiny_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_checkpoint(out, **kwargs)


def _image(seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (70, 98, 3), dtype=np.uint8))


def _image_chat(image):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]


def _listing(folder: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


@pytest.fixture(scope="module")
def snapshot(tiny_checkpoint):
    """The released-format text snapshot; every test leaves its files as they were."""
    before = _listing(tiny_checkpoint)
    yield tiny_checkpoint
    assert _listing(tiny_checkpoint) == before, "loading wrote into the user's snapshot folder"


@pytest.fixture(scope="module")
def vision_snapshot(tmp_path_factory):
    folder = _make_tiny_checkpoint(tmp_path_factory.mktemp("released") / "vision", vision_layers=2)
    before = _listing(folder)
    yield folder
    assert _listing(folder) == before, "loading wrote into the user's snapshot folder"


def _export(source: Path, out: Path) -> Path:
    DeepseekV41ForCausalLM.from_pretrained(source).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def text_export(snapshot, tmp_path_factory):
    return _export(snapshot, tmp_path_factory.mktemp("export") / "text")


@pytest.fixture(scope="module")
def vision_export(vision_snapshot, tmp_path_factory):
    return _export(vision_snapshot, tmp_path_factory.mktemp("export") / "vision")


class GenerateSpy:
    """Wraps ``model.generate`` and records the keyword inputs of each call."""

    def __init__(self, model):
        self.generate, self.calls = model.generate, []

    def __call__(self, *args, **kwargs):
        assert not args, "pipelines pass their inputs by keyword"
        self.calls.append({k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        return self.generate(**kwargs)


def _greedy_new_text(model, tokenizer, inputs) -> str:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + NEW_TOKENS
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------
# Tokenizer: the chat template on a released snapshot is the one exports carry
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trust_remote_code", [None, True])
def test_released_snapshot_tokenizer_has_the_export_chat_template(snapshot, text_export, trust_remote_code):
    assert "chat_template" not in json.loads((snapshot / "tokenizer_config.json").read_text())
    assert not (snapshot / "chat_template.jinja").exists()
    tokenizer = AutoTokenizer.from_pretrained(snapshot, trust_remote_code=trust_remote_code)
    assert type(tokenizer) is DeepseekV41Tokenizer
    # one source of truth: what the export writes (the processor's chat_template.jinja) and what it loads back
    assert (text_export / "chat_template.jinja").read_text(encoding="utf-8") == CHAT_TEMPLATE
    exported = AutoTokenizer.from_pretrained(text_export, trust_remote_code=trust_remote_code)
    assert tokenizer.chat_template == exported.chat_template == CHAT_TEMPLATE
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == MESSAGES_RENDERED
    # the tokenizer itself is the released one: same ids as tokenizer.json read directly
    assert tokenizer("hi <｜User｜>")["input_ids"] == exported("hi <｜User｜>")["input_ids"]
    assert tokenizer.backend_tokenizer.to_str() == exported.backend_tokenizer.to_str()


def test_a_folders_own_chat_template_wins(snapshot, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(snapshot / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert type(tokenizer) is DeepseekV41Tokenizer
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == "hi!"
    assert AutoTokenizer.from_pretrained(snapshot, chat_template="{{ 'x' }}").chat_template == "{{ 'x' }}"


@pytest.mark.parametrize("name, loader", [("tokenizer.json", AutoTokenizer),
                                          ("tokenizer_config.json", DeepseekV41Tokenizer)])
def test_a_truncated_tokenizer_file_is_named(request, tmp_path, name, loader):
    """Issue 43: AutoTokenizer on a snapshot or an export with a truncated tokenizer.json raised transformers'
    bare JSONDecodeError, naming no file; now the file, with what to do.  (A truncated tokenizer_config.json
    fails in AutoTokenizer before it picks a class, so only our class names it.)"""
    for source in ("snapshot", "text_export"):
        folder = tmp_path / source
        folder.mkdir()
        for file in request.getfixturevalue(source).iterdir():
            if file.is_file() and file.suffix != ".safetensors":
                shutil.copy(file, folder)
        assert type(AutoTokenizer.from_pretrained(folder)) is DeepseekV41Tokenizer  # intact: loads
        whole = (folder / name).read_bytes()
        (folder / name).write_bytes(whole[: len(whole) // 2])
        with pytest.raises(ValueError, match=rf"{folder / name} is not valid JSON \(truncated or corrupted\? .*\); "
                                             "re-save the tokenizer or re-download the file"):
            loader.from_pretrained(folder)


def test_a_transformers_without_the_tokenizer_routing_is_named(monkeypatch, caplog):
    from transformers.models.auto import tokenization_auto

    from deepseek_v41.processing_deepseek_v41 import register_tokenizer

    monkeypatch.delattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS")
    with caplog.at_level("WARNING", logger="deepseek_v41.processing_deepseek_v41"):
        register_tokenizer()
    assert "without the chat template" in caplog.text and "chat_template=" in caplog.text


# ----------------------------------------------------------------------------------------------------
# pipeline("text-generation", model=<path>) with chat messages
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder, trust_remote_code", [("snapshot", None), ("snapshot", True), ("text_export", None)])
def test_text_generation_pipeline_on_a_path_takes_chat_messages(request, monkeypatch, folder, trust_remote_code):
    path = request.getfixturevalue(folder)
    pipe = pipeline("text-generation", model=str(path), trust_remote_code=trust_remote_code)
    assert type(pipe.model) is DeepseekV41ForCausalLM and type(pipe.tokenizer) is DeepseekV41Tokenizer
    spy = GenerateSpy(pipe.model)
    monkeypatch.setattr(pipe.model, "generate", spy)
    out = pipe(MESSAGES, max_new_tokens=NEW_TOKENS, do_sample=False)

    # the prompt the model got is the chat template's rendering of the messages
    prompt = pipe.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt")
    expected_ids = pipe.tokenizer(MESSAGES_RENDERED, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert torch.equal(prompt["input_ids"], expected_ids)
    assert len(spy.calls) == 1 and torch.equal(spy.calls[0]["input_ids"], expected_ids)
    # the answer is the greedy continuation, returned as the assistant turn after the messages
    monkeypatch.setattr(pipe.model, "generate", spy.generate)
    answer = _greedy_new_text(pipe.model, pipe.tokenizer, prompt)
    generated = out[0]["generated_text"]
    assert generated[:-1] == MESSAGES and generated[-1] == {"role": "assistant", "content": answer}
    assert answer.strip()


# ----------------------------------------------------------------------------------------------------
# AutoModelForImageTextToText / pipeline("image-text-to-text", model=<path>) with a PIL image
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder, trust_remote_code", [("vision_snapshot", None), ("vision_snapshot", True),
                                                       ("vision_export", None)])
def test_image_text_to_text_pipeline_on_a_path(request, monkeypatch, folder, trust_remote_code):
    path = request.getfixturevalue(folder)
    model = AutoModelForImageTextToText.from_pretrained(path, trust_remote_code=trust_remote_code)
    processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    assert type(model) is DeepseekV41ForCausalLM and model.has_vision
    assert type(processor) is DeepseekV41Processor and processor.chat_template == CHAT_TEMPLATE

    pipe = pipeline("image-text-to-text", model=str(path), trust_remote_code=trust_remote_code)
    assert type(pipe.model) is DeepseekV41ForCausalLM and type(pipe.processor) is DeepseekV41Processor
    spy = GenerateSpy(pipe.model)
    monkeypatch.setattr(pipe.model, "generate", spy)
    image = _image()
    chat = _image_chat(image)
    out_chat = pipe(text=chat, max_new_tokens=NEW_TOKENS, generate_kwargs={"do_sample": False})
    out_text = pipe(images=image, text=f"{IMAGE_PLACEHOLDER}Describe it.", max_new_tokens=NEW_TOKENS,
                    generate_kwargs={"do_sample": False})
    monkeypatch.setattr(pipe.model, "generate", spy.generate)

    # the model got the processor's inputs: the templated prompt with the image span, and the image's patches
    by_chat = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="pt")
    by_text = processor(images=image, text=f"{IMAGE_PLACEHOLDER}Describe it.", return_tensors="pt")
    assert len(spy.calls) == 2
    for call, inputs in zip(spy.calls, (by_chat, by_text)):
        assert (inputs["vision_token_types"] >= 0).sum() > 0
        for key in ("input_ids", "vision_token_types", "image_grid_hws"):
            assert torch.equal(call[key], inputs[key]), key
        assert torch.equal(call["pixel_values"], inputs["pixel_values"].to(call["pixel_values"].dtype))
    assert processor.tokenizer.decode(by_chat["input_ids"][0, :3]) == "<｜begin▁of▁sentence｜><｜User｜><｜image2｜>"

    # the answers are the greedy continuations of those inputs
    by_chat = by_chat.to(dtype=pipe.model.dtype)
    answer = _greedy_new_text(pipe.model, processor.tokenizer, by_chat)
    assert out_chat[0]["generated_text"][:-1] == chat
    assert out_chat[0]["generated_text"][-1] == {"role": "assistant", "content": answer}
    answer = _greedy_new_text(pipe.model, processor.tokenizer, by_text.to(dtype=pipe.model.dtype))
    assert out_text[0]["generated_text"] == f"{IMAGE_PLACEHOLDER}Describe it.{answer}"


def test_image_input_to_a_text_only_snapshot_is_a_clear_error(snapshot):
    pipe = pipeline("image-text-to-text", model=str(snapshot))
    assert type(pipe.model) is DeepseekV41ForCausalLM and not pipe.model.has_vision
    with pytest.raises(ValueError, match="no vision tower"):
        pipe(text=_image_chat(_image()), max_new_tokens=1)


# ----------------------------------------------------------------------------------------------------
# trust_remote_code=True on exports, in an interpreter where deepseek_v41 cannot be imported
# ----------------------------------------------------------------------------------------------------


REMOTE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys
    class Block(importlib.abc.MetaPathFinder):  # hide an installed deepseek_v41 (e.g. an editable install)
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "deepseek_v41":
                raise ImportError(name)
    sys.meta_path.insert(0, Block())
    import numpy as np
    from PIL import Image
    from transformers import pipeline
    text_folder, vision_folder, out, messages, new_tokens = sys.argv[1:4] + [eval(sys.argv[4]), int(sys.argv[5])]
    try:
        import deepseek_v41
        raise SystemExit("deepseek_v41 is importable")
    except ImportError:
        pass

    def remote(module):
        assert module.startswith("transformers_modules."), module

    result = {}
    pipe = pipeline("text-generation", model=text_folder, trust_remote_code=True)
    remote(type(pipe.model).__module__)
    result["template"] = pipe.tokenizer.chat_template
    result["prompt"] = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    result["text"] = pipe(messages, max_new_tokens=new_tokens, do_sample=False)[0]["generated_text"]
    pipe = pipeline("image-text-to-text", model=vision_folder, trust_remote_code=True)
    remote(type(pipe.model).__module__)
    remote(type(pipe.processor).__module__)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (70, 98, 3), dtype=np.uint8))
    chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]
    answer = pipe(text=chat, max_new_tokens=new_tokens, generate_kwargs={"do_sample": False})
    result["image"] = answer[0]["generated_text"][-1]
    json.dump(result, open(out, "w"))
    """
)


@pytest.mark.slow  # a fresh interpreter imports torch and transformers and loads two models from their remote code
def test_pipelines_with_trust_remote_code_on_exports_without_the_package(text_export, vision_export, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "modules"))
    out = tmp_path / "remote.json"
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(text_export), str(vision_export), str(out), repr(MESSAGES),
         str(NEW_TOKENS)],
        cwd=tmp_path, env=env, capture_output=True, check=False, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(out.read_text())

    # the same template, prompt and greedy answers as the package's own classes give on the same folders
    tokenizer = AutoTokenizer.from_pretrained(text_export)
    assert remote["template"] == CHAT_TEMPLATE
    assert remote["prompt"] == tokenizer(MESSAGES_RENDERED, add_special_tokens=False)["input_ids"]
    model = DeepseekV41ForCausalLM.from_pretrained(text_export)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    assert remote["text"] == [*MESSAGES, {"role": "assistant", "content": _greedy_new_text(model, tokenizer, prompt)}]
    model = DeepseekV41ForCausalLM.from_pretrained(vision_export)
    processor = AutoProcessor.from_pretrained(vision_export)
    inputs = processor.apply_chat_template(_image_chat(_image()), add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt").to(dtype=model.dtype)
    assert remote["image"] == {"role": "assistant", "content": _greedy_new_text(model, processor.tokenizer, inputs)}
