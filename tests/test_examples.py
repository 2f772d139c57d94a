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
    "jit_sharded": ["--steps", "40"],
}
REPORTS_IN_TABLE = ["nnx_shard_map", "linen_pmap", "vmap_simulated_workers"]
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


# The examples compile one program per step kind each (~90 s together on 2 cores): they run with
# `make test-slow`, which CI runs after `make test`.
@pytest.mark.slow
@pytest.mark.parametrize("name", REPORTS_IN_TABLE)
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


@pytest.mark.slow
def test_jit_sharded_example_trains_on_a_two_d_mesh_and_reports_its_bytes(outputs):
    code, out = outputs["jit_sharded"]
    assert code == 0, out[-3000:]
    assert "4 data x 2 model devices" in out
    first = float(re.search(r"step    0  eval loss ([\d.]+)", out).group(1))
    last_line = out.strip().splitlines()[-1]
    final = re.fullmatch(
        r"final eval loss ([\d.]+) after 40 steps, bytes sent per data worker ([\d,]+) "
        r"\(pmean every step would send ([\d,]+)\)",
        last_line,
    )
    assert final, last_line
    loss, sent, pmean = (float(v.replace(",", "")) for v in final.groups())
    assert loss < first - 0.5, out[-3000:]
    assert 0 < sent < 0.6 * pmean, out[-3000:]
    # a variance step's float mean is a pmean of this device's shard (up to leaf padding);
    # a 1-bit step sends ~1/16 of it (two phases of 1 bit against a 32-bit ring all-reduce)
    per_kind = dict(
        (k, float(v.replace(",", "")))
        for k, v in re.findall(r"(variance|compressed|sync|a pmean) ([\d,]+)", out)
    )
    assert per_kind["a pmean"] <= per_kind["variance"] <= 1.05 * per_kind["a pmean"]
    assert per_kind["compressed"] < per_kind["a pmean"] / 12


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
