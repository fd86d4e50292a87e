"""Block-FP8 checkpoints under tensor parallelism over two CPU processes (gloo): shards follow the 128-blocks
(their scale blocks with them) and decode the tokens transformers gives on the dequantized weights; a shard that
would cut a block is refused, naming the cut."""

from __future__ import annotations

import pytest

from freetoken_core import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.models.fp8_checkpoints import write_fp8_pair
from tests.models.moe_checkpoints import PROMPTS, hf_greedy, make_tiny_moe

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
# every sharded dimension splits into whole 128-blocks per rank: q 4 x 128, k/v 2 x 128 (one head a rank),
# o_proj's 512 inputs, the MLP's 512 (dense) / 256 (experts) intermediate rows
SPLITS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128)


def tp2(path) -> LLM:
    return LLM(path, dtype="float32", page_size=4, num_pages=200, max_running_req=3, tensor_parallel_size=2)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3moe-stacked"])
def test_tp2_fp8_matches_transformers(tmp_path, kind):
    if kind == "qwen3":
        plain = make_tiny_model(tmp_path, arch="qwen3", intermediate_size=512, **SPLITS)
        fp8, ref = write_fp8_pair(plain)
    else:
        moe = dict(SPLITS, moe_intermediate_size=256, norm_topk_prob=True)
        fp8, _ = write_fp8_pair(make_tiny_moe(tmp_path, "stacked", **moe))
        _, ref = write_fp8_pair(make_tiny_moe(tmp_path / "ref", "per_expert", **moe))  # the same weights
    llm = tp2(fp8)
    try:
        assert llm.scheduler.engine.model.model.layers[0].self_attn.num_heads == 2
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == hf_greedy(ref, PROMPTS, PARAMS.max_tokens)
    finally:
        llm.scheduler.engine.close()


def test_a_shard_that_cuts_a_block_is_refused(tmp_path):
    plain = make_tiny_model(tmp_path, arch="qwen3", intermediate_size=384, **SPLITS)  # 192 MLP rows a rank
    fp8, _ = write_fp8_pair(plain)
    with pytest.raises(ValueError, match=r"mlp\.down_proj\.weight: a slice \[0, 192\) of dimension 1 \(size 384\) "
                                         r"cuts a 128-element FP8 scale block"):
        tp2(fp8)
