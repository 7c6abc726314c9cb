"""What one named part of the model costs in a compiled program: the roofline of
:mod:`dagmoe_jax.compile.roofline` restricted to the instructions a ``jax.named_scope`` made.

The DAG module runs under ``jax.named_scope("dag_module")``
(:class:`~dagmoe_jax.model.dag.DAGAggregator`), so every instruction it lowers to carries
``dag_module`` in its ``op_name`` metadata; a fusion is the scope's when it or an instruction
fused into it carries the name (XLA fuses a module's first and last elementwise work with its
neighbours', which are then counted with it: an upper bound). :func:`scope_cost` sums those
instructions' roofline times, FLOPs and HBM bytes, and counts their launches (each run of an
instruction, a loop's body counted once per trip): the measure of "the DAG module at its
FLOPs" (how far its time is above ``flops / peak``) and of its small kernels.
"""

from __future__ import annotations

import dataclasses

from dagmoe_jax.compile.chips import Chip
from dagmoe_jax.compile.roofline import FUSIONS, Cost, _Walker
from dagmoe_jax.compile.hlo import parse_module

DAG_MODULE = "dag_module"
"""The named scope of the DAG module's instructions."""


@dataclasses.dataclass
class ScopeCost:
    """The roofline of a scope's instructions on one chip (seconds, FLOPs, bytes, launches)."""

    seconds: float = 0.0
    matmul_flops: float = 0.0
    hbm_bytes: float = 0.0
    launches: int = 0

    def at_peak(self, chip: Chip) -> float:
        """The time its matrix products would take at the chip's peak: its floor."""
        return self.matmul_flops / chip.peak_flops


class _ScopeWalker(_Walker):
    """The roofline's walk, adding each instruction of ``scope`` to a :class:`ScopeCost`."""

    def __init__(self, computations, chip: Chip, scope: str):
        super().__init__(computations, chip, 1, None)
        self.scope, self.part = f"/{scope}/", ScopeCost()

    def _in_scope(self, ins) -> bool:
        if self.scope in ins.attrs:
            return True
        fused = (self.computations.get(self.called(ins, "calls"), []) if ins.op in FUSIONS
                 else [])
        return any(self.scope in inner.attrs for inner in fused)

    def _compute(self, ins, shapes, times: float, cost: Cost) -> None:
        before = (cost.compute_seconds, cost.matmul_flops, cost.hbm_bytes)
        super()._compute(ins, shapes, times, cost)
        if self._in_scope(ins):
            self.part.seconds += cost.compute_seconds - before[0]
            self.part.matmul_flops += cost.matmul_flops - before[1]
            self.part.hbm_bytes += cost.hbm_bytes - before[2]
            self.part.launches += int(times)


def scope_cost(hlo_text: str, chip: Chip, scope: str = DAG_MODULE) -> ScopeCost:
    """The :class:`ScopeCost` of the instructions of ``scope`` in one chip's compiled program
    (the text of ``compiled.as_text()``); zero when none carries the name."""
    computations, entry = parse_module(hlo_text)
    walker = _ScopeWalker(computations, chip, scope)
    walker.walk(entry, 1, Cost())
    return walker.part
