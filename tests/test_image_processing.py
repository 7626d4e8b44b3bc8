"""DeepseekV41ImageProcessor: golden patches, the official resize plan, image modes, padding, limits."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from deepseek_v41.configuration_deepseek_v41 import DeepseekV41VisionConfig
from deepseek_v41.image_processing_deepseek_v41 import DeepseekV41ImageProcessor, plan_image_box
from deepseek_v41.vision import image_span_length, llm_grid


@pytest.fixture(scope="module")
def fixture_dir(vision_fixture_dir):
    return vision_fixture_dir


@pytest.fixture(scope="module")
def golden(fixture_dir):
    return load_file(fixture_dir / "reference" / "golden.safetensors")


@pytest.fixture(scope="module")
def tiny_processor(fixture_dir):
    """The fixture model's vision config: max_image_tokens 64, min_pixels 1."""
    vision = json.loads((fixture_dir / "snapshot" / "config.json").read_text())["vision_config"]
    return DeepseekV41ImageProcessor.from_vision_config(DeepseekV41VisionConfig(**vision))


def test_fixture_images_reproduce_official_patches_bit_exactly(golden, tiny_processor):
    images = [Image.fromarray(golden[f"image{k}.rgb_uint8"].numpy()) for k in range(2)]
    out = tiny_processor(images)
    expected = torch.cat([golden["image0.patches"], golden["image1.patches"]])
    assert out["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(out["pixel_values"].view(torch.int16), expected.view(torch.int16))
    for k in range(2):
        # stored grid: [span start, n_vit_h, n_vit_w, n_llm_h, n_llm_w]
        _, vit_h, vit_w, llm_h, llm_w = golden[f"image{k}.grid"].tolist()
        assert out["image_grid_hws"][k].tolist() == [vit_h, vit_w]
        assert llm_grid(vit_h, vit_w, tiny_processor.downsample_ratio) == (llm_h, llm_w)


# (width, height) -> (n_llm_h, n_llm_w) under the released vision config, as computed by the official
# inference/image_processor.py (revision dba1be0a) in a published sweep (GitHub
# xbzb404/dsh-context-compression-selector, packages/runtime/tests/fixtures/vision-official-sweep.json):
# min-pixel upscales, plain sizes and shrinks.
OFFICIAL_GRIDS = {
    (1, 1): (13, 13),
    (2, 3): (16, 11),
    (13, 14): (14, 13),
    (28, 14): (10, 19),
    (543, 544): (13, 13),
    (240, 180): (12, 15),
    (180, 240): (15, 12),
    (640, 480): (12, 16),
    (800, 600): (15, 20),
    (1024, 768): (19, 25),
    (1280, 960): (23, 31),
    (1600, 1200): (27, 36),
    (2000, 2000): (31, 31),
    (4000, 3000): (27, 36),
    (1444, 1240): (29, 34),
    (4328, 2964): (26, 38),
    (4, 400): (130, 2),
    (400, 4): (2, 130),
    (1152, 128): (5, 39),
    (4200, 100): (3, 100),
    (10000, 10): (1, 410),
    (10, 10000): (410, 1),
    (839, 2): (1, 266),
    (3235, 396): (10, 78),
    (99, 3973): (95, 3),
}


@pytest.mark.parametrize("size", list(OFFICIAL_GRIDS))
def test_resize_plan_matches_official_grids(size):
    processor = DeepseekV41ImageProcessor()  # released defaults: 1024 tokens, min_pixels 544^2
    width, height = size
    assert llm_grid(*processor.vit_grid(height, width), 3) == OFFICIAL_GRIDS[size]


def test_shrink_collapses_to_single_row_and_column():
    # 62 = max_image_tokens - 2 positions left for the grid: one row takes n_w + 1, one column 2 per row
    assert plan_image_box(5000, 20, 14, 3, 64, 1) == (42, 61 * 42)
    assert plan_image_box(20, 5000, 14, 3, 64, 1) == (31 * 42, 42)
    for box_h, box_w in (plan_image_box(5000, 20, 14, 3, 64, 1), plan_image_box(20, 5000, 14, 3, 64, 1)):
        assert image_span_length(*llm_grid(box_h // 14, box_w // 14, 3)) == 64


def _uint8(pixels):
    """Undo (x/255 - 0.5)/0.5 for values that are exact in bf16."""
    return torch.round((pixels.float() * 0.5 + 0.5) * 255)


def test_made_up_images_token_counts_grids_and_range(tiny_processor):
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (37, 150, 3), dtype=np.uint8)),  # wide
        Image.fromarray(rng.integers(0, 256, (200, 45, 4), dtype=np.uint8), mode="RGBA"),  # tall, RGBA
        Image.fromarray(rng.integers(0, 256, (60, 60), dtype=np.uint8), mode="L"),  # gray
        Image.new("P", (33, 17)),  # palette
        Image.new("RGB", (3000, 2000), (200, 10, 10)),  # large: shrink to <= 64 positions
        Image.new("RGB", (9000, 30)),  # extreme aspect: shrink
    ]
    out = tiny_processor(images)
    grids = out["image_grid_hws"].tolist()
    assert out["pixel_values"].shape[0] == sum(h * w for h, w in grids)
    assert out["pixel_values"].abs().max() <= 1.0
    spans = [image_span_length(*llm_grid(h, w, 3)) for h, w in grids]
    assert all(n <= 64 for n in spans)
    assert max(spans[-2:]) > 50  # the shrunk images use most of the budget, not a trivial grid
    start = 0
    for image, (h, w) in zip(images, grids):
        # every image is planned on its own: processing it alone gives the same patches
        single = tiny_processor(image)["pixel_values"]
        assert torch.equal(single, out["pixel_values"][start : start + h * w])
        start += h * w


