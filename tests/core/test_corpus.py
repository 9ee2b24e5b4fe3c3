"""The bundled corpus and the script that builds it from the Ding dictionary."""

import gzip
import os
import re

import pytest

from tools import build_ding_corpus as ding
from tests.helpers import ROOT, run_module

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "ding_sample.txt")
BUNDLED = os.path.join(ROOT, "data", "ding-de-en")

EXPECTED_PAIRS = [
    ("Bitte nehmen Sie Ihren Abfall mit.", "Please take your litter home."),
    ("Das Haus ist sehr alt.", "The house is very old."),
    ("Wir wohnen in einem Haus.", "We live in a house."),
    ("Er läuft jeden Morgen zur Arbeit.", "He runs to work every morning."),
    ("Sie läuft gern im Park.", "She likes running in the park."),
    ("Das ist ein ganz anderes Ding.", "That is a different thing altogether."),
    ("Ich habe eine Frage an Sie.", "I have a question for you."),
    ("Haben Sie eine Frage?", "Do you have a question?"),
    ("Mach bitte das Fenster zu!", "Please close the window!"),
    ("Es ist kalt hier drin.", "It is cold in here."),
    ("Ich lese gerade ein spannendes Buch.", "I am reading an exciting book."),
    ("Der Zug hat heute Verspätung.", "The train is late today."),
]


def read_gz(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def test_extraction_rules_on_fixture():
    # aligned sub-entries and alternatives, markup removed, placeholders / misaligned entries / non-sentences
    # dropped, the second translation of an already seen German sentence dropped
    with open(FIXTURE, encoding="utf-8") as f:
        pairs = ding.deduplicate(ding.sentence_pairs(f))
    assert pairs == EXPECTED_PAIRS


def test_builder_cli_on_fixture_is_deterministic(tmp_path):
    args = ["--dict", FIXTURE, "--valid-size", "2", "--test-size", "3", "--seed", "7", "--out"]
    outs = [tmp_path / "a", tmp_path / "b"]
    proc = run_module("tools.build_ding_corpus", args + [outs[0]])  # the real command line
    assert "train 7" in proc.stdout and "valid 2" in proc.stdout and "test 3" in proc.stdout
    ding.main(args + [str(outs[1])])
    got = set()
    for split, n in (("train", 7), ("valid", 2), ("test", 3)):
        de, en = read_gz(outs[0] / f"{split}.de.gz"), read_gz(outs[0] / f"{split}.en.gz")
        assert len(de) == len(en) == n
        got |= set(zip(de, en))
        for lang in ("de", "en"):  # byte-identical rebuild
            assert (outs[0] / f"{split}.{lang}.gz").read_bytes() == (outs[1] / f"{split}.{lang}.gz").read_bytes()
    assert got == set(EXPECTED_PAIRS)  # a partition of the pairs, still aligned
    provenance = (outs[0] / "PROVENANCE.md").read_text()
    assert "GNU General Public License" in provenance and "seed=7" in provenance


def test_builder_refuses_a_split_that_leaves_no_training_data(tmp_path):
    with pytest.raises(ValueError, match="leave nothing for training"):
        ding.main(["--dict", FIXTURE, "--out", str(tmp_path), "--valid-size", "6", "--test-size", "6"])


def test_bundled_corpus_matches_its_provenance():
    provenance = open(os.path.join(BUNDLED, "PROVENANCE.md"), encoding="utf-8").read()
    counts = dict(re.findall(r"(train|valid|test) (\d+)", provenance.split("Sentence pairs:")[1]))
    assert counts == {"train": "12797", "valid": "1000", "test": "1000"}
    assert "GPL" in open(os.path.join(BUNDLED, "COPYRIGHT.ding"), encoding="utf-8").read()
    seen_de = set()
    for split, n in counts.items():
        de, en = read_gz(os.path.join(BUNDLED, f"{split}.de.gz")), read_gz(os.path.join(BUNDLED, f"{split}.en.gz"))
        assert len(de) == len(en) == int(n)
        assert all(ding.is_sentence(s, 4) for s in de + en)
        assert not seen_de & {s.casefold() for s in de}, f"{split} shares sentences with an earlier split"
        seen_de |= {s.casefold() for s in de}


@pytest.mark.skipif(not os.path.isfile("/usr/share/trans/de-en"), reason="Debian package trans-de-en not installed")
def test_bundled_corpus_rebuilds_identically_from_the_installed_package(tmp_path):
    ding.main(["--dict", "/usr/share/trans/de-en", "--out", str(tmp_path)])
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            assert (tmp_path / f"{split}.{lang}.gz").read_bytes() == open(
                os.path.join(BUNDLED, f"{split}.{lang}.gz"), "rb").read()
