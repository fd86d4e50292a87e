"""The serve command's runtime repository: parameters from env/overrides, EngineConfig round trip."""

from pathlib import Path

import pytest

from freetoken_core.serving.launch.server import free_ports
from freetoken_core.serving.launch.repository import get_parameter, render_repository, set_parameter, source_repository
from freetoken_core.serving.config import ServingConfig, serving_config
from freetoken_core.serving.params import engine_config_from_params, parse_model_config_params


def test_set_parameter_replaces_and_appends():
    text = 'parameters { key: "dtype" value: { string_value: "auto" } }\n'
    text = set_parameter(text, "dtype", "float32")
    assert get_parameter(text, "dtype") == "float32"
    text = set_parameter(text, "model_path", '/a "quoted" \\path')
    assert get_parameter(text, "model_path") == '/a "quoted" \\path'
    assert text.count("parameters") == 2


def test_render_repository_env_and_overrides(tmp_path: Path):
    env = {"FREETOKEN_DTYPE": "float32", "FREETOKEN_MAX_RUNNING_REQ": "4", "FREETOKEN_DETOKENIZER_INSTANCES": "3",
           "FREETOKEN_NOT_A_PARAM": "x"}
    repo = render_repository(tmp_path / "repo", {"max_running_req": "8", "model_path": "/models/m"}, env)
    cfg = (repo / "freetoken" / "config.pbtxt").read_text()
    assert get_parameter(cfg, "dtype") == "float32"  # from env
    assert get_parameter(cfg, "max_running_req") == "8"  # override beats env
    for model in ("freetoken", "tokenizer", "detokenizer"):
        assert get_parameter((repo / model / "config.pbtxt").read_text(), "model_path") == "/models/m"
    assert "count: 3" in (repo / "detokenizer" / "config.pbtxt").read_text()
    assert (repo / "ensemble" / "config.pbtxt").is_file()
    # the source repository is untouched
    assert get_parameter((source_repository() / "freetoken" / "config.pbtxt").read_text(), "model_path") == ""
    with pytest.raises(ValueError, match="unknown engine parameter"):
        render_repository(tmp_path / "r2", {"max_runing_req": "8"}, {})


def test_params_to_engine_config():
    params = parse_model_config_params({"parameters": {
        "model_path": {"string_value": "/m"}, "dtype": {"string_value": "float32"},
        "max_running_req": {"string_value": "16"}, "num_pages": {"string_value": ""},
        "cuda_graph": {"string_value": "false"}, "kv_cache_gb": {"string_value": "0.25"},
    }})
    cfg = engine_config_from_params(params)
    assert (cfg.model_path, cfg.dtype, cfg.max_running_req, cfg.num_pages, cfg.cuda_graph, cfg.kv_cache_gb) == \
        ("/m", "float32", 16, None, False, 0.25)
    with pytest.raises(ValueError, match="max_running_req"):
        engine_config_from_params({"model_path": "/m", "max_running_req": "many"})
    with pytest.raises(ValueError, match="max_running_req must be >= 1"):
        engine_config_from_params({"model_path": "/m", "max_running_req": "0"})
    assert serving_config({}).cancel_check_interval_ms == 200.0
    assert serving_config({}).stream_interval == 1 and serving_config({"stream_interval": "4"}).stream_interval == 4
    for bad in ("0", "2.5"):
        with pytest.raises(ValueError, match="stream_interval"):
            serving_config({"stream_interval": bad})


def test_free_ports_distinct():
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


def test_probes_render_a_decoupled_detokenizer_and_the_engine_checks_it(tmp_path: Path):
    from freetoken_core.serving.triton.freetoken_model import check_detokenizer_decoupled

    plain = render_repository(tmp_path / "plain", {"model_path": "/m"}, {})
    # decoupled always now (issue 13: it acks a response after its send); a plain one is refused with probes
    cfg_path = plain / "detokenizer" / "config.pbtxt"
    assert "model_transaction_policy { decoupled: true }" in cfg_path.read_text()
    cfg_path.write_text(cfg_path.read_text().replace("model_transaction_policy { decoupled: true }", ""))
    with pytest.raises(ValueError, match="needs a decoupled detokenizer"):
        check_detokenizer_decoupled(str(plain / "freetoken"))
    probed = render_repository(tmp_path / "probed", {"model_path": "/m", "nonstream_cancel_probe_ms": "100"}, {})
    cfg = (probed / "detokenizer" / "config.pbtxt").read_text()
    assert "model_transaction_policy { decoupled: true }" in cfg
    check_detokenizer_decoupled(str(probed / "freetoken"))  # no error
    assert serving_config({}).max_nonstream_tokens == 4096 and serving_config({}).nonstream_cancel_probe_ms == 0


