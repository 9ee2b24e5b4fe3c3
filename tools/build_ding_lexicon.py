"""Build a German-English lexicon training set from the Ding dictionary (Debian ``trans-de-en``, GPL-2.0+): the
word and phrase entries beside the example sentences that tools/build_ding_corpus.py takes.

A Ding line is ``German sub-entries :: English sub-entries``; sub-entries (`` | ``) are aligned between the two
sides, a sub-entry lists alternatives separated by ``;``, markup sits in ``{}``, ``[]`` and ``<>``.

Pairing: from every aligned sub-entry we take ONE pair, the FIRST German alternative with the FIRST English
alternative (a ``;`` inside brackets or parentheses does not separate alternatives). Ding lists the main
translation first on each side; the further alternatives are synonyms, spelling variants and regional or register
variants (``sunglasses; shades [coll.]; sunnies [Aus.]``) whose order
does not correspond between the sides even when their counts match, so pairing the n-th with the n-th (or all
with all) would add many wrong pairs, and the synonyms would multiply near-identical lines. Lines whose two sides
have different numbers of sub-entries are skipped (not aligned).

Cleaning: ``clean()`` of build_ding_corpus (markup removed, NFC, whitespace), then parenthesised notes and
optional words removed (``Sonnendach (Aufbau)``, ``(sich) freuen``, ``to wash (oneself)``: the parentheses are
glosses or optional parts that the other side rarely mirrors) with the space before punctuation they leave.
Pairs empty on either side after cleaning are skipped, and so are the few with a bracket left over (unbalanced
markup, or entries about the bracket characters themselves).

Dropped: the example-sentence pairs that ``sentence_pairs()`` of build_ding_corpus finds (they are the material
of data/ding-de-en), pairs equal to a training pair of data/ding-de-en (case-folded), pairs whose German or
English side (case-folded, after the same cleaning) equals a valid or test sentence of data/ding-de-en in either
language, and repeated pairs (the first is kept). Order: the dictionary's line order. The same dictionary gives
byte-identical output.

Usage::

    python tools/build_ding_lexicon.py --out data/ding-lexicon-de-en            # apt-get download
    python tools/build_ding_lexicon.py --deb trans-de-en_1.9-6_all.deb --out DIR
    python tools/build_ding_lexicon.py --dict /usr/share/trans/de-en --out DIR

Outputs, in ``--out``: ``train.de.gz``, ``train.en.gz`` (line i of one translates line i of the other),
``PROVENANCE.md`` (source, sha256, counts, the command) and ``COPYRIGHT.ding`` (the Debian copyright file: GPL-2+;
from the .deb, or data/ding-de-en's copy with --dict). Training data only: no valid or test split.
"""

import argparse
import collections
import gzip
import io
import os
import re
import shlex
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for tools.*
from tools.build_ding_corpus import (  # noqa: E402
    add_source_args, aligned_subentries, clean, open_source, sentence_pairs, sha256, write_gz,
)

DEFAULT_DING_CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "ding-de-en")

_PARENS = re.compile(r"\([^()]*\)")
_BRACKETS = re.compile(r"[(){}\[\]<>]")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+(?=[,;:.!?])")
_SPACES = re.compile(r"\s+")


