"""``--bert-feature-cache DIR``: BERT's outputs for every sentence of a split, computed once and memory-mapped.

While BERT is frozen (BERT-JAM phases 1 and 2) its output for a sentence never changes, yet the live path runs
it on every batch of every epoch. With a cache, ``--task translation_bert`` computes the features of each split
once and writes them to ``DIR`` (one ``.npy`` memory map per split, read by every rank and data-loader worker),
and the collater puts each batch's rows into ``net_input["bert_out"]``; the encoder then uses them instead of
running BERT (the model only accepts an optional precomputed tensor; it never imports this module).

* **What is stored.** Only what the layer compositions read: B_L alone (``last``: ``n_tokens x C``) when every
  composition selects it (phase 1 at Eq. 11, ablation M2), every layer B_1..B_L (``all``:
  ``n_tokens x C x L``, the embedding output excluded as in the live path) otherwise (phase 2). Rows are the
  sentences' BERT tokens back to back, in dataset order (the offsets are the cumulative lengths of the
  prepared BERT ids). ``float16`` by default, ``float32`` on request.
  Size: ``n_bert_tokens x C x (1 or L) x (2 or 4)`` bytes.
* **Eval mode.** The features are BERT's in eval mode (no dropout), computed in float32 under ``no_grad``.
  The live path runs the frozen BERT in train mode, so with its dropout (as the official code): with the
  cache, phases 1-2 train on dropout-free BERT features, which is what inference sees.
* **Keyed, never silently stale.** ``DIR/{split}.json`` records the content hash of the BERT weights
  (``bert_sha256``), the layers stored, the dtype, BERT's width/depth/pad id and the binarised BERT ids of the
  split (sentences, tokens and the SHA-256 of their ``.bin``/``.idx`` files). A cache that differs in any of
  them is refused with one line naming the directory and what differs.
* **Atomic and concurrent.** A cache is written to a temporary file and renamed; the JSON, renamed last, marks
  it complete, so a killed run leaves none (a ``.npy`` without its JSON is rebuilt, and the temporary file of a
  killed build is deleted by the next build). Building holds an
  exclusive ``flock`` on ``DIR/.lock``: when several ranks or runs start at once, one builds and the others
  wait and then read it (``DIR`` must be on a file system with working ``flock``, e.g. local disk).
"""

import contextlib
import copy
import fcntl
import glob
import hashlib
import json
import logging
import os
import time
from typing import Dict, List, Optional

import numpy as np
import torch

from fairseq_ext.common.errors import FairseqExtError

logger = logging.getLogger(__name__)

FORMAT = 1
DTYPES = ("float16", "float32")
LAYERS = ("last", "all")

# what a key holds, as the refusal names it
KEY_LABELS = {
    "format": "the cache format",
    "bert_sha256": "the BERT weights (sha256 of --bert-model-name)",
    "layers": "the BERT layers stored (last = B_L only, for phase 1; all = every layer, for phase 2)",
    "dtype": "the dtype (--bert-feature-cache-dtype)",
    "hidden_size": "BERT's hidden size",
    "num_layers": "BERT's number of layers",
    "pad_id": "BERT's pad id",
    "sentences": "the number of sentences of the split",
    "tokens": "the number of BERT tokens of the split",
    "bert_ids_sha256": "the prepared BERT ids of the split (sha256 of its .bert.bin/.idx)",
}


