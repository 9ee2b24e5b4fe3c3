from setuptools import find_packages, setup

setup(
    name="fairseq-ext",
    version="0.1.0",
    description="Research NMT architectures (MSC, SAT, ConvS2S, BERT-JAM) as a fairseq --user-dir plugin",
    packages=find_packages(include=["fairseq_ext", "fairseq_ext.*"]),
    python_requires=">=3.9",
    # torch and fairseq-fixed are installed by install.sh (pinned CPU torch, fairseq built without
    # build isolation); requirements.txt pins the rest. Nothing is declared here so that `pip install -e .`
    # can never pull a CUDA torch or torchaudio.
    install_requires=[],
)
