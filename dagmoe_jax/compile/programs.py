"""The run's programs compiled ahead of time for a TPU topology, from a host that owns none.

:func:`compile_run` takes a run's four configs (what ``python train.py`` reads from gin) and
the compile-only devices of a topology (:func:`dagmoe_jax.compile.chips.topology_devices`) and
compiles, with nothing materialised:

* ``train``: the jitted step the training loop runs (``make_train_step`` with the run's
  ``grad_accum``, trainable set and donation), on the model settled for TPU under the run's
  mesh (:func:`dagmoe_jax.model.settle.settle`: remat, scanned layers, splash attention,
  megablox gmm, the ragged all-to-all), its parameters and AdamW state abstract and sharded by
  the mesh rules, the batch sharded over the batch axes as ``run.device_batch`` shards it;
* ``eval``: ``eval_step`` on a replicated batch of ``DataConfig.batch_size`` rows, as the
  evaluator feeds it;
* ``prefill`` and ``decode``: generation's :func:`~dagmoe_jax.decoding.generate.prefill` over
  prompts of ``prompt_len`` tokens and one :func:`~dagmoe_jax.decoding.generate.decode_step`
  against a cache of ``prompt_len + new_tokens`` slots, with generation's dropless dispatch.

Each gives a :class:`ProgramReport`: the compiler's memory analysis per chip, its flops and
bytes, and this library's roofline (:mod:`dagmoe_jax.compile.roofline`) of the compiled HLO.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dagmoe_jax.compile import ptxas
from dagmoe_jax.compile.chips import Chip
from dagmoe_jax.compile.kernel_costs import pallas_gpu_kernels
from dagmoe_jax.compile.roofline import Cost, program_cost
from dagmoe_jax.compile.scopes import (DAG_MODULE, DISPATCH_SCOPE, ScopeCost, dispatch_cost,
                                      has_scope, scope_cost)
from dagmoe_jax.config import ExecutionConfig, ModelConfig, experts_of
from dagmoe_jax.kernels.gpu_grouped_matmul import mosaic_gpu_target
from dagmoe_jax.data import DataConfig
from dagmoe_jax.decoding.generate import DEFAULT_DISPATCH, decode_step, prefill
from dagmoe_jax.data.batch import MODEL_INPUTS
from dagmoe_jax.model import Transformer
from dagmoe_jax.run.extensions import extension_for
from dagmoe_jax.model.accounting import account
from dagmoe_jax.model.routed.expert_parallel import dispatch_axes
from dagmoe_jax.parallel import activate
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.parallel.state import batch_shards, batch_sharding
from dagmoe_jax.run.config import OptimConfig, RunConfig
from dagmoe_jax.run.optim import TRAINABLE
from dagmoe_jax.run.state import build
from dagmoe_jax.evaluation import eval_step
from dagmoe_jax.train.step import make_train_step

PROGRAMS = ("train", "eval", "prefill", "decode")


class OutOfMemory(ValueError):
    """A program does not fit its chip's HBM (the compiler's word, or the memory analysis)."""


@dataclasses.dataclass
class ProgramReport:
    """One compiled program, per chip (bytes, FLOPs, seconds)."""

    name: str
    compile_seconds: float
    tokens: int                  # tokens the program processes, all chips together
    state_bytes: float           # parameters (+ optimizer state for train) on one chip
    argument_bytes: float
    output_bytes: float
    alias_bytes: float
    temp_bytes: float
    code_bytes: float
    compiler_flops: float
    compiler_bytes: float
    model_flops: float           # model.accounting's FLOPs per chip (train: 3x forward)
    cost: Cost
    hlo: str = dataclasses.field(repr=False, default="")
    dag_module: Optional[ScopeCost] = None    # the DAG module's share (compile/scopes.py)
    dispatch: Optional[ScopeCost] = None      # the routed experts' less their products
    # GPU: each kernel as ptxas assembled it; the Pallas Triton kernels' threads (the HLO's)
    kernel_resources: Dict[str, ptxas.KernelResources] = dataclasses.field(default_factory=dict)
    pallas_kernels: Dict[str, Optional[int]] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        """HBM a chip holds at the program's peak: its arguments, temporaries, the outputs
        that do not overwrite an argument, and its code."""
        return (self.argument_bytes + self.temp_bytes + self.code_bytes
                + max(self.output_bytes - self.alias_bytes, 0.0))

    def as_dict(self, chip: Chip) -> dict:
        seconds = self.cost.seconds
        return {
            "compile_seconds": round(self.compile_seconds, 1),
            "tokens": self.tokens,
            "memory_per_chip": {
                "state": self.state_bytes, "arguments": self.argument_bytes,
                "outputs": self.output_bytes, "aliased": self.alias_bytes,
                "temporaries": self.temp_bytes, "code": self.code_bytes,
                "total": self.total_bytes, "hbm": chip.hbm_bytes,
                "fits": self.total_bytes <= chip.hbm_bytes},
            "flops_per_chip": {"model": self.model_flops, "compiler": self.compiler_flops,
                               "roofline_matmul": self.cost.matmul_flops},
            "bytes_accessed_per_chip": {"compiler": self.compiler_bytes,
                                        "roofline_hbm": self.cost.hbm_bytes},
            "collectives": self.cost.collectives,
            "kernels": self.cost.kernels,
            "estimate": {"seconds": seconds, "compute_seconds": self.cost.compute_seconds,
                         "collective_seconds": self.cost.collective_seconds,
                         "offload_seconds": self.cost.offload_seconds,
                         "overlapped_seconds": self.cost.overlapped_seconds,
                         "tokens_per_second": self.tokens / seconds if seconds else 0.0,
                         "mfu": (self.model_flops / (seconds * chip.peak_flops)
                                 if seconds else 0.0)},
            "slowest": [[s, what] for s, what in self.cost.slowest],
            "dag_module": (None if self.dag_module is None else
                           {**dataclasses.asdict(self.dag_module),
                            "seconds_at_peak": self.dag_module.at_peak(chip)}),
            "dispatch": (None if self.dispatch is None else dataclasses.asdict(self.dispatch)),
            "kernel_resources": ptxas.as_dicts(self.kernel_resources, self.pallas_kernels),
        }


def state_bytes_per_chip(obj) -> float:
    """Bytes of an abstract (sharded) NNX object's arrays that one chip holds."""
    total = 0.0
    for leaf in jax.tree.leaves(nnx.state(obj)):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _batch(model_cfg: ModelConfig, mesh, rows: int, seq: int, replicated: bool,
           mask: bool) -> dict:
    """An abstract batch as the loop feeds the model: rows over the batch axes, or (an
    evaluation batch) replicated; with the family's per-token annotations."""
    sharding = (NamedSharding(mesh, PartitionSpec()) if replicated
                else batch_sharding(mesh, 2))
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=sharding)
    batch = {"inputs": tokens, "targets": tokens}
    if mask:
        batch["mask"] = jax.ShapeDtypeStruct((rows, seq), jnp.bool_, sharding=sharding)
    for key in extension_for(model_cfg).batch_keys:
        if key not in MODEL_INPUTS:
            batch[key] = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=sharding)
    return batch


