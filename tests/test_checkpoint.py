"""Checkpointer: bit-exact round trips, retention, intervals, iterator positions, corruption
fallback and architecture mismatches."""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dagmoe_jax.run.checkpoint import CheckpointMismatchError, Checkpointer, Restored
from dagmoe_jax.run.config import OptimConfig
from dagmoe_jax.run.optim import make_optimizer
from dagmoe_jax.train.step import make_train_step
from conftest import make_model

# One transformation for every optimizer of this module (a new one would mean a new graph).
TX = make_optimizer(OptimConfig(learning_rate=1e-2, schedule="constant", warmup_steps=0), 100)


def make_train_state(cfg, seed=0, updates=0):
    """A model and its optimizer after ``updates`` AdamW steps with random gradients."""
    model = make_model(cfg, seed=seed)
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    key = jax.random.key(seed + 1)
    for _ in range(updates):
        params = nnx.state(model, nnx.Param)
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(key, len(leaves) + 1)
        key = keys[0]
        grads = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype)
                                             for k, x in zip(keys[1:], leaves)])
        optimizer.update(model, grads)
    return model, optimizer


def abstract_train_state(cfg):
    return nnx.state(nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, TX, wrt=nnx.Param)))(
            make_model(cfg))))


def host_copy(tree):
    return [np.array(x) for x in jax.tree.leaves(tree)]


def assert_bit_exact(restored, expected_leaves):
    leaves = jax.tree.leaves(restored)
    assert len(leaves) == len(expected_leaves)
    for got, want in zip(leaves, expected_leaves):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def small_state(value=0.0):
    return {"w": jnp.full((8, 8), value, jnp.float32), "b": jnp.zeros((8,), jnp.float32)}


def abstract_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def truncate_biggest_file(step_dir):
    files = [os.path.join(root, f) for root, _, names in os.walk(step_dir) for f in names]
    biggest = max(files, key=os.path.getsize)
    os.truncate(biggest, os.path.getsize(biggest) // 2)
    return biggest


# ----------------------------------------------------------------------------- round trip

def test_round_trip_of_model_and_optimizer_is_bit_exact(tmp_path, tiny):
    cfg = tiny(block="moe", kind="dag", experts=dict(num_shared=1))
    model, optimizer = make_train_state(cfg, updates=3)
    saved = host_copy(nnx.state((model, optimizer)))
    meta = {"model_config": dataclasses.asdict(cfg), "step": 3}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    step = make_train_step(donate=True)  # donates the state it updates, as the loop's does
    params_at_save = host_copy(nnx.state(model, nnx.Param))
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        assert ckpt.save(np.int64(3), nnx.state((model, optimizer)), meta=meta)
        # the loop keeps training while the save is written, over the donated arrays
        for _ in range(2):
            step(model, optimizer, batch)
    assert int(optimizer.step[...]) == 5
    assert any(not np.array_equal(np.asarray(now), then) for now, then in
               zip(jax.tree.leaves(nnx.state(model, nnx.Param)), params_at_save))

    # restore puts every array into the sharding its abstract leaf asks for
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                            abstract_train_state(cfg))
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        restored = ckpt.restore(abstract, expected_meta={"model_config": dataclasses.asdict(cfg)})
    assert isinstance(restored, Restored)
    assert (restored.step, restored.skipped, restored.meta_diffs) == (3, [], [])
    assert restored.meta == meta
    assert_bit_exact(restored.state, saved)
    assert all(x.sharding == replicated for x in jax.tree.leaves(restored.state))

    fresh_model, fresh_optimizer = make_train_state(cfg, seed=5)
    nnx.update((fresh_model, fresh_optimizer), restored.state)
    assert int(fresh_optimizer.step[...]) == 3
    assert_bit_exact(nnx.state((fresh_model, fresh_optimizer)), saved)


def test_pure_dict_state_round_trip_and_form_mismatch(tmp_path, tiny):
    cfg = tiny(block="moe", kind="dag")
    model, optimizer = make_train_state(cfg, updates=1)
    pure = nnx.to_pure_dict(nnx.state((model, optimizer)))
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        ckpt.save(1, pure, meta={})
        restored = ckpt.restore(abstract_of(pure))
        assert_bit_exact(restored.state, host_copy(pure))
        with pytest.raises(CheckpointMismatchError, match="different pytree form"):
            ckpt.restore(abstract_train_state(cfg))
    assert sorted(os.listdir(tmp_path)) == ["1"]


# ----------------------------------------------------------------------------- retention, interval

