"""Offloaded FP8 experts: the host banks and device slots hold block-FP8 values and their scales (a miss copies
both, about half a bf16 expert's bytes), and the slots run the FP8 expert kernels (on CPU under Triton's
interpreter, FREETOKEN_FP8_KEEP=1). Greedy tokens equal the resident FP8 experts' with the host-driven slot pool
and the device-side cache (kernel B copying FP8 bytes), speculation on and off; the cpu executor dequantizes."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams
from freetoken_core.env import kernel_env
from freetoken_core.kernels.fp8_ref import FP8_DTYPE
from tests.models.fp8_checkpoints import write_fp8_pair
from tests.models.moe_checkpoints import PROMPTS, make_tiny_moe

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
MOE = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, decoder_sparse_step=2,
           mlp_only_layers=[0], num_hidden_layers=2, norm_topk_prob=True)


@pytest.fixture(autouse=True)
def _keep_fp8(monkeypatch):
    monkeypatch.setenv("FREETOKEN_FP8_KEEP", "1")
    kernel_env.cache_clear()
    yield
    kernel_env.cache_clear()


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    return write_fp8_pair(make_tiny_moe(tmp_path_factory.mktemp("fp8_offload"), "per_expert", **MOE))[0]


@pytest.fixture(scope="module")
def resident_tokens(fp8_moe):
    """The resident FP8 experts' tokens, the reference every offload strategy must give (run once per module)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FREETOKEN_FP8_KEEP", "1")
        kernel_env.cache_clear()
        want, resident = run(fp8_moe)
        kernel_env.cache_clear()
    experts = resident.scheduler.engine.model.get_submodule("model.layers.1.mlp.experts")
    assert experts.fp8_block is not None and experts.executor is None
    return want


def run(path, speculative=None, **kw):
    llm = LLM(path, dtype="float32", page_size=4, num_pages=300, max_running_req=3, speculative=speculative,
              num_speculative_tokens=1, **kw)
    outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return outs, llm


@pytest.mark.parametrize("device_cache,speculative", [("off", None), ("on", "ngram")])
def test_offloaded_fp8_experts_give_the_resident_fp8_tokens(fp8_moe, resident_tokens, device_cache, speculative):
    want = resident_tokens
    got, llm = run(fp8_moe, speculative, moe_strategy="offload", moe_cache_slots=5, moe_device_cache=device_cache)
    assert got == want
    executor = llm.scheduler.engine.model.get_submodule("model.layers.1.mlp.experts").executor
    assert type(executor).__name__ == ("DeviceExpertCache" if device_cache == "on" else "ExpertSlotPool")
    assert executor.host_w13.dtype == FP8_DTYPE and executor.fp8 is not None
    assert executor.fp8[0].dtype == torch.float32 and executor.fp8[0].shape[0] == 5  # scale slots beside values
    values = executor.host_w13[0].numel() + executor.host_w2[0].numel()
    scales = executor.host_fp8[0][0].numel() + executor.host_fp8[1][0].numel()
    assert executor.bytes_per_expert == values + 4 * scales  # what a miss copies: 1 byte a value, fp32 scales
    stats = llm.scheduler.stats().extra["moe"]
    assert stats["slot_hit_rate"] < 1.0 and stats["bytes_copied_per_token"] > 0


def test_cpu_executor_dequantizes_fp8_experts(fp8_moe, resident_tokens):
    want = resident_tokens
    got, llm = run(fp8_moe, moe_strategy="cpu")
    experts = llm.scheduler.engine.model.get_submodule("model.layers.1.mlp.experts")
    assert experts.fp8_block is None and experts.gate_up_proj.dtype == torch.float32
    assert got == want
