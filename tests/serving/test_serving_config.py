"""ServingConfig: every serving knob documented, accepted from config.pbtxt and from FREETOKEN_<NAME>, one default."""

import dataclasses
import re
from pathlib import Path

import pytest

from freetoken_core.config import EngineConfig
from freetoken_core.serving.config import FIELDS, ServingConfig, env_name, field_type, serving_config
from freetoken_core.serving.launch.repository import source_repository

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def other_value(name: str) -> tuple[str, object]:
    """A valid value of `name` that is not its default: (as a parameter's text, as the field holds it)."""
    f = FIELDS[name]
    kind, default, lo, hi = field_type(f), f.default, f.metadata["lo"], f.metadata["hi"]
    if kind is bool:
        return ("0", False) if default else ("1", True)
    if kind is str:
        return ("off", "off") if name == "engine_cpus" else ("anything", "anything")
    value = default + 1 if hi is None or default + 1 <= hi else default - 1
    assert lo is None or value >= lo
    return str(value), kind(value)


def documented_names() -> set[str]:
    return set(re.findall(r"^\| `([a-z_0-9]+)` \|", DOC.read_text(), re.M))


def test_every_serving_and_engine_knob_is_documented():
    names = documented_names()
    assert set(FIELDS) <= names, sorted(set(FIELDS) - names)
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    assert engine <= names, sorted(engine - names)
    assert names <= set(FIELDS) | engine, sorted(names - set(FIELDS) - engine)  # nothing stale


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_field_is_accepted_from_config_pbtxt_and_from_the_environment(name):
    text, value = other_value(name)
    assert getattr(serving_config({name: text}), name) == value
    assert getattr(serving_config({}, {env_name(name): text}), name) == value
    # the environment overrides the parameter
    assert getattr(serving_config({name: str(FIELDS[name].default)}, {env_name(name): text}), name) == value
    # a blank parameter keeps the default (a text knob: blank is its value)
    if field_type(FIELDS[name]) is not str:
        assert getattr(serving_config({name: " "}), name) == FIELDS[name].default


def test_an_unknown_parameter_is_a_start_up_error_naming_it_and_backend_keys_pass():
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['stream_intervall'\]"):
        serving_config({"stream_intervall": "4"})
    config = serving_config({"EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env.tar.gz", "dtype": "float32",
                             "stream_interval": "4"})
    assert config.stream_interval == 4


def test_the_shipped_config_pbtxt_is_known_and_keeps_the_one_default():
    """Every parameter of model_repository/freetoken/config.pbtxt is a knob; a serving knob there holds the
    ServingConfig default (it is listed for the deployer to see, not to set a second default)."""
    text = re.sub(r"#[^\n]*", "", (source_repository() / "freetoken" / "config.pbtxt").read_text())
    params = dict(re.findall(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text))
    assert set(params) & set(FIELDS)  # the serving knobs a deployer changes are listed there
    assert serving_config(params) == ServingConfig()


def test_a_value_out_of_range_names_the_parameter_and_its_range():
    with pytest.raises(ValueError, match="detok_inflight_budget must be a whole number from 0"):
        serving_config({"detok_inflight_budget": "-1"})
    with pytest.raises(ValueError, match="engine_process must be 1 or 0"):
        serving_config({"engine_process": "maybe"})
    with pytest.raises(ValueError, match="stream_interval"):
        ServingConfig(stream_interval=0)
