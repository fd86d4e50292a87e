"""The engine process's pipe protocol: one typed message per pipe message, used by both ends.

Commands go from a `freetoken` instance (engine_process.py EngineClient) to the engine process
(engine_server.py EngineServer); events come back. Control messages are slotted frozen dataclasses. A step's
DetokenizeMsgs travel as a `StepBatch`, a plain list of plain tuples (`encode` / `decode`): they pickle fastest,
and the engine process pays for that on every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from freetoken_core.config import SamplingParams
from freetoken_core.messages import DetokenizeMsg, EngineStats


class _Wire:
    """Pickles as its constructor call with the fields in order (small, and unpickles frozen slotted classes on
    every Python version)."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return type(self), tuple(getattr(self, name) for name in self.__slots__)


# --- instance -> engine process ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AddRequest(_Wire):
    uid: int
    input_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Abort(_Wire):
    uid: int


@dataclass(frozen=True, slots=True)
class Stop(_Wire):
    """The owner stops the engine (it finishes its step and closes its ranks)."""


@dataclass(frozen=True, slots=True)
class Bye(_Wire):
    """A member of a shared engine leaves; the engine aborts its requests."""


Command = Union[AddRequest, Abort, Stop, Bye]


# --- engine process -> instance ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Ready(_Wire):
    """The engine is up: what the instance needs of it, its own connection index and message ring (if any)."""

    anchors: Any  # the tokenizer's detokenization anchors (None: no tokenizer)
    stats: EngineStats
    max_req_len: int
    index: int = 0
    ring: str | None = None  # the path of this instance's shared-memory message ring (msg_ring.py)


@dataclass(frozen=True, slots=True)
class Failed(_Wire):
    """The engine could not start (or a member could not join): why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Stats(_Wire):
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Dead(_Wire):
    """The engine can run no more steps (a device fault): why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Stopped(_Wire):
    """To a member: the owner stopped the shared engine."""

    reason: str


StepBatch = list  # one step's messages of one instance, each `encode`d
Event = Union[Ready, Failed, Stats, Dead, Stopped, StepBatch]


def encode(msg: DetokenizeMsg) -> tuple:
    """A message as a plain tuple in field order (what pickles fastest; the engine process pays for it per step)."""
    return tuple(msg.__dict__.values())


def decode(fields: tuple) -> DetokenizeMsg:
    return DetokenizeMsg(*fields)
