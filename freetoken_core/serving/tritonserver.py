"""Find and prepare the `tritonserver` binary that the nvidia-pytriton wheel ships.

The wheel carries the server, the Python backend and one backend stub per Python version. The
backend directory must hold the stub of the Python that runs our models, and the stub starts the
first `python3` on PATH (it ignores PYTHONPATH), so the server's PATH must lead with this venv.
We copy the backend directory into the cache dir instead of writing into site-packages, which may
be read-only (system installs, shared venvs).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from freetoken_core.models.gguf import _file_lock, freetoken_home


@dataclass
class TritonInstall:
    binary: Path  # the tritonserver executable
    backend_dir: Path  # holds python/ with libtriton_python.so and the stub for this Python


def _pytriton_root() -> Path:
    try:
        import pytriton  # noqa: F401  (located only; its Python API is not used)
    except ImportError as e:
        raise RuntimeError(
            "tritonserver not found: install the serve extra (`pip install -e .[serve]`, which brings "
            "nvidia-pytriton and its tritonserver binary) or put `tritonserver` on PATH"
        ) from e
    return Path(pytriton.__file__).parent / "tritonserver"


def find_tritonserver() -> TritonInstall:
    """Prefer an NGC image's /opt/tritonserver (GPU deployments), else the pytriton wheel's copy."""
    ngc = Path("/opt/tritonserver")
    if (ngc / "bin" / "tritonserver").is_file() and (ngc / "backends" / "python").is_dir():
        return TritonInstall(ngc / "bin" / "tritonserver", ngc / "backends")
    root = _pytriton_root()
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        raise RuntimeError(f"the nvidia-pytriton install has no tritonserver binary at {binary}")
    return TritonInstall(binary, prepare_backend_dir(root))


def prepare_backend_dir(root: Path, dest: Path | None = None) -> Path:
    """Copy backends/python plus the stub matching this Python into a writable directory (once)."""
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton has no Python-backend stub for Python {pyver} (looked at {stub})")
    dest = dest or freetoken_home() / "tritonserver" / f"backends-py{pyver}"
    src_python = root / "backends" / "python"
    with _file_lock(dest.parent / ".backends.lock"):
        target = dest / "python"
        # Recopy when the wheel changed (new version installed over an old cache).
        marker = target / ".source"
        source_id = f"{src_python.resolve()}:{stub.stat().st_mtime_ns}:{stub.stat().st_size}"
        if not (marker.is_file() and marker.read_text() == source_id):
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(src_python, target, ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy2(stub, target / "triton_python_backend_stub")
            os.chmod(target / "triton_python_backend_stub", 0o755)
            marker.write_text(source_id)
    return dest


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for tritonserver: this interpreter's bin first on PATH (the stub's python3)."""
    env = dict(os.environ if base is None else base)
    bindir = str(Path(sys.executable).parent)
    parts = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir]
    env["PATH"] = os.pathsep.join([bindir, *parts])
    # Our models log through Python's logging; keep their output unbuffered so it interleaves sanely.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
