"""Decoding speed of the release models on the Acts test, every decoding path measured in one run.

    python -m benchmarks.speed.decode [--sentences 200] [--batch 64] [--threads 1] [--sat NAME=PATH ...]
                                      [--no-ct2] [--json FILE] [--workdir work/bench-decode] [--quick]

Contenders (the release transformer unless named otherwise), each decoding the same batches:

* ``fairseq``: fairseq's own ``SequenceGenerator`` (what ``FAIRSEQ_EXT_STOCK_GENERATOR=1`` gives);
* ``default``: what ``fairseq-generate --task translation --user-dir fairseq_ext`` builds, through the task's
  ``build_generator`` (the group search at K = 1 on the static decoder step of
  ``fairseq_ext/inference/static_step.py``);
* ``lean``: the same search on the lean step (``--task translation_sat --no-static-step``), the step before it;
* ``SAT K=2`` / ``K=4`` / ``K=6`` (the releases ``sat_transformer_k{2,4,6}.pt``; more with ``--sat NAME=PATH``) through
  ``--task translation_sat``'s generator, on the static step;
* ``int8``: the default search with every decoder ``nn.Linear`` in int8 (``--inference-speedups int8-decoder``,
  PyTorch's dynamic quantisation, on the same static step);
* ``CTranslate2 int8`` and ``float32``: the transformer converted with CTranslate2's fairseq converter (the ``bench``
  extra: ``pip install -e .[bench]``, or ``pip install ctranslate2==4.8.5``; left out with a note when it is
  missing).

Four settings: batch 1 (the first --sentences verses, one at a time) and batches of --batch sentences (the whole
test set, batched by fairseq's iterator as fairseq-generate batches it), each greedy and beam 4, --max-len-b 200.
Interleaved: the batches are taken in blocks of 10 and every block is decoded by every contender in a new random
order, so that the machine's load falls on all alike; all ratios are measured in this one run. The table gives ms
per sentence, sentences per second, the ratio to CTranslate2 int8, sacreBLEU on the detokenised output (its
signature printed once) and the share of hypotheses identical, token for token, to fairseq's.

Timings only (``--json`` adds the hypotheses' agreement and BLEU per contender and setting); no test asserts a speed.
"""

import argparse
import json
import os
import random
import sys
import time

from .sat_contenders import ROOT, Contender, ct2_contenders
from .speculative import CORPUS, RELEASE, acts_test_bin


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(ROOT, "work", "bench-decode"))
    p.add_argument("--release", default=RELEASE, help="the release directory (transformer.pt, sat_*.pt, dict.txt)")
    p.add_argument("--sentences", type=int, default=200, help="verses decoded one at a time (default 200)")
    p.add_argument("--batch", type=int, default=64, help="sentences per batch of the batched settings (default 64)")
    p.add_argument("--batched-sentences", type=int, default=0,
                   help="verses of the batched settings (default 0: the whole test set)")
    p.add_argument("--threads", type=int, default=1, help="torch and CTranslate2 threads (default 1)")
    p.add_argument("--sat", action="append", default=[], metavar="NAME=PATH",
                   help="another SAT checkpoint (e.g. 'SAT K=4=work/k4.pt'; the name ends at the last '=')")
    p.add_argument("--no-ct2", action="store_true", help="leave out CTranslate2")
    p.add_argument("--no-int8", action="store_true", help="leave out the int8 contender")
    p.add_argument("--quick", action="store_true", help="batch 1 only, greedy and beam 4 (the tests)")
    p.add_argument("--capture", action="store_true",
                   help="instead: the static step's decoder call captured each way (eager, torch.jit.trace, "
                        "AOTInductor with and without its GEMM template, with the attention fused or as batched "
                        "products, torch.compile) and each weight layout, us per call at 1, 4, 16 and 64 rows")
    p.add_argument("--no-compile", action="store_true", help="with --capture: leave torch.compile out")
    p.add_argument("--json", help="write the table and the details here")
    p.add_argument("--seed", type=int, default=1)
    # CTranslate2's FairseqConverter reads these
    p.add_argument("--source-lang", default="de")
    p.add_argument("--target-lang", default="en")
    return p.parse_args(argv)


def load(path, data):
    """The model of ``path`` and the task it was trained with (the release SATs: translation_sat)."""
    from fairseq import checkpoint_utils

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data})
    return models[0].eval(), task


