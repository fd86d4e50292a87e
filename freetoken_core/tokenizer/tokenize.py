"""Tokenizer wrapper: encode, chat template, EOS ids, stop words, decode.

`Tokenizer` wraps a transformers tokenizer loaded from local files only (never a hub id). It is the
one object the engine, the scheduler's stop checks, the Triton tokenizer/detokenizer models and the
offline `LLM` share, so every place encodes, decodes and picks EOS ids the same way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(model_path: str) -> "Tokenizer":
    """Load the tokenizer of a local model directory (or a local .gguf file) without touching a hub."""
    AutoTokenizer = _auto_tokenizer_class()  # noqa: N806

    path = os.fspath(model_path)
    if not os.path.exists(path):
        raise ValueError(f"tokenizer path {path!r} does not exist (only local model directories are supported)")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path!r} is a file; give a model directory or a .gguf file")
        hf = AutoTokenizer.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path), local_files_only=True
        )
        config_dir = os.path.dirname(path) or "."
    else:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        config_dir = path
    return Tokenizer(hf, generation_eos=_generation_config_eos(config_dir), model_vocab_size=config_vocab_size(config_dir))


def _auto_tokenizer_class() -> Any:
    """transformers' AutoTokenizer, or PreTrainedTokenizerFast where AutoTokenizer cannot import.

    AutoTokenizer pulls in the model classes (GenerationMixin); in a Triton Python-backend stub whose
    numpy is 1.x next to packages built for numpy 2 that import fails, while the tokenizer.json-based
    fast tokenizer, all a serving path needs, still loads."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer
    except ImportError:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast


def config_vocab_size(model_dir: str) -> int:
    """vocab_size of the model's config.json (a multimodal wrapper's under text_config), read without transformers
    or torch; 0 where the directory has none (a .gguf beside no config.json)."""
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        return 0
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    return int(cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or 0)


def _eos_list(eos: Any) -> list[int]:
    """An eos_token_id setting: an int, a list, or absent (many chat models list several)."""
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _generation_config_eos(model_dir: str) -> list[int]:
    """eos_token_id of generation_config.json."""
    cfg_path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(cfg_path):
        return []
    with open(cfg_path, encoding="utf-8") as f:
        return _eos_list(json.load(f).get("eos_token_id"))


def config_eos_ids(hf_config: Any) -> set[int]:
    """eos_token_id of a loaded model config (token-in/token-out models without tokenizer files)."""
    return set(_eos_list(getattr(hf_config, "eos_token_id", None)))


