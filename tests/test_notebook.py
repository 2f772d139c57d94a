"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel of this interpreter (so that it
cannot rot), trains both optimizers to a falling loss, and is stored without outputs."""

import json
import pathlib
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
KERNEL = "optax-zero-one-test"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


def test_install_cell_builds_requirements_for_paths_and_git_urls(monkeypatch):
    import tomllib

    from packaging.requirements import Requirement

    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "pip_requirement" in c.source)
    monkeypatch.delenv("OPTAX_ZERO_ONE_SOURCE", raising=False)
    namespace: dict = {}
    exec(cell.source, namespace)  # the package imports here, so the cell installs nothing
    requirement = namespace["pip_requirement"]

    root = NOTEBOOK.parent.parent
    assert requirement(str(root)) == f"{root}[notebook]"
    assert requirement("~/clone").endswith("/clone[notebook]") and "~" not in requirement("~/clone")
    for url in ["https://example.org/o/optax_zero_one", "git+https://example.org/o/optax_zero_one"]:
        parsed = Requirement(requirement(url))
        assert parsed.name == "optax_zero_one" and parsed.extras == {"notebook"}
        assert parsed.url == "git+https://example.org/o/optax_zero_one"
    # the extra the cell asks for exists and brings what the notebook imports beyond the package
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(dep.startswith("matplotlib") for dep in extras["notebook"])


def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    # A kernel spec for this very interpreter (the venv's), found first on JUPYTER_PATH, so that
    # neither a user-level "python3" spec nor a missing system one can change what runs.
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "optax_zero_one tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # The kernel inherits this environment: CPU only, PJRT_NPROC set (conftest.py); the notebook
    # asks for its 8 simulated devices itself.
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=600,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    nbformat.write(nb, tmp_path / "executed.ipynb")  # kept by pytest for a look after a failure

    text = "\n".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.get("output_type") == "stream"
    )
    assert "8 workers on cpu devices" in text, text
    finals = [float(v) for v in re.findall(r"final eval loss ([\d.]+)", text)]
    assert len(finals) == 2 and all(f < 0.8 for f in finals), text  # from ~2.3 at the start
    saved = float(re.search(r"MB, ([\d.]+)x less", text).group(1))  # all workers, the whole run
    assert saved > 2, text
    images = sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )
    assert images == 3


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
