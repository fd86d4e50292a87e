"""What the frontend knows about the model it serves, read once at start from the rendered model repository.

The tokenizer here only counts prompt tokens (the same `Tokenizer` and chat parsing as the ensemble's tokenizer
step, so the count is the engine's): OpenAI's unset `max_tokens` means the rest of the context, and the ensemble
has no input that says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken_core.serving.triton.chat import parse_chat_messages
from freetoken_core.serving.launch.repository import get_parameter
from freetoken_core.serving.openai.reasoning import THINK_OPEN
from freetoken_core.serving.openai.tool_parsers import tool_parser_for_template
from freetoken_core.tokenizer.tokenize import Tokenizer, load_tokenizer

# The engine's own default context when max_seq_len is not set (engine/engine.py MAX_DEFAULT_SEQ_LEN), kept here so
# the frontend does not import the engine (torch) for one number.
ENGINE_DEFAULT_MAX_SEQ_LEN = 32768


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: Tokenizer
    context_limit: int  # tokens one request may hold: prompt + generated
    max_tokens_limit: int | None  # the server's ceiling on max_tokens (max_tokens_limit parameter), if any
    tool_format: str | None  # TOOL_PARSERS key the chat template writes, if any
    starts_in_reasoning: bool | None  # None: the template has no <think>; True: its generation prompt opens one

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """OpenAI's unset max_tokens: the rest of the context (at least 1: a too-long prompt then gets the
        engine's own error naming the limit)."""
        rest = max(1, self.context_limit - prompt_tokens)
        return min(rest, self.max_tokens_limit) if self.max_tokens_limit else rest

    def chat_prompt_tokens(self, messages: list[dict[str, Any]]) -> int:
        return len(self.tokenizer.apply_chat_template(parse_chat_messages(json.dumps(messages)),
                                                      add_generation_prompt=True))

    def text_prompt_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))


def load_served_model(repo_dir: Path, served_name: str | None = None) -> ServedModel:
    """From the runtime repository `serve` rendered: the engine's parameters, the model's tokenizer and config."""
    cfg = (Path(repo_dir) / "freetoken" / "config.pbtxt").read_text()
    model_path = get_parameter(cfg, "model_path") or ""
    if not model_path:
        raise ValueError(f"{repo_dir}/freetoken/config.pbtxt has no model_path")
    tok = load_tokenizer(model_path)
    max_seq_len = int(get_parameter(cfg, "max_seq_len") or 0) or _model_max_positions(model_path)
    rows = int(get_parameter(cfg, "decode_rows_per_req") or 1)
    if (get_parameter(cfg, "speculative") or "").strip():  # a verify step holds k + 1 rows (config.py)
        rows = max(rows, int(get_parameter(cfg, "num_speculative_tokens") or 0) + 1)
    limit = int(get_parameter(cfg, "max_tokens_limit") or 0)
    template = getattr(tok.hf, "chat_template", None) or ""
    return ServedModel(
        name=served_name or Path(model_path.rstrip("/")).name,
        tokenizer=tok,
        context_limit=max_seq_len - (rows - 1),  # the engine's max_req_len
        max_tokens_limit=limit or None,
        tool_format=tool_parser_for_template(template),
        starts_in_reasoning=_prefills_think(tok) if THINK_OPEN in template else None,
    )


def _model_max_positions(model_path: str) -> int:
    path = os.path.join(model_path, "config.json")
    cfg = json.loads(Path(path).read_text()) if os.path.isfile(path) else {}
    cfg = cfg.get("text_config", cfg)
    return min(int(cfg.get("max_position_embeddings") or ENGINE_DEFAULT_MAX_SEQ_LEN), ENGINE_DEFAULT_MAX_SEQ_LEN)


def _prefills_think(tok: Tokenizer) -> bool:
    """Whether the template's generation prompt ends inside `<think>` (the model then writes only `</think>`)."""
    prompt = tok.render_chat([{"role": "user", "content": "x"}], add_generation_prompt=True)
    return prompt.rstrip().endswith(THINK_OPEN)
