"""`serve` restarts a dead engine, and gives up (exits non-zero) after a bounded number of restarts.

When the engine dies (its process killed, a sticky CUDA error), the `freetoken` model unloads itself
with the ensemble (serving/engine_proc/faults.py), so `/v2/health/ready` turns false while the unload runs. Once
an unload ends, Triton counts the unloaded models out of its readiness, and the server would say
ready again with no model to serve. So the launcher watches the engine model's readiness and asks
Triton to load the ensemble (and with it the engine model) at once: Triton queues that load behind the
unload, and the server stays not ready until the new engine is up. A load that fails leaves the model
unavailable (not ready either); the next try waits a backoff that doubles. After `engine_restarts`
restarts the launcher stops the server and exits with RESTARTS_SPENT_EXIT, so that a supervisor
(systemd, Kubernetes) restarts the whole pod.
"""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Mapping

log = logging.getLogger(__name__)

RESTARTS_SPENT_EXIT = 3
ENGINE_MODEL = "freetoken"
TOP_MODEL = "ensemble"  # loading it loads every model it composes


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # `engine_restarts`: 0 = never restart, exit at the first engine death
    first_backoff_s: float = 1.0  # before the second try of a restart whose load failed; doubles each time
    max_backoff_s: float = 30.0
    not_ready_polls: int = 2  # consecutive not-ready answers that count as a dead engine (not a slow one)


def http_status(url: str, method: str = "GET", headers: Mapping[str, str] | None = None,
                timeout: float = 2.0) -> int | None:
    """The HTTP status of a request (None: no answer, e.g. a server too busy to answer in time)."""
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method,
                                 headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, OSError):
        return None


class EngineSupervisor:
    """Polled by the launcher's loop: `check()` restarts the engine when its model reports not ready.

    Only an answer that says "not ready" counts: a server too busy to answer a poll is no dead engine."""

    def __init__(self, base_url: str, admin_headers: Mapping[str, str], policy: RestartPolicy,
                 load_timeout_s: float = 1800.0) -> None:
        self.base_url = base_url
        self.admin_headers = dict(admin_headers)
        self.policy = policy
        self.load_timeout_s = load_timeout_s
        self.restarts = 0
        self._not_ready = 0
        self._backoff_s = policy.first_backoff_s

    def engine_ready(self) -> bool | None:
        status = http_status(f"{self.base_url}/v2/models/{ENGINE_MODEL}/ready")
        return None if status is None else status == 200

    def check(self) -> bool:
        """One poll; False once the restarts are spent (the caller stops the server and exits)."""
        ready = self.engine_ready()
        if ready is None:
            return True
        if ready:
            self._not_ready = 0
            self._backoff_s = self.policy.first_backoff_s
            return True
        self._not_ready += 1
        if self._not_ready < self.policy.not_ready_polls:
            return True
        if self.restarts >= self.policy.max_restarts:
            log.error("the engine is down and its %d restart(s) are spent (engine_restarts=%d): stopping",
                      self.restarts, self.policy.max_restarts)
            return False
        self.restarts += 1
        log.warning("the engine model is not ready: restarting it (%d of %d)", self.restarts, self.policy.max_restarts)
        t0 = time.monotonic()
        status = http_status(f"{self.base_url}/v2/repository/models/{TOP_MODEL}/load", "POST", self.admin_headers,
                             timeout=self.load_timeout_s)
        if status == 200:
            log.warning("engine restarted in %.1f s", time.monotonic() - t0)
            self._not_ready = 0
            return True
        log.error("restarting the engine failed (HTTP %s); next try in %.0f s", status, self._backoff_s)
        time.sleep(self._backoff_s)
        self._backoff_s = min(2 * self._backoff_s, self.policy.max_backoff_s)
        self._not_ready = self.policy.not_ready_polls  # not ready still: the next poll tries again
        return True
