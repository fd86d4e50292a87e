"""Engine settings of the `freetoken` Triton model: config.pbtxt `parameters` <-> EngineConfig (the serving
knobs beside them are ServingConfig's, serving/config.py).

Every EngineConfig field is a string parameter of the same name; an empty string means "the
EngineConfig default". The serve command overrides any of them with FREETOKEN_<NAME> environment
variables (FREETOKEN_MODEL_PATH, FREETOKEN_DTYPE, FREETOKEN_MAX_RUNNING_REQ, ...) and writes the
result into the runtime copy of the repository, so the running config.pbtxt is the whole truth.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Mapping

from freetoken_core.config import EngineConfig
from freetoken_core.serving.config import FIELDS as SERVING_FIELDS, env_name


def engine_param_names() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig)]


def all_param_names() -> list[str]:
    return engine_param_names() + list(SERVING_FIELDS)


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """FREETOKEN_<NAME> variables for known parameter names (unknown ones are ignored)."""
    out = {}
    for name in all_param_names():
        key = env_name(name)
        if key in environ:
            out[name] = environ[key]
    return out


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _convert(name: str, raw: str, annotation: Any) -> Any:
    text = raw.strip()
    args = typing.get_args(annotation) if _is_union(annotation) else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    if optional and text.lower() in ("", "none", "null"):
        return None
    try:
        if base is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base is int:
            return int(text)
        if base is float:
            return float(text)
    except ValueError:
        raise ValueError(f"engine parameter {name}={raw!r} is not a valid {getattr(base, '__name__', base)}") from None
    return text


def engine_config_from_params(params: Mapping[str, str]) -> EngineConfig:
    """Build an EngineConfig from string parameters; blank values keep the dataclass default."""
    hints = typing.get_type_hints(EngineConfig)
    kwargs: dict[str, Any] = {}
    for name in engine_param_names():
        raw = params.get(name)
        if raw is None or (raw.strip() == "" and name != "model_path"):
            continue
        kwargs[name] = _convert(name, raw, hints[name])
    kwargs["model_path"] = resolve_model_path(kwargs.get("model_path") or "")
    cfg = EngineConfig(**kwargs)
    cfg.validate()
    return cfg


def resolve_model_path(path: str) -> str:
    """"" means the default model (SmolLM2-135M-Instruct, fetched and converted on first use)."""
    if path.strip():
        return path.strip()
    from freetoken_core.models.gguf import default_model_path

    return default_model_path()


def parse_model_config_params(model_config: str | Mapping[str, Any]) -> dict[str, str]:
    """Triton hands initialize() the config as JSON: parameters = {key: {"string_value": v}}."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    return {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
