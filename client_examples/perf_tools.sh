# Sourced by perf_analyzer.sh and genai_perf.sh: put this checkout's .venv first on PATH (no need to activate
# it) and make sure perf_analyzer really runs, else say what to install and exit.
#
# perf_analyzer is a C++ binary. pip's `perf-analyzer` (2.60) ships it in a manylinux_2_38 wheel: it runs where
# glibc is 2.38 or newer (Ubuntu 24.04, ...). Elsewhere (Debian 12: glibc 2.36) pip finds only perf-analyzer
# 0.1.0, a placeholder with no binary. genai-perf drives perf_analyzer, so it needs it too.
# PERF_ANALYZER=/path/to/perf_analyzer uses that binary instead of the one on PATH.

_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -x "$_here/../.venv/bin/python" ]; then
  PATH="$(cd "$_here/../.venv/bin" && pwd):$PATH"
fi

require_perf_analyzer() {
  PERF_ANALYZER=${PERF_ANALYZER:-perf_analyzer}
  local err
  if ! command -v "$PERF_ANALYZER" >/dev/null; then
    err="$PERF_ANALYZER is not on PATH"
  elif err=$("$PERF_ANALYZER" --version 2>&1); then
    PATH="$(dirname "$(command -v "$PERF_ANALYZER")"):$PATH"  # genai-perf runs the first perf_analyzer on PATH
    return 0
  fi
  local glibc pip_version
  glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
  pip_version=$(python3 -c "import importlib.metadata as m; print(m.version('perf-analyzer'))" 2>/dev/null || true)
  {
    echo "perf_analyzer does not run here: $(echo "$err" | head -2)"
    if [ "$pip_version" = "0.1.0" ]; then
      echo "(the pip package perf-analyzer installed here is PyPI's 0.1.0 placeholder: it has no binary)"
    fi
    if [ -n "$glibc" ] && [ "$(printf '%s\n2.38\n' "$glibc" | sort -V | head -1)" != "2.38" ]; then
      echo "pip's perf-analyzer 2.60 wheel needs glibc >= 2.38 and this host has glibc $glibc. Either:"
      echo "  - run the load test from a host with glibc >= 2.38 (Ubuntu 24.04 and later):"
      echo "      pip install -e '.[perf]'   (perf-analyzer and genai-perf)"
      echo "  - or use NVIDIA's Triton SDK container (tritonserver:24.10-py3-sdk), which has both"
      echo "  - or PERF_ANALYZER=/path/to/perf_analyzer (a build of triton-inference-server/perf_analyzer)"
    else
      echo "install it: pip install -e '.[perf]'   (perf-analyzer and genai-perf; or set PERF_ANALYZER=/path/to/perf_analyzer)"
    fi
  } >&2
  exit 1
}
