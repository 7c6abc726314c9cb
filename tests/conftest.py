"""Shared helpers for the CPU test suite: tiny configurations and float32-exact matmuls."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Almost all of this suite's time is XLA compiling tiny programs; LLVM's optimisation passes are
# about half of that on CPU. Level 0 halves the suite's wall time and changes no float semantics
# (XLA CPU does not enable fast-math either way). It must be set before JAX starts its backend,
# hence here, before any test runs. Set DAGMOE_TEST_XLA_OPT=1 (or put your own
# --xla_backend_optimization_level in XLA_FLAGS) to test with the default optimisation.
if (os.environ.get("DAGMOE_TEST_XLA_OPT", "0") != "1"
        and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()
# Eight simulated CPU devices for the sharding tests (tests/test_parallel.py): every other test
# runs on the first device as before (JAX's default device), unaffected by the other seven.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# One persistent JAX compilation cache for the whole run: both xdist workers and every
# subprocess they start (train.py, the commands, the benchmarks) share it, so a program that
# many tests compile (the smoke run's training step) is compiled once per run, not once per
# process (a train.py of train/smoke.gin starts in 9 s instead of 24). Fresh for each run, so
# the suite times what CI times: made here by the process pytest started (xdist's workers,
# started after this file is read, inherit the variable) and removed when its session ends
# (pytest_sessionfinish). Set JAX_COMPILATION_CACHE_DIR to choose one (it is then kept).
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="dagmoe-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
# JAX caches only programs that took a second or more to compile by default; most of this suite's
# take 0.1-1 s (a smoke run's init and eval steps, the tiny models' forward and gradient
# programs, which fresh models of one structure compile again in the same process) and were
# compiled again by every process and test that needed them. Caching every program over 0.1 s
# cut the subprocess-heavy files (test_train, test_usability, test_finetune) by a quarter; it
# changes no program.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

# With libtpu installed (.ci/run installs it for tests/test_compile.py) JAX would look for a
# TPU on this machine, and libtpu print a multi-line error on every start; the suite runs on
# the CPU, and compiles for TPU topologies through dagmoe_jax.compile (compile-only devices).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The test processes themselves read that cache but write nothing to it; the subprocesses they
# start (the environment above) still write. Writing serialises the XLA:CPU executable, and
# that serialisation (jax 0.11.2) crashed a pytest worker with a segmentation fault in two
# full runs out of four (both times a training step of part of the parameters, in
# tests/test_upcycle.py and tests/test_upcycle_dag.py; neither reproduced alone), which took
# the whole run down with it.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)

from flax import nnx  # noqa: E402

# A test whose xdist worker crashed runs once more (tests/rerun_crashed.py)
pytest_plugins = ["rerun_crashed"]

# Python's cyclic collector walks every tracked object at each full collection, and tracing and
# lowering allocate objects by the million: the modules loaded by now (JAX, Flax, NumPy) are
# frozen out of its walks, and a young collection waits for 50,000 allocations instead of 700
# (an old one, far longer). It still runs, so cycles are freed; tests/test_model.py and
# test_dag.py took 0.88-0.95x the time on the 2-core machine. It changes no computation.
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 50, 100)

from dagmoe_jax.config import ExecutionConfig, ModelConfig  # noqa: E402
from dagmoe_jax.model import Transformer  # noqa: E402
from dagmoe_jax.model.settle import settle  # noqa: E402

# Some backends run float32 matmuls at reduced precision by default (TF32 / bf16 passes on GPU and
# TPU); the oracle comparisons (1e-5 relative) need true float32 products wherever they run.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_sessionfinish(session, exitstatus):
    """The run's compilation cache, made above, goes with the run (in the process that made
    it: the xdist controller, or pytest itself without workers)."""
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def single_device_env(**extra: str) -> dict:
    """This environment for a subprocess (train.py, a command, a benchmark), minus the simulated
    devices set above: one CPU device, as on a user's machine (on the eight, a train.py smoke
    run shards eight ways, at 1.8x the time); the XLA optimisation level and the compilation
    cache stay as the suite set them. ``extra``: more variables."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), **extra}


