"""What a compiled program costs per chip: its collectives and a roofline step-time estimate.

The input is the text of the optimised HLO module the TPU compiler produced
(``compiled.as_text()``, read by :mod:`dagmoe_jax.compile.hlo`), which is one chip's program
(SPMD). The model, stated so it can be checked by hand:

* **Instructions.** The entry computation is walked; a ``while`` loop's body and condition are
  walked as many times as the loop runs (its ``known_trip_count``, else read from its
  condition ``i < N``: the scanned layers, the micro-batches), a ``call`` once
  and a ``conditional`` as its most expensive branch. Bookkeeping instructions move no data:
  parameter, constant, tuple, get-tuple-element, bitcast, the ``-done`` halves of asynchronous
  operations, partition / replica ids, and the ``AllocateBuffer`` custom call
  (``lax.empty``: a buffer claimed, nothing written).
* **Compute.** Each other instruction (a fusion, a copy, a Mosaic kernel, a lone dot) is a
  roofline of its own: ``max(flops / peak, bytes / HBM bandwidth)``, where ``bytes`` is its
  operands' and results' sizes (a fusion reads its inputs and writes its outputs to HBM once;
  a buffer it reads only through ``dynamic-slice`` counts its slices, one it updates in place
  by ``dynamic-update-slice`` the update: a scanned layer's weights and stacked outputs; an
  asynchronous ``call-start``, a gather or scatter offloaded to the SparseCore, reads and
  writes its result, and its ``-update`` and ``-done`` halves are free)
  and ``flops`` the matrix products inside it: ``2 x output elements x contracted size`` for
  each ``dot``, and for a ``convolution`` only the kernel taps that land on the input
  (XLA:TPU writes batched matmuls as convolutions over the batch, padded so each output
  position meets one tap); fused computations' products count too. A Mosaic kernel
  (``tpu_custom_call``) counts the ``flops`` of its cost estimate when it carries one
  (megablox ``gmm``; a grouped matmul without one, ``2 M K N`` from its shapes), times the
  expected share of its rows that hold tokens (``gmm_occupancy``; see below); splash attention
  carries none, and its FLOPs are read from its shapes:
  ``4 B H S^2 D`` forward, ``6`` for ``dq`` and ``8`` for ``dkv``, times the share of the
  causal mask's key blocks it visits. Elementwise and reduction work counts as bytes only.
* **GPU kernels.** A Pallas kernel on GPU (a ``mosaic_gpu_v2`` or ``__gpu$xla.gpu.triton``
  custom call) is named by its library and shapes ('mgpu gmm', 'triton tgmm'); a grouped
  matmul counts ``2 M K N`` FLOPs from its shapes times ``gmm_occupancy``. XLA:GPU's own GEMMs
  are fusions whose ``dot`` counts as any fused product.
* **Grouped matmuls.** Megablox ``gmm`` and ``tgmm`` run a dynamic grid over the row tiles
  their group sizes cover, but their static cost estimate counts every row of the buffer they
  are handed. Under expert parallelism that buffer is sized for the worst case (every token of
  the ``E`` expert shards routed here: ``E x T_loc x k`` rows) while a balanced router fills
  ``T_loc x k`` of them, so the caller passes ``gmm_occupancy = 1 / E`` and the kernels'
  FLOPs are scaled by it (their bytes are not: an upper bound).
* **Collectives.** A collective over a group of ``n`` chips moves, per chip, ``(n - 1) / n``
  of its buffer (all-gather: the result, reduce-scatter: the operand, all-to-all and the
  ragged all-to-all: the operand, all-reduce: twice the operand, as a reduce-scatter then an
  all-gather); a collective-permute moves its operand. It runs as a bidirectional ring along
  one torus dimension (:attr:`~dagmoe_jax.compile.chips.Chip.ring_bandwidth`), or at the DCN
  bandwidth when its group spans slices. XLA:TPU writes a reduce-scatter as a fusion of an
  all-reduce and a slice (``calls=%all-reduce-scatter...``): it is costed as the
  reduce-scatter it is.
* **Host transfers.** An instruction that reads or writes host memory (memory space ``S(5)``
  in its shape: the asynchronous ``dynamic-slice-start`` / ``dynamic-update-slice-start`` /
  ``copy-start`` of activations offloaded by a remat policy) moves its slice, its update or its
  buffer at the host link's bandwidth (:attr:`~dagmoe_jax.compile.chips.Chip.host_bandwidth`),
  off the cores: ``offload`` seconds, not compute.
* **The estimate** is the sum of the instructions' times plus the collectives' (no overlap:
  a program whose collectives and host transfers XLA overlaps with compute runs below it);
  the floor ``max(compute + exchanges, other collectives, offload)`` beside it overlaps
  everything but the all-to-all exchanges, which the experts wait for. Neither is a
  measured step time: :mod:`dagmoe_jax.compile.calibration` scales the floor by what
  published runs measured.

The compiler's own ``cost_analysis()`` totals (flops, bytes accessed) are reported next to
this walk's; its ``optimal_seconds`` is not used (it came out negative for whole training
steps).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

from dagmoe_jax.compile.chips import Chip
from dagmoe_jax.compile.hlo import (ARRAY, Instruction, attr, backend_config, constant_value,
                                    group_size, parse_module, shape_bytes)
from dagmoe_jax.compile.kernel_costs import (GPU_KERNEL_CALLS, KNOWN_TPU_KERNELS,
                                             dag_kernel_flops, grouped_matmul_flops,
                                             gpu_kernel_family,
                                             kernel_family, megablox_family, mosaic_flops)
from dagmoe_jax.compile.matmul_flops import dot_flops

FUSIONS = ("fusion", "fusion-start")
"""A fused computation run in place or asynchronously (its ``-done`` is free)."""
EXCHANGES = ("all-to-all", "ragged-all-to-all")
"""Collectives whose results the next instructions need at once (dispatch's token exchange):
the floor does not overlap them with compute."""
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute",
               "ragged-all-to-all")

_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "partition-id",
         "replica-id", "after-all", "add-dependency", "opt-barrier", "iota", "call-update",
         "async-update"}
HOST_MEMORY = "S(5)"
"""The host's memory space in a TPU layout (``bf16[...]{...:S(5)}``)."""
_FREE_CALLS = {"AllocateBuffer"}
"""Custom-call targets that move no data (``lax.empty``'s uninitialised buffer)."""


@dataclasses.dataclass
class Cost:
    """What one chip does in one run of the program (module docstring)."""

    compute_seconds: float = 0.0
    collective_seconds: float = 0.0
    matmul_bound_seconds: float = 0.0     # the compute of instructions bound by their FLOPs
    offload_seconds: float = 0.0          # host transfers (asynchronous, off the cores)
    offload_bytes: float = 0.0
    matmul_flops: float = 0.0
    hbm_bytes: float = 0.0
    collectives: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)
    kernels: Dict[str, int] = dataclasses.field(default_factory=dict)
    slowest: List[Tuple[float, str]] = dataclasses.field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.collective_seconds

    @property
    def exchange_seconds(self) -> float:
        """The all-to-all exchanges' time (expert-parallel dispatch: the experts wait for it)."""
        return sum(self.collectives.get(k, {}).get("seconds", 0.0) for k in EXCHANGES)

    @property
    def overlapped_seconds(self) -> float:
        """The floor: compute with the exchanges it waits for, the other collectives and the
        host transfers, overlapped with each other."""
        return max(self.compute_seconds + self.exchange_seconds,
                   self.collective_seconds - self.exchange_seconds, self.offload_seconds)

    @property
    def memory_bound_seconds(self) -> float:
        """The compute of instructions bound by the bytes they move."""
        return self.compute_seconds - self.matmul_bound_seconds

    def add(self, other: "Cost") -> None:
        """Add ``other``'s figures to these (a conditional's chosen branch)."""
        self.compute_seconds += other.compute_seconds
        self.collective_seconds += other.collective_seconds
        self.matmul_bound_seconds += other.matmul_bound_seconds
        self.offload_seconds += other.offload_seconds
        self.offload_bytes += other.offload_bytes
        self.matmul_flops += other.matmul_flops
        self.hbm_bytes += other.hbm_bytes
        self.slowest.extend(other.slowest)
        for kind, entry in other.collectives.items():
            mine = self.collectives.setdefault(kind, {"count": 0, "bytes": 0.0, "seconds": 0.0})
            for key in mine:
                mine[key] += entry[key]
        for kernel, count in other.kernels.items():
            self.kernels[kernel] = self.kernels.get(kernel, 0) + count


