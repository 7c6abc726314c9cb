"""Runs written by earlier versions of the library still load, resume and sample.

Before ``ExecutionConfig`` existed (commit 520a405), a run's ``config.json`` and its
checkpoints' metadata kept ``remat``, ``attention``, ... at the top level of the model config.
The ``old_run`` fixture trains the run that commit's smoke command made (a tiny DAG-MoE, 2
steps, one checkpoint at step 2)::

    python train.py --gin_file=train/smoke.gin --no_progress --gin.RunConfig.steps=2 \\
        --gin.RunConfig.save_every=2 --gin.RunConfig.eval_every=0 \\
        --gin.RunConfig.task_eval_examples=0 --gin.DataConfig.num_synthetic=64 \\
        --gin.ModelConfig.d_model=16 --gin.AggregationConfig.dag_dim=8 \\
        --gin.ExpertConfig.expert_hidden=16 --gin.ModelConfig.max_seq_len=64

and rewrites both places into that layout (the execution fields moved up a level, the step's
checksums rewritten to match), so no checkpoint is kept in the repository.

The ``old_run`` fixture's other layouts: 7ae9da1 (issue 32's starting point):
``ExpertConfig.dispatch='auto'`` in the model config (settled per machine; ``settled_model``
and the checkpoint's metadata hold what it became) and ``ExecutionConfig.fuse_gate_up``, since
renamed ``fuse_projections``; 684ed26, the last with every block family's fields flat in the
model config; 7ae8cf5, the last with the ``ExecutionConfig`` inside the model config
(``ModelConfig.execution``) instead of beside the mesh (``RunConfig.execution``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import build_once
from dagmoe_jax import run as run_lib
from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.families.coe.config import CoEConfig
from dagmoe_jax.families.doe.config import DoEConfig
from dagmoe_jax.run.gin import load_configs
from dagmoe_jax.decoding.generate import generate
from dagmoe_jax.run.checkpoint_files import write_checksums
from dagmoe_jax.train.loop import train

SMOKE = ["RunConfig.steps = 2", "RunConfig.save_every = 2", "RunConfig.eval_every = 0",
         "RunConfig.task_eval_examples = 0", "RunConfig.tensorboard = False",
         "DataConfig.num_synthetic = 64", "ModelConfig.d_model = 16",
         "AggregationConfig.dag_dim = 8", "ExpertConfig.expert_hidden = 16",
         "ModelConfig.max_seq_len = 64"]


def with_execution(model: dict, execution: dict) -> dict:
    """A model config dict as versions up to 7ae8cf5 wrote it: with ``execution`` inside."""
    return {**json.loads(json.dumps(model)), "execution": dict(execution)}


def model_684ed26(model: dict) -> dict:
    """An MoE model's config dict (the runs here are) as versions before the block families'
    configs wrote it (684ed26 and earlier): the family's name in ``block``, and every family's
    fields beside it (the other families' at their defaults)."""
    model = json.loads(json.dumps(model))
    block = model.pop("block")
    kind = block.pop("kind")
    coe = {k: v for k, v in dataclasses.asdict(CoEConfig()).items()
           if k not in ("kind", "router", "experts")}
    doe = {k: v for k, v in dataclasses.asdict(DoEConfig()).items() if k != "kind"}
    return {**model, "block": kind, "ffn_hidden": None, "router": block["router"],
            "experts": block["experts"], "aggregation": block["aggregation"], "coe": coe,
            "doe": doe}


def legacy_model(model: dict) -> dict:
    """A model config dict in the layout before ExecutionConfig (520a405): flat, and its
    execution fields at the top level."""
    model = model_684ed26(model)
    execution = model.pop("execution")
    return {**model, **execution}


def model_7ae9da1(model: dict, dispatch: str = "auto") -> dict:
    """A model config dict as 7ae9da1 wrote it: flat, ``dispatch`` ('auto' in the config as
    given, the settled value elsewhere) and ``fuse_gate_up`` by that name."""
    model = model_684ed26(model)
    model["experts"]["dispatch"] = dispatch
    model["execution"]["fuse_gate_up"] = model["execution"].pop("fuse_projections")
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The run of this version that each layout is written from (built once for the whole
    run: conftest.build_once; the fixtures below copy it)."""
    def build(root: Path) -> str:
        run_dir = root / "trained"
        train(*load_configs(["train/smoke.gin"], SMOKE + [f"RunConfig.run_dir = '{run_dir}'"]),
              progress=False, log=lambda _m: None)
        return str(root / "trained")
    return Path(build_once(tmp_path_factory, "compat", build))


@pytest.fixture(params=["520a405", "7ae9da1", "684ed26", "7ae8cf5"])
def old_run(request, trained, tmp_path) -> Path:
    run_dir = tmp_path / f"run_{request.param}"
    shutil.copytree(trained, run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    step = run_dir / "checkpoints" / "2"
    meta = json.loads((step / "meta" / "metadata").read_text())
    config["train"] = config.pop("run")           # the run's config's key before RunConfig
    execution, settled = config["train"].pop("execution"), config.pop("settled_execution")
    config["settled_model"] = with_execution(config["model"], settled)
    config["model"] = with_execution(config["model"], execution)
    meta["model_config"] = with_execution(meta["model_config"], execution)
    if request.param == "7ae9da1":
        settled = "capacity"                 # what 'auto' became on a GPU (dropless on a CPU)
        config["model"] = model_7ae9da1(config["model"])
        config["settled_model"] = model_7ae9da1(config["settled_model"], settled)
        meta["model_config"] = model_7ae9da1(meta["model_config"], settled)
    elif request.param == "684ed26":
        for key in ("model", "settled_model"):
            config[key] = model_684ed26(config[key])
        meta["model_config"] = model_684ed26(meta["model_config"])
    elif request.param == "520a405":
        del config["settled_model"]
        config["model"] = legacy_model(config["model"])
        meta["model_config"] = legacy_model(meta["model_config"])
    (run_dir / "config.json").write_text(json.dumps(config))
    (step / "meta" / "metadata").write_text(json.dumps(meta))
    write_checksums(step)
    return run_dir


def test_the_legacy_config_reads_migrated(old_run):
    blob = json.loads((old_run / "config.json").read_text())
    model_cfg, _, _, run_cfg = run_lib.load_configs(old_run)
    if old_run.name == "run_520a405":       # the execution fields at the top level: beside the mesh
        assert "remat" in blob["model"] and "execution" not in blob["model"]
        assert run_cfg.execution == ExecutionConfig(**{
            f.name: blob["model"][f.name] for f in dataclasses.fields(ExecutionConfig)})
        assert model_cfg == ModelConfig.from_dict(blob["model"])
    elif old_run.name == "run_7ae8cf5":     # the execution inside the model config: beside the mesh
        assert "execution" in blob["model"] and "execution" not in blob["train"]
        assert run_cfg.execution == ExecutionConfig(**blob["model"]["execution"])
        assert "execution" not in dataclasses.asdict(model_cfg)
    elif old_run.name == "run_684ed26":     # the block family's fields at the top level
        assert blob["model"]["block"] == "moe" and "doe" in blob["model"]
        assert model_cfg.block.router.top_k == blob["model"]["router"]["top_k"]
    else:                                   # dispatch 'auto' and fuse_gate_up, migrated
        assert blob["model"]["experts"]["dispatch"] == "auto"
        assert model_cfg.block.experts.dispatch == blob["settled_model"]["experts"]["dispatch"] == (
            "capacity")
        assert (run_cfg.execution.fuse_projections
                == blob["model"]["execution"]["fuse_gate_up"])
    assert (model_cfg.d_model, model_cfg.block.aggregation.kind) == (16, "dag")


def test_a_checkpoint_written_before_the_restructure_loads_and_samples(old_run, trained):
    loaded = run_lib.load_run(old_run)
    assert loaded.step == 2 and not loaded.warnings
    expected = run_lib.load_run(trained).model_cfg
    if old_run.name == "run_7ae9da1":       # the dispatch its GPU settled 'auto' to
        expected = expected.replace(block=dict(experts=dict(dispatch="capacity")))
    assert loaded.model_cfg == expected
    tokens = jnp.asarray(np.arange(32).reshape(2, 16) % 256, jnp.int32)
    logits, _ = loaded.model(tokens)
    assert logits.shape == (2, 16, 256) and bool(jnp.all(jnp.isfinite(logits)))
    prompt = [loaded.tokenizer.eos_id] + loaded.tokenizer.encode("lis 3 1 4 =")
    out = generate(loaded.model, [prompt], max_new_tokens=4)[0]
    assert len(out) == 4 and all(0 <= t < 256 for t in out)


def test_a_checkpoint_written_before_the_restructure_resumes(old_run, tmp_path):
    """Each layout's configs resume its checkpoint with no model or data change (what the
    training loop's resume policy asks of them); the oldest layout's run trains on a step. (The
    layouts differ in their JSON only, so the restore itself is the same for all four.)"""
    model_cfg, data_cfg, _, _ = run_lib.load_configs(old_run)
    meta = json.loads((old_run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert run_lib.resume_changes(old_run, model_cfg, data_cfg, meta) == ([], [])
    if old_run.name != "run_520a405":
        return
    run_dir = tmp_path / "run"
    shutil.copytree(old_run, run_dir)
    model_cfg, data_cfg, optim_cfg, run_cfg = run_lib.load_configs(run_dir)
    run_cfg = dataclasses.replace(run_cfg, run_dir=str(run_dir), steps=3, tensorboard=False)
    messages = []
    result = train(model_cfg, data_cfg, optim_cfg, run_cfg, progress=False,
                   log=messages.append)
    assert result.resumed_from == 2 and result.step == 3, messages
    assert not any("changed model" in m or "differs" in m for m in messages), messages
    assert np.isfinite(result.losses[3])
