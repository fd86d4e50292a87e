"""Finding tags in streamed text: what is safe to hand on now, and what must wait for the next chunk."""

from __future__ import annotations


def held_suffix_len(text: str, tag: str) -> int:
    """Length of the longest proper suffix of `text` that is a prefix of `tag`: text that may be the start of
    the tag once the next chunk comes, so it is held back instead of emitted."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_at_tag(buffer: str, tag: str) -> tuple[str, bool, str]:
    """(safe text, whether the tag was found, the rest). Found: the text before the tag and the text after it.
    Not found: the text that cannot start the tag, and the held tail that may."""
    i = buffer.find(tag)
    if i >= 0:
        return buffer[:i], True, buffer[i + len(tag):]
    held = held_suffix_len(buffer, tag)
    return buffer[:len(buffer) - held], False, buffer[len(buffer) - held:]