def test_tiny_image_is_upscaled_to_min_pixels():
    processor = DeepseekV41ImageProcessor()  # min_pixels 295936
    out = processor(Image.new("RGB", (5, 3), (0, 255, 0)))
    h, w = out["image_grid_hws"][0].tolist()
    assert (h * 14) * (w * 14) >= 295936 * 0.95
    assert image_span_length(*llm_grid(h, w, 3)) <= 1024
    green = _uint8(out["pixel_values"][:, 1]) == 255
    assert green.float().mean() > 0.95  # the image fills the box; gray only in the rounding margin


def test_aspect_preserving_resize_pads_centered_gray(tiny_processor):
    # 100x20 white -> box 112x28: resized to 112x22, 3 gray rows above and below
    out = tiny_processor(Image.new("RGB", (100, 20), (255, 255, 255)))
    assert out["image_grid_hws"].tolist() == [[2, 8]]
    pixels = out["pixel_values"].reshape(2, 8, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 112)
    values = _uint8(pixels)
    assert torch.all(values[:, :3] == 127) and torch.all(values[:, -3:] == 127)
    assert torch.all(values[:, 4:-4] == 255)


def test_max_wh_ratio_clamps_width_and_stretches():
    processor = DeepseekV41ImageProcessor(max_image_tokens=64, min_pixels=1, max_wh_ratio=2)
    out = processor(Image.new("RGB", (400, 100), (255, 255, 255)))
    assert out["image_grid_hws"].tolist() == [[8, 15]]  # planned as 200x100 -> box 210x112
    assert torch.all(out["pixel_values"] == 1.0)  # stretched into the box: no gray padding
    narrow = processor(Image.new("RGB", (150, 100), (255, 255, 255)))  # under the ratio: padded as usual
    assert narrow["image_grid_hws"].tolist() == [[8, 11]] and not torch.all(narrow["pixel_values"] == 1.0)


