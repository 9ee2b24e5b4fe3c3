"""The plugin through fairseq's real command lines: registration, and a full round trip of fairseq's own
``transformer`` (preprocess, train, validate, generate, interactive, average, resume) with --user-dir."""

import argparse
import os
import re
import shutil
import sys

from tests.conftest import TINY_TRANSFORMER
from tests.helpers import ROOT, USER_DIR, generate_main, hypotheses, run_cli, run_module, train_args


def test_plugin_registers_once_under_every_import_route(monkeypatch):
    import fairseq_ext
    from fairseq import utils
    from fairseq.models import ARCH_MODEL_REGISTRY

    before = dict(ARCH_MODEL_REGISTRY)
    # fairseq's --user-dir import (absolute path, then the relative path from the repository root) on top
    # of the normal import must neither raise "duplicate architecture" nor register anything twice
    utils.import_user_module(argparse.Namespace(user_dir=USER_DIR))
    monkeypatch.chdir(ROOT)
    utils.import_user_module(argparse.Namespace(user_dir="fairseq_ext"))
    assert dict(ARCH_MODEL_REGISTRY) == before
    assert os.path.dirname(fairseq_ext.__file__) == USER_DIR
    ours = [name for name, mod in sys.modules.items() if mod is not None
            and getattr(mod, "__file__", None) and mod.__file__.startswith(USER_DIR + os.sep)]
    assert all(name == "fairseq_ext" or name.startswith("fairseq_ext.") for name in ours), ours


def test_every_paper_folder_registers_its_models_tasks_and_criteria():
    import fairseq_ext  # noqa: F401
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.models import MODEL_REGISTRY
    from fairseq.tasks import TASK_REGISTRY

    registered = {name: cls.__module__ for reg in (MODEL_REGISTRY, TASK_REGISTRY, CRITERION_REGISTRY)
                  for name, cls in reg.items()}
    assert registered["fconv_glu"] == "fairseq_ext.convs2s.model"
    assert registered["msc_transformer"] == "fairseq_ext.msc.model"
    assert registered["label_smoothed_cross_entropy_l2"] == "fairseq_ext.msc.criterion"
    assert registered["sat_transformer"] == "fairseq_ext.sat.model"
    assert registered["translation_sat"] == "fairseq_ext.sat.task"
    assert registered["bert_jam"] == "fairseq_ext.bert_jam.model"
    assert registered["translation_bert"] == "fairseq_ext.bert_jam.task"
    # every module of the package that registers something is one of these (nothing left behind by a move)
    ours = {m for m in registered.values() if m.startswith("fairseq_ext.")}
    assert ours == {"fairseq_ext.convs2s.model", "fairseq_ext.msc.model", "fairseq_ext.msc.criterion",
                    "fairseq_ext.sat.model", "fairseq_ext.sat.task", "fairseq_ext.bert_jam.model",
                    "fairseq_ext.bert_jam.task"}


def test_models_never_import_tasks():
    """A model module imports no task module (tasks may import models and generators, not the reverse)."""
    import ast

    for paper in ("convs2s", "msc", "sat", "bert_jam"):
        for name in os.listdir(os.path.join(USER_DIR, paper)):
            if name not in ("model.py", "layers.py", "generator.py", "bert.py", "criterion.py"):
                continue
            tree = ast.parse(open(os.path.join(USER_DIR, paper, name)).read())
            imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + \
                       [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            assert not [m for m in imported if m.startswith("fairseq_ext.") and m.endswith(".task")], (paper, name)


PAPERS = ("convs2s", "msc", "sat", "bert_jam")


def _package_modules():
    """(module name, its package, its parsed code) for every module of the package."""
    import ast

    for folder, _, files in os.walk(USER_DIR):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.dirname(USER_DIR))[:-3].replace(os.sep, ".")
            module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
            package = module if name == "__init__.py" else module.rsplit(".", 1)[0]
            yield module, package, ast.parse(open(path, encoding="utf-8").read())


def _package_imports():
    """{module: the fairseq_ext modules it imports, at any depth of its code} for every module of the package."""
    import ast

    out = {}
    for module, package, tree in _package_modules():
        found = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:  # relative: from the package, n.level - 1 levels up
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - n.level + 1] + ([base] if base else []))
                is_package = os.path.isdir(os.path.join(os.path.dirname(USER_DIR), *base.split(".")))
                for a in n.names:  # from a package: the module it names, when it is one
                    sub = os.path.join(os.path.dirname(USER_DIR), *base.split("."), a.name)
                    found.add(f"{base}.{a.name}" if is_package and (os.path.isdir(sub) or os.path.isfile(
                        sub + ".py")) else base)
            elif isinstance(n, ast.Import):
                found.update(a.name for a in n.names)
        out[module] = {m for m in found if m == "fairseq_ext" or m.startswith("fairseq_ext.")}
    return out


SHARED = ("inference", "checkpoints", "common")


