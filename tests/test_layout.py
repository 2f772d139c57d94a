"""The package's two parts stay apart: the optimizer core never imports the integration."""

import ast
import pathlib

import numpy as np

import optax_zero_one as ozo

PACKAGE = pathlib.Path(ozo.__file__).parent


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_core_imports_only_core():
    files = sorted((PACKAGE / "core").glob("*.py"))
    assert len(files) > 10
    for path in files:
        ours = {m for m in imported_modules(path) if m.split(".")[0] == "optax_zero_one"}
        outside = {m for m in ours if not m.startswith("optax_zero_one.core")}
        assert not outside, f"{path.name} imports {sorted(outside)}: core must not depend on them"


def test_public_names_resolve_and_are_documented():
    assert len(ozo.__all__) == len(set(ozo.__all__))
    for name in ozo.__all__:
        obj = getattr(ozo, name)
        if callable(obj):
            assert obj.__doc__, f"ozo.{name} has no docstring"
    # nothing beyond __all__ and the two subpackages leaks into the top-level namespace
    public = {n for n in vars(ozo) if not n.startswith("_")}
    assert public - set(ozo.__all__) == {"core", "integration"}


def test_the_types_public_functions_return_and_take_are_public():
    """A user annotating a loop needs the dispatcher's, comm_stats' and the job's types from
    the package, and isinstance against the policy protocols (a TypeError before)."""
    schedule = ozo.zero_one_schedule(var_freeze_step=4)
    assert isinstance(ozo.dispatch_by_kind(lambda kind: None, schedule), ozo.KindDispatcher)
    stats = ozo.comm_stats(lambda x: x * 2, np.ones(3, np.float32))
    assert isinstance(stats, ozo.CommStats) and not stats.collectives
    assert ozo.initialize_from_env.__annotations__["return"] in (
        "DistributedJob",
        ozo.DistributedJob,
    )
    for policy in (ozo.VarianceDoubling(8), ozo.FullPrecisionWarmup(8)):
        assert isinstance(policy, ozo.VariancePolicy)
    for policy in (ozo.LocalStepDoubling(4), ozo.SyncEvery(4)):
        assert isinstance(policy, ozo.LocalStepPolicy)
        assert not isinstance(policy, ozo.VariancePolicy)  # no freeze_step


def test_every_test_named_in_the_tiers_exists():
    """The tier lists of conftest.py name tests by ``file::function``: a renamed test must not
    silently fall back into another tier."""
    import conftest

    tests = pathlib.Path(__file__).parent
    defined = {
        f"{path.name}::{node.name}"
        for path in tests.glob("test_*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }
    named = conftest.SLOW_TESTS | conftest.INTEGRATION_TESTS
    # a name may pick one parametrization, ``file::function[id]``: its function must exist and
    # its id must be written in that file (e.g. a key of the cases it is drawn from)
    functions = {name.split("[")[0] for name in named}
    assert functions <= defined, sorted(functions - defined)
    for name in named:
        if "[" in name:
            file, test_id = name.split("::")[0], name.split("[", 1)[1].rstrip("]")
            assert test_id in (tests / file).read_text(), name
    files = {p.name for p in tests.glob("test_*.py")}
    assert files >= conftest.UNIT_FILES | conftest.SLOW_FILES