_OOM = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory|Used [\d.]+[GMK] of", re.IGNORECASE)


@contextlib.contextmanager
def _tracing_for(chip: Chip, device) -> Iterator[None]:
    """Trace for ``chip`` from this host: on a GPU target, JAX's default device is the
    target's (Pallas Triton kernels lower for the default device) and the Mosaic GPU weight
    gradient sizes its grid for the target's SMs; a TPU needs nothing."""
    if chip.platform != "gpu":
        yield
        return
    with jax.default_device(device), mosaic_gpu_target(chip.sm_count):
        yield


def _compile(name: str, lowered_fn: Callable, chip: Chip, device=None):
    """(compiled, seconds, {kernel: its ptxas resources} on a GPU, else {}) or
    :class:`OutOfMemory` with the compiler's figures; ``device``: one of the target's devices
    (:func:`_tracing_for`)."""
    tick = time.perf_counter()
    try:
        with _tracing_for(chip, device), (
                ptxas.recorded() if chip.platform == "gpu" else contextlib.nullcontext({})
        ) as resources:
            compiled = lowered_fn().compile()
    except Exception as err:      # XLA's errors are JaxRuntimeError / XlaRuntimeError
        text = str(err)
        if _OOM.search(text):
            # XLA:TPU: "the total memory required for HLO temporaries (256.96G) exceeds
            # available HBM (95.74G)", or "Used 120.5G of 95.7G hbm"
            scale = {"G": 2 ** 30, "M": 2 ** 20, "K": 2 ** 10}
            used = (re.search(r"required for [^(]*\(([\d.]+)([GMK])\)", text)
                    or re.search(r"Used ([\d.]+)([GMK]) of", text))
            need = (float(used.group(1)) * scale[used.group(2)]) if used else None
            raise OutOfMemory(name, need, text.strip().splitlines()[0][:300]) from None
        raise
    return compiled, time.perf_counter() - tick, resources


