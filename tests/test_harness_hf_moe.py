"""lm-evaluation-harness against the real client on a mixture of experts: a random OLMoE made
and saved by ``transformers``' own ``OlmoeForCausalLM`` (float32, 2 layers, d 32, 8 experts,
top 2, ``norm_topk_prob`` false as OLMoE's release has it, norm scales away from 1), with a
byte-level tokenizer of tests/conftest.py beside it, scored on the offline tasks of
tests/harness_tasks by the harness's own Hugging Face model (``hf``: ``pretrained=FOLDER``,
torch, float32, CPU) and by ``dagmoe`` with ``run_dir=hf:FOLDER`` (the folder imported by
:func:`dagmoe_jax.hf.llama.load_hf_llama` and :mod:`dagmoe_jax.hf.moe`), each with its default
flags, gives the same per-sample loglikelihoods, is_greedy flags, rolling loglikelihoods and
greedy generations.

tests/test_harness_hf.py checks the harness's rules (BOS, EOS, windows, stop strings) on a dense
model the library exported; this file checks that an MoE folder as published (OLMoE's q/k
norms over the whole projections, softmax routing over every expert without renormalising the
kept two, SwiGLU experts) is read and scored as transformers computes it, through the whole
harness path: the window comes from the folder's ``max_position_embeddings`` on both sides,
and ``dagmoe`` scores 8 rows a call (padding beside the real tokens, routed too) where ``hf``
scores one. Two tokenizer kinds: ``no_bos`` (EOS starts documents) and ``bos_added`` (the
tokenizer.json's post-processor adds ``<s>``).

Optional: skipped without torch, transformers and accelerate (``pip install -r
benchmarks/requirements-peer.txt``). ``python tests/test_harness_hf_moe.py`` prints the
measured agreement (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if __name__ == "__main__":          # as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# test_harness_hf skips the module without torch, transformers, accelerate or lm-eval
from test_harness_hf import (AGREEMENT_HEADER, TASKS_DIR, agreement_row, compare,  # noqa: E402
                             direct_requests, evaluate, lm_eval, rel_gap, torch, transformers)
from lm_eval.api.registry import get_model  # noqa: E402

from conftest import write_special_tokenizer  # noqa: E402
from dagmoe_jax.harness.lm import DagmoeLM  # noqa: E402
from dagmoe_jax.hf.run import HF_PREFIX  # noqa: E402
from test_hf_transformers import tiny_moe  # noqa: E402

WINDOW = 32             # the folder's max_position_embeddings: the window on both sides
KINDS = ("no_bos", "bos_added")
# Measured: at most 1.44e-07 relative on any sample, tasks and direct requests alike, both
# tokenizers (RESULTS.md). The dense test's bound, with 7x margin: a token more or less, another
# window, or the kept two weights renormalised (norm_topk_prob read wrong: 0.15) exceed it by far.
RTOL = 1e-6


def make_folder(folder: Path, kind: str) -> Path:
    """A random OLMoE saved by transformers in ``folder``, with a tokenizer of ``kind``.
    Weights at std 0.2 (transformers' default 0.02 would make every choice near uniform and
    the router's logits near ties), vocabulary 259: the tokenizer's bytes and specials."""
    model = tiny_moe("olmoe", vocab_size=259, max_position_embeddings=WINDOW,
                     norm_topk_prob=False, initializer_range=0.2)
    model.save_pretrained(folder, safe_serialization=True)
    write_special_tokenizer(folder, kind, WINDOW)
    return folder


def models(folder: Path):
    """(dagmoe, hf) on the folder, each with its default flags; ``mesh='none'``: one device
    (the suite simulates 8 CPU devices, which a user's machine does not have)."""
    ours = DagmoeLM(run_dir=HF_PREFIX + str(folder), mesh="none")
    theirs = get_model("hf").create_from_arg_obj(
        {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}, {})
    return ours, theirs


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp(f"harness_hf_moe_{request.param}"),
                         request.param)
    return (*models(folder), request.param)


@pytest.fixture(scope="module")
def measured(pair):
    ours, theirs, _ = pair
    return compare(evaluate(ours), evaluate(theirs))


def test_the_folder_is_read_as_olmoe_on_both_sides(pair):
    ours, theirs, kind = pair
    assert type(theirs.model).__name__ == "OlmoeForCausalLM"
    cfg = ours.run.model_cfg
    assert cfg.qk_norm == "full" and cfg.block.experts.num_experts == 8
    assert cfg.block.router.top_k == 2 and not cfg.block.router.renormalize
    assert ours.max_length == theirs.max_length == WINDOW
    assert ours.eot_token_id == theirs.eot_token_id == 256
    assert ours.prefix_token_id == theirs.prefix_token_id == (257 if kind == "bos_added"
                                                              else 256)
    text = (TASKS_DIR / "mc.jsonl").read_text(encoding="utf-8")
    assert ours.tok_encode(text) == theirs.tok_encode(text)


def test_multiple_choice_loglikelihoods_agree(measured):
    assert measured["mc"] < RTOL
    assert measured["fewshot"] < RTOL       # the same few-shot contexts, past the window
    flags, their_flags = measured["mc greedy"]
    assert flags == their_flags


def test_rolling_loglikelihoods_agree(measured):
    assert measured["rolling"] < RTOL


def test_greedy_generations_agree(measured):
    mine, theirs = measured["gen"]
    assert mine == theirs and any(mine)


def test_greedy_and_truncated_requests_agree(pair):
    mine, their = direct_requests(*pair[:2])
    assert rel_gap([ll for ll, _ in mine], [ll for ll, _ in their]) < RTOL
    assert [g for _, g in mine] == [g for _, g in their]
    assert all(g for _, g in mine[:3]) and not any(g for _, g in mine[3:])


if __name__ == "__main__":           # the agreement of benchmarks/RESULTS.md
    import tempfile
    print(f"lm-eval {lm_eval.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}; OLMoE, max |dagmoe - hf| / |hf| per sample")
    print(AGREEMENT_HEADER)
    for kind in KINDS:
        with tempfile.TemporaryDirectory() as tmp:
            print(agreement_row(kind, *models(make_folder(Path(tmp), kind))))
    sys.exit(0)
