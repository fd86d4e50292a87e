"""The Triton attention kernels on a real GPU in bf16 with Llama-3-8B head shapes, and decode
through a captured CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

if torch.cuda.is_available():
    import attn_gpu_checks as g

TOL = 3e-2  # bf16 output rounding on values of order 1


def test_store_kv_bf16_exact():
    assert g.check_store_kv() == 0.0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_decode_bf16(page_size, num_splits):
    assert g.check_decode(torch.bfloat16, page_size, num_splits=num_splits) < TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_bf16(page_size):
    assert g.check_decode(torch.bfloat16, page_size, rows_per_req=4) < TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_bf16(page_size):
    assert g.check_extend(torch.bfloat16, page_size) < TOL


def test_decode_fp16():
    assert g.check_decode(torch.float16, 16) < 5e-3


def test_cuda_graph_replay_matches_eager():
    assert g.check_graph_replay() < TOL