def gmm_occupancy(cfg: ModelConfig, mesh, tokens: int) -> float:
    """The expected share of a grouped matmul's rows that hold tokens
    (:mod:`~dagmoe_jax.compile.roofline`, "Grouped matmuls"): ``1 / E`` for dropless dispatch
    across ``E`` expert shards, whose receive buffers are sized for every token of the expert
    group, ``1 / f`` when ``ExpertConfig.exchange_buffer`` f < E bounds them to f times the
    balanced share (the ragged exchange of the accelerators this tool compiles for); 1
    otherwise (no expert axis, capacity dispatch, or a token count the token axes do not
    divide, which falls back to the global-view dispatch)."""
    layout = MeshLayout.of(mesh)
    experts = experts_of(cfg.block)
    if layout is None or experts is None or experts.dispatch != "dropless":
        return 1.0
    token_axes, experts, _ = dispatch_axes(layout)
    if not experts or tokens % layout.size(token_axes):
        return 1.0
    shards = layout.size(experts)
    buffer = experts_of(cfg.block).exchange_buffer
    return 1.0 / (shards if buffer is None else min(buffer, shards))


def _report(name: str, compiled, seconds: float, tokens: int, state: float, model_flops: float,
            chip: Chip, devices: Sequence, keep_hlo: bool,
            occupancy: float = 1.0, resources=None) -> ProgramReport:
    memory = compiled.memory_analysis()
    analysis = compiled.cost_analysis() or {}
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    text = compiled.as_text()
    slices = [getattr(d, "slice_index", 0) or 0 for d in devices]
    cost = program_cost(text, chip, len(devices), slices if len(set(slices)) > 1 else None,
                        gmm_occupancy=occupancy)
    return ProgramReport(
        name=name, compile_seconds=seconds, tokens=tokens, state_bytes=state,
        argument_bytes=float(memory.argument_size_in_bytes),
        output_bytes=float(memory.output_size_in_bytes),
        alias_bytes=float(memory.alias_size_in_bytes),
        temp_bytes=float(memory.temp_size_in_bytes),
        code_bytes=float(memory.generated_code_size_in_bytes),
        compiler_flops=float(analysis.get("flops", 0.0)),
        compiler_bytes=float(analysis.get("bytes accessed", 0.0)),
        model_flops=model_flops, cost=cost, hlo=text if keep_hlo else "",
        dag_module=scope_cost(text, chip) if has_scope(text, DAG_MODULE) else None,
        dispatch=(dispatch_cost(text, chip, len(devices))
                  if has_scope(text, DISPATCH_SCOPE) else None),
        kernel_resources=dict(resources or {}), pallas_kernels=pallas_gpu_kernels(text))


def cudnn_missing() -> bool:
    """Whether cuDNN cannot be loaded in this process (no GPU machine: the CUDA plugin is
    installed without its nvidia-* wheels)."""
    try:
        from jax._src.lib import cuda_versions
        return cuda_versions is None or not cuda_versions.cudnn_get_version()
    except Exception:
        return True