def benchmark_command(name: str, *args: str) -> list:
    """``python -m benchmarks.NAME ARGS``, a benchmark as its users start it; from a directory
    other than the repository root with :func:`repository_importable`'s environment."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def repository_importable(env: dict) -> dict:
    """``env`` with the repository root first on ``PYTHONPATH``: a child process started in
    another directory imports the benchmarks package as one started in the root does."""
    paths = [str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def build_once(tmp_path_factory, name: str, build):
    """``build(directory)``'s result (JSON-able), built once for the whole run: under xdist by
    the first worker that asks, the others waiting on a file lock and reading it back
    (pytest-xdist's recipe for a fixture that should run once); without xdist, here. What
    ``build`` writes in ``directory`` is shared by every worker's tests: they must only read
    it (copy it to change it). A module fixture that builds a run takes 15-30 s, which each
    worker running one of its tests would otherwise pay again."""
    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent          # shared by every worker of the run
    directory, done = root / f"shared-{name}", root / f"shared-{name}.json"
    with FileLock(str(root / f"shared-{name}.lock")):
        if done.is_file():
            return json.loads(done.read_text())
        directory.mkdir(exist_ok=True)
        value = build(directory)
        done.write_text(json.dumps(value))
        return value


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory):
    """``stdlib_corpus(folder)`` puts the standard-library docstring corpus in ``folder`` as
    ``benchmarks.experiments.corpus.build_stdlib_corpus(folder)`` leaves it (its two text files
    and the JSON that names them), built once for the whole run (:func:`build_once`) and copied
    there.
    A benchmark started with ``folder`` as its corpus directory reuses it, as it reuses a
    corpus it built itself, instead of parsing the standard library again (3-7 s a build,
    four benchmark micro runs)."""

    from benchmarks.experiments.corpus import build_stdlib_corpus

    shared = Path(build_once(tmp_path_factory, "stdlib_corpus",
                             lambda directory: build_stdlib_corpus(directory).train_path)).parent

    def copy_to(folder) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        info = json.loads((shared / "stdlib_docstrings.json").read_text())
        for key in ("train_path", "heldout_path"):
            info[key] = str(shutil.copy(info[key], folder))
        (folder / "stdlib_docstrings.json").write_text(json.dumps(info, indent=1))
        return folder

    return copy_to


def tiny_config(block: str = "moe", kind: str = "sum", **overrides) -> ModelConfig:
    """A model small enough to compile in a few seconds and run in milliseconds on 2 CPU cores.

    d_model 32, 2 layers, 4 heads over 2 KV heads (GQA), vocab 64, 4 experts with top-2,
    DAG/MLP hidden 16 with 2 iterations. The dense FFN (and DoE's output FFN) is 64 wide. The
    block family's parts are given by the part they configure, as dicts of their fields:
    ``router=``, ``experts=``, ``aggregation=`` (MoE, CoE), ``coe=`` (the chain's own fields),
    ``doe=`` and ``ffn_hidden=`` (dense); the parts another family has are ignored. How it
    runs is :func:`tiny_execution`'s (:func:`make_model` builds it).
    """
    base = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       max_seq_len=64)
    parts = {"router": {"top_k": 2, **overrides.pop("router", {})},
             "experts": {"num_experts": 4, "expert_hidden": 32, "shared_hidden": 32,
                         **overrides.pop("experts", {})},
             "aggregation": {"kind": kind, "dag_dim": 16, "dag_iters": 2,
                             **overrides.pop("aggregation", {})},
             "ffn_hidden": overrides.pop("ffn_hidden", 64),
             **overrides.pop("coe", {}), **overrides.pop("doe", {})}
    base = base.replace(block=block)          # the family at its defaults (a bad name: one line)
    own = {f.name for f in dataclasses.fields(base.block) if f.init}
    return base.replace(block={k: v for k, v in parts.items() if k in own}, **overrides)


def tiny_execution(cfg: ModelConfig, layout=None, **fields) -> ExecutionConfig:
    """How the tests run ``cfg``: ``ExecutionConfig(**fields)`` settled for one device of this
    backend (or ``layout``), as a run settles it. Attention 'auto' is the fused C++ kernel here
    (CPU, float32, single device) and blockwise under a mesh; ``attention_block`` 8 (unless
    given) is smaller than the test sequence lengths (16-32), so the blockwise attention really
    runs block by block (test_kernels.py compares the two on the whole model)."""
    return settle(cfg, ExecutionConfig(**{"attention_block": 8, **fields}), layout=layout)


def make_model(cfg: ModelConfig, *, seed: int = 0, layout=None, **execution):
    """``Transformer(cfg)`` initialised from ``seed``, run as :func:`tiny_execution` settles
    ``execution`` (``ExecutionConfig`` fields) for it, its dispatch over ``layout``."""
    return Transformer(cfg, execution=tiny_execution(cfg, layout, **execution),
                       rngs=nnx.Rngs(seed), layout=layout)


@pytest.fixture
def tiny():
    """The :func:`tiny_config` helper as a fixture (for tests that prefer not to import it)."""
    return tiny_config


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def np_grouped_matmul(lhs, rhs, sizes):
    """``jax.lax.ragged_dot`` in NumPy (float64), the grouped matmuls' oracle: group g's rows
    times rhs[g], rows past the groups zero."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g]
        start += size
    return out


def write_byte_level_tokenizer(folder, eos: str = "</s>", model_max_length: int = 2048):
    """A Hugging Face byte-level tokenizer in ``folder``: ``tokenizer.json`` whose ids 0-255 are
    the utf-8 bytes (GPT-2's byte alphabet, no merges), ``eos`` the special token 256 and no
    BOS, and a ``tokenizer_config.json`` telling ``AutoTokenizer`` the same (the harness tests
    read it with the library's ``DataConfig(tokenizer='hf')`` and with transformers). Returns
    the path of tokenizer.json."""
    import json
    from pathlib import Path

    from tokenizers import AddedToken

    from dagmoe_jax.hf.tokenizer import byte_level_tokenizer

    tok = byte_level_tokenizer()
    tok.add_special_tokens([AddedToken(eos, special=True)])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length}, indent=2) + "\n")
    return folder / "tokenizer.json"


