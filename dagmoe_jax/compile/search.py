"""Mesh search: compile a run's training step under many meshes and batch sizes, rank them.

:func:`candidates` lists the factorisations of the chips into ``data x fsdp x expert x tensor``
that the model admits (``expert`` divides the routed experts, ``tensor`` the KV heads and the
expert hidden size, every batch axis divides the global batch), for each per-chip batch size
asked for, and on meshes with an expert axis each bounded exchange buffer asked for
(``ExpertConfig.exchange_buffer``); :func:`search` compiles them in a stated order (the run's
own mesh first, then by tensor, expert and FSDP parallelism ascending: data, FSDP and mixed
meshes before wide expert parallelism, the cheapest collectives first),
skips what does not fit, and stops at a time budget. Each compilation is reported as it ends,
and the results are ranked by estimated tokens/s among those that fit. :class:`OutcomeCache`
keeps every outcome on disk under a fingerprint of the run's configuration, the topology and the
compiler's version, so a search run again (with a larger budget, more batch sizes) compiles
only what it has not yet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from dagmoe_jax.compile.chips import mesh_label
from dagmoe_jax.config import ModelConfig, experts_of
from dagmoe_jax.parallel.axes import MESH_AXES


# No buffer setting of its own: the candidate runs the run's ExpertConfig.exchange_buffer.
OWN = "own"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A mesh (data, fsdp, expert, tensor sizes), a per-chip batch and, on a mesh with an
    expert axis, the ``ExpertConfig.exchange_buffer`` to try (``OWN``: the run's own)."""

    sizes: Tuple[int, int, int, int]      # data, fsdp, expert, tensor
    batch_per_chip: int
    exchange_buffer: object = OWN

    @property
    def mesh(self) -> Dict[str, int]:
        return dict(zip(MESH_AXES, self.sizes))

    def bindings(self) -> List[str]:
        """The gin bindings that run this candidate."""
        chips = math.prod(self.sizes)
        buffer = ([] if self.exchange_buffer == OWN
                  else [f"ExpertConfig.exchange_buffer = {self.exchange_buffer}"])
        return ([f"MeshConfig.{a} = {s}" for a, s in zip(MESH_AXES, self.sizes)]
                + [f"DataConfig.batch_size = {self.batch_per_chip * chips}"] + buffer)

    def label(self) -> str:
        if self.exchange_buffer == OWN:
            return mesh_label(self.mesh)
        bound = ("worst case" if self.exchange_buffer is None
                 else f"{self.exchange_buffer:g}x")
        return f"{mesh_label(self.mesh)}, buffer {bound}"

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this candidate's exchange buffer."""
        if self.exchange_buffer == OWN:
            return cfg
        return cfg.replace(block=dict(experts=dict(exchange_buffer=self.exchange_buffer)))


def factorisations(n: int, parts: int = 4) -> Iterator[Tuple[int, ...]]:
    """Every ordered ``parts``-tuple of positive integers whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorisations(n // d, parts - 1):
                yield (d,) + rest


def admits(cfg: ModelConfig, sizes: Sequence[int], global_batch: int) -> bool:
    """Whether the model can run on a mesh of these axis sizes with this global batch."""
    data, fsdp, expert, tensor = sizes
    experts = experts_of(cfg.block)
    if experts is not None and experts.num_experts % expert:
        return False
    if experts is None and expert > 1:
        return False
    if tensor > 1 and (cfg.num_kv_heads % tensor or cfg.num_heads % tensor
                       or (experts is not None and experts.expert_hidden % tensor)
                       or cfg.d_model % tensor):
        return False
    if fsdp > 1 and cfg.d_model % fsdp:
        return False
    return global_batch % (data * fsdp * expert) == 0


def candidates(cfg: ModelConfig, chips: int, batches_per_chip: Sequence[int],
               first: Optional[Tuple[Tuple[int, ...], int]] = None,
               num_slices: int = 1, buffers: Sequence[Optional[float]] = ()) -> List[Candidate]:
    """The meshes, per-chip batches and exchange buffers to try, in search order (module
    docstring). ``buffers``: ``ExpertConfig.exchange_buffer`` values (None: the worst case) a
    dropless model also tries on each mesh with an expert axis, before the run's own."""
    experts = experts_of(cfg.block)
    own = experts.exchange_buffer if experts is not None else None
    tried = [b for b in dict.fromkeys(buffers) if b != own]
    out = []
    for sizes in factorisations(chips):
        if sizes[0] % num_slices:
            continue
        for b in batches_per_chip:
            if admits(cfg, sizes, b * chips):
                out.append(Candidate(tuple(sizes), b))
                if sizes[2] > 1 and experts.dispatch == "dropless":
                    out.extend(Candidate(tuple(sizes), b, f) for f in tried)
    # cheapest collectives first: data, FSDP and mixed meshes before wide expert and tensor
    # parallelism (expert ascending), a bounded buffer before the worst case on a mesh
    out.sort(key=lambda c: (c.sizes[3], c.sizes[2], c.sizes[1], c.exchange_buffer == OWN,
                            c.batch_per_chip))
    if first is not None:
        head = Candidate(tuple(first[0]), first[1])
        out = [head] + [c for c in out if c != head]
    return out


