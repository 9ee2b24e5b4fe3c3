"""SAT decoding speed against its anchors, all measured in one run (the paper's Tables 3-5).

    python -m benchmarks.speed.sat [--workdir work/bench-sat] [--minutes 8] [--ks 2 4 6] [--sentences 200]
                                   [--threads 1] [--batch 64] [--quantize output] [--baseline-rev REV]
    python -m benchmarks.speed.sat --random-init --fixed-length 27 --no-throughput --json FILE

Contenders, all in this one process, measured interleaved (each sentence / batch is decoded by every
contender in turn, in a rotating random order) so that the load of the machine affects all alike:

* ``ours K=1``: our generator (:mod:`fairseq_ext.sat.generator`, whatever it holds when this runs: its default
  lean decoder step included; ``--float-opt own-step`` adds the decoder's own step, i.e. ``--no-lean-step``) on
  the transformer: the baseline of every speed-up; the JSON records each generator's ``decoder_step``;
* anchors: (a) fairseq's ``SequenceGenerator`` on the same transformer; (b) the same transformer converted to
  CTranslate2 (``pip install --no-deps ctranslate2==4.8.5``; int8 and float32; skipped with a note when
  ctranslate2 is missing), what a user who wants fast CPU decoding picks; (c) a deep-encoder / shallow-decoder
  autoregressive transformer (Kasai et al., 2021), 6 encoder layers + 1 decoder layer, the parameter count of
  the 3+3 model (an encoder layer is 2/3 of a decoder layer), with our K=1 and CTranslate2 int8; (d) the SAT
  with that shallow decoder (6+1) for every K;
* ours SAT K=2/4/6 (3+3);
* with ``--quantize output|decoder|all|...`` (opt-in, repeatable): our K=1 and SATs after
  :func:`fairseq_ext.inference.speedups.quantize_decoder` (int8 softmax projection / every decoder nn.Linear;
  'all': and :func:`~fairseq_ext.inference.speedups.quantize_encoder`; see --help), with
  their agreement with the float hypotheses (and BLEU with trained models);
* with ``--baseline-rev REV``: our K=1 with ``fairseq_ext/sat/generator.py`` as committed at REV (git), to
  measure what the generator's own changes give (the models are the same).

Two ways to get models:

1. ``--random-init`` (no training, a few minutes): every model is built with random weights at the
   quickstart's sizes (examples/quickstart/transformer.sh, Ding corpus: d 256, 3+3 layers, 4 heads, FFN 512,
   all embeddings shared, an 8,000-word joint vocabulary). The sources are random token ids, 25 tokens on
   average (normal, sd 6, 5-50) + EOS; needs ``--fixed-length N`` (every contender emits exactly N words +
   EOS) and measures batch-1 latency only. Speed only: random models translate nothing.
2. Trained (default): models trained on the bundled German->English corpus (each step skipped when its output
   exists): a fairseq ``transformer`` teacher trained for --minutes, sequence-level distillation of the
   training set with it (--kd-beam; 0 = none), and one SAT student of the same size (3+3 layers, d 256, FFN
   1024, as the quickstart's SAT) per K, trained for --minutes and initialised from the teacher; or
   ``--teacher/--student`` checkpoints (and ``--deep-shallow``/``--deep-shallow-student`` for anchors c, d).
   Latency per sentence at batch 1 (greedy and beam 4) on the first --sentences test sentences; throughput at
   batch --batch on the test set, scored with sacreBLEU.

Prints the table, the speed-ups over our K=1 (for each --quantize variant over its own K=1) checked against
the CPU targets at batch 1 (greedy 1.5x / 2.7x / 3.4x and beam 4 1.8x / 3.0x / 3.6x for
K = 2 / 4 / 6), ours K=1 against fairseq's generator and --baseline-rev, and SAT against CTranslate2.
``--json FILE`` writes ``speedup_vs_k1`` ({"greedy": {"2": x, ...}, "beam4": {...}}), ``ms_per_sentence``
({contender: {"greedy": ms, "beam4": ms}}) and the details. Timings on a shared machine are noisy: compare
the ratios, which are measured in one run; the absolute numbers are printed beside them. Exit status 1 when
a target is missed.

Batch-1 timing: each contender decodes --block consecutive sentences (default 10: a model translating a
stream of sentences, as fairseq-interactive does, its weights warm in the caches), the contenders in a new
random order for every block of sentences (so that load changes during the run fall on all of them alike).
``--block 1`` interleaves the contenders sentence by sentence: every
sentence then starts with the weights of the previous contender in the caches, which costs SAT more than K=1
(fewer decoder calls share the refill). ``--repeat R`` times every block R times (contenders reshuffled each
time) and keeps, per contender and sentence, the fastest of the R: load from other work on a shared machine
only ever adds time, so the minimum is the steadiest estimate (how much single passes move the ratios: the same
command twice in a row with ``--repeat 1``).
"""

