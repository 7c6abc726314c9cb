"""The depth L(dp) of each synthetic task's dynamic-programming DAG (DAG-MoE Appendix A.2.1).

Theorem 3.3 (DAG-MoE sec. 3; proof in Appendix A.3) says a constant-depth transformer with a
DAG-MoE block of L >= L(dp) iterations can output a DP problem's answer directly, for problems of
size O(K log n), where L(dp) is the depth of the DP's computation DAG G(dp) (Definition A.4):
inputs sit at depth 0, a subproblem state i sits one deeper than the deepest state it reads
(a state that reads only inputs or constants has depth 1), and the final answer is one node
deeper than the states it aggregates (eq. 25). The depths of our three tasks:

* ``lis`` (eq. 26-27; A.2.2): ``dp(i) = 1 + max{dp(j) : j < i, s_j < s_i}`` is at depth
  "length of the longest increasing subsequence ending at i", and the answer ``max_i dp(i)``
  one deeper: **L(dp) = LIS(s) + 1**, at most ``min(n, 10) + 1`` for n digits.
* ``edit_distance`` (Levenshtein): ``dp(i, j)`` reads ``dp(i-1, j)``, ``dp(i, j-1)`` and
  ``dp(i-1, j-1)``; the boundary row and column are constants, so ``dp(i, j)`` sits at depth
  ``i + j - 1`` and the answer is ``dp(n, m)`` itself, read out one deeper: **L(dp) = n + m**.
* ``lcs``: the same grid and dependencies as the edit distance: **L(dp) = n + m**.

So the suite's sizes (4-12 in training, longer beyond) need L(dp) of 5-11 (LIS) and 6-26
(edit distance, LCS): far more than the 1-3 DAG iterations per layer we train, times the
layers. Like the paper (A.3: "solving a full O(n)-sized DP instance in a single forward pass
... remains challenging"), the benchmark measures whether DAG aggregation helps a small model
*approximate* these answers, not the theorem's exact regime.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from dagmoe_jax.data.tasks import get_task

State = Tuple[int, ...]


def dp_graph(task: str, inputs: tuple) -> Tuple[Dict[State, List[State]], List[State]]:
    """The DP's state graph: ``{state: states it reads}`` and the states the answer aggregates.

    ``lis``: states ``(i,)``, i < n. ``edit_distance`` / ``lcs``: states ``(i, j)`` with
    1 <= i <= n, 1 <= j <= m (the i = 0 / j = 0 boundary is constant and left out).
    """
    get_task(task)
    if task == "lis":
        (seq,) = inputs
        preds = {(i,): [(j,) for j in range(i) if seq[j] < seq[i]] for i in range(len(seq))}
        return preds, list(preds)
    a, b = inputs
    preds = {}
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            preds[(i, j)] = [s for s in ((i - 1, j), (i, j - 1), (i - 1, j - 1)) if min(s) >= 1]
    return preds, [(len(a), len(b))]


def dp_depth(task: str, inputs: tuple) -> int:
    """L(dp) of one instance by longest path in :func:`dp_graph` (Definition A.4)."""
    preds, final = dp_graph(task, inputs)
    depth: Dict[State, int] = {}
    for state in sorted(preds):  # every predecessor sorts before its state in both tasks
        depth[state] = 1 + max((depth[p] for p in preds[state]), default=0)
    return 1 + max((depth[s] for s in final), default=0)


def dp_depth_closed_form(task: str, inputs: tuple) -> int:
    """The closed forms of the module docstring: LIS(s) + 1, or n + m."""
    if task == "lis":
        return get_task("lis").solve(inputs) + 1
    get_task(task)
    return len(inputs[0]) + len(inputs[1])


DP_DEPTH_NOTES: Dict[str, str] = {
    "lis": "L(dp) = LIS + 1 <= min(n, 10) + 1",
    "edit_distance": "L(dp) = n + m (m in n-2..n+2)",
    "lcs": "L(dp) = n + m (m in n-2..n+2)",
}
