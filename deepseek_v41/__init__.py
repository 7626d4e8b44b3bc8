"""DeepSeek-V4.1-Flash for Hugging Face Transformers.

Importing the package registers the configs and models with the Auto classes, so
``AutoModelForCausalLM.from_pretrained(folder)`` uses these local classes (no remote code needed).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_deepseek_v41 import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig
from .image_processing_deepseek_v41 import DeepseekV41ImageProcessor
from .modeling_deepseek_v41 import DeepseekV41ForCausalLM, DeepseekV41Model, DeepseekV41PreTrainedModel
from .processing_deepseek_v41 import DeepseekV41Processor, register_processors

for _config in (DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
AutoModel.register(DeepseekV41Config, DeepseekV41Model, exist_ok=True)
AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
register_processors()

__all__ = [
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "DeepseekV41ImageProcessor",
    "DeepseekV41Model",
    "DeepseekV41PreTrainedModel",
    "DeepseekV41Processor",
    "DeepseekV41TextConfig",
    "DeepseekV41VisionConfig",
]
