"""Vision side of DeepSeek-V4.1: the ViT, the 3x3 pixel-unshuffle aligner, and the image-span merge.

An image becomes an ``n_vit_h x n_vit_w`` grid of 14x14 patches for the ViT; the aligner folds each 3x3
block of ViT cells into one LLM token, giving an ``n_llm_h x n_llm_w`` grid with
``n_llm = ceil(n_vit / 3)`` (zero padding bottom/right). In ``input_ids`` an image is a span of
``image_span_length(n_llm_h, n_llm_w)`` positions, all carrying ``image_token_id``; only
``vision_token_types`` tells them apart::

    START, (IMAGE x n_llm_w, NEWLINE) x n_llm_h, END        (types 0, 1 ... 1, 2, ..., 3; TEXT is -1)

How the model uses this file (architecture.md §10)::

    validate_image_inputs(input_ids, vision_token_types, image_token_id, image_grid_hws, pixel_values, ratio)
    features = encode_images(vision, aligner, pixel_values, image_grid_hws)   # list of [n_llm_h*n_llm_w, D]
    inputs_embeds = merge_image_embeddings(inputs_embeds, vision_token_types, features,
                                           image_start, image_end, image_newline)

The pure span/grid helpers at the top are shared with the processor (``processing_deepseek_v41.py``).
"""

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .layers import RMSNorm

# Token types of ``vision_token_types`` (the official ``token_types``).
TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3
_TYPE_NAMES = {TEXT: "TEXT", IMAGE_START: "START", IMAGE: "IMAGE", IMAGE_NEWLINE: "NEWLINE", IMAGE_END: "END"}


