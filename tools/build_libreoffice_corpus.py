"""Build German-English paragraph pairs from the LibreOffice help (Debian ``libreoffice-help-de`` and
``libreoffice-help-en-us``, LibreOffice 7.4.7, MPL-2.0): extra training data for the Ding corpus.

Each package holds the help as one HTML file per page (``usr/share/libreoffice/help/{de,en-US}/text/...``), the
same file names in both languages. Headings and paragraphs carry anchors ``id="par_id..."`` / ``id="hd_id..."``
that both languages share within the same help file, so ``(file, anchor)`` aligns them. Per anchored element we
take its text: tags removed (block tags and ``<br>`` become spaces), entities decoded, ``<script>``/``<style>``
dropped, and of the hidden variants of a switch (``<span hidden id="MAC...">``/``"CALC..."``/``"default..."``,
which the help's JavaScript picks from by system or module) only the ``default...`` one, or the first variant
when there is no default; then Unicode NFC and whitespace normalised. An anchor is used when it occurs in the
German and the English file of the same page, and with one text per language (anchors repeated with different
texts within one file are ambiguous and dropped). A pair is kept when both sides have ``--min-words`` to
``--max-words`` words (default 3-60), the two sides differ (identical sides are untranslated text or code),
neither side (case-folded) equals a sentence of the Ding valid or test set (data/ding-de-en, either language),
and the pair was not seen before (exact duplicates dropped, the first kept). Order: help files sorted by path,
anchors in English document order. The same input gives byte-identical output.

Usage::

    python tools/build_libreoffice_corpus.py --out data/libreoffice-help-de-en        # apt-get download
    python tools/build_libreoffice_corpus.py --de-deb DE.deb --en-deb EN-US.deb --out DIR   # given .debs
    python tools/build_libreoffice_corpus.py --de-dir .../help/de --en-dir .../help/en-US --out DIR

Outputs, in ``--out``: ``train.de.gz``, ``train.en.gz`` (line i of one translates line i of the other),
``PROVENANCE.md`` (sources, sha256, counts, the command), ``COPYRIGHT.libreoffice`` (the packages' Debian
copyright file, when built from the .debs) and ``LICENSE.MPL-2.0`` (the licence text, from
/usr/share/common-licenses when the machine has it). Training data only: no valid or test split.
"""

import argparse
import collections
import html.parser
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for tools.*
from tools.build_ding_corpus import sha256, write_gz  # noqa: E402  (file hash, deterministic gzip)
from tools.build_ding_lexicon import DEFAULT_DING_CORPUS, heldout_sentences  # noqa: E402

PACKAGES = {"de": "libreoffice-help-de", "en": "libreoffice-help-en-us"}
HELP_DIR_IN_DEB = {"de": "usr/share/libreoffice/help/de", "en": "usr/share/libreoffice/help/en-US"}
MPL_TEXT = "/usr/share/common-licenses/MPL-2.0"

_ANCHOR = re.compile(r"^(par|hd)_id")
_SPACES = re.compile(r"\s+")
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track",
         "wbr"}
_SKIP = {"script", "style", "head", "title", "noscript"}
_BLOCK = {"address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt", "footer", "h1", "h2", "h3",
          "h4", "h5", "h6", "header", "hr", "li", "nav", "ol", "p", "pre", "section", "table", "tbody", "td", "th",
          "thead", "tr", "ul"}


class _Node:
    __slots__ = ("tag", "attrs", "children")

    def __init__(self, tag, attrs):
        self.tag, self.attrs, self.children = tag, attrs, []


