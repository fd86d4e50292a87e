"""Programmatic dependent launch switch (freetoken_core/kernels/pdl.py): never on CPU or under the interpreter."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels import pdl


def test_pdl_is_off_for_cpu_tensors():
    x = torch.zeros(4)
    assert not pdl.use_pdl(x)
    assert pdl.pdl_launch(x) == {"USE_PDL": False}  # no launch_pdl keyword: plain launches
    assert not pdl.device_uses_pdl(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_needs_hopper_and_the_switch(monkeypatch):
    x = torch.zeros(4, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.use_pdl(x) == (hopper and pdl.ENABLED)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_launch(x) == {"USE_PDL": False}
