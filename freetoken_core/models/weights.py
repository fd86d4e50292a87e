"""The one checkpoint loader: checkpoint names -> (parameter, shard, expert) by the model's declared
rules, then each layer's `weight_loader` copies (and slices) the tensor into place.

A model declares `weight_rules`: regular expressions on checkpoint names with the parameter name
they become and the shard they fill (q/k/v of a fused QKV projection, gate/up of a fused MLP, an
expert's slot in a stacked expert weight via the named group `expert`). The loader knows nothing
of architectures; layers know nothing of checkpoint names (nano-vllm's `packed_modules_mapping` +
`utils/loader.py` split, with the expert index and later a tensor-parallel rank on top).

Every parameter says which units it expects (`load_units`: the shards of a fused weight, the
(expert, shard) pairs of stacked experts); a unit left unfilled, or a checkpoint tensor that maps
to no parameter, is an error naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

import torch
from torch import nn

from ..kernels.fp8_ref import FP8_DTYPE
from ..layers.fp8 import dense_weight

Unit = Hashable  # None (the whole parameter), a shard id, or (expert, shard)


@dataclass(frozen=True)
class WeightRule:
    """Checkpoint names matching `pattern` become `re.sub(pattern, replace, name)` and fill `shard`
    of that parameter; a named group `expert` in the pattern gives the expert index."""

    pattern: str
    replace: str
    shard: str | int | None = None

    def apply(self, name: str) -> tuple[str, str | int | None, int | None] | None:
        m = re.search(self.pattern, name)
        if m is None:
            return None
        expert = m.groupdict().get("expert")
        return re.sub(self.pattern, self.replace, name, count=1), self.shard, (int(expert) if expert is not None else None)


def packed_rules(packed: dict[str, tuple[str, str | int]]) -> tuple[WeightRule, ...]:
    """{".q_proj.": (".qkv_proj.", "q"), ...} -> rules (the common fused-projection renames)."""
    return tuple(WeightRule(re.escape(ckpt), fused, shard) for ckpt, (fused, shard) in packed.items())


def _unit_name(pname: str, unit: Unit) -> str:
    if unit is None:
        return pname
    if isinstance(unit, tuple):
        return f"{pname}[expert {unit[0]}" + (f", {unit[1]}]" if len(unit) > 1 and unit[1] is not None else "]")
    return f"{pname}[{unit}]"


def _module_of(model: nn.Module, pname: str) -> nn.Module:
    return model.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else model


def expected_units(model: nn.Module) -> set[tuple[str, Unit]]:
    out: set[tuple[str, Unit]] = set()
    for pname, param in model.named_parameters():  # a tied weight is listed once
        module = _module_of(model, pname)
        units = module.load_units(param) if hasattr(module, "load_units") else [None]
        out.update((pname, u) for u in units)
    return out


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    rules: Iterable[WeightRule], skip: Any = None) -> None:
    """Copy checkpoint tensors into the model's parameters; raise if a tensor has no parameter or a
    parameter (or a shard of one) is left unset. `skip(name)` drops tensors the model does not use."""
    rules = tuple(rules)
    params = dict(model.named_parameters())
    expected = expected_units(model)
    loaded: set[tuple[str, Unit]] = set()
    for name, tensor in weights:
        if skip is not None and skip(name):
            continue
        for rule in rules:
            hit = rule.apply(name)
            if hit is not None:
                pname, shard, expert = hit
                break
        else:
            pname, shard, expert = name, None, None
        if pname not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        param = params[pname]
        if getattr(tensor, "dtype", None) == FP8_DTYPE and param.dtype != FP8_DTYPE:
            raise ValueError(f"checkpoint tensor {name!r} is float8 but config.json has no fp8 quantization_config "
                             f"(its block scales would be ignored)")
        module = _module_of(model, pname)
        loader = getattr(module, "weight_loader", None)
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.data.copy_(dense_weight(tensor, param))
            units = [None]
        else:
            try:
                units = loader(param, tensor, shard, expert=expert) if expert is not None else loader(param, tensor, shard)
            except ValueError as e:  # the layer says what does not fit; the tensor's name says where
                raise ValueError(f"{name}: {e}") from e
        loaded.update((pname, u) for u in (units if units is not None else [shard]))
    missing = sorted(_unit_name(p, u) for p, u in expected - loaded)
    if missing:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{more}")