def read_gz(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def heldout_sentences(ding_corpus=DEFAULT_DING_CORPUS):
    """The German and English sentences of the Ding corpus's valid and test splits (a set, as in the files)."""
    out = set()
    for split in ("valid", "test"):
        for lang in ("de", "en"):
            path = os.path.join(ding_corpus, f"{split}.{lang}.gz")
            if not os.path.isfile(path):
                raise SystemExit(f"build_ding_lexicon: {path} is missing (--ding-corpus: the Ding corpus whose "
                                 "valid/test sentences are kept out)")
            out.update(read_gz(path))
    return out


def first_alternative(sub_entry):
    """The text before the first ``;`` that is outside brackets (a ``;`` may sit inside a note:
    ``Abbau {m} (Druck; Spannung)``)."""
    depth = 0
    for i, ch in enumerate(sub_entry):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth = max(0, depth - 1)
        elif ch == ";" and depth == 0:
            return sub_entry[:i]
    return sub_entry


def clean_entry(text):
    """clean(), then parenthesised notes/optional words removed and whitespace tidied."""
    text = clean(text)
    while True:
        stripped = _PARENS.sub(" ", text)
        if stripped == text:
            break
        text = stripped
    text = _SPACE_BEFORE_PUNCT.sub("", _SPACES.sub(" ", text)).strip()
    return text


def lexicon_pairs(lines, stats=None):
    """Yield (german, english) for each aligned sub-entry: first alternative with first alternative, cleaned."""
    stats = stats if stats is not None else collections.Counter()
    for de_subs, en_subs in aligned_subentries(lines, stats):
        for de_sub, en_sub in zip(de_subs, en_subs):
            stats["subentries"] += 1
            de, en = clean_entry(first_alternative(de_sub)), clean_entry(first_alternative(en_sub))
            if not (de and en):
                stats["dropped_empty"] += 1
            elif _BRACKETS.search(de) or _BRACKETS.search(en):
                stats["dropped_markup"] += 1
            else:
                yield de, en


def build_lexicon(lines, heldout=(), train_pairs=(), stats=None):
    """The kept pairs, in dictionary order (lines: the dictionary's lines, a list; heldout: valid/test sentences;
    train_pairs: the corpus's (german, english) training pairs)."""
    stats = stats if stats is not None else collections.Counter()
    heldout_keys = {s.casefold() for s in heldout} | {clean_entry(s).casefold() for s in heldout}
    sentence_keys = {(de.casefold(), en.casefold()) for de, en in sentence_pairs(lines)}
    train_keys = {(de.casefold(), en.casefold()) for de, en in train_pairs}
    seen, out = set(), []
    for de, en in lexicon_pairs(lines, stats):
        key = (de.casefold(), en.casefold())
        if (de, en) in seen:
            stats["dropped_duplicate"] += 1
        elif key[0] in heldout_keys or key[1] in heldout_keys:
            stats["dropped_heldout"] += 1
        elif key in sentence_keys or key in train_keys:
            stats["dropped_sentence"] += 1
        else:
            out.append((de, en))
        seen.add((de, en))
    return out


def build(dict_path, out_dir, ding_corpus=DEFAULT_DING_CORPUS, source_note="", copyright_path=None, command=None):
    if not os.path.isfile(dict_path):
        raise SystemExit(f"build_ding_lexicon: dictionary file '{dict_path}' does not exist")
    heldout = heldout_sentences(ding_corpus)
    train_pairs = list(zip(read_gz(os.path.join(ding_corpus, "train.de.gz")),
                           read_gz(os.path.join(ding_corpus, "train.en.gz"))))
    with io.open(dict_path, encoding="utf-8") as f:
        lines = f.readlines()
    stats = collections.Counter()
    pairs = build_lexicon(lines, heldout, train_pairs, stats)
    os.makedirs(out_dir, exist_ok=True)
    write_gz(os.path.join(out_dir, "train.de.gz"), [de for de, _ in pairs])
    write_gz(os.path.join(out_dir, "train.en.gz"), [en for _, en in pairs])
    if not (copyright_path and os.path.isfile(copyright_path)):
        copyright_path = os.path.join(ding_corpus, "COPYRIGHT.ding")
    if os.path.isfile(copyright_path):
        shutil.copyfile(copyright_path, os.path.join(out_dir, "COPYRIGHT.ding"))
    words_de = sum(len(de.split()) for de, _ in pairs)
    words_en = sum(len(en.split()) for _, en in pairs)
    one_word = sum(1 for de, en in pairs if len(de.split()) == 1 and len(en.split()) == 1)
    with open(os.path.join(out_dir, "PROVENANCE.md"), "w", encoding="utf-8") as f:
        f.write(
            "# Provenance of this corpus\n\n"
            "German-English word and phrase pairs (a lexicon) from the Ding dictionary by Frank Richter, TU Chemnitz\n"
            "(https://dict.tu-chemnitz.de/), as shipped in the Debian package `trans-de-en`: extra TRAINING data\n"
            "for data/ding-de-en (no valid or test split).\n"
            "License: GNU General Public License, version 2 or later (see COPYRIGHT.ding).\n\n"
            f"Source: {source_note or os.path.basename(dict_path)}\n"
            f"Dictionary sha256: {sha256(dict_path)}\n\n"
            f"Built by `{command or 'python tools/build_ding_lexicon.py'}`.\n\n"
            "Selection: per aligned sub-entry (` | `), the first German alternative with the first English one\n"
            "(`;`-separated alternatives are synonyms whose order does not correspond between the sides); markup\n"
            "in {} [] <> and parenthesised notes removed, NFC, whitespace normalised. Dropped: pairs with a bracket\n"
            "left over, the example-sentence pairs of data/ding-de-en's material, pairs whose German or English\n"
            "side equals a Ding valid/test sentence (case-folded, either language), repeated pairs.\n\n"
            f"Dictionary lines used: {stats['lines']} (skipped: {stats['lines_unaligned']} with unaligned "
            f"sub-entries, {stats['lines_malformed']} malformed); aligned sub-entries: {stats['subentries']}.\n"
            f"Dropped: {stats['dropped_empty']} empty after cleaning, {stats['dropped_markup']} with a bracket "
            f"left over, {stats['dropped_duplicate']} repeated, "
            f"{stats['dropped_sentence']} example-sentence pairs of the corpus, {stats['dropped_heldout']} equal "
            "to a Ding valid/test sentence.\n\n"
            f"Pairs: train {len(pairs)} ({one_word} of one word on both sides); words: German {words_de}, "
            f"English {words_en}.\n"
            "Files: train.{de,en}.gz, one entry per line, line i of .de translates line i of .en.\n"
        )
    return len(pairs), stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_args(p)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--ding-corpus", default=DEFAULT_DING_CORPUS,
                   help="the Ding sentence corpus whose valid/test sentences and training pairs are kept out "
                        "(default data/ding-de-en)")
    args = p.parse_args(argv)
    command = "python tools/build_ding_lexicon.py " + shlex.join(map(str, sys.argv[1:] if argv is None else argv))
    with tempfile.TemporaryDirectory() as tmp:
        dict_path, copyright_path, note = open_source(args, tmp, "build_ding_lexicon")
        n, _ = build(dict_path, args.out, args.ding_corpus, note, copyright_path, command)
    print(f"wrote {args.out}: train {n}")


if __name__ == "__main__":
    sys.exit(main())
