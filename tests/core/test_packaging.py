"""The package outside the checkout: a LICENSE and a NOTICE for the fairseq-derived code,
a wheel built from the checkout declares the real runtime dependencies (Requires-Dist), holds every fairseq_ext
subpackage and nothing of tools/ or tests/, and once installed into another environment that has torch and
fairseq it registers our architectures with fairseq-train from any directory."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.helpers import ROOT

SUBPACKAGES = ("convs2s", "msc", "sat", "bert_jam")


def test_license_and_notice():
    setup = open(os.path.join(ROOT, "setup.py")).read()
    license_text = open(os.path.join(ROOT, "LICENSE")).read()
    notice = open(os.path.join(ROOT, "NOTICE")).read()
    assert license_text.startswith("MIT License") and 'license="MIT"' in setup
    # fairseq's MIT notice, and the files derived from fairseq named
    assert "Copyright (c) Facebook, Inc. and its affiliates." in notice and "Permission is hereby granted" in notice
    for path in ("fairseq_ext/convs2s/model.py", "fairseq_ext/convs2s/layers.py",
                 "fairseq_ext/common/decoder_features.py"):
        assert path in notice and os.path.isfile(os.path.join(ROOT, path)), path
    # the bundled corpus keeps its GPL notice
    assert "GNU General Public License, version 2 or later" in notice
    assert "GPL-2+" in open(os.path.join(ROOT, "data", "ding-de-en", "COPYRIGHT.ding")).read()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """`pip wheel --no-deps --no-build-isolation .` on a copy of the checkout (the build writes build/ and
    *.egg-info beside setup.py; other runs share the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for f in ("setup.py", "README.md", "LICENSE", "NOTICE"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("fairseq_ext", "tools", "tests"):  # tools/ and tests/ are there to be left out
        shutil.copytree(os.path.join(ROOT, d), src / d, ignore=ignore)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", ".", "-w",
                           str(tmp / "dist"), "-q"], cwd=src, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = glob.glob(str(tmp / "dist" / "*.whl"))
    return whl


def test_wheel_metadata_and_contents(wheel):
    z = zipfile.ZipFile(wheel)
    names = z.namelist()
    meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    runtime = {r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip()
               for r in requires if "extra ==" not in r}
    assert runtime >= {"fairseq-fixed", "torch", "sacrebleu", "sentencepiece", "transformers", "omegaconf"}
    assert "torch>=2.4" in requires  # loose: an installed CPU or CUDA torch satisfies it, nothing is re-downloaded
    assert not any("torchaudio" in r or r.startswith("torch==") for r in requires)
    assert "License: MIT" in meta
    assert any(n.endswith("licenses/LICENSE") for n in names) and any(n.endswith("licenses/NOTICE") for n in names)
    tops = {n.split("/")[0] for n in names}
    assert tops == {"fairseq_ext", "fairseq_ext-0.1.0.dist-info"}  # no tools/, tests/, data/
    for sub in SUBPACKAGES:
        assert f"fairseq_ext/{sub}/__init__.py" in names and f"fairseq_ext/{sub}/model.py" in names, sub
    for f in ("__init__.py", "__main__.py", "release.py", "average_checkpoints.py", "common/errors.py",
              "common/fairseq_fixes.py", "common/decoder_features.py", "common/building.py",
              "checkpoints/loading.py", "checkpoints/release.py", "checkpoints/average.py", "sat/generator.py",
              "sat/group_step.py", "inference/lean_decoder.py", "inference/speedups.py"):
        assert f"fairseq_ext/{f}" in names, f
    assert not [n for n in names if n.endswith((".c", ".cpp", ".so"))]  # no native code


@pytest.mark.slow
def test_wheel_installs_and_registers_with_fairseq(wheel, tmp_path):
    """The wheel, installed with --no-deps into a new venv that sees this environment's torch and fairseq (through a
    .pth line, as a user's environment with torch would), works from another directory: `python -m fairseq_ext`
    prints the installed package's folder, and fairseq-train with that --user-dir knows our architectures."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    # this environment's packages (torch, fairseq), after the venv's own; .pth files there (our editable install
    # of the checkout) are not processed for a path added this way
    with open(os.path.join(site, "_base_env.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q",
                           wheel], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    user_dir = subprocess.run([py, "-m", "fairseq_ext"], cwd=elsewhere, capture_output=True, text=True, env=env,
                              timeout=300)
    assert user_dir.returncode == 0, user_dir.stderr[-3000:]
    user_dir = user_dir.stdout.strip()
    assert user_dir == os.path.join(site, "fairseq_ext")  # the installed copy, not the checkout
    proc = subprocess.run([py, "-m", "fairseq_cli.train", "--user-dir", user_dir, "--arch", "nope"], cwd=elsewhere,
                          capture_output=True, text=True, env=env, timeout=300)
    assert "invalid choice: 'nope'" in proc.stderr, proc.stderr[-3000:]
    for arch in ("fconv_glu_iwslt_de_en", "msc_transformer_iwslt_de_en_72l", "sat_transformer_iwslt_de_en",
                 "bert_jam_iwslt_de_en"):
        assert arch in proc.stderr, arch
