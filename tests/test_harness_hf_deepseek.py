"""lm-evaluation-harness against the real client on a DeepSeek-V3: a random one made and saved
by ``transformers``' own ``DeepseekV3ForCausalLM`` (float32, 3 layers, the first dense, MLA with
query compression, YaRN, 8 experts in 4 groups, top 3 by the biased scores, one shared expert,
norm scales, router weights and correction bias away from their initial values), with a
byte-level tokenizer beside it, scored on the offline tasks of tests/harness_tasks by the
harness's own Hugging Face model (``hf``: ``pretrained=FOLDER``, torch, float32, CPU) and by
``dagmoe`` with ``run_dir=hf:FOLDER``, each with its default flags: the same per-sample
loglikelihoods, is_greedy flags, rolling loglikelihoods and greedy generations.

tests/test_harness_hf_moe.py makes the same comparison on an OLMoE; this file checks the
DeepSeek import (dagmoe_jax/hf/deepseek.py) through the whole harness path. Optional: skipped
without torch, transformers, accelerate and lm-eval (``pip install -r
benchmarks/requirements-peer.txt``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

# test_harness_hf skips the module without torch, transformers, accelerate or lm-eval
from test_harness_hf import compare, direct_requests, evaluate, rel_gap  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from conftest import write_special_tokenizer  # noqa: E402
from dagmoe_jax.harness.lm import DagmoeLM  # noqa: E402
from dagmoe_jax.hf.run import HF_PREFIX  # noqa: E402
from test_hf_deepseek_transformers import SIZES, made_by_transformers  # noqa: E402

WINDOW = 32             # the folder's max_position_embeddings: the window on both sides
RTOL = 1e-6             # tests/test_harness_hf_moe.py's bound


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harness_hf_deepseek")
    SIZES_259 = {**SIZES, "vocab_size": 259, "max_position_embeddings": WINDOW}
    made_by_transformers("v3", folder, sizes=SIZES_259)
    write_special_tokenizer(folder, "bos_added", WINDOW)
    ours = DagmoeLM(run_dir=HF_PREFIX + str(folder), mesh="none")
    theirs = get_model("hf").create_from_arg_obj(
        {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}, {})
    return ours, theirs


def test_a_deepseek_folder_scores_as_lm_evals_hf_model_scores_it(pair):
    ours, theirs = pair
    assert type(theirs.model).__name__ == "DeepseekV3ForCausalLM"
    cfg = ours.run.model_cfg
    assert cfg.mla.kv_lora_rank == 16 and cfg.first_dense_layers == 1
    assert ours.max_length == theirs.max_length == WINDOW
    measured = compare(evaluate(ours), evaluate(theirs))
    assert measured["mc"] < RTOL and measured["fewshot"] < RTOL
    assert measured["rolling"] < RTOL
    flags, their_flags = measured["mc greedy"]
    assert flags == their_flags
    mine, their = measured["gen"]
    assert mine == their and any(mine)
    mine, their = direct_requests(ours, theirs)
    assert rel_gap([ll for ll, _ in mine], [ll for ll, _ in their]) < RTOL
    assert [g for _, g in mine] == [g for _, g in their]
