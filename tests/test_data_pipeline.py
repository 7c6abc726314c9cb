"""grain pipelines: packing, determinism, shards, held-out split, checkpoints, eval batches."""

import json
import math

import grain
import numpy as np
import pytest

from dagmoe_jax.data import (DataConfig, check_tokens, eval_batches, eval_source, make_tokenizer,
                             train_dataset, train_records, train_source, unigram_entropy)
from dagmoe_jax.data.splits import HeldOutView, TrainView, heldout_count

TOK = make_tokenizer(DataConfig())
SMALL = DataConfig(seq_len=24, batch_size=4, num_synthetic=300, num_synthetic_eval=40)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k])
                                                                  for k in x) for x, y in zip(a, b))


def _stream(batches):
    """The packed token stream: each window is inputs + the last target."""
    return np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], 1).ravel()
                           for b in batches])


def _records(src):
    return [src[i] for i in range(len(src))]


@pytest.fixture
def text_cfg(tmp_path):
    """Two files of 40 distinct one-paragraph documents."""
    for f in range(2):
        docs = [f"file {f} document {i} " + "xyz" * (i % 5) for i in range(40)]
        (tmp_path / f"part{f}.txt").write_text("\n\n".join(docs) + "\n")
    return DataConfig(source=f"text:{tmp_path}/part*.txt", seq_len=16, batch_size=4)


def test_shapes_dtypes_and_shift():
    batches = _take(iter(train_dataset(SMALL, TOK)), 3)
    for b in batches:
        assert set(b) == {"inputs", "targets", "mask"}
        assert b["inputs"].shape == b["targets"].shape == b["mask"].shape == (4, 24)
        assert b["inputs"].dtype == b["targets"].dtype == np.int32 and b["mask"].dtype == bool
        assert np.array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
        assert b["mask"].all()  # the endless stream is packed without padding


def test_packing_is_the_concatenated_records():
    cfg = SMALL.replace(shuffle=False)
    stream = _stream(_take(iter(train_dataset(cfg, TOK)), 5))
    src = train_source(cfg)
    expected = np.concatenate([TOK.encode(src[i]) + [TOK.eos_id] for i in range(60)])
    assert np.array_equal(stream, expected[:len(stream)])


def test_deterministic_and_seeded():
    first = _take(iter(train_dataset(SMALL, TOK)), 4)
    assert _same(first, _take(iter(train_dataset(SMALL, TOK)), 4))
    assert not _same(first, _take(iter(train_dataset(SMALL.replace(seed=1), TOK)), 4))


def test_each_epoch_is_a_new_permutation(text_cfg):
    cfg = text_cfg.replace(heldout_fraction=0.1)
    in_order = _records(train_source(cfg))
    n = len(in_order)
    text = TOK.decode(_stream(_take(iter(train_dataset(cfg, TOK)), 80)).tolist())
    docs = text.split("\x00")
    assert len(docs) > 2 * n
    epoch1, epoch2 = docs[:n], docs[n:2 * n]
    assert sorted(epoch1) == sorted(in_order) == sorted(epoch2)  # every record once per epoch
    assert epoch1 != in_order and epoch2 != in_order and epoch1 != epoch2


def test_process_shards_are_disjoint_and_cover(text_cfg):
    every = _records(train_source(text_cfg))
    shards = [_records(train_records(text_cfg, process_index=k, process_count=2)) for k in (0, 1)]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(every)
    batch = next(iter(train_dataset(text_cfg, TOK, process_index=1, process_count=2)))
    assert batch["inputs"].shape == (2, 16)  # batch_size is global
    a = _stream(_take(iter(train_dataset(text_cfg, TOK, process_index=0, process_count=2)), 3))
    b = _stream(_take(iter(train_dataset(text_cfg, TOK, process_index=1, process_count=2)), 3))
    assert not np.array_equal(a, b)
    with pytest.raises(ValueError, match=r"DataConfig.batch_size=4 is invalid: expected a "
                                         r"multiple of the process count 3"):
        train_dataset(text_cfg, TOK, process_index=0, process_count=3)
    with pytest.raises(ValueError, match=r"process_index=2, process_count=2 is invalid"):
        eval_batches(text_cfg, TOK, process_index=2, process_count=2)
    with pytest.raises(ValueError, match=r"fewer training records than the 100 processes"):
        train_records(text_cfg, process_index=99, process_count=100)


def test_heldout_is_disjoint_deterministic_and_seed_independent(text_cfg):
    all_docs = _records(train_source(text_cfg.replace(eval_source=text_cfg.source)))
    train, held = _records(train_source(text_cfg)), _records(eval_source(text_cfg))
    assert len(all_docs) == 80 and len(held) == heldout_count(80, 0.05) == 4
    assert not set(train) & set(held) and sorted(train + held) == sorted(all_docs)
    assert _records(eval_source(text_cfg.replace(seed=9, shuffle=False))) == held
    evaluated = TOK.decode(_stream(eval_batches(text_cfg, TOK)).tolist()).split("\x00")
    assert evaluated[:len(held)] == held  # eval batches are the held-out records, in order


