"""lm-evaluation-harness against the real client: a dense model of the library, exported with
:func:`dagmoe_jax.hf.export.export_hf`, scored on the offline tasks of
tests/harness_tasks by the harness's own Hugging Face model (``hf``, torch and transformers)
and by ``dagmoe`` on a run directory of the same model, with each side's default flags, gives
the same per-sample loglikelihoods, is_greedy flags, rolling loglikelihoods and greedy
generations, for every kind of tokenizer that changes how text becomes ids:

* ``no_bos``: a byte-level ``tokenizer.json`` (ids 0-255 the utf-8 bytes, no merges, ``</s>``
  = 256 as EOS) with no BOS: EOS starts documents;
* ``bos_added``: the same with ``<s>`` = 257 named BOS and added by the tokenizer.json's own
  post-processor, as Llama 3's is (every encoded text starts with it, BOS starts documents);
* ``bos_named``: ``<s>`` named BOS but not added (it starts documents only);
* ``eos_ids``: ``generation_config.json`` lists two EOS ids, ``</s>`` and ``<|eot|>`` = 258,
  and the model is made to emit ``<|eot|>``: generation stops at either, as
  ``transformers``' ``generate`` does.

Both sides read the tokenizer from the exported folder (``AutoTokenizer.from_pretrained``; the
run's ``DataConfig(tokenizer='hf')``). Optional: skipped without torch, transformers and
accelerate (``pip install -r benchmarks/requirements-peer.txt``), which CI does not install
(the CUDA build of torch alone is several GB). ``python tests/test_harness_hf.py`` prints the
measured agreement (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

if __name__ == "__main__":          # as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

torch = pytest.importorskip("torch", reason="the peer tests need torch and transformers "
                            "(pip install -r benchmarks/requirements-peer.txt), which CI "
                            "does not install: README")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the harness's hf model needs accelerate")
lm_eval = pytest.importorskip("lm_eval", reason="needs the [harness] extra (in requirements)")

from flax import nnx  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from conftest import (SPECIAL_TOKENIZER_KINDS, make_model, tiny_config,  # noqa: E402
                      write_special_tokenizer)
from dagmoe_jax.data import DataConfig  # noqa: E402
from dagmoe_jax.harness.lm import DagmoeLM, cut_at_stop  # noqa: E402
from dagmoe_jax.hf.export import export_hf  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parent / "harness_tasks"
TASKS = ["dagmoe_mc", "dagmoe_mc_fewshot", "dagmoe_rolling", "dagmoe_gen"]
WINDOW = 32             # the model's max_seq_len: the rolling window on both sides
BOS = "<s>"             # id 257 (conftest.write_special_tokenizer: </s> 256, <|eot|> 258)
KINDS = SPECIAL_TOKENIZER_KINDS
RAW = tiny_config("dense", vocab_size=259, max_seq_len=WINDOW, init_std=0.2)
# Measured: at most 3.4e-07 relative on any sample (RESULTS.md); the bound, which any
# real difference of semantics (a token more or less, another window) exceeds by far.
RTOL = 1e-6


def make_pair(root: Path, kind: str = "no_bos", emit_eot: bool = False):
    """(run directory, Hugging Face folder) of one random dense model and the tokenizer; the
    model emits ``<|eot|>`` for ``kind='eos_ids'`` or ``emit_eot``."""
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.run.config import OptimConfig, RunConfig

    cfg = RAW
    model = make_model(cfg)
    if kind == "eos_ids" or emit_eot:
        # <|eot|> scores 1.5x what byte 'e' scores: greedy decoding emits it where it would
        # emit 'e' (on the generation task's prompts, within the first few tokens).
        head = model.lm_head[...]
        model.lm_head[...] = head.at[:, 258].set(1.5 * head[:, ord("e")])
    hf_dir = export_hf(model, root / "hf")
    tokenizer_json = write_special_tokenizer(hf_dir, kind, WINDOW)

    run_dir = root / "run"
    run_lib.prepare_run_dir(run_dir)
    data_cfg = DataConfig(tokenizer="hf", tokenizer_path=str(tokenizer_json), seq_len=WINDOW)
    run_cfg = RunConfig(run_dir=str(run_dir), tensorboard=False)
    optim_cfg = OptimConfig()
    run_lib.save_configs(run_dir, RAW, data_cfg, optim_cfg, run_cfg)
    built, optimizer, _ = run_lib.build(cfg, optim_cfg, run_cfg)
    nnx.update(built, nnx.state(model, nnx.Param))
    run_lib.save_initial_checkpoint(run_dir, built, optimizer, cfg, run_cfg, None)
    return run_dir, hf_dir


def models(run_dir: Path, hf_dir: Path):
    """(dagmoe, hf): the harness's two model classes, made as ``--model`` would make them."""
    ours = DagmoeLM(run_dir=str(run_dir), batch_size=4, mesh="none")
    theirs = get_model("hf").create_from_arg_obj(
        {"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu",
         "max_length": WINDOW}, {"batch_size": 1})
    return ours, theirs