class _Walker:
    """Walks a parsed module's computations into a :class:`Cost` (module docstring)."""

    def __init__(self, computations: Dict[str, List[Instruction]], chip: Chip, devices: int,
                 slice_of: Optional[Sequence[int]], gmm_occupancy: float = 1.0):
        self.computations, self.chip, self.devices = computations, chip, devices
        self.slice_of, self.gmm_occupancy = slice_of, gmm_occupancy
        self.index = {c: {i.name: i for i in instrs} for c, instrs in computations.items()}
        self.shapes = {c: {n: i.shape for n, i in names.items()}
                       for c, names in self.index.items()}
        self._fused_flops: Dict[str, float] = {}
        self._fusion_io: Dict[str, Tuple[Dict[int, float], Optional[float]]] = {}

    def called(self, ins: Instruction, key: str) -> str:
        return (attr(ins.attrs, key) or "").lstrip("%")

    def fused_flops(self, computation: str) -> float:
        """Matmul FLOPs inside a fused computation (nested fusions too), once each."""
        if computation not in self._fused_flops:
            shapes = self.shapes.get(computation, {})
            self._fused_flops[computation] = sum(
                dot_flops(ins, shapes) if ins.op in ("dot", "convolution")
                else self.fused_flops(self.called(ins, "calls")) if ins.op == "fusion" else 0.0
                for ins in self.computations.get(computation, []))
        return self._fused_flops[computation]

    def trip_count(self, ins: Instruction, computation: str) -> int:
        """A ``while`` loop's trip count: its ``known_trip_count``, else read from its
        condition ``i < N`` (``i`` the tuple's element that the condition's root compares,
        started from the init tuple's constant, 0 when it is not one); 1 if neither."""
        known = backend_config(ins.attrs).get("known_trip_count", {}).get("n")
        if known is not None:
            return int(known)
        condition = self.called(ins, "condition")
        names = self.index.get(condition, {})
        root = next((i for i in reversed(self.computations.get(condition, []))
                     if i.op == "compare"), None)
        if root is None or "direction=LT" not in root.attrs or len(root.operands) != 2:
            return 1
        counter, limit = (names.get(o) for o in root.operands)
        if limit is None or limit.op != "constant" or counter is None:
            return 1
        bound = constant_value(limit) or 1
        outer = self.index.get(computation, {})
        init = outer.get(ins.operands[0]) if ins.operands else None
        index = attr(counter.attrs, "index") if counter.op == "get-tuple-element" else None
        start = 0.0
        if index is not None and init is not None and init.op == "tuple" \
                and int(index) < len(init.operands):
            element = outer.get(init.operands[int(index)])
            if element is not None and element.op == "constant":
                start = constant_value(element) or 0.0
        return max(int(bound - start), 1)

    def walk(self, computation: str, times: float, cost: Cost) -> Cost:
        """Add ``times`` runs of ``computation`` to ``cost``; returns it."""
        shapes = self.shapes.get(computation, {})
        for ins in self.computations.get(computation, []):
            op = ins.op
            if op in _FREE or op.endswith("-done") or (op == "custom-call" and (
                    attr(ins.attrs, "custom_call_target") or "").strip('"') in _FREE_CALLS):
                continue
            if op == "while":
                trips = self.trip_count(ins, computation)
                for key in ("body", "condition"):
                    self.walk(self.called(ins, key), times * trips, cost)
            elif op == "call":
                self.walk(self.called(ins, "to_apply"), times, cost)
            elif op == "conditional":
                branches = attr(ins.attrs, "branch_computations")
                names = ([b.strip().lstrip("%") for b in branches.strip("{}").split(",")]
                         if branches else [self.called(ins, "true_computation"),
                                           self.called(ins, "false_computation")])
                costs = [self.walk(name, times, Cost()) for name in names if name]
                if costs:
                    cost.add(max(costs, key=lambda c: c.seconds))
            elif op.removesuffix("-start") in COLLECTIVES:
                self._collective(op.removesuffix("-start"), ins, shapes, times, cost)
            elif (scatter := self._fused_reduce_scatter(ins)) is not None:
                self._collective("reduce-scatter", scatter, shapes, times, cost)
            else:
                self._compute(ins, shapes, times, cost)
        return cost

    def _fused_reduce_scatter(self, ins: Instruction) -> Optional[Instruction]:
        """XLA:TPU writes a reduce-scatter as a fusion of an all-reduce and the slice of this
        chip's share (``kind=kCustom, calls=%all-reduce-scatter...``): that fusion, with the
        all-reduce's replica groups, to be costed as the reduce-scatter of its operands;
        None for any other instruction."""
        if ins.op not in FUSIONS:
            return None
        called = self.called(ins, "calls")
        if not called.startswith("all-reduce-scatter"):
            return None
        inner = next((i for i in self.computations.get(called, [])
                      if i.op.removesuffix("-start") == "all-reduce"), None)
        return None if inner is None else dataclasses.replace(
            ins, attrs=f"{inner.attrs}, {ins.attrs}")

    def moved_bytes(self, ins: Instruction, shapes) -> float:
        """HBM bytes an instruction reads and writes: its operands and results, except that a
        buffer read only through ``dynamic-slice`` reads its slices (a scanned layer's weights)
        and a buffer updated in place by ``dynamic-update-slice`` moves only the update (a
        scan's stacked outputs), alone or inside a fusion."""
        if ins.op == "dynamic-slice":
            return 2.0 * shape_bytes(ins.shape)
        if ins.op == "call-start":
            # an asynchronous call (a gather or scatter offloaded to the SparseCore): shape
            # ((operands...), result, context); it reads and writes what it returns
            arrays = ARRAY.findall(ins.shape)
            if len(arrays) > len(ins.operands):
                dtype, dims = arrays[len(ins.operands)]
                return 2.0 * shape_bytes(f"{dtype}[{dims}]")
        if ins.op == "dynamic-update-slice" and len(ins.operands) > 1:
            return 2.0 * shape_bytes(shapes.get(ins.operands[1], ""))
        operands = [shape_bytes(shapes.get(o, "")) for o in ins.operands]
        result = shape_bytes(ins.shape)
        if ins.op == "fusion-start":
            # an asynchronous fusion (jax 0.11's XLA:GPU): shape ((operands...), result,
            # context), the operands aliased and the context a scalar
            arrays = ARRAY.findall(ins.shape)[len(ins.operands):-1]
            result = sum(shape_bytes(f"{dtype}[{dims}]") for dtype, dims in arrays)
        if ins.op not in FUSIONS:
            return sum(operands) + result
        reads, writes = self.fusion_io(self.called(ins, "calls"))
        for n, nbytes in reads.items():
            if n < len(operands):
                operands[n] = nbytes
        return sum(operands) + (result if writes is None else writes)

    def fusion_io(self, computation: str) -> Tuple[Dict[int, float], Optional[float]]:
        """What a fused computation really moves, once per computation: (the bytes read from
        each parameter only sliced or only updated in place, by parameter number; the bytes
        written when its root updates a buffer in place, else None)."""
        if computation in self._fusion_io:
            return self._fusion_io[computation]
        body = self.computations.get(computation, [])
        names, inner = self.index.get(computation, {}), self.shapes.get(computation, {})
        users: Dict[str, List[Instruction]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        reads: Dict[int, float] = {}
        for i in body:
            uses = users.get(i.name, [])
            if i.op != "parameter" or not i.inner.strip().isdigit() or not uses:
                continue
            if all(u.op == "dynamic-slice" and u.operands[0] == i.name for u in uses):
                reads[int(i.inner)] = sum(shape_bytes(u.shape) for u in uses)
            elif all(u.op == "dynamic-update-slice" and u.operands[0] == i.name for u in uses):
                reads[int(i.inner)] = 0.0
        writes = None
        if body:
            root = body[-1]
            parts = ([names[o] for o in root.operands if o in names] if root.op == "tuple"
                     else [root])
            if any(p.op == "dynamic-update-slice" for p in parts):
                writes = sum(shape_bytes(inner.get(p.operands[1], ""))
                             if p.op == "dynamic-update-slice" and len(p.operands) > 1
                             else shape_bytes(p.shape) for p in parts)
        self._fusion_io[computation] = (reads, writes)
        return reads, writes

    def _compute(self, ins: Instruction, shapes, times: float, cost: Cost) -> None:
        if HOST_MEMORY in ins.shape:
            self._host_transfer(ins, shapes, times, cost)
            return
        nbytes = self.moved_bytes(ins, shapes)
        flops = 0.0
        if ins.op in FUSIONS:
            flops = self.fused_flops(self.called(ins, "calls"))
        elif ins.op in ("dot", "convolution"):
            flops = dot_flops(ins, shapes)
        elif ins.op == "custom-call":
            flops = self._kernel_flops(ins, shapes, times, cost)
        seconds = max(flops / self.chip.peak_flops, nbytes / self.chip.hbm_bandwidth)
        cost.compute_seconds += seconds * times
        if flops / self.chip.peak_flops >= nbytes / self.chip.hbm_bandwidth:
            cost.matmul_bound_seconds += seconds * times
        cost.matmul_flops += flops * times
        cost.hbm_bytes += nbytes * times
        cost.slowest.append((seconds * times, f"{ins.op} {ins.name} x{int(times)}"))

    def _host_transfer(self, ins: Instruction, shapes, times: float, cost: Cost) -> None:
        """An instruction touching host memory (module docstring): the slice a
        ``dynamic-slice-start`` brings back, the update a ``dynamic-update-slice-start``
        sends, else its operands' bytes (a ``copy-start`` to or from the host)."""
        arrays = ARRAY.findall(ins.shape)
        if ins.op == "dynamic-slice-start" and len(arrays) > len(ins.operands):
            dtype, dims = arrays[len(ins.operands)]
            nbytes = shape_bytes(f"{dtype}[{dims}]")
        elif ins.op in ("dynamic-update-slice-start", "dynamic-update-slice") \
                and len(ins.operands) > 1:
            nbytes = shape_bytes(shapes.get(ins.operands[1], ""))
        else:
            nbytes = sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
        seconds = nbytes / self.chip.host_bandwidth
        cost.offload_seconds += seconds * times
        cost.offload_bytes += nbytes * times
        cost.slowest.append((seconds * times, f"host {ins.op} {ins.name} x{int(times)}"))

    def _kernel_flops(self, ins: Instruction, shapes, times: float, cost: Cost) -> float:
        """A custom call's matmul FLOPs, counting it in ``cost.kernels`` when it is a Pallas
        kernel (TPU Mosaic or GPU); 0 for any other custom call."""
        target = (attr(ins.attrs, "custom_call_target") or "").strip('"')
        if target == "tpu_custom_call":
            m = re.search(r'kernel_name="?([\w]+)', ins.attrs)
            kernel = kernel_family(m.group(1) if m else ins.name)
            if kernel not in KNOWN_TPU_KERNELS:     # jax 0.11 names megablox tpu_custom_call.N
                kernel = megablox_family(ins, shapes) or kernel
        elif target in GPU_KERNEL_CALLS:
            kernel = gpu_kernel_family(target, ins, shapes)
        else:
            return 0.0
        cost.kernels[kernel] = cost.kernels.get(kernel, 0) + int(times)
        if target == "tpu_custom_call":
            return mosaic_flops(kernel, ins, shapes, self.gmm_occupancy)
        family = kernel.split(" ", 1)[-1]
        if family in ("dag forward", "dag backward"):
            return dag_kernel_flops(family == "dag backward", ins, shapes)
        return (grouped_matmul_flops(family, ins, shapes) * self.gmm_occupancy
                if family in ("gmm", "tgmm") else 0.0)

    def _collective(self, kind: str, ins: Instruction, shapes, times: float,
                    cost: Cost) -> None:
        n, ids = group_size(ins.attrs, self.devices)
        sizes = [shape_bytes(shapes.get(o, "")) for o in ins.operands]
        operands, share = sum(sizes), (n - 1) / max(n, 1)
        if kind == "all-gather":     # an asynchronous start's shape is (operands, results)
            moved = (shape_bytes(ins.shape) - (operands if ins.op.endswith("-start") else 0)
                     ) * share
        elif kind == "all-reduce":
            moved = 2 * operands * share
        elif kind == "collective-permute":
            moved = operands
        elif kind == "ragged-all-to-all":   # input, output buffer, offsets, sizes: input moves
            moved = (sizes[0] if sizes else 0.0) * share
        else:                                # all-to-all, reduce-scatter
            moved = operands * share
        spans = bool(self.slice_of and ids) and len(
            {self.slice_of[i] for i in ids if i < len(self.slice_of)}) > 1
        bandwidth = self.chip.dcn_bandwidth if spans else self.chip.ring_bandwidth
        seconds = moved / bandwidth if n > 1 else 0.0
        entry = cost.collectives.setdefault(kind, {"count": 0, "bytes": 0.0, "seconds": 0.0})
        entry["count"] += int(times)
        entry["bytes"] += moved * times
        entry["seconds"] += seconds * times
        cost.collective_seconds += seconds * times
        cost.slowest.append((seconds * times, f"{kind} {ins.name} x{int(times)}"))


def program_cost(hlo_text: str, chip: Chip, devices: int,
                 slice_of: Optional[Sequence[int]] = None, top: int = 10,
                 gmm_occupancy: float = 1.0) -> Cost:
    """The :class:`Cost` of one chip's compiled program (module docstring). ``devices``: the
    program's device count (a collective without replica groups spans them all); ``slice_of``:
    each device id's slice (multi-slice), so collectives across slices run at DCN speed;
    ``top``: how many of the dearest instructions ``Cost.slowest`` keeps; ``gmm_occupancy``:
    the expected share of a grouped matmul's rows that hold tokens (module docstring)."""
    computations, entry = parse_module(hlo_text)
    if not entry:
        raise ValueError("the compiled module has no ENTRY computation")
    cost = _Walker(computations, chip, devices, slice_of, gmm_occupancy).walk(entry, 1, Cost())
    cost.slowest = sorted(cost.slowest, reverse=True)[:top]
    return cost
