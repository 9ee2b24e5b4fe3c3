"""Extra training data for the Ding corpus: tools/build_ding_lexicon.py (the dictionary's word and phrase entries),
tools/build_libreoffice_corpus.py (LibreOffice help paragraphs aligned by their anchors), the bundled
data/ding-lexicon-de-en and data/libreoffice-help-de-en, and prepare_bundled_corpus --extra-train. The builders
run on small inline samples here; no download, no training."""

import collections
import gzip
import os
import re
import shutil

import pytest

from tools import build_ding_lexicon as lexicon
from tools import build_libreoffice_corpus as libreoffice
from tools import prepare_bundled_corpus as prepare
from tests.helpers import ROOT, run_module

DING = os.path.join(ROOT, "data", "ding-de-en")
LEXICON = os.path.join(ROOT, "data", "ding-lexicon-de-en")
HELP = os.path.join(ROOT, "data", "libreoffice-help-de-en")


def read_gz(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


def write_gz(path, lines):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def without_built_by(path):
    with open(path, encoding="utf-8") as f:
        return re.sub(r"^Built by .*$", "", f.read(), flags=re.M)  # the line names --out


# --- the Ding lexicon -------------------------------------------------------------------------------------------

DICT_LINES = [
    "# Version :: devel 2023-01-30\n",
    "Sonnenbräune {f}; Bräune {f} | eine tiefe Bräune haben :: suntan; tan | to have a deep tan; to be tanned\n",
    "Sonnendach {n} (Aufbau) | Sonnendächer {pl} :: canopy top | canopy tops\n",
    "(sich) waschen {vr} [ugs.] | er wäscht (sich) :: to wash (oneself) <washing> | he washes (himself), quickly\n",
    "Haus {n} | Häuser {pl} :: house | houses | homes\n",  # 2 German sub-entries, 3 English: not aligned
    "krank {adj} | Er ist schon lange krank. :: ill; sick | He has been ill for a long time.\n",  # an example sentence
    "Dank {m} | Vielen Dank! :: thanks | Thank you very much!\n",  # English side = a test sentence
    "Wetter {n} | schönes Wetter :: weather | Nice weather today.\n",  # = a training pair, case-folded
    "Abbau {m} (Druck; Spannung); Verringerung {f} :: reduction (of pressure; of stress); decrease\n",
    "öffnende runde Klammer /(/ :: opening round bracket\n",  # a bracket left over after cleaning
    "Sonnendach {n} :: canopy top\n",  # repeated
    "{m} :: [coll.]\n",  # empty after cleaning
    "Kein Trenner hier\n",
]
# the tiny Ding corpus the sample is checked against: its valid/test sentences and training pairs stay out
CORPUS = {
    "train": (["SCHÖNES WETTER"], ["nice weather today."]),
    "valid": (["Ein Satz im Validierungsset."], ["A sentence of the valid set."]),
    "test": (["SONNENDÄCHER"], ["Thank you very much!"]),  # a German side equal to a lexicon entry, case-folded
}
LEXICON_EXPECTED = [
    ("Sonnenbräune", "suntan"),
    ("eine tiefe Bräune haben", "to have a deep tan"),
    ("Sonnendach", "canopy top"),
    ("waschen", "to wash"),
    ("er wäscht", "he washes, quickly"),
    ("krank", "ill"),
    ("Dank", "thanks"),
    ("Wetter", "weather"),
    ("Abbau", "reduction"),
]


def make_ding_corpus(d):
    os.makedirs(d, exist_ok=True)
    for split, (de, en) in CORPUS.items():
        write_gz(os.path.join(d, f"{split}.de.gz"), de)
        write_gz(os.path.join(d, f"{split}.en.gz"), en)
    shutil.copyfile(os.path.join(DING, "COPYRIGHT.ding"), os.path.join(d, "COPYRIGHT.ding"))
    return d


def test_lexicon_pairs_first_alternatives_cleaned():
    stats = collections.Counter()
    pairs = list(lexicon.lexicon_pairs(DICT_LINES, stats))
    assert pairs == [
        ("Sonnenbräune", "suntan"), ("eine tiefe Bräune haben", "to have a deep tan"),
        ("Sonnendach", "canopy top"), ("Sonnendächer", "canopy tops"),
        ("waschen", "to wash"), ("er wäscht", "he washes, quickly"),
        ("krank", "ill"), ("Er ist schon lange krank.", "He has been ill for a long time."),
        ("Dank", "thanks"), ("Vielen Dank!", "Thank you very much!"),
        ("Wetter", "weather"), ("schönes Wetter", "Nice weather today."),
        ("Abbau", "reduction"),
        ("Sonnendach", "canopy top"),
    ]
    assert (stats["lines"], stats["subentries"], stats["lines_unaligned"], stats["lines_malformed"],
            stats["dropped_empty"], stats["dropped_markup"]) == (10, 16, 1, 1, 1, 1)
    assert lexicon.clean_entry("Tee {m} (schwarz) ((alt)) [Br.]  ,  gut") == "Tee, gut"


def test_lexicon_drops_heldout_sentences_corpus_pairs_and_repeats():
    stats = collections.Counter()
    heldout = {"SONNENDÄCHER", "Thank you very much!"}
    pairs = lexicon.build_lexicon(DICT_LINES, heldout, [("SCHÖNES WETTER", "nice weather today.")], stats)
    assert pairs == LEXICON_EXPECTED
    # Sonnendächer (German = a test sentence), Vielen Dank! (English = a test sentence); the example sentence
    # (sentence_pairs of build_ding_corpus) and the training pair; the second Sonnendach
    assert (stats["dropped_heldout"], stats["dropped_sentence"], stats["dropped_duplicate"]) == (2, 2, 1)
    # without the held-out sentences and the training pair, those entries stay
    assert ("Vielen Dank!", "Thank you very much!") in lexicon.build_lexicon(DICT_LINES)
    assert ("schönes Wetter", "Nice weather today.") in lexicon.build_lexicon(DICT_LINES)
    assert ("Er ist schon lange krank.", "He has been ill for a long time.") not in lexicon.build_lexicon(DICT_LINES)


def test_lexicon_builder_output_is_deterministic(tmp_path):
    corpus = make_ding_corpus(str(tmp_path / "ding"))
    dict_path = tmp_path / "de-en"
    dict_path.write_text("".join(DICT_LINES), encoding="utf-8")
    a, b = tmp_path / "a", tmp_path / "b"
    proc = run_module("tools.build_ding_lexicon", ["--dict", dict_path, "--out", a, "--ding-corpus", corpus])
    assert proc.stdout.strip() == f"wrote {a}: train 9"
    lexicon.main(["--dict", str(dict_path), "--out", str(b), "--ding-corpus", corpus])
    assert list(zip(read_gz(a / "train.de.gz"), read_gz(a / "train.en.gz"))) == LEXICON_EXPECTED
    for name in ("train.de.gz", "train.en.gz", "COPYRIGHT.ding"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert without_built_by(a / "PROVENANCE.md") == without_built_by(b / "PROVENANCE.md")
    text = (a / "PROVENANCE.md").read_text(encoding="utf-8")
    assert "Pairs: train 9 (5 of one word on both sides); words: German 13, English 17." in text
    assert f"Built by `python tools/build_ding_lexicon.py --dict {dict_path} --out {a} --ding-corpus {corpus}`" \
        in text
    assert "2 equal to a Ding valid/test sentence" in text
    assert "GNU General Public License, version 2 or later" in text
    assert (a / "COPYRIGHT.ding").read_bytes() == open(os.path.join(DING, "COPYRIGHT.ding"), "rb").read()


# --- the LibreOffice help -----------------------------------------------------------------------------------------

DE_PAGE = """<!DOCTYPE html>
<html lang="de"><head><meta charset="utf-8"><title>Titel</title>
<script type="text/javascript">var s = "<p id='par_id90'>Skript im Kopf</p>";</script></head>
<body><div id="DisplayArea">
<h1 id="hd_id1" dir="auto">Tabellen &amp; Diagramme &#x2013; Überblick</h1>
<p id="par_id2" class="paragraph">Wa\u0308hlen Sie <span id="swln_1" class="switchinline"><span hidden="true"
id="MACtext_1" class="MAC"><span class="emph">LibreOffice – Einstellungen</span></span><span hidden="true"
id="defaulttext_1"><span class="emph">Extras – Optionen</span></span></span> und&nbsp;klicken Sie<br>auf <a
href="x.html"><b>OK</b></a>.</p>
<table><tr><td><p id="par_id3" class="paragraphintable">Zelle   mit
  Text und <span class="switchinline"><span hidden="true" id="CALCtext_2" class="CALC">Calc</span><span hidden="true"
id="WRITERtext_2" class="WRITER">Writer</span></span> darin</p></td></tr></table>
<p id="par_id4">Zwei Wörter</p>
<p id="par_id5">LibreOffice Basic IDE</p>
<p id="par_id6">Nur im Deutschen vorhanden.</p>
<p id="par_id7">Erste Fassung des Absatzes hier.</p>
<p id="par_id7">Zweite Fassung des Absatzes hier.</p>
<p id="par_id8">Vielen Dank für alles!</p>
<p class="embedded">Ohne Anker wird dieser Absatz nicht verwendet.</p>
<p id="bm_id10">Kein par_id-Anker hier.</p>
</div></body></html>
"""
EN_PAGE = """<!DOCTYPE html>
<html lang="en-US"><head><meta charset="utf-8"><title>Title</title></head>
<body><div id="DisplayArea">
<h1 id="hd_id1" dir="auto">Tables &amp; Charts &#8211; Overview</h1>
<p id="par_id2" class="paragraph">Choose <span id="swln_1" class="switchinline"><span hidden="true" id="MACtext_1"
class="MAC"><span class="emph">LibreOffice - Preferences</span></span><span hidden="true" id="defaulttext_1"><span
class="emph">Tools - Options</span></span></span> and click<br/>on <a href="x.html"><b>OK</b></a>.</p>
<table><tr><td><p id="par_id3" class="paragraphintable">Cell with text and <span class="switchinline"><span
hidden="true" id="CALCtext_2" class="CALC">Calc</span><span hidden="true" id="WRITERtext_2"
class="WRITER">Writer</span></span> in it</p></td></tr></table>
<p id="par_id4">Two words</p>
<p id="par_id5">LibreOffice Basic IDE</p>
<p id="par_id7">Version of the paragraph here.</p>
<p id="par_id8">Thank you for everything!</p>
<p id="par_id11">Only in the English page.</p>
</div></body></html>
"""
# a second page: one pair repeats a pair of the first page, one is new
DE_PAGE2 = ('<html><body><p id="par_id1">Wählen Sie Extras – Optionen und klicken Sie auf OK.</p>\n'
            '<h2 id="hd_id2">Ein &quot;neuer&quot; Abschnitt <i>mit <b>Fett</b></i></h2></body></html>\n')
EN_PAGE2 = ('<html><body><p id="par_id1">Choose Tools - Options and click on OK.</p>\n'
            '<h2 id="hd_id2">A &quot;new&quot; section <i>with <b>bold</b></i></h2></body></html>\n')
HELP_EXPECTED = [
    ("Tabellen & Diagramme – Überblick", "Tables & Charts – Overview"),
    ("Wählen Sie Extras – Optionen und klicken Sie auf OK.", "Choose Tools - Options and click on OK."),
    ("Zelle mit Text und Calc darin", "Cell with text and Calc in it"),
    ('Ein "neuer" Abschnitt mit Fett', 'A "new" section with bold'),
]


def make_help_dirs(root):
    pages = {"de": {"text/a.html": DE_PAGE, "text/sub/b.html": DE_PAGE2, "text/only_de.html": DE_PAGE2},
             "en": {"text/a.html": EN_PAGE, "text/sub/b.html": EN_PAGE2}}
    dirs = {}
    for lang, files in pages.items():
        dirs[lang] = os.path.join(root, lang)
        for rel, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(dirs[lang], rel)), exist_ok=True)
            with open(os.path.join(dirs[lang], rel), "w", encoding="utf-8") as f:
                f.write(text)
    return dirs["de"], dirs["en"]


