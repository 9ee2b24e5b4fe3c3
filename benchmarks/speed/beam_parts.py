"""Where a batch-1 search's time goes, part by part (docs/sat_transformer.md, "Measured"): our K=1 and the SAT
models of ``python -m benchmarks.speed.sat --random-init`` (the quickstart's sizes, random weights) decode random
sources with exactly --length words + EOS, and each part of ``generate`` is timed where it runs:

* the encoder and the search's buffers (``_start``), per sentence;
* the decoder call (layers, softmax projection, log-softmax: ``decode_group``);
* fairseq's rules (``_constrain``), the group step (``_enumerated_group`` / ``_pruned_group``; K = 1 takes
  fairseq's beam step inside ``_beam_search``, counted in the rest) and the reorder (``_reorder``);
* the rest of the search (the top B, EOS; bookkeeping): the sentence's time less the parts above.

The generator takes its default, the static decoder step (``--no-lean-step``: the decoder's own step), with
fairseq's rules run op by op, as it runs them above 16 rows a step (at batch 1 it runs them as one scripted call
with the choice of words, which cannot be timed apart: ``fairseq_ext/sat/step_rules.py``). Then the
reorder alone, on the K=1 model's state after a search through the decoder's own step: fairseq's
``reorder_incremental_state_scripting`` (its walk over every submodule) against the generator's ``_reorder``.
``--profile K`` also prints, from ``torch.profiler`` over one more pass, the operators whose self time per
decoder call grows most from K=1 to K.

    python -m benchmarks.speed.beam_parts [--speedups int8-decoder,int8-encoder,lean-decoder] [--beam 4]
                                          [--length 27] [--sentences 20] [--repeat 4] [--threads 1] [--tiny]
                                          [--profile {2,4,6}] [--no-lean-step]

Each part is the fastest of --repeat passes over the sentences (models in turn within a pass); microseconds
per decoder call, milliseconds per sentence, ratios over K=1 measured in the same run.
"""

import argparse
import collections
import logging
import tempfile
import time
import warnings


from .beam_rows import best_us
from .sat_contenders import build_random_models, random_sources

PARTS = [("decode", "decoder call (layers, softmax projection, log-softmax)"),
         ("constrain", "fairseq's rules (pad, --min-len, --max-len, ...)"), ("step", "group step"),
         ("reorder", "reorder"), ("rest", "the rest of the search (top B, EOS, bookkeeping)")]


def timed(acc, key, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0
    return wrapper


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.beam_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("--speedups", default="", help="fairseq_ext.inference speed-ups applied to every model "
                                                  "(apply_speedups names, comma-separated; default none)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--length", type=int, default=27, help="words per output (+ EOS; default 27)")
    p.add_argument("--sentences", type=int, default=20)
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="tiny models (a smoke test)")
    p.add_argument("--profile", type=int, choices=[2, 4, 6], help="operator self times, K=1 against this K")
    p.add_argument("--no-lean-step", action="store_true",
                   help="the decoder's own step instead of the generator's default lean step (--no-lean-step)")
    a = p.parse_args(argv)
    if min(a.beam, a.length, a.sentences, a.repeat, a.threads) < 1:
        p.error("--beam, --length, --sentences, --repeat and --threads must be positive")
    return a


def timed_generators(a, models, task, samples, names):
    """A generator per model whose parts add their time to the model's accumulator: (gens, accs)."""
    from fairseq_ext.inference.speedups import apply_speedups
    from fairseq_ext.sat.generator import SATSequenceGenerator

    gens, accs = {}, {}
    for name in names:
        m = apply_speedups(models[name], a.speedups) if a.speedups else models[name].eval()
        g = SATSequenceGenerator([m], task.target_dictionary, beam_size=a.beam, max_len_a=0,
                                 max_len_b=a.length, min_len=a.length, lean_step=not a.no_lean_step)
        # the rules op by op, so that they can be timed apart (scripted, they are one call with the choice)
        g._scripted_rules = lambda device: None
        acc = accs[name] = collections.defaultdict(float)
        g.model.decode_group = timed(acc, "decode", g.model.decode_group)
        # TODO(public): times the generator's private steps in place (_start, _reorder, _constrain, the group steps)
        for method, key in (("_start", "encoder"), ("_reorder", "reorder"), ("_constrain", "constrain"),
                            ("_enumerated_group", "step"), ("_pruned_group", "step")):
            setattr(g, method, timed(acc, key, getattr(g, method)))
        gens[name] = (g, m)
        g.generate([m], samples[0])  # warm-up
    return gens, accs


def time_parts(a, gens, accs, samples, names):
    """Each part's fastest of --repeat passes (seconds over all sentences) and the decoder calls per sentence."""
    import torch

    best = {name: collections.defaultdict(lambda: float("inf")) for name in names}
    calls = {}
    with torch.inference_mode():
        for _ in range(a.repeat):
            for name in names:
                g, m = gens[name]
                acc = accs[name]
                acc.clear()
                n_calls = 0
                t0 = time.perf_counter()
                for s in samples:
                    g.generate([m], s)
                    n_calls += g.decoder_calls
                total = time.perf_counter() - t0
                calls[name] = n_calls / len(samples)
                b = best[name]
                b["total"] = min(b["total"], total)
                b["rest"] = min(b["rest"], total - sum(acc.values()))
                for key, v in acc.items():
                    b[key] = min(b[key], v)
    return best, calls


