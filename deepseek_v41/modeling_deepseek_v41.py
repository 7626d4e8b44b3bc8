"""DeepSeek-V4.1-Flash: token embedding → 4 mHC streams → 40 CSA2 + MoE blocks (Engram before layers 1 and 14)
→ collapse → final norm → fp32 head.

Parameter names are the released checkpoint's (``embed.weight``, ``layers.{i}.attn.wq_a.weight``,
``layers.{i}.hc_attn_fn``, ``head.weight``, …) except the routed experts, stacked per layer
(``layers.{i}.ffn.experts.w1`` [E, inter, dim]); ``checkpoint.py`` maps them to and from
``layers.{i}.ffn.experts.{e}.w1.weight``.
"""

import contextlib
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .attention import Attention, CSA2State, check_attention_memory
from .backends import check_available
from .cache_deepseek_v41 import DeepseekV41Cache, DeepseekV41StaticCache
from .configuration_deepseek_v41 import DeepseekV41Config, check_config_values
from .dspark import build_stages, dspark_stage_count
from .dspark_loss import check_dspark_training, dspark_batch_loss, dspark_loss_weight
from .engram import Engram, engram_constants, resolve_engram_tokenizer
from .engram_host import HOST, prefetch_engram_rows, stored_table_tensors, tables_left_out
from .kept import KeptTensor, is_kept, keep_release_formats
from .layers import (
    FrozenLinear,
    RMSNorm,
    bf16_copy_if_exact,
    is_plain_linear,
    make_head_loss,
    make_head_matmul,
    make_rms_norm,
)
from .mhc import mhc_ops
from .moe import MoE, RoutedExperts, Router

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # a label that counts for nothing (padding, prompt tokens)
# prepare_inputs_for_generation marks generate's decode steps with this keyword: their token and mask come from
# generate itself, so forward leaves out the value checks (and their host sync)
GENERATE_DECODE_STEP = "_generate_decode_step"

# What an exported folder's config.json maps the Auto classes to (the flat remote-code files). The causal LM is also
# the image-text-to-text model (it embeds images itself), as the package registers it locally.
AUTO_MAP = {
    "AutoConfig": "configuration_deepseek_v41.DeepseekV41Config",
    "AutoModel": "modeling_deepseek_v41.DeepseekV41Model",
    "AutoModelForCausalLM": "modeling_deepseek_v41.DeepseekV41ForCausalLM",
    "AutoModelForImageTextToText": "modeling_deepseek_v41.DeepseekV41ForCausalLM",
}


class StreamMeans:
    """What a forward's DSpark target blocks append their stream means to (``append``, then iterated in layer order).
    Not a list: module hooks that rebuild a block's list and dataclass inputs around their tensors (FSDP2's
    post-backward hook) would hand the next block a copy."""

    def __init__(self):
        self.means = []

    def append(self, mean: torch.Tensor) -> None:
        self.means.append(mean)

    def __iter__(self):
        return iter(self.means)


