"""ConvS2S (Gehring et al., ICML 2017) against what its paper beat, for python -m benchmarks.claims --paper convs2s.

Claim: a fully convolutional encoder-decoder with GLUs and multi-step attention beats strong recurrent
(LSTM) models in accuracy (WMT'16 En-Ro, WMT'14 En-De / En-Fr) while training and translating faster; attention in
every decoder layer (multi-step attention) is better than attention in the last layer only (Table 5: removing
attention from all but the top layer costs BLEU).

Here: ``fconv_glu`` (4 + 3 GLU convolutions of width ``--dim``, kernel 3: the quickstart's) against fairseq's ``lstm``
with attention of similar size (a bidirectional LSTM encoder and an LSTM decoder of hidden size 2 * ``--dim``, shared
embeddings), and ``fconv_glu`` with attention in its last decoder layer only. Tuned alike: each model's learning
rate from the same number of pilots of the same length at the same batch size (1,024 tokens), on valid greedy BLEU
(NAG for ConvS2S as in the paper, adam for the LSTM), and both annealed by the paper's rule (the learning rate / 10
at the end of each epoch once valid loss stops improving), so that a fixed budget reaches each one's plateau. Then
each trains the same fixed number of updates of the same
batches (no early stopping), two at a time, one thread each, so their wall clocks compare, and is evaluated on its
best checkpoint by valid loss (both train on the real targets); interval checkpoints give the equal-minutes
comparison. Translation speed, the paper's headline (Table 3), is timed for both on one CPU thread at batch 1 and
64, greedy and beam 4.
"""

import os

from . import report as R
from .common import (adam_args, curve_cell, eval_job, fixed_budget_args, flattened, lr_pilots, still_falling,
                     train_job, trained, update_walls)
from .jobs import ClaimsError, Job
from .report import pyplot, save_figure

PAPER = {"en_ro": {"convs2s": 30.02, "gru_bpe_sennrich": 28.1},  # Table 1: WMT'16 En-Ro, ConvS2S vs Sennrich's GRU
         "en_de": {"convs2s": 25.16, "gnmt_lstm": 24.61},  # Table 1: WMT'14 En-De, ConvS2S vs GNMT (word-piece LSTM)
         "attention_last_layer_only_delta": -0.3}  # Table 5 on WMT'16 En-Ro: attention only in the top decoder layer
LRS = {"fconv": (0.25, 0.5, 1.0), "lstm": (0.0015, 0.003, 0.006)}  # the same number of pilots for each, x2 apart
EXTEND = 2  # pilots beyond an edge of an arm's grid while its best is there (:meth:`ConvS2S.pilots`)
DIVERGED = ("FloatingPointError", "gradients are Nan/Inf", "Minimum loss scale")  # a pilot's lr too high
ANNEAL_GAIN = 0.01  # an epoch "stops improving" valid loss when it is not 1% below the best (the flatness bar)
ANNEAL = ["--lr-scheduler", "reduce_lr_on_plateau", "--lr-shrink", "0.1", "--lr-patience", "0",
          "--lr-threshold", str(ANNEAL_GAIN)]  # Section 5.1: lr / 10 each epoch once valid stops improving
SPEED_TARGET = 5.0  # ConvS2S over the LSTM, CPU: the geometric mean over batch 1 / 64 and greedy / beam 4


def options(p):
    g = p.add_argument_group("convs2s")
    g.add_argument("--convs2s-updates", type=int, default=17500, help="updates of every model (default 17500)")
    g.add_argument("--convs2s-pilot-updates", type=int, default=800, help="updates of each pilot (default 800)")


def smoke(a):
    a.convs2s_updates, a.convs2s_pilot_updates = 30, 10


