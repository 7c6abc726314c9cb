"""What a compiled program costs per chip: its collectives and a roofline step-time estimate.

The input is the text of the optimised HLO module the TPU compiler produced
(``compiled.as_text()``), which is one chip's program (SPMD). The model, stated so it can be
checked by hand:

* **Instructions.** The entry computation is walked; a ``while`` loop's body and condition are
  walked ``known_trip_count`` times (the scanned layers, the micro-batches), a ``call`` once
  and a ``conditional`` as its most expensive branch. Bookkeeping instructions move no data:
  parameter, constant, tuple, get-tuple-element, bitcast, the ``-done`` halves of asynchronous
  operations, partition / replica ids.
* **Compute.** Each other instruction (a fusion, a copy, a Mosaic kernel, a lone dot) is a
  roofline of its own: ``max(flops / peak, bytes / HBM bandwidth)``, where ``bytes`` is its
  operands' and results' sizes (a fusion reads its inputs and writes its outputs to HBM once)
  and ``flops`` the matrix products inside it: ``2 x output elements x contracted size`` for
  each ``dot`` and ``convolution`` (of fused computations too). A Mosaic kernel
  (``tpu_custom_call``) counts the ``flops`` of its cost estimate when it carries one
  (megablox ``gmm``); splash attention carries none, and its FLOPs are read from its shapes:
  ``4 B H S^2 D`` forward, ``6`` for ``dq`` and ``8`` for ``dkv``, times the share of the
  causal mask's key blocks it visits. Elementwise and reduction work counts as bytes only.
* **Collectives.** A collective over a group of ``n`` chips moves, per chip, ``(n - 1) / n``
  of its buffer (all-gather: the result, reduce-scatter: the operand, all-to-all and the
  ragged all-to-all: the operand, all-reduce: twice the operand, as a reduce-scatter then an
  all-gather); a collective-permute moves its operand. It runs as a bidirectional ring along
  one torus dimension (:attr:`~dagmoe_jax.compile.chips.Chip.ring_bandwidth`), or at the DCN
  bandwidth when its group spans slices.
* **The estimate** is the sum of the instructions' times plus the collectives' (no overlap:
  an upper bound on a program whose collectives XLA overlaps with compute); the overlapped
  bound ``max(compute, collectives)`` is reported beside it.

The compiler's own ``cost_analysis()`` totals (flops, bytes accessed) are reported next to
this walk's; its ``optimal_seconds`` is not used (it came out negative for whole training
steps).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dagmoe_jax.compile.chips import Chip

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "token": 0}

COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute",
               "ragged-all-to-all")

_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "partition-id",
         "replica-id", "after-all", "add-dependency", "opt-barrier", "iota"}

_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str                  # the result's shape text (a tuple for several results)
    op: str
    operands: List[str]
    attrs: str                  # everything after the operand list
    inner: str = ""             # the operand list's text (a constant's value)


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


def parse_instruction(line: str) -> Optional[Instruction]:
    """One HLO instruction line, or None for anything else."""
    m = _NAME.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        space = rest.find(" ")
        if space < 0:
            return None
        shape, rest = rest[:space], rest[space + 1:]
    paren = rest.find("(")
    if paren <= 0:
        return None
    op = rest[:paren].strip()
    end = _matching(rest, paren)
    inner = rest[paren + 1:end - 1]
    operands = re.findall(r"%([\w.\-]+)", inner)
    return Instruction(m.group(1), shape, op, operands, rest[end:], inner.strip())


def parse_module(text: str) -> Tuple[Dict[str, List[Instruction]], str]:
    """({computation name: its instructions}, the entry computation's name)."""
    computations: Dict[str, List[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("//") or stripped.startswith("HloModule"):
            continue
        if stripped == "}":
            current = None
            continue
        if current is None:
            header = _HEADER.match(stripped)
            if header:
                current = header.group(1)
                computations[current] = []
                if stripped.startswith("ENTRY"):
                    entry = current
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            computations[current].append(instruction)
    return computations, entry


def shape_bytes(shape: str) -> float:
    """Bytes of every array in a shape text (a tuple's elements summed)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def shape_dims(shape: str) -> List[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _attr(attrs: str, key: str) -> Optional[str]:
    """The value of ``key=`` in an attribute list (a bracketed value whole)."""
    i = attrs.find(key + "=")
    if i < 0:
        return None
    start = i + len(key) + 1
    if start < len(attrs) and attrs[start] in "{[(":
        return attrs[start:_matching(attrs, start)]
    m = re.match(r"[^,\s]+", attrs[start:])
    return m.group(0) if m else None


def _backend_config(attrs: str) -> dict:
    raw = _attr(attrs, "backend_config")
    if not raw or not raw.startswith("{"):
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {}


def dot_flops(instruction: Instruction, shapes: Dict[str, str]) -> float:
    """2 x output elements x contracted size of a ``dot`` (lhs contracting dims) or a
    ``convolution`` (the kernel's input-feature and spatial dims)."""
    out = math.prod(shape_dims(instruction.shape))
    if not instruction.operands:
        return 0.0
    if instruction.op == "dot":
        lhs = shape_dims(shapes.get(instruction.operands[0], ""))
        dims = _attr(instruction.attrs, "lhs_contracting_dims") or "{}"
        contracted = math.prod(lhs[int(d)] for d in dims.strip("{}").split(",") if d.strip()
                               and int(d) < len(lhs))
        return 2.0 * out * contracted
    # convolution: dim_labels=b0f_0io->b0f; contracted = kernel's i and spatial sizes
    if len(instruction.operands) < 2:
        return 0.0
    kernel = shape_dims(shapes.get(instruction.operands[1], ""))
    labels = _attr(instruction.attrs, "dim_labels") or ""
    parts = labels.split("_")
    if len(parts) < 2 or not kernel:
        return 0.0
    kernel_labels = parts[1].split("->")[0]
    contracted = 1
    for label, size in zip(kernel_labels, kernel):
        if label != "o":
            contracted *= size
    return 2.0 * out * contracted      # the kernel's i is per feature group already


def _splash_flops(instruction: Instruction, shapes: Dict[str, str]) -> float:
    """Splash attention's FLOPs from its query operand [B, H, S, D] (module docstring)."""
    kernel = _attr(instruction.attrs, "kernel_name") or ""
    metadata = re.search(r'kernel_name="?([\w]+)', instruction.attrs)
    kernel = metadata.group(1) if metadata else kernel
    factor = 8.0 if "dkv" in kernel else 6.0 if "dq" in kernel else 4.0
    q = None
    for name in instruction.operands:
        dims = shape_dims(shapes.get(name, ""))
        if len(dims) == 4:
            q = dims
            break
    if q is None:
        return 0.0
    b, h, s, d = q
    blocks = max(1, s // 128)
    causal_share = (blocks + 1) / (2 * blocks)
    return factor * b * h * s * s * d * causal_share


def _mosaic_flops(instruction: Instruction, shapes: Dict[str, str]) -> float:
    config = _backend_config(instruction.attrs)
    estimate = config.get("custom_call_config", {}).get("cost_estimate") or config.get(
        "cost_estimate")
    if estimate and "flops" in estimate:
        return float(estimate["flops"])
    flat = json.dumps(config) + instruction.attrs
    m = re.search(r'"flops"\s*:\s*"?(\d+)', flat)
    if m:
        return float(m.group(1))
    if "splash" in instruction.attrs or "splash" in instruction.name:
        return _splash_flops(instruction, shapes)
    return 0.0


def kernel_family(name: str) -> str:
    """A Mosaic kernel's name without the wrappers' prefixes and numbering: 'gmm', 'tgmm',
    'splash_mha_fwd', 'splash_mha_dq', 'splash_mha_dkv', else the name as compiled."""
    if "tgmm" in name:
        return "tgmm"
    if "gmm" in name:
        return "gmm"
    m = re.search(r"splash_mha_(fwd|dq|dkv)", name)
    return f"splash_mha_{m.group(1)}" if m else re.sub(r"\.\d+$", "", name)


def _constant_value(ins: Instruction) -> Optional[float]:
    """The value of a scalar ``constant`` instruction (None for anything else)."""
    try:
        return float(ins.inner)
    except ValueError:
        return None


def group_size(attrs: str, total_devices: int) -> Tuple[int, Optional[List[int]]]:
    """(chips per group, the first group's device ids when listed) of a collective."""
    groups = _attr(attrs, "replica_groups")
    if groups is None:
        pairs = _attr(attrs, "source_target_pairs")
        return (2 if pairs else total_devices), None
    groups = groups.strip()
    if groups.startswith("{{"):
        first = groups[2:groups.find("}")]
        ids = [int(x) for x in first.split(",") if x.strip()]
        return max(len(ids), 1), ids
    # iota groups: [groups, size]<=[dims] (optionally T(permutation)): the device ids
    # 0..n-1 laid out as dims, transposed, and cut into groups
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return shape[-1], [int(i) for i in ids.reshape(-1, shape[-1])[0]]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in
                     (kv.split("=") for kv in m.group(1).split(",")))
        names = [n.strip("' ") for n in m.group(2).split(",") if n.strip()]
        return math.prod(sizes[n] for n in names), None
    return total_devices, None


@dataclasses.dataclass
class Cost:
    """What one chip does in one run of the program (module docstring)."""

    compute_seconds: float = 0.0
    collective_seconds: float = 0.0
    matmul_flops: float = 0.0
    hbm_bytes: float = 0.0
    collectives: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)
    kernels: Dict[str, int] = dataclasses.field(default_factory=dict)
    slowest: List[Tuple[float, str]] = dataclasses.field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.collective_seconds

    @property
    def overlapped_seconds(self) -> float:
        return max(self.compute_seconds, self.collective_seconds)

    def collective_bytes(self) -> float:
        return sum(c["bytes"] for c in self.collectives.values())


class _Walker:
    def __init__(self, computations, chip: Chip, devices: int, slice_of: Optional[Sequence[int]]):
        self.computations, self.chip, self.devices = computations, chip, devices
        self.slice_of = slice_of
        self.shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in computations.items()}
        self._fused_flops: Dict[str, float] = {}
        self.cost = Cost()

    def fused_flops(self, computation: str) -> float:
        if computation not in self._fused_flops:
            total = 0.0
            shapes = self.shapes.get(computation, {})
            for ins in self.computations.get(computation, []):
                if ins.op in ("dot", "convolution"):
                    total += dot_flops(ins, shapes)
                elif ins.op == "fusion":
                    called = _attr(ins.attrs, "calls")
                    if called:
                        total += self.fused_flops(called.lstrip("%"))
            self._fused_flops[computation] = total
        return self._fused_flops[computation]

    def trip_count(self, ins: Instruction, computation: str) -> int:
        """A ``while`` loop's trip count: its ``known_trip_count``, else read from its
        condition ``i < N`` (``i`` the tuple's element that the condition's root compares,
        started from the init tuple's constant, 0 when it is not one); 1 if neither."""
        known = _backend_config(ins.attrs).get("known_trip_count", {}).get("n")
        if known is not None:
            return int(known)
        condition = (_attr(ins.attrs, "condition") or "").lstrip("%")
        body = self.computations.get(condition, [])
        by_name = {i.name: i for i in body}
        root = next((i for i in reversed(body) if i.op == "compare"), None)
        if root is None or "direction=LT" not in root.attrs or len(root.operands) != 2:
            return 1
        counter, limit = (by_name.get(o) for o in root.operands)
        if limit is None or limit.op != "constant" or counter is None:
            return 1
        bound = _constant_value(limit)
        index = _attr(counter.attrs, "index") if counter.op == "get-tuple-element" else None
        start = 0
        outer = {i.name: i for i in self.computations.get(computation, [])}
        init = outer.get(ins.operands[0]) if ins.operands else None
        if index is not None and init is not None and init.op == "tuple":
            element = outer.get(init.operands[int(index)]) if int(index) < len(
                init.operands) else None
            if element is not None and element.op == "constant":
                start = _constant_value(element) or 0
        return max(int((bound or 1) - start), 1)

    def spans_slices(self, ids: Optional[List[int]]) -> bool:
        if not self.slice_of or not ids:
            return False
        return len({self.slice_of[i] for i in ids if i < len(self.slice_of)}) > 1

    def walk(self, computation: str, times: float, depth: int = 0) -> None:
        shapes = self.shapes.get(computation, {})
        for ins in self.computations.get(computation, []):
            op = ins.op
            if op in _FREE or op.endswith("-done"):
                continue
            if op == "while":
                trips = self.trip_count(ins, computation)
                for key in ("body", "condition"):
                    called = _attr(ins.attrs, key)
                    if called:
                        self.walk(called.lstrip("%"), times * int(trips), depth + 1)
                continue
            if op == "call":
                called = _attr(ins.attrs, "to_apply")
                if called:
                    self.walk(called.lstrip("%"), times, depth + 1)
                continue
            if op == "conditional":
                self._conditional(ins, times, depth)
                continue
            base = op[:-len("-start")] if op.endswith("-start") else op
            operand_bytes = sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
            if base in COLLECTIVES:
                first = shape_bytes(shapes.get(ins.operands[0], "")) if ins.operands else 0.0
                self._collective(base, ins, operand_bytes, first, times)
                continue
            out_bytes = shape_bytes(ins.shape)
            nbytes = operand_bytes + out_bytes
            if op == "fusion":
                called = _attr(ins.attrs, "calls")
                flops = self.fused_flops(called.lstrip("%")) if called else 0.0
            elif op in ("dot", "convolution"):
                flops = dot_flops(ins, shapes)
            elif op == "custom-call":
                target = _attr(ins.attrs, "custom_call_target") or ""
                target = target.strip('"')
                if target == "tpu_custom_call":
                    m = re.search(r'kernel_name="?([\w]+)', ins.attrs)
                    kernel = kernel_family(m.group(1) if m else ins.name)
                    self.cost.kernels[kernel] = self.cost.kernels.get(kernel, 0) + int(times)
                    flops = _mosaic_flops(ins, shapes)
                else:
                    flops = 0.0
            else:
                flops = 0.0
            seconds = max(flops / self.chip.peak_flops, nbytes / self.chip.hbm_bandwidth)
            self.cost.compute_seconds += seconds * times
            self.cost.matmul_flops += flops * times
            self.cost.hbm_bytes += nbytes * times
            self.cost.slowest.append((seconds * times, f"{op} {ins.name} x{int(times)}"))

    def _conditional(self, ins: Instruction, times: float, depth: int) -> None:
        branches = _attr(ins.attrs, "branch_computations")
        names = ([b.strip().lstrip("%") for b in branches.strip("{}").split(",")]
                 if branches else [n.lstrip("%") for n in
                                   (_attr(ins.attrs, "true_computation"),
                                    _attr(ins.attrs, "false_computation")) if n])
        best = None
        for name in names:
            sub = _Walker(self.computations, self.chip, self.devices, self.slice_of)
            sub._fused_flops = self._fused_flops
            sub.walk(name, times, depth + 1)
            if best is None or sub.cost.seconds > best.cost.seconds:
                best = sub
        if best is not None:
            c, b = self.cost, best.cost
            c.compute_seconds += b.compute_seconds
            c.collective_seconds += b.collective_seconds
            c.matmul_flops += b.matmul_flops
            c.hbm_bytes += b.hbm_bytes
            c.slowest.extend(b.slowest)
            for kind, entry in b.collectives.items():
                mine = c.collectives.setdefault(kind, {"count": 0, "bytes": 0.0, "seconds": 0.0})
                for key in mine:
                    mine[key] += entry[key]
            for kernel, count in b.kernels.items():
                c.kernels[kernel] = c.kernels.get(kernel, 0) + count

    def _collective(self, kind: str, ins: Instruction, operand_bytes: float, first: float,
                    times: float):
        n, ids = group_size(ins.attrs, self.devices)
        out_bytes = shape_bytes(ins.shape)
        if kind == "all-gather":
            moved = out_bytes * (n - 1) / max(n, 1)
            if ins.op.endswith("-start"):       # the start's shape is (operands, results)
                moved = (out_bytes - operand_bytes) * (n - 1) / max(n, 1)
        elif kind == "all-reduce":
            moved = 2 * operand_bytes * (n - 1) / max(n, 1)
        elif kind == "collective-permute":
            moved = operand_bytes
        elif kind == "ragged-all-to-all":
            # operands: input, output buffer, offsets and sizes: the input is what moves
            moved = first * (n - 1) / max(n, 1)
        else:                                    # all-to-all, reduce-scatter
            moved = operand_bytes * (n - 1) / max(n, 1)
        bandwidth = (self.chip.dcn_bandwidth if self.spans_slices(ids)
                     else self.chip.ring_bandwidth)
        seconds = moved / bandwidth if n > 1 else 0.0
        entry = self.cost.collectives.setdefault(kind, {"count": 0, "bytes": 0.0, "seconds": 0.0})
        entry["count"] += int(times)
        entry["bytes"] += moved * times
        entry["seconds"] += seconds * times
        self.cost.collective_seconds += seconds * times
        self.cost.slowest.append((seconds * times, f"{kind} {ins.name} x{int(times)}"))


def program_cost(hlo_text: str, chip: Chip, devices: int,
                 slice_of: Optional[Sequence[int]] = None, top: int = 10) -> Cost:
    """The :class:`Cost` of one chip's compiled program (module docstring). ``devices``: the
    program's device count (a collective without replica groups spans them all); ``slice_of``:
    each device id's slice (multi-slice), so collectives across slices run at DCN speed."""
    computations, entry = parse_module(hlo_text)
    if not entry:
        raise ValueError("the compiled module has no ENTRY computation")
    walker = _Walker(computations, chip, devices, slice_of)
    walker.walk(entry, 1)
    cost = walker.cost
    cost.slowest = sorted(cost.slowest, reverse=True)[:top]
    return cost
