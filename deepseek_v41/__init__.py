"""DeepSeek-V4.1-Flash for Hugging Face Transformers.

Importing the package registers the configs, models, tokenizer and processors with the Auto classes, so
``AutoModelForCausalLM.from_pretrained(folder)`` / ``AutoModelForImageTextToText`` / ``AutoTokenizer`` /
``AutoProcessor`` and the text-generation and image-text-to-text pipelines use these local classes on a released
checkpoint folder or an export (no remote code needed).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from .configuration_deepseek_v41 import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig
from .image_processing_deepseek_v41 import DeepseekV41ImageProcessor
from .modeling_deepseek_v41 import DeepseekV41ForCausalLM, DeepseekV41Model, DeepseekV41PreTrainedModel
from .processing_deepseek_v41 import (
    DeepseekV41Processor,
    DeepseekV41Tokenizer,
    register_processors,
    register_tokenizer,
)

for _config in (DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
AutoModel.register(DeepseekV41Config, DeepseekV41Model, exist_ok=True)
AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
# one class for text and images: the causal LM embeds images itself (pixel_values, image_grid_hws, vision_token_types)
AutoModelForImageTextToText.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
register_tokenizer()
register_processors()

__all__ = [
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "DeepseekV41ImageProcessor",
    "DeepseekV41Model",
    "DeepseekV41PreTrainedModel",
    "DeepseekV41Processor",
    "DeepseekV41TextConfig",
    "DeepseekV41Tokenizer",
    "DeepseekV41VisionConfig",
]
