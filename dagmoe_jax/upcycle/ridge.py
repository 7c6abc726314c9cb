"""Closed-form ridge-regression routers (DUME eqs. 2-7), in float64 NumPy on the host.

DUME (seed 004, sec. 2.3) fits each MoE layer's router as a ridge regression from the layer's
MLP input x (with a ones column appended for the bias, ``x~ = [x, 1]``) to the one-hot domain
label y of the text it came from. The regression needs only two sums over tokens,
``A = sum x~^T x~`` [(d+1), (d+1)] and ``B = sum x~^T y`` [(d+1), N] (eq. 3 / 5 / 7), which are
accumulated batch by batch in any order; ``W~ = (A + lambda I)^-1 B`` (eq. 2 / 6) is solved once.

Since y is one-hot, domain j contributes only to column j of B, and that column is the sum of
its tokens' x~. :class:`DomainStatistics` therefore keeps, per domain, ``gram = sum x~^T x~``
([layers, d+1, d+1]), ``total = sum x~`` ([layers, d+1]) and the token count: adding a domain
later adds its gram to A and its column to B, and re-solves, with no retraining. This is exact
as long as the averaged (non-MLP) weights, which shape the later layers' inputs, do not change;
adding a domain to a merged model changes the average, so :mod:`dagmoe_jax.upcycle.dume`
keeps the first merge's shared weights when a domain is added.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence, Tuple, Union

import numpy as np

DEFAULT_LAMBDA = 1e-2    # DUME sec. 3.1 and the authors' code: absolute, not scaled by token count
PathLike = Union[str, Path]


@dataclasses.dataclass
class DomainStatistics:
    """One domain's ridge statistics for every MoE layer (float64).

    gram [layers, d+1, d+1]: sum of x~^T x~ over the domain's tokens (its share of A, eq. 7);
    total [layers, d+1]: sum of x~ (its column of B, eq. 7); tokens: how many tokens were seen.
    """

    gram: np.ndarray
    total: np.ndarray
    tokens: int = 0

    @classmethod
    def zeros(cls, num_layers: int, d_model: int) -> "DomainStatistics":
        return cls(np.zeros((num_layers, d_model + 1, d_model + 1), np.float64),
                   np.zeros((num_layers, d_model + 1), np.float64), 0)

    def update(self, x: np.ndarray, mask: np.ndarray = None) -> None:
        """Accumulate one batch of MLP inputs ``x`` [layers, T, d] (any float dtype; T tokens,
        e.g. a flattened [B, S]), keeping only tokens where ``mask`` [T] is true (DUME eq. 5 /
        7: A += X~^T X~, B[:, j] += X~^T 1)."""
        x = np.asarray(x, np.float64)
        if mask is not None:
            x = x[:, np.asarray(mask, bool).reshape(-1)]
        ones = np.ones(x.shape[:2] + (1,), np.float64)
        xt = np.concatenate([x, ones], axis=-1)                          # X~ = [X, 1]
        self.gram += np.matmul(xt.transpose(0, 2, 1), xt)              # BLAS, per layer
        self.total += xt.sum(axis=1)
        self.tokens += int(x.shape[1])

    def save(self, path: PathLike) -> Path:
        path = Path(path)
        np.savez(path, gram=self.gram, total=self.total, tokens=np.int64(self.tokens))
        return path

    @classmethod
    def load(cls, path: PathLike) -> "DomainStatistics":
        with np.load(path) as f:
            return cls(f["gram"], f["total"], int(f["tokens"]))


def normal_equations(stats: Sequence[DomainStatistics]) -> Tuple[np.ndarray, np.ndarray]:
    """(A [layers, d+1, d+1], B [layers, d+1, N]) of the domains ``stats`` in expert order:
    A the sum of their grams, column j of B domain j's token sum (DUME eq. 7)."""
    if not stats:
        raise ValueError("no domain statistics to solve: give at least one domain")
    for j, s in enumerate(stats):
        if s.tokens == 0:
            raise ValueError(f"domain {j} has no tokens in its statistics: give it data "
                             f"(a non-empty source, with non-padding tokens)")
    a = stats[0].gram.copy()           # summed in place: no [N, layers, d+1, d+1] stack
    for s in stats[1:]:
        a += s.gram
    b = np.stack([s.total for s in stats], axis=-1)
    return a, b


def ridge_solve(a: np.ndarray, b: np.ndarray, lam: float = DEFAULT_LAMBDA) -> np.ndarray:
    """W~ = (A + lambda I)^-1 B (DUME eq. 2 / 6) for A [..., n, n], B [..., n, N], float64."""
    if not lam > 0:
        raise ValueError(f"ridge lambda={lam} is invalid: expected a number > 0")
    a = np.array(a, np.float64)           # one copy, regularised in place
    diagonal = np.einsum("...ii->...i", a)
    diagonal += lam
    return np.linalg.solve(a, np.asarray(b, np.float64))


def split_and_normalise(w_tilde: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Router weight W [..., d, N] and bias b [..., N] from W~ [..., d+1, N]: the last row is
    the bias, and each expert's column and bias are divided by that column's norm ||W_j||
    (DUME sec. 2.3, against unbalanced domains; the norm is the weight column's, without the
    bias, as in the authors' code)."""
    w, bias = w_tilde[..., :-1, :], w_tilde[..., -1, :]
    norm = np.linalg.norm(w, axis=-2)
    norm = np.where(norm > 0, norm, 1.0)     # a zero column (no signal) stays zero
    return w / norm[..., None, :], bias / norm


def solve_routers(stats: Sequence[DomainStatistics],
                  lam: float = DEFAULT_LAMBDA) -> Tuple[np.ndarray, np.ndarray]:
    """Every layer's normalised DUME router (W [layers, d, N], b [layers, N]) from the
    per-domain statistics in expert order (DUME eqs. 6-7 and the column normalisation)."""
    a, b = normal_equations(stats)
    return split_and_normalise(ridge_solve(a, b, lam))
