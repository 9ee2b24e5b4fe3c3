"""The plugin through fairseq's real command lines: registration, and a full round trip of fairseq's own
``transformer`` (preprocess, train, validate, generate, interactive, average, resume) with --user-dir."""

import argparse
import os
import re
import shutil
import sys

import torch

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


def test_criteria_of_the_package_are_registered():
    import fairseq_ext.criterions  # noqa: F401
    from fairseq.criterions import CRITERION_REGISTRY

    crit_dir = os.path.join(USER_DIR, "criterions")
    modules = [f[:-3] for f in os.listdir(crit_dir) if f.endswith(".py") and not f.startswith("_")]
    registered = {cls.__module__ for cls in CRITERION_REGISTRY.values()}
    for m in modules:
        assert f"fairseq_ext.criterions.{m}" in registered, f"criterions/{m}.py registers no criterion"


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
    updates_after_2 = torch.load(os.path.join(r, "checkpoint2.pt"), weights_only=True)["optimizer_history"][-1]["num_updates"]
    assert re.search(rf"Loaded checkpoint .*checkpoint_last\.pt \(epoch 3 @ {updates_after_2} updates\)", log), log[-3000:]
    assert os.path.isfile(os.path.join(r, "checkpoint3.pt"))
