"""Image processor of DeepSeek-V4.1: the official resize plan, gray padding, and 14x14 patches (PIL backend).

Per image (architecture.md §10 "Preprocessing"; reproduces the official ``inference/image_processor.py``
bit for bit on the golden fixture):

1. ``convert("RGB")`` (PIL semantics: an alpha channel is dropped, not composited; palette, LA and CMYK
   images convert by PIL's rules). 16-bit grayscale (``I;16``) is rounded to 8 bits first (PIL would clip it);
   32-bit integer (``I``) and float (``F``) images have no known value range and are refused. An image may be
   given as a path or as the encoded file's bytes.
2. Plan a box ``(box_h, box_w)``, multiples of ``patch_size`` (``plan_image_box``): upscale tiny images to
   ``min_pixels``, round each side up to whole patches, and if the image would cost more than
   ``max_image_tokens`` LLM positions shrink it with the closed form.
3. Aspect-preserving resize into the box with centered gray ``(127, 127, 127)`` padding
   (``PIL.ImageOps.pad``); if ``max_wh_ratio`` is set and the image is at least that wide, stretch instead.
4. ``x / 255``, ``(x - 0.5) / 0.5`` in fp32, then BF16; cut into row-major ``[3, p, p]`` patches.

Outputs ``pixel_values`` [all patches, 3, p, p] (BF16) and ``image_grid_hws`` [n_images, 2] (ViT grid h, w).
"""

import io
import math
import os
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import PILImageResampling
from transformers.processing_utils import ImagesKwargs, Unpack

from .vision import image_span_length, llm_grid

PAD_COLOR = (127, 127, 127)
# The vision_config fields that decide the resize plan (also image-processor attributes and call kwargs).
PLAN_FIELDS = ("patch_size", "downsample_ratio", "max_image_tokens", "min_pixels", "max_wh_ratio")


class DeepseekV41ImageProcessorKwargs(ImagesKwargs, total=False):
    """The ``PLAN_FIELDS`` of ``vision_config``."""

    patch_size: int
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None


_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


def open_image_source(image):
    """An image given as a local path or as the encoded file's bytes -> a loaded PIL image; other inputs unchanged.

    URLs and base64 strings are left to transformers' ``fetch_images``; a path-like string that does not exist,
    or bytes / a file PIL cannot decode, raise an error naming the source."""
    if isinstance(image, (list, tuple)):
        return [open_image_source(item) for item in image]
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(bytes(image)), f"the {len(image)} bytes given as an image")
    if isinstance(image, (str, os.PathLike)):
        path = Path(os.fspath(image)).expanduser()
        if path.is_file():
            return _decode(path, f"image file {path}")
        text = os.fspath(image)
        if isinstance(image, os.PathLike) or text.lower().endswith(_IMAGE_SUFFIXES) or text.startswith(("/", "./", "~")):
            raise FileNotFoundError(f"image file {path} does not exist")
    return image


def _decode(source, what: str) -> Image.Image:
    try:
        image = Image.open(source)
        image.load()  # decode now, so a truncated file fails here, named
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise ValueError(f"{what}: not an image PIL can decode ({error})") from error
    return image


ACCEPTED_IMAGES = ("a PIL image, a local path or URL, the encoded file's bytes, or a uint8 array / tensor "
                   "[H, W, 3] or [3, H, W] (RGB); a list of those (or of lists, one per text)")


def _flat_images(images) -> list:
    # the images a call holds, in order: one image, a list of them, a list of per-text lists, or a 4-D batch array
    if isinstance(images, (list, tuple)):
        return [image for item in images for image in (item if isinstance(item, (list, tuple)) else [item])]
    if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4:
        return list(images)
    return [images]