import argparse
import copy
import datetime
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import types

from .sat_contenders import (RANDOM_SIZES, Contender, build_random_models, ct2_convert, ensure_models,
                             random_sources)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# --quantize / --float-opt choices -> the fairseq_ext.inference.speedups speed-ups they apply (apply_speedups names)
INT8_SPEEDUPS = {"output": "int8-output", "decoder": "int8-decoder", "all": "int8-decoder,int8-encoder",
                 "all-lean": "int8-decoder,int8-encoder,lean-decoder,lean-encoder",
                 "all-lean-decoder": "int8-decoder,int8-encoder,lean-decoder"}
FLOAT_SPEEDUPS = {"prepack": "prepack", "lean": "lean-decoder,lean-encoder",
                  "lean-prepack": "lean-decoder,lean-encoder,prepack", "lean-decoder": "lean-decoder", "own-step": ""}
# what this benchmark checks: batch-1, one-thread CPU speed-ups over our own K=1 in the same run (set for
# --random-init --fixed-length 27)
CPU_TARGETS = {"greedy": {2: 1.5, 4: 2.7, 6: 3.4}, "beam4": {2: 1.8, 4: 3.0, 6: 3.6}}
K1_VS_BASELINE_REV = 1.2  # target of ours K=1 against --baseline-rev's K=1


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.sat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(ROOT, "work", "bench-sat"))
    p.add_argument("--random-init", action="store_true",
                   help="no training: every model with random weights at the quickstart's sizes, random source "
                        "token ids; needs --fixed-length; batch-1 latency only")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # --random-init at a tiny size (tests)
    p.add_argument("--minutes", type=float, default=8, help="training minutes of the teacher and of each student")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--sentences", type=int, default=None,
                   help="sentences of the batch-1 latency (default: 200 test sentences; 30 with --random-init)")
    p.add_argument("--batch", type=int, default=64, help="batch size of the throughput runs")
    p.add_argument("--throughput-sentences", type=int, default=1000,
                   help="test sentences of the throughput runs and BLEU (default: the whole test set, 1000)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one sentence on one core)")
    p.add_argument("--block", type=int, default=10,
                   help="batch-1 sentences each contender decodes in a row before the next one (default 10; 1: "
                        "interleaved sentence by sentence, caches cold for every sentence)")
    p.add_argument("--repeat", type=int, default=1,
                   help="batch-1 timing passes over the sentences (default 1); each contender's time for a sentence "
                        "is its fastest of the passes (other load on the machine only ever adds time), the "
                        "contenders in a new random order per block and pass")
    p.add_argument("--no-throughput", action="store_true", help="only the batch-1 latencies")
    p.add_argument("--kd-beam", type=int, default=4,
                   help="beam of the teacher's distillation decode of the training set (0: no distillation)")
    p.add_argument("--fixed-length", type=int, default=0,
                   help="decode exactly N words + EOS with every contender (--min-len N --max-len-b N "
                        "--max-len-a 0; CTranslate2: min/max decoding length): speed at equal output length, "
                        "independent of how well (or badly) the models are trained; BLEU is then meaningless")
    p.add_argument("--quantize", action="append", default=[], choices=list(INT8_SPEEDUPS),
                   help="also measure our K=1 and SATs after fairseq_ext.inference.speedups.quantize_decoder(model, "
                        "layers): int8 softmax projection ('output') or every decoder nn.Linear ('decoder'); "
                        "'all': every decoder and encoder nn.Linear (quantize_encoder too); 'all-lean': 'all' with "
                        "the lean incremental decoder step and encoder layers (fairseq_ext.inference.lean_decoder, "
                        "lean_encoder); 'all-lean-decoder': 'all' with the lean decoder step only; repeatable")
    p.add_argument("--float-opt", action="append", default=[], choices=list(FLOAT_SPEEDUPS),
                   help="also measure our K=1 and SATs in float32 after the speed-ups of "
                        "fairseq_ext.inference.speedups: 'prepack' (the softmax projection through MKL's packed "
                        "GEMM), 'lean' (the lean decoder step mixed into the decoder and the lean encoder layers), "
                        "'lean-prepack', 'lean-decoder' (the lean step alone), or 'own-step' (the decoder's own step "
                        "instead of the generator's default lean step: --no-lean-step); repeatable")
    p.add_argument("--baseline-rev", default=None, metavar="REV",
                   help="also measure our K=1 with fairseq_ext/sat/generator.py as committed at this git revision")
    p.add_argument("--no-ct2", action="store_true", help="leave out the CTranslate2 anchors")
    p.add_argument("--no-deep-shallow", action="store_true", help="leave out the 6+1 anchors (c) and (d)")
    p.add_argument("--seed", type=int, default=0, help="--random-init: seed of the weights and the sources")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--teacher", default=None,
                   help="benchmark these trained checkpoints instead of training: the K=1 transformer ...")
    p.add_argument("--student", action="append", default=[], metavar="K=PATH",
                   help="... and one SAT student per K (repeat), e.g. --student 2=ckpt/sat-k2/checkpoint_avg.pt")
    p.add_argument("--deep-shallow", default=None, metavar="PATH",
                   help="with --teacher: a trained deep-encoder/shallow-decoder transformer (anchor c) ...")
    p.add_argument("--deep-shallow-student", action="append", default=[], metavar="K=PATH",
                   help="... and SAT students with its shallow decoder (anchor d)")
    p.add_argument("--data", default=None, help="with --teacher: the binarised data directory of the test set")
    p.add_argument("--refs", default=None, help="with --teacher: detokenised test references, one per line")
    p.add_argument("--source-lang", default="de")
    p.add_argument("--target-lang", default="en")
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if a.teacher and not (a.student and a.data and a.refs):
        p.error("--teacher needs --student K=PATH (one or more), --data BIN and --refs FILE")
    if a.tiny and not a.random_init:
        p.error("--tiny is a size of --random-init")
    if a.random_init:
        if a.teacher:
            p.error("--random-init builds its own models: remove --teacher/--student")
        if a.fixed_length <= 0:
            p.error("--random-init needs --fixed-length N (random models do not stop by themselves), e.g. 27")
        a.no_throughput = True  # random models: no BLEU, and batch-1 latency is what the targets are about
    for flag in a.student + a.deep_shallow_student:
        k, _, path = flag.partition("=")
        if not k.isdigit() or not path:
            p.error(f"--student/--deep-shallow-student takes K=PATH (got {flag!r})")
    if a.repeat < 1:
        p.error(f"--repeat must be at least 1 (got {a.repeat})")
    if a.sentences is None:
        a.sentences = 30 if a.random_init else 200
    return a