def print_parts(a, best, calls, n, names, step):
    print(f"batch 1, beam {a.beam}, {a.length} words + EOS, {n} sentences, {a.threads} thread(s), "
          f"speed-ups: {a.speedups or 'none'}, {step}; fastest of {a.repeat} passes per part")
    print(f"{'us per decoder call':<58}" + "".join(f"{nm:>10}" for nm in names))
    for key, label in PARTS:  # "-": a part that did not run
        print(f"{label:<58}" + "".join(f"{best[nm][key] / n / calls[nm] * 1e6:>10.0f}"
                                        if best[nm][key] < float("inf") else f"{'-':>10}" for nm in names))
    print(f"{'encoder and the search buffers (_start), ms per sentence':<58}"
          + "".join(f"{best[nm]['encoder'] / n * 1e3:>10.2f}" for nm in names))
    print(f"{'decoder calls per sentence':<58}" + "".join(f"{calls[nm]:>10.1f}" for nm in names))
    print(f"{'ms per sentence':<58}" + "".join(f"{best[nm]['total'] / n * 1e3:>10.2f}" for nm in names))
    print(f"{'speed-up over K=1':<58}" + "".join(f"{best['K=1']['total'] / best[nm]['total']:>9.2f}x"
                                                 for nm in names))


def reorder_walk(a, gens, task, sample):
    """The reorder alone, on the K=1 model's state after a search through the decoder's own step (fairseq's walk
    does not reorder the lean step's state): fairseq's walk over every submodule against the generator's."""
    import torch
    from fairseq.models import FairseqIncrementalDecoder

    from fairseq_ext.sat.generator import SATSequenceGenerator

    g, m = gens["K=1"]
    if g.model.step_name != "own":
        g = SATSequenceGenerator([m], task.target_dictionary, beam_size=a.beam, max_len_a=0,
                                 max_len_b=a.length, min_len=a.length, lean_step=False)
    captured = {}
    reorder = g._reorder

    def capture(state, encoder_outs, rows, same_sources=False):
        captured.update(state=state, encoder_outs=encoder_outs, rows=rows)
        return reorder(state, encoder_outs, rows, same_sources)

    g._reorder = capture
    with torch.inference_mode():
        g.generate([m], sample)
        g._reorder = reorder
        if captured:
            state, enc = captured["state"], captured["encoder_outs"]
            same = torch.arange(captured["rows"].numel())
            decoder = m.decoder
            t_walk = best_us(lambda: FairseqIncrementalDecoder.reorder_incremental_state_scripting(
                decoder, state, same), 300)
            t_ours = best_us(lambda: g._reorder(state, enc, same), 300)
            print(f"reorder of the K=1 state of the decoder's own step ({same.numel()} rows): fairseq's walk "
                  f"over every submodule "
                  f"{t_walk:.1f} us, the generator's _reorder {t_ours:.1f} us ({t_walk / t_ours:.2f}x)")


def main(argv=None):
    a = parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    margs = argparse.Namespace(tiny=a.tiny, source_lang="de", target_lang="en", seed=1, ks=[2, 4, 6],
                               no_deep_shallow=True)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices
        models, _, _, task = build_random_models(margs, tmp)
        samples = random_sources(margs, task.source_dictionary, a.sentences)
        names = ["K=1", "K=2", "K=4", "K=6"]
        gens, accs = timed_generators(a, models, task, samples, names)
        best, calls = time_parts(a, gens, accs, samples, names)
        step = {"static": "the static step", "lean": "the lean step",
                "own": "the decoder's own step"}[gens["K=1"][0].model.step_name]
        print_parts(a, best, calls, len(samples), names, step)
        reorder_walk(a, gens, task, samples[0])
        if a.profile:
            profile_ops(gens, samples, f"K={a.profile}")


def profile_ops(gens, samples, name, rows=12):
    """Self CPU time per decoder call of each operator (torch.profiler, one pass), K=1 against ``name``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    per_call = {}
    for nm in ("K=1", name):
        g, m = gens[nm]
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            n_calls = 0
            for s in samples:
                g.generate([m], s)
                n_calls += g.decoder_calls
        per_call[nm] = {e.key: e.self_cpu_time_total / n_calls for e in prof.key_averages()}
    a, b = per_call["K=1"], per_call[name]
    keys = sorted(set(a) | set(b), key=lambda k: -(b.get(k, 0.0) - a.get(k, 0.0)))
    print(f"operator self time per decoder call (torch.profiler, us): K=1 against {name}; total "
          f"{sum(a.values()):.0f} against {sum(b.values()):.0f}")
    for k in keys[:rows]:
        print(f"  {k[:52]:<52} {a.get(k, 0.0):>8.1f} {b.get(k, 0.0):>8.1f} {b.get(k, 0.0) - a.get(k, 0.0):>+8.1f}")


if __name__ == "__main__":
    main()
