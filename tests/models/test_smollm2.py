"""The real default model: our engine-path forward vs transformers, and greedy decoding through
the paged cache vs transformers' greedy generate."""

from __future__ import annotations

import torch
from harness import ModelHarness
from transformers import AutoModelForCausalLM, AutoTokenizer

from freetoken_core.models import load_model


def test_smollm2_matches_transformers_greedy(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    prompt = list(prompt)
    n_new = 8

    ref = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0]
        ref_out = ref.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False)[0, len(prompt):].tolist()
    del ref

    model = load_model(smollm2_path, torch.float32, "cpu", progress=False)
    assert model.num_layers == 30 and model.attn_layout().num_kv_heads == 3
    h = ModelHarness(model, num_pages=64, page_size=16)
    req = h.add_request(prompt)
    logits = h.logits([req], [prompt])
    torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=0)

    out = [int(logits[-1].argmax())]
    while len(out) < n_new:
        out.append(int(h.logits([req], [[out[-1]]])[-1].argmax()))
    assert out == ref_out
    assert "Paris" in tok.decode(out)