@dataclasses.dataclass
class Outcome:
    candidate: Candidate
    seconds: Optional[float] = None        # estimated step time
    tokens_per_second: float = 0.0
    mfu: float = 0.0
    hbm_bytes: float = 0.0
    error: str = ""                        # 'out of memory: ...' or the compiler's word
    compute_seconds: float = 0.0           # the roofline's terms (compile/roofline.py)
    collective_seconds: float = 0.0
    floor_seconds: float = 0.0             # max(compute, collectives, host transfers)


class OutcomeCache:
    """Search outcomes on disk (a JSON file per fingerprint under ``directory``): the
    fingerprint is a hash of ``key``, the text of everything that decides a compiled program
    but the mesh and batch (the run's configs, the topology, the compiler's version)."""

    def __init__(self, directory, key: str):
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.path = Path(directory) / f"search-{digest}.json"
        try:
            self.entries = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            self.entries = {}          # unreadable: start afresh, overwritten on the next put

    @staticmethod
    def _key(candidate: Candidate) -> str:
        buffer = ("" if candidate.exchange_buffer == OWN
                  else f"/buffer={candidate.exchange_buffer}")
        return f"{'x'.join(map(str, candidate.sizes))}/{candidate.batch_per_chip}{buffer}"

    def get(self, candidate: Candidate) -> Optional[Outcome]:
        entry = self.entries.get(self._key(candidate))
        return None if entry is None else Outcome(candidate, **entry)

    def put(self, outcome: Outcome) -> None:
        fields = dataclasses.asdict(outcome)
        fields.pop("candidate")
        self.entries[self._key(outcome.candidate)] = fields
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.entries, indent=1))
        tmp.replace(self.path)         # atomic: a search stopped mid-write keeps the last file


def search(compile_one: Callable[[Candidate], Outcome], todo: Sequence[Candidate], *,
           budget_seconds: float, log: Callable[[str], None],
           cache: Optional[OutcomeCache] = None) -> List[Outcome]:
    """Compile ``todo`` in order until the budget is spent; outcomes in that order. Outcomes
    in ``cache`` are reused without compiling (and cost no budget); new ones are added."""
    start = time.perf_counter()
    outcomes = []
    for i, candidate in enumerate(todo):
        known = cache.get(candidate) if cache is not None else None
        if known is not None:
            outcomes.append(known)
            log(f"search [{i + 1}/{len(todo)}] {candidate.label()}, batch "
                f"{candidate.batch_per_chip}/chip: {_said(known)} (compiled before)")
            continue
        elapsed = time.perf_counter() - start
        if elapsed > budget_seconds:
            log(f"search: time budget of {budget_seconds:.0f} s spent after {i} of {len(todo)} "
                f"candidates (raise --search_budget to try the rest)")
            break
        tick = time.perf_counter()
        outcome = compile_one(candidate)
        outcomes.append(outcome)
        if cache is not None:
            cache.put(outcome)
        log(f"search [{i + 1}/{len(todo)}] {candidate.label()}, batch {candidate.batch_per_chip}"
            f"/chip: {_said(outcome)} ({time.perf_counter() - tick:.0f} s)")
    return outcomes


def _said(outcome: Outcome) -> str:
    return (f"{outcome.tokens_per_second:,.0f} tokens/s, MFU {outcome.mfu:.1%}, "
            f"{outcome.hbm_bytes / 1e9:.1f} GB/chip" if outcome.seconds else outcome.error)


def ranked(outcomes: Sequence[Outcome]) -> List[Outcome]:
    """Those that fit, fastest first (by their tokens/s: the calibrated prediction where the
    outcome has one), then the others."""
    fit = sorted((o for o in outcomes if o.seconds), key=lambda o: -o.tokens_per_second)
    return fit + [o for o in outcomes if not o.seconds]


def within_error(outcomes: Sequence[Outcome], low: float, high: float) -> List[Outcome]:
    """The ranked outcomes (best first) whose predicted tokens/s the best's cannot be told
    from: a prediction's truth lies in ``[1 + low, 1 + high]`` times it (the calibration's
    spread of measured / predicted step time), so B is within the error of the best A when
    ``tokens_A / tokens_B <= (1 + high) / (1 + low)``."""
    fit = [o for o in outcomes if o.seconds]
    if not fit:
        return []
    bound = (1 + high) / (1 + low)
    return [o for o in fit if fit[0].tokens_per_second / o.tokens_per_second <= bound]


MOSAIC_UNDER_TENSOR = ("skipped: a Mosaic kernel (splash attention, the megablox grouped "
                       "matmul) is not partitioned over a tensor axis; "
                       "ExecutionConfig.attention='xla' and grouped_matmul='ragged_dot' "
                       "run there")
"""What the search says of a mesh whose compile failed with JAX's "Mosaic kernels cannot be
automatically partitioned" (a Pallas TPU kernel outside ``shard_map`` under a sharded axis)."""


def compile_error_line(err: BaseException) -> str:
    """A failed candidate's one line: the compiler's first line, or what it means."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if "Mosaic kernels cannot be automatically partitioned" in text:
        return MOSAIC_UNDER_TENSOR
    return text[:200]
