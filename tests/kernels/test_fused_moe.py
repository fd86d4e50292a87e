"""Fused-MoE kernels against their plain-torch references (CPU: Triton's interpreter, fp32/fp16, tiny
shapes), the reference against transformers' own Qwen3-MoE block, and on CUDA: bf16 at Qwen3-30B-A3B's
expert shape and CUDA-graph capture and replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken_core.kernels.fused_moe import (
    fused_moe,
    fused_moe_decode,
    fused_moe_grouped,
    moe_align_block_size,
)
from freetoken_core.kernels.moe_router import topk_softmax
from freetoken_core.kernels.moe_gemv import moe_gemv_gate_up
from freetoken_core.kernels.fused_moe_configs import (
    DECODE_MAX_TOKENS,
    down_config,
    get_config,
    get_decode_config,
)
from freetoken_core.kernels.fused_moe_ref import (
    fused_moe_ref,
    moe_align_block_size_ref,
    topk_softmax_ref,
    topk_softmax_shared_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0,
                 device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Random w13 [E, 2I, H] (gate first) and w2 [E, H, I], scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def make_routing(num_tokens: int, num_experts: int, top_k: int, renormalize: bool = True, seed: int = 1,
                 device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing from wide random logits (no near-ties)."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(num_tokens, num_experts, generator=g)
    return topk_softmax_ref(logits.to(device), top_k, renormalize)


def fixed_routing(ids: list[list[int]], device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Hand-written routing (all tokens to one expert, ...) with random positive weights."""
    topk_ids = torch.tensor(ids, dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    weights = torch.rand(topk_ids.shape, generator=g) + 0.1
    return weights.to(device), topk_ids.to(device)


def random_x(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int = 3, device: str = DEVICE) -> torch.Tensor:
    return torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


# ------------------------------------------------------------------------------------------- router


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 2), (16, 8), (60, 4)])
def test_topk_softmax_matches_reference(num_experts: int, top_k: int, renormalize: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(num_experts * 10 + top_k)
    logits = (3.0 * torch.randn(19, num_experts, generator=g)).to(DEVICE, dtype)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    ref_weights, ref_ids = topk_softmax_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (256, 8)])
def test_topk_softmax_with_a_shared_expert_column(num_experts: int, top_k: int, renormalize: bool):
    """Logits [T, E + 1] (the last column the shared expert's gate) -> k + 1 routes: the top-k of the E
    routed experts, then expert E at sigmoid(gate), in one launch (`topk_softmax_shared_ref`)."""
    g = torch.Generator().manual_seed(num_experts + top_k)
    logits = (3.0 * torch.randn(11, num_experts + 1, generator=g)).to(DEVICE)
    logits[0, -1] = 50.0  # the shared gate never joins the routed top-k, however large
    weights, ids = topk_softmax(logits, top_k, renormalize, shared_expert=True)
    ref_weights, ref_ids = topk_softmax_shared_ref(logits, top_k, renormalize)
    assert ids.shape == (11, top_k + 1) and torch.equal(ids, ref_ids)
    assert torch.all(ids[:, -1] == num_experts) and torch.all(ids[:, :-1] < num_experts)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights[:, -1], torch.sigmoid(logits[:, -1]), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------- alignment


ALIGN_CASES = {
    "ragged": (13, 2, 8, 16, None),
    "many-chunks": (300, 4, 16, 16, None),  # 1200 routes: more than one 1024-wide chunk per program
    "all-to-one-expert": (9, 1, 8, 16, [[3]] * 9),
    "two-experts-only": (5, 2, 8, 4, [[5, 3], [3, 5], [5, 3], [3, 5], [5, 3]]),
    "block-of-one": (6, 2, 4, 1, None),
}


@pytest.mark.parametrize("case", list(ALIGN_CASES))
def test_moe_align_block_size_matches_reference(case: str):
    num_tokens, top_k, num_experts, block, ids = ALIGN_CASES[case]
    topk_ids = (fixed_routing(ids)[1] if ids is not None
                else make_routing(num_tokens, num_experts, top_k)[1])
    got = moe_align_block_size(topk_ids, block, num_experts)
    want = moe_align_block_size_ref(topk_ids, block, num_experts)
    for name, g, w in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, want):
        assert g.dtype == torch.int32 and torch.equal(g, w), name
    sorted_ids, expert_ids, total = want
    flat = topk_ids.reshape(-1).long()
    used = sorted_ids[: int(total)]
    real = used[used < flat.numel()].long()
    assert torch.equal(real.sort().values, torch.arange(flat.numel(), device=real.device))  # each route once
    block_of = expert_ids.repeat_interleave(block)[: int(total)]
    assert torch.equal(flat[real], block_of[used < flat.numel()].long())  # in its expert's block