def check_images(images) -> None:
    """Each image must be one of ``ACCEPTED_IMAGES``; otherwise ``ValueError`` naming its index (0-based, in
    order of appearance) and what is wrong, instead of the image library's generic error."""
    if images is None:
        raise ValueError(f"no images given; pass {ACCEPTED_IMAGES}")
    for index, image in enumerate(_flat_images(images)):
        if isinstance(image, (Image.Image, str, os.PathLike)):
            continue  # paths and bytes are opened before this check; URLs are fetched by transformers
        if isinstance(image, (np.ndarray, torch.Tensor)):
            shape, dtype = tuple(image.shape), image.dtype
            if image.ndim == 3 and (shape[-1] == 3 or shape[0] == 3) and min(shape) > 0:
                if dtype in (np.uint8, torch.uint8):
                    continue
                problem = f"an array of dtype {dtype}: expected an RGB uint8 image (convert to uint8 0-255)"
            elif image.ndim == 3 and 0 in shape:
                problem = f"an empty array of shape {shape}"
            elif image.ndim == 3:
                problem = (f"an array of shape {shape} with no 3-channel axis first or last ({min(shape[0], shape[-1])}"
                           "-channel images are not RGB; for grayscale pass Image.fromarray(x) or stack 3 channels)")
            else:
                problem = f"a {image.ndim}-D array of shape {shape} (an image is 3-D: [H, W, 3] or [3, H, W])"
        elif image is None:
            problem = "None"
        else:
            problem = f"of type {type(image).__name__} ({image!r:.60})"
        raise ValueError(f"image {index} is {problem}; accepted: {ACCEPTED_IMAGES}")


def rgb_image(image: Image.Image) -> Image.Image:
    """A PIL image of any mode -> RGB without saturating: 16-bit grayscale rounds to 8 bits (PIL's own
    conversion clips it at 255); I and F images, whose value range is unknown, are refused."""
    if image.mode in _SIXTEEN_BIT_MODES:
        wide = np.asarray(image).astype(np.uint32)  # [H, W] 0..65535
        image = Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), "L")
    elif image.mode in ("I", "F"):
        kind = "32-bit integer" if image.mode == "I" else "floating-point"
        raise ValueError(
            f"a {kind} ({image.mode}) image has no known value range; convert it to 8-bit yourself, e.g. "
            "Image.fromarray(np.clip(x * 255, 0, 255).round().astype(np.uint8)) for values in [0, 1]"
        )
    return image.convert("RGB")