class DeepseekV41Block(GradientCheckpointingLayer):
    """One layer: [Engram] → attention sublayer → MoE sublayer, each wrapped by an mHC mix.

    V4.1's delayed pre-mix: the attention input collapses the streams with the pre-mix handed in by the
    previous block (``pre_in``), the FFN input with this block's attention-mix ``pre``, and the FFN-mix
    ``pre`` is handed on to the next block.
    """

    def __init__(self, config, layer: int, backend: dict, has_image_bias: bool, engram: Engram | None):
        super().__init__()
        self.layer = layer
        self.hc = config.hc_mult
        self.sinkhorn_iters, self.hc_eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        n_mix, width = (2 + self.hc) * self.hc, self.hc * config.hidden_size
        for sub in ("attn", "ffn"):  # fp32 islands: the mix coefficients never round to bf16
            setattr(self, f"hc_{sub}_fn", nn.Parameter(torch.empty(n_mix, width, dtype=torch.float32)))
            setattr(self, f"hc_{sub}_base", nn.Parameter(torch.empty(n_mix, dtype=torch.float32)))
            setattr(self, f"hc_{sub}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))
        self.engram = engram
        self.attn_norm = make_rms_norm(config.hidden_size, config.rms_norm_eps, backend)
        self.attn = Attention(config, layer, backend)
        self.ffn_norm = make_rms_norm(config.hidden_size, config.rms_norm_eps, backend)
        self.ffn = MoE(config, backend, has_image_bias)
        self.hc_mix_pre, _, self.hc_post = mhc_ops(backend)  # backend "mhc": torch or tile_kernels

    def mix_pre(self, x, sub: str, pre_in):
        # -> (pre, post, comb) of sublayer `sub`'s mix and its input: the streams collapsed with pre_in
        return self.hc_mix_pre(
            x, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_base"), getattr(self, f"hc_{sub}_scale"),
            pre_in, self.hc, self.sinkhorn_iters, self.hc_eps, self.norm_eps,
        )

    def forward(self, x, pre_in, state: CSA2State, input_ids=None, image_mask=None, engram_hash_ids=None,
                stream_means=None):
        # x [b, s, hc, dim] streams, pre_in fp32 [b, s, hc] -> (streams [b, s, hc, dim], pre-mix fp32 [b, s, hc]).
        # stream_means (a list): gets the block input's mean over the streams [b, s, dim] (a DSpark target layer)
        if self.engram is not None:
            hash_ids = engram_hash_ids if engram_hash_ids is not None else self.engram.hash(input_ids, image_mask)
            x = self.engram(x, hash_ids, image_mask)
        if stream_means is not None:
            stream_means.append(x.float().mean(2).to(x.dtype))
        attn_pre, attn_post, attn_comb, h = self.mix_pre(x, "attn", pre_in)
        y = self.attn(self.attn_norm(h), state)
        x = self.hc_post(y, x, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb, u = self.mix_pre(x, "ffn", attn_pre)
        u = self.ffn_norm(u)  # [b, s, dim]; the MoE works on the flat token list
        y = self.ffn(u.flatten(0, 1), None if image_mask is None else image_mask.flatten()).view_as(u)
        x = self.hc_post(y, x, ffn_post, ffn_comb)
        return x, ffn_pre


class DeepseekV41PreTrainedModel(PreTrainedModel):
    config_class = DeepseekV41Config
    base_model_prefix = "model"
    _no_split_modules = ["DeepseekV41Block"]
    supports_gradient_checkpointing = True
    input_modalities = ("image", "text")
    _supports_sdpa = False
    _input_embed_layer = "embed"
    # fp32 islands (architecture.md §4, §7, §8): loaded, kept and trained in fp32 whatever the model dtype.
    _keep_in_fp32_modules_strict = [
        "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
        "attn_sink", "gate.bias", "gate.bias_vl", "head", "norm1", "norm2", "vision.norm", "confidence_head",
    ]

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.text_config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding, FrozenLinear)):
            init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, Router):
            init.normal_(module.weight, std=std)
        elif isinstance(module, RoutedExperts):
            for weight in (module.w1, module.w2, module.w3):
                init.normal_(weight, std=std)
        elif isinstance(module, DeepseekV41Block):
            for sub in ("attn", "ffn"):
                init.normal_(getattr(module, f"hc_{sub}_fn"), std=std)
                init.zeros_(getattr(module, f"hc_{sub}_base"))
                init.ones_(getattr(module, f"hc_{sub}_scale"))
        elif isinstance(module, Attention):
            init.zeros_(module.attn_sink)
        elif isinstance(module, Engram):
            init.ones_(module.q_weight)
            init.ones_(module.k_weight)
        elif hasattr(module, "image_newline"):
            for name in ("image_start", "image_end", "image_newline"):
                init.normal_(getattr(module, name), std=std)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **options):
        """Per-block activation checkpointing, always non-reentrant: the CSA2 state that Full layers publish to
        later layers must stay on the autograd graph (reentrant checkpointing would cut the compressor off).
        ``options`` are transformers' (``every_n_layers``, ``offload``); ``activation_checkpointing_enable``
        (what the Trainer calls) comes here too."""
        kwargs = dict(gradient_checkpointing_kwargs or {})
        if kwargs.get("use_reentrant"):
            raise ValueError(
                "use_reentrant=True would drop the gradients that reach the compressors through the shared CSA2 "
                "state; use the default non-reentrant checkpointing"
            )
        kwargs["use_reentrant"] = False
        if hasattr(PreTrainedModel, "_activation_checkpointing_enable"):  # transformers >= 5.2x
            self._activation_checkpointing_enable(kwargs, **options)
        else:
            super().gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **options)

    def get_output_embeddings(self):
        return getattr(self, "head", None)

    def set_output_embeddings(self, new_embeddings):
        self.head = new_embeddings

    def _apply(self, fn, recurse=True):
        # A cast to bf16 / fp16 (model.to(dtype), .half(), .bfloat16(), also through a wrapper such as PEFT's, whose
        # cast reaches this model here) leaves the fp32 islands fp32, as loading with dtype= does: they only follow
        # the cast's device.  An empty probe tells a cast from other tensor functions (moves, to_empty, ...).
        self._decode_graph_epoch = getattr(self, "_decode_graph_epoch", 0) + 1  # captured decode graphs are stale
        self._head_bf16 = None  # and so is the head's bf16 copy (head_logits)
        if fn(torch.empty(0)).dtype not in (torch.bfloat16, torch.float16):
            return super()._apply(fn, recurse)
        islands = {id(t) for t in fp32_island_tensors(self)}

        def cast(t):
            return t.to(device=fn(t.new_empty(0)).device) if id(t) in islands else fn(t)

        return super()._apply(cast, recurse)

    def to_empty(self, *, device, recurse: bool = True):
        # Non-persistent derived buffers (Engram hash constants) are garbage after to_empty: restore them.
        super().to_empty(device=device, recurse=recurse)
        for module in self.modules():
            if isinstance(module, Engram):
                module.restore_derived_buffers()
        return self

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path=None, *model_args, config=None, dtype="auto", backend=None, tokenizer=None,
        device=None, device_map=None, max_memory=None, revision=None, cache_dir=None, local_files_only=False,
        token=None, force_download=False, subfolder="", use_safetensors=None, low_cpu_mem_usage=None,
        dequantize_base_checkpoint=None, adapter_kwargs=None, verify_checksums=None, engram_device=None, **kwargs,
    ):
        """Load a released-format (FP8/FP4) or floating-point checkpoint.

        Builds the model on the meta device, materializes it on ``device`` / ``device_map`` and streams the
        shards straight into the parameters (always: ``low_cpu_mem_usage`` is accepted and changes nothing).
        ``dequantize_base_checkpoint``: as transformers does for a checkpoint that carries a
        ``quantization_config``, the released formats are kept by default (``None``, or ``False``): FP8 linears and
        FP4 routed experts hold the snapshot's codes and scales (``kept.py``; FP8/FP4 GEMMs on sm_89+ GPUs, a
        tile-by-tile decoding fallback elsewhere), for inference only. ``True`` decodes every weight exactly to
        ``dtype`` (needed to train or fine-tune, and by the fp32 parity checks). A floating-point checkpoint loads
        as it is either way.
        ``backend={"rms_norm": "torch", ...}`` overrides kernel backends (merged with the config's);
        ``tokenizer`` supplies Engram's tokenizer (default: the checkpoint folder's); ``dtype`` defaults to the
        config's.  ``device_map``: a device (``"cpu"``, ``"cuda:0"``, 0), ``"auto"`` / ``"balanced"`` /
        ``"sequential"`` (accelerate's planner, whole blocks per device, ``max_memory`` honoured) or a dict
        {module name: device} covering the model without splitting a block; blocks on several devices run one
        after the other (pipelined inference, no overlap).  A Hub repo id is downloaded with ``revision``,
        ``cache_dir``, ``local_files_only``, ``token``, ``force_download``.  ``verify_checksums`` (default: on,
        or ``DEEPSEEK_V41_VERIFY_CHECKSUMS``): an export of ours records each shard's checksum in its index, and
        a shard whose bytes changed is refused, named, before a tensor is read from it; ``False`` skips the reads.
        ``engram_device="cpu"`` (sets ``text_config.engram_device``): the Engram tables stay in host memory whatever
        ``device`` / ``device_map`` place, and each forward copies only the rows it needs to the GPU, overlapped
        with the first blocks (``engram_host.py``); ``None`` keeps the config's (default: tables with their block).
        """
        from .checkpoint import ReleasedCheckpoint, load_checkpoint_into_model

        if kwargs.get("quantization_config") is not None:
            raise NotImplementedError(
                "quantization_config= is not supported: a released snapshot's FP8/FP4 weights are kept as stored "
                "(the default) or decoded to floating point with dequantize_base_checkpoint=True"
            )
        for unsupported in ("tp_plan", "tp_size", "device_mesh", "pp_plan", "distributed_config", "proxies",
                            "offload_folder", "offload_state_dict"):
            if kwargs.get(unsupported) is not None:
                raise NotImplementedError(
                    f"{unsupported}= is not supported: deepseek_v41 trains with FSDP2 + expert parallelism "
                    "(examples/finetune.py); tensor/pipeline/context parallelism, weight offloading and per-call "
                    "proxies (set HTTPS_PROXY) are out of scope"
                )
            kwargs.pop(unsupported, None)
        if use_safetensors is False:
            raise ValueError("use_safetensors=False: deepseek_v41 checkpoints are read from safetensors files only")
        if device is not None and device_map is not None:
            raise ValueError(f"give device={device!r} or device_map={device_map!r}, not both")
        dtype = kwargs.pop("torch_dtype", dtype)
        for auto_class_only in ("trust_remote_code", "_from_auto", "_from_pipeline", "code_revision"):
            kwargs.pop(auto_class_only, None)
        path = resolve_checkpoint_dir(
            pretrained_model_name_or_path, revision, cache_dir=cache_dir, local_files_only=local_files_only,
            token=token, force_download=force_download,
        )
        path = path / subfolder if subfolder else path
        if config is None:
            config, kwargs = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **kwargs)
        if kwargs:
            raise TypeError(
                f"from_pretrained got unexpected keyword arguments {sorted(kwargs)}: they are neither loading options "
                "(dtype, device, device_map, max_memory, backend, tokenizer, revision, cache_dir, local_files_only, "
                "token, force_download, subfolder, use_safetensors, low_cpu_mem_usage, dequantize_base_checkpoint, "
                "verify_checksums, engram_device) "
                "nor config fields"
            )
        config._name_or_path = str(path)
        config._commit_hash = revision_of(path) or getattr(config, "_commit_hash", None)
        if backend:
            config.backend = {**config.backend, **backend}
        if dequantize_base_checkpoint is not None:
            config.dequantize_base_checkpoint = dequantize_base_checkpoint
        if engram_device is not None:
            config.text_config.engram_device = engram_device
            check_config_values(config.text_config)
        dtype = resolve_dtype(dtype, config)
        checkpoint = ReleasedCheckpoint(path, verify_checksums=verify_checksums)
        keep = checkpoint.is_quantized and config.dequantize_base_checkpoint is not True
        with torch.device("meta"), default_dtype(dtype):
            model = cls(config, *model_args, tokenizer=tokenizer)
        if keep:  # before anything is allocated: no floating-point copy of a kept weight ever exists
            keep_release_formats(model, checkpoint)
        placement = resolve_device_map(model, device if device_map is None else device_map, dtype, max_memory)
        materialize(model, placement)
        # The backbone (AutoModel) loads a causal-LM checkpoint without its head; nothing else may be left over.
        report = load_checkpoint_into_model(model, checkpoint, strict=cls._with_head,
                                            dequantize_base_checkpoint=not keep)
        leftover = sorted(set(report.unexpected) - {"head.weight"}) + sorted(report.missing)
        if leftover:
            raise ValueError(f"checkpoint {path} does not match {cls.__name__}: missing/unexpected {leftover[:10]}")
        if device_map is not None:  # transformers' record of the placement (Trainer reads it)
            model.hf_device_map = {name: str(dev) for name, dev in placement.items()}
        if (path / "generation_config.json").is_file():  # else the defaults built from the config's bos / eos / pad
            model.generation_config = GenerationConfig.from_pretrained(path)
        if (adapter_kwargs or {}).get("_adapter_model_path"):  # the Auto classes found a PEFT adapter folder
            adapter_kwargs = dict(adapter_kwargs)
            model.load_adapter(adapter_kwargs.pop("_adapter_model_path"), **adapter_kwargs)
        model.eval()
        return model

    def save_pretrained(self, save_directory, is_main_process=True, state_dict=None, push_to_hub=False,
                        max_shard_size="5GB", safe_serialization=True, quantize=None, variant=None, token=None,
                        save_peft_format=True, save_original_format=True, distributed_checkpoint=False, **kwargs):
        """Export a Hugging Face folder: released tensor names, remote-code files with ``auto_map``, tokenizer,
        processor and generation files; streamed shard by shard into a new folder that then takes ``save_directory``'s place
        (only an empty folder or a previous export is replaced).

        ``quantize=None`` keeps the weights as held (fp32 islands stay fp32); ``quantize="release"`` re-encodes
        them to the released FP8/FP4/Engram format with its ``quantization_config`` (served unchanged by the
        official code, vLLM and SGLang). A model loaded with its formats kept writes the released format: its
        FP8/FP4 codes and scales byte for byte as loaded, with the snapshot's ``quantization_config``. ``state_dict`` (e.g. from transformers' Trainer) is written instead of
        the model's own tensors. ``save_peft_format`` / ``save_original_format`` change nothing here: the
        model's names already are the original checkpoint's.
        """
        from .hf_export import export_config, local_source, write_export

        if kwargs:
            raise TypeError(f"save_pretrained got unexpected keyword arguments {sorted(kwargs)}")
        if push_to_hub:
            raise NotImplementedError("push_to_hub is not supported: save locally, then upload the folder "
                                      "(huggingface_hub.upload_folder)")
        if token is not None:
            raise ValueError("token= is only used to push to the Hub, which save_pretrained does not do")
        if not safe_serialization:
            raise ValueError("safe_serialization=False: only safetensors checkpoints are written; "
                             "drop the argument (pickle .bin files are not supported)")
        if variant is not None:
            raise ValueError(f"variant={variant!r}: weight variants are not supported; save into another folder")
        if distributed_checkpoint:
            raise ValueError("distributed_checkpoint=True is not supported here: a sharded training run exports "
                             "with checkpoint.export_dir (deepseek_v41.training.export), shard by shard")
        if not is_main_process:
            return
        own = self.state_dict()
        if state_dict is None:
            state_dict = own
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise ValueError(f"state_dict holds {unknown[:5]} ({len(unknown)} in all), which {type(self).__name__} "
                             "has no tensor for: pass this model's state_dict() names")
        missing = sorted(set(own) - set(state_dict))
        if missing:
            logger.warning("save_pretrained: state_dict lacks %d of the model's tensors (%s...); the folder will "
                           "not load without them", len(missing), missing[:3])
        kept = is_kept(self)
        if kept:  # held in the released format: kept codes as they are, the rest as the release stores it
            quantize = "release"
        config = export_config(self.config.to_dict(), architectures=[type(self).__name__],
                               dtype=self.embed.weight.dtype, auto_map=AUTO_MAP, quantize=quantize)
        if kept and getattr(self.config, "quantization_config", None) is not None:
            config["quantization_config"] = dict(self.config.quantization_config)  # the snapshot's, unchanged
        with tempfile.TemporaryDirectory() as scratch:  # Engram's tokenizer and the processor travel along
            files = remote_code_files() + support_files(self.config, self.engram_tokenizer, Path(scratch),
                                                        getattr(self, "generation_config", None))
            write_export([local_source(n, t) for n, t in state_dict.items()], save_directory, config, files,
                         quantize=quantize, max_shard_bytes=parse_size(max_shard_size))


