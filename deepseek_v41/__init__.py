"""DeepSeek-V4.1-Flash for Hugging Face Transformers. Importing the package registers the Auto classes."""

from .configuration_deepseek_v41 import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig

__all__ = ["DeepseekV41Config", "DeepseekV41TextConfig", "DeepseekV41VisionConfig"]
