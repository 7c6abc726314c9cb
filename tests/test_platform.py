"""``import dagmoe_jax`` on a host without an accelerator (dagmoe_jax/platform.py; issue 69,
item 5): the library works quietly in the environment README's test set-up builds, where the
CUDA compiler plugin and libtpu are installed beside JAX (CI installs both): no plugin's
traceback or warnings at the first computation, the CPU chosen; and nothing is changed where
the user chose, or where an accelerator is visible."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from dagmoe_jax import platform

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = """if True:
    import dagmoe_jax, jax, jax.numpy as jnp
    from flax import nnx
    from dagmoe_jax.model import Transformer
    cfg = dagmoe_jax.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                                 num_kv_heads=2, max_seq_len=32)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((1, 8), jnp.int32))[0]
    print(jax.default_backend(), logits.shape)
"""


def _user_env() -> dict:
    """The environment of a user's Python: no JAX_PLATFORMS, no simulated devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return {**env, "PYTHONPATH": str(REPO)}


def test_the_library_from_python_is_quiet_where_there_is_no_accelerator():
    plugins = [name for name in ("jax_plugins.xla_cuda13", "libtpu")
               if importlib.util.find_spec(name) is not None]
    result = subprocess.run([sys.executable, "-c", NOTEBOOK], capture_output=True, text=True,
                            env=_user_env(), cwd="/", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["cpu", "(1,", "8,", "64)"], (result.stdout, plugins)
    for noise in ("Traceback", "cuDNN", "TPU_WORKER_HOSTNAMES", "libtpu", "WARNING"):
        assert noise not in result.stderr, (noise, plugins, result.stderr[-2000:])


def test_a_choice_made_elsewhere_is_left_alone(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")               # the user's
    assert not platform.cpu_where_no_accelerator()
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(platform, "accelerator_visible", lambda: True)
    assert not platform.cpu_where_no_accelerator()
    assert "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(platform, "accelerator_visible", lambda: False)
    # JAX is loaded and its backends started in this process: left alone too
    assert not platform.cpu_where_no_accelerator()
