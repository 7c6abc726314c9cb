"""pyproject.toml: the pins agree with requirements.txt, every package and gin file ships, and
the console scripts work from another directory on the installed layout.

The installed layout is built with setuptools' ``build_py`` from pyproject.toml into a temporary
directory (what ``pip install .`` copies into site-packages; no download, no wheel package
needed), and the console scripts' targets are run from an unrelated working directory with only
that layout importable. A real install, measured at about 3 s (``python -m venv
--system-site-packages /tmp/v && /tmp/v/bin/pip install -e . --no-deps``), needs setuptools
fetched into pip's isolated build environment, so the suite does not run it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dagmoe_jax.run.gin import load_configs

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "DAGMOE_TCMALLOC": "0"}


def _pins(lines):
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)==(\S+)", line).groups()
            out[name.lower().replace("_", "-")] = version
    return out


def test_pins_match_requirements():
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    requirements = _pins((REPO / "requirements.txt").read_text().splitlines())
    declared = _pins(project["dependencies"] + extras["dev"])
    assert declared == requirements
    peer = _pins((REPO / "benchmarks/requirements-peer.txt").read_text().splitlines())
    assert _pins(extras["peer"]) == peer
    assert _pins(extras["gpu"]) == {"jax[cuda13]": requirements["jax"]}
    # requirements-tpu.txt: the deviceless compilers, TPU (the [tpu] extra) and, through
    # requirements-gpu-compile.txt, CUDA 13: the plain plugin (no [with-cuda] extra: no nvidia-*)
    tpu = (REPO / "requirements-tpu.txt").read_text().splitlines()
    assert "-r requirements-gpu-compile.txt" in tpu
    tpu = _pins(line for line in tpu if not line.startswith("-r "))
    assert _pins(extras["tpu"]) == tpu == {"jax[tpu]": requirements["jax"]}
    gpu_compile = _pins((REPO / "requirements-gpu-compile.txt").read_text().splitlines())
    assert {name: gpu_compile[name] for name in gpu_compile if name != "absl-py"} == {
        "jax-cuda13-plugin": requirements["jax"], "jax-cuda13-pjrt": requirements["jax"]}
    assert "wandb" in _pins(extras["wandb"]) and "wandb" not in requirements
    # the harness extra brings IFEval's checkers too (lm-eval's own [ifeval] extra)
    assert _pins(extras["harness"]) == {"lm-eval[ifeval]": requirements["lm-eval"]}


def test_every_package_and_config_dir_is_listed():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts)
             for p in (REPO / "dagmoe_jax").rglob("__init__.py")}
    found |= {"dagmoe_jax.configs" + "".join("." + part for part in p.relative_to(REPO / "configs").parts)
              for p in [REPO / "configs", *(d for d in (REPO / "configs").rglob("*") if d.is_dir())]}
    assert found == listed


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package as ``pip install .`` lays it out, built from pyproject.toml."""
    root = tmp_path_factory.mktemp("install")
    (root / "egg").mkdir()
    subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                    "egg_info", "--egg-base", str(root / "egg"),
                    "build_py", "--build-lib", str(root / "lib")],
                   cwd=REPO, check=True, capture_output=True, env=ENV, timeout=120)
    return root / "lib"


def _run_installed(installed: Path, cwd: Path, code: str, *args: str):
    env = {**ENV, "PYTHONPATH": str(installed)}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_gin_files_ship_as_package_data(installed, tmp_path):
    shipped = sorted(p.relative_to(installed / "dagmoe_jax/configs").as_posix()
                     for p in (installed / "dagmoe_jax/configs").rglob("*.gin"))
    in_repo = sorted(p.relative_to(REPO / "configs").as_posix()
                     for p in (REPO / "configs").rglob("*.gin"))
    assert shipped == in_repo
    assert (installed / "dagmoe_jax/kernels/causal_attention.cc").is_file()
    assert (installed / "dagmoe_jax/kernels/grouped_matmul.cc").is_file()
    assert (installed / "dagmoe_jax/kernels/cpu_common.h").is_file()
    # From a directory with no configs/, the shipped files resolve (and their includes).
    code = ("import dagmoe_jax.run.gin as g, sys; "
            "m, d, o, t = g.load_configs(['models/s.gin', 'configs/train/smoke.gin']); "
            "print(g.CONFIG_DIR); print(m.d_model, t.steps)")
    result = _run_installed(installed, tmp_path, code)
    assert result.returncode == 0, result.stderr
    config_dir, numbers = result.stdout.split("\n")[:2]
    assert Path(config_dir) == installed / "dagmoe_jax" / "configs"
    model, _, _, train = load_configs(["models/s.gin", "configs/train/smoke.gin"])
    assert numbers.split() == [str(model.d_model), str(train.steps)]


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(PYPROJECT["project"]["scripts"]))
def test_console_scripts_from_another_directory(installed, tmp_path, script):
    """What the console-script wrapper pip writes does: import the target, exit with it."""
    module, function = PYPROJECT["project"]["scripts"][script].split(":")
    code = f"import sys; from {module} import {function}; sys.exit({function}())"
    result = _run_installed(installed, tmp_path, code, "--help")
    assert result.returncode == 0, result.stderr
    # every command reads a run directory, but the compiler, which reads train.py's gin, and
    # DoE's Stage 1, which writes a topic model from train.py's gin
    own = {"dagmoe-compile": "--topology", "dagmoe-topics": "--out"}
    assert own.get(script, "--run_dir") in result.stdout
    bad = _run_installed(installed, tmp_path, code, "--no_such_flag")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")
    assert not list(tmp_path.iterdir())           # nothing written where it was run
