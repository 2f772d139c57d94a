"""The scripts in examples/ run end to end (reduced to a few dozen steps, each in its own
process, as a user would run them) and report a falling loss and fewer bytes than a pmean of the
gradients; the byte formula of the vmap example equals what comm_stats reads from the compiled
programs of the shard_map example."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
from unittest import mock

import jax
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = {
    "nnx_shard_map": ["--steps", "40"],
    "linen_pmap": ["--steps", "40"],
    "vmap_simulated_workers": ["--steps", "40", "--workers", "4"],
}
TIMEOUT_S = 480


@pytest.fixture(scope="module")
def outputs():
    """Starts all three scripts at once (they wait on compilation more than on each other)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PJRT_NPROC="16",
        JAX_NUM_CPU_DEVICES="8",
        PYTHONUNBUFFERED="1",  # keep what was printed if a script is stopped
    )
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for name, args in SCRIPTS.items()
    }
    results = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += f"\n[timed out after {TIMEOUT_S} s]"
        results[name] = (proc.returncode, out)
    return results


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_example_runs_and_reports(outputs, name):
    code, out = outputs[name]
    assert code == 0, out[-3000:]
    first, last = map(float, re.search(r"eval loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < 0.5 * first, out[-3000:]
    sent, baseline = (
        float(v.replace(",", ""))
        for v in re.search(r": ([\d,]+) with 0/1 Adam vs ([\d,]+) for", out).groups()
    )
    assert 0 < sent < baseline / 2, out[-3000:]
    for kind in ("variance", "compressed", "sync", "local"):
        assert re.search(rf"^\s+{kind}\s+[1-9]\d* steps x", out, re.M), (kind, out[-3000:])


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ):  # the scripts set environment defaults when imported
        spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("num_workers", [4, 8])
def test_byte_formula_matches_compiled_programs(num_workers):
    measured_by = load("nnx_shard_map").bytes_per_step_kind
    formula = load("vmap_simulated_workers").bytes_per_step_kind
    params = {"w": np.zeros((33, 7), np.float32), "b": np.zeros(7, np.float32)}
    devices = jax.devices()[:num_workers]
    mesh = jax.make_mesh((num_workers,), ("workers",), devices=devices)
    measured = measured_by(params, mesh, num_workers)
    expected = formula(params, num_workers)
    assert measured.keys() == expected.keys()
    for kind in measured:
        np.testing.assert_allclose(measured[kind], expected[kind], rtol=1e-9, err_msg=kind)
