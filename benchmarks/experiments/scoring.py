"""Exact-answer scoring of the synthetic DP tasks, by problem size, and seed statistics.

A task example is scored teacher-forced: the row holds EOS, the prompt and the reference
answer, and it is right iff the model's argmax at every answer position equals the reference
token (:func:`dagmoe_jax.evaluation.exact_match`). Each answer token is then predicted from the
correct prefix, so this is exactly "greedy decoding writes the reference answer" (the answer
ends with its newline, so greedy decoding would stop there too), computed in one forward pass.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from dagmoe_jax.data import task_eval_batches
from dagmoe_jax.data.config import DataConfig
from dagmoe_jax.data.tasks import LETTERS, get_task
from dagmoe_jax.evaluation import eval_step, exact_match
from dagmoe_jax.decoding.generate import decoding_model

Predictor = Callable[[Dict[str, np.ndarray]], np.ndarray]


def model_predictor(model, rows: Optional[int] = None, dispatch: Optional[str] = None) -> Predictor:
    """``batch -> argmax ids [B, S]`` of ``model`` (the jitted eval step of the train loop).

    rows: a batch of fewer rows is padded to ``rows`` before the step (and the padding's
      predictions dropped), so a last partial batch does not compile the step again.
    dispatch: None runs the model as configured. With capacity dispatch (the benchmarks'
      configs) an expert's buffer is shared by every token of the batch, so what gets dropped,
      and hence a problem's verdict, depends on the other rows (padding included). 'dropless'
      (exact) scores each problem on its own, as generation does (:func:`dagmoe_jax.decoding.generate.decoding_model`).
    """
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel


    if dispatch is not None:
        model = decoding_model(model, dispatch)

    def predict(batch):
        n = len(batch["inputs"])
        pad = max((rows or n) - n, 0)
        device = {}
        for k in ("inputs", "targets", "mask"):
            rows_k = np.asarray(batch[k])
            if pad:
                rows_k = np.concatenate([rows_k, np.zeros((pad,) + rows_k.shape[1:], rows_k.dtype)])
            device[k] = jnp.asarray(rows_k)
        return np.asarray(eval_step(model, device)["predictions"])[:n]
    return predict


def score_batches(predict: Predictor, batches: Iterable[Dict[str, np.ndarray]]
                  ) -> Dict[str, np.ndarray]:
    """Per example: ``correct`` (bool), ``size`` and ``task_id`` (int), concatenated over
    ``batches`` (from :func:`~dagmoe_jax.data.task_eval_batches`)."""
    correct, size, task_id = [], [], []
    for batch in batches:
        correct.append(exact_match(predict(batch), batch["targets"], batch["mask"]))
        size.append(np.asarray(batch["size"]))
        task_id.append(np.asarray(batch["task_id"]))
    if not correct:
        return {"correct": np.zeros(0, bool), "size": np.zeros(0, np.int32),
                "task_id": np.zeros(0, np.int32)}
    return {"correct": np.concatenate(correct).astype(bool), "size": np.concatenate(size),
            "task_id": np.concatenate(task_id)}


def accuracy_by_size(correct: np.ndarray, size: np.ndarray) -> Dict[int, float]:
    """``{size: share of correct examples}`` for each size present."""
    correct, size = np.asarray(correct, bool), np.asarray(size)
    return {int(n): float(correct[size == n].mean()) for n in np.unique(size)}


def max_example_tokens(task: str, size: int) -> int:
    """An upper bound on the bytes of one ``task`` line of problem ``size`` plus the EOS before
    it: the longest inputs a generator can draw (digits are one byte; pair tasks draw a second
    string of up to size + 2) and the longest answer (an LIS of digits is at most 10, an edit
    distance or LCS at most size + 2)."""
    t = get_task(task)
    if task == "lis":
        inputs = ((0,) * size,)
        answer = min(size, 10)
    else:
        inputs = (LETTERS[0] * size, LETTERS[0] * (size + 2))
        answer = size + 2
    return 1 + len(f"{t.prefix} {t.write(inputs)} = {answer}\n")


def eval_seq_len(tasks: Sequence[str], sizes: Sequence[int], multiple: int = 16) -> int:
    """One row length that fits every example of ``tasks`` x ``sizes`` (byte tokenizer),
    rounded up to ``multiple`` so a benchmark compiles its eval step once."""
    need = max(max_example_tokens(t, n) for t in tasks for n in sizes) - 1
    return int(math.ceil(need / multiple) * multiple)


def score_by_size(predict: Predictor, data_cfg: DataConfig, tokenizer, task: str,
                  sizes: Sequence[int], *, num_examples: int, batch_size: int = 64,
                  seq_len: Optional[int] = None) -> Dict[int, float]:
    """Exact-answer accuracy of ``predict`` on ``num_examples`` problems of ``task`` at each
    size of ``sizes`` (the same problems for every model: they depend only on
    ``data_cfg.synthetic_seed``, the task and the size)."""
    seq_len = seq_len or eval_seq_len([task], sizes)
    result = {}
    for n in sizes:
        batches = task_eval_batches(data_cfg, tokenizer, num_examples=num_examples, size=int(n),
                                    batch_size=batch_size, tasks=[task], seq_len=seq_len)
        result[int(n)] = float(score_batches(predict, batches)["correct"].mean())
    return result


def majority_baseline(batches: Iterable[Dict[str, np.ndarray]]) -> float:
    """Accuracy of always giving the most common reference answer among ``batches``' problems
    (what a model that learned only the answer distribution at this size would score)."""
    answers: Dict[tuple, int] = {}
    total = 0
    for batch in batches:
        for targets, mask in zip(batch["targets"], batch["mask"]):
            key = tuple(int(t) for t in np.asarray(targets)[np.asarray(mask, bool)])
            answers[key] = answers.get(key, 0) + 1
            total += 1
    return max(answers.values()) / total if total else float("nan")


def baseline_by_size(data_cfg: DataConfig, tokenizer, task: str, sizes: Sequence[int], *,
                     num_examples: int, seq_len: Optional[int] = None) -> Dict[int, float]:
    """:func:`majority_baseline` of the problems :func:`score_by_size` scores, per size."""
    seq_len = seq_len or eval_seq_len([task], sizes)
    return {int(n): majority_baseline(task_eval_batches(
        data_cfg, tokenizer, num_examples=num_examples, size=int(n), batch_size=num_examples,
        tasks=[task], seq_len=seq_len)) for n in sizes}


def mean_std(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for a single value) of ``values``."""
    array = np.asarray(values, np.float64)
    if array.size == 0:
        return float("nan"), float("nan")
    return float(array.mean()), float(array.std(ddof=1)) if array.size > 1 else 0.0


# Two-sided 5% critical values of Student's t by degrees of freedom (1-9); normal beyond.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> Dict[str, float]:
    """The seed-paired difference a - b over the seeds both have: mean, sample std, count, and
    whether the mean is beyond the seed spread (a paired t-test at 5%, two-sided: |mean| >
    t * std / sqrt(n); never with fewer than 2 seeds)."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    mean, std = mean_std(diffs)
    n = len(diffs)
    beyond = False
    if n >= 2:
        t = _T_975[n - 2] if n - 2 < len(_T_975) else 1.96
        beyond = bool(abs(mean) > t * std / math.sqrt(n))
    return {"mean": mean, "std": std, "seeds": n, "beyond_spread": beyond}


def seed_statistics(per_seed: Sequence[Mapping[int, float]]) -> Dict[int, Tuple[float, float]]:
    """``{size: (mean, std)}`` across seeds of per-seed ``{size: accuracy}`` dicts."""
    sizes: List[int] = sorted({n for acc in per_seed for n in acc})
    return {n: mean_std([acc[n] for acc in per_seed if n in acc]) for n in sizes}
