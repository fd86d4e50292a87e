"""The secret that tells the ensemble's internal traffic from a client's.

Two routes inside the ensemble give a request powers no client should have: the tokenizer step marks a
request as the ensemble's (the engine then hands the detokenizer a cancel key and paces the stream by
its acks), and the engine's slim responses name the stream's slot in the detokenizers' order table
(a detokenizer waits for its turn there). A client can call `freetoken` and `detokenizer` directly, so
both routes carry proof that they come from this server's own models: the tokenizer step's
`ensemble_key` input must equal the secret, and a slim response's `meta` carries a tag derived from it.
Neither ever reaches a client (the ensemble does not output them).

The secret is per server: `serve` puts a fresh one in the server's environment (the stubs inherit it).
Under a plain `tritonserver`, the stubs of one server agree on one through a 0600 file named after the
server process (their parent), made by whichever stub comes first.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import tempfile
import time
from pathlib import Path

SECRET_ENV = "FREETOKEN_ENSEMBLE_SECRET"
FILE_PREFIX = "freetoken-secret-"


def new_secret() -> str:
    return secrets.token_hex(16)


@functools.lru_cache(maxsize=1)
def ensemble_secret() -> str:
    value = os.environ.get(SECRET_ENV, "").strip()
    return value or _server_file_secret(os.getppid())


def _server_file_secret(server_pid: int) -> str:
    path = Path(tempfile.gettempdir()) / f"{FILE_PREFIX}{server_pid}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # the stub that created it may still be writing it
            text = path.read_text().strip()
            if text:
                return text
            time.sleep(0.01)
        raise RuntimeError(f"{path} stayed empty: remove it and restart the server") from None
    value = new_secret()
    with os.fdopen(fd, "w") as f:
        f.write(value)
    return value


def is_ensemble_key(value: str) -> bool:
    return secrets.compare_digest(value.encode(), ensemble_secret().encode())


@functools.lru_cache(maxsize=1)
def route_tag() -> tuple[int, int]:
    """Two int32 values derived from the secret: what a slim response's `meta` carries (serving/triton/response.py)."""
    digest = hashlib.sha256(b"freetoken-route:" + ensemble_secret().encode()).digest()
    return (int.from_bytes(digest[:4], "little", signed=True), int.from_bytes(digest[4:8], "little", signed=True))