class ConvS2S:
    def __init__(self, ctx):
        self.ctx, self.S, self.a, self.corpus = ctx, ctx.S, ctx.args, ctx.corpus

    def common(self, updates):
        interval = 10 if self.a.smoke else 250
        budget = fixed_budget_args(updates, interval=interval, keep=1000)
        budget[budget.index("--validate-interval") + 1] = "1"  # valid loss at every epoch's end, for ANNEAL
        return ["--task", "translation", "--source-lang", "de", "--target-lang", "en", "--max-tokens", "1024",
                *budget]

    def model(self, kind, lr, attention="True"):
        return self.fconv(lr, attention) if kind == "fconv" else self.lstm(lr)

    def fconv(self, lr=0.25, attention="True"):
        d = self.a.dim
        return ["--arch", "fconv_glu", "--encoder-embed-dim", str(d), "--encoder-layers", f"[({d}, 3)] * 4",
                "--decoder-embed-dim", str(d), "--decoder-layers", f"[({d}, 3)] * 3", "--decoder-out-embed-dim",
                str(d), "--decoder-attention", attention, "--share-input-output-embed", "--dropout", "0.0",
                "--optimizer", "nag", "--lr", str(lr), "--clip-norm", "0.1", *ANNEAL,
                "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]

    def lstm(self, lr):
        d = self.a.dim
        argv = ["--arch", "lstm", "--encoder-embed-dim", str(d), "--encoder-hidden-size", str(2 * d),
                "--encoder-layers", "1", "--encoder-bidirectional", "--decoder-embed-dim", str(d),
                "--decoder-hidden-size", str(2 * d), "--decoder-layers", "1", "--decoder-out-embed-dim", str(d),
                "--decoder-attention", "1", *adam_args(lr, warmup=200, attention_dropout=False)]
        at = argv.index("--lr-scheduler")
        return argv[:at] + ANNEAL + argv[at + 2:]  # warmup, then the paper's schedule, as fconv's

    def pilot(self, kind, lr):
        """A pilot and its valid greedy BLEU; a pilot whose training ends on non-finite values (too high a
        learning rate) scores 0 instead of stopping the run (any other failure stops it)."""
        S, name = self.S, f"convs2s-{kind}-pilot-lr{lr}"
        if name in S.jobs:
            return name
        job = train_job(name, S, self.corpus.bin, self.model(kind, lr) + self.common(self.a.convs2s_pilot_updates),
                        ["data"], {}, what=f"{kind} pilot, lr {lr}")
        train = job.run

        def run(job, S):
            try:
                return train(job, S)
            except ClaimsError:
                with open(S.log(name, "train.log"), encoding="utf-8", errors="replace") as f:
                    if not any(w in f.read() for w in DIVERGED):
                        raise
                return {"diverged": True, "summary": "diverged: non-finite loss or gradients"}

        job.run = run
        S.add(job)
        ev = eval_job(f"{name}-eval", S, lambda S: S.result(name)["checkpoint"], self.corpus, [("valid", 1)], [name])
        evaluate = ev.run
        ev.run = lambda job, S: ({"bleu_valid_greedy": 0.0, "summary": "diverged: 0"}
                                 if S.result(name).get("diverged") else evaluate(job, S))
        S.add(ev)
        return name

    def pilots(self):
        """Each arm's learning rate on valid greedy BLEU from its grid (:data:`LRS`) by :func:`common.lr_pilots`'s
        rule (at most :data:`EXTEND` pilots past an edge)."""
        chosen, by = lr_pilots(self.S, {k: list(v) for k, v in LRS.items()}, EXTEND,
                               lambda kind, lr: self.pilot(kind, lr) + "-eval")
        scored = {f"convs2s-{kind}-pilot-lr{lr}": b for (kind, lr), b in by.items()}
        self.ctx.say("convs2s: pilots on valid (greedy BLEU): " + ", ".join(f"{n[8:]} {b:.2f}" for n, b in
                                                                          scored.items())
                     + " -> " + ", ".join(f"{k} lr {lr}" for k, lr in chosen.items()))
        return chosen, scored

    def run(self):
        S, a = self.S, self.a
        chosen, scored = self.pilots()
        runs = {"convs2s-fconv": self.fconv(chosen["fconv"]), "convs2s-lstm": self.lstm(chosen["lstm"]),
                "convs2s-fconv-lastattn": self.fconv(chosen["fconv"], "[False, False, True]")}
        for name, argv in runs.items():
            S.add(train_job(name, S, self.corpus.bin, argv + self.common(a.convs2s_updates), ["data"], {},
                            what=name[8:]))
            S.add(eval_job(f"{name}-eval", S, lambda S, n=name: os.path.join(S.W, "checkpoints", n,
                                                                             "checkpoint_best.pt"),
                           self.corpus, [("valid", 4), ("test", 1), ("test", 4)], [name]))

        def speed(job, S):
            models = [{"label": n[8:], "ckpt": os.path.join(S.W, "checkpoints", n, "checkpoint_best.pt"),
                       "task": "translation"} for n in ("convs2s-fconv", "convs2s-lstm")]
            return S.worker("speed", {"models": models, "bin_dir": self.corpus.bin, "src": "de", "tgt": "en",
                                      "sentences": 16 if a.smoke else 256, "repeat": 1 if a.smoke else 3,
                                      "batches": [1, 64]}, S.log("convs2s-speed"), threads=1)

        S.add(Job("convs2s-speed", speed, {"sentences": 256, "repeat": 3, "batches": [1, 64]},
                  ["convs2s-fconv", "convs2s-lstm", "data"], exclusive=True,
                  what="translation speed, one thread, batch 1 and 64 (runs alone)"))

        def equal_minutes(job, S):
            """The checkpoint of each model at the minutes the faster of fconv / lstm needed for all its updates."""
            times = {name: update_walls(S.log(name, "train.log")) for name in ("convs2s-fconv", "convs2s-lstm")}
            budget = min(t[-1][1] for t in times.values())
            out = {"minutes": round(budget / 60, 1)}
            interval = 10 if self.a.smoke else 250
            for name, t in times.items():
                reached = max(u for u, w in t if w <= budget + 1)
                ckpt_update = reached // interval * interval
                ckpt = next((os.path.join(S.W, "checkpoints", name, f) for f in os.listdir(os.path.join(
                    S.W, "checkpoints", name)) if f.endswith(f"_{ckpt_update}.pt")), None)
                res = {"updates_at_budget": reached, "checkpoint_update": ckpt_update}
                if ckpt:
                    res.update(S.worker("evaluate", {"ckpt": ckpt, "bin_dir": self.corpus.bin, "src": "de",
                                                     "tgt": "en", "refs": self.corpus.refs(), "decodes": [["test", 4]],
                                                     "out_dir": S.dir("hyps", f"{name}-equal-minutes")},
                                        S.log(f"{name}-equal-minutes")))
                out[name] = res
            return out

        S.add(Job("convs2s-equal-minutes", equal_minutes, {}, ["convs2s-fconv", "convs2s-lstm", "data"],
                  what="each model at the minutes the faster needed"))
        S.run_all([f"{n}-eval" for n in runs] + ["convs2s-equal-minutes", "convs2s-speed"])
        return {"lr": chosen, "pilots": scored}


def verdict(fconv, lstm, last, minutes, speedup=None):
    """(verdict, reason) from test BLEU (beam 4): the targets ConvS2S >= the tuned LSTM at equal updates and, where
    measured, >= 5x its CPU translation speed (``speedup``); equal minutes and multi-step attention (against
    attention in the last layer only) are reported beside them."""
    parts = {"equal updates": fconv - lstm, "equal minutes": minutes[0] - minutes[1] if minutes else None,
             "multi-step attention": fconv - last}
    said = "; ".join(f"{k}: {v:+.2f} BLEU" for k, v in parts.items() if v is not None)
    met = {"ConvS2S >= LSTM at equal updates": fconv >= lstm}
    if speedup is not None:
        met["ConvS2S >= 5x the LSTM's CPU translation speed"] = speedup >= 5.0
        said += f"; CPU translation speed {speedup:.2f}x the LSTM's"
    v = R.verdict_of(met)
    held = [t for t, ok in met.items() if ok]
    missed = [t for t, ok in met.items() if not ok]
    return v, ((f"Holds: {'; '.join(held)}. " if held else "") + (f"Missed: {'; '.join(missed)}. " if missed else "")
               + f"({said}).")


def plot(S, labels, png):
    """Valid loss against updates (equal updates) and against training minutes (equal minutes), one line per
    model, from the training logs."""
    fig, (by_update, by_minute) = pyplot().subplots(1, 2, figsize=(9.6, 3.8), sharey=True)
    for (name, label), style in zip(labels.items(), ("o-", "s-", "^--")):
        curve = trained(S, name)["valid_curve"]
        walls = update_walls(S.log(name, "train.log"))
        minutes = [next((w for u2, w in walls if u2 >= u), walls[-1][1]) / 60 for u, _ in curve]
        by_update.plot([u for u, _ in curve], [loss for _, loss in curve], style, label=label, markersize=4)
        by_minute.plot(minutes, [loss for _, loss in curve], style, label=label, markersize=4)
    by_update.set_xlabel("updates")
    by_minute.set_xlabel("training minutes (2 cores, side by side)")
    by_update.set_ylabel("valid loss (label-smoothed)")
    for ax in (by_update, by_minute):
        ax.grid(alpha=0.3)
    by_update.legend(fontsize=7)
    fig.suptitle("ConvS2S vs an LSTM with attention, Bible De->En")
    save_figure(fig, png)


def speedup(ms):
    """ConvS2S over the LSTM: per (batch, beam) the LSTM's ms per sentence over ConvS2S's, and their geometric
    mean (the figure the target reads, fixed before any run)."""
    import math

    by = {}
    for m in ms:
        by.setdefault((m["batch"], m["beam"]), {})[m["label"]] = m["ms"]
    ratios = {k: v["lstm"] / v["fconv"] for k, v in sorted(by.items()) if "lstm" in v and "fconv" in v}
    gmean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios)) if ratios else None
    return by, ratios, gmean


