"""lm-evaluation-harness integration: the scorer against an independent computation from the
model's logits, batching and padding invariance, the harness's rolling windows, generation with
stop strings, the offline tasks under tests/harness_tasks through ``simple_evaluate``, and the
command line on a run directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import (SPECIAL_TOKENIZER_KINDS, make_model, tiny_config,
                      write_byte_level_tokenizer, write_special_tokenizer)
from dagmoe_jax.data import DataConfig
from dagmoe_jax.data.tokenizers import ByteTokenizer
from dagmoe_jax.decoding.generate import generate
from dagmoe_jax.evaluation.scoring import Scorer, padded_width

lm_eval = pytest.importorskip("lm_eval", reason="needs the [harness] extra (in requirements)")
from dagmoe_jax.harness.lm import DagmoeLM, cut_at_stop  # noqa: E402

TASKS = Path(__file__).resolve().parent / "harness_tasks"
WINDOW = 32
# A MoE whose capacity dispatch would drop tokens (factor 1): the scorer's dropless routing is
# what makes rows independent of their batch.
RAW = tiny_config("moe", "dag", vocab_size=256, max_seq_len=WINDOW, init_std=0.2,
                  experts=dict(capacity_factor=1.0, num_shared=1))
CFG = RAW


GRAPHDEF = nnx.graphdef(nnx.eval_shape(lambda: make_model(CFG)))


@pytest.fixture(scope="module")
def model():
    return make_model(CFG)


def fake_run(model):
    """What DagmoeLM reads of a loaded run, for a model that was never saved."""
    return SimpleNamespace(model=model, model_cfg=model.cfg, tokenizer=ByteTokenizer(),
                           data_cfg=DataConfig(), step=0)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@jax.jit
def _dropless_logits(state, tokens):
    from dagmoe_jax.decoding.generate import decoding_model
    return decoding_model(nnx.merge(GRAPHDEF, state))(tokens)[0]


def reference(model, context, continuation):
    """(sum log p, is_greedy) from one forward pass of the dropless model over the pair alone
    (right-padded to the whole window, a width the scorer never uses for short pairs)."""
    whole = (context + continuation)[-(WINDOW + 1):]
    tokens = np.zeros((1, WINDOW), np.int32)
    tokens[0, :len(whole) - 1] = whole[:-1]
    logits = _dropless_logits(nnx.state(model), tokens)[0, :len(whole) - 1]
    logp = log_softmax(np.asarray(logits))[-len(continuation):]
    picked = logp[np.arange(len(continuation)), continuation]
    return float(picked.sum()), bool(np.all(logp.argmax(-1) == continuation))


def random_pairs(rng, n, longest=24):
    return [(rng.integers(0, 256, rng.integers(1, longest)).tolist(),
             rng.integers(0, 256, rng.integers(1, 6)).tolist()) for _ in range(n)]


def test_loglikelihood_equals_the_logits(model, rng):
    pairs = random_pairs(rng, 7) + [(list(range(40)), [7, 8, 9])]   # the last one truncated
    # a continuation that is the model's own greedy choice, so is_greedy is true for one pair
    from dagmoe_jax.decoding.generate import decoding_model
    logits, _ = decoding_model(model)(jax.numpy.asarray([[3, 4, 5]]))
    pairs.append(([3, 4, 5], [int(np.argmax(logits[0, -1]))]))
    got = Scorer(model, batch_size=3).loglikelihood(pairs)
    want = [reference(model, c, t) for c, t in pairs]
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5, atol=1e-4)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert got[-1][1] is True


def test_batch_size_and_padding_change_nothing(model, rng):
    pairs = random_pairs(rng, 9)
    one = Scorer(model, batch_size=1).loglikelihood(pairs)
    many = Scorer(model, batch_size=4).loglikelihood(pairs)
    np.testing.assert_allclose([a for a, _ in one], [b for b, _ in many], rtol=1e-5, atol=1e-5)
    assert [a for _, a in one] == [b for _, b in many]
    assert padded_width(3, WINDOW) == 16 and padded_width(17, WINDOW) == 32
    assert padded_width(40, WINDOW) == WINDOW


def test_a_mesh_gives_the_same_scores(model, rng):
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    pairs = random_pairs(rng, 5)
    mesh = make_mesh(MeshConfig())
    sharded = Scorer(model, batch_size=3, mesh=mesh)
    assert sharded.batch_size == mesh.size
    np.testing.assert_allclose([a for a, _ in sharded.loglikelihood(pairs)],
                               [a for a, _ in Scorer(model).loglikelihood(pairs)], atol=1e-5)


def test_rolling_loglikelihood_follows_the_harness_windows(model):
    """The harness's definition, written out: the first window predicts tokens [0, W) from EOS
    and tokens [0, W - 1); each later window predicts the next (up to W) tokens from the W
    tokens before its last one; the text's log-likelihood is the sum over windows."""
    text = "the router sends every token to two experts, " * 3
    ids = ByteTokenizer().encode(text)
    assert len(ids) > 2 * WINDOW
    lm = DagmoeLM(run=fake_run(model), batch_size=2, mesh="none")
    request = SimpleNamespace(args=(text,))
    got = lm.loglikelihood_rolling([request], disable_tqdm=True)[0]

    want, end = 0.0, 0
    while end < len(ids):
        stop = min(end + WINDOW, len(ids))
        inputs = [0] + ids[:WINDOW - 1] if end == 0 else ids[stop - WINDOW - 1:stop - 1]
        logits = _dropless_logits(nnx.state(model), np.asarray([inputs], np.int32))
        logp = log_softmax(np.asarray(logits[0]))[-(stop - end):]
        want += float(logp[np.arange(stop - end), ids[end:stop]].sum())
        end = stop
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_generation_stops_at_the_stop_string_and_equals_generate(model):
    lm = DagmoeLM(run=fake_run(model), batch_size=2, mesh="none")
    contexts = ["add 3 4 =", "sort 9 1 =", "x"]
    plain = generate(model, [ByteTokenizer().encode(c) for c in contexts], max_new_tokens=10,
                     stop_tokens=[0])
    texts = [ByteTokenizer().decode([t for t in ids if t != 0]) for ids in plain]
    stop = texts[0][3] if len(texts[0]) > 3 else "\x00"
    requests = [SimpleNamespace(args=(c, {"until": [stop], "max_gen_toks": 10}))
                for c in contexts]
    decoded, scorer_generate = {}, lm.scorer.generate

    def spy(prompts, **kwargs):
        out = scorer_generate(prompts, **kwargs)
        decoded.update((tuple(p), ids) for p, ids in zip(prompts, out))
        return out
    lm.scorer.generate = spy
    got = lm.generate_until(requests, disable_tqdm=True)
    assert got == [cut_at_stop(t, [stop]) for t in texts]
    assert stop not in got[0] and len(got[0]) <= 3
    # decoding ended inside the loop, at the token that completed the stop string
    row = decoded[tuple(ByteTokenizer().encode(contexts[0]))]
    assert stop in ByteTokenizer().decode(row) and stop not in ByteTokenizer().decode(row[:-1])
    assert len(row) < 10


