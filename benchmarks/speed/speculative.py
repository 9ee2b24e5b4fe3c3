"""Lossless speculative decoding (``--sat-draft-path``) against the verifier's own greedy search, in one run.

    python -m benchmarks.speed.speculative [--workdir work/bench-speculative] [--drafter NAME=PATH[@SPEEDUPS] ...]
                                           [--sentences 1003] [--batch 64] [--threads 1] [--block 10] [--no-ct2]
                                           [--noise-sentences 200] [--json FILE]

The verifier is the release transformer (releases/bible-de-en/transformer.pt, float32, our generator's default
path); the drafters are the release's SAT models (every ``sat_*.pt`` of the release directory by default, or
``--drafter``; ``@int8-decoder,int8-encoder``: the drafter's own speed-ups, ``--sat-draft-speedups``). Data: the
Acts test set (data/bible-de-en, 1,003 verses) encoded with the release's BPE and binarised with its dictionary
(:func:`acts_test_bin`). Decoding options: greedy, --max-len-a 1.2 --max-len-b 10 (the quickstart's).

Measured, every contender in this one process (each block of --block sentences decoded by every contender in turn,
in a new random order per block, so that the load of the machine falls on all alike):

* batch 1, --threads threads: ms per sentence of the verifier's greedy search (``greedy K=1``: our K=1 path, the
  baseline), of each speculative contender and of CTranslate2 int8 / float32 greedy on the same transformer
  (``pip install --no-deps ctranslate2==4.8.5``; skipped with a note when missing); the ratio of each to the
  baseline; the outputs identical to the baseline's (x / N); accepted drafts and words per verifier call;
  sentences decided by the verifier alone (``fallbacks``: a decision within eps of a tie);
* batch --batch: sentences per second over the test set (batches of sentences of similar length, as
  fairseq-generate makes them), baseline and speculative, and the identical outputs at that batch size;
* noise: the largest difference between a log-probability the speculative search computed for a decided position
  and the verifier's one-position step along the same prefix (--noise-sentences sentences, batch 1 and --batch),
  against the guard eps (fairseq_ext/sat/speculative.py).

Ratios are measured in one run with the absolute numbers beside them; the machine's load is printed before and
after. Exit status 1 when an output differs from the verifier's.
"""

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELEASE = os.path.join(ROOT, "releases", "bible-de-en")
CORPUS = os.path.join(ROOT, "data", "bible-de-en")
GEN_OPTS = dict(max_len_a=1.2, max_len_b=10)


def acts_test_bin(workdir, release=RELEASE, corpus=CORPUS, src="de", tgt="en"):
    """The test split of the bundled Bible corpus encoded as tools/prepare_bundled_corpus.py encodes it (with the
    release's spm.model) and binarised with the release's dict.txt, ``src`` -> ``tgt``; returns the data directory
    (made once)."""
    out = os.path.join(workdir, "acts-bin")
    if os.path.exists(os.path.join(out, ".done")):
        return out
    import sentencepiece as spm

    text = os.path.join(workdir, "acts-text")
    os.makedirs(text, exist_ok=True)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(release, "spm.model"))
    for lang in ("de", "en"):
        with gzip.open(os.path.join(corpus, f"test.{lang}.gz"), "rt", encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f.readlines()]
        with open(os.path.join(text, f"test.spm.{lang}"), "w", encoding="utf-8") as g:
            g.writelines(" ".join(pieces) + "\n" for pieces in sp.encode(lines, out_type=str))
    subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", src, "--target-lang", tgt,
                    "--testpref", os.path.join(text, "test.spm"), "--destdir", out, "--srcdict",
                    os.path.join(release, "dict.txt"), "--tgtdict", os.path.join(release, "dict.txt"),
                    "--workers", "1"], check=True, capture_output=True, cwd=ROOT)
    open(os.path.join(out, ".done"), "w").close()
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(ROOT, "work", "bench-speculative"))
    p.add_argument("--verifier", default=os.path.join(RELEASE, "transformer.pt"))
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH[@SPEEDUPS]",
                   help="a drafter (repeatable; default: every sat_*.pt of the release directory)")
    p.add_argument("--sentences", type=int, default=1003, help="test sentences of the batch-1 latency")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--noise-sentences", type=int, default=200)
    p.add_argument("--no-ct2", action="store_true")
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--throughput-sentences", type=int, default=None, help="verses of the batch runs (default all)")
    p.add_argument("--sweep", type=int, nargs="*", default=[], metavar="B",
                   help="throughput of the first drafter against greedy at these batch sizes (speculation forced; "
                        "--sweep-sentences verses): where --sat-draft-max-batch should be")
    p.add_argument("--sweep-sentences", type=int, default=256)
    p.add_argument("--parts", action="store_true", help="ms of one decoder call per kind (the first drafter): why "
                                                         "a speculative step costs what it costs")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def drafter_specs(args):
    if args.drafter:
        specs = []
        for spec in args.drafter:
            name, _, rest = spec.partition("=")
            path, _, speedups = rest.partition("@")
            specs.append((name, path, speedups))
        return specs
    return [(f[:-3], os.path.join(RELEASE, f), "") for f in sorted(os.listdir(RELEASE))
            if f.startswith("sat_") and f.endswith(".pt")]