def deviceless_execution(run_cfg: RunConfig, chip: Chip, one_device: bool,
                         log: Callable[[str], None] = lambda _m: None) -> RunConfig:
    """``run_cfg`` as it can be compiled for ``chip`` from this host: for a GPU target
    without cuDNN here, attention that would settle to cuDNN's flash kernel ('auto' or
    'cudnn'; cuDNN builds its kernels at compile time from the library itself) is compiled as
    the Pallas Triton flash kernel on one device (the same algorithm, no cuDNN), as XLA's
    under a mesh; ``log`` says which. Anything else unchanged."""
    ex = run_cfg.execution
    if chip.platform != "gpu" or ex.attention not in ("auto", "cudnn") or not cudnn_missing():
        return run_cfg
    stand_in = "triton" if one_device else "xla"
    log(f"attention compiled as {'the Pallas Triton flash kernel' if one_device else 'XLA'}'s"
        f" in cuDNN's place: cuDNN's flash attention needs the cuDNN library at compile time, "
        f"which a host without a GPU lacks (a GPU run settles to it)")
    return dataclasses.replace(run_cfg, execution=dataclasses.replace(ex, attention=stand_in))


@dataclasses.dataclass(frozen=True)
class GenerationShape:
    """The generation programs' shapes: ``batch`` prompts of ``prompt_len`` tokens, a cache of
    ``prompt_len + new_tokens`` slots."""

    batch: int = 8
    prompt_len: int = 1024
    new_tokens: int = 1024


