"""The FLOPs of a compiled matrix product: a ``dot``, or a ``convolution`` as XLA:TPU writes
batched products (read by :mod:`dagmoe_jax.compile.roofline`)."""

from __future__ import annotations

import math
import re
from typing import Dict

from dagmoe_jax.compile.hlo import Instruction, attr, shape_dims


def _window_taps(size: int, window: int, out: int, pad_lo: int, stride: int,
                 lhs_dilate: int = 1, rhs_dilate: int = 1) -> int:
    """How many (output position, kernel tap) pairs of one spatial dimension land on an input
    element, not on padding nor on the holes a dilation puts between elements: tap ``k`` of
    output ``o`` reads position ``o * stride + k * rhs_dilate - pad_lo`` of the input dilated
    by ``lhs_dilate`` (elements at the multiples of ``lhs_dilate`` up to
    ``(size - 1) * lhs_dilate``)."""
    last = (size - 1) * lhs_dilate
    total = 0
    for o in range(out):
        start = o * stride - pad_lo                      # tap 0's position
        if rhs_dilate == 1:
            lo, hi = max(start, 0), min(start + window - 1, last)
            if hi >= lo:
                total += hi // lhs_dilate - (lo + lhs_dilate - 1) // lhs_dilate + 1
        elif lhs_dilate == 1:
            first = 0 if start >= 0 else (-start + rhs_dilate - 1) // rhs_dilate
            end = min(window - 1, (last - start) // rhs_dilate) if last >= start else -1
            total += max(0, end - first + 1)
        else:
            total += sum(1 for k in range(window)
                         if 0 <= (p := start + k * rhs_dilate) <= last and p % lhs_dilate == 0)
    return total


def _convolution_flops(instruction: Instruction, shapes: Dict[str, str]) -> float:
    """2 x multiply-adds of a ``convolution``: per output batch and feature, the kernel's input
    features times, in each spatial dimension, the kernel taps that land on the input. (XLA:TPU
    writes batched matmuls as convolutions whose spatial dimensions are the batch, with a
    window the batch's size padded to ``size - 1`` on each side: each output position meets one
    tap, not ``size``; with ``lhs_dilate`` equal to the window it writes a batched product
    over that dimension the same way.)"""
    labels = (attr(instruction.attrs, "dim_labels") or "").split("_")
    if len(instruction.operands) < 2 or len(labels) < 2 or "->" not in labels[1]:
        return 0.0
    lhs_labels, (kernel_labels, out_labels) = labels[0], labels[1].split("->")
    lhs = shape_dims(shapes.get(instruction.operands[0], ""))
    kernel = shape_dims(shapes.get(instruction.operands[1], ""))
    out = shape_dims(instruction.shape)
    if len(lhs) != len(lhs_labels) or len(kernel) != len(kernel_labels) \
            or len(out) != len(out_labels):
        return 0.0
    window = re.search(r"window=\{([^}]*)\}", instruction.attrs)
    fields = dict(f.split("=", 1) for f in (window.group(1).split() if window else ())
                  if "=" in f)
    spatial = sorted((c for c in kernel_labels if c.isdigit()), key=int)   # window order
    pads = [p.split("_") for p in fields.get("pad", "").split("x")] if "pad" in fields else []
    strides = fields.get("stride", "").split("x") if "stride" in fields else []
    lhs_dilate = fields.get("lhs_dilate", "").split("x") if "lhs_dilate" in fields else []
    rhs_dilate = fields.get("rhs_dilate", "").split("x") if "rhs_dilate" in fields else []
    taps = 1
    for n, digit in enumerate(spatial):
        k = kernel[kernel_labels.index(digit)]
        pad_lo = int(pads[n][0]) if n < len(pads) else 0
        stride = int(strides[n]) if n < len(strides) else 1
        taps *= _window_taps(lhs[lhs_labels.index(digit)], k, out[out_labels.index(digit)],
                             pad_lo, stride,
                             int(lhs_dilate[n]) if n < len(lhs_dilate) else 1,
                             int(rhs_dilate[n]) if n < len(rhs_dilate) else 1)
    per_position = math.prod(size for label, size in zip(out_labels, out) if not label.isdigit())
    return 2.0 * per_position * kernel[kernel_labels.index("i")] * taps


def dot_flops(instruction: Instruction, shapes: Dict[str, str]) -> float:
    """2 x output elements x contracted size of a ``dot`` (lhs contracting dims); a
    ``convolution``'s by :func:`_convolution_flops`."""
    if instruction.op != "dot":
        return _convolution_flops(instruction, shapes)
    if not instruction.operands:
        return 0.0
    out = math.prod(shape_dims(instruction.shape))
    lhs = shape_dims(shapes.get(instruction.operands[0], ""))
    dims = (attr(instruction.attrs, "lhs_contracting_dims") or "{}").strip("{}")
    contracted = math.prod(lhs[int(d)] for d in dims.split(",")
                           if d.strip() and int(d) < len(lhs))
    return 2.0 * out * contracted
