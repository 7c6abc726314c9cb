"""Which records train and which evaluate, and which process reads which training record.

Held-out records are evenly spaced: of n records, m = max(1, round(heldout_fraction * n)) are
held out, the j-th being record ``(j * n) // m``. They depend only on n and the fraction (not on
any seed), and both views are index arithmetic, so nothing of size n is built.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import grain

from dagmoe_jax.data.config import (DataConfig, check_process, mix_components,
                                    parse_source)
from dagmoe_jax.data.instruct_records import open_instruct
from dagmoe_jax.data.sources import HELDOUT_STREAM, TRAIN_STREAM
from dagmoe_jax.data.sources import open_source as _open_text


def open_source(cfg: DataConfig, field: str, **kwargs):
    """The records of ``cfg.<field>``: conversations of an ``instruct:`` spec
    (:mod:`~dagmoe_jax.data.instruct_records`), else texts
    (:func:`dagmoe_jax.data.sources.open_source`)."""
    kind, args = parse_source(getattr(cfg, field), field)
    if kind == "instruct":
        return open_instruct(args, cfg.instruct_format, field, getattr(cfg, field))
    return _open_text(cfg, field, **kwargs)


def mixture(cfg: DataConfig):
    """[(weight, DataConfig of the component)] of a ``mix:`` source
    (:func:`~dagmoe_jax.data.config.mix_components`), else None."""
    kind, _, rest = cfg.source.partition(":")
    if kind != "mix":
        return None
    return [(w, cfg.replace(source=spec)) for w, spec in mix_components(rest)]


def describe_mixture(cfg: DataConfig, sizes: Optional[Sequence[int]] = None
                     ) -> Optional[str]:
    """One line on what a ``mix:`` source draws (None for any other source): each component's
    weight (the one written too, where the weights did not sum to 1 and were normalised), its
    spec and its number of training records (``sizes``, where the caller opened the
    components already; else each is opened here), e.g.
    ``mixture of 2 sources: 0.5 of parquet:a/*.parquet (1,024 records), 0.5 of jsonl:b.jsonl
    (88 records); weights 0.3, 0.3 normalised to sum to 1``."""
    components = mixture(cfg)
    if components is None:
        return None
    if sizes is None:
        sizes = [len(train_source(sub)) for _, sub in components]
    given = mix_components(cfg.source.partition(":")[2], normalise=False)
    parts = [f"{w:.3g} of {sub.source} ({size:,} records)"
             for (w, sub), size in zip(components, sizes)]
    line = f"mixture of {len(parts)} sources: {', '.join(parts)}"
    total = sum(w for w, _ in given)
    if not math.isclose(total, 1.0, rel_tol=1e-6):
        line += (f"; weights {', '.join(f'{w:g}' for w, _ in given)} (sum {total:g}) "
                 "normalised to sum to 1")
    return line


def _mixed(components, parts) -> grain.MapDataset:
    """``parts`` (one record source per component of :func:`mixture`) drawn by weight."""
    return grain.MapDataset.mix([p if isinstance(p, grain.MapDataset) else
                                 grain.MapDataset.source(p) for p in parts],
                                [w for w, _ in components])


def mixed_train_records(cfg: DataConfig, *, process_index: int = 0, process_count: int = 1,
                        log: Optional[Callable[[str], None]] = None) -> grain.MapDataset:
    """The endless training records of a ``mix:`` source for this process: each component's
    records (:func:`train_records`), shuffled with its own seed (``cfg.seed`` + its position)
    unless ``cfg.shuffle`` is False, repeated forever, and drawn in proportion to the weights
    by ``grain.MapDataset.mix``: deterministic, index-based, so a saved iterator state
    resumes exactly, and a small component repeats rather than cutting the large one short.
    ``log`` hears :func:`describe_mixture` of the components as opened here."""
    components, parts, sizes = mixture(cfg), [], []
    for c, (_, sub) in enumerate(components):
        source = train_source(sub)
        sizes.append(len(source))
        records = _process_records(source, sub, process_index, process_count)
        if cfg.shuffle:
            records = records.shuffle(seed=(cfg.seed + c) % 2**32)
        parts.append(records.repeat())
    if log is not None:
        log(describe_mixture(cfg, sizes))
    return _mixed(components, parts)


def heldout_count(num_records: int, fraction: float) -> int:
    """Records held out of ``num_records``: ``max(1, round(fraction * num_records))``."""
    return max(1, int(round(fraction * num_records)))


class HeldOutView:
    """The held-out records of ``source``: record j is ``source[(j * n) // m]``."""

    def __init__(self, source, num_heldout: int):
        self.source, self.n, self.m = source, len(source), int(num_heldout)

    def __len__(self) -> int:
        return self.m

    def index(self, j: int) -> int:
        """The ``source`` index of held-out record ``j``."""
        return (int(j) % self.m) * self.n // self.m

    def __getitem__(self, j: int):
        return self.source[self.index(j)]


class TrainView(HeldOutView):
    """The records of ``source`` that :class:`HeldOutView` does not hold out, in order."""

    def __len__(self) -> int:
        return self.n - self.m

    def _held_below(self, x: int) -> int:
        # #{j < m : (j * n) // m < x} = #{j : j < x m / n}
        return min(self.m, (x * self.m + self.n - 1) // self.n)

    def index(self, p: int) -> int:
        """The ``source`` index of training record ``p``: the smallest i with p + 1 training
        records in [0, i]."""
        p = int(p) % len(self)
        lo, hi = p, p + self.m
        while lo < hi:
            mid = (lo + hi) // 2
            if mid + 1 - self._held_below(mid + 1) >= p + 1:
                hi = mid
            else:
                lo = mid + 1
        return lo


def _holds_out(cfg: DataConfig) -> bool:
    """Whether evaluation uses held-out records of ``source`` (rather than other data)."""
    return (not cfg.eval_source and not cfg.eval_split and cfg.heldout_fraction > 0
            and parse_source(cfg.source)[0] not in ("synthetic", "mix"))


def has_eval_data(cfg: DataConfig) -> bool:
    """Whether ``cfg`` has evaluation data: an ``eval_source`` or ``eval_split``, a synthetic
    source's held-out stream, or held-out records (``heldout_fraction`` > 0)."""
    return bool(cfg.eval_source or cfg.eval_split or cfg.heldout_fraction > 0
                or parse_source(cfg.source)[0] == "synthetic")


def _split_views(cfg: DataConfig):
    source = open_source(cfg, "source", stream=TRAIN_STREAM)
    n, m = len(source), heldout_count(len(source), cfg.heldout_fraction)
    if m >= n:
        raise ValueError(f"DataConfig.source={cfg.source!r} has only {n} record(s), too few to "
                         f"hold out DataConfig.heldout_fraction={cfg.heldout_fraction} and "
                         "train on the rest: add data or set DataConfig.eval_source")
    return TrainView(source, m), HeldOutView(source, m)


def train_source(cfg: DataConfig):
    """All training records (every process's): ``source`` minus the held-out records when
    evaluation holds records out, else all of ``source`` (split ``cfg.split`` for TFDS)."""
    components = mixture(cfg)
    if components:          # each component's own, once, in proportion (a finite mixture)
        return _mixed(components, [train_source(sub) for _, sub in components])
    if _holds_out(cfg):
        return _split_views(cfg)[0]
    return open_source(cfg, "source", stream=TRAIN_STREAM)


def eval_source(cfg: DataConfig):
    """The evaluation records: ``eval_source`` if set (TFDS split ``eval_split or split``),
    else split ``eval_split`` of a TFDS ``source``, else the synthetic held-out stream, else
    the held-out records of ``source`` (a one-line error when ``heldout_fraction`` is 0:
    :func:`has_eval_data` says so beforehand)."""
    if not has_eval_data(cfg):
        raise ValueError(f"DataConfig.source={cfg.source!r} has no evaluation data: "
                         "heldout_fraction is 0 and no eval_source is set; set one of them")
    if cfg.eval_source:
        return open_source(cfg, "eval_source", split=cfg.eval_split or cfg.split,
                           stream=HELDOUT_STREAM)
    if cfg.eval_split:
        return open_source(cfg, "source", split=cfg.eval_split)
    components = mixture(cfg)
    if components:          # each component's held-out records, in proportion
        return _mixed(components, [eval_source(sub) for _, sub in components])
    if parse_source(cfg.source)[0] == "synthetic":
        return open_source(cfg, "source", stream=HELDOUT_STREAM)
    return _split_views(cfg)[1]


def train_records(cfg: DataConfig, *, process_index: int = 0,
                  process_count: int = 1) -> grain.MapDataset:
    """This process's training records (text) as a ``grain.MapDataset``, unshuffled.

    Process k of P reads records k, k + P, k + 2P, ... of :func:`train_source`: the processes'
    records are disjoint and together cover all training records.
    """
    return _process_records(train_source(cfg), cfg, process_index, process_count)


def _process_records(source, cfg: DataConfig, process_index: int,
                     process_count: int) -> grain.MapDataset:
    """Process k of P's records of the training records ``source``: k, k + P, k + 2P, ..."""
    check_process(process_index, process_count)
    ds = grain.MapDataset.source(source)[process_index::process_count]
    if len(ds) == 0:
        raise ValueError(f"DataConfig.source={cfg.source!r} has fewer training records than the "
                         f"{process_count} processes: add data")
    return ds