class _TreeBuilder(html.parser.HTMLParser):
    """A minimal DOM: elements and text; a stray end tag closes up to its open element, or is ignored."""

    def __init__(self):
        super().__init__(convert_charrefs=True)  # entities (&amp; &#x2013; ...) decoded in the text
        self.root = _Node("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = _Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(_Node(tag, dict(attrs)))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def normalise(text):
    """Unicode NFC and single spaces."""
    return _SPACES.sub(" ", unicodedata.normalize("NFC", text)).strip()


def _visible_children(node):
    """Children without the hidden switch variants, except the one the help shows by default."""
    hidden = [c for c in node.children if isinstance(c, _Node) and "hidden" in c.attrs]
    if not hidden:
        return node.children
    shown = next((c for c in hidden if (c.attrs.get("id") or "").startswith("default")), hidden[0])
    return [c for c in node.children if not (isinstance(c, _Node) and "hidden" in c.attrs) or c is shown]


def _text(node, out):
    for child in _visible_children(node):
        if isinstance(child, str):
            out.append(child)
        elif child.tag not in _SKIP:
            block = child.tag in _BLOCK
            if block:
                out.append(" ")
            _text(child, out)
            if block:
                out.append(" ")


def paragraphs(html_text):
    """[(anchor, text), ...] of the elements with a par_id/hd_id anchor, in document order (nested anchors
    are listed too; the outer text includes them)."""
    builder = _TreeBuilder()
    builder.feed(html_text)
    builder.close()
    out, todo = [], [builder.root]
    while todo:
        node = todo.pop()
        anchor = node.attrs.get("id") or ""
        if _ANCHOR.match(anchor) and node.tag not in _SKIP:
            parts = []
            _text(node, parts)
            out.append((anchor, normalise("".join(parts))))
        todo.extend(reversed([c for c in node.children if isinstance(c, _Node)]))
    return out


def unique_paragraphs(html_text, stats=None):
    """{anchor: text} for anchors with one text in the file; anchors repeated with different texts are left out
    (counted in stats["anchors_ambiguous"]). Insertion order = document order of the first occurrence."""
    texts = collections.defaultdict(set)
    for anchor, text in paragraphs(html_text):
        texts[anchor].add(text)
    if stats is not None:
        stats["anchors_ambiguous"] += sum(1 for t in texts.values() if len(t) > 1)
    return {a: next(iter(t)) for a, t in texts.items() if len(t) == 1}


def aligned_pairs(de_html, en_html, stats=None):
    """(german, english) for the anchors both files have, in English document order."""
    de, en = unique_paragraphs(de_html, stats), unique_paragraphs(en_html, stats)
    if stats is not None:
        stats["anchors_en"] += len(en)
        stats["anchors_unmatched"] += len(en.keys() ^ de.keys())
    return [(de[a], en[a]) for a in en if a in de]


def help_files(de_dir, en_dir):
    """Relative paths of the .html pages present in both help directories, sorted."""
    def pages(root):
        found = set()
        for d, _, files in os.walk(root):
            for f in files:
                if f.endswith(".html"):
                    found.add(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
        return found
    return sorted(pages(de_dir) & pages(en_dir))


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def collect(de_dir, en_dir, heldout=(), min_words=3, max_words=60):
    """(pairs, stats): the kept (german, english) pairs in output order, and counts of what was dropped."""
    stats = collections.Counter()
    heldout = {s.casefold() for s in heldout}
    seen, pairs = set(), []
    for rel in help_files(de_dir, en_dir):
        stats["files"] += 1
        for de, en in aligned_pairs(_read(os.path.join(de_dir, rel)), _read(os.path.join(en_dir, rel)), stats):
            stats["aligned"] += 1
            if (de, en) in seen:
                stats["dropped_duplicate"] += 1
                continue
            seen.add((de, en))
            if not all(min_words <= len(s.split()) <= max_words for s in (de, en)):
                stats["dropped_length"] += 1
            elif de == en:
                stats["dropped_identical"] += 1
            elif de.casefold() in heldout or en.casefold() in heldout:
                stats["dropped_heldout"] += 1
            else:
                pairs.append((de, en))
    return pairs, stats


def apt_download(package, workdir):
    """``apt-get download PACKAGE`` into workdir (as build_ding_corpus does for trans-de-en); the .deb path."""
    try:
        subprocess.run(["apt-get", "download", package], cwd=workdir, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"build_libreoffice_corpus: 'apt-get download {package}' failed ({e}); run 'apt-get "
                         "update' first, or pass --de-deb/--en-deb or --de-dir/--en-dir")
    debs = sorted(f for f in os.listdir(workdir) if f.startswith(package + "_") and f.endswith(".deb"))
    return os.path.join(workdir, debs[-1])


def unpack_deb(deb, workdir):
    if not os.path.isfile(deb):
        raise SystemExit(f"build_libreoffice_corpus: '{deb}' does not exist")
    if shutil.which("dpkg-deb") is None:
        raise SystemExit("build_libreoffice_corpus: dpkg-deb is needed to unpack a .deb; use --de-dir/--en-dir")
    subprocess.run(["dpkg-deb", "-x", deb, workdir], check=True)


def build(de_dir, en_dir, out_dir, ding_corpus=DEFAULT_DING_CORPUS, min_words=3, max_words=60, sources=(),
          copyright_path=None, command=None):
    for d in (de_dir, en_dir):
        if not os.path.isdir(d):
            raise SystemExit(f"build_libreoffice_corpus: help directory '{d}' does not exist")
    heldout = heldout_sentences(ding_corpus)
    pairs, stats = collect(de_dir, en_dir, heldout, min_words, max_words)
    os.makedirs(out_dir, exist_ok=True)
    write_gz(os.path.join(out_dir, "train.de.gz"), [de for de, _ in pairs])
    write_gz(os.path.join(out_dir, "train.en.gz"), [en for _, en in pairs])
    licence_files = []
    if copyright_path and os.path.isfile(copyright_path):
        shutil.copyfile(copyright_path, os.path.join(out_dir, "COPYRIGHT.libreoffice"))
        licence_files.append("`COPYRIGHT.libreoffice` (the packages' Debian copyright file)")
    if os.path.isfile(MPL_TEXT):
        shutil.copyfile(MPL_TEXT, os.path.join(out_dir, "LICENSE.MPL-2.0"))
        licence_files.append("`LICENSE.MPL-2.0` (the licence text)")
    words_de = sum(len(de.split()) for de, _ in pairs)
    words_en = sum(len(en.split()) for _, en in pairs)
    source_lines = "".join(f"* {s}\n" for s in sources) or f"* help directories {de_dir} and {en_dir}\n"
    with open(os.path.join(out_dir, "PROVENANCE.md"), "w", encoding="utf-8") as f:
        f.write(
            "# Provenance of this corpus\n\n"
            "German-English paragraph pairs of the LibreOffice 7.4 help, as shipped in the Debian packages\n"
            "`libreoffice-help-de` and `libreoffice-help-en-us`: extra TRAINING data for data/ding-de-en\n"
            "(no valid or test split).\n"
            "License: Mozilla Public License 2.0 (MPL-2.0), copyright The Document Foundation, LibreOffice\n"
            "contributors, Oracle and/or its affiliates"
            + (f"; see {' and '.join(licence_files)}" if licence_files else "") + ".\n"
            "Source code form: the help sources are in LibreOffice's `helpcontent2` repository\n"
            "(https://git.libreoffice.org/help), and Debian's source package `libreoffice`.\n\n"
            "Sources:\n\n" + source_lines + "\n"
            f"Built by `{command or 'python tools/build_libreoffice_corpus.py'}`.\n\n"
            "Selection: paragraphs and headings aligned by their shared `par_id`/`hd_id` anchor within the same\n"
            f"help file; HTML stripped, entities decoded, NFC, whitespace normalised; {min_words}-{max_words} words\n"
            "on each side; sides that are identical (untranslated text, code) and pairs whose German or English\n"
            "side (case-folded) equals a Ding valid/test sentence dropped; exact duplicates dropped.\n\n"
            f"Help pages in both languages: {stats['files']}.\n"
            f"Aligned anchors: {stats['aligned']} (English anchors {stats['anchors_en']}, anchors in only one "
            f"language {stats['anchors_unmatched']}, anchors with two texts in one file "
            f"{stats['anchors_ambiguous']}).\n"
            f"Dropped: {stats['dropped_duplicate']} duplicates, {stats['dropped_length']} outside "
            f"{min_words}-{max_words} words, {stats['dropped_identical']} identical sides, "
            f"{stats['dropped_heldout']} equal to a Ding valid/test sentence.\n\n"
            f"Pairs: train {len(pairs)}; words: German {words_de}, English {words_en}.\n"
            "Files: train.{de,en}.gz, one paragraph per line, line i of .de translates line i of .en.\n"
        )
    return len(pairs), stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--de-deb", help="the libreoffice-help-de .deb (default: apt-get download)")
    p.add_argument("--en-deb", help="the libreoffice-help-en-us .deb (default: apt-get download)")
    p.add_argument("--de-dir", help="an unpacked German help directory (.../help/de), instead of --de-deb")
    p.add_argument("--en-dir", help="an unpacked English help directory (.../help/en-US), instead of --en-deb")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--ding-corpus", default=DEFAULT_DING_CORPUS,
                   help="the Ding corpus whose valid/test sentences are kept out (default data/ding-de-en)")
    p.add_argument("--min-words", type=int, default=3)
    p.add_argument("--max-words", type=int, default=60)
    args = p.parse_args(argv)
    for lang in PACKAGES:
        if getattr(args, f"{lang}_deb") and getattr(args, f"{lang}_dir"):
            p.error(f"--{lang}-deb and --{lang}-dir exclude each other")
    command = "python tools/build_libreoffice_corpus.py " + shlex.join(map(str, sys.argv[1:] if argv is None else argv))
    with tempfile.TemporaryDirectory() as tmp:
        dirs, sources, copyright_path = {}, [], None
        for lang, package in PACKAGES.items():
            given_dir = getattr(args, f"{lang}_dir")
            if given_dir:
                dirs[lang] = given_dir
                sources.append(f"{package}: help directory {os.path.basename(os.path.normpath(given_dir))}")
                continue
            deb = getattr(args, f"{lang}_deb") or apt_download(package, tmp)
            unpack_deb(deb, os.path.join(tmp, lang))
            dirs[lang] = os.path.join(tmp, lang, HELP_DIR_IN_DEB[lang])
            sources.append(f"Debian package file `{os.path.basename(deb)}` (sha256 {sha256(deb)})")
            copyright_path = copyright_path or os.path.join(
                tmp, lang, "usr/share/doc", package, "copyright")
        n, _ = build(dirs["de"], dirs["en"], args.out, args.ding_corpus, args.min_words, args.max_words, sources,
                     copyright_path, command)
    print(f"wrote {args.out}: train {n}")


if __name__ == "__main__":
    sys.exit(main())