def test_keep_last_n(tmp_path):
    with Checkpointer(tmp_path, save_every=1, keep=2) as ckpt:
        for step in range(1, 5):
            assert ckpt.save(step, small_state(step), meta={"step": step})
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
    assert sorted(d for d in os.listdir(tmp_path) if d.isdigit()) == ["3", "4"]
    with Checkpointer(tmp_path, save_every=1, keep=2) as ckpt:
        restored = ckpt.restore(abstract_of(small_state()))
    assert restored.step == 4 and restored.meta == {"step": 4}
    np.testing.assert_array_equal(restored.state["w"], np.full((8, 8), 4.0, np.float32))


def test_save_interval_and_force(tmp_path):
    with Checkpointer(tmp_path, save_every=5) as ckpt:
        assert ckpt.latest_step() is None
        assert not ckpt.save(3, small_state(), meta={})     # not even the first step seen
        assert ckpt.save(5, small_state(), meta={})
        assert not ckpt.save(7, small_state(), meta={})
        assert ckpt.save(7, small_state(), meta={}, force=True)
        assert not ckpt.save(7, small_state(), meta={}, force=True)   # already saved
        assert ckpt.save(10, small_state(), meta={})
        ckpt.wait()
        assert ckpt.all_steps() == [5, 7, 10] and ckpt.latest_step() == 10
        with pytest.raises(ValueError, match="meta is not JSON-serialisable"):
            ckpt.save(15, small_state(), meta={"bad": object()})


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match=r"Checkpointer.save_every=0 is invalid"):
        Checkpointer(tmp_path, save_every=0)
    with pytest.raises(ValueError, match=r"Checkpointer.keep=0 is invalid"):
        Checkpointer(tmp_path, save_every=1, keep=0)


# ----------------------------------------------------------------------------- data iterator

def make_iterator():
    return iter(grain.MapDataset.range(100).shuffle(seed=0).repeat().to_iter_dataset())


def test_async_save_captures_the_iterator_position_at_save_time(tmp_path):
    reference = [next(it) for it in [make_iterator()] for _ in range(20)]
    it = make_iterator()
    consumed = [next(it) for _ in range(7)]
    with Checkpointer(tmp_path, save_every=10, async_save=True) as ckpt:
        assert ckpt.save(10, small_state(1.0), data_iterator=it, meta={"step": 10})
        after = [next(it) for _ in range(5)]            # the loop goes on during the save
        ckpt.wait()
    assert consumed + after == reference[:12]

    fresh = make_iterator()
    with Checkpointer(tmp_path, save_every=10) as ckpt:
        restored = ckpt.restore(abstract_of(small_state()), data_iterator=fresh)
    assert restored.step == 10
    assert [next(fresh) for _ in range(5)] == reference[7:12]


# ----------------------------------------------------------------------------- corruption
# When one array read fails, Orbax closes its event loop with the other reads still pending;
# they end later, in TensorStore's threads or the garbage collector, and Python reports each as
# an unraisable exception ("Exception ignored in: <coroutine ...>", "Event loop is closed").
# Harmless noise on stderr; pytest turns it into warnings. Tests that make a restore fail
# ignore those and let the leftovers finish before the next test starts.


@pytest.fixture
def failed_reads_settle():
    yield
    time.sleep(0.5)
    gc.collect()


def orbax_failed_reads(test):
    test = pytest.mark.usefixtures("failed_reads_settle")(test)
    return pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")(test)


@orbax_failed_reads
def test_truncated_newest_step_falls_back_and_is_moved_aside(tmp_path, tiny):
    cfg = tiny(block="moe", kind="dag")
    model, optimizer = make_train_state(cfg, updates=1)
    with Checkpointer(tmp_path, save_every=10, keep=3) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, nnx.state((model, optimizer)), data_iterator=make_iterator(),
                      meta={"step": step})
    saved = host_copy(nnx.state((model, optimizer)))
    truncate_biggest_file(tmp_path / "30")
    # an unfinished save left behind by a killed process is ignored, as Orbax does
    os.makedirs(tmp_path / "40.orbax-checkpoint-tmp-1234567890" / "state")

    with Checkpointer(tmp_path, save_every=10, keep=3) as ckpt:
        restored = ckpt.restore(abstract_train_state(cfg), data_iterator=make_iterator())
        assert restored.step == 20
        assert len(restored.skipped) == 1
        message = restored.skipped[0]
        assert message.startswith(f"checkpoint step 30 in {tmp_path} is unreadable (")
        assert message.endswith("; falling back to step 20") and "\n" not in message
        assert_bit_exact(restored.state, saved)
        assert not (tmp_path / "30").exists() and (tmp_path / "30.corrupt").is_dir()
        assert ckpt.all_steps() == [10, 20]
        # training goes on from step 20 and saves step 30 again
        assert ckpt.save(30, nnx.state((model, optimizer)), meta={"step": 30})
    with Checkpointer(tmp_path, save_every=10, keep=3) as ckpt:
        again = ckpt.restore(abstract_train_state(cfg))
    assert (again.step, again.skipped) == (30, [])
    assert (tmp_path / "30.corrupt").is_dir()


