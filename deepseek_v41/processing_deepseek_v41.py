"""Processor of DeepSeek-V4.1: chat template, tokenizer and image processor, with image spans expanded by id.

Text marks each image with ``IMAGE_PLACEHOLDER`` (``<｜deepseek_image｜>``, the V4.1 code's name; the chat
template writes it for ``{"type": "image"}`` content parts). The processor splits the text at the
placeholders, tokenizes the pieces, and puts one image span in each gap::

    START, (IMAGE x n_llm_w, NEWLINE) x n_llm_h, END      every position with id image_token_id (129264)

so the span never depends on how a tokenizer spells id 129264 (the V4 tokenizer calls it ``<｜image2｜>``,
a non-special token). ``vision_token_types`` (TEXT -1, START 0, IMAGE 1, NEWLINE 2, END 3) tells the span
positions apart. The processor adds no special tokens: BOS comes from the chat template (or the text).

The chat template is a Jinja port of the DeepSeek-V4 chat format (``encoding_dsv4.py``) for ordinary
conversations: system, user and assistant messages with text and image parts, chat mode or thinking mode
(``apply_chat_template(..., thinking=True)``). Specialized formatting -- tools and DSML tool calls,
``developer``/``latest_reminder``/``tool`` roles, tasks, ``reasoning_effort``, keeping earlier reasoning --
should be rendered with the official ``encoding_dsv4.py`` encoder into a string first, then passed to the
processor as ``text`` (with ``IMAGE_PLACEHOLDER`` where images go).

``DeepseekV41Tokenizer`` is the tokenizer ``AutoTokenizer`` gives for a DeepSeek-V4.1 folder once the package is
imported: the released ``tokenizer.json`` as is, with this chat template when the folder brings none (a released
checkpoint's tokenizer files carry no template; an export's ``chat_template.jinja`` holds this same template).
"""

import json
import logging
import os
from pathlib import Path
from typing import ClassVar

from transformers import AutoProcessor, PreTrainedTokenizerFast
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import make_flat_list_of_images

# from its module: `transformers.AutoImageProcessor` is a placeholder that raises without torchvision in some 5.x
# releases (5.17 among them), and this image processor needs only PIL
from transformers.models.auto import tokenization_auto
from transformers.models.auto.image_processing_auto import AutoImageProcessor
from transformers.processing_utils import MultiModalData, ProcessingKwargs, ProcessorMixin, Unpack

from .configuration_deepseek_v41 import DeepseekV41Config
from .image_processing_deepseek_v41 import (
    PLAN_FIELDS,
    DeepseekV41ImageProcessor,
    DeepseekV41ImageProcessorKwargs,
    check_images,
    open_image_source,
)
from .vision import TEXT, image_span_length, image_span_token_types, llm_grid

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
# What save_pretrained writes and from_pretrained needs (chat_template.jinja is optional: CHAT_TEMPLATE is the default).
SAVED_FILES = ("processor_config.json", "tokenizer.json", "tokenizer_config.json")

