"""The text models' tokenizer encodes on the calling thread (serving/triton/triton_io.py model_tokenizer): the tokenizers
library's thread pool would hand each one-prompt encode to a pool thread and wake the caller back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, sys, time
from freetoken_core.serving.triton.triton_io import model_tokenizer
args = {"model_config": json.dumps({"parameters": {"model_path": {"string_value": sys.argv[1]}}})}
tok = model_tokenizer(args)
before = len(os.listdir("/proc/self/task"))
for _ in range(20):
    tok.encode("Explain how a paged KV cache works.")
    time.sleep(0.002)
print(json.dumps({"setting": os.environ.get("TOKENIZERS_PARALLELISM"), "threads_started": len(os.listdir("/proc/self/task")) - before}))
"""


def run(model_path: str, env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if env_value is not None:
        env["TOKENIZERS_PARALLELISM"] = env_value
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", SCRIPT, model_path], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2,
                    reason="counts threads through /proc; a pool needs two CPUs")
def test_the_text_models_encode_without_a_thread_pool(smollm2_path):
    assert run(smollm2_path, None) == {"setting": "false", "threads_started": 0}
    # the deployer's own setting stands (and shows that the pool would start threads otherwise)
    kept = run(smollm2_path, "true")
    assert kept["setting"] == "true" and kept["threads_started"] > 0
