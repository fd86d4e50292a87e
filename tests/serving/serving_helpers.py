"""Helpers of the serving tests: Prometheus scraping and polling."""

from __future__ import annotations

import re
import time
import urllib.request


def scrape_metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels kept verbatim)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of all series of `name` whose labels include the given ones."""
    total, found = 0.0, False
    for key, v in metrics.items():
        base = key.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{val}"' in key for k, val in labels.items()):
            total += v
            found = True
    if not found:
        raise KeyError(f"metric {name} {labels} not found")
    return total


def wait_for(pred, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    return last

