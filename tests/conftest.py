import os

# deterministic, quiet, offline test runs on 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("MKL_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the static decoder step traced, not compiled ahead of time in background processes for every tiny model of the
# suite (tests/inference/test_aot_step.py compiles on purpose, into its own cache)
os.environ.setdefault("FAIRSEQ_EXT_STEP_CAPTURE", "trace")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_TRANSFORMER = [
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny in-process models: one intra-op thread is faster than two fighting over a shared
    machine (use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_transformer_dir(tmp_path_factory):
    """Dummy data binarised, and fairseq's own ``transformer`` trained for 2 epochs through
    ``fairseq-train --user-dir fairseq_ext`` (checkpoint1.pt, checkpoint2.pt, checkpoint_last.pt)."""
    from tests.helpers import create_dummy_data, preprocess_translation_data, train_translation_model

    d = str(tmp_path_factory.mktemp("tiny_transformer"))
    create_dummy_data(d)
    preprocess_translation_data(d)
    train_translation_model(d, "transformer_iwslt_de_en", TINY_TRANSFORMER, max_epoch=2)
    return d


@pytest.fixture(scope="session")
def acts_bin(tmp_path_factory):
    """The Acts test set (data/bible-de-en) encoded with the release's BPE and binarised with its dictionary."""
    if not os.path.isfile(os.path.join(ROOT, "releases", "bible-de-en", "sat_transformer_k2.pt")):
        pytest.skip("no releases/bible-de-en/sat_transformer_k2.pt")
    from benchmarks.speed.speculative import acts_test_bin

    return acts_test_bin(str(tmp_path_factory.mktemp("acts")))


@pytest.fixture(scope="session")
def acts_en_de_bin(tmp_path_factory):
    """The Acts test set English -> German, encoded with the En->De release's BPE, binarised with its dictionary."""
    release = os.path.join(ROOT, "releases", "bible-en-de")
    if not os.path.isfile(os.path.join(release, "bert_jam.pt")):
        pytest.skip("no releases/bible-en-de/bert_jam.pt")
    from benchmarks.speed.speculative import acts_test_bin

    return acts_test_bin(str(tmp_path_factory.mktemp("acts_en_de")), release=release, src="en", tgt="de")


@pytest.fixture(scope="session")
def release_data(tmp_path_factory):
    """The De->En release's joined dictionary as a data directory's two dictionaries (for the hub)."""
    import shutil

    d = tmp_path_factory.mktemp("release_data")
    for lang in ("de", "en"):
        shutil.copyfile(os.path.join(ROOT, "releases", "bible-de-en", "dict.txt"), d / f"dict.{lang}.txt")
    return str(d)


# Fixtures that train a model or run a pipeline through the fairseq command lines: every test that uses one is
# part of the full suite only (`-m slow`), so that `pytest -m "not slow"` (the fast lane, README) stays a few
# minutes of unit tests and in-process checks.
TRAINING_FIXTURES = {
    "tiny_transformer_dir", "tiny_run", "run", "prepared", "genuine", "evil_transformer", "smoke", "server",
    "data", "data_dir", "trained", "runs", "wheel", "interactive_runs", "acts_bin", "acts_en_de_bin",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if TRAINING_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