def _folder(module):
    """The room of a module: its paper folder, a shared folder, or "core" (the modules at the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in PAPERS + SHARED) else "core"


def test_shared_code_never_imports_a_paper_folder_and_no_loop_across_folders():
    """The package's import rules: the root modules ("core") and fairseq_ext/inference/ never import a paper folder
    (a decoder declares what the lean step needs instead); paper folders import the shared code, never each other;
    and the folders' import graph has no cycle (an import inside a function counts too)."""
    imports = _package_imports()
    assert "fairseq_ext.inference.lean_decoder" in imports and "fairseq_ext.sat.generator" in imports
    edges = set()
    for module, deps in imports.items():
        for dep in deps:
            a, b = _folder(module), _folder(dep)
            if module == "fairseq_ext" or a == b:  # the package's __init__ registers the papers
                continue
            if a in ("core",) + SHARED:
                assert b not in PAPERS, f"{module} (shared) imports {dep} (a paper folder)"
            if a in PAPERS:
                assert b not in PAPERS, f"{module} imports another paper's {dep}"
            edges.add((a, b))
    # no cycle across folders
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    assert _cycles(graph) == [], edges


def _cycles(graph):
    """The nodes of ``graph`` ({node: successors}) that reach themselves."""
    def reaches(start, goal, seen):
        for n in graph.get(start, ()):
            if n == goal:
                return True
            if n not in seen:
                seen.add(n)
                if reaches(n, goal, seen):
                    return True
        return False

    return sorted(f for f in graph if reaches(f, f, set()))


def test_no_import_loop_between_modules():
    """No module imports (at any depth of its code, lazily included) a module that leads back to it: inside a folder
    as across folders. The package's __init__ files, which register the folders' modules, are left out."""
    imports = _package_imports()
    packages = {m for m in imports if any(o.startswith(m + ".") for o in imports)}
    graph = {m: {d for d in deps if d in imports and d not in packages} for m, deps in imports.items()
             if m not in packages}
    assert "fairseq_ext.sat.generator" in graph and "fairseq_ext.common.errors" in graph
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == ["a", "b"]  # the check itself sees a loop
    assert _cycles(graph) == [], {m: graph[m] for m in _cycles(graph)}


def test_python_m_fairseq_ext_prints_the_user_dir():
    assert run_module("fairseq_ext", []).stdout.strip() == USER_DIR


def test_round_trip_with_user_dir(tiny_transformer_dir, tmp_path):
    d = tiny_transformer_dir
    for name in ("checkpoint1.pt", "checkpoint2.pt", "checkpoint_last.pt", "checkpoint_best.pt"):
        assert os.path.isfile(os.path.join(d, name)), name
    # validate
    val = run_cli("validate", [d, "--task", "translation", "--path", os.path.join(d, "checkpoint_last.pt"),
                               "--user-dir", USER_DIR, "--valid-subset", "valid", "--max-tokens", "500",
                               "--num-workers", "0", "--source-lang", "in", "--target-lang", "out"])
    assert re.search(r"valid on 'valid' subset \| loss [0-9.]+", val.stdout + val.stderr)
    # generate (beam 3, alignment) and interactive on "h e l l o"
    gen, inter = generate_main(d)
    hyps = hypotheses(gen)
    assert len(hyps) == 100 and "BLEU4" in gen and re.search(r"^A-\d+\t", gen, re.M)
    assert re.search(r"^H-0\t-?[0-9.]+\t", inter, re.M) and "S-0\th e l l o" in inter
    # average the two epoch checkpoints, decode with the average
    avg = tmp_path / "avg.pt"
    run_module("fairseq_ext.average_checkpoints",
               ["--inputs", d, "--num-epoch-checkpoints", "2", "--output", avg])
    gen_avg, _ = generate_main(d, path=str(avg), interactive=False)
    assert len(hypotheses(gen_avg)) == 100
    # resume from checkpoint_last.pt for one more epoch (in a copy, the fixture stays as it is), from another
    # working directory with the absolute --user-dir (the path `python -m fairseq_ext` prints)
    r = str(tmp_path / "resume")
    shutil.copytree(d, r)
    resumed = run_cli("train", train_args(r, "transformer_iwslt_de_en", TINY_TRANSFORMER + [
        "--restore-file", "checkpoint_last.pt"], max_epoch=3), cwd=str(tmp_path))
    log = resumed.stdout + resumed.stderr
    # fairseq reports the epoch it resumes into: 3, after the updates of the two finished epochs
    from fairseq_ext.checkpoints import load_checkpoint_file  # plain torch.load refuses Namespace (S2)

    updates_after_2 = load_checkpoint_file(os.path.join(r, "checkpoint2.pt"))["optimizer_history"][-1]["num_updates"]
    loaded = rf"Loaded checkpoint .*checkpoint_last\.pt \(epoch 3 @ {updates_after_2} updates\)"
    assert re.search(loaded, log), log[-3000:]
    assert os.path.isfile(os.path.join(r, "checkpoint3.pt"))


MAX_LINES = 700


def test_every_source_file_is_at_most_700_lines():
    """Files a reader reads top to bottom: every Python and C source of the package, the benchmarks and the tools."""
    long = []
    for top in ("fairseq_ext", "benchmarks", "tools"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".c", ".sh")):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        n = sum(1 for _ in f)
                    if n > MAX_LINES:
                        long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, long


def test_no_private_name_is_imported_from_another_folder():
    """Across folders of the package only public names are imported (``from fairseq_ext.x.y import _name`` is
    refused unless x is the importing module's own folder)."""
    import ast

    bad = []
    for module, _, tree in _package_modules():
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").startswith("fairseq_ext."):
                if _folder(n.module) != _folder(module):
                    bad += [f"{module}: from {n.module} import {a.name}" for a in n.names if a.name.startswith("_")]
    assert not bad, bad