def test_stop_strings_end_rows_alike_on_a_mesh(model):
    """The stop rule's host callback reads rows sharded over the devices' data axis: the
    generations equal those of one device."""
    requests = [SimpleNamespace(args=(c, {"until": ["e", "\n"], "max_gen_toks": 10}))
                for c in ("add 3 4 =", "sort 9 1 =", "x", "hello")]
    one = DagmoeLM(run=fake_run(model), batch_size=2, mesh="none")
    many = DagmoeLM(run=fake_run(model), batch_size=2, mesh="auto")
    assert many.scorer.mesh is not None and many.scorer.mesh.size > 1
    assert many.generate_until(requests, disable_tqdm=True) == one.generate_until(
        requests, disable_tqdm=True)


def test_generation_is_cut_at_the_eos_text(model, tmp_path, monkeypatch):
    """As the harness's hf model does, the EOS token's text is one more stop string: a
    continuation whose ordinary tokens spell it (the bytes of '</s>') ends there."""
    from dagmoe_jax.data.tokenizers import HFTokenizer

    run = fake_run(model)
    run.tokenizer = HFTokenizer(str(write_byte_level_tokenizer(tmp_path)))
    lm = DagmoeLM(run=run, batch_size=2, mesh="none")
    monkeypatch.setattr(lm.scorer, "generate",
                        lambda prompts, **_: [list(b"ab</s>cd\nx")] * len(prompts))
    requests = [SimpleNamespace(args=("q", {"until": ["\n"], "max_gen_toks": 10})),
                SimpleNamespace(args=("r", {"until": "</s>", "max_gen_toks": 10}))]
    assert lm.generate_until(requests, disable_tqdm=True) == ["ab", "ab"]


