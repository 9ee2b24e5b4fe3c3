"""Build the bundled German-English corpus from the Ding dictionary (Debian package ``trans-de-en``).

The Ding dictionary (Frank Richter, TU Chemnitz; GPL-2.0-or-later) has one entry per line::

    German alternatives | sub-entry | ... :: English alternatives | sub-entry | ...

Sub-entries (``|``) are aligned between the two sides, alternatives inside a sub-entry are separated by
``;``, and markup sits in ``{}``, ``[]`` and ``<>``. Many sub-entries are example sentences. We keep the aligned
pairs that are sentences on both sides (>= 4 words, ending in ``.``, ``!`` or ``?``), drop pairs with
dictionary placeholders (``etw.``, ``jdm.``, ``sth.``, ``sb.``, ``…``, ``/``), deduplicate (a German or English
sentence seen before drops the pair, so no sentence of the test set appears in training), shuffle with a fixed
seed and split off valid and test sets.

Usage::

    python tools/build_ding_corpus.py --out data/ding-de-en            # apt-get download
    python tools/build_ding_corpus.py --deb trans-de-en_1.9-6_all.deb --out DIR
    python tools/build_ding_corpus.py --dict /usr/share/trans/de-en --out DIR
"""

import argparse
import gzip
import hashlib
import io
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import unicodedata

DICT_PATH_IN_DEB = "usr/share/trans/de-en"
COPYRIGHT_IN_DEB = "usr/share/doc/trans-de-en/copyright"

_MARKUP = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]|<[^<>]*>")
_SPACES = re.compile(r"\s+")
_PLACEHOLDERS = re.compile(r"(^|\W)(etw|jdm|jdn|jds|jd|sth|sb|sb's)\.(\W|$)|…|\.\.\.|/|~|\+")
_SENTENCE_END = ("." , "!", "?")


def clean(text):
    """Remove Ding markup and normalise Unicode (NFC) and whitespace."""
    text = _MARKUP.sub(" ", text)
    text = unicodedata.normalize("NFC", text)
    return _SPACES.sub(" ", text).strip()


def is_sentence(text, min_words):
    return (
        len(text.split()) >= min_words
        and text.endswith(_SENTENCE_END)
        and text[0].isupper()
        and _PLACEHOLDERS.search(text) is None
    )


def aligned_subentries(lines, stats=None):
    """Yield (German sub-entries, English sub-entries) of each dictionary line whose sub-entries (`` | ``) align
    one to one, in file order; comments and blank lines are skipped. STATS (a Counter), when given, counts
    ``lines`` (yielded), ``lines_malformed`` (no single `` :: ``) and ``lines_unaligned``."""
    for line in lines:
        line = line.rstrip("\n")
        if not line or line.startswith("#"):
            continue
        sides = line.split(" :: ")
        if len(sides) != 2:
            if stats is not None:
                stats["lines_malformed"] += 1
            continue
        de_subs, en_subs = sides[0].split(" | "), sides[1].split(" | ")
        if len(de_subs) != len(en_subs):
            if stats is not None:
                stats["lines_unaligned"] += 1
            continue
        if stats is not None:
            stats["lines"] += 1
        yield de_subs, en_subs


def sentence_pairs(lines, min_words=4):
    """Yield (german, english) sentence pairs from Ding dictionary lines, in file order."""
    for de_subs, en_subs in aligned_subentries(lines):
        for de_sub, en_sub in zip(de_subs, en_subs):
            de_alts = [clean(a) for a in de_sub.split(";")]
            en_alts = [clean(a) for a in en_sub.split(";")]
            if len(de_alts) != len(en_alts):
                continue  # alternatives not aligned one to one
            for de, en in zip(de_alts, en_alts):
                if is_sentence(de, min_words) and is_sentence(en, min_words):
                    yield de, en


def deduplicate(pairs):
    """Keep a pair only if neither its German nor its English side (case-folded) was seen before."""
    seen_de, seen_en, out = set(), set(), []
    for de, en in pairs:
        kde, ken = de.casefold(), en.casefold()
        if kde in seen_de or ken in seen_en:
            continue
        seen_de.add(kde)
        seen_en.add(ken)
        out.append((de, en))
    return out


def split(pairs, seed, valid_size, test_size):
    if len(pairs) <= valid_size + test_size:
        raise ValueError(
            f"only {len(pairs)} sentence pairs found; --valid-size {valid_size} + --test-size {test_size} "
            "leave nothing for training"
        )
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    shuffled = [pairs[i] for i in order]
    return {
        "test": shuffled[:test_size],
        "valid": shuffled[test_size:test_size + valid_size],
        "train": shuffled[test_size + valid_size:],
    }


