"""Helpers of the serving tests: Prometheus scraping, polling, a server for a tiny test checkpoint."""

from __future__ import annotations

import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest


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



def serve_checkpoint(path: Path, smollm2_path: str, workdir: Path, params: dict[str, str]):
    """A tritonserver for a tiny random checkpoint of vocabulary 49152, served with SmolLM2's tokenizer (and chat
    template) copied beside it. Returns the launcher's handle; the caller stops it."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        try:
            shutil.copy(f"{smollm2_path}/{name}", Path(path) / name)
        except FileNotFoundError:
            pass
    return start_test_server({**params, "model_path": str(path)}, workdir)


def start_test_server(params: dict[str, str], workdir: Path):
    """A tritonserver on `params` (the launcher's, as `freetoken-core serve`), its repository and log under workdir;
    skips the test where no tritonserver is installed. The caller stops the handle."""
    from freetoken_core.serving.launch.server import start_server
    from freetoken_core.serving.launch.tritonserver import find_tritonserver

    try:
        find_tritonserver()
    except RuntimeError as e:
        pytest.skip(f"no tritonserver: {e}")
    return start_server(params, repo_dir=workdir / "repo", log_path=workdir / "tritonserver.log", ready_timeout=300)