@pytest.mark.parametrize("n", [2, 3, 7, 20, 101, 1000])
def test_split_views_match_brute_force(n):
    for m in sorted({1, n // 3, n - 1} - {0}):
        held = [HeldOutView(range(n), m)[j] for j in range(m)]
        train = [TrainView(range(n), m)[p] for p in range(n - m)]
        assert len(set(held)) == m and sorted(held + train) == list(range(n))
        assert train == sorted(train)


def test_too_few_records_to_hold_out(tmp_path):
    (tmp_path / "one.txt").write_text("only one document\n")
    cfg = DataConfig(source=f"text:{tmp_path}/one.txt")
    with pytest.raises(ValueError, match=r"has only 1 record\(s\), too few to hold out") as err:
        train_source(cfg)
    assert "\n" not in str(err.value)
    assert len(train_source(cfg.replace(eval_source=cfg.source))) == 1


def test_state_resume_reproduces_batches():
    it = iter(train_dataset(SMALL, TOK))
    _take(it, 7)
    state = json.loads(json.dumps(it.get_state()))  # survives a JSON round trip
    expected = _take(it, 6)
    fresh = iter(train_dataset(SMALL, TOK))
    fresh.set_state(state)
    assert _same(_take(fresh, 6), expected)


def test_orbax_checkpoint_resume(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    it = iter(train_dataset(SMALL, TOK))
    _take(it, 5)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as manager:
        manager.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        expected = _take(it, 6)  # advance at once: the state was written at save()
        manager.wait_until_finished()
    restored = iter(train_dataset(SMALL, TOK))
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.latest_step() == 5
        manager.restore(5, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(restored)))
    assert _same(_take(restored, 6), expected)


def test_eval_batches_pack_pad_and_split_rows(text_cfg):
    cfg = text_cfg.replace(eval_source=text_cfg.source, batch_size=8)
    batches = eval_batches(cfg, TOK)
    assert _same(batches, eval_batches(cfg, TOK))
    src = eval_source(cfg)
    tokens = np.concatenate([TOK.encode(src[i]) + [TOK.eos_id] for i in range(len(src))])
    width, total = cfg.seq_len + 1, len(tokens)
    windows = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], 1)
                              for b in batches])
    masks = np.concatenate([b["mask"] for b in batches])
    assert len(windows) == 8 * math.ceil(math.ceil(total / width) / 8)
    full = total // width
    assert np.array_equal(windows[:full].ravel(), tokens[:full * width])
    assert masks[:full].all()
    rest = total - full * width
    assert np.array_equal(windows[full, :rest], tokens[full * width:])
    assert masks[full].sum() == rest - 1 and not masks[full + 1:].any()
    halves = [eval_batches(cfg, TOK, process_index=k, process_count=2) for k in (0, 1)]
    assert len(halves[0]) == len(halves[1]) == len(batches)
    for whole, a, b in zip(batches, *halves):
        for key in whole:
            assert np.array_equal(np.concatenate([a[key], b[key]]), whole[key])
    assert _same(eval_batches(cfg, TOK, max_batches=2), batches[:2])


def test_synthetic_eval_is_the_heldout_stream():
    batches = eval_batches(SMALL, TOK)
    text = TOK.decode(_stream(batches).tolist())
    held = _records(eval_source(SMALL))
    assert len(held) == 40 and text.startswith(held[0] + "\x00" + held[1])
    assert all(b["inputs"].shape == (4, 24) for b in batches)


def test_check_tokens():
    check_tokens({"inputs": np.array([[0, 255]]), "targets": np.array([[1, 2]])}, 256)
    with pytest.raises(ValueError, match=r"batch\['targets'\] has token id 300 \(max 300\) "
                                         r"outside \[0, vocab_size=256\): set "
                                         r"ModelConfig.vocab_size >= tokenizer.vocab_size") as err:
        check_tokens({"inputs": np.array([[0, 1]]), "targets": np.array([[300, 2]])}, 256)
    assert "\n" not in str(err.value)


def test_the_training_stream_checks_its_ids_against_the_model_vocabulary():
    """The check runs where the batch is made (a grain step), not in the training loop: a
    byte stream for a model of 100 ids fails at its first batch, in one line."""
    batches = iter(train_dataset(SMALL, TOK, vocab_size=256))
    assert next(batches)["inputs"].max() < 256
    with pytest.raises(ValueError, match=r"outside \[0, vocab_size=100\)") as err:
        next(iter(train_dataset(SMALL, TOK, vocab_size=100)))
    assert "\n" not in str(err.value)


def test_unigram_entropy_matches_direct_count(text_cfg):
    cfg = text_cfg.replace(seed=3)
    value = unigram_entropy(cfg, TOK, max_tokens=10**7)  # bound not reached: all records
    counts = np.zeros(256)
    for text in _records(train_source(cfg)):
        np.add.at(counts, TOK.encode(text) + [TOK.eos_id], 1)
    log_p = np.log(counts + 1) - np.log(counts.sum() + 256)
    targets = np.concatenate([b["targets"][b["mask"]] for b in eval_batches(cfg, TOK)])
    assert value == pytest.approx(-log_p[targets].mean(), rel=1e-9)
    assert 0 < value < math.log(256)
    bounded = unigram_entropy(cfg, TOK, max_tokens=50)
    assert bounded != value and math.isfinite(bounded)


def test_worker_processes_resume():
    cfg = SMALL.replace(worker_count=1)
    it = iter(train_dataset(cfg, TOK))
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 4)
    it.close()
    fresh = iter(train_dataset(cfg, TOK))
    fresh.set_state(state)
    got = _take(fresh, 4)
    fresh.close()
    assert _same(got, expected)
    assert _same(expected, _take(iter(train_dataset(SMALL, TOK)), 7)[3:])  # 1 worker = in-process