def report(ctx, outcome):
    """docs/CLAIMS.md's ConvS2S section and claims.json's ``convs2s``."""
    S, a = ctx.S, ctx.args
    lr = outcome["lr"]
    labels = {"convs2s-fconv": f"fconv_glu (attention in every decoder layer, lr {lr['fconv']})",
              "convs2s-lstm": f"lstm with attention (lr {lr['lstm']})",
              "convs2s-fconv-lastattn": "fconv_glu, attention in the last decoder layer only"}
    rows, rec = [], {}
    for n, label in labels.items():
        tr, ev = trained(S, n), S.result(f"{n}-eval")
        rows.append([label, f"{ev.get('params', 0) / 1e6:.2f}", R.fmt(ev["bleu_valid_beam4"]),
                     R.fmt(ev["bleu_test_greedy"]), R.fmt(ev["bleu_test_beam4"]), tr["updates"],
                     f"{tr['train_tokens_per_s']:.0f}", f"{tr.get('train_minutes') or tr['minutes']:.1f}",
                     curve_cell(tr)])
        rec[n[8:]] = {"params": ev.get("params"), "valid_beam4": ev["bleu_valid_beam4"],
                      "test_beam4": ev["bleu_test_beam4"], "test_greedy": ev["bleu_test_greedy"],
                      "updates": tr["updates"], "train_tokens_per_s": tr["train_tokens_per_s"],
                      "minutes": round(tr.get("train_minutes") or tr["minutes"], 1), "seed": tr.get("seed"),
                      "valid_loss_gain_last_20pct": flattened(tr.get("valid_curve", []))[0]}
    eq = S.result("convs2s-equal-minutes")
    erows, eq_bleu = [], None
    if all("bleu_test_beam4" in eq.get(n, {}) for n in ("convs2s-fconv", "convs2s-lstm")):
        eq_bleu = (eq["convs2s-fconv"]["bleu_test_beam4"], eq["convs2s-lstm"]["bleu_test_beam4"])
        for n in ("convs2s-fconv", "convs2s-lstm"):
            erows.append([labels[n], eq[n]["updates_at_budget"], eq[n]["checkpoint_update"],
                          R.fmt(eq[n]["bleu_test_beam4"])])
    by, ratios, gmean = speedup(S.result("convs2s-speed")["ms"])
    srows = [[f"{batch}", "greedy" if beam == 1 else f"beam {beam}", R.fmt(v.get("fconv")), R.fmt(v.get("lstm")),
              f"{ratios[(batch, beam)]:.2f}x" if (batch, beam) in ratios else "-"] for (batch, beam), v in by.items()]
    ev = {n: S.result(f"{n}-eval")["bleu_test_beam4"] for n in labels}
    v, reason = verdict(ev["convs2s-fconv"], ev["convs2s-lstm"], ev["convs2s-fconv-lastattn"], eq_bleu, gmean)
    unflat = still_falling([(labels[n], trained(S, n)) for n in labels], sep="; ")
    if unflat:
        reason += " " + unflat
    v, reason = R.past_early_regime(v, reason, unflat, "--convs2s-updates")
    prov, prov_line = R.provenance([S.result(n) for n in S.results if n.startswith("convs2s-")], "convs2s")
    prow = [[n[8:].replace("-pilot-lr", ", lr "), R.fmt(b)] for n, b in sorted(outcome["pilots"].items())]
    npilots = {k: sum(n.startswith(f"convs2s-{k}-") for n in outcome["pilots"]) for k in LRS}
    md = f"""## ConvS2S: convolutional sequence to sequence (Gehring et al., ICML 2017)

**Claim** (Table 1): a fully convolutional model with gated linear units and multi-step attention beats strong
recurrent models (WMT'16 En-Ro {PAPER['en_ro']['convs2s']} vs {PAPER['en_ro']['gru_bpe_sennrich']}; WMT'14 En-De
{PAPER['en_de']['convs2s']} vs GNMT's LSTM {PAPER['en_de']['gnmt_lstm']}) while translating an order of magnitude
faster (Table 3, GPU and CPU); attention in every decoder layer beats attention in the last layer only (Table 5).
Targets here: ConvS2S >= the tuned LSTM at equal updates, and >= {SPEED_TARGET:g}x its CPU translation speed
(geometric mean over batch 1 and 64, greedy and beam 4).

**Verdict: {v}.** {reason}

```bash
{R.command(a, "convs2s")}
```

**Setup.** `fconv_glu` of width {a.dim} (4 encoder and 3 decoder convolutions of kernel 3, shared input/output
embedding, NAG, clip 0.1) against fairseq's `lstm` (a bidirectional 1-layer encoder and a 1-layer decoder of hidden
size {2 * a.dim}, attention, shared embeddings, adam, 200 warmup updates), and `fconv_glu` with `--decoder-attention
"[False, False, True]"`. Each model's learning rate chosen on valid greedy BLEU by pilots of
{a.convs2s_pilot_updates} updates (1,024 tokens a batch) under one rule: a grid x2 apart (fconv
{', '.join(map(str, LRS['fconv']))}; the LSTM {', '.join(map(str, LRS['lstm']))}), then, while an arm's best pilot
is at an edge of what it tried, one more pilot x2 beyond that edge (at most {EXTEND}): {npilots['fconv']} pilots
for fconv, {npilots['lstm']} for the LSTM (table below). Both anneal by the paper's rule
(Section 5.1): the learning rate shrinks 10x at the end of every epoch whose valid loss is not {ANNEAL_GAIN:.0%} below
the best so far (`--lr-scheduler reduce_lr_on_plateau`). Then label smoothing 0.1, 1,024 tokens a batch,
{a.convs2s_updates} updates each (no early stopping), fconv and the LSTM side by side (one thread each, so their
minutes compare), each evaluated on its best checkpoint by valid loss. {prov_line}

### Equal updates

{R.table(["model", "params (M)", "valid BLEU (beam 4)", "test BLEU (greedy)", "test BLEU (beam 4)", "updates",
          "train tokens/s", "minutes", "valid loss gain, last 20%"], rows)}

### Translation speed (one CPU thread, ms per sentence over the first test sentences; fastest of 3 passes)

{R.table(["batch", "search", "fconv_glu ms", "lstm ms", "fconv_glu speed-up"], srows)}

### Equal minutes ({eq.get('minutes', '-')} min: what the faster of the two needed for all its updates)

{R.table(["model", "updates in that time", "checkpoint used", "test BLEU (beam 4)"], erows) if erows else "-"}

![valid loss against updates and against minutes](claims_convs2s_valid_loss.png)

Pilots (valid greedy BLEU by model and learning rate):

{R.table(["model, lr", "valid greedy"], prow)}

Signatures: {R.signatures([S.result(f"{n}-eval") for n in labels])}.
"""
    record = {"verdict": v, "reason": reason, "models": rec, "equal_minutes": eq, "paper": PAPER,
              "speed_ms": {f"{k[0]}x{k[1]}": val for k, val in by.items()},
              "speedup_over_lstm": {f"batch {k[0]} beam {k[1]}": round(r, 3) for k, r in ratios.items()},
              "speedup_geomean": gmean, "lr": lr, "pilots_valid_greedy": outcome["pilots"],
              "command": R.command(a, "convs2s"), **prov}
    png = os.path.join(S.W, "convs2s_valid_loss.png")
    plot(S, labels, png)
    return R.write(a.docs_dir, "convs2s", md, record, [png])