def test_moe_align_accepts_int64_ids():
    _, ids = make_routing(11, 8, 2)
    got = moe_align_block_size(ids.long(), 16, 8)
    for g, w in zip(got, moe_align_block_size_ref(ids, 16, 8)):
        assert torch.equal(g, w)


# ------------------------------------------------------------------------------------ fused MoE paths


GROUPED_CASES = {  # T, E, k, H, I, routing (None: random)
    "ragged-T": (13, 8, 2, 64, 32, None),
    "top8-E16": (40, 16, 8, 128, 96, None),
    "uneven-K-and-N": (21, 8, 4, 72, 40, None),  # neither K is a multiple of BLOCK_SIZE_K, nor I of N
    "top1-idle-experts": (7, 16, 1, 64, 32, None),
    "all-to-one-expert": (17, 8, 1, 64, 32, [[3]] * 17),
    "two-experts-only": (9, 8, 2, 64, 32, [[6, 1], [1, 6]] * 4 + [[6, 1]]),
}


def _routing_for(case: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts, top_k, _, _, ids = case
    return fixed_routing(ids) if ids is not None else make_routing(num_tokens, num_experts, top_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_fused_moe_grouped_matches_reference(case: str, dtype: torch.dtype):
    num_tokens, num_experts, _, hidden, inter, _ = GROUPED_CASES[case]
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    weights, ids = _routing_for(GROUPED_CASES[case])
    x = random_x(num_tokens, hidden, dtype)
    out = fused_moe_grouped(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **TOL[dtype])


@pytest.mark.parametrize("block_m", [16, 32])
def test_fused_moe_grouped_explicit_config(block_m: int):
    """Grouped program order (GROUP_SIZE_M > 1), a "down" override and a larger alignment block."""
    config = dict(BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=4, num_warps=4,
                  num_stages=1, down=dict(BLOCK_SIZE_N=32, BLOCK_SIZE_K=64))
    w13, w2 = make_experts(8, 64, 40, torch.float32)
    weights, ids = make_routing(19, 8, 2)
    x = random_x(19, 64, torch.float32)
    torch.testing.assert_close(fused_moe_grouped(x, w13, w2, weights, ids, config=config),
                               fused_moe_ref(x, w13, w2, weights, ids), **TOL[torch.float32])


DECODE_CASES = {  # T, E, k, H, I
    "batch1-top1": (1, 8, 1, 64, 32),
    "batch1-top8": (1, 16, 8, 64, 48),
    "batch3-top2-uneven-K": (3, 8, 2, 72, 40),
    "batch4-top4": (4, 8, 4, 64, 32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_fused_moe_decode_matches_reference(case: str, dtype: torch.dtype):
    num_tokens, num_experts, top_k, hidden, inter = DECODE_CASES[case]
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    weights, ids = make_routing(num_tokens, num_experts, top_k, renormalize=False)
    x = random_x(num_tokens, hidden, dtype)
    out = fused_moe_decode(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **TOL[dtype])


@pytest.mark.parametrize("routes", ["tile", "loop"])
@pytest.mark.parametrize("case", ["batch1-top8", "batch3-top2-uneven-K", "batch2-top3-uneven-K"])
def test_fused_moe_decode_down_route_layouts(case: str, routes: str):
    """The down GEMV's two ways over a token's routes (fused_moe_configs.down_routes): all routes in one tile,
    or a loop over them in BLOCK_K chunks (here 16 of an uneven I, so a route spans several chunks; k = 3 is
    padded to 4 lanes by the tile)."""
    num_tokens, num_experts, top_k, hidden, inter = {**DECODE_CASES, "batch2-top3-uneven-K": (2, 8, 3, 48, 40)}[case]
    w13, w2 = make_experts(num_experts, hidden, inter, torch.float32)
    weights, ids = make_routing(num_tokens, num_experts, top_k, renormalize=False)
    x = random_x(num_tokens, hidden, torch.float32)
    tile = dict(BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
    config = {"gate_up": tile, "down": {**tile, "routes": routes}}
    torch.testing.assert_close(fused_moe_decode(x, w13, w2, weights, ids, config=config),
                               fused_moe_ref(x, w13, w2, weights, ids), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_fused_moe_decode_with_a_stacked_shared_expert(num_tokens: int, dtype: torch.dtype):
    """shared_last: each token's last route is the shared expert stacked last (expert E - 1, the routing of
    topk_softmax(shared_expert=True)); the gate/up GEMV takes that expert without reading the ids (on the GPU
    before its PDL wait). The same output as the reference and as the path without the hint, bit for bit."""
    num_experts, top_k, hidden, inter = 9, 3, 64, 40  # 8 routed experts + the shared one, 3 routes + the shared
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    routed_weights, routed_ids = make_routing(num_tokens, num_experts - 1, top_k, renormalize=False)
    gate = torch.rand(num_tokens, 1, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    weights = torch.cat([routed_weights, gate], dim=1).contiguous()
    ids = torch.cat([routed_ids, torch.full_like(routed_ids[:, :1], num_experts - 1)], dim=1).contiguous()
    x = random_x(num_tokens, hidden, dtype)
    out = fused_moe_decode(x, w13, w2, weights, ids, shared_last=True)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **TOL[dtype])
    torch.testing.assert_close(out, fused_moe_decode(x, w13, w2, weights, ids), rtol=0, atol=0)
    # the gate/up GEMV follows the hint, not the ids: a last route naming another expert still runs E - 1
    wrong = ids.clone()
    wrong[:, -1] = 0
    torch.testing.assert_close(moe_gemv_gate_up(x, w13, wrong, shared_last=True), moe_gemv_gate_up(x, w13, ids),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("early", [2, 3, 5, 8])
def test_down_loop_early_routes(early: int, dtype: torch.dtype):
    """The route loop's "early" (one K chunk per route): the first `early` routes as one tile, loaded before the
    PDL wait on the GPU (8 > k = 5 is capped at k), then the rest in the loop: the reference's output, and the
    plain loop's up to fp32 summation order inside a dot product."""
    num_tokens, num_experts, top_k, hidden, inter = 2, 12, 5, 48, 40
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    weights, ids = make_routing(num_tokens, num_experts, top_k, renormalize=False)
    x = random_x(num_tokens, hidden, dtype)
    tile = dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=1)
    plain = {"gate_up": tile, "down": {**tile, "routes": "loop"}}
    out = fused_moe_decode(x, w13, w2, weights, ids, config={**plain, "down": {**plain["down"], "early": early}})
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **TOL[dtype])
    torch.testing.assert_close(out, fused_moe_decode(x, w13, w2, weights, ids, config=plain),
                               **(TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-6, atol=1e-6)))
    with pytest.raises(ValueError, match="early=2 needs BLOCK_K"):  # a route over several chunks: not supported
        short = {**tile, "BLOCK_K": 16}
        fused_moe_decode(x, w13, w2, weights, ids, config={"gate_up": short, "down": {**short, "routes": "loop",
                                                                                       "early": 2}})


def test_down_routes_rule():
    from freetoken_core.kernels.fused_moe_configs import DECODE_CONFIGS, down_routes

    assert [down_routes({}, k) for k in (1, 2, 8, 9, 3)] == ["tile", "tile", "tile", "loop", "loop"]
    assert down_routes({"routes": "tile"}, 9) == "tile"
    assert down_routes(DECODE_CONFIGS[(256, 2048, 512, "default")]["down"], 9) == "loop"  # Qwen3.6, measured
    assert down_routes(DECODE_CONFIGS[(128, 2048, 768, "default")]["down"], 8) == "tile"  # Qwen3-30B-A3B


def test_fused_moe_decode_all_routes_to_one_expert():
    w13, w2 = make_experts(8, 64, 32, torch.float32)
    weights, ids = fixed_routing([[2], [2], [2]])
    x = random_x(3, 64, torch.float32)
    torch.testing.assert_close(fused_moe_decode(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids),
                               **TOL[torch.float32])


@pytest.mark.parametrize("num_tokens", [DECODE_MAX_TOKENS, DECODE_MAX_TOKENS + 1])
def test_fused_moe_dispatch_either_side_of_the_threshold(num_tokens: int):
    w13, w2 = make_experts(8, 64, 32, torch.float32)
    weights, ids = make_routing(num_tokens, 8, 2)
    x = random_x(num_tokens, 64, torch.float32)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), ref, **TOL[torch.float32])
    configs = dict(config=get_config(8, 64, 32, num_tokens, x.dtype),
                   decode_config=get_decode_config(8, 64, 32, x.dtype))
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, **configs), ref, **TOL[torch.float32])