# ---------------------------------------------------------------------------------------------------------
# Span and grid helpers (pure functions, shared with the processor)
# ---------------------------------------------------------------------------------------------------------
def image_span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Positions one image occupies in ``input_ids``: a NEWLINE after every row, plus START and END."""
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(n_vit_h: int, n_vit_w: int, downsample_ratio: int) -> tuple[int, int]:
    """LLM token grid of a ViT patch grid: the aligner zero-pads to multiples of ``downsample_ratio``."""
    return math.ceil(n_vit_h / downsample_ratio), math.ceil(n_vit_w / downsample_ratio)


def image_span_token_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """Token types of one image span: START, (IMAGE x n_llm_w, NEWLINE) x n_llm_h, END."""
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEWLINE]) * n_llm_h + [IMAGE_END]


# ---------------------------------------------------------------------------------------------------------
# ViT
# ---------------------------------------------------------------------------------------------------------
def vision_norm(config) -> RMSNorm:
    # fp32 weight, fp32 math, one rounding: the official code holds the vision norms in fp32
    return RMSNorm(config.hidden_size, config.rms_norm_eps, "torch_fp32", dtype=torch.float32)


def vision_rope_cos_sin(n_h: int, n_w: int, head_dim: int, theta: float, device=None):
    """2D RoPE tables of one image, fp32 ``[n_h*n_w, head_dim]`` each, patches in row-major order.

    The first quarter of the rotary angles follows the patch row, the second its column
    (``inv_k = theta^(-k / (head_dim/4))``); the halves are repeated so that channel ``i`` pairs with
    ``i + head_dim/2`` (half-split, not interleaved)."""
    quarter = head_dim // 4
    inv = 1.0 / theta ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
    rows = torch.arange(n_h, device=device, dtype=torch.float32).repeat_interleave(n_w)  # [n]
    cols = torch.arange(n_w, device=device, dtype=torch.float32).repeat(n_h)  # [n]
    angles = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)  # [n, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [n, head_dim]
    return angles.cos(), angles.sin()


def apply_vision_rope(x, cos, sin):
    """Half-split rotation in fp32. x [heads, n, head_dim]; cos/sin [n, head_dim]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class DeepseekV41VisionAttention(nn.Module):
    """Bidirectional multi-head attention inside one image, with 2D RoPE on q and k."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        if self.head_dim * self.num_heads != config.hidden_size or self.head_dim % 4:
            raise ValueError(
                f"vision hidden_size={config.hidden_size} must split into num_attention_heads="
                f"{config.num_attention_heads} heads whose size is a multiple of 4 (2D RoPE uses quarters)"
            )
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x, grid_hws, rope):
        # x [n_patches_all, d]; grid_hws: list of (h, w) per image; rope: list of (cos, sin) per image
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        outputs = []
        start = 0
        for (h, w), (cos, sin) in zip(grid_hws, rope):
            n = h * w
            # [n, d] -> [heads, n, head_dim]
            qi, ki, vi = (
                t[start : start + n].view(n, self.num_heads, self.head_dim).transpose(0, 1) for t in (q, k, v)
            )
            qi, ki = apply_vision_rope(qi, cos, sin), apply_vision_rope(ki, cos, sin)
            oi = F.scaled_dot_product_attention(qi, ki, vi)  # scale head_dim^-0.5, no mask
            outputs.append(oi.transpose(0, 1).reshape(n, -1))
            start += n
        return self.wo(torch.cat(outputs, dim=0))


class DeepseekV41VisionMLP(nn.Module):
    """SwiGLU: ``w1`` yields (gate, up) halves, ``w2(silu(gate) * up)``."""

    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        # x [n, d] -> [n, d]
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class DeepseekV41VisionBlock(GradientCheckpointingLayer):
    """Pre-norm block: ``x += attn(norm1 x)``, ``x += mlp(norm2 x)``."""

    def __init__(self, config):
        super().__init__()
        self.norm1 = vision_norm(config)
        self.attn = DeepseekV41VisionAttention(config)
        self.norm2 = vision_norm(config)
        self.mlp = DeepseekV41VisionMLP(config)

    def forward(self, x, grid_hws, rope):
        # x [n_patches_all, d]
        x = x + self.attn(self.norm1(x), grid_hws, rope)
        return x + self.mlp(self.norm2(x))


class DeepseekV41VisionPatchEmbed(nn.Module):
    """Linear embedding of a flattened ``(channel, row, col)`` patch."""

    def __init__(self, config):
        super().__init__()
        self.proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=True)

    def forward(self, pixel_values):
        # pixel_values [n, 3, p, p] -> [n, d]
        return self.proj(pixel_values.reshape(pixel_values.shape[0], -1).to(self.proj.weight.dtype))


class DeepseekV41VisionTransformer(nn.Module):
    """The ViT (``vision.*`` in the checkpoint). Several images are processed together; attention never
    crosses from one image to another."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.patch_embed = DeepseekV41VisionPatchEmbed(config)
        self.blocks = nn.ModuleList(DeepseekV41VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = vision_norm(config)

    def forward(self, pixel_values, image_grid_hws):
        # pixel_values [sum(h*w), 3, p, p] (images' patches concatenated, each row-major);
        # image_grid_hws [n_images, 2] ViT patch grid (h, w) -> list of [h*w, d], one per image
        grid_hws = [(int(h), int(w)) for h, w in image_grid_hws.tolist()]
        check_pixel_rows(pixel_values, grid_hws)
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        rope = [
            vision_rope_cos_sin(h, w, head_dim, self.config.rope_theta, pixel_values.device)
            for h, w in grid_hws
        ]
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, grid_hws, rope)
        x = self.norm(x)
        return list(x.split([h * w for h, w in grid_hws], dim=0))


# ---------------------------------------------------------------------------------------------------------
# Aligner
# ---------------------------------------------------------------------------------------------------------
class DeepseekV41VisionAligner(nn.Module):
    """3x3 pixel-unshuffle + MLP into the text width (``aligner.*`` in the checkpoint)."""

    def __init__(self, config, text_hidden_size: int):
        super().__init__()
        self.ratio = config.downsample_ratio
        self.w1 = nn.Linear(config.hidden_size * self.ratio**2, text_hidden_size, bias=True)
        self.w2 = nn.Linear(text_hidden_size, text_hidden_size, bias=True)

    def forward(self, features, grid_hw):
        # features [h*w, c] of one image, grid_hw (h, w) ViT grid -> [n_llm_h*n_llm_w, text_hidden]
        h, w = (int(s) for s in grid_hw)
        if features.shape[0] != h * w:
            raise ValueError(
                f"aligner got {features.shape[0]} feature rows for a {h}x{w} ViT grid ({h * w} rows)"
            )
        r = self.ratio
        x = features.t().reshape(1, -1, h, w)  # [1, c, h, w]
        x = F.pad(x, (0, -w % r, 0, -h % r))  # zeros bottom/right
        # unfold: column index c*r*r + dy*r + dx, one row per cell in row-major order
        x = F.unfold(x, kernel_size=r, stride=r)[0].t()  # [n_llm_h*n_llm_w, c*r*r]
        return self.w2(F.gelu(self.w1(x.to(self.w1.weight.dtype))))


