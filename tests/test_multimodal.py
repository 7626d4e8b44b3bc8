"""Text+image through the tiny model with the vision tower on: processor → model → loss → gradients."""

import numpy as np
import pytest
import torch
from conftest import tiny_model
from PIL import Image
from torch.nn import functional as F
from transformers import PreTrainedTokenizerFast

from deepseek_v41.image_processing_deepseek_v41 import DeepseekV41ImageProcessor
from deepseek_v41.processing_deepseek_v41 import IMAGE_PLACEHOLDER, DeepseekV41Processor

VISION = {"num_hidden_layers": 2}


@pytest.fixture(scope="module")
def model(v4_tokenizer):
    return tiny_model(v4_tokenizer, text={"vocab_size": 129280}, vision=VISION)


@pytest.fixture(scope="module")
def processor(model, tokenizer_file):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), bos_token="<｜begin▁of▁sentence｜>",
                                        eos_token="<｜end▁of▁sentence｜>", pad_token="<｜▁pad▁｜>")
    image_processor = DeepseekV41ImageProcessor.from_vision_config(model.config.vision_config)
    return DeepseekV41Processor(image_processor, tokenizer, image_token_id=model.config.image_token_id)


def image(width, height, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def batch(processor, texts, images):
    return dict(processor(text=texts, images=images, return_tensors="pt"))


def test_text_image_forward_backward(model, processor):
    inputs = batch(processor, [f"Look at this {IMAGE_PLACEHOLDER} and describe it.", "Only text here."],
                   [image(98, 70, 0)])
    model.train()
    out = model(**inputs, labels=inputs["input_ids"])
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    for name in ("vision.patch_embed.proj.weight", "vision.blocks.1.mlp.w2.weight", "aligner.w1.weight",
                 "image_start", "image_end", "image_newline"):
        grad = model.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    model.zero_grad()


def test_text_image_batch_equals_its_rows_and_the_loss_is_shifted_cross_entropy(model, processor):
    """Each row of a padded text+image batch gets the logits it gets alone (an image's features in the wrong row
    or at shifted positions fail), and the loss is the shifted cross-entropy over the real tokens."""
    texts = [f"Look at this {IMAGE_PLACEHOLDER} and describe it.", "Only text here, a little longer than that."]
    inputs = batch(processor, texts, [image(98, 70, 0)])
    model.eval()
    with torch.no_grad():
        out = model(**inputs, labels=inputs["input_ids"])
        alone = [model(**batch(processor, texts[:1], [image(98, 70, 0)])).logits[0],
                 model(**batch(processor, texts[1:], None)).logits[0]]
    for row, logits in enumerate(alone):
        real = inputs["attention_mask"][row].bool()
        assert int(real.sum()) == logits.shape[0]
        # fp32 round-off of the same computation at another batch shape: measured 2.2e-7 (1 and 2 threads); 4.5x
        torch.testing.assert_close(out.logits[row][real], logits, rtol=0, atol=1e-6)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    manual = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    # measured 0 (1 and 2 threads); gate ~4 fp32 ulps: the model sums then divides, the manual loss is a mean
    torch.testing.assert_close(out.loss, manual, rtol=4e-7, atol=0)


def test_vision_gradients_are_the_backbone_gradient_at_the_image_rows(model, processor, monkeypatch):
    """The gradients of the tower, the aligner and the span vectors are exactly what the backbone's gradient at the
    merged embeddings gives them: the tower and aligner run alone under the gradient that reached the image rows,
    the span vectors the sum over their positions (a wrongly scaled or detached image path fails; the tower's and
    the merge's own backward are checked in test_vision.py)."""
    from deepseek_v41.vision import IMAGE, IMAGE_END, IMAGE_NEWLINE, IMAGE_START

    inputs = batch(processor, [f"Look at this {IMAGE_PLACEHOLDER} and describe it."], [image(98, 70, 7)])
    model.eval()
    merged, embed_images = [], model.embed_images

    def keep_merged(*args):
        out = embed_images(*args)
        out.retain_grad()
        merged.append(out)
        return out

    monkeypatch.setattr(model, "embed_images", keep_merged)
    model.zero_grad()
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    upstream, types = merged[0].grad[0], inputs["vision_token_types"][0]
    assert upstream[types == IMAGE].abs().sum() > 0
    tower = [p for p in [*model.vision.parameters(), *model.aligner.parameters()] if p.grad is not None]
    assert len(tower) == len(list(model.vision.parameters())) + len(list(model.aligner.parameters()))
    grids = inputs["image_grid_hws"]  # the tower and the aligner called directly, not through the model's path
    features = torch.cat([model.aligner(f, hw) for f, hw in zip(model.vision(inputs["pixel_values"], grids),
                                                                   grids.tolist())])
    expected = torch.autograd.grad(features, tower, upstream[types == IMAGE])
    for param, want in zip(tower, expected):
        torch.testing.assert_close(param.grad, want, rtol=0, atol=0)  # the same ops: measured bit-equal (1, 2 threads)
    for name, kind in (("image_start", IMAGE_START), ("image_newline", IMAGE_NEWLINE), ("image_end", IMAGE_END)):
        # measured bit-equal (1 and 2 threads)
        torch.testing.assert_close(model.get_parameter(name).grad, upstream[types == kind].sum(0), rtol=0, atol=0)
    model.zero_grad()


def test_image_content_changes_the_output(model, processor):
    model.eval()
    text = [f"A picture: {IMAGE_PLACEHOLDER} what is it?"]
    with torch.no_grad():
        a = model(**batch(processor, text, [image(84, 56, 1)])).logits
        b = model(**batch(processor, text, [image(84, 56, 2)])).logits
    span_start = int((batch(processor, text, [image(84, 56, 1)])["vision_token_types"][0] >= 0).nonzero()[0])
    # causal: text before the image is unchanged; measured 1.5e-7 (1 and 2 threads), gate 4x
    torch.testing.assert_close(a[:, :span_start], b[:, :span_start], rtol=0, atol=6e-7)
    assert not torch.allclose(a[:, span_start:], b[:, span_start:])


def test_moving_an_image_moves_its_span(processor):
    first = batch(processor, [f"{IMAGE_PLACEHOLDER} then words"], [image(56, 56, 3)])
    later = batch(processor, [f"some words then {IMAGE_PLACEHOLDER}"], [image(56, 56, 3)])
    span = lambda b: (b["vision_token_types"][0] >= 0).nonzero().flatten()
    assert len(span(first)) == len(span(later))
    assert span(later)[0] > span(first)[0]
    types = first["vision_token_types"][0]
    assert types[span(first)[0]] == 0 and types[span(first)[-1]] == 3


def test_image_tokens_close_the_engram_gate(model, processor):
    inputs = batch(processor, [f"x {IMAGE_PLACEHOLDER} y"], [image(56, 56, 4)])
    image_mask = inputs["vision_token_types"] >= 0
    engram = model.layers[1].engram
    captured = {}
    hook = engram.register_forward_hook(lambda m, a, o: captured.update(x=a[0], out=o))
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    delta = (captured["out"].float() - captured["x"].float()).abs().sum(-1).sum(-1)  # [b, s]
    assert (delta[image_mask] == 0).all() and (delta[~image_mask] > 0).all()


def test_mismatched_patches_are_rejected(model, processor):
    inputs = batch(processor, [f"x {IMAGE_PLACEHOLDER} y"], [image(56, 56, 5)])
    inputs["pixel_values"] = inputs["pixel_values"][:-1]
    with pytest.raises(ValueError, match="patch rows"):
        model(**inputs)


def test_released_snapshot_processor_and_model_end_to_end():
    from conftest import golden_dir
    from transformers import AutoModelForCausalLM, AutoProcessor

    snapshot = golden_dir("v41_tiny_vision") / "snapshot"
    processor = AutoProcessor.from_pretrained(snapshot)  # no processor_config.json: built from config + tokenizer
    assert isinstance(processor, DeepseekV41Processor) and processor.image_token_id == 129264
    messages = [{"role": "user", "content": [{"type": "image", "image": image(98, 70, 6)},
                                             {"type": "text", "text": "What is this?"}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert inputs["image_grid_hws"].tolist() == [[5, 7]]
    assert int((inputs["vision_token_types"] >= 0).sum()) == 2 * (3 + 1) + 2
    model = AutoModelForCausalLM.from_pretrained(snapshot)
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pixel_values_are_refused(model, processor, bad):
    """Issue 43: NaN pixel_values gave NaN logits without an error."""
    inputs = batch(processor, [f"{IMAGE_PLACEHOLDER} one {IMAGE_PLACEHOLDER} two"], [image(40, 40, 0), image(40, 40, 1)])
    first = int(inputs["image_grid_hws"][0].prod())
    inputs["pixel_values"][first + 2, 1, 3, 4] = bad
    with pytest.raises(ValueError, match=rf"pixel_values hold non-finite values \(NaN or Inf\) in 1 patch rows, the "
                                         rf"first at row {first + 2} \(image 1 of 2\)"):
        model(**inputs)
