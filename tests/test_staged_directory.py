"""A command's output directory is written whole or not at all
(:func:`dagmoe_jax.run.paths.staged_directory`): into a hidden sibling, moved into place."""

from __future__ import annotations

import pytest

from dagmoe_jax.run.paths import partial_path, staged_directory


def names(path):
    return sorted(p.name for p in path.iterdir())


@pytest.mark.parametrize("existing", [False, True])
def test_the_sibling_becomes_the_target_when_the_block_ends(tmp_path, existing):
    target = tmp_path / "out"
    if existing:
        target.mkdir()                            # an empty directory is taken over
    with staged_directory(target) as stage:
        assert stage == partial_path(target) == tmp_path / ".out.partial"
        (stage / "a.txt").write_text("a")
        assert not (target / "a.txt").exists()    # nothing at the target meanwhile
    assert names(tmp_path) == ["out"] and (target / "a.txt").read_text() == "a"


@pytest.mark.parametrize("error", [KeyboardInterrupt, ValueError])
def test_an_exception_leaves_the_target_as_it_was(tmp_path, error):
    target = tmp_path / "out"
    with pytest.raises(error):
        with staged_directory(target) as stage:
            (stage / "a.txt").write_text("a")
            raise error()
    assert names(tmp_path) == []
    target.mkdir()
    with pytest.raises(error):
        with staged_directory(target) as stage:
            (stage / "a.txt").write_text("a")
            raise error()
    assert names(tmp_path) == ["out"] and names(target) == []


def test_a_full_target_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    for target in (tmp_path / "out", tmp_path / "file"):
        with pytest.raises(ValueError, match="already exists and is not an empty directory"):
            with staged_directory(target):
                pytest.fail("entered")
    assert names(tmp_path) == ["file", "out"] and names(tmp_path / "out") == ["mine.txt"]


def test_merge_keeps_other_files_and_replaces_those_of_the_same_name(tmp_path):
    """As a results folder grows (lm-eval's ``OUT/<model>/results_<date>.json``)."""
    target = tmp_path / "plots"
    target.mkdir()
    (target / "mine.txt").write_text("mine")
    (target / "a.png").write_text("old")
    (target / "stats").mkdir()
    (target / "stats" / "old.npz").write_text("old")
    with staged_directory(target, merge=True) as stage:
        # inside the directory it merges into: needs no write permission beside it
        assert stage == partial_path(target, merge=True) == target / ".plots.partial"
        (stage / "a.png").write_text("new")
        (stage / "stats").mkdir()
        (stage / "stats" / "new.npz").write_text("new")
    assert names(tmp_path) == ["plots"]
    assert names(target) == ["a.png", "mine.txt", "stats"]
    assert (target / "a.png").read_text() == "new"
    assert names(target / "stats") == ["new.npz", "old.npz"]


def test_a_leftover_sibling_of_a_killed_attempt_is_replaced(tmp_path):
    leftover = partial_path(tmp_path / "out")
    leftover.mkdir()
    (leftover / "half.bin").write_text("half")
    with staged_directory(tmp_path / "out") as stage:
        assert names(stage) == []
    assert names(tmp_path) == ["out"] and names(tmp_path / "out") == []


def test_an_unwritable_parent_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"cannot write .*: choose a writable path"):
        with staged_directory(tmp_path / "file" / "out"):
            pytest.fail("entered")


def test_merge_into_a_new_directory_is_a_rename_and_a_file_is_refused(tmp_path):
    with staged_directory(tmp_path / "plots", merge=True) as stage:
        assert stage == tmp_path / ".plots.partial"
        (stage / "a.png").write_text("a")
    assert names(tmp_path) == ["plots"] and names(tmp_path / "plots") == ["a.png"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="already exists and is not a directory"):
        with staged_directory(tmp_path / "file", merge=True):
            pytest.fail("entered")
    assert (tmp_path / "file").read_text() == "x"


def test_a_merge_stopped_by_an_exception_leaves_the_directory_as_it_was(tmp_path):
    target = tmp_path / "plots"
    target.mkdir()
    (target / "mine.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt):
        with staged_directory(target, merge=True) as stage:
            (stage / "a.png").write_text("a")
            raise KeyboardInterrupt
    assert names(target) == ["mine.txt"]
