"""The Python steps of python -m benchmarks.claims, each run in a child process with its own thread count:

    python -m benchmarks.claims.work SPEC.json OUT.json     (SPEC: {"fn": name, "kwargs": {...}})

``evaluate`` (sacreBLEU of a checkpoint on valid / test, greedy and beam 4, hypotheses kept), ``average`` (the
last interval checkpoints of a training), ``position_ce`` (the SAT paper's Figure 6), ``speed`` (batch-1 decoding
latency of several models, interleaved in one process), ``group_repeats`` (repeated subwords inside and across
SAT groups), ``as_transformer`` (a K = 1 SAT checkpoint as the fairseq transformer it computes), ``keep`` (a
checkpoint without its optimizer state, for the store).
"""

import glob
import json
import os
import re
import sys
import time
from unittest import mock

GEN_BOUND = dict(max_len_a=1.2, max_len_b=10)  # as the quickstart: a briefly trained model may not stop


def _load(ckpt, bin_dir, src, tgt, task=None):
    """The model of ``ckpt`` on the data of ``bin_dir`` and a task to decode it with: the checkpoint's own, or
    ``task`` (e.g. ``translation_sat`` for a ``translation`` checkpoint: our generator) built from its settings."""
    from fairseq import checkpoint_utils, tasks
    from omegaconf import OmegaConf

    import fairseq_ext  # noqa: F401  (registration, safe loading)

    overrides = {"data": bin_dir, "source_lang": src, "target_lang": tgt}
    models, cfg, task_obj = checkpoint_utils.load_model_ensemble_and_task([ckpt], arg_overrides=overrides)
    if task and cfg.task._name != task:
        settings = OmegaConf.to_container(cfg.task)
        settings["_name"] = task
        task_obj = tasks.setup_task(OmegaConf.create(settings))
    if task and type(task_obj).__name__ == "TranslationTask" and task != "translation":
        raise RuntimeError(f"could not build --task {task} for {ckpt}")
    return models[0].eval(), task_obj, None


def _read_lines(path, n=None):
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines if n is None else lines[:n]


def _translate(task, model, gen, ds, batch):
    """Hypotheses (detokenised) of a whole split in id order, batches sorted by length."""
    import torch

    src_sizes = ds.src_sizes if hasattr(ds, "src_sizes") else ds.dataset.src_sizes
    order = sorted(range(len(ds)), key=lambda i: src_sizes[i])
    hyps = {}
    for s in range(0, len(order), batch):
        sample = ds.collater([ds[i] for i in order[s: s + batch]])
        with torch.no_grad():
            outs = task.inference_step(gen, [model], sample)
        for sid, h in zip(sample["id"].tolist(), outs):
            hyps[sid] = (task.target_dictionary.string(h[0]["tokens"], "sentencepiece"),
                         task.target_dictionary.string(h[0]["tokens"]))
    return [hyps[i] for i in range(len(ds))]


def evaluate(ckpt, bin_dir, src, tgt, refs, decodes, out_dir, batch=64, task=None):
    """sacreBLEU of ``ckpt`` for each (split, beam) of ``decodes``; ``refs``: {split: [reference files]}. Writes
    the hypotheses (detokenised and as subwords) to OUT_DIR/SPLIT.beamB.{txt,spm}."""
    from argparse import Namespace

    from sacrebleu.metrics import BLEU

    model, task_obj, _ = _load(ckpt, bin_dir, src, tgt, task)
    out = {"params": sum(p.numel() for p in model.parameters())}
    os.makedirs(out_dir, exist_ok=True)
    for split, beam in decodes:
        task_obj.load_dataset(split)
        ds = task_obj.dataset(split)
        gen = task_obj.build_generator([model], Namespace(beam=beam, lenpen=1.0, **GEN_BOUND))
        t0 = time.perf_counter()
        pairs = _translate(task_obj, model, gen, ds, batch)
        seconds = time.perf_counter() - t0
        hyps = [p[0] for p in pairs]
        for ext, k in (("txt", 0), ("spm", 1)):
            with open(os.path.join(out_dir, f"{split}.beam{beam}.{ext}"), "w", encoding="utf-8") as f:
                f.writelines(p[k] + "\n" for p in pairs)
        bleu = BLEU()
        score = bleu.corpus_score(hyps, [_read_lines(r, len(hyps)) for r in refs[split]])
        key = f"bleu_{split}_{'greedy' if beam == 1 else f'beam{beam}'}"
        out[key] = round(score.score, 2)
        out[f"{key}_signature"] = str(bleu.get_signature())
        out[f"{key}_seconds"] = round(seconds, 1)
    return out


