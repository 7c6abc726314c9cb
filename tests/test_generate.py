"""Cached autoregressive generation: equality with the full forward pass for every block type,
batching of prompts of different lengths, sampling filters, stop tokens and the sample CLI.

Compilation dominates on CPU, so each configuration's model is built once, and the tests share
shapes (batch 2 or 3, padded prompt length, max_new_tokens) so that ``generate``'s jitted
program and the reference forward are compiled as few times as possible.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import build_once, make_model, single_device_env, tiny_config
from dagmoe_jax.decoding.generate import Generation, decoding_model, generate, sample_logits
from dagmoe_jax.model import Transformer

ROOT = Path(__file__).resolve().parents[1]
SEQ = 16
# capacity_factor = num_experts: the full forward's capacity dispatch never drops a token, so it
# is comparable with generation's dropless dispatch (see dagmoe_jax/decoding/generate.py).
NO_DROP = dict(capacity_factor=4.0)
# init_std 0.2 gives peaked logits (the default 0.02 leaves them almost uniform, so a greedy
# comparison would hinge on float-rounding ties).
CONFIGS = {
    "dense": tiny_config("dense", init_std=0.2),
    "moe-sum": tiny_config("moe", "sum", experts=NO_DROP, init_std=0.2),
    "moe-dag": tiny_config("moe", "dag", experts=dict(num_shared=1, **NO_DROP), init_std=0.2),
    "moe-mlp": tiny_config("moe", "mlp", experts=NO_DROP, init_std=0.2),
    "coe": tiny_config("coe", experts=NO_DROP, init_std=0.2),
}
PROMPTS = [[5, 17, 3, 44, 9], [60, 2]]        # different lengths: the second is right-padded


@functools.lru_cache(maxsize=None)
def model_for(name: str) -> Transformer:
    """A model whose zero-initialised aggregator outputs (DAG W_up, MLP W_3) are randomised, so
    the DAG / MLP modules really contribute to the logits being compared."""
    model = make_model(CONFIGS[name])
    key = jax.random.key(1)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and "aggregator" in path and path[-1] in ("w_up", "w_3"):
            key, sub = jax.random.split(key)
            node[...] = 0.1 * jax.random.normal(sub, node.shape, node.dtype)
    return model


@nnx.jit
def forward(model, tokens):
    return model(tokens)[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "prompt_len"))
def teacher_forced(graphdef, state, tokens, lengths, *, prompt_len):
    """Prefill right-padded prompts (junk after each row's length), then feed the rest of
    ``tokens`` one decode step at a time: (prefill logits [B, P, V], step logits [B, steps, V])."""
    model = nnx.merge(graphdef, state)
    b, s = tokens.shape
    junk = (tokens[:, :prompt_len] * 7 + 3) % model.cfg.vocab_size
    prompt = jnp.where(jnp.arange(prompt_len)[None, :] < lengths[:, None], tokens[:, :prompt_len],
                       junk)
    pre, aux = model(prompt, cache=model.init_cache(b, s))
    cache = aux["cache"]

    def step(carry, i):
        params, cache = carry
        pos = lengths + i
        tok = jnp.take_along_axis(tokens, pos[:, None], axis=1)
        logits, aux = nnx.merge(graphdef, params)(tok, cache=cache, start=pos)
        return (params, aux["cache"]), logits[:, 0]

    _, steps = jax.lax.scan(step, (state, cache), jnp.arange(s - prompt_len))
    return pre, steps.transpose(1, 0, 2)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_matches_forward(name):
    """Prefill + one-token decode steps give the full forward pass's logits at every position."""
    model = model_for(name)
    tokens = jax.random.randint(jax.random.key(2), (2, SEQ), 0, 64)
    lengths = jnp.array([7, 4])
    full = np.asarray(forward(model, tokens))
    graphdef, state = nnx.split(decoding_model(model))
    pre, steps = map(np.asarray, teacher_forced(graphdef, state, tokens, lengths, prompt_len=7))
    assert np.abs(full).max() > 1.0                                 # not a vacuous comparison
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(pre[b, :n], full[b, :n], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(steps[b], full[b, n:n + steps.shape[1]], atol=1e-5, rtol=1e-5)


def test_chunked_decode_from_an_empty_cache():
    """Decoding also takes several tokens per row, starting from ``init_cache``."""
    model = decoding_model(model_for("moe-dag"))
    tokens = jax.random.randint(jax.random.key(3), (2, SEQ), 0, 64)

    @nnx.jit
    def chunks(model, tokens):
        cache = model.init_cache(2, SEQ)
        first, aux = model(tokens[:, :6], cache=cache, start=jnp.zeros((2,), jnp.int32))
        rest, _ = model(tokens[:, 6:], cache=aux["cache"], start=jnp.full((2,), 6))
        return jnp.concatenate([first, rest], axis=1)

    np.testing.assert_allclose(np.asarray(chunks(model, tokens)),
                               np.asarray(forward(model_for("moe-dag"), tokens)),
                               atol=1e-5, rtol=1e-5)


def greedy_reference(model, prompts, max_new_tokens):
    """Greedy decoding by full forward passes over a fixed-width buffer (causal, so the buffer's
    tail does not matter; one compilation)."""
    buffer = np.zeros((len(prompts), SEQ), np.int32)
    for b, p in enumerate(prompts):
        buffer[b, :len(p)] = p
    lengths = np.array([len(p) for p in prompts])
    for i in range(max_new_tokens):
        logits = np.asarray(forward(model, jnp.asarray(buffer)))
        pos = lengths + i
        buffer[np.arange(len(prompts)), pos] = logits[np.arange(len(prompts)), pos - 1].argmax(-1)
    return [buffer[b, n:n + max_new_tokens].tolist() for b, n in enumerate(lengths)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_repeated_forward(name):
    model = model_for(name)
    assert generate(model, PROMPTS, max_new_tokens=8) == greedy_reference(model, PROMPTS, 8)


def test_batched_rows_equal_rows_alone():
    model = model_for("moe-dag")
    batched = generate(model, PROMPTS, max_new_tokens=8)
    assert batched == [generate(model, [p], max_new_tokens=8)[0] for p in PROMPTS]
    # an array of right-padded prompts with lengths is the same batch (padding past the longest
    # prompt is cut off)
    array = np.full((2, 7), 63)
    for b, p in enumerate(PROMPTS):
        array[b, :len(p)] = p
    out = generate(model, array, [len(p) for p in PROMPTS], max_new_tokens=8)
    assert isinstance(out, Generation) and out.as_lists() == batched
    assert out.tokens.shape == (2, 8) and not out.finished.any()


def test_filters_at_their_limit_equal_greedy():
    model = model_for("moe-dag")
    greedy = generate(model, PROMPTS, max_new_tokens=8)
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.5, top_k=1, seed=3) == greedy
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.5, top_p=1e-6, seed=4) == greedy


def test_sampling_is_seeded():
    model = model_for("moe-dag")
    sample = functools.partial(generate, model, PROMPTS, max_new_tokens=8, temperature=1.0)
    assert sample(seed=0) == sample(seed=0)
    assert sample(seed=0) != sample(seed=1)
    assert sample(seed=0, top_k=5, top_p=0.9) == sample(seed=0, top_k=5, top_p=0.9)


def test_sample_logits_filters():
    """top-k and top-p keep exactly the tokens they should (2,000 draws of one row)."""
    logits = jnp.log(jnp.array([[0.05, 0.4, 0.3, 0.2, 0.05]] * 2000))
    draw = lambda **kw: np.asarray(sample_logits(logits, jax.random.key(0), **kw))
    assert set(draw(temperature=1.0, top_k=2, top_p=1.0)) == {1, 2}
    assert set(draw(temperature=1.0, top_k=0, top_p=0.75)) == {1, 2, 3}   # 0.4 + 0.3 < 0.75
    assert set(draw(temperature=1.0, top_k=0, top_p=0.7)) == {1, 2}
    assert set(draw(temperature=1.0, top_k=0, top_p=1.0)) == {0, 1, 2, 3, 4}


def test_stop_tokens_finish_rows():
    model = model_for("moe-dag")
    greedy = generate(model, PROMPTS, max_new_tokens=8)
    stop = greedy[0][3]
    cut = greedy[0].index(stop) + 1
    out = generate(model, np.array([PROMPTS[0], PROMPTS[1] + [0, 0, 0]]), [5, 2],
                   max_new_tokens=8, stop_tokens=[stop], pad_id=63)
    assert out.tokens[0, :cut].tolist() == greedy[0][:cut]
    assert (out.tokens[0, cut:] == 63).all() and out.lengths[0] == cut and out.finished[0]
    expected_1 = greedy[1][:greedy[1].index(stop) + 1] if stop in greedy[1] else greedy[1]
    assert out.as_lists()[1] == expected_1
    # every row stops at its first token: the decode loop ends early, the rest is padding
    first = generate(model, PROMPTS, max_new_tokens=8, stop_tokens=[g[0] for g in greedy])
    assert first == [g[:1] for g in greedy]


def test_a_stop_rule_finishes_rows_inside_the_loop():
    """``stop_when`` sees each live row's generated ids so far and finishes the row at the
    token it holds for (kept), independently of the other rows; the decode loop ends once every
    row is done, so the rule is asked no more than each row's length times."""
    model = model_for("moe-dag")
    greedy = generate(model, PROMPTS, max_new_tokens=8)
    target = greedy[0][2]
    seen = []

    def rule(ids):
        seen.append(list(ids))
        return ids[-1] == target or len(ids) == 4
    out = generate(model, np.array([PROMPTS[0], PROMPTS[1] + [0, 0, 0]]), [5, 2],
                   max_new_tokens=8, stop_when=rule, pad_id=63)
    for row, ids in enumerate(greedy):
        n = next(i + 1 for i, t in enumerate(ids) if t == target or i == 3)
        assert out.as_lists()[row] == ids[:n] and out.finished[row]
        assert (out.tokens[row, n:] == 63).all()
        assert [s for s in seen if s == ids[:len(s)]] and max(
            len(s) for s in seen if s == ids[:len(s)]) == n
    assert len(seen) == sum(out.lengths)
    # the rule with stop tokens: whichever comes first ends the row
    both = generate(model, PROMPTS, max_new_tokens=8, stop_tokens=[greedy[1][0]],
                    stop_when=lambda ids: len(ids) == 3)
    assert both == [greedy[0][:3], greedy[1][:1]]


def test_invalid_requests_are_one_line_errors():
    model = model_for("dense")
    for kwargs, match in [
            (dict(prompts=[list(range(60)) + [1] * 5]), "longer than the model's max_seq_len=64"),
            (dict(prompts=[[1] * 60], max_new_tokens=6), "at most 5 new tokens fit"),
            (dict(prompts=[[1], []]), "prompt 1 is empty"),
            (dict(prompts=[[1, 64]]), "token id 64 outside"),
            (dict(prompts=[[1]], top_p=0.0), "top_p=0.0 is invalid"),
            (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens=0 is invalid")]:
        kwargs.setdefault("max_new_tokens", 4)
        with pytest.raises(ValueError, match=match) as err:
            generate(model, **kwargs)
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """A 2-step train.py run of the smoke config (the tiny DAG-MoE, byte tokenizer), built
    once for the whole run (conftest.build_once)."""
    return Path(build_once(tmp_path_factory, "smoke_run", _smoke_run))


def _smoke_run(root: Path) -> str:
    run_dir = root / "smoke"
    cmd = [sys.executable, "train.py", "--gin_file=train/smoke.gin", f"--run_dir={run_dir}",
           "--no_progress", "--gin.RunConfig.steps=2", "--gin.OptimConfig.warmup_steps=0",
           "--gin.RunConfig.task_eval_examples=0", "--gin.RunConfig.eval_batches=1",
           "--gin.RunConfig.tensorboard=False"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=single_device_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return str(run_dir)


@pytest.mark.slow
def test_cli_samples_from_a_checkpoint(smoke_run):
    prompt = "lis 3 1 4 1 5 ="
    cmd = [sys.executable, "-m", "dagmoe_jax.cli.sample", f"--run_dir={smoke_run}",
           f"--prompt={prompt}",
           "--max_new_tokens", "12", "--temperature", "0.8", "--top_k", "20", "--top_p", "0.9",
           "--num_samples", "3", "--seed", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=single_device_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    blocks = proc.stdout.split("--- sample ")[1:]
    assert [b.split(" ---\n", 1)[0] for b in blocks] == ["0", "1", "2"]
    assert all(b.split(" ---\n", 1)[1].startswith(prompt) for b in blocks)
    assert "at step 2" in proc.stderr


@pytest.mark.slow
def test_harness_command_scores_a_train_py_run(smoke_run, tmp_path, capsys):
    from dagmoe_jax.harness.cli import main

    out = tmp_path / "results"
    assert main([f"--run_dir={smoke_run}", "--tasks=dagmoe_gen,dagmoe_rolling",
                 f"--include_path={ROOT / 'tests' / 'harness_tasks'}", "--limit=2",
                 f"--output_path={out}", "--bootstrap_iters=0"]) == 0
    printed = capsys.readouterr()
    assert "exact_match" in printed.out and "bits_per_byte" in printed.out
    assert "at step 2" in printed.err
    assert len(list(out.rglob("results_*.json"))) == 1


@pytest.mark.slow
def test_cli_greedy_equals_library(smoke_run, capsys):
    from dagmoe_jax.run import load_run
    from dagmoe_jax.cli.sample import main

    assert main([f"--run_dir={smoke_run}", "--prompt=edit ab =", "--max_new_tokens=6"]) == 0
    printed = capsys.readouterr().out.split(" ---\n", 1)[1].rstrip("\n")
    run = load_run(smoke_run)
    tok = run.tokenizer
    new = generate(run.model, [[tok.eos_id] + tok.encode("edit ab =")], max_new_tokens=6,
                   stop_tokens=[tok.eos_id])[0]
    new = new[:-1] if new and new[-1] == tok.eos_id else new
    assert printed == ("edit ab =" + tok.decode(new)).rstrip("\n")


@pytest.mark.slow
def test_cli_stop_strings_end_samples(smoke_run, capsys):
    """--stop: the sample is the greedy continuation up to the stop text, and decoding ended
    at the token that completed it (--max_new_tokens is not reached)."""
    from dagmoe_jax.cli.sample import main
    from dagmoe_jax.run import load_run

    run = load_run(smoke_run)
    tok = run.tokenizer
    new = generate(run.model, [[tok.eos_id] + tok.encode("edit ab =")], max_new_tokens=12)[0]
    text = tok.decode(new)
    stop = text[2:4] if len(text) > 4 else text[-1]
    assert main([f"--run_dir={smoke_run}", "--prompt=edit ab =", "--max_new_tokens=12",
                 "--ignore_eos", f"--stop={stop}"]) == 0
    printed = capsys.readouterr().out.split(" ---\n", 1)[1].rstrip("\n")
    assert printed == ("edit ab =" + text.split(stop)[0]).rstrip("\n")


@pytest.mark.slow
@pytest.mark.parametrize("argv, match", [
    (["--run_dir=/nonexistent/run", "--prompt=x"], "does not exist"),
    (["--prompt=" + "a" * 200], "max_seq_len is 128"),
    (["--prompt=x", "--top_k=-1"], "top_k=-1 is invalid"),
    (["--prompt=x", "--bogus"], "unrecognized arguments"),
    (["--prompt=x", "--stop="], "--stop= is empty"),
])
def test_cli_errors_are_one_line(smoke_run, capsys, argv, match):
    from dagmoe_jax.cli.sample import main

    if not any(a.startswith("--run_dir") for a in argv):
        argv = [f"--run_dir={smoke_run}"] + argv
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and err.startswith("error: ") and "\n" not in err


def test_a_prefill_cache_shorter_than_the_prompt_is_a_clear_error():
    model = model_for("moe-dag")
    tokens = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"the cache has 4 slots, fewer than the prompts' 8 "
                                         r"tokens: make it with init_cache"):
        model(tokens, cache=model.init_cache(2, 4))


@pytest.mark.slow
def test_cli_chat_renders_the_prompt_as_fine_tuning_did(smoke_run, capsys):
    """--chat: the prompt as a user turn of the run's template (the plain one for a byte
    tokenizer) with the assistant's header; --show_prompt prints it; the answer equals the
    library's generation from those ids, stopping at the end of turn."""
    from dagmoe_jax.cli.sample import chat_prompt, main
    from dagmoe_jax.data.instruct import chat_encoder
    from dagmoe_jax.run import load_run

    assert main([f"--run_dir={smoke_run}", "--prompt=edit ab", "--chat", "--show_prompt",
                 "--system=be brief", "--max_new_tokens=6"]) == 0
    out = capsys.readouterr().out
    rendered = "be brief\n\n### Instruction:\nedit ab\n\n### Response:\n"
    assert out.startswith(f"--- prompt 0 ---\n{rendered}\n--- sample 0 ---\n")
    run = load_run(smoke_run)
    encoder = chat_encoder(run.data_cfg, run.tokenizer)
    ids, text = chat_prompt(encoder, "edit ab", "be brief")
    assert text == rendered
    new = generate(run.model, [ids], max_new_tokens=6, stop_tokens=[encoder.end_id])[0]
    new = new[:-1] if new and new[-1] == encoder.end_id else new
    assert out.split("--- sample 0 ---\n", 1)[1].rstrip("\n") == \
        run.tokenizer.decode(new).rstrip("\n")
    assert main([f"--run_dir={smoke_run}", "--prompt=x", "--system=s"]) == 2
    assert "--system needs --chat" in capsys.readouterr().err


def test_a_chat_sample_that_ends_its_turn_at_once_says_so():
    """--chat: a first token that ends the turn prints a note, not an empty sample; a stop id
    after an answer is dropped as before, and with --ignore_eos it is text."""
    from dagmoe_jax.cli.sample import EMPTY_TURN, shown_sample
    from dagmoe_jax.data.tokenizers import ByteTokenizer

    tok, end = ByteTokenizer(), 3                           # 3: the template's end of turn
    prompt = tok.encode("### Response:\n")
    assert shown_sample(tok, prompt, [end], stops=(0, end), chat=True) == EMPTY_TURN
    assert shown_sample(tok, prompt, tok.encode("ok") + [end], stops=(0, end),
                        chat=True) == "ok"
    assert shown_sample(tok, prompt, [end], stops=(0, end), chat=True,
                        ignore_eos=True) == "\x03"
    assert shown_sample(tok, [0] + prompt, tok.encode("ok!") + [0], stops=(0,),
                        stop_strings=["!"], prefix=[0]) == "### Response:\nok"


def test_a_chat_prompt_is_the_start_of_the_conversation_fine_tuning_trains():
    """The ids --chat decodes from are exactly the first ids of the trained conversation with
    an answer (the same pieces, tokenized the same way), for a jinja template too."""
    from dagmoe_jax.cli.sample import chat_prompt
    from dagmoe_jax.data.chat import ChatEncoder
    from dagmoe_jax.data.tokenizers import ByteTokenizer

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    for encoder in (ChatEncoder(ByteTokenizer()), ChatEncoder(ByteTokenizer(), template)):
        ids, _ = chat_prompt(encoder, "2+2?", "math")
        full, weights = encoder.encode([{"role": "system", "content": "math"},
                                        {"role": "user", "content": "2+2?"},
                                        {"role": "assistant", "content": "4"}])
        assert full[:len(ids)] == ids and not any(weights[:len(ids)])
        assert any(weights[len(ids):])
