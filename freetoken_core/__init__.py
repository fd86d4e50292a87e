"""freetoken_core: an LLM inference engine (paged KV cache, continuous batching) for Triton Inference Server."""

from .env import configure_triton as _configure_triton

# Triton decides interpreted vs compiled when `triton` is first imported; without a GPU its kernels
# run only under the interpreter. Decided before anything imports triton (users may override).
_configure_triton()

from .config import EngineConfig, SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the model and tokenizer stacks; import it only when asked for
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)
