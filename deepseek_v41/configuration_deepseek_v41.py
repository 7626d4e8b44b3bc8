"""Configurations of DeepSeek-V4.1-Flash: the outer multimodal config and its text and vision parts.

Field names and defaults are the released ``config.json``'s: the default config IS DeepSeek-V4.1-Flash.
Text architecture lives only in ``config.text_config``, vision only in ``config.vision_config``; the
released ``quantization_config`` is kept untouched on the outer config; ``config.backend`` holds the
kernel-backend strings (see ``backends.py``).
"""

import functools
import math
import warnings

import torch
from transformers import PretrainedConfig

from .backends import resolve_backend
from .engram_hashing import engram_primes


class DeepseekV41TextConfig(PretrainedConfig):
    model_type = "deepseek_v41_text"
    base_config_key = "text_config"

    def __init__(
        self,
        vocab_size=129280,
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=64,
        num_key_value_heads=1,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1280,
        o_lora_rank=1024,
        o_groups=8,
        rms_norm_eps=1e-20,
        hidden_act="silu",
        swiglu_limit=10.0,
        initializer_range=0.02,
        attention_bias=False,
        attention_dropout=0.0,
        use_cache=True,
        max_position_embeddings=1048576,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_scaling=None,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=6,
        moe_intermediate_size=2304,
        scoring_func="sqrtsoftplus",
        topk_method="noaux_tc",
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        gate_temp=1.0,
        gate_bias_update_factor=0.0,
        sliding_window=128,
        compress_ratios=None,
        kv_source_layer_ids=None,
        index_source_layer_ids=None,
        candidate_source_layer_id=20,
        candidate_topk_blocks=2048,
        candidate_block_size=8,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        q_head_rescale=False,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        engram_layer_ids=None,
        engram_num_embeddings=None,
        engram_max_ngram_size=4,
        engram_vocab_size=16000000,
        engram_n_heads=8,
        engram_head_dim=256,
        engram_pad_token_id=2,
        engram_compressed_vocab_size=99092,
        engram_device=None,
        num_nextn_predict_layers=3,
        dspark_block_size=5,
        dspark_noise_token_id=128799,
        dspark_target_layer_ids=None,
        dspark_markov_rank=256,
        dspark_n_routed_experts=128,
        dspark_num_experts_per_tok=3,
        dspark_loss_weight=0.0,
        tie_word_embeddings=False,
        **kwargs,
    ):
        if "engram_pad_id" in kwargs:  # the official ModelArgs / upstream transformers spelling
            engram_pad_token_id = kwargs.pop("engram_pad_id")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        self.o_lora_rank = o_lora_rank
        self.o_groups = o_groups
        self.rms_norm_eps = rms_norm_eps
        self.hidden_act = hidden_act
        self.swiglu_limit = swiglu_limit
        self.initializer_range = initializer_range
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.use_cache = use_cache
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.compress_rope_theta = compress_rope_theta
        rope_scaling = rope_scaling or kwargs.pop("rope_parameters", None) or {
            "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        }
        with warnings.catch_warnings():  # transformers >= 5.2x aliases rope_scaling to rope_parameters, with a warning
            warnings.simplefilter("ignore", FutureWarning)
            self.rope_scaling = rope_scaling
        self.n_routed_experts = n_routed_experts
        self.n_shared_experts = n_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.scoring_func = scoring_func
        self.topk_method = topk_method
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.gate_temp = gate_temp
        self.gate_bias_update_factor = gate_bias_update_factor
        self.sliding_window = sliding_window
        self.compress_ratios = list(compress_ratios) if compress_ratios is not None else (
            [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
        )
        self.kv_source_layer_ids = list(kv_source_layer_ids) if kv_source_layer_ids is not None else [2, 8, 14, 20]
        self.index_source_layer_ids = (
            list(index_source_layer_ids) if index_source_layer_ids is not None
            else [2, 8, 14, 20, 24, 28, 32, 36]
        )
        self.candidate_source_layer_id = -1 if candidate_source_layer_id is None else candidate_source_layer_id
        self.candidate_topk_blocks = candidate_topk_blocks
        self.candidate_block_size = candidate_block_size
        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        self.q_head_rescale = q_head_rescale
        self.hc_mult = hc_mult
        self.hc_sinkhorn_iters = hc_sinkhorn_iters
        self.hc_eps = hc_eps
        self.engram_layer_ids = list(engram_layer_ids) if engram_layer_ids is not None else [1, 14]
        # None: each table's rows follow from its hash primes (_engram_table_rows), once the fields are checked
        self.engram_num_embeddings = list(engram_num_embeddings) if engram_num_embeddings is not None else None
        self.engram_max_ngram_size = engram_max_ngram_size
        self.engram_vocab_size = engram_vocab_size
        self.engram_n_heads = engram_n_heads
        self.engram_head_dim = engram_head_dim
        self.engram_pad_token_id = engram_pad_token_id
        self.engram_compressed_vocab_size = engram_compressed_vocab_size
        # None: each Engram table on its block's device; "cpu": in host memory, its rows copied to the block's
        # device at each forward (engram_host.py).  A placement, like device_map: from_pretrained(engram_device=)
        self.engram_device = str(engram_device) if isinstance(engram_device, torch.device) else engram_device
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.dspark_block_size = dspark_block_size
        self.dspark_noise_token_id = dspark_noise_token_id
        self.dspark_target_layer_ids = (
            list(dspark_target_layer_ids) if dspark_target_layer_ids is not None else [37, 38, 39]
        )
        self.dspark_markov_rank = dspark_markov_rank
        self.dspark_n_routed_experts = dspark_n_routed_experts
        self.dspark_num_experts_per_tok = dspark_num_experts_per_tok
        # training only: forward(labels=...) adds this times the DSpark stages' loss (dspark_loss.py); 0 = off
        self.dspark_loss_weight = dspark_loss_weight
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        if self.engram_num_embeddings is None:
            self.engram_num_embeddings = _engram_table_rows(self)
        check_config_values(self)
        self.validate_layout()

    def validate_layout(self):
        """Check the layer plan once, so a bad config fails at construction with the field to fix."""
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries but num_hidden_layers is {n}; "
                "give one ratio (0, 1 or 2) per layer"
            )
        for i in range(n):
            ratio = self.compress_ratios[i]
            if ratio not in (0, 1, 2):
                raise ValueError(f"compress_ratios[{i}] = {ratio}; V4.1 supports ratios 0, 1 and 2")
            if ratio and self.kv_source_of(i) is None:
                raise ValueError(
                    f"layer {i} has compress ratio {ratio} but no kv source layer at or before it in "
                    f"kv_source_layer_ids={self.kv_source_layer_ids}"
                )
        for i in self.kv_source_layer_ids + self.index_source_layer_ids:
            if i < n and self.compress_ratios[i] == 0:
                raise ValueError(f"layer {i} is a kv/index source but has compress ratio 0")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must divide into o_groups={self.o_groups}")
        for layer in self.engram_layer_ids:
            if not 0 <= layer < n:
                raise ValueError(f"engram_layer_ids contains {layer}, outside 0..{n - 1}")

    # ---- the CSA2 layer plan (architecture.md §3) ----
    def kv_source_of(self, layer: int):
        """The Full layer whose compressed KV (and index keys) ``layer`` reads, or None for ratio 0."""
        if self.compress_ratios[layer] == 0:
            return None
        sources = [i for i in self.kv_source_layer_ids if i <= layer]
        return max(sources) if sources else None

    def index_source_of(self, layer: int):
        """The Full or Reindex layer whose top-k ``layer`` uses, or None for ratio 0."""
        if self.compress_ratios[layer] == 0:
            return None
        sources = [i for i in self.index_source_layer_ids if i <= layer]
        return max(sources) if sources else None

    def attention_mode(self, layer: int) -> str:
        """'window', 'full', 'reindex' or 'reuse'."""
        if self.compress_ratios[layer] == 0:
            return "window"
        if layer in self.kv_source_layer_ids:
            return "full"
        if layer in self.index_source_layer_ids:
            return "reindex"
        return "reuse"


class DeepseekV41VisionConfig(PretrainedConfig):
    model_type = "deepseek_v41_vision"
    base_config_key = "vision_config"

    def __init__(
        self,
        num_hidden_layers=32,
        hidden_size=1024,
        num_attention_heads=16,
        intermediate_size=2816,
        patch_size=14,
        rope_theta=10000.0,
        downsample_ratio=3,
        max_image_tokens=1024,
        min_pixels=295936,
        max_wh_ratio=None,
        rms_norm_eps=1e-6,
        **kwargs,
    ):
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.patch_size = patch_size
        self.rope_theta = rope_theta
        self.downsample_ratio = downsample_ratio
        self.max_image_tokens = max_image_tokens
        self.min_pixels = min_pixels
        self.max_wh_ratio = max_wh_ratio
        self.rms_norm_eps = rms_norm_eps
        super().__init__(**kwargs)
        check_config_values(self)


RELEASED_IMAGE_TOKEN_ID = 129264  # the release's image_token_id: the default where the vocabulary holds it


class DeepseekV41Config(PretrainedConfig):
    model_type = "deepseek_v41"
    sub_configs = {"text_config": DeepseekV41TextConfig, "vision_config": DeepseekV41VisionConfig}

    def __init__(
        self,
        text_config=None,
        vision_config=None,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        image_token_id=None,
        backend=None,
        dequantize_base_checkpoint=None,
        tie_word_embeddings=False,
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = DeepseekV41TextConfig(**text_config)
        elif text_config is None:
            text_config = DeepseekV41TextConfig()
        if isinstance(vision_config, dict):
            vision_config = DeepseekV41VisionConfig(**vision_config)
        elif vision_config is None:
            vision_config = DeepseekV41VisionConfig()
        self.text_config = text_config
        self.vision_config = vision_config
        if image_token_id is None and text_config.vocab_size > RELEASED_IMAGE_TOKEN_ID:
            image_token_id = RELEASED_IMAGE_TOKEN_ID  # unset: the release's id, where the vocabulary holds it
        self.image_token_id = image_token_id
        self.backend = resolve_backend(backend)
        self.dequantize_base_checkpoint = dequantize_base_checkpoint
        kwargs.setdefault("architectures", ["DeepseekV41ForCausalLM"])
        kwargs.setdefault("dtype", "bfloat16")
        check_config_values(self, dtype=kwargs["dtype"])  # before transformers turns the dtype name into torch's
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def backend(self) -> dict:
        """Kernel-backend names {kind: name}, always complete: any assignment (a partial dict such as
        ``{"experts": "torch"}``, also through ``from_pretrained(..., backend=...)`` and the Auto classes) is
        merged with the defaults and checked (``ValueError`` listing the registered names)."""
        return self.__dict__["backend"]

    @backend.setter
    def backend(self, overrides):
        self.__dict__["backend"] = resolve_backend(overrides)

    def get_text_config(self, decoder=None, encoder=None):
        return self.text_config


def _delegate_to_text_config(name: str) -> property:
    # config.vocab_size etc.: the values transformers tools (Trainer, PEFT, TRL, generation) read at the top
    # level live in text_config; reads and writes (e.g. resize_token_embeddings) go there
    def get(self):
        return getattr(self.text_config, name)

    def set(self, value):
        setattr(self.text_config, name, value)

    return property(get, set, doc=f"``text_config.{name}``")


TEXT_ATTRIBUTES = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "rope_theta", "sliding_window",
    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
)
for _name in TEXT_ATTRIBUTES:
    setattr(DeepseekV41Config, _name, _delegate_to_text_config(_name))


# ---- value checks (every field, at construction, naming the field) ----

# rope_scaling: the YaRN keys the model reads; rope_theta is added by transformers' rope_parameters alias, and
# the official V4.1 code applies no YaRN attention scale, so mscale keys are accepted and unused.
_YARN_KEYS = ("rope_type", "factor", "beta_fast", "beta_slow", "original_max_position_embeddings")
_YARN_IGNORED = ("rope_theta", "mscale", "mscale_all_dim")
# Settings the model implements only one way: any other value would be silently ignored.
_FIXED = {"hidden_act": "silu", "topk_method": "noaux_tc", "attention_bias": False, "num_key_value_heads": 1}


def _need(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field} = {value!r}: {rule}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(source, name: str):
    return source[name] if isinstance(source, dict) else getattr(source, name)


def _ints(source, prefix: str, names: str, low: int) -> None:
    # source: a config or a dict (rope_scaling)
    for name in names.split():
        value = _field(source, name)
        _need(_is_int(value) and value >= low, prefix + name, value, f"must be an integer >= {low}")


def _floats(source, prefix: str, names: str, low: float, inclusive: bool = False) -> None:
    for name in names.split():
        value = _field(source, name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = number and math.isfinite(value) and (value >= low if inclusive else value > low)
        _need(ok, prefix + name, value, f"must be a finite number {'>=' if inclusive else '>'} {low}")


def _check_text(c, p="text_config.") -> None:
    _ints(c, p, "vocab_size hidden_size num_hidden_layers num_attention_heads head_dim qk_rope_head_dim q_lora_rank "
          "o_lora_rank o_groups moe_intermediate_size n_routed_experts num_experts_per_tok sliding_window "
          "max_position_embeddings candidate_topk_blocks candidate_block_size index_n_heads index_head_dim index_topk "
          "hc_mult hc_sinkhorn_iters engram_max_ngram_size engram_vocab_size engram_n_heads engram_head_dim", 1)
    _ints(c, p, "n_shared_experts num_nextn_predict_layers engram_compressed_vocab_size", 0)
    _floats(c, p, "rms_norm_eps hc_eps rope_theta compress_rope_theta routed_scaling_factor gate_temp swiglu_limit", 0)
    _floats(c, p, "initializer_range gate_bias_update_factor dspark_loss_weight", 0, inclusive=True)
    for name, value in _FIXED.items():
        _need(getattr(c, name) == value and type(getattr(c, name)) is type(value), p + name, getattr(c, name),
              f"V4.1 implements only {value!r}")
    _need(c.attention_dropout == 0, p + "attention_dropout", c.attention_dropout, "attention dropout is not implemented; use 0.0")
    _need(c.scoring_func in ("sqrtsoftplus", "softmax", "sigmoid"), p + "scoring_func", c.scoring_func,
          "use sqrtsoftplus (V4.1), softmax or sigmoid")
    _need(isinstance(c.norm_topk_prob, bool), p + "norm_topk_prob", c.norm_topk_prob, "must be true or false")
    _need(c.num_experts_per_tok <= c.n_routed_experts, p + "num_experts_per_tok", c.num_experts_per_tok,
          f"cannot exceed n_routed_experts = {c.n_routed_experts}")
    _need(c.qk_rope_head_dim % 2 == 0 and c.qk_rope_head_dim <= c.head_dim, p + "qk_rope_head_dim",
          c.qk_rope_head_dim, f"must be even and at most head_dim = {c.head_dim}")
    for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                 "engram_num_embeddings", "dspark_target_layer_ids"):
        value = getattr(c, name)
        _need(isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value), p + name, value,
              "must be a list of non-negative integers")
    _need(len(c.engram_num_embeddings) == len(c.engram_layer_ids), p + "engram_num_embeddings",
          c.engram_num_embeddings, f"needs one table size per engram_layer_ids entry ({c.engram_layer_ids}); "
          "leave it out to take each table's size from its hash primes")
    _need(c.engram_device in (None, "cpu"), p + "engram_device", c.engram_device,
          "use None (each table on its block's device) or 'cpu' (tables in host memory, rows copied per forward)")
    _need(_is_int(c.candidate_source_layer_id) and c.candidate_source_layer_id >= -1, p + "candidate_source_layer_id",
          c.candidate_source_layer_id, "must be a layer index or -1 (none)")
    yarn = c.rope_scaling
    _need(isinstance(yarn, dict) and all(k in yarn for k in _YARN_KEYS), p + "rope_scaling", yarn,
          f"must be a dict with the YaRN keys {list(_YARN_KEYS)}")
    unknown = sorted(set(yarn) - set(_YARN_KEYS) - set(_YARN_IGNORED))
    _need(not unknown, p + "rope_scaling", yarn, f"unknown keys {unknown}; the keys are {list(_YARN_KEYS)}")
    _need(yarn["rope_type"] == "yarn", p + "rope_scaling.rope_type", yarn["rope_type"], "V4.1 uses 'yarn'")
    _ints(yarn, p + "rope_scaling.", "original_max_position_embeddings", 1)
    _floats(yarn, p + "rope_scaling.", "factor beta_fast beta_slow", 0)


