#!/usr/bin/env bash
# Issue 13 in one device call: the in-process side once, then the served side (benchmarks/gpu_perf_analyzer.sh,
# ensemble, gRPC streaming) under each of several settings, so that every row of one call compares.
#   source .gpu-bundle/setup.sh && bash benchmarks/gpu_served_ab.sh SHAPE "SETTING;SETTING;..."
# SHAPE: a bench_serving.py shape (smollm2-135m, llama-3.2-1b), served with random weights and the tokenizer of
# TOKENIZER_DIR (default .gpu-model/smollm2: the default model's tokenizer files and config.json, no weights).
# A SETTING is environment assignments for the server (FREETOKEN_<PARAM>=V overrides a serving parameter), e.g.
#   bash benchmarks/gpu_served_ab.sh smollm2-135m \
#     "FREETOKEN_FREETOKEN_INSTANCES=2;FREETOKEN_FREETOKEN_INSTANCES=4;FREETOKEN_FREETOKEN_INSTANCES=4 FREETOKEN_DETOKENIZER_INSTANCES=8"
# An empty SETTING is the defaults, wherever it stands ("" alone, "X;" = X then the defaults, ";X"). PA_EXPORT=DIR: each setting's exports go to DIR/1, DIR/2, ... in order. CONCURRENCY (default "1 16 64"), PA_MS (3000), PA_TRIALS (10) as in
# gpu_perf_analyzer.sh; INPROCESS=0 skips the in-process side, INPROCESS=2 runs it before and after; REQUESTS
# (default 64; bench_serving.py runs at least 4 waves of each concurrency anyway) prompts in each in-process run.
# IN_WINDOW_S (default PA_MS in seconds): the in-process side measured as perf_analyzer measures the served one,
# windows of this many seconds until the last 3 agree within 10%, their mean (0: the median of three single runs,
# each ~1 s at 64 streams: what every session before the thirty-fourth used). IN_CPUS: run the in-process side
# under `taskset -c` on these CPUs (auto: the CPUs serve gives the engine process, engine_cpus=auto). Issue 13's
# full command (INPROCESS=2, CONCURRENCY="1 16 64 128", SSE at 16 and 64) took 335-390 s in the thirty-fourth session.
# CPU_WAKE_LATENCY_US=N: hold /dev/cpu_dma_latency at N us for the whole call, both sides (host tuning, as tuned's
# latency-performance profile does: benchmarks/host_idle.py); the first lines say whether the host allows it (the
# lent H200 hosts allow it but have no idle states for it to act on: twenty-seventh session).
set -euo pipefail
shape=$1
settings=${2:-""}
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZER_DIR=${TOKENIZER_DIR:-$repo/.gpu-model/smollm2}
export PA_MS=${PA_MS:-3000} PA_TRIALS=${PA_TRIALS:-10} TARGETS=${TARGETS:-ensemble} SSE_CONCURRENCY=${SSE_CONCURRENCY-} STREAM1=${STREAM1-}
export CONCURRENCY=${CONCURRENCY:-"1 16 64"}
in_pin=${IN_CPUS:-}
[ "$in_pin" != auto ] || in_pin=$(python3 -c "from freetoken_core.serving.engine_proc.cpu_affinity import resolve_engine_cpus, format_cpu_list as f; print(f(resolve_engine_cpus('auto')))")
echo "in-process CPUs: ${in_pin:-any}"
in_window_s=${IN_WINDOW_S:-$(python3 -c "print($PA_MS / 1000)")}
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true
# the device's copy of .git may be older than the tree it was sent (the commit line then misleads): the digest of
# the tracked sources says which tree ran (`git ls-files -z freetoken_core model_repository | xargs -0 cat | sha1sum`
# on the sending side gives the same)
# (a file the stale index lists but the tree no longer has is skipped: under pipefail its failing `cat` used to end
# the whole call here, thirty-eighth session)
src=$(cd "$repo" && { git ls-files -z freetoken_core model_repository 2>/dev/null | xargs -0 cat 2>/dev/null || true; } \
  | sha1sum | cut -c1-12)
echo "cpus: $(nproc), commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?'), sources: $src"
python3 "$repo/benchmarks/host_idle.py" info || true
if [ -n "${CPU_WAKE_LATENCY_US:-}" ]; then
  python3 "$repo/benchmarks/host_idle.py" hold "$CPU_WAKE_LATENCY_US" & holder=$!
  trap 'kill $holder 2>/dev/null || true' EXIT
  sleep 0.5
fi
inprocess() {
  echo "=== in-process $shape${1:-}"
  ${in_pin:+taskset -c "$in_pin"} python3 "$repo/benchmarks/bench_serving.py" --model-path "$TOKENIZER_DIR" --shape "$shape" --device cuda \
    --dtype bfloat16 --concurrency $CONCURRENCY --requests ${REQUESTS:-64} --rounds 3 --window-s "$in_window_s" \
    --only offline 2>&1 | grep "in-process"
}
[ "${INPROCESS:-1}" = 0 ] || inprocess
# split on ';' keeping empty settings anywhere ("X;" is X then the defaults; `read -a` would drop a trailing one)
runs=(); rest=$settings
while :; do runs+=("${rest%%;*}"); [[ $rest == *";"* ]] || break; rest=${rest#*;}; done
export_base=${PA_EXPORT:-}
n=0
for setting in "${runs[@]}"; do
  echo "=== served $shape [${setting:-defaults}]"
  # PA_EXPORT: one folder per setting (perf_analyzer refuses to overwrite an export file)
  n=$((n + 1)); [ -z "$export_base" ] || export PA_EXPORT=$export_base/$n
  # the sender's last lines (its rate, send() cost, ack round trip) and the table
  env $setting bash "$repo/benchmarks/gpu_perf_analyzer.sh" "$shape" 2>&1 | tail -${TAIL:-12}
done
# INPROCESS=2: the in-process side once more after the served settings (how far the host drifted meanwhile)
[ "${INPROCESS:-1}" != 2 ] || inprocess " (again)"
