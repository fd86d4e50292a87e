"""What the served path's log lines share: the format every served process logs in, and the periodic report lines
(the sender thread's, the engine process's step pace).

Kept free of imports that start threads (numpy's BLAS pool): the engine process imports it before it moves onto its
own CPUs (serving/engine_proc/engine_server.py engine_main), and a thread started before that would stay behind."""

from __future__ import annotations

import logging

REPORT_INTERVAL_S = 10.0  # how often a busy sender thread or engine process logs its line


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else 0.0


def configure_logging(process_tag: str = "") -> None:
    """INFO lines to stderr (which Triton's log collects) in one format for every served process; process_tag
    marks a process whose module names alone would not say where a line came from (the engine process)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s{process_tag}: %(message)s")
