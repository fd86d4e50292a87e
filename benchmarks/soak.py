"""Soak and cancel-storm benchmark of the served ensemble (issues 14 and 52).

N mixed requests at a given concurrency: gRPC streams, HTTP generate_stream (SSE), HTTP generate,
gRPC non-streaming; greedy, seeded sampling, stop words, chat messages. A fraction is cancelled at a
random point (gRPC client cancel, SSE socket closed mid-stream, HTTP generate socket closed before
the reply), and a fraction are bad requests (soak_requests.BAD_CASES: each must be refused with an
error naming its field, without disturbing the others). Each good request is one of a few templates,
each run alone first (the "solo" reference).

Reports: requests, errors among the good requests, requests with != 1 FINAL, output mismatches against
the solo run (fp32: must be 0; in bf16 batch-dependent kernels may legitimately change greedy output, so
there it is information), bad requests refused clearly, KV pages and (hybrids) linear-state snapshot slots
leaked (from /metrics, once idle), RSS of tritonserver, each stub and the engine process (the `freetoken`
stub's child) sampled every 5% of the run, with the growth over the last 80%, p50/p99 latency. Exit status 0
when the issue-52 targets hold: no error among good requests, no mismatch, every bad request refused clearly,
no page or snapshot slot leaked, engine RSS growth over the last 80% under --max-engine-rss-growth.
`--shared-prefix N` adds templates that open with one shared prefix of about N tokens and their second turns
(prompt + solo reply + a question), so prefix-cache hits run under the same checks; "no page leaked" then
means free + evictable cached pages == the pool, and free + cached snapshot slots == the snapshot pool
(wait_idle).

    python benchmarks/soak.py --requests 10000 --concurrency 8 --max-tokens 8     # cancels 10%, bad 1%
    python benchmarks/soak.py --requests 2000 --shared-prefix 500   # + chats sharing a prefix, and their 2nd turns
    python benchmarks/soak.py --grpc-url localhost:8001 --http-url localhost:8000 --metrics-url ...  # a running server

tests/serving/test_soak.py runs a short version against the test server.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_requests import (BAD_CASES, KINDS, STREAMING, BadCase, Outcome,  # noqa: E402
                           Template, execute, make_templates, next_turn, run_grpc, shared_prefix_templates)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# --- the server side: metrics and memory ----------------------------------------------------------
def scrape(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + float(value)
            if 'finish_reason="' in name:
                reason = name.split('finish_reason="', 1)[1].split('"', 1)[0]
                out[f"{base}:{reason}"] = out.get(f"{base}:{reason}", 0.0) + float(value)
    return out


def rss_mb(server_pid: int | None) -> dict[str, float]:
    """RSS (MB) of tritonserver, of each Python stub (named by the model it runs) and of the engine process
    (the `freetoken` stub's spawned child; its tensor-parallel workers, if any, as engine_workers)."""
    if server_pid is None:
        return {}
    import psutil

    def model_of(proc: psutil.Process) -> str | None:
        cmd = " ".join(proc.cmdline())
        return next((m for m in ("tokenizer", "freetoken", "detokenizer") if f"/{m}/1/model.py" in cmd), None)

    try:
        server = psutil.Process(server_pid)
        out = {"tritonserver": server.memory_info().rss / 2**20}
        for child in server.children(recursive=True):
            model = model_of(child)
            if model:
                name = f"stub:{model}"
            elif "spawn_main" in " ".join(child.cmdline()):
                name = "engine" if model_of(child.parent()) == "freetoken" else "engine_workers"
            else:
                continue  # multiprocessing's resource tracker: a few MB, not ours
            out[name] = out.get(name, 0.0) + child.memory_info().rss / 2**20
        return out
    except psutil.Error:
        return {}


# --- the run --------------------------------------------------------------------------------------
@dataclass
class SoakConfig:
    requests: int = 300
    concurrency: int = 8
    cancel_fraction: float = 0.1
    max_tokens: int = 24
    seed: int = 0
    bad_fraction: float = 0.01
    shared_prefix: int = 0  # > 0: templates that share a prefix of about this many tokens, and their second turns


@dataclass
class SoakReport:
    requests: int
    cancelled: int
    completed: int
    errors: int  # among the good (not bad, not cancelled) requests
    bad_finals: int  # completed requests (and bad gRPC ones) with != 1 FINAL
    mismatches: int  # completed requests whose text differs from their template's solo run
    bad_requests: int
    bad_unclear: int  # bad requests accepted, or refused by an error that does not name the field
    leaked_pages: float  # pages neither free nor evictable once idle
    cached_pages_after: float  # evictable: the prefix cache's pages, held by no request once idle
    leaked_snapshot_slots: float  # hybrids: linear-state snapshot slots neither free nor evictable once idle
    snapshot_slots: float  # hybrids: the snapshot pool's slots (0: an attention-only model)
    prefix_hit_tokens: float  # prompt tokens served from the prefix cache during the run
    shared_completed: int  # completed requests of the shared-prefix templates and their second turns
    running_after: float
    waiting_after: float
    aborted: float  # finish_reason="abort" counted by the engine during the run
    p50_s: float
    p99_s: float
    wall_s: float
    rss_before_mb: dict[str, float]
    rss_at_20pct_mb: dict[str, float]
    rss_after_mb: dict[str, float]
    by_kind: dict[str, int] = field(default_factory=dict)
    rss_curve: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (requests done, RSS) every 5%
    examples: list[str] = field(default_factory=list)  # a few errors / mismatches, for the reader

    def rss_growth_pct(self, start: str = "rss_at_20pct_mb") -> dict[str, float]:
        a, b = getattr(self, start), self.rss_after_mb
        return {k: 100.0 * (b[k] - a[k]) / a[k] for k in a if k in b and a[k]}


def make_plan(cfg: SoakConfig, templates: list[Template]) -> list[tuple[str, Template, object, BadCase | None]]:
    """(kind, template, cancel point or None, bad case or None) per request. Bad requests sit at even
    intervals and take the cases (and each case its transports) in turn, so a short run meets every case."""
    rng = random.Random(cfg.seed)
    cases = BAD_CASES
    bad_every = round(1 / cfg.bad_fraction) if cfg.bad_fraction > 0 else 0
    plan: list[tuple[str, Template, object, BadCase | None]] = []
    for i in range(cfg.requests):
        if bad_every and i % bad_every == bad_every // 2:
            n = i // bad_every
            case = cases[n % len(cases)]
            kind = case.kinds[(n + n // len(cases)) % len(case.kinds)]  # neighbours differ, every case meets each
            plan.append((kind, case.template, None, case))
            continue
        kind, tpl = KINDS[i % len(KINDS)], rng.choice(templates)
        cancel = None
        if rng.random() < cfg.cancel_fraction:
            cancel = rng.randint(1, max(1, cfg.max_tokens // 2)) if STREAMING[kind] else rng.uniform(0.05, 1.0)
        plan.append((kind, tpl, cancel, None))
    return plan


def wait_idle(metrics_url: str, timeout: float = 120.0) -> dict[str, float]:
    """Until nothing runs or waits and every page and snapshot slot is free (or the timeout); returns the last
    scrape.

    With prefix caching the free list alone no longer refills the pool: finished requests' pages stay cached.
    The engine's free-pages gauge counts the cached pages no request holds (evicted on demand), so the idle
    invariant is free list + evictable cached pages == pool, i.e. free == total, with every cached page among
    them; a hybrid's snapshot slots likewise (cached snapshots are never held, all evictable)."""
    deadline = time.monotonic() + timeout
    m = scrape(metrics_url)
    while time.monotonic() < deadline:
        m = scrape(metrics_url)
        if (not m.get("freetoken_num_requests_running") and not m.get("freetoken_num_requests_waiting")
                and m.get("freetoken_kv_cache_free_pages") == m.get("freetoken_kv_cache_total_pages")
                and not leaked_snapshot_slots(m)):
            break
        time.sleep(0.2)
    return m


def leaked_snapshot_slots(m: dict[str, float]) -> float:
    """Snapshot slots neither free nor evictable (meaningful once idle; 0 on attention-only models)."""
    total = m.get("freetoken_prefix_cache_snapshot_slots_total", 0)
    return total - m.get("freetoken_prefix_cache_snapshot_slots_free", 0)


def run_soak(grpc_url: str, http_url: str, metrics_url: str, cfg: SoakConfig, server_pid: int | None = None,
             log=print) -> SoakReport:
    http_host, http_port = http_url.rsplit(":", 1)[0], int(http_url.rsplit(":", 1)[1])
    templates = make_templates(cfg.max_tokens)
    shared = shared_prefix_templates(cfg.max_tokens, cfg.shared_prefix) if cfg.shared_prefix else []
    solo: dict[str, str] = {}

    def solo_run(tpl: Template) -> None:  # the reference: each template alone on the server
        ref = run_grpc(grpc_url, tpl, True, None)
        if ref.error or ref.finals != 1:
            raise RuntimeError(f"solo run of {tpl.name} failed: {ref}")
        solo[tpl.name] = ref.text

    for tpl in templates + shared:
        solo_run(tpl)
    turns2 = [next_turn(tpl, solo[tpl.name]) for tpl in shared]
    for tpl in turns2:
        solo_run(tpl)
    templates += shared + turns2
    log(f"solo runs of {len(templates)} templates done")
    plan = make_plan(cfg, templates)
    wait_idle(metrics_url)
    m0 = scrape(metrics_url)
    rss0 = rss_mb(server_pid)
    rss20: dict[str, float] = {}
    curve: list[tuple[int, dict[str, float]]] = [(0, rss0)]
    results: list[tuple[Outcome, BadCase | None]] = []
    lock = threading.Lock()
    work: queue.Queue = queue.Queue()
    for item in plan:
        work.put(item)

    def worker() -> None:
        nonlocal rss20
        while True:
            try:
                kind, tpl, cancel, bad = work.get_nowait()
            except queue.Empty:
                return
            try:
                o = execute(kind, tpl, cancel, grpc_url, http_host, http_port)
            except Exception as e:  # noqa: BLE001 (a client-side failure is an error of the run)
                o = Outcome(tpl.name, kind, cancel is not None, error=f"client: {type(e).__name__}: {e}")
            with lock:
                results.append((o, bad))
                done = len(results)
                if done == max(1, cfg.requests // 5):
                    rss20 = rss_mb(server_pid)
                if done % max(1, cfg.requests // 20) == 0:
                    curve.append((done, rss_mb(server_pid)))
                if done % max(1, cfg.requests // 10) == 0:
                    log(f"  {done}/{cfg.requests} requests")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(cfg.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    m1 = wait_idle(metrics_url)
    rss1 = rss_mb(server_pid)
    outcomes = [o for o, bad in results if bad is None]
    bads = [(o, bad) for o, bad in results if bad is not None]
    done = [o for o in outcomes if not o.cancelled]
    errors = [o for o in done if o.error]
    bad_finals = [o for o in done if not o.error and o.finals != 1]
    bad_finals += [o for o, _ in bads if o.kind.startswith("grpc") and o.finals != 1]
    mism = [o for o in done if not o.error and o.text != solo[o.template]]
    unclear = [(o, bad) for o, bad in bads if not (o.error and bad.field in o.error)]
    lat = sorted(o.latency_s for o in done if not o.error) or [0.0]
    by_kind: dict[str, int] = {}
    for o, bad in results:
        key = f"{o.kind}{'/cancelled' if o.cancelled else ''}{'/bad' if bad else ''}"
        by_kind[key] = by_kind.get(key, 0) + 1
    examples = [f"error {o.kind} {o.template}: {o.error}" for o in errors[:3]]
    examples += [f"mismatch {o.kind} {o.template}: {o.text!r} != {solo[o.template]!r}" for o in mism[:3]]
    examples += [f"bad request {o.template} over {o.kind} not refused by naming {bad.field!r}: "
                 f"{o.error or 'accepted: ' + repr(o.text)}" for o, bad in unclear[:3]]
    return SoakReport(
        requests=len(results), cancelled=len(outcomes) - len(done), completed=len(done), errors=len(errors),
        bad_finals=len(bad_finals), mismatches=len(mism), bad_requests=len(bads), bad_unclear=len(unclear),
        leaked_pages=m1.get("freetoken_kv_cache_total_pages", 0) - m1.get("freetoken_kv_cache_free_pages", 0),
        cached_pages_after=m1.get("freetoken_prefix_cache_pages", 0),
        leaked_snapshot_slots=leaked_snapshot_slots(m1),
        snapshot_slots=m1.get("freetoken_prefix_cache_snapshot_slots_total", 0),
        prefix_hit_tokens=m1.get("freetoken_prefix_cache_hits_total", 0) - m0.get("freetoken_prefix_cache_hits_total", 0),
        shared_completed=sum(o.template.startswith("shared") for o in done),
        running_after=m1.get("freetoken_num_requests_running", 0), waiting_after=m1.get("freetoken_num_requests_waiting", 0),
        aborted=m1.get("freetoken_request_finished_total:abort", 0) - m0.get("freetoken_request_finished_total:abort", 0),
        p50_s=lat[len(lat) // 2], p99_s=lat[min(len(lat) - 1, int(len(lat) * 0.99))], wall_s=wall,
        rss_before_mb=rss0, rss_at_20pct_mb=rss20, rss_after_mb=rss1, by_kind=by_kind, examples=examples,
        rss_curve=curve,
    )


def format_report(r: SoakReport) -> str:
    lines = [
        f"requests {r.requests} (cancelled {r.cancelled}, completed {r.completed}, bad {r.bad_requests}) "
        f"in {r.wall_s:.1f} s",
        f"errors among good {r.errors}   != 1 FINAL {r.bad_finals}   mismatches vs solo {r.mismatches}   "
        f"bad requests not refused clearly {r.bad_unclear} of {r.bad_requests}",
        f"leaked KV pages {r.leaked_pages:g} (cached, evictable {r.cached_pages_after:g})   running after {r.running_after:g}   waiting after {r.waiting_after:g}   "
        f"engine aborts {r.aborted:g}",
        f"leaked snapshot slots {r.leaked_snapshot_slots:g} of {r.snapshot_slots:g}",
        f"prompt tokens from the prefix cache {r.prefix_hit_tokens:g}   shared-prefix requests completed "
        f"{r.shared_completed}",
        f"latency p50 {r.p50_s:.2f} s   p99 {r.p99_s:.2f} s",
        "by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(r.by_kind.items())),
    ]
    growth = r.rss_growth_pct()
    for name in sorted(r.rss_after_mb):
        lines.append(f"RSS {name:<18} before {r.rss_before_mb.get(name, 0):7.1f} MB   at 20% "
                     f"{r.rss_at_20pct_mb.get(name, 0):7.1f} MB   after {r.rss_after_mb[name]:7.1f} MB   "
                     f"growth over the last 80%: {growth.get(name, 0.0):+.2f}%")
    if len(r.rss_curve) > 2:
        for name in sorted(r.rss_after_mb):
            lines.append(f"RSS {name:<18} by requests done: " + "  ".join(
                f"{done}:{rss.get(name, 0):.0f}" for done, rss in r.rss_curve))
    lines += r.examples
    return "\n".join(lines)


def targets_met(r: SoakReport, max_engine_rss_growth_pct: float) -> bool:
    """Issue 52's bar: nothing wrong among the good requests, every bad one refused clearly, no page or snapshot
    slot held, and the engine process's RSS flat over the last 80% of the run."""
    growth = r.rss_growth_pct().get("engine")
    return not (r.errors or r.bad_finals or r.mismatches or r.bad_unclear or r.leaked_pages or r.leaked_snapshot_slots
                or r.running_after or r.waiting_after) and (growth is None or growth < max_engine_rss_growth_pct)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--bad-fraction", type=float, default=0.01)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="add templates that open with one shared prefix of about this many tokens, and their "
                        "second turns (prompt + reply + a question): the prefix cache's hits under the same checks")
    p.add_argument("--max-engine-rss-growth", type=float, default=2.0, metavar="PCT",
                   help="exit non-zero when the engine process grew more than this over the last 80%% of the run")
    p.add_argument("--model-path", help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="more freetoken parameters")
    p.add_argument("--grpc-url", help="use a running server (with --http-url and --metrics-url)")
    p.add_argument("--http-url")
    p.add_argument("--metrics-url")
    p.add_argument("--server-pid", type=int, help="tritonserver's pid, for RSS (a running server)")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args()
    cfg = SoakConfig(args.requests, args.concurrency, args.cancel_fraction, args.max_tokens, args.seed,
                     args.bad_fraction, args.shared_prefix)
    handle = None
    if args.grpc_url:
        grpc_url, http_url, metrics_url, pid = args.grpc_url, args.http_url, args.metrics_url, args.server_pid
    else:
        import tempfile

        from freetoken_core.serving.launch.server import start_server

        overrides = {"dtype": args.dtype, "device": args.device, "max_running_req": str(max(16, args.concurrency)),
                     "max_nonstream_tokens": "0"}
        if args.model_path:
            overrides["model_path"] = args.model_path
        overrides.update(dict(kv.split("=", 1) for kv in args.param))
        log_path = Path(tempfile.gettempdir()) / "freetoken-soak-tritonserver.log"
        handle = start_server(overrides, log_path=log_path, ready_timeout=600)
        grpc_url, http_url, metrics_url, pid = handle.grpc_url, handle.http_url, handle.metrics_url, handle.process.pid
    try:
        report = run_soak(grpc_url, http_url, metrics_url, cfg, pid)
    finally:
        if handle is not None:
            handle.stop()
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    return 0 if targets_met(report, args.max_engine_rss_growth) else 1


if __name__ == "__main__":
    sys.exit(main())