def evaluate(lm) -> dict:
    """Per task, its samples by doc_id (``simple_evaluate`` with ``log_samples``)."""
    results = lm_eval.simple_evaluate(
        model=lm, tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        log_samples=True, bootstrap_iters=0)
    return {task: sorted(samples, key=lambda s: s["doc_id"])
            for task, samples in results["samples"].items()}


def rel_gap(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs) / np.abs(theirs)))


def compare(ours: dict, theirs: dict) -> dict:
    """What the two sides' samples give: per task the max relative gap of its loglikelihoods
    (mc, rolling), the is_greedy flags of both, or the generations of both."""
    assert set(ours) == set(theirs) == set(TASKS)
    for task in TASKS:
        assert [s["arguments"] for s in ours[task]] == [s["arguments"] for s in theirs[task]]
    mc = [[r[0] for r in s["resps"]] for s in ours["dagmoe_mc"]], \
         [[r[0] for r in s["resps"]] for s in theirs["dagmoe_mc"]]
    rolling = [s["resps"][0][0] for s in ours["dagmoe_rolling"]], \
              [s["resps"][0][0] for s in theirs["dagmoe_rolling"]]
    fewshot = [[r[0][0] for r in s["resps"]] for s in ours["dagmoe_mc_fewshot"]], \
              [[r[0][0] for r in s["resps"]] for s in theirs["dagmoe_mc_fewshot"]]
    return {
        "mc": rel_gap([[ll for ll, _ in s] for s in mc[0]], [[ll for ll, _ in s] for s in mc[1]]),
        "fewshot": rel_gap(*fewshot),
        "mc greedy": ([[bool(g) for _, g in s] for s in mc[0]],
                      [[bool(g) for _, g in s] for s in mc[1]]),
        "rolling": rel_gap(*rolling),
        "gen": ([s["resps"][0][0] for s in ours["dagmoe_gen"]],
                [s["resps"][0][0] for s in theirs["dagmoe_gen"]]),
    }


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    run_dir, hf_dir = make_pair(tmp_path_factory.mktemp(f"harness_hf_{request.param}"),
                                request.param)
    return (*models(run_dir, hf_dir), request.param)


@pytest.fixture(scope="module")
def measured(pair):
    ours, theirs, _ = pair
    return compare(evaluate(ours), evaluate(theirs))


def test_both_sides_tokenize_alike(pair):
    ours, theirs, kind = pair
    assert ours.eot_token_id == theirs.eot_token_id == 256
    bos = kind in ("bos_added", "bos_named")
    assert theirs.prefix_token_id == ours.prefix_token_id == (257 if bos else 256)
    assert ours.max_length == theirs.max_length == WINDOW
    for name in ("mc.jsonl", "rolling.jsonl", "gen.jsonl"):
        text = (TASKS_DIR / name).read_text(encoding="utf-8")
        body = list(text.encode("utf-8"))
        assert ours.tok_encode(text) == theirs.tok_encode(text) == (
            [257] + body if kind == "bos_added" else body)
        for flag in (False, True):
            assert (ours.tok_encode(text, add_special_tokens=flag)
                    == theirs.tok_encode(text, add_special_tokens=flag))
        assert ours.tok_encode(BOS + text) == theirs.tok_encode(BOS + text)
    ids = [257, 104, 105, 258, 256]
    assert ours.tok_decode(ids) == theirs.tok_decode(ids) == "hi"
    assert ours.tok_decode(ids, skip_special_tokens=False) == theirs.tok_decode(
        ids, skip_special_tokens=False)


def test_generation_stops_at_every_eos_id(pair):
    ours, theirs, kind = pair
    expected = (256, 258) if kind == "eos_ids" else (256,)
    assert ours.stop_token_ids() == expected
    configured = theirs.model.generation_config.eos_token_id
    configured = set([configured] if isinstance(configured, int) else configured or [])
    assert configured <= set(expected)
    if kind == "eos_ids":               # transformers read the same two ids from the folder
        assert configured == set(expected)
    if kind == "eos_ids":           # <|eot|> does end a row here: the test has teeth
        prompts = [ours.prompt_encode((TASKS_DIR / "gen.jsonl").read_text()[:20])]
        ids = ours.scorer.generate(prompts, max_new_tokens=16, stop_tokens=expected)[0]
        assert ids[-1] == 258 and len(ids) < 16


def test_multiple_choice_loglikelihoods_agree(measured):
    assert measured["mc"] < RTOL
    assert measured["fewshot"] < RTOL       # the same few-shot contexts on both sides
    flags, their_flags = measured["mc greedy"]
    assert flags == their_flags


def test_rolling_loglikelihoods_agree(measured):
    assert measured["rolling"] < RTOL


def test_greedy_generations_agree(measured):
    mine, theirs = measured["gen"]
    assert mine == theirs and any(mine)