def ids_fingerprint(prefixes: List[str]) -> str:
    """SHA-256 of the prepared BERT ids of a split (every shard's ``.idx`` and ``.bin``, in order)."""
    h = hashlib.sha256()
    for prefix in prefixes:
        for ext in (".idx", ".bin"):
            with open(prefix + ext, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
    return h.hexdigest()


def make_key(bert_sha256: str, layers: str, dtype: str, hidden_size: int, num_layers: int, pad_id: int,
             sizes: np.ndarray, prefixes: List[str]) -> Dict:
    if layers not in LAYERS:
        raise FairseqExtError(f"BERT feature cache: layers '{layers}': choose one of {', '.join(LAYERS)}")
    if dtype not in DTYPES:
        raise FairseqExtError(f"--bert-feature-cache-dtype {dtype}: choose one of {', '.join(DTYPES)}")
    return {"format": FORMAT, "bert_sha256": bert_sha256, "layers": layers, "dtype": dtype,
            "hidden_size": int(hidden_size), "num_layers": int(num_layers), "pad_id": int(pad_id),
            "sentences": int(len(sizes)), "tokens": int(np.asarray(sizes, dtype=np.int64).sum()),
            "bert_ids_sha256": ids_fingerprint(prefixes)}


def feature_shape(key: Dict):
    n, c = key["tokens"], key["hidden_size"]
    return (n, c) if key["layers"] == "last" else (n, c, key["num_layers"])


def cache_bytes(n_tokens: int, hidden_size: int, num_layers: int, layers: str, dtype: str) -> int:
    """The size formula: n_bert_tokens x C x (1 or L) x bytes per value."""
    return n_tokens * hidden_size * (1 if layers == "last" else num_layers) * np.dtype(dtype).itemsize


class FeatureCache:
    """Read side: the rows of one split, opened lazily in every process (a pickled copy, e.g. in a data-loader
    worker, reopens the memory map instead of copying it)."""

    def __init__(self, path: str, key: Dict, sizes: np.ndarray):
        self.path = path
        self.key = key
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
        self._mm = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_mm"] = None
        return state

    @property
    def array(self):
        if self._mm is None:
            self._mm = np.load(self.path, mmap_mode="r")
        return self._mm

    def __len__(self):
        return len(self.offsets) - 1

    def rows(self, index: int) -> np.ndarray:
        return self.array[self.offsets[index]:self.offsets[index + 1]]

    def batch(self, ids, length: Optional[int] = None) -> torch.Tensor:
        """B x T x C (x L) in the stored dtype, right-padded with zeros (as the BERT input is right-padded;
        padded positions are masked by its padding mask)."""
        rows = [self.rows(int(i)) for i in ids]
        T = max([len(r) for r in rows] + [length or 0])
        out = np.zeros((len(rows), T) + self.array.shape[1:], dtype=self.array.dtype)
        for j, r in enumerate(rows):
            out[j, :len(r)] = r
        return torch.from_numpy(out)


@contextlib.contextmanager
def locked(directory: str):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _paths(directory, name):
    return os.path.join(directory, f"{name}.npy"), os.path.join(directory, f"{name}.json")


def _check(directory: str, name: str, key: Dict) -> bool:
    """True when a complete cache with this key exists; raises on a cache with another key; False when none."""
    npy, meta_path = _paths(directory, name)
    if not os.path.exists(meta_path):
        return False
    with open(meta_path) as f:
        meta = json.load(f)
    cached = meta.get("key", {})
    diffs = []
    for k, label in KEY_LABELS.items():
        if str(cached.get(k)) != str(key.get(k)):
            a, b = cached.get(k), key.get(k)
            if k in ("bert_sha256", "bert_ids_sha256"):
                a, b = str(a)[:16], str(b)[:16]
            diffs.append(f"{label}: {a} there, {b} here")
    if diffs:
        raise FairseqExtError(
            f"--bert-feature-cache {directory}: the cached BERT features of split '{name}' ({meta_path}) do not "
            f"belong to this run ({'; '.join(diffs)}); delete {name}.npy and {name}.json there or give another "
            "directory (one per phase: phase 1 stores B_L only, phase 2 every layer)")
    if not os.path.exists(npy):
        logger.warning(f"{meta_path} has no {npy}: rebuilding the cache of '{name}'")
        return False
    arr = np.load(npy, mmap_mode="r")
    if tuple(arr.shape) != feature_shape(key) or str(arr.dtype) != key["dtype"]:
        raise FairseqExtError(
            f"--bert-feature-cache {directory}: {npy} holds {tuple(arr.shape)} {arr.dtype} but its key says "
            f"{feature_shape(key)} {key['dtype']}; delete {name}.npy and {name}.json there")
    return True


def _atomic_json(path, obj):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _bert_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def compute(bert, ids_dataset, sizes: np.ndarray, key: Dict, out: np.ndarray, max_tokens: int = 8192,
            log_every: float = 60.0):
    """Fill ``out`` (n_tokens x C [x L]) with eval-mode BERT features of every sentence of ``ids_dataset``, in
    batches of similar lengths. Runs on the first GPU if there is one, in float32; leaves ``bert`` as it was."""
    from fairseq_ext.bert_jam.bert import collate_bert

    device = _bert_device()
    p = next(bert.parameters())
    orig_device, was_training = p.device, bert.training
    runner = bert
    if p.dtype != torch.float32:  # e.g. already cast by --fp16: compute from a float32 copy
        runner = copy.deepcopy(bert).float()
    runner.to(device).eval()
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    order = np.argsort(sizes, kind="stable")
    pad, last = key["pad_id"], key["layers"] == "last"
    t0 = t_log = time.time()
    done = 0
    try:
        with torch.no_grad():
            start = 0
            while start < len(order):
                end = start + 1
                while end < len(order) and (end - start + 1) * sizes[order[end]] <= max_tokens:
                    end += 1
                idx = order[start:end]
                ids = collate_bert([ids_dataset[int(i)] for i in idx], pad).to(device)
                mask = ids.eq(pad)
                o = runner(input_ids=ids, attention_mask=(~mask).long(), output_hidden_states=not last,
                           return_dict=True)
                feats = o.last_hidden_state if last else torch.stack(o.hidden_states[1:], dim=-1)
                feats = feats.to(torch.float32 if key["dtype"] == "float32" else torch.float16).cpu().numpy()
                for j, i in enumerate(idx):
                    out[offsets[i]:offsets[i + 1]] = feats[j, :sizes[i]]
                done += len(idx)
                start = end
                if time.time() - t_log > log_every:
                    t_log = time.time()
                    logger.info(f"BERT feature cache: {done}/{len(order)} sentences ({t_log - t0:.0f} s)")
    finally:
        if runner is bert:
            bert.to(orig_device)
            bert.train(was_training)
    return time.time() - t0


def open_or_build(directory: str, name: str, key: Dict, bert, ids_dataset, sizes: np.ndarray,
                  max_tokens: int = 8192) -> FeatureCache:
    """The cache ``DIR/{name}`` for ``key``: checked and opened when it exists (refused if it has another key),
    else built once (under the directory's lock, atomically)."""
    npy, meta_path = _paths(directory, name)
    if not _check(directory, name, key):
        with locked(directory):
            if not _check(directory, name, key):  # nobody built it while we waited
                shape = feature_shape(key)
                size = int(np.prod(shape)) * np.dtype(key["dtype"]).itemsize
                logger.info(f"BERT feature cache: computing {key['layers']} layer(s) of BERT (eval mode) for "
                            f"'{name}' ({key['sentences']} sentences, {key['tokens']} BERT tokens, "
                            f"{size / 2 ** 20:.1f} MiB {key['dtype']}) into {npy}")
                for old in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.*.tmp.npy")):
                    os.remove(old)  # left by a killed build (we hold the lock: nobody else is writing it)
                tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp.npy")
                try:
                    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=key["dtype"], shape=shape)
                    seconds = compute(bert, ids_dataset, sizes, key, arr, max_tokens=max_tokens)
                    arr.flush()
                    del arr
                    os.replace(tmp, npy)
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)
                _atomic_json(meta_path, {"key": key, "shape": list(shape), "bytes": size,
                                         "bert_mode": "eval (no dropout), float32 compute, no_grad",
                                         "seconds": round(seconds, 1), "device": str(_bert_device())})
                logger.info(f"BERT feature cache: '{name}' written in {seconds:.1f} s")
    else:
        logger.info(f"BERT feature cache: using {npy} ({key['layers']} layer(s), {key['dtype']})")
    return FeatureCache(npy, key, sizes)