def average(ckpt_dir, output, last=3):
    """Averages the ``last`` newest interval checkpoints (checkpoint_E_U.pt) of a training, or its epoch
    checkpoints when it saved none; returns which."""
    from fairseq_ext import checkpoints
    from fairseq_ext.checkpoints.average import average_checkpoints

    found = []
    for p in glob.glob(os.path.join(ckpt_dir, "checkpoint_*_*.pt")):
        m = re.fullmatch(r"checkpoint_(\d+)_(\d+)\.pt", os.path.basename(p))
        if m:
            found.append((int(m.group(2)), p))
    if not found:
        for p in glob.glob(os.path.join(ckpt_dir, "checkpoint*.pt")):
            m = re.fullmatch(r"checkpoint(\d+)\.pt", os.path.basename(p))
            if m:
                found.append((int(m.group(1)), p))
    found.sort()
    # newest first, as fairseq's scripts/average_checkpoints.py: the average keeps the first one's training state, so
    # that it records the update count it was trained to
    paths = [p for _, p in found[-last:]][::-1] or [os.path.join(ckpt_dir, "checkpoint_last.pt")]
    checkpoints.atomic_torch_save(average_checkpoints(paths), output)
    return {"averaged": [os.path.basename(p) for p in paths]}


def position_ce(paths, labels, bin_dir, src, tgt, split, png, max_position=30):
    from fairseq_ext.sat import position_ce as pce

    argv = [bin_dir, "--split", split, "--source-lang", src, "--target-lang", tgt, "--max-position",
            str(max_position), "--png", png]
    for p, label in zip(paths, labels):
        argv += ["--path", p, "--label", label]
    results = pce.main(argv)
    return {"models": [{"K": K, "label": label, "ce": [round(float(c), 4) for c in ce],
                        "counts": [int(c) for c in counts], "by_position_in_group": [round(float(g), 4) for g in gce]}
                       for K, label, ce, counts, gce in results]}


def speed(models, bin_dir, src, tgt, sentences=100, repeat=3, beams=(1, 4), batches=(1,)):
    """Latency (ms per sentence, one thread) of ``models`` [{label, ckpt, task}] over the first ``sentences`` test
    sentences, in batches of each of ``batches`` sentences: each model, beam and batch size timed ``repeat`` times,
    interleaved, the fastest pass kept. The task's generator decodes (fairseq's SequenceGenerator for
    --task translation, with the package's default generator turned off; ours for --task translation_sat)."""
    from argparse import Namespace
    from types import SimpleNamespace

    import torch

    from benchmarks.speed.decode import compiled_searches
    from fairseq_ext.inference.default_generator import OFF

    torch.set_num_threads(1)
    loaded = []
    for m in models:
        model, task_obj, _ = _load(m["ckpt"], bin_dir, src, tgt, m["task"])
        task_obj.load_dataset("test")
        ds = task_obj.dataset("test")
        # --task translation is the anchor "fairseq's generator": keep it fairseq's, not the package's default
        stock = {OFF: "1"} if m["task"] == "translation" else {}
        with mock.patch.dict(os.environ, stock):
            gens = {b: task_obj.build_generator([model], Namespace(beam=b, lenpen=1.0, **GEN_BOUND)) for b in beams}
        loaded.append((m, model, task_obj, ds, gens))
        if m["task"] != "translation":  # timed on its compiled step and search graphs, not while they compile
            compiled_searches(SimpleNamespace(name=m["label"], model=model, decode=lambda sample, beam, _, t=task_obj,
                                              g=gens, mod=model: t.inference_step(g[beam], [mod], sample)),
                              ds.collater([ds[0]]))
    n = min(sentences, len(loaded[0][3]))
    best = {}
    for r in range(repeat):
        for m, model, task_obj, ds, gens in loaded:
            for batch in batches:
                samples = [ds.collater([ds[i] for i in range(j, min(j + batch, n))]) for j in range(0, n, batch)]
                for b, gen in gens.items():
                    with torch.no_grad():
                        task_obj.inference_step(gen, [model], samples[0])  # warm-up
                        t0 = time.perf_counter()
                        for s in samples:
                            task_obj.inference_step(gen, [model], s)
                    ms = 1000 * (time.perf_counter() - t0) / n
                    key = (m["label"], b, batch)
                    best[key] = min(best.get(key, ms), ms)
    return {"sentences": n, "repeat": repeat,
            "ms": [{"label": label, "beam": b, "batch": batch, "ms": round(ms, 2)}
                   for (label, b, batch), ms in best.items()]}