def noise(spec_gen, verifier, samples, batch):
    """The largest |difference| between the speculative search's log-probability of a decided position and the
    verifier's one-position lean step along the same prefix; and the number of positions compared."""
    import torch

    from fairseq_ext.inference.lean_decoder import lean_step

    worst, count = 0.0, 0
    limit, spec_gen.max_batch = spec_gen.max_batch, batch  # speculation at this batch size
    for first in range(0, len(samples), batch):
        group = samples[first: first + batch]
        sample = collate(group)
        spec_gen.record = []
        out = spec_gen.generate([verifier], sample)
        records = {}
        for sid, step, lp in spec_gen.record:
            records[(sid, step)] = lp
        spec_gen.record = None
        for r, hyp in enumerate(out):
            sid = int(sample["id"][r])
            row = {k: v[r: r + 1] for k, v in sample["net_input"].items() if torch.is_tensor(v)}
            tokens = torch.cat([torch.tensor([spec_gen.eos]), hyp[0]["tokens"]]).unsqueeze(0)
            with torch.inference_mode():
                enc = verifier.encoder(row["src_tokens"], src_lengths=row["src_lengths"])
                state = {}
                for t in range(tokens.size(1) - 1):
                    x, extra = lean_step(verifier.decoder, tokens[:, : t + 1], enc, state)
                    lp = verifier.get_normalized_probs((verifier.decoder.output_layer(x), extra), log_probs=True)[0, -1]
                    got = records.get((sid, t))
                    if got is None:  # a sentence the verifier decided alone
                        continue
                    both = lp.isfinite() & got.isfinite()
                    worst = max(worst, float((lp[both] - got[both]).abs().max()))
                    count += 1
    spec_gen.max_batch = limit
    return worst, count