def _shrink_box(height, width, patch_size, downsample_ratio, max_image_tokens):
    """Largest box of the image's aspect whose LLM grid fits ``max_image_tokens`` (official closed form).

    With n_w LLM columns and n_h = n_w * h/w rows the span costs n_h*(n_w+1)+2 positions; solving for
    n_w gives ``max_w``. Images too tall (too wide) for one column (row) collapse to a single one."""
    cell = patch_size * downsample_ratio
    aspect = height / width
    max_w = math.sqrt((max_image_tokens - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    if max_w < 1.0:  # single column: n_h*2 + 2 <= max
        return (max_image_tokens - 2) // 2 * cell, cell
    if max_h < 1.0:  # single row: n_w + 3 <= max
        return cell, (max_image_tokens - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    box_h = math.floor(height * beta / patch_size) * patch_size
    return box_h, math.floor(width * beta / patch_size) * patch_size


def plan_image_box(
    width, height, patch_size, downsample_ratio, max_image_tokens, min_pixels, max_wh_ratio=None
):
    """Pixel box ``(box_h, box_w)`` an image of ``width x height`` is fitted into (multiples of patch_size)."""
    if max_wh_ratio is not None and width > height * max_wh_ratio:
        width = height * max_wh_ratio
    if 0 < width * height < min_pixels:
        scale = (min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    box_h, box_w = math.ceil(height / patch_size) * patch_size, math.ceil(width / patch_size) * patch_size
    if (
        image_span_length(*llm_grid(box_h // patch_size, box_w // patch_size, downsample_ratio))
        > max_image_tokens
    ):
        box_h, box_w = _shrink_box(height, width, patch_size, downsample_ratio, max_image_tokens)
    if box_h < patch_size or box_w < patch_size:
        raise ValueError(
            f"a {width}x{height} image plans to an empty {box_w}x{box_h} box; check the vision config"
        )
    return box_h, box_w


class DeepseekV41ImageProcessor(PilBackend):
    """PIL-backend image processor; the defaults are the released ``vision_config`` (build one for another
    config with ``from_vision_config``). Accepts PIL images of any mode and uint8 arrays."""

    resample = PILImageResampling.BICUBIC  # ImageOps.pad's default filter, as in the official code
    do_convert_rgb = True
    do_rescale = True
    rescale_factor = 1 / 255
    do_normalize = True
    image_mean = (0.5, 0.5, 0.5)
    image_std = (0.5, 0.5, 0.5)
    patch_size = 14
    downsample_ratio = 3
    max_image_tokens = 1024
    min_pixels = 295936
    max_wh_ratio = None
    valid_kwargs = DeepseekV41ImageProcessorKwargs
    model_input_names: ClassVar[list[str]] = ["pixel_values", "image_grid_hws"]

    def __init__(self, **kwargs: Unpack[DeepseekV41ImageProcessorKwargs]):
        super().__init__(**kwargs)

    @classmethod
    def from_vision_config(cls, vision_config, **kwargs):
        """Image processor matching a ``DeepseekV41VisionConfig``."""
        return cls(**{name: getattr(vision_config, name) for name in PLAN_FIELDS}, **kwargs)

    def _prepare_images_structure(self, images, expected_ndims=3):
        images = open_image_source(images)
        check_images(images)
        return super()._prepare_images_structure(images, expected_ndims=expected_ndims)

    def convert_to_rgb(self, image, **kwargs):
        # PIL's own conversion, as the official loader (RGBA drops alpha, L/P expand), see rgb_image. Arrays: base class
        # (kwargs: input_data_format, which transformers passes from 5.2x on and 5.17 neither passes nor accepts)
        if isinstance(image, Image.Image):
            return np.array(rgb_image(image))
        return super().convert_to_rgb(image, **kwargs)

    def vit_grid(self, height, width, **overrides):
        """ViT patch grid ``(n_vit_h, n_vit_w)`` of an image of this size (``overrides``: config fields)."""
        cfg = {name: overrides.get(name, getattr(self, name)) for name in PLAN_FIELDS}
        box_h, box_w = plan_image_box(width, height, **cfg)
        return box_h // cfg["patch_size"], box_w // cfg["patch_size"]

    def _preprocess(
        self,
        images,
        resample,
        do_rescale,
        rescale_factor,
        do_normalize,
        image_mean,
        image_std,
        patch_size,
        downsample_ratio,
        max_image_tokens,
        min_pixels,
        max_wh_ratio,
        return_tensors=None,
        **kwargs,
    ):
        # images: list of channels-first arrays [3, H, W] (uint8) from PilBackend.process_image
        if return_tensors not in (None, "pt"):
            raise ValueError(
                f"pixel_values are BF16 torch tensors; return_tensors={return_tensors!r} is not supported"
            )
        mean = torch.tensor(image_mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.tensor(image_std, dtype=torch.float32).view(-1, 1, 1)
        patches, grids = [], []
        for array in images:
            if array.dtype != np.uint8 or array.shape[0] != 3:
                raise ValueError(
                    f"expected an RGB uint8 image, got an array of dtype {array.dtype} and shape "
                    f"{array.shape}; pass PIL images or uint8 arrays"
                )
            image = Image.fromarray(np.ascontiguousarray(array.transpose(1, 2, 0)))
            box_h, box_w = plan_image_box(
                image.width,
                image.height,
                patch_size,
                downsample_ratio,
                max_image_tokens,
                min_pixels,
                max_wh_ratio,
            )
            if max_wh_ratio is not None and image.width >= max_wh_ratio * image.height:
                image = image.resize((box_w, box_h), resample=resample)
            else:
                image = ImageOps.pad(image, (box_w, box_h), method=resample, color=PAD_COLOR)
            x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)  # [3, H, W]
            if do_rescale:
                x = x / (1 / rescale_factor)  # divide, as the reference (x * (1/255) rounds differently)
            if do_normalize:
                x = (x - mean) / std
            n_h, n_w = box_h // patch_size, box_w // patch_size
            x = x.to(torch.bfloat16).reshape(3, n_h, patch_size, n_w, patch_size)
            patches.append(x.permute(1, 3, 0, 2, 4).reshape(n_h * n_w, 3, patch_size, patch_size))
            grids.append([n_h, n_w])
        data = {
            "pixel_values": torch.cat(patches)
            if patches
            else torch.empty(0, 3, patch_size, patch_size).bfloat16(),
            "image_grid_hws": torch.tensor(grids, dtype=torch.long).reshape(-1, 2),
        }
        return BatchFeature(data=data)


__all__ = ["DeepseekV41ImageProcessor", "check_images", "open_image_source", "plan_image_box", "rgb_image"]
