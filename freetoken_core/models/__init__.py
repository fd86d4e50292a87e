"""Models: registry (config architectures -> classes), loader (safetensors -> device), GGUF import."""

from .loader import load_config, load_model, parse_dtype
from .registry import get_model_class, known_architectures, register_model

__all__ = ["get_model_class", "known_architectures", "load_config", "load_model", "parse_dtype", "register_model"]