def parts(spec_gen, verifier, sample, repeat=300):
    """Milliseconds of one decoder call with its output projection, at batch 1 after 20 cached positions: the
    verifier's one-position step (what the greedy search calls per word), the verifier over K + 1 positions and the
    drafter over K (what the speculative search calls per step), each timed warm, one after the other."""
    import torch

    from fairseq_ext.inference.lean_decoder import cut_back, lean_step, rows_step

    K, drafter = spec_gen.K, spec_gen.drafter
    out = {}
    with torch.inference_mode():
        enc = verifier.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
        words = torch.full((1, 24 + K), 7)
        cases = [("verifier, 1 position (greedy)", verifier, 1, lambda st: (lean_step(
                     verifier.decoder, words[:, :21], enc, st)[0], verifier.decoder.output_layer)),
                 (f"verifier, {K + 1} positions", verifier, K + 1, lambda st: (rows_step(
                     verifier.decoder, words[:, 20: 21 + K], [20], enc, st)[0], None)),
                 (f"drafter, {K} positions", drafter, K, lambda st: (rows_step(
                     drafter.decoder, words[:, 20: 20 + K], [20], enc, st, group=K)[0], None))]
        for label, model, T, call in cases:
            st = {}
            rows_step(model.decoder, words[:, :20], [0], enc, st)
            h, proj = call(st)
            # TODO(public): the speculative search's own projection (SpeculativeSATGenerator._output)
            project = proj or (lambda x, m=model: spec_gen._output(m.decoder, x))
            t0 = time.perf_counter()
            for _ in range(repeat):
                cut_back(model.decoder, st, 20)
                h, _ = call(st)
                project(h)
            out[label] = 1000 * (time.perf_counter() - t0) / repeat
        # the products inside: the verifier's output projection and first feed-forward layer, 1 row against K + 1
        for name, lin in (("output projection", verifier.decoder.output_projection),
                          ("feed-forward fc1", verifier.decoder.layers[0].fc1)):
            for rows in (1, K + 1):
                x = torch.randn(rows, lin.in_features)
                lin(x)
                t0 = time.perf_counter()
                for _ in range(repeat):
                    lin(x)
                out[f"{name}, {rows} row{'s' if rows > 1 else ''}"] = 1000 * (time.perf_counter() - t0) / repeat
    return out


_DATASET = None


def collate(samples):
    return _DATASET.collater(samples)


def load_verifier(args):
    """The verifier on the Acts test set: (verifier, task, test dataset, its items, the first --sentences as
    batch-1 samples, the data directory)."""
    from fairseq import checkpoint_utils

    global _DATASET
    os.makedirs(args.workdir, exist_ok=True)
    data = acts_test_bin(args.workdir)
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.verifier], arg_overrides={"data": data, "source_lang": "de", "target_lang": "en"})
    verifier = models[0].eval()
    task.load_dataset("test")
    ds = _DATASET = task.dataset("test")
    n = min(args.sentences, len(ds))
    items = [ds[i] for i in range(len(ds))]
    singles = [ds.collater([items[i]]) for i in range(n)]
    return verifier, task, ds, items, singles, data


def build_contenders(args, verifier, task, data, tmp):
    """Greedy K=1, one speculative search per drafter, the CTranslate2 anchors: (contenders, {label: generator})."""
    from fairseq_ext.inference.speedups import apply_speedups
    from fairseq_ext.sat.generator import SATSequenceGenerator
    from fairseq_ext.sat.speculative import SpeculativeSATGenerator, load_drafter

    from .sat_contenders import Contender, ct2_contenders

    tgt_dict = task.target_dictionary
    cs = [Contender("greedy K=1", 1, "", model=verifier,
                    make_gen=lambda beam: SATSequenceGenerator([verifier], tgt_dict, beam_size=1, **GEN_OPTS))]
    spec_gens = {}
    for name, path, speedups in drafter_specs(args):
        drafter = load_drafter(path, task, verifier)
        if speedups:
            apply_speedups(drafter, speedups, flag="--sat-draft-speedups")
        gen = SpeculativeSATGenerator([verifier], drafter, tgt_dict, beam_size=1, **GEN_OPTS)
        label = f"speculative {name} (K={gen.K}{', ' + speedups if speedups else ''})"
        spec_gens[label] = gen
        cs.append(Contender(label, gen.K, "spec", model=verifier, make_gen=lambda beam, g=gen: g))
    if not args.no_ct2:
        args.source_lang, args.target_lang = "de", "en"
        cs += ct2_contenders(args.verifier, data, os.path.join(tmp, "ct2"), args, task, label="CTranslate2 {} greedy")
    return cs, spec_gens


