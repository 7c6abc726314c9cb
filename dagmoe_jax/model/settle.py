"""Settle every 'auto' of how a model runs once, when the run is built.

The model code (``dagmoe_jax/model``) never asks what machine it runs on: no backend query,
no look at the active mesh. Every choice that depends on the machine is a field of an
:class:`~dagmoe_jax.config.ExecutionConfig` (a run's ``RunConfig.execution``, beside its
mesh) left 'auto' by the user and decided here, from (model config, backend, mesh layout), into
a concrete ``ExecutionConfig`` that the run prints and saves, and builds the model with
(``Transformer(cfg, execution=settle(cfg, execution))``):

=================  =====================================================================
``remat``          'none' on CPU (memory is plentiful, recomputing costs ~15%), 'full' on
                   GPU / TPU (MaxText's default)
``scan_unroll``    all layers unrolled on CPU (XLA:CPU slices each layer's weights statically
                   instead of updating stacked buffers in a loop), 1 elsewhere
``attention``      CPU: the fused C++ kernel (float32, one device, a working compiler: it is
                   compiled here, about 10 s the first time), else blockwise; GPU: cuDNN for
                   16-bit compute and a head dim cuDNN's flash kernel takes (a multiple of 8,
                   at most 128), else XLA's; TPU: the Pallas splash kernel
``grouped_matmul`` dropless dispatch's grouped matmul: megablox ``gmm`` (Pallas) on TPU when
                   d_model and the expert hidden size are multiples of its 128 tile; on GPU
                   JAX's Mosaic GPU kernels ``mgpu`` on Hopper (sm90) for 16-bit compute and
                   dims multiples of 64, else this library's Pallas Triton kernel ``triton``
                   on sm80 and newer (dims multiples of 16), else ``jax.lax.ragged_dot``
                   (which XLA:GPU rewrites into a dense dot over zero-padded groups); on CPU
                   (one device, a working compiler) the C++ kernel ``cpu_gmm``, compiled here
                   the first time (XLA:CPU's ``ragged_dot`` is 40-100x slower); else
                   ``jax.lax.ragged_dot``
``expert_exchange`` expert-parallel dropless dispatch: ``jax.lax.ragged_all_to_all`` on GPU and
                   TPU; the all-gather fallback on CPU (XLA:CPU has no ragged all-to-all)
``fuse_projections`` one [W_gate | W_up] matmul (and one [W_q | W_k | W_v]) on one device;
                   separate ones under a mesh (the concatenation would move tensor-sharded
                   weights)
``dag_module``     how the DAG module runs, each choice from a measurement or, between XLA's
                   own programs, from the roofline that ranks them (:data:`DAG_EVIDENCE`,
                   printed by :func:`describe`): the C++ kernels ('fused') on CPU for float32
                   on one device with d and d_g multiples of 16 and a working compiler
                   (compiled here the first time; measured faster than XLA's on this CPU);
                   on TPU XLA's with the projections on the [T, K, .] node arrays
                   ('xla_rank3': there the reshape to [T*K, .] rows is a relayout copy; the
                   Mosaic kernels 'pallas' are only estimated, so only run when asked for);
                   on a GPU XLA's in the bottleneck space ('bottleneck': no d-wide node
                   built; the Triton kernels ran 3.3x slower than XLA on an H200 and stay a
                   choice); else XLA's on [T*K, .] rows ('xla'), benchmarks/RESULTS.md
``loss_chunk``     tokens per device in a chunk of the vocabulary-tiled loss: 512 on CPU,
                   4096 on GPU / TPU (where smaller chunks re-read the LM head and its float32
                   gradient until the head is bound by HBM, not by its FLOPs)
=================  =====================================================================

The mesh enters as a :class:`~dagmoe_jax.parallel.axes.MeshLayout` (None for one device),
which the model also receives for its expert-parallel dispatch.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from dagmoe_jax.config import (ExecutionConfig, ModelConfig, dag_aggregation_of, experts_of,
                              family_of, router_of)
from dagmoe_jax.kernels.attention import fused_attention_unavailable, kernel_needs_build
from dagmoe_jax.kernels.dag_module import dag_module_needs_build, dag_module_unavailable
from dagmoe_jax.kernels.gpu_grouped_matmul import mgpu_unsupported, triton_unsupported
from dagmoe_jax.kernels.grouped_matmul import (grouped_matmul_needs_build,
                                               grouped_matmul_unavailable)
from dagmoe_jax.kernels.pallas import gmm_supported
from dagmoe_jax.kernels.pallas_dag_module import pallas_dag_unsupported
from dagmoe_jax.kernels.triton_dag_module import triton_dag_unsupported
from dagmoe_jax.parallel.axes import MeshLayout


def settle_remat(name: str, backend: str) -> str:
    """'auto': 'none' on CPU, 'full' on accelerators (see the module docstring)."""
    if name != "auto":
        return name
    return "none" if backend == "cpu" else "full"


def settle_scan_unroll(unroll: int, num_layers: int, backend: str) -> int:
    """0 (auto): all ``num_layers`` unrolled on CPU, 1 (one compiled layer body) elsewhere."""
    if unroll:
        return unroll
    return num_layers if backend == "cpu" else 1


def settle_attention(name: str, backend: str, dtype, head_dim: int,
                     layout: Optional[MeshLayout]) -> tuple:
    """(implementation, why) for ``ExecutionConfig.attention``: 'auto' becomes 'fused' on CPU for
    float32 on one device when the kernel builds, else 'blockwise' (``why`` says why not
    fused); on GPU 'cudnn' for 16-bit compute and a head dim that is a multiple of 8 and at
    most 128 (the shapes cuDNN's flash kernel takes on every GPU generation), else 'xla'
    (``why`` says why); 'splash' on TPU; else 'xla'. An explicit 'fused' under a multi-device
    mesh is a one-line ``ValueError``."""
    if name in ("fused", "triton") and layout is not None:
        raise ValueError(f"ExecutionConfig.attention={name!r} runs on a single device only; use "
                         f"'auto' or {'blockwise' if name == 'fused' else 'cudnn'!r} under a "
                         f"device mesh")
    if name != "auto":
        return name, ""
    if backend == "cpu":
        if layout is not None:
            return "blockwise", "the fused kernel runs on one device only"
        reason = fused_attention_unavailable((head_dim,), dtype, backend)
        return ("fused", "") if reason is None else ("blockwise", reason)
    if backend == "gpu":
        if jnp.dtype(dtype).itemsize != 2:
            return "xla", (f"cuDNN's flash attention takes 16-bit inputs "
                           f"(got {jnp.dtype(dtype).name})")
        if head_dim % 8 or head_dim > 128:
            return "xla", (f"cuDNN's flash attention takes head_dim <= 128, a multiple of 8 "
                           f"(got {head_dim})")
        return "cudnn", ""
    if backend == "tpu":
        return "splash", ""
    return "xla", ""


def gpu_capability(device=None) -> Optional[tuple]:
    """(major, minor) CUDA compute capability of ``device`` (default: JAX's first device), or
    None when it is not an NVIDIA GPU (or does not say)."""
    device = device if device is not None else jax.devices()[0]
    text = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not text:
        return None
    try:
        major, minor = (int(part) for part in str(text).split(".")[:2])
    except ValueError:
        return None
    return major, minor


def settle_gpu_grouped_matmul(capability: Optional[tuple], d_model: int, hidden: int,
                              dtype) -> tuple:
    """(implementation, why) of 'auto' on an NVIDIA GPU of compute ``capability``: 'mgpu' on
    Hopper (9.0) where the Mosaic GPU kernels take the dtype and dims; 'triton' on 8.0 and
    newer where the Triton kernel takes them; else 'ragged_dot', ``why`` saying why."""
    if capability is None:
        return "ragged_dot", "the GPU's compute capability is unknown"
    reasons = []
    if capability[0] == 9:
        reason = mgpu_unsupported(d_model, hidden, dtype)
        if reason is None:
            return "mgpu", ""
        reasons.append(reason)
    if capability >= (8, 0):
        reason = triton_unsupported(d_model, hidden, dtype)
        if reason is None:
            return "triton", ""
        reasons.append(reason)
    else:
        reasons.append(f"the GPU kernels need compute capability 8.0 or newer (this GPU: "
                       f"{capability[0]}.{capability[1]})")
    return "ragged_dot", "; ".join(reasons)


def settle_grouped_matmul(name: str, backend: str, d_model: int, hidden: int,
                          layout: Optional[MeshLayout] = None, dtype=jnp.bfloat16,
                          capability: Optional[tuple] = None) -> str:
    """'auto': megablox 'gmm' on TPU when both expert dims are multiples of its 128 tile; on
    GPU :func:`settle_gpu_grouped_matmul` for the device's compute ``capability``; on CPU
    off-mesh 'cpu_gmm' when the C++ kernel builds (it is built here on first use);
    'ragged_dot' otherwise (see the module docstring). An explicit 'cpu_gmm' under a
    multi-device mesh is a one-line ``ValueError``."""
    if name == "cpu_gmm" and layout is not None:
        raise ValueError("ExecutionConfig.grouped_matmul='cpu_gmm' runs on a single device "
                         "only; use 'auto' or 'ragged_dot' under a device mesh")
    if name != "auto":
        return name
    if backend == "tpu" and gmm_supported(d_model, hidden):
        return "gmm"
    if backend == "gpu":
        return settle_gpu_grouped_matmul(capability, d_model, hidden, dtype)[0]
    if backend == "cpu" and layout is None and grouped_matmul_unavailable(backend) is None:
        return "cpu_gmm"
    return "ragged_dot"


def settle_expert_exchange(name: str, backend: str) -> str:
    """'auto': 'ragged_all_to_all' on GPU / TPU, 'all_gather' on CPU (module docstring)."""
    if name != "auto":
        return name
    return "all_gather" if backend == "cpu" else "ragged_all_to_all"


DAG_EVIDENCE = {
    "fused": "the C++ kernels: one DAG-MoE-s layer's module forward + backward measured in "
             "0.21 s on the 2-core CPU, XLA's 'xla' 0.28-0.32 s and 'bottleneck' 0.37 s "
             "(benchmarks/RESULTS.md)",
    "xla": "XLA's on [T*K, .] rows: of XLA's programs the fastest measured on CPU, one "
           "DAG-MoE-s layer's module 0.28-0.32 s against 'bottleneck''s 0.37 s "
           "(benchmarks/RESULTS.md)",
    "xla_rank3": "XLA's on the [T, K, .] nodes: the best of XLA's programs on TPU by the "
                 "roofline (DAG-MoE-l L 2 / MoE + shared on v5p 1.16x, 'bottleneck' 1.21x); "
                 "the Mosaic kernels ('pallas') are estimated only, no TPU has run them "
                 "(benchmarks/RESULTS.md)",
    "bottleneck": "XLA's in the bottleneck space, no d-wide node built: the best of XLA's "
                  "programs by the roofline, whose ratios between them an H200 confirmed "
                  "(DAG-MoE L 2 / MoE + shared on an H100 1.18x at s and 1.20x at l, 'xla' "
                  "1.25x and 1.35x); the Triton kernels ran 3.3x slower than XLA's iteration "
                  "on an H200 (benchmarks/RESULTS.md)",
}
"""Why 'auto' settles the DAG module as it does, by the strategy it settles to
(:func:`describe` prints it beside the choice)."""


def settle_dag_module(name: str, cfg: ModelConfig, backend: str, dtype,
                      layout: Optional[MeshLayout]) -> str:
    """'auto': 'fused' (the C++ kernels, built here on first use) on CPU for float32 on one
    device when the model has a DAG module of d and d_g multiples of 16, else 'xla' there; on
    TPU 'xla_rank3'; on a GPU 'bottleneck' (XLA's program in d_g). Each for the reason
    :data:`DAG_EVIDENCE` gives: a kernel only where it was measured faster on its hardware,
    and between XLA's programs the roofline's ranking. 'triton' and 'pallas' run only when
    asked for. An explicit 'fused' or 'triton' under a multi-device mesh, a 'triton' the
    kernels cannot take, or a 'pallas' off TPU or of other widths, is a one-line
    ``ValueError``."""
    if name in ("fused", "triton") and layout is not None:
        instead = "xla" if name == "fused" else "bottleneck"      # XLA's best on its backend
        raise ValueError(f"ExecutionConfig.dag_module={name!r} runs on a single device only; "
                         f"use 'auto' or {instead!r} under a device mesh")
    dag = dag_aggregation_of(cfg.block)
    reason = (triton_dag_unsupported(cfg.d_model, dag.dag_dim, router_of(cfg.block).top_k,
                                     dtype) if name == "triton" and dag is not None else None)
    if reason is not None:
        raise ValueError(f"ExecutionConfig.dag_module='triton': {reason}; use 'auto' or "
                         "'bottleneck'")
    if name == "pallas" and dag is not None:
        reason = ("it runs on TPU only" if backend != "tpu" else
                  pallas_dag_unsupported(cfg.d_model, dag.dag_dim, dtype))
        if reason is not None:
            raise ValueError(f"ExecutionConfig.dag_module='pallas': {reason}; use 'auto' or "
                             "'xla_rank3'")
    if name != "auto":
        return name
    if dag is None:
        return "xla"                      # never used: the model has no DAG module
    if backend == "tpu":
        return "xla_rank3"
    if backend == "cpu":
        return ("fused" if layout is None and dag_module_unavailable(
            cfg.d_model, dag.dag_dim, dtype, backend) is None else "xla")
    return "bottleneck"


def check_kernel_precision(attention: str, grouped_matmul: str, backend: str) -> None:
    """A one-line ``ValueError`` when the Pallas TPU kernels are settled while
    ``jax_default_matmul_precision`` asks for float32 products: ``lax.dot_general`` takes its
    precision from that flag when the kernels are traced, and Mosaic compiles bf16 products at
    the default precision only (every kernel failed with "Bad lhs type", silently to the
    library). The kernels' backward halves are traced when the gradient is taken, outside any
    call of ours, so the flag cannot be overridden around them: the run is refused here."""
    kernels = [k for k, used in (("splash attention", attention == "splash"),
                                 ("megablox gmm", grouped_matmul == "gmm")) if used]
    if backend != "tpu" or not kernels:
        return
    from jax._src import config as jax_config
    precision = str(jax_config.default_matmul_precision.value or "default").lower()
    if precision in ("highest", "float32", "tensorfloat32", "high", "bfloat16_3x"):
        raise ValueError(
            f"jax_default_matmul_precision={precision!r} is set, and the Pallas TPU kernels "
            f"settled here ({' and '.join(kernels)}) do not compile under it (Mosaic: 'Bad lhs "
            f"type'): unset it (or set it to 'default'), or bind ExecutionConfig.attention="
            f"'xla' and ExecutionConfig.grouped_matmul='ragged_dot'")


def settle_loss_chunk(tokens: int, backend: str) -> int:
    """``ExecutionConfig.loss_chunk``: tokens per device of a tiled-loss chunk (0 = auto: 512
    on CPU, 4096 on GPU / TPU; its docstring says why)."""
    return tokens or (512 if backend == "cpu" else 4096)


def grouped_matmul_width(cfg: ModelConfig) -> int:
    """The hidden width of the grouped matmuls the block family runs (its ``accounting``
    module's ``grouped_matmul_width``: the routed experts' d_r, DoE's knowledge blocks' h_b; a
    family that runs none gives d_model, what it settles to never used)."""
    return family_of(cfg.block).part("accounting").grouped_matmul_width(cfg)


def settle(cfg: ModelConfig, execution: Optional[ExecutionConfig] = None, *,
           backend: Optional[str] = None, layout: Optional[MeshLayout] = None,
           device=None,
           log: Callable[[str], None] = lambda _message: None) -> ExecutionConfig:
    """``execution`` (default: every choice 'auto') with every 'auto' decided for the model
    ``cfg`` on ``backend`` (default: JAX's default backend) and ``layout`` (None: one device);
    ``device`` (default: JAX's first device) is asked for its compute capability on GPU (a
    compile-only device of a GPU topology when compiling for one from another host).
    Fields already concrete are kept (an impossible one, such as 'fused' attention under a
    mesh, is a one-line ``ValueError``). ``log`` hears about slow work done here (compiling
    the CPU kernels)."""
    backend = backend or jax.default_backend()
    dtype = jnp.dtype(cfg.compute_dtype)
    ex = execution or ExecutionConfig()
    if (ex.attention in ("auto", "fused") and backend == "cpu" and layout is None
            and dtype == jnp.float32 and kernel_needs_build()):
        log("compiling the fused CPU attention kernel (about 10 s, once per machine)")
    if (ex.grouped_matmul == "auto" and backend == "cpu" and layout is None
            and grouped_matmul_needs_build()):
        log("compiling the CPU grouped matmul kernel (about 5 s, once per machine)")
    if (ex.dag_module == "auto" and backend == "cpu" and layout is None
            and dag_aggregation_of(cfg.block) is not None and dtype == jnp.float32
            and dag_module_needs_build()):
        log("compiling the CPU DAG module kernels (about 5 s, once per machine)")
    attention, _ = settle_attention(ex.attention, backend, dtype, cfg.attention_head_dim,
                                    layout)
    capability = gpu_capability(device) if backend == "gpu" else None
    grouped_matmul = settle_grouped_matmul(ex.grouped_matmul, backend, cfg.d_model,
                                           grouped_matmul_width(cfg), layout, dtype,
                                           capability)
    return ExecutionConfig(
        remat=settle_remat(ex.remat, backend),
        scan_unroll=settle_scan_unroll(ex.scan_unroll, cfg.num_layers, backend),
        attention=attention,
        grouped_matmul=grouped_matmul,
        expert_exchange=settle_expert_exchange(ex.expert_exchange, backend),
        fuse_projections=layout is None if ex.fuse_projections is None else ex.fuse_projections,
        dag_module=settle_dag_module(ex.dag_module, cfg, backend, dtype, layout),
        attention_block=ex.attention_block,
        loss_chunk=settle_loss_chunk(ex.loss_chunk, backend))


def describe(cfg: ModelConfig, settled: ExecutionConfig,
             requested: Optional[ExecutionConfig] = None, backend: Optional[str] = None,
             layout: Optional[MeshLayout] = None, device=None) -> str:
    """One line for logs: how the model ``cfg`` runs (``settled``), why attention that was
    'auto' in ``requested`` fell back (to blockwise from the fused CPU kernel, to XLA from
    cuDNN), the grouped matmul of dropless dispatch (and on GPU why an 'auto' one fell back
    to ``ragged_dot``; ``device`` as :func:`settle`'s) and how the DAG module runs (an 'auto'
    one with the evidence it was chosen on, :data:`DAG_EVIDENCE`)."""
    backend = backend or jax.default_backend()
    ex = settled
    attention = ex.attention
    if (requested is not None and requested.attention == "auto"
            and attention in ("blockwise", "xla")):
        _, why = settle_attention("auto", backend, jnp.dtype(cfg.compute_dtype),
                                  cfg.attention_head_dim, layout)
        attention += f" ({why})" if why else ""
    experts = experts_of(cfg.block)
    dropless = experts is not None and experts.dispatch == "dropless"
    dispatch = f", dispatch {experts.dispatch}" if experts else ""
    grouped = ex.grouped_matmul
    if (dropless and backend == "gpu" and grouped == "ragged_dot" and requested is not None
            and requested.grouped_matmul == "auto"):
        _, why = settle_gpu_grouped_matmul(gpu_capability(device), cfg.d_model,
                                           grouped_matmul_width(cfg),
                                           jnp.dtype(cfg.compute_dtype))
        grouped += f" ({why})"
    dag_module = ex.dag_module
    dag = dag_aggregation_of(cfg.block)
    if (dag is not None and requested is not None and requested.dag_module == "auto"
            and dag_module in DAG_EVIDENCE):
        dag_module += f" ({DAG_EVIDENCE[dag_module]})"
    return (f"attention {attention}, remat {ex.remat}, layers unrolled "
            f"{ex.scan_unroll}/{cfg.num_layers}, loss chunk {ex.loss_chunk} tokens, "
            f"projections {'fused' if ex.fuse_projections else 'separate'}{dispatch}"
            f"{', grouped matmul ' + grouped if dropless else ''}"
            f"{', DAG module ' + dag_module if dag is not None else ''}"
            f"{_mesh_part(layout, experts, dropless, ex)}")


def _mesh_part(layout, experts, dropless: bool, ex) -> str:
    """The mesh's part of :func:`describe`'s line: expert-parallel only where the mesh has an
    expert axis of more than one device."""
    if layout is None:
        return ""
    sizes = dict(layout.axis_sizes)
    if experts is None or sizes.get("expert", 1) == 1:
        return f", mesh {sizes}" + (" (no expert axis: every chip holds every expert)"
                                    if experts is not None else "")
    return (f", expert-parallel over {sizes}"
            f"{' by ' + ex.expert_exchange if dropless else ''}"
            f"{_buffer(experts) if dropless else ''}")


def _buffer(experts) -> str:
    """The exchange buffer's part of :func:`describe`'s line."""
    if experts.exchange_buffer is None:
        return ""
    return (f", receive buffer {experts.exchange_buffer:g}x the balanced share (the "
            f"overflow drops)")