class DeepseekV41Model(DeepseekV41PreTrainedModel):
    """The backbone: returns the final normed hidden state (the head's input)."""

    _with_head = False

    def __init__(self, config: DeepseekV41Config, tokenizer=None):
        super().__init__(config)
        check_available(config.backend)
        text, vision = config.text_config, config.vision_config
        self.hc = text.hc_mult
        self.max_positions = text.max_position_embeddings
        self.training_max_positions = text.rope_scaling["original_max_position_embeddings"]
        self.image_token_id = config.image_token_id
        self.has_vision = vision.num_hidden_layers > 0
        self.engram_tokenizer = None
        constants = {}
        if text.engram_layer_ids:
            self.engram_tokenizer = resolve_engram_tokenizer(config, tokenizer)
            with torch.device("cpu"):  # derived on the host even inside a meta-device context
                constants = engram_constants(text, self.engram_tokenizer)
        self.embed = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList()
        for i in range(text.num_hidden_layers):
            engram = None
            if i in text.engram_layer_ids:
                k = text.engram_layer_ids.index(i)
                engram = Engram(text, i, text.engram_num_embeddings[k], constants[i], config.backend)
            self.layers.append(DeepseekV41Block(text, i, config.backend, self.has_vision, engram))
        self.norm = make_rms_norm(text.hidden_size, text.rms_norm_eps, config.backend)
        self.hc_collapse = mhc_ops(config.backend)[1]  # the final hc_pre
        if self.has_vision:
            from .vision import DeepseekV41VisionAligner, DeepseekV41VisionTransformer

            self.vision = DeepseekV41VisionTransformer(vision)
            self.aligner = DeepseekV41VisionAligner(vision, text.hidden_size)
            for name in ("image_start", "image_end", "image_newline"):
                setattr(self, name, nn.Parameter(torch.empty(text.hidden_size)))
        if self._with_head:  # the fp32 head (an fp32 island; held and computed in fp32)
            self.head = nn.Linear(text.hidden_size, text.vocab_size, bias=False, dtype=torch.float32)
            self.head_matmul = make_head_matmul(config.backend)  # backend "head": fp32 or bf16x3
            self.head_loss = make_head_loss(config.backend)  # bf16x3: the loss fused into the head, else None
            if dspark_stage_count(text):  # the DSpark draft stages mtp.{k} (dspark.py); they share embed and head
                self.mtp = build_stages(text, config.backend, DeepseekV41Block, self.has_vision)
        self.post_init()
        for module in self.modules():  # hard top-k: the indexer gets no LM gradient, so it is frozen
            if hasattr(module, "indexer"):
                module.indexer.requires_grad_(False)
            if isinstance(module, RoutedExperts):  # load_state_dict also takes the released per-expert names
                module.register_load_state_dict_pre_hook(stack_released_experts)

    def forward(
        self, input_ids=None, attention_mask=None, position_ids=None, pixel_values=None, image_grid_hws=None,
        vision_token_types=None, engram_hash_ids=None, use_cache=None, past_key_values=None, inputs_embeds=None,
        cache=None, output_hidden_states=None, output_attentions=None, return_dict=None, output_dspark_hidden=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        # input_ids [b, s] (right or left padded) -> last_hidden_state [b, s, dim]; use_cache=True (or a cache
        # given as past_key_values= / cache=) returns the DeepseekV41Cache that decodes the next tokens.  With
        # output_hidden_states also hidden_states: the embeddings, then after each block but the last its streams
        # collapsed with the pre-mix the next block's attention uses (its input before the norm), then
        # last_hidden_state: n_layers + 1 x [b, s, dim].  output_dspark_hidden: also dspark_hidden [b, s,
        # targets·dim], the DSpark stages' input (each dspark_target_layer_ids block's input, mean over the streams)
        if output_attentions:
            raise NotImplementedError(
                "output_attentions=True: CSA2 sparse attention never forms a dense attention matrix (each query "
                "attends to its sliding window and top-k compressed entries); call with output_attentions=False"
            )
        cache = past_key_values if cache is None else cache  # transformers >= 5.2x calls it `cache`
        from_generate = kwargs.pop(GENERATE_DECODE_STEP, False)
        validate_inputs(self, input_ids, attention_mask, position_ids, use_cache, cache, inputs_embeds, kwargs,
                        check_values=not from_generate)
        input_ids = input_ids.to(self.embed.weight.device)
        targets = self.dspark_targets(output_dspark_hidden)
        if cache is not None and cache.get_seq_length() > 0:
            if pixel_values is not None or (vision_token_types is not None and (vision_token_types >= 0).any()):
                raise ValueError("images go in the prompt (the first forward of a cache); decode steps are text")
            cache.check_room(input_ids.shape[1])
            # targets: the DSpark stages' input too (the target layers' stream means; a verification forward)
            hidden, logits, dspark_hidden = self._decode_columns(input_ids, cache, not output_hidden_states,
                                                                 bool(targets))
            if logits is None and not targets:
                return with_cache(BaseModelOutputWithPast, cache, last_hidden_state=hidden)
            if logits is None:
                return with_cache(DeepseekV41ModelOutput, cache, last_hidden_state=hidden, dspark_hidden=dspark_hidden)
            return with_cache(DeepseekV41DecodeOutput, cache, last_hidden_state=hidden, logits=logits,
                              dspark_hidden=dspark_hidden)
        if use_cache and cache is None:
            cache = DeepseekV41Cache(self.config)
        if cache is not None:
            cache.begin_prefill(*input_ids.shape)
        check_attention_memory(self, input_ids.shape[0], input_ids.shape[1])
        lengths, shift = real_lengths(attention_mask, input_ids)
        if shift is not None:  # left padding: rows run left-aligned (CSA2 groups, Engram n-grams start at token 0)
            if engram_hash_ids is not None:
                raise ValueError("engram_hash_ids cannot be given with left padding: they would hash the padding")
            input_ids = roll_rows(input_ids, shift)
            vision_token_types = None if vision_token_types is None else roll_rows(vision_token_types, shift)
        h = self.embed(input_ids)  # [b, s, dim]
        image_mask = None
        if vision_token_types is not None:
            if vision_token_types.shape != input_ids.shape:
                raise ValueError(
                    f"vision_token_types has shape {tuple(vision_token_types.shape)} but input_ids has "
                    f"{tuple(input_ids.shape)}: give one token type per position (TEXT = -1)"
                )
            image_mask = vision_token_types >= 0  # delimiters included: bias_vl routing, Engram gate closed
        if pixel_values is not None or (image_mask is not None and image_mask.any()):
            h = self.embed_images(h, input_ids, pixel_values, image_grid_hws, vision_token_types)
        b, s = input_ids.shape
        x = h.unsqueeze(2).expand(b, s, self.hc, h.shape[-1]).contiguous()  # [b, s, hc, dim]
        pre = torch.zeros(b, s, self.hc, dtype=torch.float32, device=h.device)
        pre[..., 0] = 1.0  # block 0 collapses with a one-hot pre-mix on stream 0
        state = CSA2State(cache, lengths if cache is not None else None)
        hidden_states = [h] if output_hidden_states else None
        means = StreamMeans()  # the DSpark target layers' stream means, in layer order
        engram_hash_ids = prefetch_engram_rows(  # host-memory tables: their rows start now, under the first blocks
            self.layers, input_ids, image_mask,
            {i.layer: engram_hash_ids_for(engram_hash_ids, i, self.config.text_config) for i in self.layers},
        )
        for layer in self.layers:
            hash_ids = engram_hash_ids_for(engram_hash_ids, layer, self.config.text_config)
            if layer.hc_attn_fn.device != x.device:  # device_map spread the blocks over devices
                device = layer.hc_attn_fn.device
                x, pre, input_ids, image_mask, hash_ids = (
                    None if t is None else t.to(device) for t in (x, pre, input_ids, image_mask, hash_ids)
                )
                state.to(device)
            x, pre = layer(x, pre, state, input_ids=input_ids, image_mask=image_mask, engram_hash_ids=hash_ids,
                           stream_means=means if layer.layer in targets else None)
            if output_hidden_states and layer is not self.layers[-1]:
                hidden_states.append(self.hc_collapse(x, pre))
        device = self.norm.weight.device
        hidden = self.norm(self.hc_collapse(x.to(device), pre.to(device)))
        if cache is not None:
            cache.finish_prefill(input_ids, image_mask, lengths, s)
        if hidden_states is not None:
            hidden_states = (*hidden_states, hidden)
        dspark_hidden = torch.cat([m.to(device) for m in means], -1) if targets else None
        if shift is not None:  # back to the input's columns
            hidden = roll_rows(hidden, -shift)
            hidden_states = None if hidden_states is None else tuple(roll_rows(t, -shift) for t in hidden_states)
            dspark_hidden = None if dspark_hidden is None else roll_rows(dspark_hidden, -shift)
        output = with_cache(DeepseekV41ModelOutput, cache, last_hidden_state=hidden, hidden_states=hidden_states,
                            dspark_hidden=dspark_hidden)
        return output.to_tuple() if return_dict is False else output

    def dspark_targets(self, output_dspark_hidden) -> tuple:
        """The layers whose stream means a forward collects: the DSpark targets when asked for, else none."""
        if not output_dspark_hidden:
            return ()
        if not hasattr(self, "mtp"):
            raise ValueError("output_dspark_hidden=True needs the DSpark draft stages: this model has none "
                             "(num_nextn_predict_layers or dspark_block_size is 0, or it is the headless backbone)")
        return tuple(self.config.text_config.dspark_target_layer_ids)

    # Whether a decode forward of several new columns per row (a speculative block's verification) runs them as one
    # multi-token step (True, where the cache's rings have room: ``step_width``) or one column at a time
    decode_at_once = True

    def decode_widths(self, cache: DeepseekV41Cache, columns: int) -> list:
        """How a decode forward of ``columns`` new columns per row is split into steps: steps of as many columns
        as the cache can take at once (``cache.step_width()``: a prompt continued in chunks goes a chunk per step
        when its cache has that room and the step's attention slots fit), else one per column."""
        width = cache.step_width() if self.decode_at_once else 1
        if 1 < columns <= width:
            return [columns]
        return [width] * (columns // width) + ([columns % width] if columns % width else [])

    def decode(self, input_ids: torch.Tensor, cache: DeepseekV41Cache, targets=()):
        """input_ids [b, n] text tokens after the cached ones -> (hidden [b, n, dim], the DSpark input [b, n, ·] of
        ``targets`` or None), in the steps of ``decode_widths``."""
        hidden, means, start = [], [], 0
        for width in self.decode_widths(cache, input_ids.shape[1]):
            step, _ = self._decode_body(input_ids[:, start : start + width], cache, means=means if targets else None)
            cache.columns += width
            start += width
            hidden.append(step)
        return torch.cat(hidden, 1), (torch.cat(means, 1) if targets else None)

    def _decode_columns(self, input_ids, cache, may_replay: bool, dspark: bool = False):
        # -> (hidden [b, n, dim], logits or None, the DSpark input or None): the backbone has no head, and decodes
        # eagerly
        hidden, means = self.decode(input_ids, cache, self.dspark_targets(dspark))
        return hidden, None, means

    def _decode_step(self, input_ids: torch.Tensor, cache: DeepseekV41Cache) -> torch.Tensor:
        # input_ids [b, 1]: row i's token at position cache.lengths[i] -> hidden [b, 1, dim]
        hidden, _ = self._decode_body(input_ids, cache)
        cache.columns += 1
        return hidden

    def _decode_outputs(self, input_ids: torch.Tensor, cache: DeepseekV41Cache, dspark: bool = False):
        # _decode_body with the head, as one function of tensors (what decode_graph.py captures or compiles):
        # -> (hidden [b, n, dim], fp32 logits [b, n, vocab], the DSpark input [b, n, targets·dim] or None)
        means = [] if dspark else None
        hidden, logits = self._decode_body(input_ids, cache, head=True, means=means)
        return hidden, logits, (means[0] if dspark else None)

    def _decode_body(self, input_ids: torch.Tensor, cache: DeepseekV41Cache, head: bool = False, means=None):
        # The device work of one decode step of input_ids [b, n] (n = 1, or a multi-token step: row i's tokens at
        # positions cache.lengths[i] + 0 .. n-1, each seeing those before it), which a CUDA graph captures
        # (decode_graph.py): the blocks, the final norm, the head when asked (-> (hidden [b, n, dim], fp32 logits
        # [b, n, vocab] or None)), and last the rows' advance (their counts and Engram context; the host's column
        # count is the caller's).  With a static cache every shape is fixed and nothing is read back to the host.
        # means (a list): gets the DSpark targets' stream means concatenated [b, n, targets·dim]
        b, n = input_ids.shape
        hashes = {}
        if cache.engram_ids is not None:  # each Engram layer's n-grams over the cached look-back context
            context, dead = cache.engram_context(input_ids)
            hashes = {
                layer.layer: layer.engram.hash(context, dead)[:, -n:] for layer in self.layers if layer.engram is not None
            }
        h = self.embed(input_ids)
        x = h.unsqueeze(2).expand(b, n, self.hc, h.shape[-1]).contiguous()
        pre = torch.zeros(b, n, self.hc, dtype=torch.float32, device=h.device)
        pre[..., 0] = 1.0
        positions = cache.lengths.unsqueeze(1) + torch.arange(n, device=cache.lengths.device)  # [b, n]
        state = CSA2State(cache, positions=positions)
        targets = self.config.text_config.dspark_target_layer_ids if means is not None else ()
        collected = []
        for layer in self.layers:
            x, pre = layer(x, pre, state, input_ids=input_ids, engram_hash_ids=hashes.get(layer.layer),
                           stream_means=collected if layer.layer in targets else None)
        hidden = self.norm(self.hc_collapse(x, pre))
        logits = self.head_logits(hidden) if head else None
        cache.advance_rows(input_ids)
        if means is not None:
            means.append(torch.cat(collected, -1))
        return hidden, logits

    def embed_images(self, h, input_ids, pixel_values, image_grid_hws, vision_token_types):
        if not self.has_vision:
            raise ValueError(
                "this model has no vision tower (vision_config.num_hidden_layers is 0) but got image inputs; "
                "load a checkpoint with the tower enabled or drop pixel_values / image spans"
            )
        if pixel_values is None or image_grid_hws is None or vision_token_types is None:
            raise ValueError("image inputs need pixel_values, image_grid_hws and vision_token_types together")
        from .vision import encode_images, merge_image_embeddings, validate_image_inputs

        validate_image_inputs(
            input_ids, vision_token_types, self.image_token_id, image_grid_hws, pixel_values,
            self.config.vision_config.downsample_ratio,
        )
        pixel_values = pixel_values.to(self.vision.patch_embed.proj.weight.dtype)
        aligned = encode_images(self.vision, self.aligner, pixel_values, image_grid_hws)
        return merge_image_embeddings(h, vision_token_types, aligned, self.image_start, self.image_end, self.image_newline)


@dataclass
class DeepseekV41ModelOutput(BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` plus ``dspark_hidden`` [b, s, targets·dim] (``output_dspark_hidden=True``)."""

    dspark_hidden: torch.Tensor | None = None


@dataclass
class DeepseekV41DecodeOutput(BaseModelOutputWithPast):
    """The backbone's output for a causal LM's decode step replayed as a CUDA graph, which runs the head inside the
    graph: ``BaseModelOutputWithPast`` plus those fp32 logits [b, n, vocab] (and ``dspark_hidden`` when asked for)."""

    logits: torch.FloatTensor | None = None
    dspark_hidden: torch.Tensor | None = None


@dataclass
class DeepseekV41CausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus the head's input: the causal LM is its own backbone (``model.base_model`` is
    the model), so tools that run the backbone and apply the head themselves (TRL's chunked LM head) read it here."""

    last_hidden_state: torch.Tensor | None = None
    dspark_hidden: torch.Tensor | None = None
    # with text_config.dspark_loss_weight > 0 and labels (dspark_loss.py): loss = lm_loss + weight x (dspark_loss +
    # dspark_confidence_loss), the stages' draft CE and confidence BCE, means over the dspark_positions drafted
    # positions; dspark_accuracy: the share of drafts (argmax) equal to their target
    lm_loss: torch.FloatTensor | None = None
    dspark_loss: torch.FloatTensor | None = None
    dspark_confidence_loss: torch.FloatTensor | None = None
    dspark_accuracy: torch.FloatTensor | None = None
    dspark_positions: torch.LongTensor | None = None


class DeepseekV41ForCausalLM(DeepseekV41Model, GenerationMixin):
    """Backbone + fp32 head: logits are fp32 and never rounded to bf16.  ``generate()`` decodes with a
    ``DeepseekV41Cache`` (greedy, sampling, beam search; left-padded batches; assisted and prompt-lookup decoding;
    with DSpark stages ``use_dspark=True``: self-speculative)."""

    _with_head = True

    def forward(
        self, input_ids=None, labels=None, attention_mask=None, logits_to_keep=0, num_items_in_batch=None,
        return_dict=None, **kwargs,
    ) -> DeepseekV41CausalLMOutput:
        # -> logits fp32 [b, s, vocab] (the last logits_to_keep positions when > 0 and no labels); loss = shifted
        # causal CE over labels != -100: the mean over the counted tokens, or with num_items_in_batch (the
        # Trainer's count over all gradient-accumulation micro-batches) the sum divided by it, so that the
        # accumulated gradient is the mean over the whole batch
        if labels is not None and (input_ids is None or labels.shape != input_ids.shape):
            raise ValueError(
                f"labels have shape {tuple(labels.shape)} but input_ids have "
                f"{None if input_ids is None else tuple(input_ids.shape)}: give one label per position (-100 = ignore)"
            )
        if labels is not None:
            check_targets(labels, self.config.text_config.vocab_size)  # a host sync, like the attention-mask check
        dspark_weight = dspark_loss_weight(self.config) if labels is not None else 0.0
        if dspark_weight:  # the DSpark stages' training loss (dspark_loss.py) reads the target layers' inputs
            check_dspark_training(self)
            kwargs["output_dspark_hidden"] = True
        backbone = super().forward(input_ids, attention_mask=attention_mask, **kwargs)
        hidden = backbone.last_hidden_state.to(self.head.weight.device)
        loss = None
        if labels is None and getattr(backbone, "logits", None) is not None:  # a replayed decode graph's head
            logits = backbone.logits[:, -logits_to_keep:] if logits_to_keep else backbone.logits
        elif labels is None:
            logits = self.head_logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        else:
            mask = None if attention_mask is None else attention_mask.to(hidden.device)
            targets = causal_lm_targets(labels.to(hidden.device), mask)
            if self.head_loss is not None and is_plain_linear(self.head):  # bf16x3: the loss fused into the backward
                logits, total = self.head_loss(hidden, self.head.weight, targets)
            else:
                logits = self.head_logits(hidden)
                flat = logits.view(-1, logits.shape[-1])
                total = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
            if num_items_in_batch is None:
                loss = total / (targets != IGNORE_INDEX).sum().clamp(min=1)
            else:
                loss = total / torch.as_tensor(num_items_in_batch, device=total.device)
        extra = {}
        if dspark_weight:  # loss = the LM loss (lm_loss) + weight x the stages' mean loss per drafted position
            stage = dspark_batch_loss(self, backbone.dspark_hidden, input_ids, labels, attention_mask)
            n = stage.count.clamp(min=1)
            mean = stage.total / n
            if num_items_in_batch is not None:  # gradient accumulation: this micro-batch's share of the labels
                mean = mean * (targets != IGNORE_INDEX).sum() / torch.as_tensor(num_items_in_batch, device=mean.device)
            extra = {"lm_loss": loss, "dspark_loss": stage.draft / n, "dspark_confidence_loss": stage.confidence / n,
                     "dspark_accuracy": stage.correct / n, "dspark_positions": stage.count}
            loss = loss + dspark_weight * mean
        output = with_cache(  # logits fp32 [b, s, vocab]
            DeepseekV41CausalLMOutput, returned_cache(backbone), loss=loss, logits=logits,
            hidden_states=backbone.hidden_states, last_hidden_state=backbone.last_hidden_state,
            dspark_hidden=getattr(backbone, "dspark_hidden", None), **extra,
        )
        return output.to_tuple() if return_dict is False else output

    def _dspark_generate(self, inputs=None, *args, use_dspark: bool = True, **kwargs):
        """``generate(..., use_dspark=True)``: decodes self-speculatively with the DSpark draft stages
        (``dspark.speculative_generate``: greedy gives plain greedy decoding's tokens, sampling keeps the target's
        distribution) and records the drafted tokens accepted per step in ``self.dspark_stats``."""
        if not use_dspark:
            return super().generate(inputs, *args, **kwargs)
        from .dspark import speculative_generate

        if args:
            raise TypeError("generate(use_dspark=True) takes keyword arguments only (besides the input ids)")
        config = kwargs.pop("generation_config", None) or self.generation_config
        options = {
            "input_ids": kwargs.pop("input_ids", inputs), "attention_mask": kwargs.pop("attention_mask", None),
            "max_new_tokens": kwargs.pop("max_new_tokens", None) or config.max_new_tokens or 20,
            "do_sample": kwargs.pop("do_sample", config.do_sample),
            "temperature": kwargs.pop("temperature", config.temperature if config.temperature is not None else 1.0),
            "eos_token_id": kwargs.pop("eos_token_id", config.eos_token_id),
            "pad_token_id": kwargs.pop("pad_token_id", config.pad_token_id),
            "generator": kwargs.pop("generator", None),
        }
        kwargs.pop("use_cache", None)
        if kwargs:
            raise ValueError(f"generate(use_dspark=True) does not take {sorted(kwargs)}: it supports input_ids, "
                             "attention_mask, max_new_tokens, do_sample, temperature, eos_token_id, pad_token_id")
        sequences, self.dspark_stats = speculative_generate(self, **options)
        return sequences

    def dspark_cache(self, batch_size: int, max_cache_len: int, rollback_tokens: int) -> DeepseekV41Cache:
        """The cache self-speculative decoding verifies with: one that can undo ``rollback_tokens`` positions (a
        static one on CUDA, as generate's)."""
        if self.device.type == "cuda":
            return self.static_cache(batch_size, max_cache_len, rollback_tokens)
        return DeepseekV41Cache(self.config, rollback_tokens=rollback_tokens)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [b, s, dim] -> fp32 logits [b, s, vocab]: the head kernel on a plain head; a wrapped or replaced
        # head (PEFT LoRA, ...) is called as a module, so what it adds is applied
        if not is_plain_linear(self.head):
            return self.head(hidden.float()).float()
        weight = self._head_bf16_weight(hidden)
        if weight is None:
            return self.head_matmul(hidden, self.head.weight)
        # bf16 x bf16 products are exact in fp32 and summed in fp32: the fp32 GEMM's logits up to summation order,
        # from half its weight bytes on tensor cores (the head is the largest read of a decode step)
        flat = torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.t(), out_dtype=torch.float32)
        return flat.view(*hidden.shape[:-1], weight.shape[0])

    def _head_bf16_weight(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The fp32 head weight as bf16 [vocab, dim], for inference on CUDA with bf16 hidden states when every value
        of the weight is a bf16 value (the release stores the head in bf16; loading holds it in fp32) -> that copy,
        or None: the fp32 GEMM.  Made once per weight version (one exactness check, a host read: not while a CUDA
        graph is captured or its warm-up checks for host reads) and kept beside the weight (+ half its bytes);
        made again when the weight changes, dropped by a forward with gradients.  A decode graph reading the copy
        is stale whenever the copy is remade (the model's graph epoch) or the weight changed since."""
        weight = self.head.weight
        if torch.is_grad_enabled():  # training: the backend's fp32 GEMM; an update may follow, so drop the copy
            if getattr(self, "_head_bf16", None) is not None:
                self._head_bf16 = None
                self._decode_graph_epoch = getattr(self, "_decode_graph_epoch", 0) + 1
            return None
        if not (hidden.is_cuda and hidden.dtype == torch.bfloat16 and weight.dtype == torch.float32):
            return None
        if type(weight.data) is not torch.Tensor or weight.device != hidden.device:  # DTensor (FSDP), offloaded
            return None
        held = getattr(self, "_head_bf16", None)  # (key, bf16 copy or None: not bf16-exact)
        if torch.compiler.is_compiling():  # traced (decode_graph "compile"): the copy the eager prefill made, as
            return None if held is None else held[1]  # data_ptr cannot be traced; model_epoch makes graphs stale
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if held is not None and held[0] == key:
            return held[1]
        if torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode() != 0:
            return None  # the check reads back to the host; the next eager call makes the copy
        reuse = held[1] if held is not None and held[1] is not None and held[1].shape == weight.shape else None
        self._head_bf16 = (key, bf16_copy_if_exact(weight, reuse))
        self._decode_graph_epoch = getattr(self, "_decode_graph_epoch", 0) + 1  # graphs holding the old copy
        return self._head_bf16[1]

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """``GenerationMixin.generate`` after the checks transformers does not make (``check_generate_arguments``):
        special token ids inside the vocabulary, ``num_beams`` / ``num_return_sequences`` bounded by the vocabulary
        and by the memory they would take, a passed cache made by this model."""
        if kwargs.pop("use_dspark", False):  # self-speculative decoding with the DSpark stages
            if generation_config is not None:
                kwargs["generation_config"] = generation_config
            return self._dspark_generate(inputs, **kwargs)
        check_generate_arguments(self, inputs, generation_config, kwargs)
        return super().generate(inputs, generation_config, **kwargs)

    # How a static cache's decode step runs on CUDA (decode_graph.py): "cuda_graph" (captured once, replayed),
    # "compile" (torch.compile's fused kernels, captured the same way) or "off" (eager)
    decode_graph = "cuda_graph"
    static_cache_pool_size = 4  # static caches (and their graphs) generate keeps for reuse, the most recent ones
    static_cache_granularity = 256  # generate's static caches hold a multiple of this many positions

    def _decode_columns(self, input_ids, cache, may_replay: bool, dspark: bool = False):
        # -> (hidden [b, n, dim], fp32 logits [b, n, vocab] or None, the DSpark input or None): through the static
        # cache's CUDA graph of the step's width (one per width: 1, or n for a multi-token step) when it can run as
        # one (logits from the head inside it), else eagerly (the head applied by forward)
        from .decode_graph import graph_decode_step

        if not (may_replay and cache.is_static and input_ids.is_cuda):
            return super()._decode_columns(input_ids, cache, may_replay, dspark)
        outs, start = [], 0
        for width in self.decode_widths(cache, input_ids.shape[1]):
            columns = input_ids[:, start : start + width]
            out = graph_decode_step(self, cache, columns, dspark)
            if out is None:
                out = self._decode_outputs(columns, cache, dspark)
            cache.columns += width
            start += width
            outs.append(out)
        hidden, logits, means = zip(*outs)
        return torch.cat(hidden, 1), torch.cat(logits, 1), (torch.cat(means, 1) if dspark else None)

    def static_cache(self, batch_size: int, max_cache_len: int, rollback_tokens: int = 0) -> DeepseekV41StaticCache:
        """A ``DeepseekV41StaticCache`` for ``batch_size`` rows and at least ``max_cache_len`` positions (rounded up
        to a multiple of ``static_cache_granularity``), reset: the one this model last handed out for that shape
        when it still holds it (its buffers and its captured decode graph are reused), else a new one.  ``generate``
        takes its caches from here; the model keeps the ``static_cache_pool_size`` most recent ones
        (``release_static_caches`` frees them)."""
        step = self.static_cache_granularity
        length = min(-(-max_cache_len // step) * step, self.max_positions)
        pool = self.__dict__.setdefault("_static_caches", {})
        key = (batch_size, length, rollback_tokens)
        cache = pool.pop(key, None)
        if cache is None:
            cache = DeepseekV41StaticCache(self.config, length, rollback_tokens)
        cache.reset()
        pool[key] = cache  # the most recent last
        while len(pool) > self.static_cache_pool_size:
            pool.pop(next(iter(pool)))
        return cache

    def release_static_caches(self) -> None:
        """Forget the static caches (and their CUDA graphs) kept for ``generate``; their memory is freed once
        nothing else holds them."""
        self.__dict__.pop("_static_caches", None)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate must not build a DynamicCache: the first forward returns a DeepseekV41Cache

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length, *args, **kwargs):
        """generate's cache: a ``DeepseekV41StaticCache`` from ``static_cache`` with ``cache_implementation="static"``
        or, when none is named, on CUDA; else none here (the prefill returns a growing ``DeepseekV41Cache``).  A
        cache passed in is used as it is."""
        name = cache_field(CausalLMOutputWithPast)
        implementation = generation_config.cache_implementation
        if model_kwargs.get(name) is not None or model_kwargs.get("past_key_values") is not None:
            if implementation is not None:
                raise ValueError("pass either cache_implementation or a cache, not both")
            return
        if generation_config.use_cache is False:
            return
        if implementation not in (None, "static", "dynamic"):
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported by DeepSeek-V4.1: use 'static' (a "
                "preallocated DeepseekV41StaticCache; the default on CUDA) or 'dynamic' (a growing DeepseekV41Cache)"
            )
        # assisted / prompt-lookup decoding (and an assistant's own generate) undo rejected candidates with crop: a
        # cache that can roll back that far (at most the whole generation)
        assisted = getattr(generation_mode, "value", generation_mode) == "assisted_generation" or bool(
            getattr(generation_config, "is_assistant", False))
        spare = max_cache_length if assisted else 0
        rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) * batch_size
        if implementation == "static" or (implementation is None and self.device.type == "cuda"):
            length = max(max_cache_length, generation_config.max_cache_len or 0)
            model_kwargs[name] = self.static_cache(rows, length, spare)
        elif assisted:  # transformers' assisted loop needs the cache before the prefill
            model_kwargs[name] = DeepseekV41Cache(self.config, rollback_tokens=spare)

    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None, cache=None, use_cache=None,
        pixel_values=None, image_grid_hws=None, vision_token_types=None, position_ids=None, **kwargs,
    ):
        """The columns the cache has not seen (all of them at the first step, with the prompt's images)."""
        if inputs_embeds is not None:
            raise NotImplementedError("inputs_embeds is not supported: Engram hashing needs input_ids")
        cache = past_key_values if cache is None else cache
        seen = 0 if cache is None else cache.get_seq_length()
        inputs = {"input_ids": input_ids[:, seen:], "attention_mask": attention_mask, "use_cache": use_cache}
        if cache is not None:
            inputs[cache_field(CausalLMOutputWithPast)] = cache
        if position_ids is not None:
            inputs["position_ids"] = position_ids[..., seen : input_ids.shape[1]]
        if seen == 0:  # images belong to the prompt
            inputs.update(pixel_values=pixel_values, image_grid_hws=image_grid_hws, vision_token_types=vision_token_types)
        for key in ("next_sequence_length", "is_first_iteration", "cache_position", "tokenizer"):
            kwargs.pop(key, None)  # generate's own bookkeeping: the cache tells which columns are new
        if seen:
            inputs[GENERATE_DECODE_STEP] = True
        inputs.update(kwargs)
        return {key: value for key, value in inputs.items() if value is not None}


_SPECIAL_IDS = ("eos_token_id", "pad_token_id", "bos_token_id")
GENERATE_LOGIT_COPIES = 4  # fp32 [rows, vocab] a decode step holds: logits, processed scores, log-softmax, top-k input


def _token_ids(value) -> list:
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    return list(value) if isinstance(value, (list, tuple)) else [value]


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` (CUDA: the driver's free bytes; CPU: Linux MemAvailable), None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def generate_memory_bytes(model, rows: int, total_tokens: int) -> dict:
    """Estimated bytes ``generate`` holds for ``rows`` sequences of up to ``total_tokens``: the fp32 logits of a
    step (``GENERATE_LOGIT_COPIES`` copies) and the decode cache (window rings, compressed entries, fp32 carries)."""
    from .cache_deepseek_v41 import cache_bytes_per_token

    text = model.config.text_config
    element = model.embed.weight.element_size()
    per_row = text.num_hidden_layers * text.sliding_window * text.head_dim * element
    per_row += cache_bytes_per_token(text, element) * total_tokens
    per_row += sum(2 * r * text.head_dim * 4 for i, r in enumerate(text.compress_ratios)
                   if text.attention_mode(i) == "full" and r > 1)
    return {"logits": GENERATE_LOGIT_COPIES * rows * text.vocab_size * 4, "cache": int(rows * per_row)}


def check_generate_arguments(model, inputs, generation_config, kwargs) -> None:
    """What ``generate`` would accept and then run wrong or for ever, refused with the numbers.

    * ``eos_token_id`` / ``pad_token_id`` / ``bos_token_id`` must be token ids of this model: an eos past the
      vocabulary never stops generation, a pad past it breaks padded rows;
    * ``num_beams`` and ``num_return_sequences``: at most the vocabulary (more beams than tokens cannot differ),
      and the rows they make (batch x the larger) must fit the device's free memory (``generate_memory_bytes``);
    * ``past_key_values`` / ``cache``: made by this model (``DeepseekV41Cache.check_matches``).
    """
    config = generation_config if generation_config is not None else model.generation_config

    def setting(key):
        return kwargs[key] if key in kwargs else getattr(config, key, None)

    vocab = model.config.text_config.vocab_size
    for key in _SPECIAL_IDS:
        value = setting(key)
        if value is None:
            continue
        for token in _token_ids(value):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(f"{key}={value!r} is not a token id of this model (text_config.vocab_size = {vocab}): "
                                 f"{'generation would never stop at it' if key == 'eos_token_id' else 'it cannot be embedded'}; "
                                 f"give ids in [0, {vocab})")
    counts = {}
    for key in ("num_beams", "num_return_sequences"):
        value = setting(key)
        value = 1 if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be a whole number >= 1")
        if value > vocab:
            raise ValueError(f"{key}={value} exceeds the vocabulary ({vocab} tokens): there are no {value} different "
                             f"continuations of a prompt; use at most {vocab} (a handful is usual)")
        counts[key] = value
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if isinstance(cache, DeepseekV41Cache):
        cache.check_matches(model)
    prompt = inputs if inputs is not None else kwargs.get("input_ids")
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2:
        return
    batch, length = prompt.shape
    new = setting("max_new_tokens")
    total = length + new if new is not None else max(length, setting("max_length") or length)
    rows = batch * max(counts.values())
    need = generate_memory_bytes(model, rows, total)
    device = model.head.weight.device
    free = available_memory_bytes(device)
    if free is not None and sum(need.values()) > free:
        gib = 2**30
        raise ValueError(
            f"num_beams={counts['num_beams']}, num_return_sequences={counts['num_return_sequences']} on a batch of "
            f"{batch} make {rows} rows: about {sum(need.values()) / gib:.1f} GiB (fp32 logits "
            f"{GENERATE_LOGIT_COPIES} x {rows} x {vocab} x 4 B = {need['logits'] / gib:.1f} GiB, cache for {total} "
            f"tokens {need['cache'] / gib:.1f} GiB) but {free / gib:.1f} GiB are free on {device}; use fewer beams or "
            "return sequences, or a smaller batch")


def stack_released_experts(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook of ``RoutedExperts``: released per-expert tensors (``{prefix}{e}.w1.weight``,
    what ``save_pretrained`` writes and the Trainer reloads on resume, possibly one shard at a time) are copied
    into their rows of the stacked ``w1`` / ``w2`` / ``w3``, which then stand in the state dict as loaded."""
    from .checkpoint import released_to_model_name

    for key in [k for k in state_dict if k.startswith(prefix)]:
        name, expert = released_to_model_name(key)
        if expert is None:
            continue
        stacked = getattr(module, name.removeprefix(prefix))
        with torch.no_grad():
            stacked[expert].copy_(state_dict.pop(key))
        state_dict[name] = stacked


def causal_lm_targets(labels: torch.Tensor, attention_mask=None) -> torch.Tensor:
    # labels [b, s] -> targets [b·s]: position t predicts labels[t + 1]; masked positions and the last are -100
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
    # the last position has no next token: its target is -100, so the logits are used whole (a slice would
    # copy them, and its backward would zero-fill and copy a full-size gradient)
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1).reshape(-1)


def check_targets(labels: torch.Tensor, vocab: int) -> None:
    """Raise ``ValueError`` naming the bad values unless every label is a token id in [0, vocab) or -100."""
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
    if bad.any():
        raise ValueError(
            f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored); got {labels[bad][:5].tolist()}"
        )


def validate_inputs(model, input_ids, attention_mask, position_ids, use_cache, cache, inputs_embeds, extra,
                    check_values: bool = True):
    """Reject what this model cannot compute correctly, with the fix in the message.

    The checks of tensor values (token ids in range, a 0/1 mask without holes, positions) share one host read.
    ``check_values=False`` leaves them out: generate's decode steps, whose new token comes from the model's own
    logits and whose mask generate extends with ones (the prompt's were checked at its prefill)."""
    if cache is not None and not isinstance(cache, DeepseekV41Cache):
        raise TypeError(
            f"past_key_values must be the DeepseekV41Cache a use_cache=True forward returns, got {type(cache).__name__}"
        )
    if extra.get("return_dict", True) is not True:
        raise NotImplementedError("return_dict=False is not supported: outputs are ModelOutput objects")
    extra.pop("return_dict", None)
    if inputs_embeds is not None:
        raise NotImplementedError("inputs_embeds is not supported: Engram hashing needs input_ids")
    for key in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx"):
        if key in extra:
            raise ValueError(f"packed (THD) inputs ({key}) are not supported: pad each sequence in its own row")
    for key in ("mtp", "dspark", "num_draft_tokens", "use_dspark"):
        if key in extra:
            raise ValueError(f"forward takes no {key}=: the DSpark stages draft in generate(..., use_dspark=True); "
                             "forward(output_dspark_hidden=True) returns their input")
    if extra:
        raise TypeError(f"forward got unexpected keyword arguments {sorted(extra)}")
    if input_ids is None:
        raise ValueError("input_ids [batch, seq] are required")
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [batch, seq] (unpacked); got shape {tuple(input_ids.shape)}. "
            "Packed/THD inputs are not supported: pad each sequence in its own row"
        )
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be an integer tensor (int64), got {input_ids.dtype}")
    b, s = input_ids.shape
    if b == 0 or s == 0:
        raise ValueError(f"input_ids have shape {(b, s)}: an empty batch or a length-0 sequence; give at least "
                         "one row with at least one token")
    past = 0 if cache is None else cache.get_seq_length()
    if cache is not None:
        cache.check_matches(model, b)
    if past + s > model.max_positions:
        raise ValueError(f"sequence length {past + s} exceeds max_position_embeddings={model.max_positions}")
    if s > model.training_max_positions and torch.is_grad_enabled():
        raise NotImplementedError(
            f"training on sequences of {s} tokens (> {model.training_max_positions}) is out of scope "
            "(million-token training needs context parallelism); run inference under torch.no_grad()"
        )
    if attention_mask is not None and attention_mask.shape != (b, past + s):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(b, past + s)}"
            + (f" (the {past} cached columns and the {s} new ones)" if past else "")
        )
    if position_ids is not None:
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape[-1] != s:
            raise ValueError(f"position_ids have length {position_ids.shape[-1]}, expected {s}")
    if not check_values:
        return
    if attention_mask is not None and attention_mask.dtype != torch.bool and (
            attention_mask.is_floating_point() or attention_mask.is_complex()):
        raise ValueError(f"attention_mask must hold 0/1 as bool or integers, got {attention_mask.dtype}; "
                         "pass attention_mask.long() of a 0/1 mask")
    # (device flag, error): every flag read back in one host sync, the first raised in this order
    vocab = model.config.text_config.vocab_size
    checks = [(((input_ids < 0) | (input_ids >= vocab)).any(), lambda: ValueError(
        f"input_ids must be token ids in [0, {vocab}) (text_config.vocab_size); got "
        f"{input_ids[(input_ids < 0) | (input_ids >= vocab)][:5].tolist()}: pad with the pad token id, not a "
        "negative or out-of-vocabulary id"))]
    mask = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            bad = (attention_mask != 0) & (attention_mask != 1)
            checks.append((bad.any(), lambda bad=bad: ValueError(  # bound now: the name is reused below
                f"attention_mask must hold only 0 (padding) and 1 (token); got {attention_mask[bad][:5].tolist()}")))
        mask = attention_mask.bool()
        if past:
            checks.append((~mask[:, past:].all(), lambda: ValueError(
                "the new columns of a decode step must all be real tokens (attention_mask 1)")))
        runs = mask & ~torch.nn.functional.pad(mask, (1, 0))[:, :-1]  # where a run of real tokens starts
        checks.append(((runs.sum(1) > 1).any(), lambda: ValueError(
            "attention_mask has holes (padding between real tokens); pad each row only at its start (left "
            "padding) or its end (right padding)")))
        if use_cache or cache is not None:
            checks.append((~mask.any(1).all(), lambda: ValueError(
                "a row of attention_mask has no real token: every generated row needs a prompt")))
        mask = mask[:, past:]
    if position_ids is not None:
        if past:
            expected = cache.lengths.unsqueeze(1) + torch.arange(s, device=position_ids.device)
        elif mask is not None:
            expected = mask.long().cumsum(1) - 1
        else:
            expected = torch.arange(s, device=position_ids.device)
        checks.append((~((position_ids == expected) | (False if mask is None else ~mask)).all(), lambda: ValueError(
            "position_ids must be zero-based and contiguous over each row's real tokens (0, 1, ..., the padding "
            "excluded, as attention_mask implies); packed sequences with restarting positions are not supported")))
    failed = torch.stack([flag.to(input_ids.device) for flag, _ in checks]).tolist()
    for bad, (_, error) in zip(failed, checks):
        if bad:
            raise error()


def real_lengths(attention_mask, input_ids):
    """(real tokens per row int64 [b], left-padding width per row [b] or None when no row is left padded)."""
    b, s = input_ids.shape
    if attention_mask is None:
        return torch.full((b,), s, dtype=torch.long, device=input_ids.device), None
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    shift = mask.long().argmax(1).masked_fill(lengths == 0, 0)  # index of each row's first real token
    return lengths, (shift if bool(shift.any()) else None)


def roll_rows(t: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    # t [b, s, ...] -> row i rolled left by shift[i] columns (negative: right), wrapping around
    s = t.shape[1]
    idx = (torch.arange(s, device=t.device) + shift.unsqueeze(1)) % s  # [b, s]
    return t.gather(1, idx.view(*idx.shape, *[1] * (t.dim() - 2)).expand_as(t))


def cache_field(output_cls) -> str:
    # what this transformers version calls the cache: `cache` (>= 5.2x) or `past_key_values`
    return "cache" if "cache" in output_cls.__dataclass_fields__ else "past_key_values"


def returned_cache(output):
    """The cache a forward returned (None without one), under either name."""
    return getattr(output, cache_field(type(output)), None)


def with_cache(output_cls, cache, **fields):
    """``output_cls(**fields)`` with the cache under this transformers version's name."""
    return output_cls(**fields, **{cache_field(output_cls): cache})


def engram_hash_ids_for(engram_hash_ids, layer: DeepseekV41Block, text_config):
    """Precomputed hash ids for ``layer``: a dict {layer_id: [b, s, cols]} or the stacked [b, s, n_layers, cols]."""
    if engram_hash_ids is None or layer.engram is None:
        return None
    if isinstance(engram_hash_ids, dict):
        return engram_hash_ids[layer.layer]
    return engram_hash_ids[:, :, text_config.engram_layer_ids.index(layer.layer)]


def resolve_checkpoint_dir(name_or_path, revision=None, **hub_options) -> Path:
    """A local folder as is; anything else is a Hub repo id downloaded (once, cached) at ``revision`` with
    ``hub_options`` (cache_dir, local_files_only, token, force_download) passed to ``snapshot_download``.
    ``None`` means the shared local snapshot named by ``DS41_CHECKPOINT``."""
    if name_or_path is None:
        name_or_path = os.environ.get("DS41_CHECKPOINT")
        if not name_or_path:
            raise ValueError("no checkpoint given: pass a folder or repo id, or set DS41_CHECKPOINT to the snapshot")
    path = Path(os.fspath(name_or_path)).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(name_or_path).startswith((".", "/")):
        raise FileNotFoundError(f"checkpoint folder {name_or_path} does not exist or is not a folder")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), revision=revision, **hub_options))


ACCELERATE_PLANS = ("auto", "balanced", "balanced_low_0", "sequential")


def resolve_device_map(model, device_map, dtype, max_memory=None) -> dict:
    """{module or tensor name: torch.device} covering every parameter and buffer of the meta-device ``model``
    exactly once, without splitting a ``_no_split_modules`` block (CSA2 state and mHC streams pass between
    blocks, not inside one)."""
    if device_map is None:
        return {"": torch.device("cpu")}
    if isinstance(device_map, (str, int, torch.device)) and device_map not in ACCELERATE_PLANS:
        return {"": as_device(device_map)}
    if isinstance(device_map, str):
        device_map = plan_device_map(model, device_map, dtype, max_memory)
    if not isinstance(device_map, dict):
        raise TypeError(f"device_map must be a device, one of {ACCELERATE_PLANS} or a dict; got {device_map!r}")
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    modules = dict(model.named_modules())
    no_split = {n for n, m in modules.items() if type(m).__name__ in model._no_split_modules}
    placement = {}
    for key, device in device_map.items():
        if key not in modules and key not in names:
            raise ValueError(f"device_map key {key!r} names no module or parameter of {type(model).__name__}")
        inside = [b for b in no_split if key.startswith(b + ".")]
        if inside:
            raise ValueError(
                f"device_map key {key!r} splits block {inside[0]!r} ({type(modules[inside[0]]).__name__} is in "
                f"_no_split_modules): place the whole block on one device"
            )
        placement[key] = as_device(device)
    uncovered = [n for n in names if placement_of(n, placement) is None]
    if uncovered:
        raise ValueError(f"device_map places no device for {uncovered[:5]}{' ...' if len(uncovered) > 5 else ''}; "
                         "add their modules (or \"\" for everything else)")
    return placement


def device_map_dtypes(model) -> dict:
    """accelerate's ``special_dtypes`` for ``model``: the tensors whose bytes are not ``dtype``'s: the fp32 islands,
    and the kept FP8/FP4 codes and scales (Engram tables' included), counted at their stored size."""
    special = {name: torch.float32 for name, t in model.named_parameters() if t.dtype == torch.float32}
    special.update({name: t.dtype for name, t in model.named_buffers() if isinstance(t, KeptTensor)})
    special.update({name: t.dtype for name, t in stored_table_tensors(model).items()})
    return special


def plan_device_map(model, plan: str, dtype, max_memory=None) -> dict:
    # accelerate's planner over the meta-device model, whole blocks per device, every tensor at the bytes it will
    # hold; Engram tables held in host memory (engram_device="cpu") are left out: they take no device's memory
    # (materialize allocates them on the host whatever the plan), as the inference planner assumes
    try:  # (in a try block, transformers' remote-code import check does not demand accelerate of every export)
        from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map
    except ImportError as err:
        raise ImportError(f'device_map="{plan}" plans with the accelerate package: pip install accelerate') from err

    no_split = list(model._no_split_modules)
    with tables_left_out(model):
        special = device_map_dtypes(model)
        if plan == "sequential":
            max_memory = get_max_memory(max_memory)
        else:
            max_memory = get_balanced_memory(
                model, max_memory, no_split_module_classes=no_split, dtype=dtype, special_dtypes=special,
                low_zero=plan == "balanced_low_0",
            )
        device_map = infer_auto_device_map(
            model, max_memory, no_split_module_classes=no_split, dtype=dtype, special_dtypes=special
        )
    offloaded = sorted(k for k, v in device_map.items() if v in ("disk", "meta"))
    if offloaded:
        raise NotImplementedError(
            f"device_map={plan!r} would offload {offloaded[:5]} to disk: weight offloading is not supported; "
            "give max_memory with more room or use more GPUs"
        )
    return device_map


def as_device(device) -> torch.device:
    if str(device) in ("meta", "disk"):
        raise ValueError(f"device {device!r} is not supported in device_map: weight offloading is out of scope")
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)