@orbax_failed_reads
def test_read_only_reader_changes_nothing_in_a_live_run(tmp_path):
    """Evaluating or sampling a run while it trains (issue: the reader deleted the save in
    flight): a read-only Checkpointer leaves a save's tmp directory and an unreadable step
    exactly where they are, falls back all the same, and refuses to save."""
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, small_state(step), meta={"step": step})
    truncate_biggest_file(tmp_path / "2")
    in_flight = tmp_path / "3.orbax-checkpoint-tmp-1234567890" / "state"
    os.makedirs(in_flight)
    (in_flight / "_METADATA").write_text("{}")
    before = sorted(os.listdir(tmp_path))
    with Checkpointer(tmp_path, save_every=1, read_only=True) as reader:
        restored = reader.restore(abstract_of(small_state()))
        assert restored.step == 1 and "falling back to step 1" in restored.skipped[0]
        with pytest.raises(ValueError, match="opened read-only"):
            reader.save(4, small_state(), meta={})
    time.sleep(0.5)                        # Orbax cleans tmp directories in a background thread
    assert sorted(os.listdir(tmp_path)) == before and (in_flight / "_METADATA").exists()
    # a writer does clean up (what used to kill the training run when a reader did it)
    with Checkpointer(tmp_path, save_every=1) as writer:
        writer.restore(abstract_of(small_state()))
    time.sleep(0.5)
    assert not (tmp_path / "3.orbax-checkpoint-tmp-1234567890").exists()


@orbax_failed_reads
def test_all_steps_corrupt_is_a_one_line_error(tmp_path):
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": jnp.arange(4096, dtype=jnp.float32)}, meta={"step": step})
    truncate_biggest_file(tmp_path / "2")
    (tmp_path / "1" / "meta" / "metadata").write_text('{"step": ')   # invalid JSON
    for _ in range(2):            # nothing is moved aside, so it keeps failing
        with Checkpointer(tmp_path, save_every=1) as ckpt:
            with pytest.raises(ValueError, match=r"no checkpoint in .* is readable: step 2 \(.*\), "
                                                 r"step 1 \(JSONDecodeError.*start a new run "
                                                 r"directory") as err:
                ckpt.restore({"w": jax.ShapeDtypeStruct((4096,), jnp.float32)})
        assert "\n" not in str(err.value)
        assert not isinstance(err.value, CheckpointMismatchError)
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_a_signal_during_a_read_is_the_signal_not_a_damaged_step(tmp_path, monkeypatch):
    """Orbax wraps what interrupts a restore (Ctrl-C, a run's SIGINT) in its own error: the
    interrupt comes out as itself, not as 'no checkpoint is readable', and no step is moved
    aside (the fine-tuning sweep of tests/test_reliability.py met it reading its source)."""
    from dagmoe_jax.train.signals import Interrupted
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        ckpt.save(1, small_state(1), meta={})

    def interrupted(*_args, **_kwargs):
        try:
            raise Interrupted("SIGINT")
        except Interrupted as err:
            raise RuntimeError("restore failed") from err
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        monkeypatch.setattr(ckpt._manager, "restore", interrupted)
        with pytest.raises(Interrupted):
            ckpt.restore(abstract_of(small_state()))
    assert sorted(os.listdir(tmp_path)) == ["1"]


@orbax_failed_reads
def test_missing_item_counts_as_unreadable(tmp_path):
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, small_state(step), data_iterator=make_iterator(), meta={})
    for name in os.listdir(tmp_path / "2" / "data"):
        os.remove(tmp_path / "2" / "data" / name)
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        restored = ckpt.restore(abstract_of(small_state()), data_iterator=make_iterator())
    assert restored.step == 1 and "step 2" in restored.skipped[0]


# ----------------------------------------------------------------------------- architecture

