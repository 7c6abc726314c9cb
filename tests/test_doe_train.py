"""A DoE run end to end (in process, configs/train/doe_smoke.gin on a planted-topic text file):
Stage 1 is fitted and kept in the run, the loss terms are logged, the loss falls, and a resume
from a checkpoint reproduces the uninterrupted run bit for bit (topics carried through packing,
shuffling and the checkpointed iterator)."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from dagmoe_jax.data import make_tokenizer, train_dataset
from dagmoe_jax.run.gin import load_configs
from dagmoe_jax.families.doe.topics import TopicModel
from dagmoe_jax.train.loop import train
from dagmoe_jax.run.records import read_metrics

THEMES = [["ocean", "wave", "salt", "tide", "reef", "coral", "shore", "current"],
          ["flame", "ember", "smoke", "ash", "heat", "spark", "coal", "furnace"],
          ["stone", "granite", "quarry", "pebble", "boulder", "marble", "slate", "cliff"]]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("doe")
    rng = np.random.default_rng(0)
    docs = [" ".join(THEMES[d % 3][i] for i in rng.integers(0, 8, rng.integers(20, 60))) + "."
            for d in range(90)]
    (root / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    model, data, optim, tcfg = load_configs(
        ["train/doe_smoke.gin"], [f"DataConfig.source = 'text:{root / 'corpus.txt'}'",
                                  "RunConfig.steps = 12", "RunConfig.save_every = 6",
                                  "RunConfig.eval_every = 0", "DoEConfig.num_topics = 8"])
    return root, model, data, optim, tcfg


def test_pipeline_carries_topics_aligned_with_tokens(configs):
    _, model_cfg, data_cfg, _, _ = configs
    from dagmoe_jax.families.doe.topics import fit_topics, piece_table, token_topics
    from dagmoe_jax.families.doe.extension import TopicAnnotator
    from dagmoe_jax.families.doe.topics.stage import training_documents

    tokenizer = make_tokenizer(data_cfg)
    topics = fit_topics(training_documents(data_cfg), 8)
    annotate = TopicAnnotator(topics, tokenizer.piece_bytes())
    it = iter(train_dataset(data_cfg, tokenizer, annotate=annotate))
    batch = next(it)
    assert batch["topics"].shape == batch["inputs"].shape == batch["topic_labels"].shape
    # Every row is a packed stretch of records. Input ids are causal, so from each record start
    # (after an EOS) to the row's end they must equal the ids re-derived from those tokens;
    # labels are non-null only on word bytes.
    pieces = piece_table(tokenizer)
    checked = 0
    for row in range(batch["inputs"].shape[0]):
        tokens, carried = batch["inputs"][row], batch["topics"][row]
        for a in np.flatnonzero(tokens == tokenizer.eos_id) + 1:
            ids, _ = token_topics(topics, tokens[a:].tolist(), pieces)
            np.testing.assert_array_equal(carried[a:], ids)
            checked += len(ids)
        word = np.isin(tokens, list(b"abcdefghijklmnopqrstuvwxyz"))
        assert np.all(word[batch["topic_labels"][row] != topics.null_id])
        assert np.any(batch["topic_labels"][row] != topics.null_id)
    assert checked > 20
    state = it.get_state()
    following = next(it)
    again = iter(train_dataset(data_cfg, tokenizer, annotate=annotate))
    again.set_state(state)
    for key, value in next(again).items():
        np.testing.assert_array_equal(value, following[key])


@pytest.mark.slow          # three training runs in this process; about 20 s
def test_doe_run_logs_its_terms_and_resumes_bit_for_bit(configs):
    root, model_cfg, data_cfg, optim_cfg, run_cfg = configs
    ref = root / "ref"
    train(model_cfg, data_cfg, optim_cfg, dataclasses.replace(run_cfg, run_dir=str(ref)),
          progress=False, log=lambda _m: None)
    records = {r["step"]: r for r in read_metrics(ref) if "loss" in r}
    assert TopicModel.load(str(ref / "topics")).num_topics == 8
    for key in ("expert_loss", "kl_loss", "recon_loss", "ce_loss"):
        assert key in records[1]
    assert records[1]["expert_loss"] > 0
    assert np.mean([records[s]["loss"] for s in (11, 12)]) < records[1]["loss"]

    resumed = root / "resumed"
    shutil.copytree(ref, resumed)
    shutil.rmtree(resumed / "checkpoints" / "12")
    messages = []
    train(model_cfg, data_cfg, optim_cfg, dataclasses.replace(run_cfg, run_dir=str(resumed)),
          progress=False, log=messages.append)
    assert any("resumed from step 6" in m for m in messages)
    again = {r["step"]: r for r in read_metrics(resumed) if "loss" in r}
    assert [again[s]["loss"] for s in range(7, 13)] == [records[s]["loss"] for s in range(7, 13)]


@pytest.mark.slow
def test_harness_scores_a_doe_run_with_its_topics_tracked(configs):
    """lm-evaluation-harness's model for a DoE run reads the run's topic model and scores each
    request with the causal topic ids of its own tokens, as the model's forward pass does."""
    pytest.importorskip("lm_eval")
    import jax.numpy as jnp

    from dagmoe_jax.decoding.generate import decoding_model
    from dagmoe_jax.harness.lm import DagmoeLM
    from dagmoe_jax.run.extensions import extension_for

    root, model_cfg, data_cfg, optim_cfg, run_cfg = configs
    run_dir = root / "harness"
    train(model_cfg, data_cfg, optim_cfg,
          dataclasses.replace(run_cfg, run_dir=str(run_dir), steps=2, save_every=2),
          progress=False, log=lambda _m: None)
    lm = DagmoeLM(run_dir=str(run_dir), batch_size=2, mesh="none")
    assert lm.scorer.features is not None
    tok = lm.tokenizer_obj
    pairs = [(tok.encode("ocean wave salt tide"), tok.encode(" reef")),
             (tok.encode("flame ember smoke ash heat spark"), tok.encode(" coal furnace"))]
    got = lm._loglikelihood_tokens([(None, c, t) for c, t in pairs], disable_tqdm=True)

    tracker = extension_for(lm.run.model_cfg).decoding_features(str(run_dir), lm.run.data_cfg,
                                                                tok)
    model = decoding_model(lm.run.model)
    for (context, continuation), (logp, _) in zip(pairs, got):
        whole = np.asarray([context + continuation])
        inputs = whole[:, :-1]
        features = {k: jnp.asarray(v) for k, v in
                    tracker.prompt(inputs, np.asarray([inputs.shape[1]])).items()}
        logits, _ = model(jnp.asarray(inputs), features=features)
        want = log_softmax_np(np.asarray(logits[0], np.float64))[-len(continuation):]
        want = want[np.arange(len(continuation)), continuation].sum()
        np.testing.assert_allclose(logp, want, rtol=1e-5)


def log_softmax_np(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
