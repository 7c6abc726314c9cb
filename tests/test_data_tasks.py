"""Synthetic DP tasks: answers equal brute force, the text format parses back, determinism."""

import numpy as np
import pytest

from dagmoe_jax.data.tasks import TASKS, format_example, generate, parse, parse_answer


@pytest.mark.parametrize("name", sorted(TASKS))
def test_dp_answer_equals_brute_force(name):
    task, rng = TASKS[name], np.random.default_rng(1)
    for _ in range(300):
        inputs = task.draw(rng, int(rng.integers(1, 8)))
        assert task.solve(inputs) == task.brute_force(inputs), inputs


def test_known_answers():
    assert TASKS["lis"].solve(((3, 1, 4, 1, 5, 9, 2, 6),)) == 4
    assert TASKS["lis"].solve(((2, 2, 2),)) == 1  # strictly increasing
    assert TASKS["edit_distance"].solve(("kitten", "sitting")) == 3
    assert TASKS["edit_distance"].solve(("abca", "acb")) == 2
    assert TASKS["lcs"].solve(("abcbdab", "bdcaba")) == 4
    assert format_example("lis", ((3, 1, 4, 1, 5, 9, 2, 6),)).text == "lis 3 1 4 1 5 9 2 6 = 4\n"
    assert format_example("edit_distance", ("abca", "acb")).text == "edit abca acb = 2\n"
    assert format_example("lcs", ("abca", "acb")).text == "lcs abca acb = 2\n"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_format_parses_back_and_is_one_line(name):
    rng = np.random.default_rng(2)
    for size in (1, 4, 12, 40):
        ex = generate(name, rng, size)
        assert ex.prompt.endswith("=") and ex.answer.startswith(" ") and ex.answer.endswith("\n")
        assert ex.text.count("\n") == 1 and "=" not in ex.answer
        task, inputs, answer = parse(ex.text)
        assert task == name and answer == TASKS[name].solve(inputs)
        assert format_example(name, inputs) == ex
        assert parse_answer(ex.answer) == answer
    lengths = [len(TASKS[name].draw(np.random.default_rng(s), 9)[0]) for s in range(5)]
    assert lengths == [9] * 5  # the first input has exactly `size` elements


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_for_a_seed(name):
    a = [generate(name, np.random.default_rng(7), 10) for _ in range(3)]
    b = [generate(name, np.random.default_rng(7), 10) for _ in range(3)]
    assert a == b
    rng = np.random.default_rng(7)
    draws = {generate(name, rng, 10).text for _ in range(20)}
    assert len(draws) > 10


def test_parse_answer_and_errors():
    assert parse_answer(" 12\nlis 1 2 = 2") == 12
    assert parse_answer(" x\n") is None
    assert parse("lis 1 2 3")[2] is None
    with pytest.raises(ValueError, match="not a task example") as err:
        parse("foo 1 2 = 3\n")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="task 'nope' is invalid"):
        generate("nope", np.random.default_rng(0), 3)
    with pytest.raises(ValueError, match="size=0 is invalid"):
        generate("lis", np.random.default_rng(0), 0)
