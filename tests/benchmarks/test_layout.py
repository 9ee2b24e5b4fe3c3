"""benchmarks/ as packages: every program answers ``python -m benchmarks.NAME --help`` with its own command line,
benchmarks/README.md names every module, no module edits ``sys.path``, and none reaches for a private name of
fairseq_ext (a benchmark measures what a user can call)."""

import ast
import importlib
import os
import sys

import pytest

from tests.helpers import ROOT

BENCHMARKS = os.path.join(ROOT, "benchmarks")


def _modules():
    """(dotted name, path) of every module of benchmarks/ but the packages' __init__.py."""
    for folder, _, files in os.walk(BENCHMARKS):
        for name in sorted(files):
            if name.endswith(".py") and name != "__init__.py":
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield dotted.removesuffix(".__main__"), path


SPEED_HELPERS = {"benchmarks.speed.sat_contenders"}  # shared by speed.sat, beam_parts and speculative


def _programs():
    """The modules a user runs: each package's __main__ and every speed module but the shared one."""
    return [d for d, path in _modules() if path.endswith("__main__.py")
            or d.startswith("benchmarks.speed.") and d not in SPEED_HELPERS]


@pytest.mark.parametrize("dotted", _programs())
def test_help_names_the_python_m_command(dotted, monkeypatch, capsys):
    module = importlib.import_module(dotted if dotted.startswith("benchmarks.speed.") else dotted + ".__main__")
    monkeypatch.setattr(sys, "argv", [dotted, "--help"])
    with pytest.raises(SystemExit) as e:
        module.main()
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {dotted} ")


def test_readme_names_every_module():
    """benchmarks/README.md is the index of the benchmarks: a module missing from it is one nobody finds."""
    with open(os.path.join(BENCHMARKS, "README.md"), encoding="utf-8") as f:
        index = f.read()
    missing = [d for d, path in _modules()
               if f"python -m {d}" not in index and f"`{os.path.basename(path)}`" not in index]
    assert not missing, f"not in benchmarks/README.md: {missing}"


def _problems(path):
    """``sys.path`` uses, and private names of fairseq_ext imported or read off a fairseq_ext module."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    ours = set()  # local names bound to fairseq_ext modules
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            ours.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("fairseq_ext"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fairseq_ext"):
            for a in node.names:
                if a.name.startswith("_"):
                    out.append(f"line {node.lineno}: from {node.module} import {a.name}")
                ours.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "sys" and node.attr == "path":
                out.append(f"line {node.lineno}: sys.path")
            elif node.value.id in ours and node.attr.startswith("_") and not node.attr.startswith("__"):
                out.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return out


def test_no_sys_path_edits_and_no_private_names_of_fairseq_ext():
    found = {os.path.relpath(path, ROOT): p for _, path in _modules() if (p := _problems(path))}
    assert not found, found
