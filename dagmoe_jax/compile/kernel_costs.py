"""The kernels of a compiled program: their names and their FLOPs from their shapes, for
:mod:`dagmoe_jax.compile.roofline` (its module docstring states the rules).

TPU: a Mosaic kernel (``tpu_custom_call``) is named by its ``kernel_name`` (megablox
``gmm`` / ``tgmm``, splash ``splash_mha_*``), or, where jax names the call only
``tpu_custom_call.N`` (jax 0.11; ``shard_map.N`` inside a shard_map), megablox's by its
operands (:func:`megablox_family`). GPU: a Pallas kernel (``mosaic_gpu_v2`` or
``__gpu$xla.gpu.triton``) by its library and shapes (:func:`gpu_kernel_family`).
"""

from __future__ import annotations

import re
from typing import Dict, Optional

from dagmoe_jax.compile.hlo import Instruction, shape_dims

KNOWN_TPU_KERNELS = ("gmm", "tgmm", "splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv")


def splash_flops(kernel: str, instruction: Instruction, shapes: Dict[str, str]) -> float:
    """Splash attention's FLOPs from its query operand [B, H, S, D] (module docstring)."""
    factor = 8.0 if "dkv" in kernel else 6.0 if "dq" in kernel else 4.0
    query = next((dims for dims in (shape_dims(shapes.get(o, "")) for o in instruction.operands)
                  if len(dims) == 4), None)
    if query is None:
        return 0.0
    b, h, s, d = query
    blocks = max(1, s // 128)
    return factor * b * h * s * s * d * (blocks + 1) / (2 * blocks)


def grouped_matmul_flops(kernel: str, instruction: Instruction,
                          shapes: Dict[str, str]) -> float:
    """A grouped matmul's FLOPs from its shapes, for kernels that carry no cost estimate:
    ``gmm`` lhs [M, K] x rhs [G, K, N] -> [M, N] is ``2 M K N``; ``tgmm`` lhs [K, M] (or
    [M, K]) x [M, N] -> [G, K, N] is ``2 K M N``, M the dimension its two matrices share."""
    matrices = [d for d in (shape_dims(shapes.get(o, "")) for o in instruction.operands)
                if len(d) == 2]
    out = shape_dims(instruction.shape)
    if kernel == "gmm" and matrices and len(out) == 2:
        lhs = next((m for m in matrices if m[0] == out[0]), matrices[0])
        return 2.0 * out[0] * out[1] * lhs[1]
    if kernel == "tgmm" and len(matrices) >= 2 and len(out) == 3:
        if matrices[0][0] == matrices[1][0]:          # x [M, K] and dy [M, N]: the GPU kernels'
            return 2.0 * out[1] * out[2] * matrices[0][0]
        shared = set(matrices[0]) & set(matrices[1])
        return 2.0 * out[1] * out[2] * max(shared) if shared else 0.0
    return 0.0


def dag_kernel_flops(backward: bool, instruction: Instruction, shapes: Dict[str, str]) -> float:
    """The matmul FLOPs of a DAG iteration's Triton kernel (kernels/triton_dag_module.py) from
    its node rows [R, d] and W_down [d, d_g]: eq. 8, 9 and 11 forward, 2 R (2 d d_g + 4 d_g^2);
    the backward recomputes eq. 8-9 and runs the input gradients of eq. 8 (twice), 9 and 11,
    2 R (5 d d_g + 8 d_g^2). The weight gradients are XLA's dots, counted as such."""
    dims = [shape_dims(shapes.get(o, "")) for o in instruction.operands]
    if len(dims) < 5 or len(dims[0]) != 2 or len(dims[4]) != 2:
        return 0.0
    (rows, d), g = dims[0], dims[4][1]
    if backward:
        return 2.0 * rows * (5 * d * g + 8 * g * g)
    return 2.0 * rows * (2 * d * g + 4 * g * g)


# custom-call targets of Pallas kernels on GPU -> the kernel library's name
GPU_KERNEL_CALLS = {"mosaic_gpu_v2": "mgpu", "__gpu$xla.gpu.triton": "triton"}


def gpu_kernel_family(target: str, instruction: Instruction, shapes: Dict[str, str]) -> str:
    """'<library> gmm' / 'tgmm' for a grouped matmul / its weight gradient, 'triton dag
    forward' / 'dag backward' for the DAG iteration's kernels, else its name."""
    library = GPU_KERNEL_CALLS[target]
    dag = re.search(r"dagmoe_triton_dag_(forward|backward)", instruction.attrs)
    if dag:
        return f"{library} dag {dag.group(1)}"
    ranks = [len(shape_dims(shapes.get(o, ""))) for o in instruction.operands]
    out = len(shape_dims(instruction.shape))
    if out == 2 and 3 in ranks and 2 in ranks:
        return f"{library} gmm"
    if out == 3 and ranks.count(2) >= 2:
        return f"{library} tgmm"
    named = re.search(r'op_name="[^"]*?(?:\(|/)(\w+)/pallas_call"', instruction.attrs)
    return f"{library} {named.group(1) if named else instruction.name.split('.')[0]}"


_TRITON_CALL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?backend_config=\{'
                          r'.*?\bname = "(\w+)".*?num_warps = (\d+)')


def pallas_gpu_kernels(hlo_text: str) -> Dict[str, Optional[int]]:
    """The Pallas Triton kernels of a compiled GPU program: their names (the ``pallas_call``'s,
    which ptxas reports as the entry function's) -> threads a block (32 x ``num_warps``)."""
    return {m.group(1): 32 * int(m.group(2)) for m in _TRITON_CALL.finditer(hlo_text)}


def mosaic_flops(kernel: str, instruction: Instruction, shapes: Dict[str, str],
                  gmm_occupancy: float = 1.0) -> float:
    """A Mosaic kernel's FLOPs: its cost estimate's (``"flops": ...`` in its backend config),
    else a grouped matmul's or splash's from its shapes, else 0; ``gmm`` and ``tgmm`` times
    ``gmm_occupancy``."""
    estimate = re.search(r'"flops"\s*:\s*"?(\d+)', instruction.attrs)
    if kernel in ("gmm", "tgmm"):
        flops = (float(estimate.group(1)) if estimate
                 else grouped_matmul_flops(kernel, instruction, shapes))
        return flops * gmm_occupancy
    if estimate:
        return float(estimate.group(1))
    return splash_flops(kernel, instruction, shapes) if "splash" in kernel else 0.0


def kernel_family(name: str) -> str:
    """A Mosaic kernel's name without the wrappers' prefixes and numbering: 'gmm', 'tgmm',
    'splash_mha_fwd', 'splash_mha_dq', 'splash_mha_dkv', 'pallas dag forward' / 'backward'
    (kernels/pallas_dag_module.py), else the name as compiled."""
    dag = re.search(r"dagmoe_pallas_dag_(forward|backward)", name)
    if dag:
        return f"pallas dag {dag.group(1)}"
    if "tgmm" in name:
        return "tgmm"
    if "gmm" in name:
        return "gmm"
    m = re.search(r"splash_mha_(fwd|dq|dkv)", name)
    return f"splash_mha_{m.group(1)}" if m else re.sub(r"\.\d+$", "", name)


def megablox_family(instruction: Instruction, shapes: Dict[str, str]) -> Optional[str]:
    """'gmm' or 'tgmm' for a megablox call whose instruction is not named after it: both take
    the group metadata first (five int32 operands: group sizes, offsets, ids, m tile ids, group
    offset), then two matrices; tgmm returns [G, K, N], gmm [M, N]. None for another kernel."""
    operands = [shapes.get(o, "") for o in instruction.operands]
    if len(operands) < 7 or not all(s.startswith("s32") for s in operands[:5]):
        return None
    out = shape_dims(instruction.shape)
    return "tgmm" if len(out) == 3 else "gmm" if len(out) == 2 else None
