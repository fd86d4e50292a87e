#!/usr/bin/env python3
"""FreeToken 0.2.1 on block-FP8 random weights (issue 54's peer): run_freetoken.py (from .peer/, as
gpu_peer_ab.sh runs it) with its shape's config.json given the published FP8 releases' `quantization_config`, so
FreeToken's dummy-weight path builds its FP8 linears and experts (`fused_experts_fp8_blockscale`) and fills them.

    PYTHONPATH=/tmp/ftsite python3 benchmarks/dev/peer_fp8.py --shape qwen3-30b-a3b [run_freetoken.py's options]
    QUANT=fp8 bash benchmarks/dev/gpu_peer_ab.sh qwen3-30b-a3b 1 16 2      (ours with --quant fp8 beside it)

`--init core` (run_freetoken.py's default) redraws floating-point tensors as our `load_format=dummy` does and keeps
FreeToken's own fill of FP8 payloads; it would redraw the fp32 block scales too, as N(0, 0.02), so this wrapper gives
them the magnitude of a 128x128 block of N(0, 0.02) weights (amax / 448) afterwards.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The releases' layout (Qwen/Qwen3-30B-A3B-FP8, Qwen/Qwen3.6-35B-A3B-FP8): every linear block-FP8 but these, which
# transformers' rule matches as `entry + "."` inside `name + "."` (so "mlp.gate" leaves mlp.gate_proj quantized).
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b"],
}
SCALE_RANGE = (1.5e-4, 2.5e-4)  # amax of 16,384 N(0, 0.02) draws (~0.08-0.09) / 448


def add_fp8_config(model_dir: Path) -> Path:
    """config.json of a run_freetoken.py shape directory, made a block-FP8 checkpoint's."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = FP8_QUANTIZATION_CONFIG
    path.write_text(json.dumps(cfg, indent=1))
    return model_dir


def fp8_shapes(rf) -> None:
    """run_freetoken.write_shape, then the FP8 config."""
    write_shape = rf.write_shape
    rf.write_shape = lambda name, root: add_fp8_config(write_shape(name, root))


def realistic_scales(rf) -> None:
    """After run_freetoken's --init core redraw (installed by its main), give the block scales their magnitude."""
    use_core = rf.use_core_dummy_init

    def use_core_then_scales() -> None:
        use_core()
        import torch

        import freetoken.engine.engine as eng

        redraw = eng._make_dummy_weight_state_dict

        def make_state(model_state, *, device, host_keys=frozenset()):
            sd = redraw(model_state, device=device, host_keys=host_keys)
            with torch.no_grad():
                for key, t in sd.items():
                    if t.dtype.is_floating_point and t.dtype.itemsize > 1 and "scale" in key.rsplit(".", 1)[-1]:
                        t.uniform_(*SCALE_RANGE)
            return sd

        eng._make_dummy_weight_state_dict = make_state

    rf.use_core_dummy_init = use_core_then_scales


def main() -> int:
    # --help answers here, without the peer's files; every other option is run_freetoken.py's
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            usage="%(prog)s [run_freetoken.py's options]").parse_known_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_prefix_chat import load_peer_template

    rf = load_peer_template()
    fp8_shapes(rf)
    realistic_scales(rf)
    sys.argv[0] = "run_freetoken.py"
    return rf.main()


if __name__ == "__main__":
    sys.exit(main())
