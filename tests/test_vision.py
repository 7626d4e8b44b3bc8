"""Vision tower, aligner and image-span merge: golden parity, structure, gradients, and every input check."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from deepseek_v41.layers import RMSNorm
from deepseek_v41.vision import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEWLINE,
    IMAGE_START,
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

IMAGE_ID = 129264


def assert_bf16_run_up_to_cpu_rounding(ours: torch.Tensor, stored: torch.Tensor, what: str) -> None:
    """The stored official bf16 run, recomputed: bit-identical on the CPU that made the fixture (measured), and
    another CPU's bf16 kernels may round a few elements differently (the text fixture on an AMX machine: 1 of 4,096
    elements 1 ulp apart). At most 1 % of the elements may differ, each by at most 1 bf16 ulp of the larger
    magnitude; a wrong weight, layer or mask moves most elements by far more. (Was: relative L2 <= 1e-2.)"""
    assert ours.dtype == stored.dtype == torch.bfloat16 and ours.shape == stored.shape, what
    a, b = ours.float(), stored.float()
    differ = a != b
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(1e-30))) - 7)
    assert differ.float().mean().item() <= 0.01, f"{what}: {int(differ.sum())} of {a.numel()} elements differ"
    assert bool(((a - b).abs() <= ulp)[differ].all()), f"{what}: max difference {(a - b).abs().max().item()}"


@pytest.fixture(scope="module")
def golden(vision_fixture_dir):
    return load_file(vision_fixture_dir / "reference" / "golden.safetensors")


@pytest.fixture(scope="module")
def released(vision_fixture_dir):
    """The snapshot's vision weights (``vision.*``, ``aligner.*``, ``image_*``), BF16 as released."""
    state = {}
    for shard in sorted((vision_fixture_dir / "snapshot").glob("*.safetensors")):
        state.update(
            {k: v for k, v in load_file(shard).items() if k.startswith(("vision.", "aligner.", "image_"))}
        )
    return state


def _tower_and_aligner(vision_fixture_config, state):
    """BF16 parameters, fp32 vision norms (as the official code holds them), released weights."""
    tower = DeepseekV41VisionTransformer(vision_fixture_config.vision_config).to(torch.bfloat16)
    aligner = DeepseekV41VisionAligner(
        vision_fixture_config.vision_config, vision_fixture_config.text_config.hidden_size
    ).to(torch.bfloat16)
    for module in tower.modules():
        if isinstance(module, RMSNorm):
            module.float()
    tower.load_state_dict({k[len("vision.") :]: v for k, v in state.items() if k.startswith("vision.")})
    aligner.load_state_dict({k[len("aligner.") :]: v for k, v in state.items() if k.startswith("aligner.")})
    return tower.eval(), aligner.eval()


def _fixture_grids(golden):
    return torch.tensor([golden[f"image{k}.grid"][1:3].tolist() for k in range(2)])


def test_parameter_names_are_the_released_ones(vision_fixture_config, released):
    state = released
    tower = DeepseekV41VisionTransformer(vision_fixture_config.vision_config)
    aligner = DeepseekV41VisionAligner(
        vision_fixture_config.vision_config, vision_fixture_config.text_config.hidden_size
    )
    ours = {f"vision.{k}": v.shape for k, v in tower.state_dict().items()}
    ours |= {f"aligner.{k}": v.shape for k, v in aligner.state_dict().items()}
    released = {k: v.shape for k, v in state.items() if not k.startswith("image_")}
    assert ours == released


def test_tower_and_aligner_match_official_outputs(vision_fixture_config, golden, released):
    tower, aligner = _tower_and_aligner(vision_fixture_config, released)
    assert tower.blocks[0].norm1.weight.dtype == torch.float32
    pixel_values = torch.cat([golden["image0.patches"], golden["image1.patches"]])
    with torch.no_grad():
        outputs = encode_images(tower, aligner, pixel_values, _fixture_grids(golden))
    for k, out in enumerate(outputs):
        assert_bf16_run_up_to_cpu_rounding(out, golden[f"bf16w_bf16.vision.aligner_out.{k}"], f"image {k}")


