"""Checkpoints are topology independent: a run saved on dp 2 x ep 4 resumes on dp 4 x ep 2, and
its checkpoint restores onto one device with the same values (8 simulated CPU devices)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dagmoe_jax.run.gin import load_configs
from dagmoe_jax.parallel import MeshConfig
from dagmoe_jax.run.checkpoint import Checkpointer
from dagmoe_jax.run import abstract, build, train_state
from dagmoe_jax.train.loop import train

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def _configs(run_dir, steps, **mesh):
    model, data, optim, tr = load_configs(["train/smoke.gin"], [
        f"RunConfig.run_dir = '{run_dir}'", f"RunConfig.steps = {steps}",
        "RunConfig.eval_every = 0", "RunConfig.task_eval_examples = 0",
        "RunConfig.tensorboard = False", "OptimConfig.warmup_steps = 2"])
    return model, data, optim, dataclasses.replace(tr, mesh=MeshConfig(**mesh))


def _params(model):
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


@pytest.mark.slow          # two sharded training runs and two restores: about 25 s
def test_checkpoint_moves_between_meshes_and_onto_one_device(tmp_path):
    run_dir = tmp_path / "run"
    first = train(*_configs(run_dir, 6, data=2, expert=4), progress=False, log=lambda _: None)
    assert first.step == 6
    messages = []
    second = train(*_configs(run_dir, 8, data=4, expert=2), progress=False, log=messages.append)
    assert second.resumed_from == 6 and second.step == 8
    assert any("resumed from step 6" in m for m in messages)
    assert sorted(second.losses) == [7, 8] and all(np.isfinite(list(second.losses.values())))

    # The step-8 checkpoint, restored on dp 4 x ep 2 and on a single device: same values.
    model_cfg, _, optim_cfg, run_cfg = _configs(run_dir, 8, data=4, expert=2)
    from dagmoe_jax.parallel import activate, make_mesh
    restored = {}
    for name, mesh in (("ep2", make_mesh(run_cfg.mesh)), ("one", None)):
        model, optimizer, _ = build(model_cfg, optim_cfg, run_cfg, mesh)
        with Checkpointer(run_dir / "checkpoints", save_every=10, async_save=False) as ckpt:
            if mesh is None:
                result = ckpt.restore(abstract(train_state(model, optimizer)))
            else:
                with activate(mesh):
                    result = ckpt.restore(abstract(train_state(model, optimizer)))
        assert result.step == 8
        nnx.update(model, result.state["model"])
        restored[name] = model
    w_up = restored["ep2"].layers.block.experts.w_up[...]
    assert w_up.sharding.spec[1] == "expert" and len(w_up.sharding.device_set) == 8
    assert len(restored["one"].layers.block.experts.w_up[...].sharding.device_set) == 1
    one, ep2 = _params(restored["one"]), _params(restored["ep2"])
    assert one.keys() == ep2.keys()
    for key in one:
        np.testing.assert_array_equal(one[key], ep2[key], err_msg=key)