# The tokenizer kinds that change how lm-eval's hf model turns text into ids (HFLM's BOS and
# EOS handling): tests/test_harness_hf.py scores each against it, tests/test_harness.py checks
# the same ids without torch.
SPECIAL_TOKENIZER_KINDS = ("no_bos", "bos_added", "bos_named", "eos_ids")


def write_special_tokenizer(folder, kind: str, model_max_length: int = 2048):
    """A byte-level Hugging Face tokenizer of ``kind`` in ``folder``; returns tokenizer.json.

    Ids 0-255 are the utf-8 bytes; ``</s>`` = 256 (EOS), ``<s>`` = 257 and ``<|eot|>`` = 258 are
    special tokens. ``no_bos``: no BOS named. ``bos_added``: ``<s>`` named BOS and added by
    the tokenizer.json's post-processor (as Llama 3's: no ``add_bos_token``, the file decides).
    ``bos_named``: ``<s>`` named BOS, not added. ``eos_ids``: as ``no_bos``, with a
    ``generation_config.json`` listing 256 and 258 as EOS ids."""
    import json
    from pathlib import Path

    from tokenizers import AddedToken, processors

    from dagmoe_jax.hf.tokenizer import byte_level_tokenizer

    if kind not in SPECIAL_TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    tok = byte_level_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("</s>", "<s>", "<|eot|>")])
    if kind == "bos_added":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 257)])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
              "clean_up_tokenization_spaces": False, "model_max_length": model_max_length}
    if kind in ("bos_added", "bos_named"):
        config["bos_token"] = "<s>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if kind == "eos_ids":
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [256, 258]}) + "\n")
    return folder / "tokenizer.json"