def placement_of(name: str, placement: dict):
    # the device of the longest key that is ``name`` or one of its module prefixes ("" covers everything)
    best = None
    for key, device in placement.items():
        if (key == "" or name == key or name.startswith(key + ".")) and (best is None or len(key) > len(best[0])):
            best = (key, device)
    return None if best is None else best[1]


def materialize(model, placement: dict) -> None:
    """Allocate the meta-device ``model``'s parameters and buffers on their ``placement`` devices (uninitialized,
    like ``to_empty``) and restore the derived buffers."""
    if set(placement) == {""}:
        model.to_empty(device=placement[""])
        return
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                device = HOST if getattr(module, "held_on_host", False) else placement_of(prefix + name, placement)
                empty = torch.empty_like(tensor, device=device)
                table[name] = nn.Parameter(empty, tensor.requires_grad) if table is module._parameters else empty
    for module in model.modules():
        if isinstance(module, Engram):
            module.restore_derived_buffers()


def revision_of(path: Path):
    # Hub snapshots live in .../snapshots/<commit>/: that commit is the pinned, resolved revision.
    return path.name if path.parent.name == "snapshots" else None


def resolve_dtype(dtype, config) -> torch.dtype:
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or "bfloat16"
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    return dtype


def fp32_island_tensors(model) -> list[torch.Tensor]:
    """The parameters and buffers (and their gradients) that stay fp32 whatever the model dtype: those named in
    ``_keep_in_fp32_modules_strict`` (also inside a PEFT wrapper, e.g. ``head.lora_A``) and the ratio-2
    compressors' ``wkv`` / ``wgate`` (built in fp32; architecture.md §5)."""
    from .attention import Compressor

    patterns = [f".{name}." for name in model._keep_in_fp32_modules_strict]
    named = [*model.named_parameters(), *model.named_buffers()]
    tensors = [t for name, t in named if any(p in f".{name}." for p in patterns)]
    for module in model.modules():
        if isinstance(module, Compressor) and module.ratio == 2:
            tensors += [*module.wkv.parameters(), *module.wgate.parameters()]
    return tensors + [t.grad for t in tensors if t.grad is not None]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def save_tokenizer_files(tokenizer, folder: Path, config) -> list[Path]:
    """Files of ``tokenizer`` (a transformers or ``tokenizers`` tokenizer) written into ``folder``, plus the
    checkpoint's ``tokenizer_config.json`` when the tokenizer has none of its own."""
    if tokenizer is None:
        return []
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)
    else:
        tokenizer.save(str(folder / "tokenizer.json"))
        source = Path(getattr(config, "_name_or_path", "") or "") / "tokenizer_config.json"
        if source.is_file():
            (folder / source.name).write_bytes(source.read_bytes())
    return sorted(p for p in folder.iterdir() if p.is_file())