def test_rgba_drops_alpha_and_gray_expands(tiny_processor):
    rgb = np.random.default_rng(1).integers(0, 256, (28, 42, 3), dtype=np.uint8)
    rgba = np.concatenate([rgb, np.zeros((28, 42, 1), np.uint8)], axis=-1)  # fully transparent
    from_rgb = tiny_processor(Image.fromarray(rgb))["pixel_values"]
    from_rgba = tiny_processor(Image.fromarray(rgba, mode="RGBA"))["pixel_values"]
    assert torch.equal(from_rgba, from_rgb)  # PIL convert("RGB"), not compositing on white
    gray = tiny_processor(Image.fromarray(rgb[..., 0], mode="L"))["pixel_values"]
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 0], gray[:, 2])
    assert torch.equal(_uint8(gray[:, 0]), _uint8(from_rgb[:, 0]))


def test_patches_are_row_major(tiny_processor):
    # 28x42 image whose pixel value encodes the patch index
    index = np.arange(6, dtype=np.uint8).reshape(2, 3).repeat(14, 0).repeat(14, 1) * 40
    out = tiny_processor(Image.fromarray(np.stack([index] * 3, -1)))
    assert out["image_grid_hws"].tolist() == [[2, 3]]
    assert _uint8(out["pixel_values"][:, 0, 0, 0]).tolist() == [0, 40, 80, 120, 160, 200]


def test_rejects_non_uint8_arrays(tiny_processor):
    with pytest.raises(ValueError, match="uint8"):
        tiny_processor(np.zeros((3, 28, 28), dtype=np.float32))


def test_arrays_convert_through_either_base_signature(tiny_processor, monkeypatch):
    # the base class's convert_to_rgb takes input_data_format in later transformers and only the image in 5.17;
    # the override (PIL images through the official conversion) passes on whatever its caller gives
    from transformers.image_processing_backends import PilBackend

    seen = []
    array = np.zeros((3, 4, 4), np.uint8)
    monkeypatch.setattr(PilBackend, "convert_to_rgb", lambda self, image: seen.append("5.17") or image)
    assert tiny_processor.convert_to_rgb(array) is array and seen == ["5.17"]
    monkeypatch.setattr(PilBackend, "convert_to_rgb",
                        lambda self, image, input_data_format=None: seen.append(input_data_format) or image)
    assert tiny_processor.convert_to_rgb(array, input_data_format="channels_first") is array
    assert seen == ["5.17", "channels_first"]
    gray = Image.fromarray(np.full((4, 5), 7, np.uint8), "L")
    assert tiny_processor.convert_to_rgb(gray).shape == (4, 5, 3) and len(seen) == 2  # PIL: its own conversion


# ---- image modes and sources (issue 24, Processor) ----

RGB = np.random.default_rng(5).integers(0, 256, (28, 42, 3), dtype=np.uint8)


def test_sixteen_bit_gray_is_rounded_to_8_bits_not_clipped(tiny_processor):
    # PIL's own convert("RGB") clips I;16 at 255: nearly every pixel of a 16-bit image became white
    gray8 = RGB[..., 0]
    gray16 = gray8.astype(np.uint16) * 257  # the same image at 16 bits (255 -> 65535)
    gray16[0, 0] += 100  # rounds back to the same 8-bit value
    from_16 = tiny_processor(Image.fromarray(gray16))["pixel_values"]
    assert Image.fromarray(gray16).mode == "I;16"
    assert torch.equal(from_16, tiny_processor(Image.fromarray(gray8, mode="L"))["pixel_values"])


@pytest.mark.parametrize("array", [
    np.linspace(0, 1, 28 * 42, dtype=np.float32).reshape(28, 42),      # F in [0, 1]: clipped to black by PIL
    np.full((28, 42), np.nan, dtype=np.float32),                        # F holding NaN
    np.arange(28 * 42, dtype=np.int32).reshape(28, 42) * 1000,          # I (32-bit)
])
def test_integer_and_float_mode_images_are_refused(tiny_processor, array):
    image = Image.fromarray(array)
    assert image.mode in ("F", "I")
    with pytest.raises(ValueError, match=rf"\({image.mode}\) image has no known value range"):
        tiny_processor(image)


