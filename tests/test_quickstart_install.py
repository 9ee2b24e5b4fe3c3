"""README's two commands stay true: install.sh is idempotent and fast the second time, and the quickstart
runs every step (corpus, BPE, preprocess, train with --user-dir, average, generate + sacreBLEU, interactive)."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT


def test_install_is_idempotent_and_pins_the_environment():
    start = time.time()
    proc = subprocess.run(["bash", os.path.join(ROOT, "install.sh")], capture_output=True, text=True, cwd=ROOT)
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is up to date" in proc.stdout, proc.stdout[-3000:]  # the seconds-fast path, nothing reinstalled
    print(f"second install.sh run: {elapsed:.1f}s")
    import importlib.metadata as md
    import importlib.util

    assert importlib.util.find_spec("torchaudio") is None
    assert md.version("fairseq-fixed") == "0.12.3.1"
    assert md.version("torch").split("+")[0] == "2.13.0" or os.environ.get("FAIRSEQ_EXT_KEEP_TORCH")
    assert sys.prefix == os.path.join(ROOT, ".venv"), "the tests run in the checkout's .venv"


def test_install_rejects_unknown_options():
    proc = subprocess.run(["bash", os.path.join(ROOT, "install.sh"), "--gpu"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown option '--gpu'" in proc.stderr


@pytest.mark.slow
def test_quickstart_smoke_runs_every_step_and_reuses_its_work(tmp_path):
    cmd = ["bash", os.path.join(ROOT, "examples", "quickstart.sh"), "--smoke", "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for step in ("1/6", "2/6 fairseq-preprocess", "3/6 fairseq-train", "4/6", "5/6", "6/6", "done in"):
        assert step in out, step
    bleu = json.loads(open(tmp_path / "out" / "transformer-de-en" / "bleu.json").read())
    assert bleu["name"] == "BLEU" and bleu["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    hyps = open(tmp_path / "out" / "transformer-de-en" / "test.hyp").read().splitlines()
    assert len(hyps) == 100  # every (smoke: the first 100) test sentence decoded, in order
    assert len(re.findall(r"^source: ", out, re.M)) == 3 and len(re.findall(r"^   -> ", out, re.M)) == 3
    # a re-run reuses the corpus, the binarised data and the trained model
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "binarised data already in" in again.stdout and "model already trained" in again.stdout


def test_quickstart_rejects_an_unknown_arch():
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "quickstart.sh"), "--arch", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no settings for --arch 'nope'" in proc.stderr and "transformer" in proc.stderr