# DeepSeek-V4 chat format: BOS{system}<｜User｜>{user}<｜Assistant｜></think>{assistant}<｜end▁of▁sentence｜>...
# Chat mode closes thinking right after <｜Assistant｜>. Thinking mode opens <think> after the LAST user turn
# and renders the answer to it as {reasoning_content}</think>{content}; earlier answers keep their content
# only (earlier reasoning is dropped). As in the official encoder, <｜Assistant｜> plus the think token
# always follow the last user turn (add_generation_prompt changes nothing), and consecutive user
# messages merge with a blank line.
CHAT_TEMPLATE = (
    "{%- if tools or documents -%}"
    "{{ raise_exception('This template covers plain conversations; render tools with the official "
    "encoding_dsv4.py and pass the string to the processor as text.') }}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '<｜begin▁of▁sentence｜>' -}}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if message['content'] is string or message['content'] is none -%}"
    "{%- set text = message['content'] or '' -%}"
    "{%- else -%}"
    "{%- set parts = namespace(text='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set parts.text = parts.text + part['text'] -%}"
    "{%- elif part['type'] == 'image' -%}{%- set parts.text = parts.text + '" + IMAGE_PLACEHOLDER + "' -%}"
    "{%- else -%}{{ raise_exception('Unsupported content part type: ' + part['type']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set text = parts.text -%}"
    "{%- endif -%}"
    "{%- if role == 'system' -%}"
    "{{- text -}}"
    "{%- elif role == 'user' -%}"
    "{%- if loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'user' -%}{{- '\n\n' + text -}}"
    "{%- else -%}{{- '<｜User｜>' + text -}}{%- endif -%}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] == 'assistant' -%}"
    "{{- '<｜Assistant｜>' -}}"
    "{%- if thinking and loop.index0 == ns.last_user -%}{{- '<think>' -}}"
    "{%- else -%}{{- '</think>' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- elif role == 'assistant' -%}"
    "{%- if message['tool_calls'] -%}"
    "{{ raise_exception('Tool calls need the official encoding_dsv4.py encoder.') }}"
    "{%- endif -%}"
    "{%- if thinking and loop.index0 > ns.last_user -%}"
    "{{- (message['reasoning_content'] or '') + '</think>' -}}"
    "{%- endif -%}"
    "{{- text + '<｜end▁of▁sentence｜>' -}}"
    "{%- else -%}"
    "{{ raise_exception('Role ' + role + ' needs the official encoding_dsv4.py encoder; this template "
    "renders system, user and assistant.') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


# the JSON files a tokenizer folder may hold (transformers reads those present)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def raise_for_unreadable_json(folder: Path, names, error: Exception, what: str) -> None:
    """After loading ``folder`` failed with ``error``: a ``ValueError`` naming the first of ``names`` present there
    that is not valid JSON (the libraries' own errors name no file); returns when all parse."""
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as bad:
            raise ValueError(f"{path} is not valid JSON (truncated or corrupted? {bad}); re-save the {what} or "
                             "re-download the file") from error


class DeepseekV41Tokenizer(PreTrainedTokenizerFast):
    """The DeepSeek-V4 byte-level BPE tokenizer (``tokenizer.json``, loaded as ``PreTrainedTokenizerFast`` does) whose
    ``from_pretrained`` falls back to ``CHAT_TEMPLATE`` when the folder has no chat template, so
    ``apply_chat_template`` and the text-generation pipeline take chat messages on a released checkpoint. A template
    the folder brings (``chat_template.jinja``, ``tokenizer_config.json``) or the caller passes wins."""

    # no __init__ of its own: transformers then loads tokenizer.json as it is (a subclass defining __init__ is
    # rebuilt from vocabulary and merges instead)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        try:
            tokenizer = super().from_pretrained(*args, **kwargs)
        except Exception as error:  # a truncated file surfaces as a bare JSONDecodeError naming no file
            if args and Path(os.fspath(args[0])).is_dir():
                raise_for_unreadable_json(Path(os.fspath(args[0])), TOKENIZER_FILES, error, "tokenizer")
            raise
        if tokenizer.chat_template is None:
            tokenizer.chat_template = CHAT_TEMPLATE
        return tokenizer


# batches are padded to the longest row unless padding=False
TEXT_DEFAULTS = {"padding": True}


class DeepseekV41ProcessorKwargs(ProcessingKwargs, total=False):
    images_kwargs: DeepseekV41ImageProcessorKwargs
    # where transformers 5.17 looks for defaults (later releases read the processor's class attributes first)
    _defaults = {"text_kwargs": TEXT_DEFAULTS}  # noqa: RUF012


class DeepseekV41Processor(ProcessorMixin):
    """Tokenizer + ``DeepseekV41ImageProcessor`` + chat template.

    ``__call__(text, images)`` returns ``input_ids``, ``attention_mask``, ``vision_token_types`` [b, s]
    (padded with the tokenizer's pad id, mask 0 and TEXT on the tokenizer's padding side) and, with images,
    ``pixel_values`` [all patches, 3, 14, 14] (BF16) and ``image_grid_hws`` [n_images, 2]; images are
    consumed in order of their placeholders, row by row."""

    valid_processor_kwargs = DeepseekV41ProcessorKwargs
    text_kwargs: ClassVar[dict] = TEXT_DEFAULTS
    image_token = IMAGE_PLACEHOLDER

    def __init__(
        self, image_processor=None, tokenizer=None, chat_template=None, image_token_id=129264, **kwargs
    ):
        self.image_token_id = image_token_id
        super().__init__(image_processor, tokenizer, chat_template=chat_template or CHAT_TEMPLATE, **kwargs)

    def __call__(self, images=None, text=None, **kwargs: Unpack[DeepseekV41ProcessorKwargs]) -> BatchFeature:
        if text is None:
            raise ValueError(
                "text is required (use IMAGE_PLACEHOLDER where images go); for images alone call "
                "processor.image_processor"
            )
        texts = [text] if isinstance(text, str) else list(text)
        if images is not None:
            images = open_image_source(images)
            check_images(images)
        images = [] if images is None else make_flat_list_of_images(images)
        n_placeholders = [t.count(self.image_token) for t in texts]
        if sum(n_placeholders) != len(images):
            raise ValueError(
                f"the text holds {sum(n_placeholders)} image placeholders {self.image_token} (per row "
                f"{n_placeholders}) but {len(images)} images were given; give one image per placeholder"
            )
        merged = self._merge_kwargs(
            DeepseekV41ProcessorKwargs, tokenizer_init_kwargs=self.tokenizer.init_kwargs, **kwargs
        )
        text_kwargs, images_kwargs = merged["text_kwargs"], merged["images_kwargs"]
        return_tensors = text_kwargs.get("return_tensors")
        if text_kwargs.get("truncation") or text_kwargs.get("return_offsets_mapping"):
            raise ValueError(
                "truncation and offset mappings are not supported: they would cut or misplace image "
                "spans; shorten conversations before processing"
            )

        data = {}
        llm_grids = []
        if images:
            data.update(self.image_processor(images, **images_kwargs))
            ratio = images_kwargs.get("downsample_ratio") or self.image_processor.downsample_ratio
            llm_grids = [llm_grid(h, w, ratio) for h, w in data["image_grid_hws"].tolist()]

        # Tokenize the text between placeholders (one batched call), then put a span in each gap.
        pieces = [t.split(self.image_token) for t in texts]
        piece_ids = iter(
            self.tokenizer([p for row in pieces for p in row], add_special_tokens=False)["input_ids"]
        )
        grids = iter(llm_grids)
        rows_ids, rows_types = [], []
        for row in pieces:
            ids, types = [], []
            for k in range(len(row)):
                if k:
                    span_types = image_span_token_types(*next(grids))
                    ids += [self.image_token_id] * len(span_types)
                    types += span_types
                piece = next(piece_ids)
                if self.image_token_id in piece:
                    raise ValueError(
                        f"the text contains token id {self.image_token_id} "
                        f"({self.tokenizer.convert_ids_to_tokens(self.image_token_id)!r}) outside an image "
                        f"placeholder; that id is reserved for image spans, write {self.image_token} instead"
                    )
                ids += piece
                types += [TEXT] * len(piece)
            rows_ids.append(ids)
            rows_types.append(types)
        data.update(self._pad(rows_ids, rows_types, text_kwargs))
        return BatchFeature(data=data, tensor_type=return_tensors)

    def _pad(self, rows_ids, rows_types, text_kwargs):
        """Pad rows of ids/types to a common length (``padding`` True/'longest'/'max_length'/False)."""
        padding = text_kwargs.get("padding")
        lengths = [len(r) for r in rows_ids]
        if padding in (True, "longest"):
            target = max(lengths)
        elif padding == "max_length":
            target = text_kwargs.get("max_length") or max(lengths)
            if target < max(lengths):
                raise ValueError(
                    f"max_length={target} is shorter than the longest row ({max(lengths)} tokens)"
                )
        elif padding in (False, None, "do_not_pad"):
            target = None
        else:
            raise ValueError(f"padding={padding!r}; use True/'longest', 'max_length' or False")
        if target is not None and (multiple := text_kwargs.get("pad_to_multiple_of")):
            target = -(-target // multiple) * multiple
        out = {"input_ids": [], "attention_mask": [], "vision_token_types": []}
        side = text_kwargs.get("padding_side") or self.tokenizer.padding_side
        for ids, types in zip(rows_ids, rows_types):
            n_pad = 0 if target is None else target - len(ids)
            if n_pad and self.tokenizer.pad_token_id is None:
                raise ValueError(
                    "the tokenizer has no pad token; set tokenizer.pad_token or pass padding=False"
                )
            pads = ([self.tokenizer.pad_token_id] * n_pad, [0] * n_pad, [TEXT] * n_pad)
            rows = (ids, [1] * len(ids), types)
            for key, row, pad in zip(out, rows, pads):
                out[key].append(pad + row if side == "left" else row + pad)
        return out

    def _get_num_multimodal_tokens(self, image_sizes=None, **kwargs):
        """Span length and patch count per image size ``(height, width)`` (for serving engines)."""
        if image_sizes is None:
            return MultiModalData()
        images_kwargs = self._merge_kwargs(DeepseekV41ProcessorKwargs, **kwargs)["images_kwargs"]
        plan = {name: images_kwargs[name] for name in PLAN_FIELDS if name in images_kwargs}
        ratio = plan.get("downsample_ratio") or self.image_processor.downsample_ratio
        grids = [self.image_processor.vit_grid(h, w, **plan) for h, w in image_sizes]
        return MultiModalData(
            num_image_tokens=[image_span_length(*llm_grid(h, w, ratio)) for h, w in grids],
            num_image_patches=[h * w for h, w in grids],
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """A saved processor folder as usual; a released checkpoint snapshot (``config.json`` + ``tokenizer.json``,
        no ``processor_config.json``) gets a processor built from its vision config and tokenizer."""
        folder = Path(os.fspath(pretrained_model_name_or_path))
        if not folder.is_dir():  # a hub name
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        released = not (folder / "processor_config.json").is_file() and (folder / "config.json").is_file()
        needed = ("config.json", "tokenizer.json") if released else SAVED_FILES
        missing = [name for name in needed if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{folder} lacks {', '.join(missing)}: a saved processor folder holds {', '.join(SAVED_FILES)} "
                "(processor.save_pretrained writes them), a released checkpoint config.json and tokenizer.json"
            )
        try:
            if released:
                return cls.from_checkpoint(folder)
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except Exception as error:  # tokenizers raises a bare Exception for a broken tokenizer.json
            raise_for_unreadable_json(folder, needed, error, "processor")
            raise

    @classmethod
    def from_checkpoint(cls, folder):
        """The processor of a released-format checkpoint folder: its vision config, tokenizer and image id."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        config = DeepseekV41Config.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        image_processor = DeepseekV41ImageProcessor.from_vision_config(config.vision_config)
        return cls(image_processor, tokenizer, image_token_id=config.image_token_id)

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "vision_token_types", "pixel_values", "image_grid_hws"]


def register_tokenizer():
    """Make ``AutoTokenizer`` give ``DeepseekV41Tokenizer`` for a folder whose config is DeepSeek-V4.1, also when its
    ``tokenizer_config.json`` names a generic class (the release names ``PreTrainedTokenizerFast``).

    ``AutoTokenizer.register`` alone is not enough there: a ``tokenizer_class`` in ``tokenizer_config.json`` wins over
    the model type's registered class, except for the model types transformers lists in
    ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` (e.g. phi3, llava), whose class comes from
    ``TOKENIZER_MAPPING_NAMES`` by name; the model type joins both (transformers 5.17 to 5.25 route this way)."""
    auto_tokenizer = tokenization_auto.AutoTokenizer
    auto_tokenizer.register(DeepseekV41Config, tokenizer_class=DeepseekV41Tokenizer, exist_ok=True)
    names = getattr(tokenization_auto, "TOKENIZER_MAPPING_NAMES", None)
    overridden = getattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", None)
    if not isinstance(names, dict) or not isinstance(overridden, set):
        logger.warning(
            "this transformers release routes tokenizer classes differently: AutoTokenizer on a released DeepSeek-V4.1 "
            "folder gives a tokenizer without the chat template; load it with DeepseekV41Tokenizer.from_pretrained "
            "or AutoProcessor, or pass chat_template=deepseek_v41.processing_deepseek_v41.CHAT_TEMPLATE"
        )
        return
    names[DeepseekV41Config.model_type] = DeepseekV41Tokenizer.__name__
    overridden.add(DeepseekV41Config.model_type)


def register_processors():
    """Make ``AutoImageProcessor``/``AutoProcessor`` find these classes locally, and have ``save_pretrained``
    copy their code and write ``auto_map`` (for ``trust_remote_code=True`` without this package)."""
    AutoImageProcessor.register(
        DeepseekV41Config, image_processor_classes={"pil": DeepseekV41ImageProcessor}, exist_ok=True
    )
    AutoProcessor.register(DeepseekV41Config, DeepseekV41Processor, exist_ok=True)
    DeepseekV41ImageProcessor.register_for_auto_class("AutoImageProcessor")
    DeepseekV41Processor.register_for_auto_class("AutoProcessor")


__all__ = [
    "IMAGE_PLACEHOLDER",
    "DeepseekV41Processor",
    "DeepseekV41Tokenizer",
    "register_processors",
    "register_tokenizer",
]
