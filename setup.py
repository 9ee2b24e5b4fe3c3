import os
import re

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# the version is declared once, in fairseq_ext/__init__.py
with open(os.path.join(ROOT, "fairseq_ext", "__init__.py"), encoding="utf-8") as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)

# The runtime dependencies, loose (requirements.txt pins the versions tested, plus the test and plot tools).
# fairseq-fixed is fairseq 0.12 with Python 3.11 fixes (import name `fairseq`); build it without build isolation
# (`pip install --no-build-isolation --no-deps fairseq-fixed==0.12.3.1`, with torch, cython, numpy, setuptools
# and wheel installed first), or let install.sh do it. It declares torchaudio, which translation never imports:
# pip adds torchaudio (and with it a torch of its choice) unless torchaudio is installed already, so install
# this package with --no-deps when it is not (README, "Installing"). torch is declared loosely so that an
# installed CPU or CUDA torch satisfies it; install.sh installs everything with --no-deps under
# constraints.txt, so nothing here can pull a CUDA torch there.
INSTALL_REQUIRES = [
    "fairseq-fixed>=0.12.3.1,<0.13",
    "torch>=2.4",
    "numpy",
    "omegaconf>=2.3",
    "sacrebleu>=2.0",
    "sentencepiece",
    "transformers>=4.30",
]

setup(
    name="fairseq-ext",
    version=VERSION,
    description="Research NMT architectures (MSC, SAT, ConvS2S, BERT-JAM) as a fairseq --user-dir plugin",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE", "NOTICE"],
    packages=find_packages(include=["fairseq_ext", "fairseq_ext.*"]),
    python_requires=">=3.9",
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "test": ["pytest", "hypothesis"],
        "plot": ["matplotlib"],  # the MSC and SAT figure tools
        "moses": ["sacremoses"],  # BERT-JAM's optional detokenisation of Moses-tokenised input
        "bench": ["ctranslate2==4.8.5"],  # the CTranslate2 anchors of benchmarks/speed (no torch dependency)
    },
)
