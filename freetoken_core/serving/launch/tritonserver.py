"""Find and prepare the `tritonserver` binary that the nvidia-pytriton wheel ships.

The wheel carries the server, the Python backend and one backend stub per Python version. The
backend directory must hold the stub of the Python that runs our models, and the stub starts the
first `python3` on PATH (it ignores PYTHONPATH), so the server's PATH must lead with this venv.
We copy the backend directory into the cache dir instead of writing into site-packages, which may
be read-only (system installs, shared venvs).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from freetoken_core.models.gguf import _file_lock, freetoken_home

log = logging.getLogger(__name__)


@dataclass
class TritonInstall:
    binary: Path  # the tritonserver executable
    backend_dir: Path  # holds python/ with libtriton_python.so and the stub for this Python
    # Shared libraries the copied stub and backend find through $ORIGIN-relative RPATHs in the wheel
    # (libcudart & co. in nvidia_pytriton.libs); the copies need them on LD_LIBRARY_PATH instead.
    lib_dirs: tuple[Path, ...] = ()


def _pytriton_root() -> Path:
    try:
        import pytriton  # noqa: F401  (located only; its Python API is not used)
    except ImportError as e:
        raise RuntimeError(
            "tritonserver not found: install the serve extra (`pip install -e .[serve]`, which brings "
            "nvidia-pytriton and its tritonserver binary) or put `tritonserver` on PATH"
        ) from e
    # a namespace package (the wheel's tritonserver tree unpacked without its Python API) has no __file__
    return Path(pytriton.__file__).parent / "tritonserver" if pytriton.__file__ else Path(list(pytriton.__path__)[0]) / "tritonserver"


def find_tritonserver() -> TritonInstall:
    """Prefer an NGC image's /opt/tritonserver (GPU deployments), else the pytriton wheel's copy."""
    ngc = Path("/opt/tritonserver")
    if (ngc / "bin" / "tritonserver").is_file() and (ngc / "backends" / "python").is_dir():
        return TritonInstall(ngc / "bin" / "tritonserver", ngc / "backends")
    root = _pytriton_root()
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        raise RuntimeError(f"the nvidia-pytriton install has no tritonserver binary at {binary}")
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(binary, prepare_backend_dir(root), (libs,) if libs.is_dir() else ())


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


def _libpython_dir() -> str | None:
    """The directory of this interpreter's shared libpython, if it was built with one."""
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    if libdir and (ldlib.endswith(".so") or ".so." in ldlib):
        if any(Path(libdir, n).exists() for n in (ldlib, ldlib + ".1.0", f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0")):
            return str(libdir)
    return None


def server_env(install: TritonInstall | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for tritonserver: this interpreter's bin first on PATH (the stub's python3)."""
    env = dict(os.environ if base is None else base)
    # The stub links libpython3.X.so.1.0 dynamically and takes the first one the loader finds (often the
    # distribution's, e.g. Debian's 3.11.2), while the venv's extension modules were built against this
    # interpreter's (e.g. pyenv's 3.11.7): `undefined symbol: _PyModule_Add`. Put ours first.
    extra = [d for d in [_libpython_dir()] if d]
    if install is not None:
        # the wheel's libraries carry hashed names (libcudart-09529672.so...): no clash with torch's
        extra += [str(d) for d in install.lib_dirs]
    if extra:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(extra + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    bindir = str(Path(sys.executable).parent)
    parts = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir]
    env["PATH"] = os.pathsep.join([bindir, *parts])
    # Our models log through Python's logging; keep their output unbuffered so it interleaves sanely.
    env.setdefault("PYTHONUNBUFFERED", "1")
    # tritonserver, three Python stubs and the engine's torch threads share the CPU. libgomp's
    # default (spin ~300k pauses after each parallel region) keeps a core busy between engine steps,
    # while sender and detokenizer need it; OMP_WAIT_POLICY=PASSIVE (no spin) makes every one of the
    # ~300 parallel regions of a CPU decode step wait for a woken thread (the box sat 40% idle). A
    # short spin covers the Python gaps inside a forward and sleeps between steps (2-core box,
    # benchmarks/bench_serving.py: 120-136 tok/s passive, 136-150 with 3000; RESULTS.md).
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", "3000")
    return env


# tritonserver's GPU build probes CUDA at start-up and, on a host without a CUDA driver, logs two of those probes'
# failures at error level; no flag skips them (the CUDA block manager's and the ensemble scheduler's stream).
CPU_HOST_NOTE = ("no CUDA driver on this host: the start-up errors of tritonserver below, 'CudaDriverHelper has not "
                 "been initialized' and 'unable to create stream for ensemble: CUDA driver version is insufficient', "
                 "are its GPU build's CUDA probes and harmless here; every model runs on the CPU")


def cuda_driver_present() -> bool:
    """Whether the CUDA driver library loads, which tritonserver's CUDA probes need. Loading it initializes no
    CUDA context, so the launcher's later forks stay safe."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cpu_host_server_args() -> list[str]:
    """Extra tritonserver arguments for a host without a CUDA driver (none on a CUDA host), logging CPU_HOST_NOTE:
    no pinned-memory pool, which needs CUDA (without the flag the server warns it could not allocate one)."""
    if cuda_driver_present():
        return []
    log.info(CPU_HOST_NOTE)
    return ["--pinned-memory-pool-byte-size=0"]
