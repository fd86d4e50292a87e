"""SmolLM2 with a Qwen3-style chat template (tools in a system block, hermes tool calls, enable_thinking): the
real weights and tokenizer, so the tokenizer step and a real server render and run tools as they would for Qwen3."""

from __future__ import annotations

import os
from pathlib import Path

QWEN_LIKE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}{% if not (loop.first and message.role == 'system') %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def qwen_like_model_dir(smollm2_path: str, dest: Path) -> Path:
    """A model directory beside `dest`: SmolLM2's files linked, the chat template replaced."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(smollm2_path):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(smollm2_path, name), dest / name)
    (dest / "chat_template.jinja").write_text(QWEN_LIKE_TEMPLATE)
    return dest