def test_send_order_is_on_by_default_and_off_with_a_plain_detokenizer(tmp_path: Path):
    """detok_send_order (on by default since the twenty-fifth session) needs the decoupled detokenizer, which
    marks a response sent only after its send(): with a plain one the engine keeps one response of a stream in
    flight instead of refusing to start."""
    from freetoken_core.serving.triton.freetoken_model import max_inflight, send_order_enabled

    assert serving_config({}).detok_send_order == 1
    repo = render_repository(tmp_path / "repo", {"model_path": "/m"}, {"FREETOKEN_DETOKENIZER_INSTANCES": "2"})
    model_dir = str(repo / "freetoken")
    assert get_parameter((repo / "freetoken" / "config.pbtxt").read_text(), "detok_send_order") == "1"
    assert send_order_enabled(1, model_dir) and not send_order_enabled(0, model_dir)
    assert max_inflight(0, model_dir, send_order_enabled(1, model_dir)) == 4
    # with the inflight budget (the default) the budget sets an ordered stream's window: auto is its floor, 1
    assert max_inflight(0, model_dir, True, budget=16) == 1 and max_inflight(3, model_dir, True, budget=16) == 3
    assert send_order_enabled(1, "")  # no ensemble next to it: as set
    cfg_path = repo / "detokenizer" / "config.pbtxt"
    cfg_path.write_text(cfg_path.read_text().replace("model_transaction_policy { decoupled: true }", ""))
    assert not send_order_enabled(1, model_dir)
    assert max_inflight(0, model_dir, send_order_enabled(1, model_dir)) == 1


def test_dockerfile_default_base_image_is_a_full_ngc_reference():
    """A plain `docker build .` must resolve the base on NVIDIA's registry (issue 14)."""
    text = (source_repository().parent / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3" in text


def test_fla_core_is_in_the_gpu_extra_and_the_image_but_never_in_the_test_venv():
    """Issue 15: fla-core's chunked prefill kernel on CUDA comes with the `gpu` extra, which the Docker
    image installs; the test venv (`make test`: test + serve extras) must not have it (it breaks
    transformers' CPU path for the GDN models the tests compare against)."""
    import tomllib

    root = source_repository().parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("fla-core") for d in extras["gpu"])
    assert not any("fla" in d for name in ("test", "serve") for d in extras[name])
    assert '".[gpu]"' in (root / "Dockerfile").read_text()
    assert '".[test,serve]"' in (root / "Makefile").read_text()


def test_detokenizer_instances_default_and_flow_control_window(tmp_path: Path):
    from freetoken_core.serving.triton.freetoken_model import max_inflight
    from freetoken_core.serving.launch.repository import default_detokenizer_instances

    assert [default_detokenizer_instances(n) for n in (1, 2, 8, 15, 16, 64)] == [1, 1, 2, 3, 16, 16]
    one = render_repository(tmp_path / "one", {"model_path": "/m"}, {"FREETOKEN_DETOKENIZER_INSTANCES": "1"})
    two = render_repository(tmp_path / "two", {"model_path": "/m"}, {"FREETOKEN_DETOKENIZER_INSTANCES": "2"})
    # auto: one queue keeps order anyway (4 in flight); several instances: one in flight per stream
    assert max_inflight(0, str(one / "freetoken")) == 4 and max_inflight(0, str(two / "freetoken")) == 1
    assert max_inflight(3, str(two / "freetoken")) == 3 and max_inflight(0, "") == 1
    with pytest.raises(ValueError, match="detok_max_inflight"):
        max_inflight(-1, "")


def test_default_freetoken_instances_eight_on_big_hosts_one_without_an_engine_process():
    from freetoken_core.serving.launch.repository import default_freetoken_instances

    assert [default_freetoken_instances(n) for n in (1, 2, 8, 15, 16, 64)] == [1, 1, 1, 1, 8, 8]
    assert default_freetoken_instances(64, engine_process=False) == 1


def test_sender_threads_and_engine_process_parameters():
    from freetoken_core.serving.config import sender_threads

    defaults = serving_config({})
    # auto: two on hosts of 16+ CPUs with the engine process (beside 8 instances), one elsewhere
    assert defaults.engine_process == 1 and defaults.sender_threads == 0
    assert [sender_threads(defaults, cpus=n) for n in (2, 15, 16, 64)] == [1, 1, 2, 2]
    assert sender_threads(serving_config({"engine_process": "0"}), cpus=64) == 1
    assert sender_threads(serving_config({"sender_threads": "8"}), cpus=2) == 8
    for bad in ("-1", "1.5", "65"):
        with pytest.raises(ValueError, match="sender_threads must be a whole number from 1 to 64"):
            sender_threads(serving_config({"sender_threads": bad}))


def test_message_ring_parameters():
    def msg_ring(config: ServingConfig) -> tuple[int, float]:
        return config.ring_bytes, config.ring_poll_s

    assert msg_ring(serving_config({})) == (0, 500e-6)  # off by default: the pipe
    assert msg_ring(serving_config({"engine_msg_ring_kib": "64", "engine_msg_ring_poll_us": "500"})) == (65536, 5e-4)
    for name, bad, words in (("engine_msg_ring_kib", "-1", "from 0"), ("engine_msg_ring_kib", "1.5", "whole"),
                             ("engine_msg_ring_poll_us", "5", "from 10 to 2000")):
        with pytest.raises(ValueError, match=words):
            msg_ring(serving_config({name: bad}))


