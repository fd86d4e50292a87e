"""Stop strings, checked token by token as the scheduler commits them."""

from __future__ import annotations

from typing import Any

from ..config import SamplingParams


class StopChecker:
    """Tells at which committed token a stop string appears (it may span token boundaries)."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        from ..tokenizer.detokenize import IncrementalDetokenizer

        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
        )

    def add(self, token: int) -> str | None:
        """Feed one committed token; return the stop string it completed, or None."""
        if self._detok.check_stop([token]) is None:
            return None
        return self._detok.matched_stop
