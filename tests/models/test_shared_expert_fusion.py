"""The shared expert stacked into the routed experts (models/qwen3_next.py SharedExpertMoeBlock.
fuse_shared_expert, FREETOKEN_FUSED_SHARED_EXPERT): the layer must compute what it computed before,
`routed(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`, on the plain-torch path and through
the fused-MoE Triton kernels (interpreted on CPU: the decode GEMVs and the grouped GEMM, k + 1 routes),
keep every parameter (as views, no second copy), and refuse where it cannot run (offloaded experts,
another intermediate size)."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels.fused_moe_configs import DECODE_MAX_TOKENS
from freetoken_core.models.qwen3_next import SharedExpertMoeBlock

H, E, K, INTER = 32, 8, 2, 16


def make_block(shared_inter: int = INTER, renormalize: bool = True, seed: int = 0) -> SharedExpertMoeBlock:
    torch.manual_seed(seed)
    block = SharedExpertMoeBlock(H, E, K, INTER, renormalize, shared_inter, torch.float32)
    with torch.no_grad():
        for name, p in block.named_parameters():
            scale = 3.0 / H ** 0.5 if name.startswith("gate.") else 1.0 / p.shape[-1] ** 0.5  # wide router: no near-ties
            p.copy_(torch.randn(p.shape) * scale)
    return block.eval()


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, DECODE_MAX_TOKENS + 5])  # decode GEMVs and the grouped GEMM
def test_fused_shared_expert_computes_the_same_layer(renormalize: bool, tokens: int):
    block = make_block(renormalize=renormalize)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    with torch.no_grad():
        expected = block(x)
        assert block.fuse_shared_expert() and block.shared_fused
        got = block(x)  # CPU: the references, with the shared expert as route k
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    # every parameter kept its name and values, now views of the two stacks and the router
    after = dict(block.named_parameters())
    assert set(after) == set(before)
    for name, p in after.items():
        assert torch.equal(p[:E] if name == "gate.weight" else p, before[name]), name
    assert torch.equal(block.gate.weight[E:], before["shared_expert_gate.weight"])  # the router's extra row
    w13, w2 = block.experts.stack_with_shared
    assert w13.shape == (E + 1, 2 * INTER, H) and w2.shape == (E + 1, H, INTER)
    assert block.shared_expert.gate_up_proj.weight.data_ptr() == w13[E].data_ptr()
    assert block.experts.down_proj.data_ptr() == w2.data_ptr()
    assert block.gate.weight.shape == (E + 1, H) and block.gate.out_features == E + 1

    # the Triton kernels (interpreted here) on the k + 1 routes
    from freetoken_core.kernels import fused_moe, moe_router

    # (compiled on a GPU machine: the kernels take device tensors there)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.no_grad():
        xd = x.to(device)
        logits = torch.nn.functional.linear(xd, block.gate.weight.to(device))
        weights, ids = moe_router.topk_softmax(logits, K, renormalize, shared_expert=True)
        out = fused_moe.fused_moe(xd, w13.to(device), w2.to(device), weights, ids)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_fusion_refuses_what_it_cannot_stack():
    assert not make_block(shared_inter=2 * INTER).fuse_shared_expert()  # another intermediate size
    offloaded = make_block()
    offloaded.experts.executor = object()  # an expert executor (offload) owns the routed experts
    assert not offloaded.fuse_shared_expert() and not offloaded.shared_fused
    block = make_block()
    assert block.fuse_shared_expert() and block.fuse_shared_expert()  # twice: nothing more happens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_gpu_fused_shared_expert_qwen36_shape_bf16(tokens: int):
    """Qwen3.6's MoE layer (256 experts of 512, top-8, a shared expert of 512), bf16, the compiled
    kernels: the stacked layer against the separate shared expert."""
    torch.manual_seed(0)
    block = SharedExpertMoeBlock(2048, 256, 8, 512, True, 512, torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, device="cuda") * (3.0 if name.startswith("gate.") else 1.0) / p.shape[-1] ** 0.5)
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        expected = block(x).float()
        assert block.fuse_shared_expert()
        got = block(x).float()
    assert float((got - expected).norm() / expected.norm()) < 1e-2
