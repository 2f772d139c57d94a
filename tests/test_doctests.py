"""The docstring examples of every module of the package run, and print what they say.

Each module's examples run in the module's own namespace plus the usual imports (``jax``,
``jnp``, ``np``, ``optax``, ``functools``, ``ozo``); the 8 simulated devices of ``conftest.py``
are there. An example that needs what a test cannot have (other processes, a user's module) is
marked ``# doctest: +SKIP`` in place.
"""

import doctest
import functools
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_zero_one

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(optax_zero_one.__path__, "optax_zero_one.")
    if not m.ispkg or m.name != "optax_zero_one"
)
EXTRA = dict(
    jax=jax,
    jnp=jnp,
    np=np,
    optax=optax,
    functools=functools,
    ozo=optax_zero_one,
    optax_zero_one=optax_zero_one,
)


def examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module, globs={**vars(module), **EXTRA}) if t.examples]


def test_the_package_has_examples():
    assert sum(len(examples(name)) for name in MODULES) >= 25


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in examples(name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"
