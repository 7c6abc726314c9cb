"""What one named part of the model costs in a compiled program: the roofline of
:mod:`dagmoe_jax.compile.roofline` restricted to the instructions a ``jax.named_scope`` made.

The DAG module runs under ``jax.named_scope("dag_module")``
(:class:`~dagmoe_jax.families.moe.dag.DAGAggregator`), so every instruction it lowers to carries
``dag_module`` in its ``op_name`` metadata (as a path component: ``.../dag_module/...``, or
``jvp(dag_module)`` / ``transpose(jvp(dag_module))`` when the scope is the outermost one a
derivative was taken through); a fusion is the scope's when it or an instruction fused into
it carries the name (XLA fuses a module's first and last elementwise work with its
neighbours', which are then counted with it: an upper bound). :func:`scope_cost` sums those
instructions' roofline times, FLOPs and HBM bytes and their collectives' times, and counts
their launches (each run of an instruction, a loop's body counted once per trip): the
measure of "the DAG module at its FLOPs" (how far its time is above ``flops / peak``) and of
its small kernels.

One device's dispatch runs under ``moe_dispatch`` and the experts' SwiGLU, inside it, under
``expert_ffn`` (:mod:`dagmoe_jax.model.routed.dispatch`): the dispatch's cost (:func:`dispatch_cost`)
is the first scope less the second and less the matrix products, the sorts, gathers,
exchanges and combines that move tokens to their experts and back.
"""

from __future__ import annotations

import dataclasses

import re
from typing import Optional

from dagmoe_jax.compile.chips import Chip
from dagmoe_jax.compile.roofline import FUSIONS, Cost, _Walker
from dagmoe_jax.compile.hlo import parse_module
from dagmoe_jax.model.routed.dispatch import DISPATCH_SCOPE, EXPERT_FFN_SCOPE

DAG_MODULE = "dag_module"
"""The named scope of the DAG module's instructions."""



def _component(scope: str) -> "re.Pattern":
    """``scope`` as a component of an ``op_name`` path, plain or wrapped by ``jvp(...)`` /
    ``transpose(...)``."""
    return re.compile(rf"[/(]{re.escape(scope)}\)*/")


def has_scope(hlo_text: str, scope: str) -> bool:
    """Whether an instruction of the program carries ``scope``."""
    return bool(_component(scope).search(hlo_text))


@dataclasses.dataclass
class ScopeCost:
    """The roofline of a scope's instructions on one chip: ``seconds`` their compute time
    (collectives apart, in ``collective_seconds``), their matmul FLOPs, HBM bytes and
    launches."""

    seconds: float = 0.0
    matmul_flops: float = 0.0
    hbm_bytes: float = 0.0
    launches: int = 0
    collective_seconds: float = 0.0

    def at_peak(self, chip: Chip) -> float:
        """The time its matrix products would take at the chip's peak: its floor."""
        return self.matmul_flops / chip.peak_flops


class _ScopeWalker(_Walker):
    """The roofline's walk, adding each instruction of ``scope`` (and not of ``exclude``, nor a
    matrix product unless ``products``) to a :class:`ScopeCost`."""

    def __init__(self, computations, chip: Chip, scope: str, exclude: Optional[str],
                 products: bool, devices: int):
        super().__init__(computations, chip, devices, None)
        self.scope, self.part = _component(scope), ScopeCost()
        self.exclude = _component(exclude) if exclude else None
        self.products = products

    def _excluded(self, attrs: str) -> bool:
        return bool(self.exclude and self.exclude.search(attrs))

    def _owns(self, attrs: str) -> bool:
        return bool(self.scope.search(attrs)) and not self._excluded(attrs)

    def _in_scope(self, ins) -> bool:
        if ins.op not in FUSIONS or self._excluded(ins.attrs):
            return self._owns(ins.attrs)
        fused = self.computations.get(self.called(ins, "calls"), [])
        return self._owns(ins.attrs) or any(self._owns(inner.attrs) for inner in fused)

    def _compute(self, ins, shapes, times: float, cost: Cost) -> None:
        before = (cost.compute_seconds, cost.matmul_flops, cost.hbm_bytes)
        super()._compute(ins, shapes, times, cost)
        flops = cost.matmul_flops - before[1]
        if self._in_scope(ins) and (self.products or not flops):
            self.part.seconds += cost.compute_seconds - before[0]
            self.part.matmul_flops += flops
            self.part.hbm_bytes += cost.hbm_bytes - before[2]
            self.part.launches += int(times)

    def _collective(self, kind: str, ins, shapes, times: float, cost: Cost) -> None:
        before = cost.collective_seconds
        super()._collective(kind, ins, shapes, times, cost)
        if self._owns(ins.attrs):
            self.part.collective_seconds += cost.collective_seconds - before
            self.part.launches += int(times)


def scope_cost(hlo_text: str, chip: Chip, scope: str = DAG_MODULE,
               exclude: Optional[str] = None, products: bool = True,
               devices: int = 1) -> ScopeCost:
    """The :class:`ScopeCost` of the instructions of ``scope`` in one chip's compiled program
    (the text of ``compiled.as_text()``), less those of ``exclude`` (a scope nested in it: a
    fusion is its when the fusion itself carries that name) and, unless ``products``, less
    every instruction with matrix products; ``devices``: the program's, for collectives
    without replica groups. Zero when no instruction carries the name."""
    computations, entry = parse_module(hlo_text)
    walker = _ScopeWalker(computations, chip, scope, exclude, products, devices)
    walker.walk(entry, 1, Cost())
    return walker.part


def dispatch_cost(hlo_text: str, chip: Chip, devices: int = 1) -> ScopeCost:
    """What moving tokens to their experts and back costs (the module docstring): the
    instructions of the routed experts' scope less their SwiGLU's, and less every matrix
    product (the grouped matmul kernels, whose custom VJPs trace them without the scope's
    name)."""
    return scope_cost(hlo_text, chip, DISPATCH_SCOPE, EXPERT_FFN_SCOPE, products=False,
                      devices=devices)