def test_attention_stays_inside_each_image(vision_fixture_config, golden, released):
    tower, _ = _tower_and_aligner(vision_fixture_config, released)
    pixel_values = torch.cat([golden["image0.patches"], golden["image1.patches"]])
    grids = _fixture_grids(golden)
    with torch.no_grad():
        together = tower(pixel_values, grids)
        alone = [tower(golden[f"image{k}.patches"], grids[k : k + 1])[0] for k in range(2)]
    for a, b in zip(together, alone):
        assert torch.equal(a, b)


def test_aligner_unshuffles_3x3_cells_channel_major(vision_fixture_config):
    torch.manual_seed(0)
    c, h, w = vision_fixture_config.vision_config.hidden_size, 5, 7  # pads to 6x9 -> 2x3 cells
    aligner = DeepseekV41VisionAligner(vision_fixture_config.vision_config, 8)
    features = torch.randn(h * w, c)
    grid = features.view(h, w, c)
    rows = []
    for cy in range(2):
        for cx in range(3):
            column = torch.zeros(c * 9)
            for dy in range(3):
                for dx in range(3):
                    y, x = cy * 3 + dy, cx * 3 + dx
                    if y < h and x < w:
                        column[torch.arange(c) * 9 + dy * 3 + dx] = grid[y, x]
            rows.append(column)
    expected = aligner.w2(F.gelu(aligner.w1(torch.stack(rows))))
    # measured 6e-8 (1 and 2 threads); gate 4.2x
    torch.testing.assert_close(aligner(features, (h, w)), expected, rtol=0, atol=2.5e-7)


def test_span_helpers():
    assert image_span_length(2, 3) == 10 and llm_grid(5, 7, 3) == (2, 3)
    assert image_span_token_types(2, 2) == [0, 1, 1, 2, 1, 1, 2, 3]


# ---------------------------------------------------------------------------------------------------------
# merge + validation on a small hand-made batch: row 0 = text, 2x3 image, text; row 1 = 2x2 image, text
# ---------------------------------------------------------------------------------------------------------
D = 6
GRIDS_VIT = torch.tensor([[5, 7], [6, 4]])  # -> LLM grids 2x3 and 2x2, spans of 10 and 8


def _batch():
    types = torch.full((2, 16), TEXT)
    types[0, 2:12] = torch.tensor(image_span_token_types(2, 3))
    types[1, 0:8] = torch.tensor(image_span_token_types(2, 2))
    ids = torch.where(types == TEXT, torch.arange(32).view(2, 16) + 100, torch.tensor(IMAGE_ID))
    pixel_values = torch.zeros(35 + 24, 3, 14, 14)
    return ids, types, pixel_values


def _validate(ids, types, pixel_values, grids=GRIDS_VIT):
    validate_image_inputs(ids, types, IMAGE_ID, grids, pixel_values, downsample_ratio=3)


def test_merge_places_rows_and_vectors_and_passes_gradients():
    ids, types, pixel_values = _batch()
    _validate(ids, types, pixel_values)
    embeds_leaf = torch.randn(2, 16, D, requires_grad=True)
    features = [torch.randn(6, D, requires_grad=True), torch.randn(4, D, requires_grad=True)]
    start, end, newline = (torch.randn(D, requires_grad=True) for _ in range(3))
    embeds = embeds_leaf * 1.0
    out = merge_image_embeddings(embeds, types, features, start, end, newline)
    assert torch.equal(out[types == IMAGE], torch.cat(features).detach())
    assert torch.equal(out[0, 2], start.detach()) and torch.equal(out[1, 7], end.detach())
    assert torch.equal(out[0, 6], newline.detach()) and torch.equal(out[1, 3], newline.detach())
    assert torch.equal(out[types == TEXT], embeds_leaf[types == TEXT].detach())
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    assert torch.equal(features[0].grad, weights[0, [3, 4, 5, 7, 8, 9]])
    # measured 0, 0, 1.2e-7 (1 and 2 threads; one fp32 ulp of the summed weights); gate 4.2x
    torch.testing.assert_close(start.grad, weights[types == IMAGE_START].sum(0), rtol=0, atol=5e-7)
    torch.testing.assert_close(end.grad, weights[types == IMAGE_END].sum(0), rtol=0, atol=5e-7)
    torch.testing.assert_close(newline.grad, weights[types == IMAGE_NEWLINE].sum(0), rtol=0, atol=5e-7)
    text_grad = torch.where((types == TEXT)[..., None], weights, torch.zeros(()))
    assert torch.equal(embeds_leaf.grad, text_grad)


