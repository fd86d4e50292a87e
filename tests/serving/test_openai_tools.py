"""Tools through the whole path: a real tritonserver serving SmolLM2 with a Qwen3-style chat template (tools in a
system block, hermes calls), the OpenAI frontend in front, the official client. The prompt the engine ran is the
one the template renders with the tool schema; chat_template_kwargs reach the template too."""

from __future__ import annotations

import json

import pytest

from tests.serving.conftest import SERVER_PARAMS

pytestmark = pytest.mark.serving

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen_like(smollm2_path, tmp_path_factory):
    """(client, model directory): a server and a frontend of their own (the template differs from the session's)."""
    pytest.importorskip("tritonclient.grpc")
    from freetoken_core.serving.launch.server import free_ports
    from freetoken_core.serving.openai.process import FrontendOptions, start_frontend, stop_frontend
    from tests.serving.qwen_like_model import qwen_like_model_dir
    from tests.serving.serving_helpers import start_test_server

    work = tmp_path_factory.mktemp("qwen_like_server")
    model_dir = qwen_like_model_dir(smollm2_path, work / "SmolLM2-qwen-template")
    server = start_test_server({**SERVER_PARAMS, "model_path": str(model_dir)}, work)
    port = free_ports(1)[0]
    frontend = start_frontend(server.grpc_url, server.repo_dir, FrontendOptions(port=port, host="127.0.0.1"),
                              log_path=work / "frontend.log", metrics_url=server.metrics_url)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                            timeout=120), model_dir
    finally:
        stop_frontend(frontend)
        server.stop()


def test_the_engine_runs_the_prompt_with_the_tool_schema(qwen_like):
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    client, model_dir = qwen_like
    tok = load_tokenizer(str(model_dir))
    rendered = tok.render_chat(CHAT, add_generation_prompt=True, tools=TOOLS)
    assert json.dumps(TOOLS[0]) in rendered  # the template writes the schema into the prompt
    name = model_dir.name
    with_tools = client.chat.completions.create(model=name, messages=CHAT, tools=TOOLS, max_tokens=4)
    assert with_tools.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    plain = client.chat.completions.create(model=name, messages=CHAT, max_tokens=4)
    assert plain.usage.prompt_tokens == len(tok.apply_chat_template(CHAT))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    # a named tool_choice is asked of the model (best effort): accepted
    named = client.chat.completions.create(model=name, messages=CHAT, tools=TOOLS, max_tokens=2,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.usage.prompt_tokens == with_tools.usage.prompt_tokens
    # unset max_tokens: the rest of the context after the prompt with its tools (counted the same way)
    rest = client.chat.completions.create(model=name, messages=CHAT, tools=TOOLS, stream=True,
                                          stream_options={"include_usage": True},
                                          extra_body={"max_tokens": None, "ignore_eos": False})
    usage = [c.usage for c in rest if c.usage is not None][0]
    assert usage.prompt_tokens == with_tools.usage.prompt_tokens


def test_chat_template_kwargs_reach_the_template(qwen_like):
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    client, model_dir = qwen_like
    tok = load_tokenizer(str(model_dir))
    r = client.chat.completions.create(model=model_dir.name, messages=CHAT, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(CHAT, enable_thinking=False))
    assert r.usage.prompt_tokens > len(tok.apply_chat_template(CHAT))