def write_gz(path, lines):
    # mtime=0 and no file name in the header: rebuilding gives byte-identical files
    with open(path, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
            gz.write("".join(line + "\n" for line in lines).encode("utf-8"))


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def extract_deb(deb, workdir):
    if shutil.which("dpkg-deb") is None:
        raise SystemExit("build_ding_corpus: dpkg-deb is needed to unpack --deb; use --dict with the unpacked file")
    subprocess.run(["dpkg-deb", "-x", deb, workdir], check=True)
    return os.path.join(workdir, DICT_PATH_IN_DEB), os.path.join(workdir, COPYRIGHT_IN_DEB)


def download_deb(workdir):
    try:
        subprocess.run(["apt-get", "download", "trans-de-en"], cwd=workdir, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
            f"build_ding_corpus: 'apt-get download trans-de-en' failed ({e}); run 'apt-get update' first, "
            "or pass --deb FILE or --dict FILE"
        )
    debs = [f for f in os.listdir(workdir) if f.startswith("trans-de-en_") and f.endswith(".deb")]
    return os.path.join(workdir, debs[0])


def build(dict_path, out_dir, seed=1, valid_size=1000, test_size=1000, min_words=4,
          source_note="", copyright_path=None):
    if not os.path.isfile(dict_path):
        raise SystemExit(f"build_ding_corpus: dictionary file '{dict_path}' does not exist")
    with io.open(dict_path, encoding="utf-8") as f:
        pairs = deduplicate(sentence_pairs(f, min_words=min_words))
    splits = split(pairs, seed, valid_size, test_size)
    os.makedirs(out_dir, exist_ok=True)
    for name, subset in splits.items():
        write_gz(os.path.join(out_dir, f"{name}.de.gz"), [de for de, _ in subset])
        write_gz(os.path.join(out_dir, f"{name}.en.gz"), [en for _, en in subset])
    if copyright_path and os.path.isfile(copyright_path):
        shutil.copyfile(copyright_path, os.path.join(out_dir, "COPYRIGHT.ding"))
    counts = {k: len(v) for k, v in splits.items()}
    with open(os.path.join(out_dir, "PROVENANCE.md"), "w", encoding="utf-8") as f:
        f.write(
            "# Provenance of this corpus\n\n"
            "German-English example sentences from the Ding dictionary by Frank Richter, TU Chemnitz\n"
            "(https://dict.tu-chemnitz.de/), as shipped in the Debian package `trans-de-en`.\n"
            "License: GNU General Public License, version 2 or later (see COPYRIGHT.ding).\n\n"
            f"Source: {source_note or dict_path}\n"
            f"Dictionary sha256: {sha256(dict_path)}\n\n"
            "Built by `python tools/build_ding_corpus.py` with "
            f"seed={seed}, min_words={min_words}, valid_size={valid_size}, test_size={test_size}.\n\n"
            f"Sentence pairs: train {counts['train']}, valid {counts['valid']}, test {counts['test']}.\n"
            "Files: {train,valid,test}.{de,en}.gz, one sentence per line, line i of .de translates line i of .en.\n"
        )
    return counts


def add_source_args(parser, deb_help="the trans-de-en .deb file (default: apt-get download)"):
    """--dict / --deb: where the Ding dictionary comes from (shared with build_ding_lexicon)."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--dict", help="the unpacked dictionary file (usr/share/trans/de-en)")
    src.add_argument("--deb", help=deb_help)


def open_source(args, tmp, tool):
    """(dictionary path, copyright path or None, provenance note) from --dict, --deb or apt-get download into
    TMP; TOOL names the tool in the error for a missing --deb."""
    if args.dict:
        return args.dict, None, f"dictionary file {os.path.basename(args.dict)}"
    deb = args.deb or download_deb(tmp)
    if not os.path.isfile(deb):
        raise SystemExit(f"{tool}: --deb '{deb}' does not exist")
    dict_path, copyright_path = extract_deb(deb, tmp)
    return dict_path, copyright_path, f"Debian package file {os.path.basename(deb)} (sha256 {sha256(deb)})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_args(p)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--valid-size", type=int, default=1000)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--min-words", type=int, default=4)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dict_path, copyright_path, note = open_source(args, tmp, "build_ding_corpus")
        counts = build(dict_path, args.out, args.seed, args.valid_size, args.test_size, args.min_words,
                       note, copyright_path)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    sys.exit(main())
