"""Engine faults in the served engine: which ones leave the device usable, and a test-only hook.

An exception inside an engine step is one of two kinds:
- a step fault (a bug, a bad tensor, an allocation that failed): the requests of the step(s) in
  flight fail, the scheduler drops their state (Scheduler.fail_step) and keeps serving the rest;
- a device fault: CUDA errors such as an illegal memory access are sticky, every later call on that
  context fails too. Everything in flight fails and the model unloads itself (not ready), so that
  Triton stops routing to it and an orchestrator can restart the server.

`fault_injection` (a freetoken model parameter for tests, empty in production) raises such faults
on purpose: "init" (in initialize()), or "step:seed=S" / "device:seed=S" (in the first engine step
whose batch holds a request with sampling seed S; add ":phase=decode" to wait for a decode step).
Several faults: separated by commas, each fires once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Messages of CUDA errors after which the CUDA context is unusable (cudaErrorIllegalAddress & co.).
_STICKY_CUDA = re.compile(
    r"illegal memory access|device-side assert|unspecified launch failure|misaligned address|"
    r"illegal instruction|uncorrectable ECC|hardware stack error|CUDA error: an illegal|"
    r"CUBLAS_STATUS_EXECUTION_FAILED|cudaErrorLaunchFailure|NVML_SUCCESS == r INTERNAL ASSERT",
    re.IGNORECASE,
)


class InjectedFault(RuntimeError):
    """A step fault raised by the test-only hook."""


class DeviceFatalError(RuntimeError):
    """The device is unusable for this process (raised by the hook; real ones are CUDA errors)."""


def is_device_fatal(exc: BaseException) -> bool:
    """Also a dead tensor-parallel rank: no later step can run (the model must report not ready)."""
    from ...distributed.group import TensorParallelError

    return (isinstance(exc, (DeviceFatalError, TensorParallelError))
            or bool(_STICKY_CUDA.search(f"{type(exc).__name__}: {exc}")))


@dataclass(frozen=True)
class FaultSpec:
    kind: str  # "init" | "step" | "device"
    seed: int | None = None
    phase: str | None = None  # only batches of this phase ("prefill", "decode", "verify")


def parse_fault_specs(text: str) -> list[FaultSpec]:
    return [parse_fault_spec(part) for part in text.split(",") if part.strip()]


def parse_fault_spec(text: str) -> FaultSpec:
    text = text.strip()
    kind, *opts = text.split(":")
    if kind not in ("init", "step", "device"):
        raise ValueError(f"fault_injection={text!r}: the kind must be init, step or device")
    fields: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in ("seed", "phase"):
            raise ValueError(f"fault_injection={text!r}: options are seed=N and phase=NAME")
        fields[key] = value
    if kind != "init" and "seed" not in fields:
        raise ValueError(f"fault_injection={text!r}: step and device faults need seed=N (the victim request)")
    return FaultSpec(kind, int(fields["seed"]) if "seed" in fields else None, fields.get("phase"))


def install_fault_hook(scheduler: Any, specs: list[FaultSpec]) -> None:
    """Wrap the engine's step entry points so that the first batch holding a spec's victim raises
    (each spec fires once)."""
    engine = scheduler.engine
    armed = [s for s in specs if s.kind != "init"]

    def check(phase: str, reqs: list[Any]) -> None:
        for spec in list(armed):
            if spec.phase is not None and phase != spec.phase:
                continue
            if any(r.sampling.seed == spec.seed for r in reqs):
                armed.remove(spec)
                if spec.kind == "device":
                    raise DeviceFatalError("injected device fault: the device is unusable")
                raise InjectedFault(f"injected step fault ({phase} step of {len(reqs)} request(s))")

    launch, verify = engine.launch, engine.forward_verify

    def launch_hooked(batch, *args, **kwargs):
        check(batch.phase, batch.reqs)
        return launch(batch, *args, **kwargs)

    def verify_hooked(batch, *args, **kwargs):
        check(batch.phase, batch.reqs)
        return verify(batch, *args, **kwargs)

    engine.launch, engine.forward_verify = launch_hooked, verify_hooked
    pipeline = getattr(scheduler.spec, "pipeline", None) if scheduler.spec is not None else None
    if pipeline is not None:
        pl_launch = pipeline.launch

        def pipeline_hooked():
            check("verify", pipeline.members)
            return pl_launch()

        pipeline.launch = pipeline_hooked