def _engram_table_rows(c, p="text_config.") -> list:
    """``engram_num_embeddings`` when only the layer ids are given: a layer's table has as many rows as the sum
    of its (max_ngram_size - 1) * n_heads hash primes (architecture.md §9.2), which for the released layer ids
    [1, 14] are the released [384006168, 384016682]; no Engram layers, no tables."""
    _need(isinstance(c.engram_layer_ids, list) and all(_is_int(v) and v >= 0 for v in c.engram_layer_ids),
          p + "engram_layer_ids", c.engram_layer_ids, "must be a list of non-negative integers")
    if not c.engram_layer_ids:
        return []
    _ints(c, p, "engram_vocab_size engram_n_heads", 1)
    _ints(c, p, "engram_max_ngram_size", 2)  # n-grams of 2 .. max_ngram_size tokens
    return list(_prime_sums(tuple(c.engram_layer_ids), c.engram_max_ngram_size, c.engram_n_heads,
                            c.engram_vocab_size))


@functools.lru_cache(maxsize=16)
def _prime_sums(layer_ids: tuple, max_ngram_size: int, n_heads: int, vocab_size: int) -> tuple:
    # the released sizes take ~50 ms of prime search: once per process
    primes = engram_primes(layer_ids, max_ngram_size, n_heads, vocab_size)
    return tuple(int(primes[layer].sum()) for layer in layer_ids)


