"""Rank 0's side: start the worker processes, join the process group, broadcast each step's plan,
watch the workers."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist

from ..parallel import TPInfo, set_tp_info
from ..spawn import spawn_context
from .plan import StepPlan

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120  # a collective waiting on a dead peer fails after this, never hangs


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot run steps any more."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device, choice: str = "auto") -> str:
    """The torch.distributed backend: NCCL on CUDA unless gloo is asked for; gloo on CPU."""
    if device.type != "cuda":
        if choice == "nccl":
            raise ValueError("tensor_parallel_backend 'nccl' needs CUDA; on CPU use gloo (or auto)")
        return "gloo"
    return "gloo" if choice == "gloo" else "nccl"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: GPU r (round robin over the GPUs there are, for gloo on fewer GPUs than ranks)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % torch.cuda.device_count())


class TensorParallelGroup:
    def __init__(self, config: Any, device: torch.device) -> None:
        from .worker import worker_main

        if dist.is_initialized():  # torch keeps one default process group per process
            raise RuntimeError("a tensor-parallel engine is still open in this process: close it first "
                               "(LLM.close() or `with LLM(...) as llm:`)")
        self.world_size = config.tensor_parallel_size
        self.device = device
        self.backend = backend_for(device, config.tensor_parallel_backend)
        if self.backend == "nccl" and torch.cuda.device_count() < self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size} over NCCL needs {self.world_size} GPUs; "
                             f"{torch.cuda.device_count()} visible (tensor_parallel_backend='gloo' runs the ranks "
                             "on fewer GPUs, for checks, not for speed)")
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = spawn_context()
        cfg = dataclasses.asdict(config)
        self.procs = [ctx.Process(target=worker_main, args=(rank, self.world_size, self.init_method, cfg, str(device)),
                                  daemon=True, name=f"freetoken-tp-rank{rank}")
                      for rank in range(1, self.world_size)]
        for p in self.procs:
            p.start()
        dist.init_process_group(self.backend, init_method=self.init_method, rank=0,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        set_tp_info(TPInfo(0, self.world_size, None))
        self.closed = False
        log.info("tensor parallelism: %d ranks (%s), workers %s", self.world_size, self.backend,
                 [p.pid for p in self.procs])

    def check(self) -> None:
        """The watchdog: a dead worker fails the step with its name and exit code."""
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            raise TensorParallelError(
                "tensor-parallel worker(s) died: " + ", ".join(f"rank {r} (exit code {c})" for r, c in dead)
                + "; the engine cannot run further steps")

    def broadcast(self, message: Any) -> None:
        self.check()
        box = [message]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as e:  # a peer vanished mid-collective
            self.check()
            raise TensorParallelError(f"tensor-parallel broadcast failed: {e}") from e

    def send_plan(self, plan: StepPlan) -> None:
        self.broadcast(plan)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([None], src=0)
        except Exception:  # noqa: BLE001  shutting down: a dead peer is fine here
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        set_tp_info(TPInfo())
