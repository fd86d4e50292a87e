"""freetoken_core: an LLM inference engine (paged KV cache, continuous batching) for Triton Inference Server."""

from .config import EngineConfig, SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the model and tokenizer stacks; import it only when asked for
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)