def _check_vision(c, p="vision_config.") -> None:
    _ints(c, p, "hidden_size num_attention_heads intermediate_size patch_size downsample_ratio", 1)
    _ints(c, p, "num_hidden_layers min_pixels", 0)
    _ints(c, p, "max_image_tokens", 4)  # the smallest image span: START, one image token, NEWLINE, END
    _floats(c, p, "rope_theta rms_norm_eps", 0)
    _need(c.hidden_size % c.num_attention_heads == 0, p + "hidden_size", c.hidden_size,
          f"must divide into num_attention_heads = {c.num_attention_heads}")
    if c.max_wh_ratio is not None:
        _floats(c, p, "max_wh_ratio", 0)


def check_config_values(config, dtype=None) -> None:
    """Range-check a text, vision or outer config's fields; ``ValueError`` names the field and the rule.

    The outer config also checks ``dtype`` (a floating torch dtype or its name) and ids against the vocabulary."""
    if isinstance(config, DeepseekV41TextConfig):
        return _check_text(config)
    if isinstance(config, DeepseekV41VisionConfig):
        return _check_vision(config)
    names = ("float32", "bfloat16", "float16", "float64")
    _need(dtype in (None, "auto") or dtype in names or (isinstance(dtype, torch.dtype) and dtype.is_floating_point),
          "dtype", dtype, f"use one of {list(names)} (or 'auto')")
    _need(config.dequantize_base_checkpoint is None or isinstance(config.dequantize_base_checkpoint, bool),
          "dequantize_base_checkpoint", config.dequantize_base_checkpoint,
          "must be true (decode FP8/FP4 to floating point), false (keep them) or null (keep them when the checkpoint "
          "is quantized)")
    vocab = config.text_config.vocab_size
    # Checked whenever it is set (a saved config is read by other code too: processors, serving engines); unset
    # (None) is allowed only without a vision tower, which never places it.
    if config.image_token_id is not None or config.vision_config.num_hidden_layers:
        _need(_is_int(config.image_token_id) and 0 <= config.image_token_id < vocab, "image_token_id",
              config.image_token_id, f"must be a token id in [0, text_config.vocab_size = {vocab})"
              + ("; a vision tower needs it (the id the processor puts at image positions)"
                 if config.image_token_id is None else ""))