def git_info():
    """The commit and the state of the SAT generator and model files this run measures (they change while
    other work lands: the JSON records which code was timed)."""
    def out(*cmd):
        r = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    info = {"head": out("rev-parse", "--short", "HEAD")}
    for rel in ("fairseq_ext/sat/generator.py", "fairseq_ext/sat/model.py"):
        with open(os.path.join(ROOT, rel), "rb") as f:
            sha = hashlib.sha1(f.read()).hexdigest()[:12]
        modified = out("status", "--porcelain", "--", rel)
        info[rel] = {"sha1": sha, "uncommitted_changes": bool(modified)}
    return info


def generator_at(rev):
    """``SATSequenceGenerator`` from fairseq_ext/sat/generator.py as committed at git revision ``rev``."""
    rel = "fairseq_ext/sat/generator.py"
    r = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: --baseline-rev {rev}: git show {rev}:{rel} failed: {r.stderr.strip()}")
    name = f"_bench_sat_generator_{rev}".replace("-", "_").replace("~", "_").replace("^", "_")
    mod = types.ModuleType(name)
    mod.__file__ = f"{rev}:{rel}"
    sys.modules[name] = mod
    exec(compile(r.stdout, mod.__file__, "exec"), mod.__dict__)
    return mod.SATSequenceGenerator


