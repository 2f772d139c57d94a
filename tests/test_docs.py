"""The documentation holds together: every Markdown file that code or docs name exists, the
README stays a front page, and its layout section lists what the repository holds."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["optax_zero_one", "tests", "benchmarks", "examples", "notebooks", "docs"]
MD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]*\.md\b")
MD_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def _files():
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in {".py", ".md", ".ipynb"} and ".ipynb_checkpoints" not in path.parts:
                yield path
    yield from (ROOT / name for name in ("README.md", "CHANGELOG.md", "Makefile"))


def _exists(name: str, where: Path) -> bool:
    candidates = [ROOT / name, where.parent / name, ROOT / "docs" / name]
    return any(c.resolve().is_file() for c in candidates)


def test_every_referenced_markdown_file_exists():
    missing = []
    for path in _files():
        text = path.read_text()
        names = set(MD_LINK.findall(text)) if path.suffix == ".md" else set()
        names |= {n for n in MD_NAME.findall(text) if "/" in n or n[0].isupper() or n.islower()}
        for name in sorted(names):
            if name.startswith(("http", "results/")) or "://" in name:
                continue
            if not _exists(name, path):
                missing.append(f"{path.relative_to(ROOT)} -> {name}")
    assert not missing, "dangling Markdown references:\n" + "\n".join(missing)


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 10_000, len(text)
    assert "make demo" in text and "make test" in text
    assert "](docs/" in text  # it links to the docs rather than holding them


def _layout_block():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout") :]
    return section[section.index("```") + 3 : section.index("```", section.index("```") + 3)]


def test_readme_layout_lists_the_repository():
    """Every path the layout block names exists (nesting by indentation), and every module of
    the package is listed in it."""
    block = _layout_block()
    parents: list[tuple[int, Path]] = []  # (indentation, folder) of the enclosing entries
    for line in block.splitlines():
        match = re.match(r"(\s*)([A-Za-z0-9_.-]+(?:\.py|\.md|/))((?:, [A-Za-z0-9_.-]+\.py)*)", line)
        if not match:
            continue
        indent, entry, more = len(match.group(1)), match.group(2), match.group(3)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        parent = parents[-1][1] if parents else ROOT
        for name in [entry, *re.findall(r"[A-Za-z0-9_.-]+\.py", more)]:
            path = parent / name
            assert path.exists(), f"README layout names {path.relative_to(ROOT)}: no such path"
        if entry.endswith("/"):
            parents.append((indent, parent / entry))
    package = ROOT / "optax_zero_one"
    modules = {p.name for p in package.rglob("*.py") if p.name != "__init__.py"}
    unlisted = sorted(m for m in modules if m not in block)
    assert not unlisted, f"modules missing from the README layout: {unlisted}"


def _overhead_state_table() -> dict[str, tuple[str, str]]:
    """The state table of the overhead page: optimizer -> (bytes at N = 2, bytes at N = 64)."""
    page = (ROOT / "docs/benchmarks/overhead.md").read_text()
    table = page[page.index("State bytes per parameter") :]
    rows = re.findall(
        r"^\| (0/1 Adam|1-bit Adam|optax.adam) \| ([\d.]+) \| ([\d.]+) \|", table, re.M
    )
    return {name: (n2, n64) for name, n2, n64 in rows}


def test_state_size_is_quoted_as_measured():
    """The state size quoted in the README and the design page is the overhead page's figure
    (three pages once gave three different numbers)."""
    n2, n64 = _overhead_state_table()["0/1 Adam"]
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "optimizer state per parameter" in line)
    assert f"{float(n2):.1f} B at N = 2" in row and f"{n64} B at N = 64" in row, row
    design = (ROOT / "docs" / "design.md").read_text()
    quoted = re.findall(
        r"state: ([\d.]+) bytes per parameter at `N = 2`, ([\d.]+) at `N = 64`", design
    )
    assert quoted == [(f"{float(n2):.1f}", n64)], quoted


@pytest.mark.parametrize("page", sorted((ROOT / "docs").rglob("*.md")), ids=lambda p: p.name)
def test_docs_pages_have_a_title(page):
    assert page.read_text().startswith("# "), page


def test_readme_composition_is_zero_one_adam():
    """The composition the README shows runs, and is the alias: the same params, bit for bit."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from support.mapping import mapped

    import optax_zero_one as ozo

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What it is made of") :]
    code = section[
        section.index("```python") + 9 : section.index("```", section.index("```python") + 9)
    ]
    schedule = dict(
        var_freeze_step=5, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4
    )
    names = {"ozo": ozo, "optax": optax, "lr": 0.01, **schedule}
    exec(code.replace('"batch"', '"w"'), names)  # noqa: S102 (our own README)
    composed, alias = names["tx"], ozo.zero_one_adam(0.01, axis_name="w", **schedule)

    def run(tx):
        def step(x, s, g):
            u, s = tx.update(g, s, x)
            return optax.apply_updates(x, u), s

        x = {"a": jnp.zeros((4, 3, 2)), "b": jnp.zeros((4, 5))}
        state = mapped(tx.init, "vmap", 4)(x)
        rng = np.random.default_rng(0)
        run_step = mapped(step, "vmap", 4)  # compiled once, not at every step
        for _ in range(16):
            g = jax.tree.map(lambda v: jnp.asarray(rng.standard_normal(v.shape), v.dtype), x)
            x, state = run_step(x, state, g)
        return x

    for a, b in zip(jax.tree.leaves(run(composed)), jax.tree.leaves(run(alias))):
        np.testing.assert_array_equal(a, b)