def test_router_and_experts_end_to_end_fp16():
    """topk_softmax feeding the grouped path, renormalize off (Qwen3's class default)."""
    w13, w2 = make_experts(16, 64, 32, torch.float16)
    x = random_x(24, 64, torch.float16)
    logits = (3.0 * torch.randn(24, 16, generator=torch.Generator().manual_seed(5))).to(DEVICE, torch.float16)
    weights, ids = topk_softmax(logits, 4, False)
    ref = fused_moe_ref(x, w13, w2, *topk_softmax_ref(logits, 4, False))
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), ref, **TOL[torch.float16])


def test_empty_batch():
    w13, w2 = make_experts(8, 64, 32, torch.float32)
    x = torch.empty(0, 64, device=DEVICE)
    weights, ids = torch.empty(0, 2, device=DEVICE), torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    assert fused_moe_grouped(x, w13, w2, weights, ids).shape == (0, 64)
    assert fused_moe_decode(x, w13, w2, weights, ids).shape == (0, 64)
    assert fused_moe_ref(x, w13, w2, weights, ids).shape == (0, 64)
    for g, w in zip(moe_align_block_size(ids, 16, 8), moe_align_block_size_ref(ids, 16, 8)):
        assert torch.equal(g, w)


def test_configs_share_the_alignment_block():
    for num_tokens in (1, 8, 64, 512, 4096):
        cfg = get_config(128, 2048, 768, num_tokens, torch.bfloat16)
        assert down_config(cfg)["BLOCK_SIZE_M"] == cfg["BLOCK_SIZE_M"] >= 16