# -- models and sources ----------------------------------------------------------------------------------------
def load_trained(args):
    """The trained models (--teacher/--student, or trained here by ensure_models) and the test set:
    (models, checkpoints, data dir, task, batch-1 samples, test dataset, references)."""
    from fairseq import checkpoint_utils

    if args.teacher:
        teacher_path, bin_ = args.teacher, args.data
        student_paths = {int(ks.split("=", 1)[0]): ks.split("=", 1)[1] for ks in args.student}
        refs_path = args.refs
    else:
        teacher_path, student_paths, bin_ = ensure_models(args)
        refs_path = os.path.join(args.workdir, "data", f"test.{args.target_lang}")

    def load(path):
        ms, _cfg, t = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": bin_})
        return ms[0].eval(), t

    teacher, task = load(teacher_path)
    models = {"K=1": teacher}
    models.update({f"K={K}": load(p)[0] for K, p in student_paths.items()})
    ckpts = {"K=1": teacher_path}
    if args.deep_shallow and not args.no_deep_shallow:
        models["6+1 K=1"] = load(args.deep_shallow)[0]
        ckpts["6+1 K=1"] = args.deep_shallow
        for ks in args.deep_shallow_student:
            K, path = ks.split("=", 1)
            models[f"6+1 K={int(K)}"] = load(path)[0]
    task.load_dataset("test")
    ds = task.dataset("test")
    with open(refs_path, encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    samples = [ds.collater([ds[i]]) for i in range(min(args.sentences, len(ds)))]
    return models, ckpts, bin_, task, samples, ds, refs


def load_models(args, tmp):
    """What load_trained returns; with --random-init the random models and sources (no test set, no references)."""
    if not args.random_init:
        return load_trained(args)
    import logging

    logging.getLogger("fairseq").setLevel(logging.WARNING)  # one "dictionary: N types" per model otherwise
    models, ckpts, data_dir, task = build_random_models(args, tmp)
    samples = random_sources(args, task.source_dictionary, args.sentences)
    return models, ckpts, data_dir, task, samples, None, None


def generation_options(args):
    if args.fixed_length:
        return dict(max_len_a=0, max_len_b=args.fixed_length, min_len=args.fixed_length)
    return dict(max_len_a=1.2, max_len_b=10)


# -- the contenders --------------------------------------------------------------------------------------------
def build_contenders(args, models, ckpts, data_dir, task, gen_opts, tmp):
    """Every contender, in the order of the table: the anchors, ours K=1 and the SATs, CTranslate2, the variants."""
    from fairseq.sequence_generator import SequenceGenerator

    from fairseq_ext.sat.generator import SATSequenceGenerator

    tgt_dict = task.target_dictionary

    def ours(model, cls=SATSequenceGenerator, **kw):
        return lambda beam: cls([model], tgt_dict, beam_size=beam, **gen_opts, **kw)

    teacher = models["K=1"]
    cs = [Contender("fairseq SequenceGenerator (transformer)", 1, "", model=teacher,
                    make_gen=lambda beam: SequenceGenerator([teacher], tgt_dict, beam_size=beam, **gen_opts)),
          Contender("ours K=1 (transformer)", 1, "", model=teacher, make_gen=ours(teacher))]
    if args.baseline_rev:
        cs.append(Contender(f"ours K=1 @{args.baseline_rev} (transformer)", 1, "@rev", model=teacher,
                            make_gen=ours(teacher, generator_at(args.baseline_rev)), of=cs[1]))
    for K in sorted(k for k in (int(n[2:]) for n in models if n.startswith("K=")) if k > 1):
        cs.append(Contender(f"ours SAT K={K}", K, "", model=models[f"K={K}"], make_gen=ours(models[f"K={K}"])))
    if "6+1 K=1" in models:
        ds_names = sorted((n for n in models if n.startswith("6+1 ")), key=lambda n: int(n.split("=")[1]))
        for n in ds_names:
            K = int(n.split("=")[1])
            label = "ours K=1 (transformer 6+1)" if K == 1 else f"ours SAT K={K} (6+1)"
            cs.append(Contender(label, K, "6+1", model=models[n], make_gen=ours(models[n])))
    if not args.no_ct2:
        add_ct2(args, cs, ckpts, data_dir, task, tmp)
    add_variants(args, cs, ours)
    return cs


def add_ct2(args, cs, ckpts, data_dir, task, tmp):
    """The CTranslate2 anchors (int8 and float32 of the transformer, int8 of the 6+1), appended to ``cs``."""
    for role, label in (("K=1", "transformer"), ("6+1 K=1", "transformer 6+1")):
        if role not in ckpts:
            continue
        out = ct2_convert(ckpts[role], data_dir, os.path.join(tmp, f"ct2-{role.replace(' ', '')}"), args)
        if out is None:
            break
        import ctranslate2

        types_ = ("int8", "float32") if role == "K=1" else ("int8",)
        for ct in types_:
            tr = ctranslate2.Translator(out, device="cpu", compute_type=ct, inter_threads=1,
                                        intra_threads=args.threads)
            ref = next((c for c in cs if c.name == f"ours K=1 ({label})"), None)
            cs.append(Contender(f"CTranslate2 {ct} ({label})", 1, "ct2", translator=tr,
                                dictionary=task.target_dictionary, src_dict=task.source_dictionary, of=ref))


def add_variants(args, cs, ours):
    """The opt-in --quantize / --float-opt variants of every float contender of ours, appended to ``cs``."""
    from fairseq_ext.inference.speedups import apply_speedups

    float_ours = [c for c in cs if c.name.startswith("ours") and c.family == ""]
    # family -> fairseq_ext.inference.speedups names
    variants = [(f"int8 {layers}", INT8_SPEEDUPS[layers]) for layers in args.quantize]
    variants += [(f"float {opt}", FLOAT_SPEEDUPS[opt]) for opt in args.float_opt]
    for family, speedups in variants:
        for c in float_ours:
            m = apply_speedups(copy.deepcopy(c.model), speedups)
            own = {"lean_step": False} if family == "float own-step" else {}
            cs.append(Contender(f"{c.name} [{family}]", c.K, family, variant=family, model=m, make_gen=ours(m, **own),
                                of=c))


def count_params(args, models):
    n_params = {"transformer 3+3" if not args.tiny else "transformer": sum(p.numel() for p in
                                                                             models["K=1"].parameters())}
    if "6+1 K=1" in models:
        n_params["transformer 6+1"] = sum(p.numel() for p in models["6+1 K=1"].parameters())
    return n_params


# -- measuring -------------------------------------------------------------------------------------------------
def time_batch1(args, cs, samples, beam, gen_opts, rng, base_j, teacher):
    """Batch 1: --block sentences in a row per contender, the contenders in a new random order per block and pass,
    each sentence's fastest of --repeat passes. Returns (seconds, decoder calls, output tokens, per sentence
    [(output length of ours K=1, seconds)], hypotheses) per contender and the encoder pass's seconds."""
    import torch

    tot = [0.0] * len(cs)
    calls = [0] * len(cs)
    toks = [0] * len(cs)
    per_sentence = [[] for _ in cs]  # (output length of ours K=1, seconds)
    hyps = [[] for _ in cs]
    enc_s = 0.0
    for first in range(0, len(samples), args.block):
        block = samples[first: first + args.block]
        lens = [[0] * len(cs) for _ in block]
        dts = [[math.inf] * len(cs) for _ in block]
        outs = [[None] * len(cs) for _ in block]
        for rep in range(args.repeat):
            order = list(range(len(cs)))
            rng.shuffle(order)
            for j in order:
                for i, sample in enumerate(block):
                    dt, out, n_calls = cs[j].decode(sample, beam, gen_opts)
                    dts[i][j] = min(dts[i][j], dt)
                    if rep == 0:
                        calls[j] += n_calls
                        outs[i][j] = out[0]
        for i, sample in enumerate(block):
            for j in range(len(cs)):
                tot[j] += dts[i][j]
                lens[i][j] = len(outs[i][j])
                toks[j] += lens[i][j]
                hyps[j].append(outs[i][j])
            for j in range(len(cs)):  # bucketed by the output length of ours K=1
                per_sentence[j].append((lens[i][base_j], dts[i][j]))
        for sample in block:  # the encoder pass alone: the part of a sentence's time no K can shrink
            t0 = time.perf_counter()
            with torch.no_grad():
                teacher.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
            enc_s += time.perf_counter() - t0
    return (tot, calls, toks, per_sentence, hyps), enc_s


def record_batch1(cs, results, mode, beam, timing, base_j, n):
    """Each contender's batch-1 figures of ``mode`` from time_batch1's ``timing`` over ``n`` sentences."""
    tot, calls, toks, per_sentence, hyps = timing
    names = [c.name for c in cs]
    for j, c in enumerate(cs):
        buckets = {}
        for (length, dt), (_, dt1) in zip(per_sentence[j], per_sentence[base_j]):
            b = "1-9" if length < 10 else ("10-19" if length < 20 else "20+")
            acc = buckets.setdefault(b, [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += dt
            acc[2] += dt1
        r = results[c.name]
        r[f"{mode}_b1_speedup_by_len"] = {b: {"sentences": v[0], "speedup": v[2] / v[1]}
                                          for b, v in buckets.items()}
        r[f"{mode}_b1_ms"] = 1000 * tot[j] / n
        r[f"{mode}_b1_ms_per_sentence"] = [1000 * dt for _, dt in per_sentence[j]]
        r[f"{mode}_b1_len"] = toks[j] / n
        if calls[j]:
            r[f"{mode}_b1_calls"] = calls[j] / n
        step = c.decoder_step(beam)
        if step is not None:
            r["decoder_step"] = step
        if c.of is not None:  # agreement with the float model's hypotheses (int8 variants), ours K=1 (ct2)
            ref = hyps[names.index(c.of.name)]
            same_pos = sum(sum(a == b for a, b in zip(h, g)) for h, g in zip(hyps[j], ref))
            r[f"{mode}_b1_agreement"] = {
                "sentences_identical": sum(h == g for h, g in zip(hyps[j], ref)) / len(ref),
                "tokens_identical": same_pos / max(1, sum(len(g) for g in ref))}


def time_throughput(args, cs, results, mode, beam, gen_opts, rng, ds, refs, tgt_dict):
    """Batch --batch throughput over the test set (batches of similar source length), interleaved, and BLEU."""
    import sacrebleu
    import torch

    n_tp = min(args.throughput_sentences, len(ds))
    order_by_len = sorted(range(n_tp), key=lambda i: ds.src_sizes[i])
    batches = [order_by_len[s: s + args.batch] for s in range(0, n_tp, args.batch)]
    tot = [0.0] * len(cs)
    out_text = [dict() for _ in cs]
    for b in batches:
        sample = ds.collater([ds[i] for i in b])
        order = list(range(len(cs)))
        rng.shuffle(order)
        for j in order:
            dt, out, _ = cs[j].decode(sample, beam, gen_opts)
            tot[j] += dt
            for sid, h in zip(sample["id"].tolist(), out):
                out_text[j][sid] = tgt_dict.string(torch.tensor(h), "sentencepiece")
    for j, c in enumerate(cs):
        r = results[c.name]
        r[f"{mode}_b{args.batch}_sent_per_s"] = n_tp / tot[j]
        r[f"{mode}_bleu"] = sacrebleu.corpus_bleu([out_text[j][i] for i in range(n_tp)], [refs[:n_tp]]).score
    print(f"[{mode}] batch {args.batch} done", flush=True)


def measure(args, cs, samples, ds, refs, tgt_dict, gen_opts, teacher):
    """Greedy then beam 4: batch 1 (and the throughput unless --no-throughput) of every contender.
    Returns (results by contender, analysis, index of ours K=1, load average before and after)."""
    base_j = [c.name for c in cs].index("ours K=1 (transformer)")
    rng = random.Random(0)
    load_before = os.getloadavg()
    results = {c.name: {"K": c.K, "family": c.family or "3+3"} for c in cs}
    analysis = {}
    for mode, beam in (("greedy", 1), ("beam4", 4)):
        for c in cs:  # warm-up
            c.decode(samples[0], beam, gen_opts)
        t_mode = time.perf_counter()
        timing, enc_s = time_batch1(args, cs, samples, beam, gen_opts, rng, base_j, teacher)
        analysis[f"{mode}_encoder_ms"] = 1000 * enc_s / len(samples)
        record_batch1(cs, results, mode, beam, timing, base_j, len(samples))
        print(f"[{mode}] batch 1 done ({len(samples)} sentences, {time.perf_counter() - t_mode:.0f} s)", flush=True)
        if not args.no_throughput:
            time_throughput(args, cs, results, mode, beam, gen_opts, rng, ds, refs, tgt_dict)
    return results, analysis, base_j, load_before, os.getloadavg()


def check_fixed_length(args, results):
    """Every contender must have decoded exactly --fixed-length words + EOS."""
    for name, r in results.items():
        for mode in ("greedy", "beam4"):
            if abs(r[f"{mode}_b1_len"] - (args.fixed_length + 1)) > 1e-9:
                sys.exit(f"error: {name} {mode} decoded {r[f'{mode}_b1_len']:.2f} tokens per sentence, not "
                         f"--fixed-length {args.fixed_length} + EOS: the lengths are not forced for it")


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import fairseq_ext  # noqa: F401  (registers the models, safe checkpoint loading)

    code = git_info()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    tmp = tempfile.TemporaryDirectory(prefix="bench-sat-")
    models, ckpts, data_dir, task, samples, ds, refs = load_models(args, tmp.name)
    gen_opts = generation_options(args)
    cs = build_contenders(args, models, ckpts, data_dir, task, gen_opts, tmp.name)
    n_params = count_params(args, models)
    print("contenders: " + "; ".join(c.name for c in cs), flush=True)
    print("parameters: " + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in n_params.items()), flush=True)
    results, analysis, base_j, load_before, load_after = measure(args, cs, samples, ds, refs, task.target_dictionary,
                                                                 gen_opts, models["K=1"])
    finished = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.fixed_length:
        check_fixed_length(args, results)
    return report(args, cs, results, analysis, n_params, load_before, load_after, code, started, finished, base_j)


# -- the report ------------------------------------------------------------------------------------------------
def print_table(args, cs, results, base, load_before, load_after, code, started, finished):
    src = ("random-init models (" + ("tiny" if args.tiny else "quickstart size: d 256, FFN 512, 4 heads") +
           f"), random sources of {RANDOM_SIZES['tiny' if args.tiny else 'full']['src_mean']} tokens on average"
           if args.random_init else "bundled de-en test set")
    gen_code = code["fairseq_ext/sat/generator.py"]
    print(f"SAT decoding benchmark: {src}, batch 1 on {args.sentences} sentences (each contender {args.block} in a "
          f"row, contenders in random order per block"
          + (f"; each time the fastest of {args.repeat} passes" if args.repeat > 1 else "") + ")"
          + f", torch threads {args.threads}, "
          f"load average {load_before[0]:.1f} before / {load_after[0]:.1f} after on {os.cpu_count()} cores "
          f"(shared machine: compare ratios); {started} - {finished}; code: HEAD {code['head']}, "
          f"generator.py {gen_code['sha1']}"
          f"{' (uncommitted changes)' if gen_code['uncommitted_changes'] else ''}"
          + (f"; every output forced to {args.fixed_length} words + EOS" if args.fixed_length else ""))
    cols = ["greedy_b1_ms", "beam4_b1_ms"] + ([] if args.no_throughput else
                                             [f"greedy_b{args.batch}_sent_per_s", f"beam4_b{args.batch}_sent_per_s",
                                              "greedy_bleu", "beam4_bleu"])
    print("contender\t" + "\t".join(cols) + "\tgreedy_b1_vs_ours_K1\tbeam4_b1_vs_ours_K1"
          + ("" if args.no_throughput else f"\tgreedy_b{args.batch}_speedup\tbeam4_b{args.batch}_speedup")
          + "\tgreedy_calls/sent\tgreedy_len\tsame tokens as (greedy/beam4)")
    for c in cs:
        r = results[c.name]
        cells = [f"{r[k]:.2f}" for k in cols]
        cells += [f"{base['greedy_b1_ms'] / r['greedy_b1_ms']:.2f}x", f"{base['beam4_b1_ms'] / r['beam4_b1_ms']:.2f}x"]
        if not args.no_throughput:
            for m in ("greedy", "beam4"):
                k = f"{m}_b{args.batch}_sent_per_s"
                cells.append(f"{r[k] / base[k]:.2f}x")
        cells.append(f"{r.get('greedy_b1_calls', float('nan')):.2f}")
        cells.append(f"{r['greedy_b1_len']:.2f}")
        agr = [r.get(f"{m}_b1_agreement") for m in ("greedy", "beam4")]
        cells.append("/".join(f"{a['tokens_identical']:.2f}" for a in agr) + f" ({c.of.name})" if agr[0] else "")
        print(c.name + "\t" + "\t".join(cells))


def print_call_costs(cs, results, analysis, base):
    """Where the time goes at batch 1 (greedy): the encoder pass E is paid once per sentence whatever K is; with
    c = (T - E) / calls the cost of one decoder call (incl. search), T_K = E + ceil(n/K) c_K, and the best a K can
    give at the measured length n is (E + n' c_1) / (E + ceil(n'/K) c_1) with n' = calls of K=1. Returns (E, c_1)."""
    E = analysis["greedy_encoder_ms"]
    c1 = (base["greedy_b1_ms"] - E) / base["greedy_b1_calls"]
    print(f"greedy batch 1: encoder {E:.2f} ms/sentence, one K=1 decoder call {c1:.2f} ms, "
          f"{base['greedy_b1_calls']:.2f} calls/sentence")
    for c in cs:
        r = results[c.name]
        if c.name.startswith("ours SAT") and c.family == "":
            cK = (r["greedy_b1_ms"] - E) / r["greedy_b1_calls"]
            calls1 = base["greedy_b1_calls"]
            bound = (E + calls1 * c1) / (E + math.ceil(calls1 / c.K) * c1)
            r["greedy_b1_call_ms"] = cK
            r["greedy_b1_bound_if_call_cost_equal_k1"] = bound
            by_len = ", ".join(f"len {b}: {v['speedup']:.2f}x ({v['sentences']})"
                               for b, v in sorted(r["greedy_b1_speedup_by_len"].items()))
            print(f"  {c.name}: one call {cK:.2f} ms ({cK / c1:.2f}x a K=1 call); speed-up bound at this length if "
                  f"a call cost what a K=1 call costs: {bound:.2f}x; greedy speed-up by K=1 output length: {by_len}")
    return E, c1


def family_speedups(cs, results, family, spread=None):
    """Speed-ups of a family's SATs over its own K=1 (float 3+3 = the targets; 6+1; each int8 variant)."""
    k1 = next((c for c in cs if c.family == family and c.K == 1 and c.name.startswith("ours")), None)
    if k1 is None:
        return {}
    out = {}
    for mode in ("greedy", "beam4"):
        sats = [c for c in cs if c.family == family and c.K > 1 and c.name.startswith("ours")]
        out[mode] = {str(c.K): results[k1.name][f"{mode}_b1_ms"] / results[c.name][f"{mode}_b1_ms"] for c in sats}
        if spread is not None:  # the same ratio sentence by sentence: 10th, 50th and 90th percentile
            for c in sats:
                per = sorted(a / b for a, b in zip(results[k1.name][f"{mode}_b1_ms_per_sentence"],
                                                   results[c.name][f"{mode}_b1_ms_per_sentence"]))
                q = [per[min(len(per) - 1, int(f * len(per)))] for f in (0.1, 0.5, 0.9)]
                spread.setdefault(family, {}).setdefault(mode, {})[str(c.K)] = q
    return out


def print_targets(by_family, spread):
    """The CPU targets of each family's speed-ups; True when the float 3+3 family meets them all."""
    ok = True
    for fam, sp in by_family.items():
        label = "float 3+3" if fam == "" else fam
        for mode in ("greedy", "beam4"):
            for K, target in CPU_TARGETS[mode].items():
                got = sp.get(mode, {}).get(str(K))
                if got is None:
                    continue
                met = got >= target
                if fam == "":
                    ok &= met
                q = spread[fam][mode][str(K)]
                print(f"target {mode} batch-1 speed-up K={K} ({label}, over its own K=1): >= {target}x, "
                      f"measured {got:.2f}x (sentence by sentence: median {q[1]:.2f}x, 10-90% {q[0]:.2f}-"
                      f"{q[2]:.2f}x)  {'ok' if met else 'BELOW TARGET'}")
    return ok


def print_anchor_checks(args, cs, results, base, checks):
    """Ours K=1 against fairseq's generator (a target) and --baseline-rev, the SAT against CTranslate2 int8 (a
    stretch); fills ``checks``; True when ours K=1 is at least 0.95x fairseq's speed."""
    ok = True
    fs = results["fairseq SequenceGenerator (transformer)"]
    for mode in ("greedy", "beam4"):
        ratio = fs[f"{mode}_b1_ms"] / base[f"{mode}_b1_ms"]
        checks[f"ours_k1_vs_fairseq_{mode}"] = ratio
        ok &= ratio >= 0.95
        print(f"target ours K=1 vs fairseq SequenceGenerator, {mode} batch 1: >= 0.95, measured {ratio:.2f}  "
              f"{'ok' if ratio >= 0.95 else 'BELOW TARGET'}")
    rev = next((c for c in cs if c.family == "@rev"), None)
    if rev is not None:
        k1s = [c for c in cs if c.K == 1 and c.name.startswith("ours K=1 (transformer)")]  # float, int8 variants
        for c in k1s:
            for mode in ("greedy", "beam4"):
                ratio = results[rev.name][f"{mode}_b1_ms"] / results[c.name][f"{mode}_b1_ms"]
                checks[f"{c.name} vs {rev.name}, {mode}"] = ratio
                print(f"{c.name} vs ours K=1 @{args.baseline_rev}, {mode} batch 1: {ratio:.2f}x faster "
                      f"(target >= {K1_VS_BASELINE_REV}x)  {'ok' if ratio >= K1_VS_BASELINE_REV else 'BELOW'}")
    ct2_int8 = results.get("CTranslate2 int8 (transformer)")
    if ct2_int8:
        for c in cs:
            if c.name.startswith("ours SAT K=4") and "(6+1)" not in c.name:  # the 3+3 SAT, every family
                ratio = results[c.name]["greedy_b1_ms"] / ct2_int8["greedy_b1_ms"]
                checks[f"{c.name} greedy / CTranslate2 int8"] = ratio
                print(f"stretch: {c.name} greedy batch 1 at or below CTranslate2 int8 (same-size transformer): "
                      f"{results[c.name]['greedy_b1_ms']:.2f} vs {ct2_int8['greedy_b1_ms']:.2f} ms ({ratio:.2f}x its "
                      f"latency; output lengths {results[c.name]['greedy_b1_len']:.1f} vs "
                      f"{ct2_int8['greedy_b1_len']:.1f})  {'ok' if ratio <= 1 else 'not met'}")
    return ok


def report(args, cs, results, analysis, n_params, load_before, load_after, code, started, finished, base_j):
    base = results[cs[base_j].name]
    print()
    print_table(args, cs, results, base, load_before, load_after, code, started, finished)
    print()
    E, c1 = print_call_costs(cs, results, analysis, base)
    print()
    spread = {}
    by_family = {f: family_speedups(cs, results, f, spread) for f in dict.fromkeys(c.family for c in cs)
                 if f not in ("ct2", "@rev")}
    ok = print_targets(by_family, spread)
    checks = {}
    ok &= print_anchor_checks(args, cs, results, base, checks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"speedup_vs_k1": by_family.get("", {}),
                       "speedup_vs_k1_by_family": {("3+3" if k == "" else k): v for k, v in by_family.items()},
                       "speedup_vs_k1_per_sentence_p10_p50_p90": {("3+3" if k == "" else k): v
                                                                  for k, v in spread.items()},
                       "ms_per_sentence": {c.name: {m: results[c.name][f"{m}_b1_ms"] for m in ("greedy", "beam4")}
                                           for c in cs},
                       "targets": {m: {str(k): v for k, v in t.items()} for m, t in CPU_TARGETS.items()},
                       "checks": checks, "results": results,
                       "analysis": {"encoder_ms": E, "k1_call_ms": c1}, "params": n_params,
                       "settings": {"random_init": args.random_init, "tiny": args.tiny, "sentences": args.sentences,
                                    "fixed_length": args.fixed_length, "threads": args.threads, "block": args.block,
                                    "repeat": args.repeat,
                                    "quantize": args.quantize, "baseline_rev": args.baseline_rev},
                       "code": code, "started": started, "finished": finished,
                       "load": [load_before, load_after]}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
