"""Triton kernels run under the interpreter where there is no GPU. Triton decides interpreted or
compiled when a kernel is defined, so the switch must be on before any kernel module is imported
(freetoken_core.attention.triton sets it too; this keeps the tests independent of import order)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