# ------------------------------------------------------------------------------ against transformers


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_reference_equals_transformers_qwen3_moe_block(norm_topk_prob: bool):
    """Same stacked weights, fp32: topk_softmax_ref + fused_moe_ref give transformers' output bit for bit."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=norm_topk_prob, experts_implementation="eager")
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    experts = block.experts
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 64, 32)  # [E,2I,H], [E,H,I]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=g))  # std 1: wide logits, no near-ties
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) / 8)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) / 32 ** 0.5)
        x = torch.randn(24, 64, generator=g)
        want = block(x[None])[0]
        weights, ids = topk_softmax_ref(F.linear(x, block.gate.weight), 2, norm_topk_prob)
        got = fused_moe_ref(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------ GPU only

QWEN3_30B = (128, 2048, 768, 8)  # E, H, I, k


def distinct_logits(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    """bf16 router logits with no ties: random bf16 normals tie often (8-bit mantissa), and a tie is
    ordered differently by torch.topk on CUDA. Each row is a permutation of i / 16 (exact in bf16)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=g) for _ in range(num_tokens)]
    return (torch.stack(rows).float() / 16 - 4).cuda().bfloat16()


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
def test_bf16_qwen3_30b_shape(num_tokens: int):
    num_experts, hidden, inter, top_k = QWEN3_30B
    w13, w2 = make_experts(num_experts, hidden, inter, torch.bfloat16)
    x = random_x(num_tokens, hidden, torch.bfloat16)
    logits = distinct_logits(num_tokens, num_experts, seed=4)
    weights, ids = topk_softmax(logits, top_k, True)
    ref_weights, ref_ids = topk_softmax_ref(logits, top_k, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)  # fp32 math on the bf16 values
    for path in (fused_moe_grouped, fused_moe_decode) if num_tokens <= 8 else (fused_moe_grouped, fused_moe):
        torch.testing.assert_close(path(x, w13, w2, weights, ids).float(), ref, **TOL[torch.bfloat16])


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_cuda_graph_capture_and_replay(num_tokens: int):
    """Router + experts captured once, replayed on new inputs written into the static buffers."""
    num_experts, hidden, inter, top_k = QWEN3_30B
    w13, w2 = make_experts(num_experts, hidden, inter, torch.bfloat16)
    x = random_x(num_tokens, hidden, torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        return fused_moe(x, w13, w2, *topk_softmax(logits, top_k, True))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph compiles the kernels
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (10, 11):
        x.copy_(torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed)))
        logits.copy_(distinct_logits(num_tokens, num_experts, seed))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, step(), rtol=0, atol=0)  # the same kernels eagerly: identical
        ref = fused_moe_ref(x.float(), w13.float(), w2.float(), *topk_softmax_ref(logits, top_k, True))
        torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])


def test_decode_tiles_follow_the_expert_shape_not_the_count(monkeypatch):
    """A shared expert stacked after the routed ones (E + 1 experts) keeps the routed shape's measured
    decode tiles; a shape with no entry gets the defaults. (GPU lookups: the interpreter has its own tiles.)"""
    from freetoken_core.kernels import fused_moe_configs as cfgs

    monkeypatch.setattr(cfgs, "triton_interpreted", lambda: False)
    routed = cfgs.DECODE_CONFIGS[(256, 2048, 512, "default")]
    assert cfgs.get_decode_config(257, 2048, 512, torch.bfloat16) is routed
    assert cfgs.get_decode_config(129, 2048, 768, torch.bfloat16) is cfgs.DECODE_CONFIGS[(128, 2048, 768, "default")]
    other = cfgs.get_decode_config(257, 1024, 512, torch.bfloat16)
    assert all(other is not tiles for tiles in cfgs.DECODE_CONFIGS.values()) and set(other) == {"gate_up", "down"}