def support_files(config, tokenizer, folder: Path, generation_config=None) -> list[Path]:
    """Tokenizer, processor and generation files of an export, written into ``folder``: Engram's tokenizer, the
    processor (``processor_config.json`` with ``auto_map``, chat template) so the export loads with
    ``AutoProcessor``, and ``generation_config.json`` when given."""
    save_tokenizer_files(tokenizer, folder, config)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    if (folder / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        from .image_processing_deepseek_v41 import DeepseekV41ImageProcessor
        from .processing_deepseek_v41 import DeepseekV41Processor

        DeepseekV41ImageProcessor.register_for_auto_class("AutoImageProcessor")
        DeepseekV41Processor.register_for_auto_class("AutoProcessor")
        image_processor = DeepseekV41ImageProcessor.from_vision_config(config.vision_config)
        processor = DeepseekV41Processor(image_processor, AutoTokenizer.from_pretrained(folder),
                                         image_token_id=config.image_token_id)
        processor.save_pretrained(folder)
    return sorted(p for p in folder.iterdir() if p.is_file())


def parse_size(size) -> int:
    """transformers' ``max_shard_size``: a byte count, or text such as '5GB', '500MB', '4GiB' -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", str(size).upper())
    if not match:
        raise ValueError(f"{size!r} is not a size: give a byte count or e.g. '5GB', '500MB', '4GiB'")
    number, unit, binary = match.groups()
    return int(float(number) * (1024 if binary else 1000) ** " KMGT".index(unit or " "))


def remote_code_files() -> list[Path]:
    """The flat modeling files a checkpoint folder needs for ``trust_remote_code`` (this file, the config
    file and everything they import relatively)."""
    from transformers.dynamic_module_utils import get_relative_import_files

    here = Path(__file__).resolve().parent
    files = {Path(f) for f in get_relative_import_files(str(here / "modeling_deepseek_v41.py"))}
    files |= {here / "modeling_deepseek_v41.py", here / "configuration_deepseek_v41.py"}
    return sorted(files)
