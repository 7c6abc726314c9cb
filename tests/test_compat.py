"""Runs written by earlier versions of the library still load and resume.

``tests/fixtures/run_520a405`` is a run directory written by commit 520a405 (before
``ExecutionConfig`` existed: its ``config.json`` and checkpoint metadata keep ``remat``,
``attention``, ... at the top level of the model config), made with::

    python train.py --gin_file=train/smoke.gin --no_progress --gin.TrainConfig.steps=2 \\
        --gin.TrainConfig.save_every=2 --gin.TrainConfig.eval_every=0 \\
        --gin.TrainConfig.task_eval_examples=0 --gin.DataConfig.num_synthetic=64 \\
        --gin.ModelConfig.d_model=16 --gin.AggregationConfig.dag_dim=8 \\
        --gin.ExpertConfig.expert_hidden=16 --gin.ModelConfig.max_seq_len=64

(its tensorboard/ folder removed): a tiny DAG-MoE, 2 steps, one checkpoint at step 2.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dagmoe_jax import runs
from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.train.loop import train

OLD_RUN = Path(__file__).resolve().parent / "fixtures" / "run_520a405"


def test_the_legacy_config_reads_with_its_execution_fields_nested():
    blob = json.loads((OLD_RUN / "config.json").read_text())
    assert "remat" in blob["model"] and "execution" not in blob["model"]   # the old layout
    model_cfg, _, _, _ = runs.load_configs(OLD_RUN)
    assert model_cfg.execution == ExecutionConfig(**{f.name: blob["model"][f.name]
                                                     for f in dataclasses.fields(ExecutionConfig)})
    assert model_cfg == ModelConfig.from_dict(blob["model"])
    assert (model_cfg.d_model, model_cfg.aggregation.kind) == (16, "dag")


def test_a_checkpoint_written_before_the_restructure_loads():
    loaded = runs.load_run(OLD_RUN)
    assert loaded.step == 2 and not loaded.warnings
    tokens = jnp.asarray(np.arange(32).reshape(2, 16) % 256, jnp.int32)
    logits, _ = loaded.model(tokens)
    assert logits.shape == (2, 16, 256) and bool(jnp.all(jnp.isfinite(logits)))


def test_a_checkpoint_written_before_the_restructure_resumes(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(OLD_RUN, run_dir)
    model_cfg, data_cfg, optim_cfg, train_cfg = runs.load_configs(run_dir)
    train_cfg = dataclasses.replace(train_cfg, run_dir=str(run_dir), steps=3, tensorboard=False)
    messages = []
    result = train(model_cfg, data_cfg, optim_cfg, train_cfg, progress=False,
                   log=messages.append)
    assert result.resumed_from == 2 and result.step == 3, messages
    assert not any("changed model" in m or "differs" in m for m in messages), messages
    assert np.isfinite(result.losses[3])