def test_local_tasks_through_simple_evaluate(model, tmp_path):
    from lm_eval.tasks import TaskManager

    lm = DagmoeLM(run=fake_run(model), batch_size=4, mesh="none")
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["dagmoe_mc", "dagmoe_rolling", "dagmoe_gen"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
        bootstrap_iters=10)
    scores = results["results"]
    assert set(scores) == {"dagmoe_mc", "dagmoe_rolling", "dagmoe_gen"}
    # multiple choice: acc is the argmax of the scorer's loglikelihoods over the choices
    samples = results["samples"]["dagmoe_mc"]
    scorer, tok = Scorer(model), ByteTokenizer()
    right = []
    for sample in samples:
        pairs = [lm._encode_pair(*args) for args in sample["arguments"]]
        assert [ids for ids, _ in pairs] == [tok.encode(sample["doc"]["question"])] * 4
        lls = [ll for ll, _ in scorer.loglikelihood(pairs)]
        np.testing.assert_allclose([r[0][0] for r in sample["resps"]], lls, rtol=1e-5,
                                   atol=1e-4)
        right.append(int(np.argmax(lls)) == sample["doc"]["label"])
    assert scores["dagmoe_mc"]["acc,none"] == pytest.approx(np.mean(right))
    assert 0 <= scores["dagmoe_mc"]["acc_norm,none"] <= 1
    assert scores["dagmoe_rolling"]["byte_perplexity,none"] > 1
    assert scores["dagmoe_gen"]["exact_match,none"] in (0.0, 1 / 6, 2 / 6, 3 / 6, 4 / 6,
                                                         5 / 6, 1.0)
    assert len(results["samples"]["dagmoe_gen"]) == 6


# ------------------------------------------------------------------------------ run directories


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model):
    """A run directory holding ``model`` as its step-0 checkpoint (as the upcycle command
    writes one)."""
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.run.config import OptimConfig, RunConfig

    path = tmp_path_factory.mktemp("harness") / "run"
    run_lib.prepare_run_dir(path)
    data_cfg = DataConfig(tokenizer="byte", seq_len=WINDOW)
    run_cfg = RunConfig(run_dir=str(path), tensorboard=False)
    optim_cfg = OptimConfig()
    run_lib.save_configs(path, RAW, data_cfg, optim_cfg, run_cfg)
    built, optimizer, _ = run_lib.build(CFG, optim_cfg, run_cfg)
    nnx.update(built, nnx.state(model, nnx.Param))
    run_lib.save_initial_checkpoint(path, built, optimizer, CFG, run_cfg, None)
    return path