def test_merge_without_images_is_identity():
    embeds = torch.randn(1, 4, D)
    types = torch.full((1, 4), TEXT)
    assert merge_image_embeddings(embeds, types, [], *torch.zeros(3, D)) is embeds


def test_error_image_positions_vs_aligner_rows():
    _, types, _ = _batch()
    features = [torch.zeros(6, D), torch.zeros(3, D)]
    with pytest.raises(ValueError, match=r"10 IMAGE positions .* 9 rows"):
        merge_image_embeddings(torch.zeros(2, 16, D), types, features, *torch.zeros(3, D))


def test_error_span_layout_vs_grid():
    ids, types, pixel_values = _batch()
    types[0, 5], types[0, 6] = IMAGE_NEWLINE, IMAGE  # newline one column early
    with pytest.raises(
        ValueError, match=r"image 0: span offset 3 \(position \[0, 5\]\) has type NEWLINE .* 2x3"
    ):
        _validate(ids, types, pixel_values)


def test_error_span_crossing_rows():
    ids, types, pixel_values = _batch()
    types[0] = TEXT
    types[0, 8:16] = torch.tensor(image_span_token_types(2, 3)[:8])
    types[1] = TEXT
    types[1, 0:2] = torch.tensor(image_span_token_types(2, 3)[8:])
    types[1, 2:10] = torch.tensor(image_span_token_types(2, 2))
    ids = torch.where(types == TEXT, ids.clamp(max=1000), torch.tensor(IMAGE_ID))
    with pytest.raises(ValueError, match=r"image 0: span starts at \[0, 8\] and ends at \[1, 1\]"):
        _validate(ids, types, pixel_values)


def test_error_text_inside_span():
    ids, types, pixel_values = _batch()
    types[1, 9:16] = types[1, 1:8].clone()  # move the 2x2 span's body right, leaving text after START
    types[1, 1:9] = TEXT
    ids = torch.where(types == TEXT, torch.tensor(7), torch.tensor(IMAGE_ID))
    with pytest.raises(ValueError, match=r"image 1: span starts at \[1, 0\] and ends at \[1, 15\]"):
        _validate(ids, types, pixel_values)


def test_error_number_of_span_positions_vs_grids():
    ids, types, pixel_values = _batch()
    with pytest.raises(ValueError, match=r"mark 18 image-span positions but the 1 image grids need 10"):
        _validate(ids, types, pixel_values[:35], GRIDS_VIT[:1])


def test_error_grids_vs_pixel_rows():
    ids, types, pixel_values = _batch()
    with pytest.raises(ValueError, match=r"58 patch rows .* needs sum\(h\*w\) = 59"):
        _validate(ids, types, pixel_values[:58])


def test_error_tower_grids_vs_pixel_rows(vision_fixture_config):
    tower = DeepseekV41VisionTransformer(vision_fixture_config.vision_config)
    with pytest.raises(ValueError, match=r"34 patch rows .* needs sum\(h\*w\) = 35"):
        tower(torch.zeros(34, 3, 14, 14), GRIDS_VIT[:1])


def test_error_span_position_without_image_id():
    ids, types, pixel_values = _batch()
    ids[1, 4] = 5
    with pytest.raises(ValueError, match=r"position \[1, 4\] has token type IMAGE but id 5"):
        _validate(ids, types, pixel_values)


def test_error_image_id_at_text_position():
    ids, types, pixel_values = _batch()
    ids[0, 14] = IMAGE_ID
    with pytest.raises(
        ValueError, match=r"position \[0, 14\] carries image_token_id 129264 but token type TEXT"
    ):
        _validate(ids, types, pixel_values)


def test_error_pixels_without_grids():
    ids, types, pixel_values = _batch()
    with pytest.raises(ValueError, match="together"):
        validate_image_inputs(ids, types, IMAGE_ID, None, pixel_values)