def gen_args(beam):
    return argparse.Namespace(beam=beam, nbest=1, max_len_a=0, max_len_b=200, min_len=1, lenpen=1.0, unkpen=0.0,
                              temperature=1.0, no_repeat_ngram_size=0, unnormalized=False)


def contenders(args, data):
    import copy

    from fairseq.sequence_generator import SequenceGenerator

    from fairseq_ext.inference.speedups import apply_speedups
    from fairseq_ext.sat.generator import SATSequenceGenerator

    tr, task = load(os.path.join(args.release, "transformer.pt"), data)
    D = task.target_dictionary
    cs = [
        Contender("fairseq", 1, "fairseq", model=tr,
                  make_gen=lambda beam: SequenceGenerator([tr], D, beam_size=beam, max_len_b=200)),
        Contender("default", 1, "ours", model=tr, make_gen=lambda beam: task.build_generator([tr], gen_args(beam))),
        Contender("lean", 1, "ours", model=tr,
                  make_gen=lambda beam: SATSequenceGenerator([tr], D, beam_size=beam, max_len_b=200,
                                                             static_step=False)),
    ]
    sats = [(f"SAT K={K}", os.path.join(args.release, f"sat_transformer_k{K}.pt")) for K in (2, 4, 6)]
    sats = [s for s in sats if s[0] == "SAT K=2" or os.path.exists(s[1])]  # K=2 said missing, K=4/6 if released
    sats += [spec.rpartition("=")[::2] for spec in args.sat]
    for name, path in sats:
        if not os.path.exists(path):
            print(f"{name} left out: {path} does not exist", flush=True)
            continue
        m, sat_task = load(path, data)
        cs.append(Contender(name, int(m.decoder.group_size), "sat", model=m,
                            make_gen=lambda beam, m=m, t=sat_task: t.build_generator([m], gen_args(beam))))
    task.load_dataset("test")
    first = task.dataset("test").collater([task.dataset("test")[0]])
    for c in cs:
        if c.family != "fairseq" and c.name != "lean":
            compiled_searches(c, first)
    if not args.no_int8:
        q = apply_speedups(copy.deepcopy(tr), "int8-decoder")
        cs.append(Contender("int8", 1, "ours", variant="int8", model=q,
                            make_gen=lambda beam: task.build_generator([q], gen_args(beam))))
    if not args.no_ct2:
        cs += ct2_contenders(os.path.join(args.release, "transformer.pt"), data, os.path.join(args.workdir, "ct2"),
                             args, task)
    return cs, task


def compiled_step(name, model):
    """Waits for the static step of ``model`` compiled ahead of time (``fairseq_ext/inference/aot_step.py``: a
    background compile on the first run, the disk cache after), so that every search timed runs on it; prints
    which capture the step runs on. Returns the step (None where the model is not on it)."""
    from fairseq_ext.inference import aot_step
    from fairseq_ext.inference import static_step as ss

    if ss.static_refusal(model) is not None:
        return None
    step = ss.step_graph(model.decoder)
    if isinstance(step.compiled, aot_step.Pending):
        t0 = time.perf_counter()
        step.compiled.wait()
        step.refresh()
        print(f"{name}: static step compiled ahead of time in {time.perf_counter() - t0:.0f} s (cached for the next "
              f"run)", flush=True)
    print(f"{name}: static step {step.capture}", flush=True)
    return step


def compiled_searches(c, sample):
    """:func:`compiled_step` for contender ``c``, then its greedy and beam 4 searches' graphs
    (``fairseq_ext/sat/search_graph.py``, started by a first search of ``sample``), waited for likewise."""
    from fairseq_ext.sat import search_graph

    step = compiled_step(c.name, c.model)
    if step is None:
        return
    t0 = time.perf_counter()
    for beam in (1, 4):
        c.decode(sample, beam, {})
    search_graph.wait(step)
    if time.perf_counter() - t0 > 5:
        print(f"{c.name}: search graphs compiled ahead of time in {time.perf_counter() - t0:.0f} s (cached for the "
              f"next run)", flush=True)