def time_batch1(args, cs, spec_gens, singles):
    """Batch 1, --block verses in a row per contender, in a new random order per block: ms per sentence, outputs
    identical to greedy's, and each speculative search's accepted drafts per verifier call."""
    n = len(singles)
    rng = random.Random(0)
    tot = {c.name: 0.0 for c in cs}
    hyps = {c.name: [] for c in cs}
    for c in cs:
        c.decode(singles[0], 1, GEN_OPTS)
    for g in spec_gens.values():
        g.stats = {k: 0 for k in g.stats}
    for first in range(0, n, args.block):
        block = singles[first: first + args.block]
        order = list(range(len(cs)))
        rng.shuffle(order)
        for j in order:
            for sample in block:
                dt, out, _ = cs[j].decode(sample, 1, GEN_OPTS)
                tot[cs[j].name] += dt
                hyps[cs[j].name].append(out[0])
    base = hyps["greedy K=1"]
    results = {}
    for c in cs:
        same = sum(int(a == b) for a, b in zip(base, hyps[c.name]))
        results[c.name] = {"ms_per_sentence": 1000 * tot[c.name] / n, "identical": same,
                           "speedup": tot["greedy K=1"] / tot[c.name]}
        g = spec_gens.get(c.name)
        if g is not None:
            st = g.stats
            results[c.name].update(accepted_per_call=st["accepted"] / st["verifier_calls"],
                                   words_per_call=(st["accepted"] + st["verifier_calls"]) / st["verifier_calls"],
                                   fallbacks=st["fallbacks"], verifier_calls=st["verifier_calls"])
    return results


def throughput(gen, verifier, ds, items, order, batch, count):
    """Sentences per second of ``gen`` over the first ``count`` verses by length, batches of ``batch``."""
    batches = [ds.collater([items[i] for i in order[b: min(b + batch, count)]]) for b in range(0, count, batch)]
    gen.generate([verifier], batches[0])  # warm-up
    res, t0 = {}, time.perf_counter()
    for b in batches:
        for sid, h in zip(b["id"].tolist(), gen.generate([verifier], b)):
            res[sid] = h[0]["tokens"].tolist()
    return count / (time.perf_counter() - t0), res


def time_batches(args, cs, results, verifier, ds, items, order, n_batch):
    """Batch --batch throughput of every contender but CTranslate2 (speculation forced), outputs against greedy's."""
    outs = {}
    for c in cs:
        if c.family == "ct2":
            continue
        gen = c.make_gen(1)
        limit = getattr(gen, "max_batch", None)
        if limit is not None:  # speculation forced at this batch size (the default decodes alone over it)
            gen.max_batch = args.batch
        results[c.name]["batch_sentences_per_s"], outs[c.name] = throughput(gen, verifier, ds, items, order,
                                                                             args.batch, n_batch)
        if limit is not None:
            gen.max_batch = limit
    for name in outs:
        results[name]["batch_identical"] = sum(int(outs[name][i] == outs["greedy K=1"][i]) for i in outs[name])
        results[name]["batch_speedup"] = (results[name]["batch_sentences_per_s"]
                                          / results["greedy K=1"]["batch_sentences_per_s"])


def sweep_batches(args, cs, spec_gens, verifier, ds, items, order):
    """Where speculation stops paying: the first drafter's throughput against greedy's by batch size."""
    from fairseq_ext.sat.speculative import MAX_BATCH

    sweep = {}
    label, gen = next(iter(spec_gens.items()))
    greedy = cs[0].make_gen(1)
    count = min(len(ds), args.sweep_sentences)
    for batch in args.sweep:
        gen.max_batch = batch
        g = throughput(greedy, verifier, ds, items, order, batch, count)[0]
        sp = throughput(gen, verifier, ds, items, order, batch, count)[0]
        sweep[batch] = (g, sp)
    gen.max_batch = MAX_BATCH
    return sweep