def test_help_paragraphs_strip_html_and_pick_the_default_variant():
    assert libreoffice.paragraphs(DE_PAGE) == [
        ("hd_id1", "Tabellen & Diagramme – Überblick"),
        ("par_id2", "Wählen Sie Extras – Optionen und klicken Sie auf OK."),
        ("par_id3", "Zelle mit Text und Calc darin"),  # no default variant: the first
        ("par_id4", "Zwei Wörter"),
        ("par_id5", "LibreOffice Basic IDE"),
        ("par_id6", "Nur im Deutschen vorhanden."),
        ("par_id7", "Erste Fassung des Absatzes hier."),
        ("par_id7", "Zweite Fassung des Absatzes hier."),
        ("par_id8", "Vielen Dank für alles!"),
    ]
    stats = collections.Counter()
    # par_id7 has two German texts (ambiguous), par_id6 only German, par_id11 only English
    assert libreoffice.aligned_pairs(DE_PAGE, EN_PAGE, stats) == [
        HELP_EXPECTED[0], HELP_EXPECTED[1], HELP_EXPECTED[2],
        ("Zwei Wörter", "Two words"), ("LibreOffice Basic IDE", "LibreOffice Basic IDE"),
        ("Vielen Dank für alles!", "Thank you for everything!"),
    ]
    assert (stats["anchors_ambiguous"], stats["anchors_unmatched"]) == (1, 3)
    # a nested anchor is listed too, and its text is part of the outer one
    assert libreoffice.paragraphs('<div id="hd_id1">Kopf<p id="par_id2">Innen</p></div>') == [
        ("hd_id1", "Kopf Innen"), ("par_id2", "Innen")]