def encode_images(vision_tower, aligner, pixel_values, image_grid_hws):
    """ViT then aligner for every image: list of ``[n_llm_h*n_llm_w, text_hidden]``, in image order."""
    features = vision_tower(pixel_values, image_grid_hws)
    return [aligner(f, hw) for f, hw in zip(features, image_grid_hws.tolist())]


# ---------------------------------------------------------------------------------------------------------
# Validation and merge
# ---------------------------------------------------------------------------------------------------------
def check_pixel_rows(pixel_values, grid_hws):
    """The grids must account for every patch row of ``pixel_values``, and every pixel must be finite (a NaN
    would spread through the tower into every logit of the batch).  One host sync per forward with images."""
    need = sum(h * w for h, w in grid_hws)
    if pixel_values.shape[0] != need:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[0]} patch rows but image_grid_hws "
            f"{[list(g) for g in grid_hws]} needs sum(h*w) = {need}; pass the processor's pixel_values and "
            "image_grid_hws together"
        )
    if not pixel_values.is_floating_point():
        raise ValueError(f"pixel_values must be floating point (the processor's BF16 patches), got {pixel_values.dtype}")
    if not bool(torch.isfinite(pixel_values.sum(dtype=torch.float32))):  # a sum is non-finite iff an element is
        bad = ~torch.isfinite(pixel_values.reshape(pixel_values.shape[0], -1)).all(1)
        if not bool(bad.any()):  # the sum overflowed; every value is finite
            return
        row = int(bad.nonzero()[0])
        image = next(i for i, end in enumerate(itertools.accumulate(h * w for h, w in grid_hws)) if row < end)
        raise ValueError(
            f"pixel_values hold non-finite values (NaN or Inf) in {int(bad.sum())} patch rows, the first at row "
            f"{row} (image {image} of {len(grid_hws)}); the processor's output is finite: check what produced or "
            "modified these pixels"
        )


def _where(mask):
    """(row, position) of the first True of a [b, s] mask."""
    row, pos = mask.nonzero()[0].tolist()
    return row, pos


