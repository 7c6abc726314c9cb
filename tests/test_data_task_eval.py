"""task_eval_batches + exact_match: the mask is exactly the answer; scoring per row and task."""

import numpy as np
import pytest

from dagmoe_jax.data import DataConfig, make_tokenizer, task_eval_batches, task_names
from dagmoe_jax.data.tasks import TASKS, parse
from dagmoe_jax.evaluation.accuracy import exact_match, per_task_accuracy

CFG = DataConfig(source="synthetic:lis,edit_distance,lcs", seq_len=48, batch_size=4)
TOK = make_tokenizer(CFG)


def _rows(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_mask_is_exactly_the_answer():
    batches = task_eval_batches(CFG, TOK, num_examples=30, batch_size=8)
    assert [len(b["inputs"]) for b in batches] == [8, 8, 8, 6]
    rows = _rows(batches)
    assert rows["inputs"].shape == (30, 48) and rows["inputs"].dtype == np.int32
    assert rows["task_id"].tolist() == [i % 3 for i in range(30)]
    for r in range(30):
        inputs, targets, mask = rows["inputs"][r], rows["targets"][r], rows["mask"][r]
        assert inputs[0] == TOK.eos_id and np.array_equal(inputs[1:], targets[:-1])
        answer = TOK.decode(targets[mask].tolist())
        assert answer.startswith(" ") and answer.endswith("\n") and answer.count("\n") == 1
        n = int(mask.nonzero()[0][-1]) + 1  # the answer ends the row
        line = TOK.decode(targets[:n].tolist())
        task, inputs_, value = parse(line)
        assert task == task_names(CFG)[rows["task_id"][r]] and value == TASKS[task].solve(inputs_)
        assert line.endswith(answer) and np.flatnonzero(mask).tolist() == list(
            range(n - len(TOK.encode(answer)), n))
        assert CFG.task_min_size <= rows["size"][r] <= CFG.task_max_size
    again = task_eval_batches(CFG, TOK, num_examples=30, batch_size=8)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(batches, again) for k in a)


def test_sizes_and_tasks_arguments():
    rows = _rows(task_eval_batches(CFG, TOK, num_examples=6, size=3, batch_size=6,
                                   tasks=["lcs"]))
    assert rows["task_id"].tolist() == [0] * 6 and rows["size"].tolist() == [3] * 6
    rows = _rows(task_eval_batches(CFG, TOK, num_examples=20, size=(20, 21), batch_size=5,
                                   seq_len=80))
    assert set(rows["size"].tolist()) <= {20, 21} and rows["inputs"].shape == (20, 80)
    with pytest.raises(ValueError, match=r"needs \d+ tokens > seq_len=48: raise "
                                         r"DataConfig.seq_len") as err:
        task_eval_batches(CFG, TOK, num_examples=3, size=30, batch_size=3)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"size=\(5, 4\) is invalid"):
        task_eval_batches(CFG, TOK, num_examples=3, size=(5, 4), batch_size=3)
    with pytest.raises(ValueError, match=r"batch_size=0 is invalid"):
        task_eval_batches(CFG, TOK, num_examples=3, batch_size=0)
    with pytest.raises(ValueError, match=r"has no synthetic tasks: pass tasks="):
        task_eval_batches(DataConfig(source="text:x.txt"), TOK, num_examples=1, batch_size=1)


def test_exact_match_scores_rows():
    batch = task_eval_batches(CFG, TOK, num_examples=6, batch_size=6)[0]
    targets, mask = batch["targets"], batch["mask"]
    perfect = targets.copy()
    perfect[~mask] = 7  # non-answer positions are not scored
    assert exact_match(perfect, targets, mask).all()
    wrong = perfect.copy()
    col = np.flatnonzero(mask[2])[-1]  # the answer's '\n'
    wrong[2, col] += 1
    assert exact_match(wrong, targets, mask).tolist() == [True, True, False, True, True, True]
    logits = np.eye(TOK.vocab_size, dtype=np.float32)[wrong]  # [B, S, V] also accepted
    assert exact_match(logits, targets, mask).tolist() == [True, True, False, True, True, True]
    acc = per_task_accuracy(exact_match(wrong, targets, mask), batch["task_id"],
                            task_names(CFG))
    assert acc == {"all": 5 / 6, "lis": 1.0, "edit_distance": 1.0, "lcs": 0.5}