def test_engine_model_instances_share_one_engine_process_or_are_refused(tmp_path: Path):
    """FREETOKEN_FREETOKEN_INSTANCES=N renders N `freetoken` instances (they share one engine process,
    serving/engine_proc/engine_share.py); N > 1 with the engine in the model's own process would start N engines on
    one GPU, so it is refused with a message that says what to change."""
    import json

    from freetoken_core.serving.triton.freetoken_model import FreetokenModel, model_instance_count

    repo = render_repository(tmp_path / "repo", {"model_path": "/m"}, {"FREETOKEN_FREETOKEN_INSTANCES": "2"})
    assert "count: 2" in (repo / "freetoken" / "config.pbtxt").read_text()
    assert model_instance_count({"instance_group": [{"count": 2, "kind": "KIND_MODEL"}, {"count": 3}]}) == 5
    assert model_instance_count({}) == 1
    config = {"instance_group": [{"count": 2}], "parameters": {"engine_process": {"string_value": "0"},
                                                               "model_path": {"string_value": "/m"}}}
    with pytest.raises(ValueError, match="share one engine process: set engine_process=1"):
        FreetokenModel(object(), {"model_name": "freetoken", "model_config": json.dumps(config)})


def test_a_reload_with_an_edited_config_meets_in_a_new_place(tmp_path: Path):
    """Triton loads a reloaded model's new instances before it unloads the old ones: they must not join
    the old load's engine, so the rendezvous name changes with the config file."""
    import os

    from freetoken_core.serving.triton.freetoken_model import load_identity

    cfg = tmp_path / "config.pbtxt"
    cfg.write_text("name: 'freetoken'")
    args = {"model_name": "freetoken", "model_version": "1", "model_repository": str(tmp_path)}
    first = load_identity(args)
    assert first == load_identity(dict(args)) and first.startswith("freetoken-1-")
    os.utime(cfg, ns=(cfg.stat().st_atime_ns, cfg.stat().st_mtime_ns + 10**9))
    assert load_identity(args) != first
    assert load_identity({"model_name": "m"}) == "m-1"


def test_serve_passes_server_args_through_to_tritonserver(monkeypatch):
    """`serve --server-arg=...` (repeatable) reaches start_server's extra tritonserver arguments, in order."""
    import argparse
    from types import SimpleNamespace

    from freetoken_core.serving.launch import serve as launcher

    seen = {}

    def fake_start_server(overrides, http_port, grpc_port, metrics_port, repo_dir, extra_args=None, **kw):
        seen["extra_args"], seen["overrides"] = extra_args, overrides
        proc = SimpleNamespace(returncode=0)
        return SimpleNamespace(http_port=1, grpc_port=2, metrics_url="localhost:3", grpc_url="localhost:2",
                               http_url="localhost:1", admin_headers={},
                               process=proc, alive=lambda: False, stop=lambda: None)

    monkeypatch.setattr(launcher, "start_server", fake_start_server)
    p = argparse.ArgumentParser()
    launcher.add_serve_args(p)
    args = p.parse_args(["--model-path", "/m", "--server-arg=--trace-config=level=TIMESTAMPS",
                         "--server-arg=--trace-config=rate=1", "--no-openai"])
    assert launcher.serve_main(args) == 0
    assert seen["extra_args"] == ["--trace-config=level=TIMESTAMPS", "--trace-config=rate=1"]
    assert seen["overrides"]["model_path"] == "/m"


def test_inflight_budget_is_shared_out_per_instance_and_needs_send_order():
    """detok_inflight_budget (128 by default, 0 off): each `freetoken` instance gets its part, rounded up; without
    detok_send_order it is ignored (a larger window could reorder a stream across detokenizer instances)."""
    from freetoken_core.serving.triton.freetoken_model import ordered_inflight_budget
    from freetoken_core.serving.config import inflight_budget

    assert serving_config({}).detok_inflight_budget == 128
    assert [inflight_budget(serving_config({}), n) for n in (1, 8, 6, 0)] == [128, 16, 22, 128]
    assert inflight_budget(serving_config({"detok_inflight_budget": "0"}), 8) == 0
    options = serving_config({"detok_inflight_budget": "64"})
    assert [inflight_budget(options, n) for n in (1, 8, 6)] == [64, 8, 11]
    assert ordered_inflight_budget(16, send_order=True) == 16 and ordered_inflight_budget(16, send_order=False) == 0
    for bad in ("-1", "2.5"):
        with pytest.raises(ValueError, match="detok_inflight_budget"):
            inflight_budget(serving_config({"detok_inflight_budget": bad}), 8)