def test_different_architecture_is_a_mismatch_not_corruption(tmp_path, tiny):
    cfg8 = tiny(block="moe", kind="dag", experts=dict(num_experts=8))
    cfg4 = tiny(block="moe", kind="dag", experts=dict(num_experts=4))
    model, optimizer = make_train_state(cfg8)
    with Checkpointer(tmp_path, save_every=10) as ckpt:
        ckpt.save(10, nnx.state((model, optimizer)),
                  meta={"model_config": dataclasses.asdict(cfg8)})
    with Checkpointer(tmp_path, save_every=10) as ckpt:
        with pytest.raises(CheckpointMismatchError) as err:
            ckpt.restore(abstract_train_state(cfg4),
                         expected_meta={"model_config": dataclasses.asdict(cfg4)})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint step 10 in {tmp_path} was written for a different "
                              f"architecture: 0/layers/block/experts/w_down has shape "
                              f"(2, 8, 32, 32) there but (2, 4, 32, 32) in this config")
    assert "also differs: model_config.block.experts.num_experts 8 -> 4" in message
    assert message.endswith("(use the original config, or a new run dir)")
    assert sorted(os.listdir(tmp_path)) == ["10"]          # nothing moved aside


def test_meta_differences_are_reported(tmp_path):
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        ckpt.save(1, small_state(), meta={"model_config": {"top_k": 2}, "lr": 0.1})
        restored = ckpt.restore(abstract_of(small_state()),
                                expected_meta={"model_config": {"top_k": 4}, "lr": 0.1})
    assert restored.meta_diffs == ["model_config.top_k 2 -> 4"]


def test_empty_directory_restores_nothing(tmp_path):
    with Checkpointer(tmp_path / "new_run", save_every=10) as ckpt:
        assert ckpt.restore(abstract_of(small_state())) is None
        assert ckpt.latest_step() is None


@orbax_failed_reads
def test_a_flipped_byte_is_caught_by_the_checksums_and_falls_back(tmp_path):
    """Silent corruption (one byte of a data file flipped) loaded without error before the
    checksum manifest; now the step is unreadable like any other damage."""
    from dagmoe_jax.run.checkpoint import CHECKSUM_FILE
    with Checkpointer(tmp_path, save_every=1) as ckpt:          # asynchronous saves
        for step in (1, 2):
            ckpt.save(step, {"w": jnp.arange(4096, dtype=jnp.float32) + step}, meta={})
    for step in (1, 2):
        assert (tmp_path / str(step) / CHECKSUM_FILE).exists()
    files = [p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x01
    biggest.write_bytes(bytes(data))
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        restored = ckpt.restore({"w": jax.ShapeDtypeStruct((4096,), jnp.float32)})
    assert restored.step == 1 and "checksum mismatch" in restored.skipped[0]
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.arange(4096) + 1)
    assert (tmp_path / "2.corrupt").is_dir()


@pytest.fixture
def file_size_limit():
    """Writes past ``limit`` bytes fail (EFBIG) while the fixture is active, as on a full disk
    (Python ignores SIGXFSZ, so the write returns the error instead of killing the process)."""
    import resource

    saved = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limit(size: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, saved[1]))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, saved)


def test_a_failed_background_save_is_one_error_and_never_a_step(tmp_path, file_size_limit):
    """A full disk during an asynchronous save: ``check_for_errors`` raises it (one line, the
    step, the OS's reason, where a rerun resumes) without waiting for another save, ``close``
    does not raise it twice, and the failed save never becomes a step."""
    from dagmoe_jax.command_line import quiet_background_errors
    from dagmoe_jax.run.checkpoint import CheckpointSaveError

    quiet_background_errors()
    ckpt = Checkpointer(tmp_path, save_every=1)
    big = {"w": jax.random.normal(jax.random.key(0), (256, 256))}   # 256 KiB, incompressible
    ckpt.save(1, big, meta={})
    ckpt.wait()
    file_size_limit(64 * 1024)
    ckpt.save(2, {"w": big["w"] + 1}, meta={})
    deadline = time.monotonic() + 30
    with pytest.raises(CheckpointSaveError) as failed:
        while time.monotonic() < deadline:
            ckpt.check_for_errors()
            time.sleep(0.01)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"saving checkpoint step 2 in {tmp_path} failed ([Errno 27] ")
    assert message.endswith("run the same command again to resume from step 1")
    ckpt.close()                                     # reported once: no second error
    assert ckpt.all_steps() == [1]
    restored = Checkpointer(tmp_path, save_every=1, read_only=True).restore(abstract_of(big))
    assert restored.step == 1


def test_a_failed_synchronous_save_raises_at_once(tmp_path, file_size_limit):
    from dagmoe_jax.run.checkpoint import CheckpointSaveError

    file_size_limit(64 * 1024)
    ckpt = Checkpointer(tmp_path, save_every=1, async_save=False)
    with pytest.raises(CheckpointSaveError, match=r"step 3 .* then run the same command again "
                                                  r"to start over$"):
        ckpt.save(3, {"w": jax.random.normal(jax.random.key(1), (256, 256))}, meta={})
    ckpt.close()
    assert ckpt.all_steps() == []