def has_tokenizer_files(model_path: str) -> bool:
    return any(os.path.exists(os.path.join(model_path, name))
               for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


@dataclass
class Tokenizer:
    """A transformers tokenizer plus what serving needs around it.

    `hf` is the transformers tokenizer; `generation_eos` the eos ids of generation_config.json.
    """

    hf: Any
    generation_eos: list[int] = field(default_factory=list)
    # the model's vocabulary (config.json; 0: unknown): often padded past the tokenizer's, and the engine may sample
    # a padding id, which decodes to no text; an id past both is no token at all (check_ids)
    model_vocab_size: int = 0
    _anchors: np.ndarray | None = field(default=None, init=False, repr=False)
    _special_ids: frozenset[int] | None = field(default=None, init=False, repr=False)

    # ---- sizes and special tokens -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def id_limit(self) -> int:
        """One past the largest valid token id: the model's vocabulary or the tokenizer's, the larger."""
        return max(self.vocab_size, self.model_vocab_size)

    def check_ids(self, field_name: str, ids: Sequence[int]) -> None:
        """Raise ValueError naming the first id outside [0, id_limit) (else decode returns empty text for it)."""
        limit = self.id_limit
        bad = next((t for t in ids if not 0 <= t < limit), None)
        if bad is not None:
            raise ValueError(f"{field_name}: token id {bad} is outside the vocabulary [0, {limit})")

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that `skip_special_tokens=True` drops: the named special tokens and added special tokens."""
        if self._special_ids is None:
            ids = set(self.hf.all_special_ids)
            for tid, added in getattr(self.hf, "added_tokens_decoder", {}).items():
                if getattr(added, "special", False):
                    ids.add(int(tid))
            self._special_ids = frozenset(ids)
        return self._special_ids

    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the tokenizer's eos plus generation_config.json's eos list."""
        ids = set(self.generation_eos)
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        return ids

    # ---- encode -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text; `add_special_tokens` adds BOS/EOS the way the model's tokenizer says."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Render chat messages with the model's template and tokenize them.

        The rendered text already holds every special token the template wants (BOS included), so it is
        encoded without adding special tokens again (a second BOS would change the model's output).
        """
        return self.encode(self.render_chat(messages, add_generation_prompt, **template_kwargs), add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        validate_chat_messages(messages)
        # Content given as OpenAI-style text parts becomes one string: most templates concatenate content.
        messages = [
            {**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m
            for m in messages
        ]
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send plain text instead of chat messages")
        text = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )
        if not isinstance(text, str):  # some versions return a list for batched input
            raise ValueError(f"chat template rendered {type(text).__name__}, expected one string")
        return text

    # ---- stop words ---------------------------------------------------------------------------
    def stop_words_to_ids(self, words: list[str]) -> list[list[int]]:
        """Token-id sequences of stop words (Triton `stop_words` lists).

        A word is encoded on its own, without special tokens. Byte-level BPE gives "Hi" and " Hi" different
        ids, so id sequences catch only the spelling given; text stop strings (IncrementalDetokenizer) catch
        every spelling and are what this engine uses to finish requests.
        """
        if isinstance(words, str):
            words = [words]
        out = []
        for w in words:
            if not isinstance(w, str) or not w:
                raise ValueError(f"stop words must be non-empty strings, got {w!r}")
            out.append(self.encode(w, add_special_tokens=False))
        return out

    def stop_words_tensor(self, words: list[str]) -> np.ndarray:
        """The [2, N] int32 layout of TensorRT-LLM's Triton `stop_words`: row 0 the ids of all words one
        after another, row 1 the end offset of each word, padded with -1."""
        seqs = self.stop_words_to_ids(words)
        flat = [t for s in seqs for t in s]
        n = max(len(flat), len(seqs), 1)
        arr = np.full((2, n), -1, dtype=np.int32)
        arr[0, :] = 0
        arr[0, : len(flat)] = flat
        arr[1, : len(seqs)] = np.cumsum([len(s) for s in seqs]) if seqs else []
        return arr

    # ---- decode -------------------------------------------------------------------------------
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Same text as `hf.decode(ids, skip_special_tokens=...)`, through the Rust tokenizer directly when
        the wrapper would add nothing (10x less overhead: the detokenizer calls this twice per step)."""
        backend = self._backend()
        if backend is not None and not getattr(self.hf, "clean_up_tokenization_spaces", False):
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _backend(self) -> Any:
        """The Rust `tokenizers.Tokenizer` of a fast tokenizer, else None."""
        try:
            return self.hf.backend_tokenizer
        except (AttributeError, NotImplementedError, ValueError):
            return None

    @property
    def anchors(self) -> np.ndarray:
        """bool per token id: decoding may safely START at this token (see detokenize.py).

        An anchor is a non-special token that decodes on its own to non-empty text without U+FFFD and is no
        byte-fallback piece: its bytes begin at a character boundary and end any byte run before it, so the
        text from an anchor on does not depend on the tokens before it (up to a leading space that a
        SentencePiece decoder strips from the first token, which only ever touches the anchor itself).
        """
        if self._anchors is None:
            n = self.vocab_size
            backend = self._backend()
            if backend is not None:
                texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
            else:
                texts = [self.hf.decode([i], skip_special_tokens=False) for i in range(n)]
            pieces = self.hf.convert_ids_to_tokens(list(range(n)))
            anchors = np.zeros(n, dtype=bool)
            special = self.special_ids
            for i, (text, piece) in enumerate(zip(texts, pieces)):
                byte_piece = isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
                anchors[i] = bool(text) and REPLACEMENT_CHAR not in text and not byte_piece and i not in special
            self._anchors = anchors
        return self._anchors

    def is_anchor(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size and bool(self.anchors[token_id])


def validate_chat_messages(messages: Any) -> None:
    """Raise ValueError naming the first malformed message (a list of {"role": str, "content": str})."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"chat message {i} must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"chat message {i} needs a non-empty string 'role', got {role!r}")
        if "content" not in m:
            raise ValueError(f"chat message {i} (role {role!r}) has no 'content'")
        content = m["content"]
        if isinstance(content, list):  # OpenAI-style content parts: only text parts are understood here
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"chat message {i} content part {j} must be {{'type': 'text', 'text': str}}")
        elif not isinstance(content, str):
            raise ValueError(f"chat message {i} 'content' must be a string, got {type(content).__name__}")