def test_cli_writes_the_harness_results(run_dir, tmp_path, capsys):
    from dagmoe_jax.harness.cli import main

    out = tmp_path / "results"
    code = main([f"--run_dir={run_dir}", "--tasks=dagmoe_mc,dagmoe_gen",
                 f"--include_path={TASKS}", f"--output_path={out}", "--log_samples",
                 "--limit=4", "--batch_size=4", "--bootstrap_iters=10"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "dagmoe_mc" in printed.out and "acc_norm" in printed.out
    written = next(out.rglob("results_*.json"))
    results = json.loads(written.read_text())
    assert set(results["results"]) == {"dagmoe_mc", "dagmoe_gen"}
    assert results["n-samples"]["dagmoe_mc"]["effective"] == 4
    assert len(list(out.rglob("samples_dagmoe_mc_*.jsonl"))) == 1
    assert "at step 0" in printed.err
    # a folder named after the run (its directory's name and step), said where
    assert written.parent == out / f"{run_dir.name}_step0"
    assert results["model_name"] == str(run_dir)
    assert f"results written to {written} (samples beside it)" in printed.err


@pytest.mark.parametrize("argv, match", [
    ([], "--run_dir=DIR is required"),
    (["--run_dir=x"], "--tasks=T1,T2 is required"),
    (["--run_dir=x", "--tasks=a", "--log_samples"], "--log_samples needs --output_path"),
    (["--run_dir=x", "--tasks=a", "--limit=0"], "--limit=0.0 is invalid"),
    (["--run_dir=x", "--tasks=a", "--metadata=max_seq_lengths=4"],
     "--metadata=max_seq_lengths=4 is invalid: expected a JSON object"),
    (["--run_dir=RUN", "--tasks=no_such_task"], "unknown task 'no_such_task'"),
    (["--run_dir=/nonexistent/run", "--tasks=dagmoe_mc"], "does not exist"),
])
def test_cli_errors_are_one_line(run_dir, capsys, argv, match):
    from dagmoe_jax.harness.cli import main

    argv = [a.replace("RUN", str(run_dir)) for a in argv]
    if any(a.startswith("--tasks=dagmoe") for a in argv):
        argv.append(f"--include_path={TASKS}")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


@pytest.mark.parametrize("value", ["0,1234,1234,1234", "42", "None", "1,2,3", "0,None,8,52",
                                   " 7 , none ,3,4"])
def test_seed_flag_reads_as_lm_eval_run_reads_it(value):
    """--seed is lm_eval run's: the same four seeds for every spelling, the same default."""
    from lm_eval._cli.run import _int_or_none_list_arg_type

    from dagmoe_jax.harness.cli import DEFAULT_SEEDS, parse_args, seeds

    want = _int_or_none_list_arg_type(3, 4, DEFAULT_SEEDS, value)
    assert seeds(value) == want
    assert parse_args(["--run_dir=x", "--tasks=a"]).seed == [0, 1234, 1234, 1234] == \
        _int_or_none_list_arg_type(3, 4, DEFAULT_SEEDS, DEFAULT_SEEDS)
    for bad in ("1,2", "1,2,3,4,5", "x"):
        with pytest.raises(ValueError, match=r"^--seed=.* is invalid: "):
            seeds(bad)


def test_the_seeds_reach_the_harness_and_the_sampler(run_dir, monkeypatch):
    """lm_eval run's default seeds (few-shot 1234) reach simple_evaluate, so few-shot contexts
    are the ones a published lm-eval number used; the torch slot seeds sampled generation."""
    import lm_eval

    from dagmoe_jax.harness.cli import evaluate, parse_args

    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return {"results": {}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", fake)
    evaluate(parse_args([f"--run_dir={run_dir}", "--tasks=dagmoe_mc",
                         f"--include_path={TASKS}"]), log=lambda _m: None)
    assert (seen["random_seed"], seen["numpy_random_seed"], seen["torch_random_seed"],
            seen["fewshot_random_seed"]) == (0, 1234, 1234, 1234)
    assert seen["model"].seed == 1234
    evaluate(parse_args([f"--run_dir={run_dir}", "--tasks=dagmoe_mc", "--seed=5",
                         f"--include_path={TASKS}"]), log=lambda _m: None)
    assert seen["fewshot_random_seed"] == seen["random_seed"] == 5 == seen["model"].seed


def test_metadata_reaches_the_tasks_and_they_are_built_once(run_dir, monkeypatch, caplog):
    """--metadata (a JSON object, merged over --model_args as lm_eval run merges them) joins
    every task's metadata and reaches simple_evaluate; the tasks load_tasks built and checked
    are the ones the evaluation gets (TaskManager.load), not built a second time, so lm-eval's
    warning about a task's data (its custom_dataset) is said once."""
    import logging

    import lm_eval

    from dagmoe_jax.harness.cli import evaluate, parse_args
    from dagmoe_jax.harness.task_loading import load_tasks, task_manager

    manager = task_manager(str(TASKS), ["dagmoe_mc"], {"max_seq_lengths": [16, 32]})
    built = load_tasks(manager, ["dagmoe_mc"])
    assert built["tasks"]["dagmoe_mc"].config.metadata["max_seq_lengths"] == [16, 32]
    assert manager.load(["dagmoe_mc"]) is built
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs, loaded=kwargs["task_manager"].load(kwargs["tasks"]))
        return {"results": {}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", fake)
    caplog.clear()
    evaluate(parse_args([f"--run_dir={run_dir}", "--tasks=dagmoe_mc", f"--include_path={TASKS}",
                         "--model_args=max_gen_toks=8",
                         '--metadata={"max_seq_lengths": [16], "max_gen_toks": 4}']),
             log=lambda _m: None)
    want = {"max_seq_lengths": [16], "max_gen_toks": 4}
    assert seen["metadata"] == want
    metadata = seen["loaded"]["tasks"]["dagmoe_mc"].config.metadata
    assert {k: metadata[k] for k in want} == want
    warned = [r for r in caplog.records if r.levelno == logging.WARNING
              and r.getMessage().startswith("dagmoe_mc: Custom kwargs can be passed")]
    assert len(warned) == 1, [r.getMessage() for r in warned]


def test_cli_without_the_harness_says_how_to_install(monkeypatch, capsys):
    from dagmoe_jax.harness import cli

    monkeypatch.setitem(sys.modules, "lm_eval.utils", None)
    assert cli.main(["--run_dir=x", "--tasks=a"]) == 3
    err = capsys.readouterr().err
    assert "pip install 'dagmoe-jax[harness]'" in err and "pip install -e '.[harness]'" in err


def test_loaded_run_scores_like_the_model(run_dir, model, rng):
    lm = DagmoeLM(run_dir=str(run_dir), batch_size=8)        # mesh 'auto': 8 CPU devices here
    assert lm.scorer.mesh is not None and lm.scorer.mesh.size == jax.device_count()
    pairs = random_pairs(rng, 4)
    requests = [(None, c, t) for c, t in pairs]
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    want = [reference(model, c, t) for c, t in pairs]
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5, atol=1e-4)
    # the run's model config as trained (how it runs is the run's train config's, settled here)
    assert lm.run.model_cfg == RAW and not lm.run.model.execution.unsettled


def test_chat_template_formats_prompts_as_fine_tuning_does(model):
    """--apply_chat_template renders the harness's prompts with the run's chat formatting (the
    plain template for the byte tokenizer): a conversation's text tokenizes to exactly the ids
    fine-tuning trains on, and the generation prompt ends with the response header."""
    from lm_eval.tasks import TaskManager

    from dagmoe_jax.data.instruct import chat_encoder

    lm = DagmoeLM(run=fake_run(model), batch_size=4, mesh="none")
    conversation = [{"role": "user", "content": "Add 2 and 3."},
                    {"role": "assistant", "content": "5"},
                    {"role": "user", "content": "Add 4 and 4."}]
    text = lm.apply_chat_template(conversation)
    ids, _ = chat_encoder(DataConfig(), ByteTokenizer()).encode(
        conversation[:2] + [{"role": "user", "content": "Add 4 and 4."},
                            {"role": "assistant", "content": ""}])
    assert ByteTokenizer().encode(text) == ids[:-1]          # all but the empty reply's EOS
    assert text.endswith("### Instruction:\nAdd 4 and 4.\n\n### Response:\n")
    assert lm.chat_template(True) == "plain"
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["dagmoe_gen"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        apply_chat_template=True, log_samples=True, limit=2, bootstrap_iters=0)
    context = results["samples"]["dagmoe_gen"][0]["arguments"][0][0]
    assert context.startswith("### Instruction:\nadd ") and context.endswith("### Response:\n")


def test_local_tasks_skip_indexing_the_harness_library(monkeypatch):
    """Tasks all found under --include_path are resolved without the harness's ~15,000
    built-in task files; any other name falls back to the full index."""
    import lm_eval.tasks

    from dagmoe_jax.harness.task_loading import task_manager

    built = []

    class Recording:
        def __init__(self, include_path=None, include_defaults=True, metadata=None):
            built.append(include_defaults)
            self.all_tasks = ["dagmoe_mc", "dagmoe_gen"] + ["hellaswag"] * include_defaults

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recording)
    local = task_manager(str(TASKS), ["dagmoe_mc", "dagmoe_gen"])
    assert local.all_tasks == ["dagmoe_mc", "dagmoe_gen"]
    assert built == [False]
    assert "hellaswag" in task_manager(str(TASKS), ["dagmoe_mc", "hellaswag"]).all_tasks
    assert built == [False, False, True]
    task_manager(None, ["hellaswag"])
    assert built == [False, False, True, True]


def special_run(model, tmp_path, kind):
    """``fake_run(model)`` reading a byte-level Hugging Face tokenizer of ``kind``
    (conftest.write_special_tokenizer): BOS, EOS ids and generation_config.json as an imported
    model's folder has them."""
    from dagmoe_jax.data.tokenizers import HFTokenizer

    path = str(write_special_tokenizer(tmp_path / kind, kind))
    return SimpleNamespace(model=model, model_cfg=model.cfg, tokenizer=HFTokenizer(path),
                           data_cfg=DataConfig(tokenizer="hf", tokenizer_path=path), step=0)


@pytest.mark.parametrize("kind", SPECIAL_TOKENIZER_KINDS)
def test_text_becomes_ids_as_hflm_makes_them(model, tmp_path, kind):
    """HFLM's rules (lm_eval/models/huggingface.py), written out: the document prefix is BOS
    when the tokenizer names one, else EOS; texts get what the tokenizer's post-processing
    adds, unless add_bos_token says otherwise or the text starts with the prefix's text;
    generation stops at every EOS id of generation_config.json. tests/test_harness_hf.py
    checks the same against lm-eval's hf model itself where torch is installed."""
    bos = kind in ("bos_added", "bos_named")
    body = list(b"sort 3 1 =")
    lm = DagmoeLM(run=special_run(model, tmp_path, kind), batch_size=2, mesh="none")
    assert (lm.eot_token_id, lm.prefix_token_id) == (256, 257 if bos else 256)
    added = [257] + body if kind == "bos_added" else body
    assert lm.tok_encode("sort 3 1 =") == lm.prompt_encode("sort 3 1 =") == added
    assert lm.tok_encode("sort 3 1 =", add_special_tokens=False) == body
    # '<s>' in the text is the special token; a text starting with BOS gets no second one
    assert lm.tok_encode("<s>sort 3 1 =") == lm.prompt_encode("<s>sort 3 1 =") == [257] + body
    assert lm.stop_token_ids() == ((256, 258) if kind == "eos_ids" else (256,))
    assert lm.tok_decode([257, *body, 256]) == "sort 3 1 ="              # skips specials
    override = DagmoeLM(run=special_run(model, tmp_path, kind), batch_size=2, mesh="none",
                        add_bos_token="false", prefix_token_id=258)
    assert override.tok_encode("sort 3 1 =") == body and override.prefix_token_id == 258


def test_chat_prompts_also_stop_at_the_end_of_turn(model, tmp_path):
    """Prompts rendered with the run's chat template stop at the token that ends an assistant
    turn there (fine-tuning trained it), besides the EOS ids."""
    import json

    run = special_run(model, tmp_path, "no_bos")
    folder = Path(run.data_cfg.tokenizer_path).parent
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(eos_token="<|eot|>", chat_template=(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    run.tokenizer = type(run.tokenizer)(run.data_cfg.tokenizer_path)
    lm = DagmoeLM(run=run, batch_size=2, mesh="none")
    assert lm.stop_token_ids() == (258,)                 # the file's EOS is <|eot|> now
    run.data_cfg = DataConfig(tokenizer="hf", tokenizer_path=run.data_cfg.tokenizer_path,
                              eos_token="</s>")
    run.tokenizer = type(run.tokenizer)(run.data_cfg.tokenizer_path, "</s>")
    lm = DagmoeLM(run=run, batch_size=2, mesh="none")
    assert lm.stop_token_ids() == (256,)
    lm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert lm.stop_token_ids() == (256, 258)


@pytest.mark.parametrize("args, match", [
    ({"trust_remote_code": True}, "model argument trust_remote_code=True is refused"),
    ({"load_in_8bit": True}, "load_in_8bit=True is refused: it is not an argument"),
    ({"dtype": "float16"}, "dtype='float16' is refused: expected one of auto, float32, bf"),
    ({"pretrained": "/x"}, r"needs exactly one of run_dir \(a run directory\) and run"),
])
def test_model_arguments_are_read_or_refused_by_name(model, args, match):
    with pytest.raises(ValueError, match=match) as err:
        DagmoeLM(run=fake_run(model), batch_size=2, mesh="none", **args)
    assert "\n" not in str(err.value)
    lm = DagmoeLM(run=fake_run(model), batch_size=2, mesh="none", dtype="float32",
                  device="cuda:0", max_batch_size=None)
    assert lm.scorer.batch_size == 2


def test_auto_batch_size_is_the_largest_that_fits(model):
    """'auto' compiles the scoring call and keeps the largest power of two within the
    memory budget; the bytes it counts grow with the rows."""
    scorer = Scorer(model, batch_size=1, max_length=WINDOW)
    sizes = [scorer.call_bytes(rows) for rows in (1, 8, 32)]
    assert sizes[0] < sizes[1] < sizes[2]
    assert scorer.fit_batch_size(32, budget=sizes[1]) == 8
    assert scorer.fit_batch_size(32, budget=sizes[1] - 1) == 4
    assert scorer.fit_batch_size(32, budget=0) == 1
    assert scorer.fit_batch_size(20, budget=sizes[2]) == 16
    lm = DagmoeLM(run=fake_run(model), batch_size="auto:4", max_batch_size=4, mesh="none")
    assert lm.scorer.batch_size == 4


@pytest.mark.parametrize("argv, match", [
    (["--batch_size=0"], "--batch_size=0 is invalid: expected an integer >= 1 or auto"),
    (["--batch_size=big"], "--batch_size=big is invalid"),
    (["--model_args=trust_remote_code=True"], "trust_remote_code=True is refused"),
    (["--model_args=run_dir=/x"], "--model_args run_dir=... is refused: pass --run_dir"),
    (["--model_args=nonsense"], "model argument nonsense='' is refused: it is not an"),
])
def test_cli_model_arguments_are_one_line(run_dir, capsys, argv, match):
    from dagmoe_jax.harness.cli import main

    assert main([f"--run_dir={run_dir}", "--tasks=dagmoe_mc", f"--include_path={TASKS}",
                 *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def test_cli_batch_size_auto(run_dir, monkeypatch, capsys):
    import lm_eval

    from dagmoe_jax.harness.cli import evaluate, parse_args

    seen = {}
    monkeypatch.setattr(lm_eval, "simple_evaluate",
                        lambda **kwargs: seen.update(kwargs) or {"results": {}})
    logged = []
    evaluate(parse_args([f"--run_dir={run_dir}", "--tasks=dagmoe_mc", "--batch_size=auto",
                         "--max_batch_size=4", "--model_args=add_bos_token=False", "--mesh=none",
                         f"--include_path={TASKS}"]), log=logged.append)
    assert seen["model"].scorer.batch_size == seen["batch_size"] == 4
    assert seen["model"].add_bos_token is False
    assert any("batch size auto: 4 rows" in line for line in logged)


def test_a_hugging_face_folder_scores_as_its_imported_run(tmp_path):
    """run_dir='hf:FOLDER' (or HFLM's pretrained=FOLDER) scores the folder as it is, with its
    own tokenizer.json: the same loglikelihoods as a run directory holding the same model and
    tokenizer; bfloat16 compute, when asked, changes them only by its rounding."""
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.hf.export import export_hf
    from dagmoe_jax.run.config import OptimConfig, RunConfig

    cfg = tiny_config("dense", vocab_size=259, max_seq_len=WINDOW, init_std=0.2)
    dense = make_model(cfg)
    folder = export_hf(dense, tmp_path / "hf")
    with pytest.raises(ValueError, match=r"tokenizer.json does not exist: a Hugging Face "):
        DagmoeLM(run_dir=f"hf:{folder}", mesh="none")
    with pytest.raises(ValueError, match=r"config.json does not exist"):
        DagmoeLM(pretrained=str(tmp_path / "nothing"), mesh="none")
    tokenizer_json = write_special_tokenizer(folder, "bos_added", WINDOW)
    run_dir = tmp_path / "run"
    run_lib.prepare_run_dir(run_dir)
    run_cfg = RunConfig(run_dir=str(run_dir), tensorboard=False)
    run_lib.save_configs(run_dir, cfg, DataConfig(tokenizer="hf", seq_len=WINDOW,
                                                  tokenizer_path=str(tokenizer_json)),
                         OptimConfig(), run_cfg)
    built, optimizer, _ = run_lib.build(cfg, OptimConfig(), run_cfg)
    nnx.update(built, nnx.state(dense, nnx.Param))
    run_lib.save_initial_checkpoint(run_dir, built, optimizer, cfg, run_cfg, None)

    requests = [(None, [257, 5, 6, 7], [8, 9]), (None, [257] + list(range(40, 70)), [3])]
    from_run = DagmoeLM(run_dir=str(run_dir), batch_size=2, mesh="none")
    want = from_run._loglikelihood_tokens(requests, disable_tqdm=True)
    for lm in (DagmoeLM(run_dir=f"hf:{folder}", batch_size=2, mesh="none"),
               DagmoeLM(pretrained=str(folder), batch_size=2),       # mesh auto: 8 devices
               ):
        assert lm.prefix_token_id == 257 and lm.tok_encode("ab") == [257, 97, 98]
        got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5)
    bf16 = DagmoeLM(run_dir=f"hf:{folder}", batch_size=2, mesh="none", dtype="bfloat16")
    assert bf16.scorer.model.cfg.compute_dtype == "bfloat16"
    got = [g[0] for g in bf16._loglikelihood_tokens(requests, disable_tqdm=True)]
    assert got != [w[0] for w in want]
    np.testing.assert_allclose(got, [w[0] for w in want], rtol=0.05)


def bad_task_folder(tmp_path, data: str, extra_yaml: str = "") -> Path:
    """tests/harness_tasks' dagmoe_mc in a folder of its own, reading ``data`` as mc.jsonl."""
    import shutil

    folder = tmp_path / "tasks"
    folder.mkdir()
    shutil.copy(TASKS / "data.py", folder / "data.py")
    (folder / "dagmoe_mc.yaml").write_text((TASKS / "dagmoe_mc.yaml").read_text() + extra_yaml)
    (folder / "mc.jsonl").write_text(data)
    return folder


@pytest.mark.parametrize("data, extra, match", [
    ("", "", "task 'dagmoe_mc' has no documents: its data file or split is empty"),
    ('{"question": "x", "choices": ["a", \n', "", "task 'dagmoe_mc' could not be loaded: "),
    ('{"question": "x", "choices": ["a", "b"]}\n', "",
     "task 'dagmoe_mc': document 0 has no valid answer (its target is 'label' for 2 choices)"),
    ('{"question": "x", "choices": ["a", "b"], "label": 1}\n', "unsafe_code: true\n",
     "task 'dagmoe_mc' runs the model's generated code: pass --confirm_run_unsafe_code"),
])
def test_bad_task_data_is_one_line_naming_the_task(run_dir, tmp_path, capsys, data, extra,
                                                   match):
    from dagmoe_jax.harness.cli import main

    folder = bad_task_folder(tmp_path, data, extra)
    assert main([f"--run_dir={run_dir}", "--tasks=dagmoe_mc", f"--include_path={folder}",
                 "--mesh=none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def test_a_missing_include_path_is_one_line(run_dir, tmp_path, capsys):
    from dagmoe_jax.harness.cli import main

    assert main([f"--run_dir={run_dir}", "--tasks=dagmoe_mc",
                 f"--include_path={tmp_path / 'nope'}"]) == 2
    err = capsys.readouterr().err
    assert "is not a folder: point it at the folder of your task YAML files" in err
    assert err.count("\n") == 1


def test_a_hub_task_offline_fails_at_once_naming_its_dataset(tmp_path, monkeypatch):
    """When the Hub is unreachable the clients read their caches only: a dataset that is not
    cached is one line naming it and how to get it, within seconds, not after retries."""
    import time

    import datasets.config
    import huggingface_hub.constants

    from dagmoe_jax.harness import task_loading

    for module, name in ((huggingface_hub.constants, "HF_HUB_OFFLINE"),
                         (datasets.config, "HF_HUB_OFFLINE"),
                         (datasets.config, "HF_DATASETS_OFFLINE")):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))      # an empty cache
    monkeypatch.setattr(task_loading, "hub_reachable", lambda timeout=3.0: False)
    folder = tmp_path / "hub_tasks"
    folder.mkdir()
    (folder / "hub_mc.yaml").write_text(
        "task: hub_mc\ndataset_path: dagmoe-nonexistent/never-cached\noutput_type: "
        "multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\n")
    manager = task_loading.task_manager(str(folder), ["hub_mc"])
    manager.dagmoe_local_only = False          # as if the task came from the Hub library
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        task_loading.load_tasks(manager, ["hub_mc"])
    assert time.monotonic() - start < 20
    message = str(err.value)
    assert message.startswith("task 'hub_mc' needs its dataset 'dagmoe-nonexistent/never-"
                              "cached', which is not in the local cache and the Hugging Face "
                              "Hub is not reachable from here: huggingface-cli download")
    assert "\n" not in message


PROTOCOLS = {   # group -> {task: shots} as the papers state them (configs/eval/*.yaml)
    "dagmoe_table2": {"piqa": 0, "arc_easy": 0, "hellaswag": 10, "gpqa_main_zeroshot": 0,
                      "lambada_openai": 0, "mmlu": 5, "bbh_zeroshot": 0},
    "coe_zeroshot": {"arc_easy": 0, "hellaswag": 0, "piqa": 0},
    "doe_zeroshot": {"mmlu": 0, "arc_challenge": 0, "hellaswag": 0, "gsm8k": 0, "humaneval": 0},
    "dume_reasoning": {"humaneval": 0, "gsm8k": 5, "dume_m_arc": None, "ifeval": 0},
}


def test_the_papers_protocols_are_lm_eval_groups_of_known_tasks():
    """configs/eval's groups index in lm-eval, name only tasks lm-eval has, and fix the shots
    the papers state (the datasets themselves are not loaded: nothing downloads here)."""
    import yaml
    from lm_eval.tasks import TaskManager

    folder = Path(__file__).resolve().parent.parent / "configs" / "eval"
    manager = TaskManager(include_path=str(folder))
    for group, shots in PROTOCOLS.items():
        assert group in manager.all_groups
        cfg = yaml.safe_load((folder / f"{group}.yaml").read_text())
        got = {(t if isinstance(t, str) else t["task"]):
               (None if isinstance(t, str) else t.get("num_fewshot")) for t in cfg["task"]}
        assert got == shots
        assert all(name in manager.all_tasks for name in got)
    m_arc = yaml.safe_load((folder / "dume_m_arc.yaml").read_text())["task"]
    assert len(m_arc) == 30 and all(name in manager.all_tasks for name in m_arc)
