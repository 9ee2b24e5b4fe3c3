"""README and the repository's lint: README's figures are the generated ones, its two commands are what CI runs,
every relative link of README and docs/ resolves, and ``ruff check .`` is clean."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tools import readme_figures


def test_readme_figures_are_the_generated_ones(tmp_path):
    assert readme_figures.main(["--check"]) == 0
    stale = tmp_path / "README.md"  # a hand-edited figure is caught, naming the line
    stale.write_text(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().replace(
        readme_figures.releases()[-1], readme_figures.releases()[-1].replace("|", "| 99.99", 1)))
    with pytest.raises(SystemExit) as e:
        readme_figures.main(["--check", "--readme", str(stale)])
    assert "differs from the generated figures; run python tools/readme_figures.py" in str(e.value)


def test_readme_shows_the_two_commands_ci_runs():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    first_screen = "\n".join(readme.splitlines()[:60])
    assert "bash install.sh && bash examples/quickstart.sh" in first_screen
    assert "bash install.sh && .venv/bin/python -m pytest tests" in first_screen
    assert "bash install.sh" in ci and ".venv/bin/python -m pytest tests" in ci


def _markdown_files():
    yield os.path.join(ROOT, "README.md")
    yield os.path.join(ROOT, "CONTRIBUTING.md")
    for folder in ("docs", "docs/notes", "benchmarks", "releases", "data"):
        d = os.path.join(ROOT, folder)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            if name.endswith(".md"):
                yield os.path.join(d, name)


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for path in _markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", open(path, encoding="utf-8").read()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            full = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
            if not full.startswith(ROOT + os.sep) or not os.path.exists(full):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target}")
    assert not broken, broken


def test_ruff_is_clean_on_the_tree():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (requirements.txt pins it)")
    proc = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
