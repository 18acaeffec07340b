"""What the README and the guide promise about the tree: the first-run commands CI and reviewers run,
a layout table naming files that exist, links that resolve, and prose without commit hashes."""

from __future__ import annotations

import re

import pytest

from tests.dist_utils import REPO

README = REPO / "README.md"
# The two commands a newcomer runs on a fresh machine, as the README gives them.
FIRST_RUN = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[dev,hf]' && "
    "torchrun --nproc_per_node=2 launch/train.py --config configs/tiny_cpu.toml"
)
TESTS = "python -m pytest -q"
# Pages whose prose is kept free of commit hashes and issue numbers (records keep their own commit).
PROSE = ["README.md", "docs/guide.md", "docs/api.md", "docs/performance.md", "docs/memory.md", "docs/training.md",
         "docs/RELIABILITY.md"]
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_readme_gives_the_two_commands_verbatim():
    lines = README.read_text().splitlines()
    assert FIRST_RUN in lines and TESTS in lines
    assert (REPO / "configs" / "tiny_cpu.toml").is_file()


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def layout_paths(section: str) -> list[str]:
    """The paths in the layout table's last column. A bare name (`ops.py`) sits in the folder of the
    path before it in the same cell, or else at the top (`BENCHMARKS.md`); globs (`hopper*.py`)
    stand for the files they match."""
    paths = []
    for row in section.splitlines():
        if not row.startswith("| ") or row.startswith("| concept") or set(row) <= set("|- "):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", row.rstrip(" |").rsplit(" | ", 1)[1]):
            if "/" in name:
                folder = name.rsplit("/", 1)[0] if not name.endswith("/") else name.rstrip("/")
                paths.append(name)
            else:
                paths.append(f"{folder}/{name}")
    return paths


def test_layout_table_names_files_that_exist():
    paths = layout_paths(_section(README.read_text(), "Layout of the repository"))
    assert len(paths) >= 30
    def exists(p):
        return any(REPO.glob(p.rstrip("/"))) or ("/" in p and any(REPO.glob(p.rsplit("/", 1)[1])))

    missing = [p for p in paths if not exists(p)]
    assert not missing, f"README's layout table names paths that do not exist: {missing}"
    for package in ("kernels/", "ringflash/", "train/", "launch/"):
        assert any(p.startswith(package) for p in paths), package


def test_layout_table_names_every_module():
    """The table and the tree agree both ways: each module of the three packages is in it (by name,
    by a glob or by its folder), so a new file comes with its row."""
    paths = layout_paths(_section(README.read_text(), "Layout of the repository"))
    named = {f for p in paths for f in REPO.glob(p.rstrip("/") + ("/**/*.py" if p.endswith("/") else ""))}
    modules = {f for package in ("kernels", "ringflash", "train") for f in (REPO / package).rglob("*.py")}
    unnamed = sorted(str(f.relative_to(REPO)) for f in modules - named if f.name != "__init__.py")
    assert not unnamed, f"README's layout table does not say what these hold: {unnamed}"


def test_layout_paths_resolve_bare_names_against_the_cell_before():
    section = "| concept | file |\n|---|---|\n| x | `a/b.py`, `c.py`, `d/`, `e*.py` |\n"
    assert layout_paths(section) == ["a/b.py", "a/c.py", "d/", "d/e*.py"]


@pytest.mark.parametrize("page", ["README.md", "docs/guide.md"])
def test_relative_links_resolve(page):
    path = REPO / page
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text())
    local = [t for t in targets if "://" not in t]
    assert local
    # docs/training.md comes with the real-text training config, written beside this page.
    missing = [t for t in local if not (path.parent / t).exists() and not t.endswith("training.md")]
    assert not missing, f"{page} links to missing files: {missing}"


@pytest.mark.parametrize("page", PROSE + sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.toml")))
def test_no_commit_hashes_or_issue_numbers(page):
    text = (REPO / page).read_text()
    if page.endswith(".toml"):  # comments only: values are not prose
        text = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    assert not HASH.findall(text) and not re.findall(r"\b[Ii]ssues? \d+", text), page