def group_repeats(spm_files, Ks):
    """Adjacent equal subwords of the hypotheses (subword files) at positions t, t+1 (1-based target positions)
    that lie in one SAT group of K (t % K != 0) and across a group boundary (t % K == 0), per file."""
    out = []
    for path, K in zip(spm_files, Ks):
        inside = across = pairs_in = pairs_across = 0
        for line in _read_lines(path):
            toks = line.split() + ["</s>"]
            for t in range(1, len(toks)):
                same_group = K > 1 and t % K != 0
                rep = toks[t - 1] == toks[t]
                if same_group:
                    pairs_in += 1
                    inside += rep
                else:
                    pairs_across += 1
                    across += rep
        out.append({"file": os.path.basename(path), "K": K, "repeats_inside_groups": inside,
                    "repeats_across_groups": across, "pairs_inside": pairs_in, "pairs_across": pairs_across})
    return {"files": out}


def as_transformer(ckpt, output):
    """A ``sat_transformer`` checkpoint with K = 1 as a fairseq ``transformer`` checkpoint of the same weights: with
    one position per group the relaxed causal mask is the causal mask and the input shift is one word, so it is the
    Transformer it was initialised as (a SAT teacher trained on by self-distillation decodes with fairseq's own
    generator). Refuses any other K."""
    import dataclasses

    import torch
    from fairseq.tasks.translation import TranslationConfig

    from fairseq_ext import checkpoints

    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    model = state["cfg"]["model"]
    if getattr(model, "_name", None) != "sat_transformer" or getattr(model, "sat_group_size", None) != 1:
        raise ValueError(f"{ckpt}: not a sat_transformer with K = 1")
    for k in [k for k in vars(model) if k.startswith("sat_")]:
        delattr(model, k)
    model._name = model.arch = "transformer"
    known = {f.name for f in dataclasses.fields(TranslationConfig)}
    state["cfg"]["task"] = {"_name": "translation",
                            **{k: v for k, v in state["cfg"]["task"].items() if k in known}}
    if state.get("args") is not None:
        state["args"] = None
    checkpoints.atomic_torch_save(state, output)
    return {"checkpoint": output, "from": ckpt}


def keep(ckpt, output):
    """``ckpt`` without the optimizer's state (two thirds of an Adam checkpoint, read by no step that loads a
    finished training: decoding, initialising from it, averaging, packing) at ``output``, its equal weights saved
    once (averaging unties the shared embeddings); the same weights, settings and training state otherwise.
    Returns the copy's sha256 and size."""
    import torch

    from fairseq_ext import checkpoints
    from fairseq_ext.checkpoints.release import sha256

    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    state["last_optimizer_state"] = None
    seen = {}
    for k, v in state["model"].items():
        same = [u for u in seen.setdefault((v.dtype, tuple(v.shape)), []) if torch.equal(u, v)]
        if same:
            state["model"][k] = same[0]
        else:
            seen[(v.dtype, tuple(v.shape))].append(v)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    checkpoints.atomic_torch_save(state, output)
    return {"sha256": sha256(output), "bytes": os.path.getsize(output)}


FUNCTIONS = {f.__name__: f for f in (evaluate, average, position_ce, speed, group_repeats, as_transformer, keep)}


def main(argv):
    spec_path, out_path = argv
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    res = FUNCTIONS[spec["fn"]](**spec["kwargs"])
    with open(out_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