def test_the_stop_string_rule_is_lm_evals(pair):
    """:class:`StopStrings` decides as lm-eval's ``MultiTokenEOSCriteria`` (what HFLM hands to
    ``generate``) on the same generated ids, for strings of one and several tokens, a special
    token's text and a multi-byte character, each side with its own tokenizer."""
    from lm_eval.models.utils_hf import MultiTokenEOSCriteria

    from dagmoe_jax.decoding.generate import StopStrings

    ours, theirs, _ = pair
    rng = np.random.default_rng(0)
    alphabet = [ord(c) for c in "ab\n<|>e"] + [0xC3, 0xA9, 256, 257, 258]
    for until in (["\n"], ["\n\n", "ab"], ["<|eot|>"], ["é", "e<"]):
        rule = StopStrings(until, ours.tokenizer_obj)
        decisions = []
        for _ in range(60):
            ids = rng.choice(alphabet, rng.integers(1, 9)).tolist()
            want = any(MultiTokenEOSCriteria(t, theirs.tokenizer, 0, 1)(torch.tensor([ids]), None)
                       for t in until)
            assert rule(ids) == want, (until, ids)
            decisions.append(want)
        assert any(decisions) and not all(decisions)


def test_a_special_tokens_stop_string_ends_generation_as_in_hflm(tmp_path):
    """A stop string spelt by a special token that is no EOS id (``<|eot|>`` here): HFLM stops
    where its rule sees the token's text, and the text it returns (special tokens skipped) ends
    there. Decoding on to ``max_gen_toks`` and cutting afterwards would return more text."""
    from types import SimpleNamespace

    ours, theirs = models(*make_pair(tmp_path, "no_bos", emit_eot=True))
    contexts = ["The tree", "Hello there", "one, two"]
    requests = [SimpleNamespace(args=(c, {"until": ["<|eot|>"], "max_gen_toks": 12}))
                for c in contexts]
    mine = ours.generate_until(requests, disable_tqdm=True)
    their = theirs.generate_until(requests, disable_tqdm=True)
    assert mine == their
    # decoded to max_gen_toks and cut afterwards (the adapter before), the texts differ
    full = ours.scorer.generate([ours.prompt_encode(c) for c in contexts], max_new_tokens=12)
    assert [cut_at_stop(ours.tok_decode(ids), ["<|eot|>"]) for ids in full] != mine


def direct_requests(ours, theirs):
    """Beyond the tasks, each side's ``_loglikelihood_tokens`` on the same requests: three
    whose continuations are the model's own greedy tokens (is_greedy true), four random ones,
    the last two longer than the window (truncated from the left)."""
    rng = np.random.default_rng(0)
    contexts = [rng.integers(0, 256, n).tolist() for n in (3, 12, 29)]
    greedy = ours.scorer.generate(contexts, max_new_tokens=3)
    requests = [(None, c, g) for c, g in zip(contexts, greedy)]
    requests += [(None, rng.integers(0, 256, n).tolist(), rng.integers(0, 256, 4).tolist())
                 for n in (5, 29, 30, 45)]
    return (ours._loglikelihood_tokens(requests, disable_tqdm=True),
            theirs._loglikelihood_tokens(requests, disable_tqdm=True))


def test_greedy_and_truncated_requests_agree(pair):
    mine, their = direct_requests(*pair[:2])
    assert rel_gap([ll for ll, _ in mine], [ll for ll, _ in their]) < RTOL
    assert [g for _, g in mine] == [g for _, g in their]
    assert all(g for _, g in mine[:3]) and not any(g for _, g in mine[3:])


AGREEMENT_HEADER = (f"{'tokenizer':<12}{'mc':>10}{'2-shot':>10}{'rolling':>10}{'7 direct':>10}"
                    f"{'is_greedy':>11}{'generations':>13}")


def agreement_row(kind: str, dagmoe, hf) -> str:
    """One row of the agreement table (benchmarks/RESULTS.md): the two sides on the tasks and
    the direct requests, under :data:`AGREEMENT_HEADER`."""
    got = compare(evaluate(dagmoe), evaluate(hf))
    mine, their = direct_requests(dagmoe, hf)
    flags = (got["mc greedy"][0] == got["mc greedy"][1]
             and [m[1] for m in mine] == [t[1] for t in their])
    gens = f"{'equal' if got['gen'][0] == got['gen'][1] else 'DIFFER'} ({len(got['gen'][0])})"
    return (f"{kind:<12}{got['mc']:>10.2e}{got['fewshot']:>10.2e}{got['rolling']:>10.2e}"
            f"{rel_gap([m[0] for m in mine], [t[0] for t in their]):>10.2e}"
            f"{'equal' if flags else 'DIFFER':>11}{gens:>13}")


if __name__ == "__main__":           # the agreement of benchmarks/RESULTS.md
    import tempfile
    print(f"lm-eval {lm_eval.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}; max |dagmoe - hf| / |hf| per sample")
    print(AGREEMENT_HEADER)
    for kind in KINDS:
        with tempfile.TemporaryDirectory() as tmp:
            print(agreement_row(kind, *models(*make_pair(Path(tmp), kind))))
    sys.exit(0)