def compile_run(model_cfg: ModelConfig, data_cfg: DataConfig, optim_cfg: OptimConfig,
                run_cfg: RunConfig, mesh, chip: Chip, *,
                programs: Sequence[str] = PROGRAMS,
                generation: GenerationShape = GenerationShape(),
                keep_hlo: bool = False,
                log: Callable[[str], None] = lambda _m: None
                ) -> Tuple[ExecutionConfig, Dict[str, ProgramReport]]:
    """(the settled execution config, {program name: its report}) for ``programs`` of the run on
    ``mesh`` (a ``Mesh`` over a topology's compile-only devices). Raises :class:`OutOfMemory`
    for a program the compiler cannot fit, ``ValueError`` for an impossible configuration."""
    unknown = set(programs) - set(PROGRAMS)
    if unknown:
        raise ValueError(f"unknown program {sorted(unknown)[0]!r}: expected some of {PROGRAMS}")
    devices = list(mesh.devices.flat)
    chips = len(devices)
    run_cfg = deviceless_execution(run_cfg, chip, chips == 1, log)
    shards = batch_shards(mesh)      # (grad_accum's split is checked by the step itself)
    if data_cfg.batch_size % shards:
        raise ValueError(f"DataConfig.batch_size={data_cfg.batch_size} does not split over the "
                         f"{shards} chips of the batch mesh axes: use a multiple of {shards}")
    model, optimizer, _ = build(model_cfg, optim_cfg, run_cfg, mesh, backend=chip.platform,
                                abstract=True)
    cfg = model_cfg
    params = state_bytes_per_chip(model)
    acc = account(cfg, data_cfg.seq_len)
    reports: Dict[str, ProgramReport] = {}
    rows, seq = data_cfg.batch_size, data_cfg.seq_len
    train_tokens = rows * seq
    if "train" in programs:
        log(f"compiling the training step ({rows} x {seq} tokens, grad_accum "
            f"{run_cfg.grad_accum})...")
        step = make_train_step(grad_accum=run_cfg.grad_accum,
                               wrt=TRAINABLE[run_cfg.trainable], donate=True)
        batch = _batch(cfg, mesh, rows, seq, replicated=False, mask=False)
        with activate(mesh):
            compiled, secs, resources = _compile(
                "train", lambda: step.lower(model, optimizer, batch), chip, devices[0])
        reports["train"] = _report(
            "train", compiled, secs, train_tokens,
            params + state_bytes_per_chip(optimizer),
            acc.train_flops_per_token * train_tokens / chips, chip, devices, keep_hlo,
            gmm_occupancy(cfg, mesh, train_tokens // run_cfg.grad_accum), resources)
    if "eval" in programs:
        log(f"compiling the evaluation step ({rows} x {seq} tokens, replicated)...")
        batch = _batch(cfg, mesh, rows, seq, replicated=True, mask=True)
        with activate(mesh):
            compiled, secs, resources = _compile(
                "eval", lambda: eval_step.lower(model, batch), chip, devices[0])
        reports["eval"] = _report("eval", compiled, secs, train_tokens, params,
                                  acc.train_flops_per_token / 3 * train_tokens / chips, chip,
                                  devices, keep_hlo, gmm_occupancy(cfg, mesh, train_tokens),
                                  resources)
    if "prefill" in programs or "decode" in programs:
        reports.update(_compile_generation(model, mesh, chip, generation, programs, params,
                                           devices, keep_hlo, log))
    return model.execution, reports


def _compile_generation(model, mesh, chip, shape: GenerationShape, programs, params,
                        devices, keep_hlo, log) -> Dict[str, ProgramReport]:
    """Prefill and one decode step with generation's dropless dispatch (same parameters)."""
    settled = model.cfg
    if extension_for(settled).batch_keys:
        log("generation programs skipped: this block family decodes with tracked features")
        return {}
    cfg = (settled if experts_of(settled.block) is None
           else settled.replace(block=dict(experts=dict(dispatch=DEFAULT_DISPATCH))))
    graphdef = nnx.graphdef(nnx.eval_shape(
        lambda: Transformer(cfg, execution=model.execution, rngs=nnx.Rngs(0),
                            layout=MeshLayout.of(mesh))))
    state = nnx.state(model)
    b, p = shape.batch, shape.prompt_len
    cache_len = p + shape.new_tokens - 1
    if cache_len > settled.max_seq_len:
        raise ValueError(f"generation of {p} + {shape.new_tokens} tokens exceeds "
                         f"ModelConfig.max_seq_len={settled.max_seq_len}: lower --prompt_len "
                         f"or --new_tokens")
    replicated = NamedSharding(mesh, PartitionSpec())
    acc = account(cfg, cache_len)
    forward_per_token = acc.train_flops_per_token / 3
    out: Dict[str, ProgramReport] = {}
    tokens = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=replicated)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=replicated)

    def run_prefill(state, tokens, lengths):
        return prefill(nnx.merge(graphdef, state), tokens, lengths, None, cache_len=cache_len)

    if "prefill" in programs:
        log(f"compiling generation's prefill ({b} x {p} tokens)...")
        with activate(mesh):
            compiled, secs, resources = _compile("prefill", lambda: jax.jit(run_prefill).lower(
                state, tokens, lengths), chip, devices[0])
        out["prefill"] = _report("prefill", compiled, secs, b * p, params,
                                 forward_per_token * b * p / len(devices), chip, devices,
                                 keep_hlo, gmm_occupancy(cfg, mesh, b * p), resources)
    if "decode" in programs:
        log(f"compiling one decode step ({b} rows against {cache_len} cache slots)...")
        with activate(mesh):
            cache = jax.eval_shape(lambda s, t, n: run_prefill(s, t, n)[1], state, tokens,
                                   lengths)
            cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                sharding=replicated), cache)
            tok = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=replicated)

            def run_decode(state, tok, cache, start):
                return decode_step(nnx.merge(graphdef, state), tok, cache, start)

            compiled, secs, resources = _compile(
                "decode", lambda: jax.jit(run_decode, donate_argnums=2).lower(
                    state, tok, cache, lengths), chip, devices[0])
        out["decode"] = _report("decode", compiled, secs, b, params,
                                forward_per_token * b / len(devices), chip, devices, keep_hlo,
                                gmm_occupancy(cfg, mesh, b), resources)
    return out
