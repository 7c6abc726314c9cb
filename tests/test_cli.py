"""The command lines' shared behaviour: bad arguments are one line on stderr and exit status 2,
checked in this process through each command's ``main(argv)`` (what its console script or
``python -m`` calls); one subprocess per command checks its ``python -m`` wiring
(test_packaging.py runs the console scripts, test_train.py ``python train.py``).
One argparse class, :class:`dagmoe_jax.command_line.OneLineParser`, turns argparse's errors into
one line for all of them."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dagmoe_jax.command_line import OneLineParser

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ["dagmoe_jax.cli.train", "dagmoe_jax.cli.sample", "dagmoe_jax.cli.analyze",
            "dagmoe_jax.upcycle.__main__", "dagmoe_jax.families.doe.command", "dagmoe_jax.cli.demo"]


def one_line_error(capsys, module: str, argv) -> str:
    code = importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert code == 2, (module, argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (module, argv, err)
    return lines[0]


@pytest.mark.parametrize("module", COMMANDS)
def test_an_unknown_flag_is_one_line(capsys, module):
    line = one_line_error(capsys, module, ["--no_such_flag", "--out=x"])
    assert "--no_such_flag" in line, line


@pytest.mark.parametrize("module, argv, fragment", [
    ("dagmoe_jax.cli.train", ["--mode=bogus"], "invalid choice: 'bogus'"),
    ("dagmoe_jax.cli.train", ["--eval_batches=many"], "invalid int value: 'many'"),
    ("dagmoe_jax.cli.sample", ["--run_dir=x"], "--prompt=TEXT is required"),
    ("dagmoe_jax.cli.sample", ["--run_dir=x", "--prompt=a", "--num_samples=0"],
     "--num_samples=0 is invalid"),
    ("dagmoe_jax.upcycle.__main__", ["--router=oracle"], "invalid choice: 'oracle'"),
    ("dagmoe_jax.upcycle.__main__", ["--dense=a"], "--run_dir is required"),
    ("dagmoe_jax.families.doe.command", [], "the following arguments are required: --out"),
    ("dagmoe_jax.families.doe.command", ["--out=x", "--max_iter=ten"], "invalid int value: 'ten'"),
    ("dagmoe_jax.cli.demo", ["--steps=0"], "--steps=0 is invalid"),
    ("dagmoe_jax.cli.demo", ["--variant=no_such_variant.gin"], "no_such_variant.gin"),
])
def test_bad_values_are_one_line(capsys, module, argv, fragment):
    assert fragment in one_line_error(capsys, module, argv)


def test_one_line_parser_raises_instead_of_exiting():
    parser = OneLineParser(add_help=False)
    parser.add_argument("--n", type=int, default=0)
    assert parser.parse_args(["--n=3"]).n == 3
    with pytest.raises(ValueError, match=r"^argument --n: invalid int value: 'x'$"):
        parser.parse_args(["--n=x"])
    with pytest.raises(ValueError, match=r"^unrecognized arguments: --m$"):
        parser.parse_args(["--m"])


def test_no_command_line_defines_its_own_parser_class():
    """The one-line argparse class lives in dagmoe_jax/command_line.py only."""
    subclasses = []
    for path in sorted((REPO / "dagmoe_jax").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    "ArgumentParser" in ast.unparse(base) for base in node.bases):
                subclasses.append(f"{path.relative_to(REPO)}:{node.name}")
    assert subclasses == ["dagmoe_jax/command_line.py:OneLineParser"]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["dagmoe_jax.cli.train", "dagmoe_jax.cli.sample", "dagmoe_jax.cli.analyze",
                                    "dagmoe_jax.upcycle", "dagmoe_jax.families.doe.command", "dagmoe_jax.cli.demo"])
def test_python_m_wiring(tmp_path, module):
    """``python -m`` runs the command's ``main`` and exits with its status."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", module, "--no_such_flag", "--out=x"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--no_such_flag" in lines[0], \
        result.stderr[-2000:]
    assert not list(tmp_path.iterdir())
