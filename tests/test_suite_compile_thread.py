"""The suite's own set-up (conftest.py): XLA compiles on the thread with the large stack."""

import threading

import jax
import jax.numpy as jnp
from jax._src import compiler

import conftest


def test_xla_compiles_on_the_big_stack_thread():
    """conftest.py moves XLA:CPU's compile off the 8 MiB main stack; if JAX renamed or inlined
    the function it replaces, this fails instead of the workers silently crashing again."""
    cell = compiler.backend_compile_and_load.__closure__[0]
    real, seen = cell.cell_contents, []

    def spy(*args, **kwargs):
        seen.append(threading.current_thread())
        return real(*args, **kwargs)

    cell.cell_contents = spy
    try:
        assert float(jax.jit(lambda x: x * 7.0 - 2.0)(jnp.ones(3)).sum()) == 15.0
    finally:
        cell.cell_contents = real
    assert seen and all(t is conftest._compile_thread for t in seen)


def test_compile_errors_reach_the_asking_thread():
    """An error raised while compiling is raised where the program was asked for."""
    class Boom(Exception):
        pass

    def fail(*args, **kwargs):
        raise Boom("from the compile thread")

    wrapped = conftest._compile_on_the_big_stack(fail)
    try:
        wrapped()
    except Boom as err:
        assert "compile thread" in str(err)
    else:
        raise AssertionError("the compile error was lost")