def print_report(args, cs, results, n, n_batch, sweep, calls, worst, load_before, load_after):
    from fairseq_ext.sat.speculative import EPS, MAX_BATCH

    print(f"\nbatch 1, {args.threads} thread(s), {n} Acts test verses; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after")
    print(f"{'contender':46s} {'ms/sentence':>11s} {'vs greedy':>9s} {'identical':>10s} {'accepted/call':>13s} "
          f"{'words/call':>10s} {'fallbacks':>9s}")
    for c in cs:
        r = results[c.name]
        extra = (f"{r['accepted_per_call']:13.2f} {r['words_per_call']:10.2f} {r['fallbacks']:9d}"
                 if "accepted_per_call" in r else "")
        print(f"{c.name:46s} {r['ms_per_sentence']:11.2f} {r['speedup']:8.2f}x {r['identical']:5d}/{n:<4d} {extra}")
    if not args.no_throughput:
        print(f"\nbatch {args.batch}: sentences per second over {n_batch} verses")
        for name, r in results.items():
            if "batch_sentences_per_s" in r:
                print(f"{name:46s} {r['batch_sentences_per_s']:9.1f}/s {r['batch_speedup']:6.2f}x "
                      f"identical {r['batch_identical']}/{n_batch}")
    if not args.no_throughput:
        print(f"(speculation forced at batch {args.batch}; by default batches over {MAX_BATCH} sentences are decoded "
              f"by the verifier alone)")
    for batch, (g, sp) in sweep.items():
        print(f"batch {batch:3d}: greedy {g:7.1f}/s, speculative {sp:7.1f}/s ({sp / g:.2f}x)")
    for label, ms in calls.items():
        if "row" in label:
            one = calls[label.rsplit(",", 1)[0] + ", 1 row"]
            print(f"product ({label}): {ms:.3f} ms ({ms / one:.2f}x one row)")
        else:
            print(f"one call ({label}, with its output projection): {ms:.3f} ms "
                  f"({ms / calls['verifier, 1 position (greedy)']:.2f}x the greedy one)")
    for batch, (w, count) in worst.items():
        print(f"noise (batch {batch}): largest |difference| {w:.2e} over {count} decided positions; eps {EPS:g} "
              f"({EPS / max(w, 1e-30):.0f} times it)")


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import fairseq_ext  # noqa: F401

    verifier, task, ds, items, singles, data = load_verifier(args)
    n = len(singles)
    tmp = tempfile.TemporaryDirectory()
    cs, spec_gens = build_contenders(args, verifier, task, data, tmp.name)
    from .decode import compiled_searches

    compiled_searches(cs[0], singles[0])  # greedy times its compiled step and search graph, not their compile
    print("contenders: " + "; ".join(c.name for c in cs), flush=True)
    load_before = os.getloadavg()
    results = time_batch1(args, cs, spec_gens, singles)
    order = sorted(range(len(ds)), key=lambda i: (items[i]["source"].numel(), i))
    n_batch = min(len(ds), args.throughput_sentences or len(ds))
    if not args.no_throughput:
        time_batches(args, cs, results, verifier, ds, items, order, n_batch)
    sweep = sweep_batches(args, cs, spec_gens, verifier, ds, items, order) if args.sweep and spec_gens else {}
    calls = {}
    if args.parts and spec_gens:
        calls = parts(next(iter(spec_gens.values())), verifier, singles[min(5, n - 1)])
    worst = {}
    if spec_gens and args.noise_sentences:
        label, gen = next(iter(spec_gens.items()))
        sel = [items[i] for i in range(min(args.noise_sentences, len(ds)))]
        for batch in (1, args.batch):
            worst[batch] = noise(gen, verifier, sel, batch)
    load_after = os.getloadavg()
    print_report(args, cs, results, n, n_batch, sweep, calls, worst, load_before, load_after)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "noise": {str(b): w for b, w in worst.items()}, "sentences": n,
                       "sweep": {str(b): v for b, v in sweep.items()}, "parts_ms": calls,
                       "threads": args.threads, "batch": args.batch, "load": [load_before, load_after]}, f, indent=1)
    differ = any(r["identical"] < n or r.get("batch_identical", n_batch) < n_batch
                 for name, r in results.items() if name.startswith("speculative"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