@pytest.mark.parametrize("array", [np.full((28, 42, 3), np.nan, np.float32), np.zeros((28, 42, 3), np.uint16)])
def test_non_uint8_arrays_are_refused(tiny_processor, array):
    with pytest.raises(ValueError, match="expected an RGB uint8 image"):
        tiny_processor(array)


def test_palette_la_and_cmyk_convert_by_their_colors(tiny_processor):
    reference = tiny_processor(Image.fromarray(RGB))["pixel_values"]
    palette = Image.fromarray(RGB).quantize(256)
    assert torch.equal(tiny_processor(palette)["pixel_values"], tiny_processor(palette.convert("RGB"))["pixel_values"])
    red = tiny_processor(Image.new("CMYK", (42, 28), (0, 255, 255, 0)))["pixel_values"]
    assert torch.equal(red, tiny_processor(Image.new("RGB", (42, 28), (255, 0, 0)))["pixel_values"])
    la = tiny_processor(Image.fromarray(np.stack([RGB[..., 0], RGB[..., 1]], -1), mode="LA"))["pixel_values"]
    assert torch.equal(la, tiny_processor(Image.fromarray(RGB[..., 0], mode="L"))["pixel_values"])  # alpha dropped
    assert reference.shape == red.shape


def test_path_and_bytes_are_opened(tiny_processor, tmp_path):
    file = tmp_path / "image.png"
    Image.fromarray(RGB).save(file)
    reference = tiny_processor(Image.fromarray(RGB))["pixel_values"]
    for source in (str(file), file, file.read_bytes(), [file.read_bytes()]):
        assert torch.equal(tiny_processor(source)["pixel_values"], reference)


def test_bad_path_or_bytes_are_named(tiny_processor, tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"image file {tmp_path / 'missing.png'} does not exist"):
        tiny_processor(str(tmp_path / "missing.png"))
    with pytest.raises(ValueError, match="the 5 bytes given as an image: not an image PIL can decode"):
        tiny_processor(b"hello")
    file = tmp_path / "cut.png"
    Image.fromarray(RGB).save(file)
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"image file {file}: not an image PIL can decode"):
        tiny_processor(str(file))


@pytest.mark.parametrize("bad, message", [
    (np.zeros((20, 20, 2), np.uint8), r"image 1 is an array of shape \(20, 20, 2\) with no 3-channel axis"),
    (torch.zeros(2, 20, 20, dtype=torch.uint8), r"image 1 is an array of shape \(2, 20, 20\) with no 3-channel axis"),
    (np.zeros(30, np.uint8), r"image 1 is a 1-D array of shape \(30,\)"),
    (np.zeros((20, 20), np.uint8), r"image 1 is a 2-D array of shape \(20, 20\)"),
    (None, r"image 1 is None"),
    (7, r"image 1 is of type int \(7\)"),
    (np.zeros((20, 20, 3), np.float32), r"image 1 is an array of dtype float32: expected an RGB uint8 image"),
    (np.zeros((0, 20, 3), np.uint8), r"image 1 is an empty array of shape \(0, 20, 3\)"),
])
def test_unsupported_images_are_named_with_the_accepted_forms(tiny_processor, bad, message):
    """Issue 43: 2-channel, 1-D and None images reached the image library's errors ("Unable to infer channel
    dimension format", "Could not make a flat list of images"); the error now names the image and the forms."""
    from deepseek_v41.processing_deepseek_v41 import IMAGE_PLACEHOLDER, DeepseekV41Processor

    good = np.zeros((20, 20, 3), np.uint8)
    accepted = r".*; accepted: a PIL image, a local path or URL, the encoded file's bytes, or a uint8 array"
    with pytest.raises(ValueError, match=message + accepted):
        tiny_processor([good, bad])
    processor = DeepseekV41Processor.__new__(DeepseekV41Processor)  # __call__ checks images before the tokenizer
    processor.image_token = IMAGE_PLACEHOLDER
    with pytest.raises(ValueError, match=message + accepted):
        processor(images=[good, bad], text=f"a {IMAGE_PLACEHOLDER} b {IMAGE_PLACEHOLDER}")