def test_help_corpus_filters_and_is_deterministic(tmp_path):
    de_dir, en_dir = make_help_dirs(str(tmp_path / "help"))
    assert libreoffice.help_files(de_dir, en_dir) == ["text/a.html", "text/sub/b.html"]
    pairs, stats = libreoffice.collect(de_dir, en_dir, heldout={"THANK YOU FOR EVERYTHING!"})
    assert pairs == HELP_EXPECTED
    assert (stats["files"], stats["aligned"], stats["dropped_duplicate"], stats["dropped_length"],
            stats["dropped_identical"], stats["dropped_heldout"]) == (2, 8, 1, 1, 1, 1)
    assert libreoffice.collect(de_dir, en_dir, min_words=6, max_words=7)[0] == [HELP_EXPECTED[2]]
    corpus = make_ding_corpus(str(tmp_path / "ding"))
    write_gz(os.path.join(corpus, "valid.en.gz"), ["Thank you for everything!"])
    a, b = tmp_path / "a", tmp_path / "b"
    proc = run_module("tools.build_libreoffice_corpus",
                      ["--de-dir", de_dir, "--en-dir", en_dir, "--out", a, "--ding-corpus", corpus])
    assert proc.stdout.strip() == f"wrote {a}: train 4"
    libreoffice.main(["--de-dir", de_dir, "--en-dir", en_dir, "--out", str(b), "--ding-corpus", corpus])
    assert list(zip(read_gz(a / "train.de.gz"), read_gz(a / "train.en.gz"))) == HELP_EXPECTED
    for name in ("train.de.gz", "train.en.gz"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert without_built_by(a / "PROVENANCE.md") == without_built_by(b / "PROVENANCE.md")
    text = (a / "PROVENANCE.md").read_text(encoding="utf-8")
    assert "Pairs: train 4; words: German 26, English 25." in text and "MPL-2.0" in text
    assert "1 equal to a Ding valid/test sentence" in text
    assert (a / "LICENSE.MPL-2.0").exists() == os.path.isfile(libreoffice.MPL_TEXT)


# --- the bundled data ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ding_heldout():
    return {s.casefold() for s in lexicon.heldout_sentences(DING)}


@pytest.mark.parametrize("bundled, licences, n_pairs", [
    (LEXICON, {"COPYRIGHT.ding": "License: GPL-2+"}, 374124),
    (HELP, {"COPYRIGHT.libreoffice": "License: MPL-2.0", "LICENSE.MPL-2.0": "Mozilla Public License Version 2.0"},
     27417),
])
def test_bundled_extra_training_data(bundled, licences, n_pairs, ding_heldout):
    assert sorted(os.listdir(bundled)) == sorted(["PROVENANCE.md", "train.de.gz", "train.en.gz", *licences])
    for name, needle in licences.items():
        with open(os.path.join(bundled, name), encoding="utf-8") as f:
            assert needle in f.read(), name
    with open(os.path.join(bundled, "PROVENANCE.md"), encoding="utf-8") as f:
        provenance = f.read()
    n = int(re.search(r"^Pairs: train (\d+)", provenance, re.M).group(1))
    assert n == n_pairs
    assert re.search(r"\.deb`? \(sha256 [0-9a-f]{64}\)", provenance)
    assert re.search(r"^Built by `python tools/build_\w+\.py --out data/[\w-]+`\.$", provenance, re.M)
    de, en = read_gz(os.path.join(bundled, "train.de.gz")), read_gz(os.path.join(bundled, "train.en.gz"))
    assert len(de) == len(en) == n
    assert all(d and e and d == d.strip() and e == e.strip() for d, e in zip(de, en))
    assert len(set(zip(de, en))) == n  # no repeated pair
    leaks = [s for s in de + en if s.casefold() in ding_heldout]
    assert leaks == []
    ding_train = set(zip(*(read_gz(os.path.join(DING, f"train.{lang}.gz")) for lang in ("de", "en"))))
    assert not ding_train & set(zip(de, en))
    if bundled == LEXICON:  # markup and parenthesised notes removed
        assert not [s for s in de + en if re.search(r"[{}\[\]<>()]", s)]
    assert open(os.path.join(bundled, "train.en.gz"), "rb").read(8)[4:8] == b"\0\0\0\0"  # mtime 0: reproducible


# --- prepare_bundled_corpus --extra-train -------------------------------------------------------------------------

WORDS = "haus baum auto katze hund rot blau gross klein alt neu".split()


def make_parallel(d, splits, n, tag):
    os.makedirs(d, exist_ok=True)
    for split in splits:
        de = [f"{tag} {split} {WORDS[i % len(WORDS)]} {WORDS[(3 * i) % len(WORDS)]} {i}" for i in range(n)]
        write_gz(os.path.join(d, f"{split}.de.gz"), de)
        write_gz(os.path.join(d, f"{split}.en.gz"), [s.upper() for s in de])
    return d


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def test_prepare_appends_extra_training_data_and_refuses_another_extra_set(tmp_path, capsys):
    assert prepare.resolve_extra_train("ding-lexicon") == LEXICON
    assert prepare.resolve_extra_train("libreoffice-help") == HELP
    corpus = make_parallel(str(tmp_path / "corpus"), ("train", "valid", "test"), 20, "korpus")
    lex = make_parallel(str(tmp_path / "lex"), ("train",), 5, "lex")
    help_ = make_parallel(str(tmp_path / "help"), ("train",), 3, "größe")  # ö: only in the extra data
    out = str(tmp_path / "out")
    argv = ["--corpus", corpus, "--out", out, "--vocab-size", "60", "--extra-train", lex, help_]
    prepare.main(argv)
    assert capsys.readouterr().out.strip().endswith(
        "train 28, valid 20, test 20 sentence pairs; joint sentencepiece BPE 60; "
        "extra training data lex (5 pairs), help (3 pairs)")
    for lang in ("de", "en"):
        assert read(os.path.join(out, f"train.{lang}")) == (
            read_gz(os.path.join(corpus, f"train.{lang}.gz")) + read_gz(os.path.join(lex, f"train.{lang}.gz"))
            + read_gz(os.path.join(help_, f"train.{lang}.gz")))
        assert len(read(os.path.join(out, f"train.spm.{lang}"))) == 28
        assert read(os.path.join(out, f"valid.{lang}")) == read_gz(os.path.join(corpus, f"valid.{lang}.gz"))
    # the BPE was learned on the combined training text: it has the extra data's own letter
    with open(os.path.join(out, "spm.vocab"), encoding="utf-8") as f:
        assert "ö" in {line.split("\t")[0] for line in f}
    with open(os.path.join(out, "train.extra"), encoding="utf-8") as f:
        assert [line.split("\t")[:2] for line in f] == [["lex", "5"], ["help", "3"]]
    prepare.main(argv)  # the same extra set: reused
    for other in ([], ["--extra-train", help_, lex], ["--extra-train", lex]):
        with pytest.raises(SystemExit, match="its extra training data is lex \\(5 pairs\\), help \\(3 pairs\\)"):
            prepare.main(argv[:6] + other)
    write_gz(os.path.join(lex, "train.de.gz"), ["geändert"] * 5)  # the same name, other content
    with pytest.raises(SystemExit, match="or their files changed"):
        prepare.main(argv)
    # without --extra-train: the corpus alone, no train.extra; such an --out refuses an extra set
    plain = str(tmp_path / "plain")
    prepare.main(["--corpus", corpus, "--out", plain, "--vocab-size", "60"])
    assert read(os.path.join(plain, "train.de")) == read_gz(os.path.join(corpus, "train.de.gz"))
    assert not os.path.exists(os.path.join(plain, "train.extra"))
    with pytest.raises(SystemExit, match="its extra training data is none, not --extra-train help \\(3 pairs\\)"):
        prepare.main(["--corpus", corpus, "--out", plain, "--vocab-size", "60", "--extra-train", help_])
    os.remove(os.path.join(help_, "train.en.gz"))
    with pytest.raises(SystemExit, match="train.en.gz is missing"):
        prepare.main(["--corpus", corpus, "--out", str(tmp_path / "x"), "--extra-train", help_])
    with pytest.raises(SystemExit, match="neither ding-lexicon, libreoffice-help nor a directory"):
        prepare.main(["--corpus", corpus, "--out", str(tmp_path / "x"), "--extra-train", str(tmp_path / "nope")])
