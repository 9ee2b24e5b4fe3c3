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
    # install.sh's own check of the environment these tests run in (any location: FAIRSEQ_EXT_VENV); tests run
    # in another environment (e.g. after `pip install .`) have nothing of install.sh's to check
    if not os.path.isfile(os.path.join(sys.prefix, ".fairseq-ext-installed")):
        pytest.skip(f"the tests run in {sys.prefix}, which install.sh did not make")
    start = time.time()
    proc = subprocess.run(["bash", os.path.join(ROOT, "install.sh")], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, FAIRSEQ_EXT_VENV=sys.prefix))
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is up to date" in proc.stdout, proc.stdout[-3000:]  # the seconds-fast path, nothing reinstalled
    print(f"second install.sh run: {elapsed:.1f}s")
    import importlib.metadata as md
    import importlib.util

    assert importlib.util.find_spec("torchaudio") is None
    assert md.version("fairseq-fixed") == "0.12.3.1"
    assert md.version("torch").split("+")[0] == "2.13.0" or os.environ.get("FAIRSEQ_EXT_KEEP_TORCH")


def test_install_rejects_unknown_options():
    proc = subprocess.run(["bash", os.path.join(ROOT, "install.sh"), "--gpu"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown option '--gpu'" in proc.stderr


def _fake_install(tmp_path, *args, torchaudio=False, user_constraint=None):
    """Run install.sh from a copy of the checkout in a path with a space, against a fake venv whose python runs
    the tests' python but only records its pip calls (nothing is downloaded or installed)."""
    import shutil

    checkout = tmp_path / "my checkout"
    checkout.mkdir()
    for f in ("install.sh", "requirements.txt", "constraints.txt", "setup.py"):
        shutil.copy(os.path.join(ROOT, f), checkout / f)
    venv, log = tmp_path / "venv", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text('#!/bin/bash\n'
                    'if [ "$1" = -m ] && [ "$2" = pip ]; then\n'
                    '  printf "%s\\n" "PIP_CONSTRAINT=${PIP_CONSTRAINT:-}" "$@" "--" >> "$FAKE_PIP_LOG"; exit 0\n'
                    'fi\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    pythonpath = [ROOT]
    if torchaudio:  # a torchaudio the user's Python can import (pytorch.org's default command, containers)
        (tmp_path / "site" / "torchaudio").mkdir(parents=True)
        (tmp_path / "site" / "torchaudio" / "__init__.py").write_text("")
        pythonpath.insert(0, str(tmp_path / "site"))
    env = dict(os.environ, FAIRSEQ_EXT_VENV=str(venv), FAKE_PIP_LOG=str(log), PYTHONPATH=os.pathsep.join(pythonpath))
    env.pop("PIP_CONSTRAINT", None)
    if user_constraint:
        env["PIP_CONSTRAINT"] = user_constraint
    proc = subprocess.run(["bash", str(checkout / "install.sh"), *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("--\n") if c.strip()] if log.exists() else []
    return proc, calls, checkout, venv


@pytest.mark.slow  # ~40 s under load: the final check imports torch, fairseq and fairseq_ext
def test_install_keep_torch_accepts_the_users_torchaudio(tmp_path):
    """B2: `install.sh --keep-torch` (the GPU path) ended with "must not be installed" whenever the user's Python
    could import torchaudio (pytorch.org's default install); its own torch is kept, and so is its torchaudio."""
    proc, calls, checkout, venv = _fake_install(tmp_path, "--keep-torch", torchaudio=True,
                                                user_constraint="/etc/site-constraints.txt")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "keeping the existing torch" in proc.stdout and "torchaudio is importable" in proc.stdout
    assert (venv / ".fairseq-ext-installed").read_text().rstrip().endswith("keep_torch=1")
    installs = [c for c in calls if "install" in c]
    assert installs and not any(a.startswith("torch==") for c in installs for a in c)  # the user's torch stays
    for c in installs:  # Q8: every pip call has our constraints (without the torch pin) and the user's own
        assert c[0] == "PIP_CONSTRAINT=/etc/site-constraints.txt"
        constraints = c[c.index("-c") + 1]
        assert constraints == str(venv / "constraints-keep-torch.txt")
    text = open(constraints).read()
    assert "torchaudio==0.0.0.dev0" in text and "torch==" not in text.replace("torchaudio==", "")
    assert not (checkout / ".constraints-keep-torch.txt").exists()  # nothing written into the checkout


@pytest.mark.slow  # ~40 s under load: the final check imports torch, fairseq and fairseq_ext
def test_install_cpu_path_refuses_torchaudio_and_pins_torch(tmp_path):
    """Without --keep-torch the venv is ours: torch pinned by constraints.txt (given with -c, which survives the
    space in the checkout path), and a torchaudio in it is an error."""
    proc, calls, checkout, venv = _fake_install(tmp_path, torchaudio=True)
    assert proc.returncode == 1 and "torchaudio must not be installed" in proc.stderr, proc.stderr[-2000:]
    installs = [c for c in calls if "install" in c]
    assert all(c[c.index("-c") + 1] == str(checkout / "constraints.txt") for c in installs)
    assert not (venv / ".fairseq-ext-installed").exists()


@pytest.mark.slow
def test_quickstart_smoke_runs_every_step_and_reuses_its_work(tmp_path):
    cmd = ["bash", os.path.join(ROOT, "examples", "quickstart.sh"), "--smoke", "--from-scratch", "--workdir",
           str(tmp_path)]
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


@pytest.mark.slow
@pytest.mark.parametrize("arch,run", [("transformer", "transformer-de-en-release"),
                                      ("sat_transformer", "sat_transformer-de-en-release-k2")])
def test_quickstart_smoke_from_the_release_continues_its_training(arch, run, tmp_path):
    """The default path: the release's BPE and dictionary, training continued from the release checkpoint (so the
    valid loss after 20 updates is that of a trained model), outputs kept apart from a --from-scratch run; for SAT
    without a teacher or a distillation step."""
    manifest = os.path.join(ROOT, "releases", "bible-de-en", "MANIFEST.json")
    if not os.path.isfile(manifest):
        pytest.skip("no bible-de-en release")
    cmd = ["bash", os.path.join(ROOT, "examples", "quickstart.sh"), "--smoke", "--arch", arch, "--workdir",
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "starting from the release checkpoint" in out and "sha256 checked" in out
    assert "more updates from the release" in out
    assert (tmp_path / "data-release" / "spm.model").read_bytes() == open(
        os.path.join(ROOT, "releases", "bible-de-en", "spm.model"), "rb").read()
    assert (tmp_path / "bin-de-en-release" / "dict.en.txt").read_text() == open(
        os.path.join(ROOT, "releases", "bible-de-en", "dict.txt")).read()
    valid_loss = float(re.search(r"trained 20 updates .*valid loss ([\d.]+)", out).group(1))
    assert valid_loss < 7.0, out  # from random weights: 12.19 after 20 updates (--smoke --from-scratch)
    bleu = json.loads(open(tmp_path / "out" / run / "bleu.json").read())
    assert bleu["score"] > 10, bleu  # the release translates (outputs cut at 16 tokens in --smoke)
    # no --from-scratch run
    assert all("-release" in d for d in os.listdir(tmp_path / "out")), os.listdir(tmp_path / "out")
    assert "SAT 1/3" not in out and "SAT 2/3" not in out


def test_quickstart_says_when_there_is_no_release_to_start_from(tmp_path):
    """No release of the transformer En->De: the quickstart says so on its second line and trains from scratch."""
    if os.path.isfile(os.path.join(ROOT, "releases", "bible-en-de", "transformer.pt")):
        pytest.skip("there is an En->De transformer release")
    proc = subprocess.Popen(["bash", os.path.join(ROOT, "examples", "quickstart.sh"), "--direction", "en-de",
                             "--workdir", str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]  # then stop it: the rest is the from-scratch run
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert lines[1].strip() == "no release of transformer in releases/bible-en-de: training from random weights"
    assert lines[2].startswith("==> 1/6 corpus (bible) and joint sentencepiece BPE")


def test_quickstart_help_is_the_whole_comment_block():
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "quickstart.sh"), "--help"], capture_output=True,
                          text=True)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and all(line.startswith("#") for line in lines)
    assert "--from-scratch" in proc.stdout and lines[-1].startswith("# logs of every tool")


def test_quickstart_with_a_malformed_spm_model_is_one_line(tmp_path):
    """--spm-model naming a file that is not a sentencepiece model stops the quickstart at its first step with one
    line naming the file, not sentencepiece's traceback."""
    bad = tmp_path / "spm.model"
    bad.write_bytes(b"\x00not a sentencepiece model")
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "quickstart.sh"), "--from-scratch", "--smoke",
                           "--spm-model", str(bad), "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"prepare_bundled_corpus: --spm-model {bad} is not a sentencepiece model" in proc.stderr


def test_quickstart_rejects_an_unknown_arch():
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "quickstart.sh"), "--arch", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no settings for --arch 'nope'" in proc.stderr and "transformer" in proc.stderr


def _run_average_last(ckpt_dir, average_last_n):
    """Run quickstart.sh's average_last function alone (extracted from the script) on CKPT_DIR."""
    script = open(os.path.join(ROOT, "examples", "quickstart.sh")).read()
    body = script[script.index("average_last() {"):]
    body = body[:body.index("\n}\n") + 3]
    snippet = (f"set -euo pipefail\nsay() {{ printf '%s\\n' \"$*\"; }}\nquiet() {{ shift; \"$@\"; }}\n"
               f"AVERAGE_LAST={average_last_n}\n{body}\naverage_last {ckpt_dir}\n")
    return subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, cwd=ROOT)


def test_average_last_uses_the_last_checkpoint_when_the_cap_stopped_training_early(tmp_path):
    # the --minutes cap stopped training at update 1689, after one of the three save points (1600): averaging
    # checkpoint_1_1600.pt alone would throw away the last 89 updates
    (tmp_path / "checkpoint_1_1600.pt").write_bytes(b"update 1600")
    (tmp_path / "checkpoint_last.pt").write_bytes(b"update 1689")
    proc = _run_average_last(tmp_path, 3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "checkpoint_avg.pt").read_bytes() == b"update 1689"
    assert "training stopped before its last save points" in proc.stdout
