"""Reading the text of a compiled HLO module (``compiled.as_text()``): its computations and
instructions, shapes in bytes, attributes, and the replica groups of its collectives.

Only what :mod:`dagmoe_jax.compile.roofline` needs: an instruction is its name, result shape,
opcode, operand names and the attribute text after them; a computation is the list of its
instructions in order. Layouts (``{1,0:T(8,128)}``) and metadata are kept as text, unread.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Dict, List, Optional, Tuple

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "token": 0}

ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
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
    for dtype, dims in ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def shape_dims(shape: str) -> List[int]:
    """The dimensions of the first array in a shape text."""
    m = ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def attr(attrs: str, key: str) -> Optional[str]:
    """The value of ``key=`` in an attribute list (a bracketed value whole)."""
    i = attrs.find(key + "=")
    if i < 0:
        return None
    start = i + len(key) + 1
    if start < len(attrs) and attrs[start] in "{[(":
        return attrs[start:_matching(attrs, start)]
    m = re.match(r"[^,\s]+", attrs[start:])
    return m.group(0) if m else None


def backend_config(attrs: str) -> dict:
    """An instruction's ``backend_config`` JSON ({} when it has none)."""
    raw = attr(attrs, "backend_config")
    if not raw or not raw.startswith("{"):
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {}


def constant_value(ins: Instruction) -> Optional[float]:
    """The value of a scalar ``constant`` instruction (None for anything else)."""
    try:
        return float(ins.inner)
    except ValueError:
        return None


def group_size(attrs: str, total_devices: int) -> Tuple[int, Optional[List[int]]]:
    """(chips per group, the first group's device ids when listed) of a collective."""
    groups = attr(attrs, "replica_groups")
    if groups is None:
        pairs = attr(attrs, "source_target_pairs")
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
        # an axis, or a sub-axis 'name':(pre)size (the size devices of name that lie after
        # pre of them)
        axes = [re.fullmatch(r"\s*'?([^':]+)'?(?::\((\d+)\)(\d+))?\s*", n)
                for n in m.group(2).split(",") if n.strip()]
        return math.prod(int(a.group(3)) if a.group(3) else sizes[a.group(1)]
                         for a in axes if a), None
    return total_devices, None
