"""DataConfig validation and source specs: one-line errors naming the field."""

import dataclasses

import pytest

from dagmoe_jax.data import DataConfig, parse_source
from dagmoe_jax.data.config import local_batch_size


def _one_line(err):
    assert "\n" not in str(err.value), str(err.value)


def test_defaults_and_frozen():
    cfg = DataConfig()
    assert parse_source(cfg.source) == ("synthetic", ("lis", "edit_distance"))
    assert (cfg.seq_len, cfg.batch_size, cfg.tokenizer) == (256, 16, "byte")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_len = 3
    for f in dataclasses.fields(DataConfig):  # gin-friendly: plain field types only
        assert f.type in ("str", "int", "float", "bool"), f


def test_parse_source():
    assert parse_source("text:a/*.txt, b.txt") == ("text", ("a/*.txt", "b.txt"))
    assert parse_source("tfds:foo/bar:1.0.0") == ("tfds", ("foo/bar:1.0.0",))
    assert parse_source("synthetic:lcs") == ("synthetic", ("lcs",))


@pytest.mark.parametrize("spec, match", [
    ("csv:x", r"DataConfig.source='csv:x' is invalid: expected 'synthetic:"),
    ("nocolon", r"DataConfig.source='nocolon' is invalid"),
    ("text:", r"expected a non-empty argument after 'text:'"),
    ("tfds: ", r"expected a non-empty argument after 'tfds:'"),
    ("synthetic:lis,sudoku", r"unknown task 'sudoku'"),
])
def test_bad_source_specs(spec, match):
    with pytest.raises(ValueError, match=match) as err:
        DataConfig(source=spec)
    _one_line(err)


@pytest.mark.parametrize("changes, match", [
    (dict(eval_source="bogus:1"), r"DataConfig.eval_source='bogus:1' is invalid"),
    (dict(eval_split="validation"), r"DataConfig.eval_split='validation' is invalid: expected "
                                    r"'' unless the eval data is a tfds source"),
    (dict(heldout_fraction=-0.1),
     r"DataConfig.heldout_fraction=-0.1 is invalid: expected a number in \[0, 1\)"),
    (dict(heldout_fraction=1), r"DataConfig.heldout_fraction=1 is invalid"),
    (dict(tokenizer="wordpiece"), r"DataConfig.tokenizer='wordpiece' is invalid"),
    (dict(tokenizer="hf"), r"DataConfig.tokenizer_path='' is invalid: expected the path"),
    (dict(seq_len=0), r"DataConfig.seq_len=0 is invalid: expected an integer >= 1"),
    (dict(batch_size=2.0), r"DataConfig.batch_size=2.0 is invalid"),
    (dict(seed=-1), r"DataConfig.seed=-1 is invalid"),
    (dict(seed=2**32), r"DataConfig.seed=4294967296 is invalid"),
    (dict(task_min_size=5, task_max_size=4), r"DataConfig.task_max_size=4 is invalid: expected "
                                              r"an integer >= 5"),
    (dict(text_key=""), r"DataConfig.text_key='' is invalid"),
    (dict(worker_count=-1), r"DataConfig.worker_count=-1 is invalid"),
    (dict(shuffle=1), r"DataConfig.shuffle=1 is invalid"),
])
def test_bad_fields(changes, match):
    with pytest.raises(ValueError, match=match) as err:
        DataConfig(**changes)
    _one_line(err)


def test_eval_split_allowed_for_tfds_and_batch_divides():
    DataConfig(source="tfds:foo", eval_split="validation")
    DataConfig(eval_source="tfds:foo", eval_split="validation")
    assert local_batch_size(DataConfig(batch_size=8), 4) == 2
    with pytest.raises(ValueError, match=r"DataConfig.batch_size=6 is invalid: expected a "
                                         r"multiple of the process count 4") as err:
        local_batch_size(DataConfig(batch_size=6), 4)
    _one_line(err)
