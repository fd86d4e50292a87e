"""Triton-language kernels, each beside its plain-torch reference (`<op>.py` and `<op>_ref.py`).

Kernel modules import Triton; the `*_ref.py` modules are plain torch (the CPU path of the layers
and the references the tests compare against). Nothing here imports `layers/` or `models/`.
Importing this package decides interpreted vs compiled Triton (`env.configure_triton`).
"""

from ..env import configure_triton

configure_triton()