def batches(task, n, bsz):
    """The first n test verses (0: all) in batches of bsz: one at a time in corpus order for bsz 1, else sorted by
    source length as fairseq-generate batches them."""
    ds = task.dataset("test")
    n = min(n or len(ds), len(ds))
    if bsz == 1:
        return [ds.collater([ds[i]]) for i in range(n)]
    order = sorted(range(n), key=lambda i: (int(ds.src_sizes[i]), i))
    return [ds.collater([ds[i] for i in order[j: j + bsz]]) for j in range(0, n, bsz)]


def run_setting(cs, samples, beam, rng, block=10):
    """Decodes ``samples`` with every contender, interleaved in blocks; returns {name: (seconds, {id: tokens})}."""
    res = {c.name: [0.0, {}] for c in cs}
    opts = dict(max_len_a=0, max_len_b=200)
    for start in range(0, len(samples), block):
        order = list(cs)
        rng.shuffle(order)
        for c in order:
            for s in samples[start: start + block]:
                dt, hyps, _ = c.decode(s, beam, opts)
                res[c.name][0] += dt
                for i, h in zip(s["id"].tolist(), hyps):
                    res[c.name][1][i] = h
    return res


def bleu(task, hyps, refs):
    import sacrebleu

    D = task.target_dictionary
    ids = sorted(hyps)
    sys_ = [D.string(hyps[i][:-1] if hyps[i] and hyps[i][-1] == D.eos() else hyps[i], "sentencepiece") for i in ids]
    b = sacrebleu.BLEU()
    score = b.corpus_score(sys_, [[refs[i] for i in ids]])
    return score.score, str(b.get_signature())