def validate_image_inputs(
    input_ids, vision_token_types, image_token_id, image_grid_hws=None, pixel_values=None, downsample_ratio=3
):
    """Check that ids, token types, grids and pixels describe the same images; raise ``ValueError`` naming the
    first inconsistency. The model calls this before running the vision tower.

    input_ids, vision_token_types [b, s]; image_grid_hws [n_images, 2] ViT grids (h, w) in order of appearance
    (row-major over batch rows, then positions); pixel_values [sum(h*w), 3, p, p]."""
    if vision_token_types.shape != input_ids.shape:
        raise ValueError(
            f"vision_token_types has shape {tuple(vision_token_types.shape)} but input_ids has "
            f"{tuple(input_ids.shape)}; the processor returns both with the same [batch, seq] shape"
        )
    types = vision_token_types
    unknown = (types < TEXT) | (types > IMAGE_END)
    if unknown.any():
        row, pos = _where(unknown)
        raise ValueError(
            f"vision_token_types[{row}, {pos}] = {types[row, pos].item()}; allowed are -1 (TEXT), 0 (START), "
            "1 (IMAGE), 2 (NEWLINE), 3 (END)"
        )
    in_span = types != TEXT
    has_id = input_ids == image_token_id
    if (in_span != has_id).any():
        row, pos = _where(in_span != has_id)
        n_span, n_id = int(in_span.sum()), int(has_id.sum())
        counts = f"({n_span} image-span positions, {n_id} positions with id {image_token_id})"
        if in_span[row, pos]:
            raise ValueError(
                f"position [{row}, {pos}] has token type {_TYPE_NAMES[types[row, pos].item()]} but id "
                f"{input_ids[row, pos].item()}; every image-span position must carry image_token_id "
                f"{image_token_id} {counts}"
            )
        raise ValueError(
            f"position [{row}, {pos}] carries image_token_id {image_token_id} but token type TEXT; that id "
            f"is reserved for image spans built by the processor {counts}"
        )

    if (image_grid_hws is None) != (pixel_values is None):
        raise ValueError("pass pixel_values and image_grid_hws together (both come from the image processor)")
    grid_hws = [] if image_grid_hws is None else [(int(h), int(w)) for h, w in image_grid_hws.tolist()]
    if any(h <= 0 or w <= 0 for h, w in grid_hws):
        raise ValueError(f"image_grid_hws {grid_hws} holds a non-positive size")
    if pixel_values is not None:
        check_pixel_rows(pixel_values, grid_hws)

    # Layout: the non-TEXT positions, read row-major, must be the concatenation of the images' spans.
    llm_grids = [llm_grid(h, w, downsample_ratio) for h, w in grid_hws]
    lengths = [image_span_length(h, w) for h, w in llm_grids]
    actual = types[in_span]
    if actual.numel() != sum(lengths):
        raise ValueError(
            f"vision_token_types mark {actual.numel()} image-span positions but the {len(grid_hws)} image "
            f"grids need {sum(lengths)} (span lengths {lengths} for LLM grids {[list(g) for g in llm_grids]}); "
            "the number of image spans in the text must equal the number of images"
        )
    if not lengths:
        return
    expected = torch.tensor(
        [t for g in llm_grids for t in image_span_token_types(*g)], dtype=actual.dtype, device=actual.device
    )
    if (actual != expected).any():
        first = int((actual != expected).nonzero()[0])
        k = next(i for i in range(len(lengths)) if first < sum(lengths[: i + 1]))
        row, pos = in_span.nonzero()[first].tolist()
        n_h, n_w = llm_grids[k]
        raise ValueError(
            f"image {k}: span offset {first - sum(lengths[:k])} (position [{row}, {pos}]) has type "
            f"{_TYPE_NAMES[actual[first].item()]} but its {n_h}x{n_w} LLM grid needs "
            f"{_TYPE_NAMES[expected[first].item()]}; the layout is START, (IMAGE x {n_w}, NEWLINE) x {n_h}, END"
        )
    starts = (types == IMAGE_START).nonzero().tolist()
    ends = (types == IMAGE_END).nonzero().tolist()
    for k, ((r0, p0), (r1, p1)) in enumerate(zip(starts, ends)):
        if r0 != r1 or p1 - p0 + 1 != lengths[k]:
            raise ValueError(
                f"image {k}: span starts at [{r0}, {p0}] and ends at [{r1}, {p1}]; a span must be "
                f"{lengths[k]} consecutive positions inside one batch row (no row crossing, no text inside)"
            )


def merge_image_embeddings(
    inputs_embeds, vision_token_types, image_features, image_start, image_end, image_newline
):
    """Write the image spans into the token embeddings, out of place (gradients reach all inputs).

    inputs_embeds [b, s, D]; vision_token_types [b, s]; image_features: list of [n_llm_h*n_llm_w, D] in
    order of appearance (row-major over batch rows, then positions); image_start/end/newline [D].
    IMAGE positions take the aligner rows in order; START/END/NEWLINE take the learned vectors.
    Call ``validate_image_inputs`` first: this function checks only the row count."""
    b, s, d = inputs_embeds.shape
    is_image = vision_token_types == IMAGE
    n_rows = sum(f.shape[0] for f in image_features)
    n_image = int(is_image.sum())
    if n_image != n_rows:
        raise ValueError(
            f"{n_image} IMAGE positions in vision_token_types but the aligner produced {n_rows} rows "
            f"({[f.shape[0] for f in image_features]} per image); the images and the text spans disagree"
        )
    if n_rows == 0:
        return inputs_embeds
    features = torch.cat(image_features, dim=0)
    if features.shape[-1] != d:
        raise ValueError(f"image features have width {features.shape[-1]} but inputs_embeds has {d}")
    flat = inputs_embeds.reshape(b * s, d)
    flat = flat.index_put((is_image.reshape(-1).nonzero()[:, 0],), features.to(flat.dtype))
    out = flat.view(b, s, d)
    types = vision_token_types[..., None]
    for kind, vector in ((IMAGE_START, image_start), (IMAGE_END, image_end), (IMAGE_NEWLINE, image_newline)):
        out = torch.where(types == kind, vector.to(out.dtype), out)
    return out
