"""The block-FP8 weight on its way through the loaders (layers/fp8.py): slices take their scale blocks along and
refuse a cut inside a block (a tensor-parallel shard or a fused segment), pieces join back, and the copy into a
parameter dequantizes to the parameter's dtype."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels.fp8_ref import dequantize_block_fp8
from freetoken_core.layers.fp8 import Fp8BlockWeight
from freetoken_core.layers.linear import copy_checked


def _weight(*shape: int) -> tuple[torch.Tensor, Fp8BlockWeight]:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    q = Fp8BlockWeight.quantize(w)
    return dequantize_block_fp8(q.weight, q.scale_inv), q


@pytest.mark.parametrize("dim,start,length", [(0, 128, 128), (0, 256, 64), (1, 0, 128), (1, 128, 72)])
def test_aligned_slices_keep_their_blocks(dim, start, length):
    real, q = _weight(320, 200)  # partial last blocks in both dimensions: a slice may end at the edge
    part = q.narrow(dim, start, length)
    assert torch.equal(part.dequantize(torch.float32), real.narrow(dim, start, length))


@pytest.mark.parametrize("dim,start,length", [(0, 64, 128), (0, 0, 192), (1, 100, 100)])
def test_a_slice_inside_a_block_is_refused(dim, start, length):
    _, q = _weight(320, 200)
    with pytest.raises(ValueError, match="cuts a 128-element FP8 scale block"):
        q.narrow(dim, start, length)


def test_stacked_experts_slice_and_join_along_rows():
    real, q = _weight(4, 512, 256)  # [E, 2I, H], I = 256: each rank's gate rows then its up rows (2 ranks)
    rank1 = Fp8BlockWeight.cat([q.narrow(1, 128, 128), q.narrow(1, 384, 128)], dim=1)
    want = torch.cat([real[:, 128:256], real[:, 384:]], dim=1)
    assert torch.equal(rank1.dequantize(torch.float32), want)
    assert torch.equal(q.narrow(0, 1, 2).dequantize(torch.float32), real[1:3])  # the expert dimension: any slice


def test_copy_into_a_parameter_dequantizes_to_its_dtype():
    real, q = _weight(192, 128)
    dst = torch.empty(192, 128, dtype=torch.bfloat16)
    copy_checked(dst, q)
    assert torch.equal(dst, real.to(torch.bfloat16))


def test_scales_that_do_not_match_are_named():
    _, q = _weight(256, 256)
    with pytest.raises(ValueError, match=r"weight_scale_inv shape \(2, 1\) does not match weight \(256, 256\)"):
        Fp8BlockWeight(q.weight, q.scale_inv[:, :1])