def references():
    import gzip

    with gzip.open(os.path.join(CORPUS, "test.en.gz"), "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.makedirs(args.workdir, exist_ok=True)
    data = acts_test_bin(args.workdir)
    import fairseq_ext  # noqa: F401  (registers the models, tasks and the default generator)

    if args.capture:
        return capture_part(args, data)
    cs, task = contenders(args, data)  # the test split loaded
    refs = references()
    settings = [("batch 1", 1, args.sentences)]
    if not args.quick:
        settings.append((f"batch {args.batch}", args.batch, args.batched_sentences))
    rng = random.Random(args.seed)
    table, signature = [], None
    print(f"threads {args.threads}; contenders: {', '.join(c.name for c in cs)}", flush=True)
    for label, bsz, n in settings:
        samples = batches(task, n, bsz)
        n_sent = sum(int(s["nsentences"]) for s in samples)
        for beam in (1, 4):
            t0 = time.time()
            res = run_setting(cs, samples, beam, rng)
            ref = res["fairseq"][1]
            ct2 = res.get("CTranslate2 int8")
            for c in cs:
                secs, hyps = res[c.name]
                score, signature = bleu(task, hyps, refs)
                same = sum(hyps[i] == ref[i] for i in ref)
                row = dict(setting=label, search="greedy" if beam == 1 else f"beam {beam}", contender=c.name,
                           ms_per_sentence=1e3 * secs / n_sent, sentences_per_s=n_sent / secs, bleu=score,
                           identical_to_fairseq=same / len(ref), sentences=n_sent,
                           x_ct2_int8=(secs / ct2[0]) if ct2 else None)
                table.append(row)
            print_setting(table[-len(cs):], f"{label}, {'greedy' if beam == 1 else f'beam {beam}'}: {n_sent} "
                          f"verses ({time.time() - t0:.0f} s)")
    print(f"sacreBLEU: {signature}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "signature": signature, "table": table}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _per_call(step, model, rows, calls=40):
    """us per static call of ``step`` at ``rows`` rows (a 30-token source, positions 5..calls+5)."""
    import torch

    from fairseq_ext.inference import static_step as ss

    src = torch.randint(4, 100, (1, 30))
    src[:, -1] = 2
    with torch.inference_mode():
        state = ss.StaticState(model.decoder, model.encoder(src, torch.full((1,), 30)), 1)
        if rows > 1:
            state.reorder(torch.zeros(rows, dtype=torch.long))
        tok = torch.full((rows, 1), 5)
        for i in range(5):
            ss.static_call(step, state, tok, i)
        t0 = time.perf_counter()
        for i in range(5, 5 + calls):
            ss.static_call(step, state, tok, i)
    return 1e6 * (time.perf_counter() - t0) / calls


def capture_part(args, data):
    """--capture: the ways to run the step and the weight layouts (fairseq_ext/inference/static_step.py)."""
    import torch

    from fairseq_ext.inference import aot_step
    from fairseq_ext.inference import static_step as ss

    model, _ = load(os.path.join(args.release, "transformer.pt"), data)
    module = ss.StepGraph(model.decoder).eval()
    output = ss.OutputProjection(model.decoder.output_projection)
    ways = {"eager": (ss.Step(module, output), 0.0)}
    t0 = time.perf_counter()
    ways["torch.jit.trace"] = (ss.Step(ss.capture(module, model.decoder), output), time.perf_counter() - t0)
    example = ss.example_inputs(module, model.decoder, N=6, B=3, S=7, T=96)
    # the last is the package's: explicit attention with its products as sums, inductor's GEMM template where it
    # times faster
    for name, explicit, sums, gemm in (("AOTI fused attn", False, False, True),
                                       ("AOTI ATen products", True, True, False),
                                       ("AOTI batched attn", True, False, True), ("AOTInductor", True, True, True)):
        t0 = time.perf_counter()
        compiled = aot_step.start(ss.aot_module(module, explicit, sums), example, gemm_template=gemm)
        if isinstance(compiled, aot_step.Pending):
            compiled = compiled.wait()
        if compiled is None:
            print(f"{name} left out: FAIRSEQ_EXT_STEP_CAPTURE is not aot, or the compile failed (its log in "
                  f"{aot_step.cache_dir()})")
            continue
        ways[name] = (ss.Step(compiled, output), time.perf_counter() - t0)
    try:
        if args.no_compile:
            raise RuntimeError("--no-compile")
        t0 = time.perf_counter()
        compiled = ss.Step(torch.compile(module, dynamic=True, fullgraph=True), output)
        _per_call(compiled, model, 1, calls=1)
        _per_call(compiled, model, 4, calls=1)
        ways["torch.compile"] = (compiled, time.perf_counter() - t0)
    except Exception as e:  # no C++ compiler, or inductor cannot compile it
        print(f"torch.compile left out: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    print(f"{'capture':18s} {'setup s':>8s} {'us/call 1 row':>14s} {'4 rows':>8s} {'16 rows':>8s} {'64 rows':>8s}")
    for rep in range(3):
        for name, (graph, setup) in ways.items():
            print(f"{name:18s} {setup:8.2f} {_per_call(graph, model, 1):14.1f} {_per_call(graph, model, 4):8.1f} "
                  f"{_per_call(graph, model, 16):8.1f} {_per_call(graph, model, 64):8.1f}", flush=True)
    print(f"\n{'weight [out, in]':18s} {'rows':>4s} {'F.linear us':>11s} {'[in, out] us':>12s} {'oneDNN us':>9s}")
    dec = model.decoder
    layer = dec.layers[0]
    for name, w in (("q/k/v", torch.cat([layer.self_attn.q_proj.weight] * 3)), ("fc1", layer.fc1.weight),
                    ("fc2", layer.fc2.weight), ("output", dec.output_projection.weight)):
        w = w.detach().contiguous()
        wt, b = w.t().contiguous(), torch.zeros(w.size(0))
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        for rows in (1, 4, 16, 64):
            x = torch.randn(rows, w.size(1))
            plain = _time(lambda: torch.nn.functional.linear(x, w, b))
            trans = _time(lambda: torch.addmm(b, x, wt))
            onednn = _time(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""))
            print(f"{name + ' ' + 'x'.join(map(str, w.shape)):18s} {rows:4d} {plain:11.1f} {trans:12.1f} "
                  f"{onednn:9.1f}")
    return 0


def _time(fn, n=2000):
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n // 3):
            fn()
        best = min(best, (time.perf_counter() - t0) / (n // 3))
    return 1e6 * best


def print_setting(rows, title):
    print(f"\n{title}")
    print(f"{'contender':20s} {'ms/sent':>8s} {'sent/s':>7s} {'x CT2 int8':>10s} {'BLEU':>6s} {'= fairseq':>9s}")
    for r in rows:
        x = f"{r['x_ct2_int8']:.2f}" if r["x_ct2_int8"] is not None else "-"
        print(f"{r['contender']:20s} {r['ms_per_sentence']:8.2f} {r['sentences_per_s']:7.1f} {x:>10s} "
              f"{r['bleu']:6.2f} {100 * r['identical_to_fairseq']:8.1f}%", flush=True)


if __name__ == "__main__":
    sys.exit(main())
