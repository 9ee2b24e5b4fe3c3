"""MSC (Wei et al., ACL 2020) depth with its controls, for python -m benchmarks.claims --paper msc.

Claim: a plain deep Transformer degrades as its encoder grows (Figure 2: lower BLEU on its own training data, so
not over-fitting), while MSC's block-scale and contextual collaboration train deep encoders that gain 2-3 BLEU over
the 6-layer model (Table 1: IWSLT'14 De-En 6 -> 36 / 54 / 72 layers).

Here: encoders of 6 and 12 layers (``--msc-depths``, 24 where it fits; 3 decoder layers, so 3 MSC blocks), width
``--dim`` (128), for three encoders at each depth: fairseq's post-norm transformer, its pre-norm transformer (the
paper's baseline: layer norm at each sublayer's input) and MSC. Tuned alike: each encoder's learning rate and
warm-up chosen at each depth by the same pilots on valid greedy BLEU (a rate chosen at 12 layers need not train
at 6: the 12-layer post-norm pilots all stayed below 2 BLEU, and the rate they picked left the 6-layer post-norm
model untrained), then, while a best pilot is at an edge of the rates it tried, one more x2 beyond that edge (at
most :data:`EXTEND`; the same rule as the other papers' pilots). Then the same batch size
(tokens), dropout and fixed number of updates for every model (long enough that the curves flatten: the report
checks it) on the first ``--msc-train-verses`` (8,000) training verses, where such a budget fits (the pilots train
on all of them). Each model is then the one of two checkpoints with the higher valid BLEU (beam 4): the average of
its last 3 interval checkpoints, or its checkpoint of the best valid loss (an over-fitting model's average is past
that point); test BLEU is read for the one valid chose. Figure 2 scores the end of training (the average) on 1,000
training pairs drawn with a fixed seed and on valid (the paper measures 3,000 training pairs of converged models:
``python -m fairseq_ext.msc.degradation --checkpoints`` does that scoring and draws the figure).
"""

import os

from . import report as R
from .common import (SubsetCorpus, adam_args, curve_cell, eval_job, fixed_budget_args, flattened, lr_pilots,
                     size_args, still_falling, train_job, trained)
from .jobs import Job, read_json
from .report import pyplot, save_figure

# Table 2 of the paper (IWSLT'14 De->En, small models, BLEU): the 6-layer Transformer, MSC with 6 / 36 / 54 layers and
# 72 layers with L2 (the 72-layer MSC without L2 did not train)
PAPER = {"plain_6": 32.73, "msc_6": 33.10, "msc_36": 34.86, "msc_54": 35.16, "msc_72_l2": 35.81}
BLOCKS = 3
VARIANTS = ("post", "pre", "msc")
# (peak lr, warm-up updates), every encoder; every warm-up ends by half a pilot (2,000 updates), so that a pilot
# scores its rate and not its ramp (a warm-up of 4,000 left those pilots at a fraction of their peak)
PILOTS = ((0.0005, 1000), (0.001, 1000), (0.0015, 500), (0.003, 500))
EXTEND = 2  # at most this many pilots past an edge of the rates, per encoder


def warmup_of(lr):
    """The warm-up of a pilot at ``lr``: the grid's, and past its edges the one at that edge."""
    return dict(PILOTS).get(lr, PILOTS[0][1] if lr < PILOTS[0][0] else PILOTS[-1][1])


def options(p):
    g = p.add_argument_group("msc")
    # on all 29,080 verses, 8,000 updates left every valid-loss curve falling 1.9-4.8% over its last 20%, and a
    # budget that flattens them would not finish a 12-layer model in one session (about 3 h at 12,000 updates);
    # the first 8,000 verses run 24 epochs in 8,000 updates. A budget raised later goes on from the checkpoints
    # (common.train_job)
    g.add_argument("--msc-updates", type=int, default=8000, help="updates of every model (default 8000)")
    g.add_argument("--msc-train-verses", type=int, default=8000,
                   help="training verses of the models compared, the first N of one shuffled order (the pilots "
                        "train on all of them); 0: all (default 8000)")
    g.add_argument("--msc-depths", default="6,12", help="encoder depths, multiples of 3 (default 6,12)")
    # 800 updates left every 12-layer pilot below 1 valid greedy BLEU (a choice by noise); 2,000 (a quarter of the
    # budget) runs half of each pilot past its warm-up
    g.add_argument("--msc-pilot-updates", type=int, default=2000, help="updates of each pilot (default 2000)")
    g.add_argument("--msc-dropout", type=float, default=0.1, help="dropout of all (default 0.1)")
    g.add_argument("--msc-train-sample", type=int, default=1000, help="training pairs scored (default 1000)")


def smoke(a):
    a.msc_updates, a.msc_depths, a.msc_train_sample, a.msc_pilot_updates = 30, "6,12", 20, 10
    a.msc_train_verses = 200


class MSC:
    def __init__(self, ctx):
        self.ctx, self.S, self.a, self.corpus = ctx, ctx.S, ctx.args, ctx.corpus
        self.depths = [int(d) for d in self.a.msc_depths.split(",")]

    def argv(self, variant, depth, lr, warmup, updates):
        a = self.a
        opt = adam_args(lr, warmup=warmup, dropout=a.msc_dropout)
        interval = 10 if a.smoke else 500
        common = ["--task", "translation", "--source-lang", "de", "--target-lang", "en",
                  *fixed_budget_args(updates, interval=interval, keep=3)]
        if variant == "msc":
            dims = size_args(a.dim, enc_layers=None, dec_layers=BLOCKS)
            return ["--arch", "msc_transformer", "--encoder-blocks", str(BLOCKS), "--encoder-layers-per-block",
                    str(depth // BLOCKS), *dims, *opt, *common]
        norm = ["--encoder-normalize-before", "--decoder-normalize-before"] if variant == "pre" else []
        return ["--arch", "transformer", *size_args(a.dim, enc_layers=depth, dec_layers=BLOCKS), *norm, *opt, *common]

    def pilot(self, arm, lr):
        """A pilot of ``arm`` (variant, depth) at ``lr`` (its warm-up: :func:`warmup_of`); returns its evaluation's
        job name."""
        (variant, depth), S, warmup = arm, self.S, warmup_of(lr)
        name = f"msc-pilot-{variant}{depth}-lr{lr}-w{warmup}"
        if name not in S.jobs:
            S.add(train_job(name, S, self.corpus.bin, self.argv(variant, depth, lr, warmup,
                                                                self.a.msc_pilot_updates),
                            ["data"], {}, what=f"pilot {variant} {depth} layers, lr {lr}, warm-up {warmup}"))
            S.add(eval_job(f"{name}-eval", S, lambda S, n=name: S.result(n)["checkpoint"], self.corpus,
                           [("valid", 1)], [name]))
        return f"{name}-eval"

    def pilots(self):
        """The same (lr, warm-up) grid for every encoder at every depth, past its edges by
        :func:`common.lr_pilots`'s rule; valid greedy BLEU chooses. Returns ({(variant, depth): (lr, warm-up)},
        {pilot: valid greedy BLEU})."""
        arms = {(v, d): [lr for lr, _ in PILOTS] for d in sorted(self.depths, reverse=True) for v in VARIANTS}
        best_lr, by = lr_pilots(self.S, arms, EXTEND, self.pilot)
        chosen = {arm: (lr, warmup_of(lr)) for arm, lr in best_lr.items()}
        scored = {f"msc-pilot-{v}{d}-lr{lr}-w{warmup_of(lr)}": b for ((v, d), lr), b in sorted(by.items())}
        self.ctx.say("msc: pilots on valid (greedy BLEU): " + ", ".join(f"{n[10:]} {b:.2f}" for n, b in
                                                                      scored.items())
                     + " -> " + ", ".join(f"{v}{d} lr {lr} warm-up {w}" for (v, d), (lr, w) in chosen.items()))
        return chosen, scored

    def training_set(self):
        """(job name, binarised data, corpus for eval_job) of the set the compared models train on:
        ``--msc-train-verses`` of the training verses, or all of them."""
        n = self.a.msc_train_verses
        if not n:
            return "data", self.corpus.bin, self.corpus
        name = f"msc-data-{n}"
        if name not in self.S.jobs:
            self.S.add(self.corpus.subset_job(n, name, f"data-{n}"))
        bin_dir = self.corpus.subset_bin(n)
        return name, bin_dir, SubsetCorpus(self.corpus, bin_dir)

    def run(self):
        S = self.S
        chosen, scored = self.pilots()
        data, bin_dir, corpus = self.training_set()
        names = []
        # deepest first, MSC and its baseline before the post-norm control: the longest trainings start first
        for depth in sorted(self.depths, reverse=True):
            for variant in reversed(VARIANTS):
                name = f"msc-{variant}{depth}"
                kind = "MSC" if variant == "msc" else f"{variant}-norm transformer"
                lr, warmup = chosen[(variant, depth)]
                S.add(train_job(name, S, bin_dir, self.argv(variant, depth, lr, warmup, self.a.msc_updates),
                                [data], {}, what=f"{kind}, {depth} encoder layers"))
                S.add(eval_job(f"{name}-eval", S, lambda S, n=name: S.result(n)["checkpoint"], corpus,
                               [("valid", 4), ("test", 4)], [name]))
                S.add(eval_job(f"{name}-best-eval", S, lambda S, n=name: best_loss_checkpoint(S.result(n)), corpus,
                               [("valid", 4), ("test", 4)], [name]))
                names.append(name)

        def train_bleu(job, S):
            """Figure 2's scores of one model (BLEU on training pairs and valid), right after its training: a
            step of its own, so that a run continued in another session (the store) needs no model trained again."""
            n = job.deps[0]
            out = S.dir("degradation", n)
            S.sh([os.sys.executable, "-m", "fairseq_ext.msc.degradation", bin_dir, "--src", "de",
                  "--tgt", "en", "--workdir", out, "--checkpoints", f"{n[4:]}={S.result(n)['checkpoint']}",
                  "--sample", str(self.a.msc_train_sample), "--cpu"], S.log(job.name), job.threads,
                 "msc.degradation")
            row = dict(read_json(os.path.join(out, "degradation.json"))["results"][0])
            row.pop("checkpoint", None)  # a file of this work directory: the row is all later steps read
            return row

        for n in names:
            S.add(Job(f"{n}-train-bleu", train_bleu, {"sample": self.a.msc_train_sample}, [n, data],
                      what=f"Figure 2: BLEU of {n[4:]} on training pairs and valid"))
        S.run_all([f"{n}-{step}" for n in names for step in ("eval", "best-eval", "train-bleu")])
        return {"models": names, "chosen": {f"{v}{d}": {"lr": lr, "warmup": w} for (v, d), (lr, w) in chosen.items()},
                "pilots": scored}


def best_loss_checkpoint(trained_result):
    """fairseq's checkpoint of the best valid loss, beside the average the training result names."""
    return os.path.join(os.path.dirname(trained_result["checkpoint"]), "checkpoint_best.pt")


def selected(S, name, tr):
    """(evaluation, which checkpoint) of the model ``name``: of its last-3 average and its checkpoint of the best
    valid loss, the one with the higher valid BLEU (beam 4; the average on a tie). ``tr``: its training result."""
    avg, best = S.result(f"{name}-eval"), S.result(f"{name}-best-eval")
    if best["bleu_valid_beam4"] > avg["bleu_valid_beam4"]:
        at = min(tr["valid_curve"], key=lambda p: p[1])[0] if tr.get("valid_curve") else None
        return best, f"best valid loss ({at})" if at else "best valid loss"
    return avg, "last 3 averaged"


def learning_curves(S, names, png):
    """Valid loss against updates of every model (the evidence when depth does not pay)."""
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for n in names:
        curve = S.result(n)["valid_curve"]
        if curve:
            ax.plot([u for u, _ in curve], [loss for _, loss in curve], marker=".", label=n[4:])
    ax.set_xlabel("updates")
    ax.set_ylabel("valid loss (label-smoothed, base 2)")
    ax.set_title("Valid loss of every encoder, Bible De->En")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, png)
    return png


def verdict(bleu, depths):
    """(verdict, reason) from test BLEU (beam 4) by (variant, depth), the targets for the deepest MSC: MSC-deep >=
    pre-norm-deep + 1.0 (what the collaboration buys at equal depth) and MSC-deep >= MSC-shallow (depth pays)."""
    lo, hi = min(depths), max(depths)
    msc, pre, post = bleu[("msc", hi)], bleu[("pre", hi)], bleu[("post", hi)]
    gain = {v: bleu[(v, hi)] - bleu[(v, lo)] for v in VARIANTS}
    numbers = (f"test BLEU (beam 4) at {hi} layers: MSC {msc:.2f}, pre-norm {pre:.2f}, post-norm {post:.2f}; "
               f"{lo} -> {hi} layers: " + ", ".join(f"{v} {d:+.2f}" for v, d in gain.items()))
    met = {f"MSC-{hi} >= pre-norm-{hi} + 1.0": msc >= pre + 1.0, f"MSC-{hi} >= MSC-{lo}": msc >= bleu[("msc", lo)]}
    v = R.verdict_of(met)
    held = [t for t, ok in met.items() if ok]
    missed = [t for t, ok in met.items() if not ok]
    said = (f"Holds: {'; '.join(held)}. " if held else "") + (f"Missed: {'; '.join(missed)}. " if missed else "")
    return v, f"{said}({numbers})."


def untrained_controls(valid, depths):
    """The sentence naming the depths where the post-norm control did not train ("" where it did everywhere): its
    valid BLEU (beam 4) below half the pre-norm model's at the same depth. ``valid``: {(variant, depth): BLEU}. The
    targets compare MSC with the pre-norm model (the paper's baseline), so this does not change the verdict; it
    says which comparisons with post-norm mean nothing."""
    failed = [d for d in depths if valid[("post", d)] < 0.5 * valid[("pre", d)]]
    if not failed:
        return ""
    scores = ", ".join(f"{valid[('post', d)]:.2f} against {valid[('pre', d)]:.2f} at {d}" for d in failed)
    return (f"The post-norm control did not train at {' / '.join(map(str, failed))} layers, with its learning rate "
            f"and warm-up chosen by the same pilots (valid BLEU, beam 4, post-norm against pre-norm: {scores}); "
            f"the verdict rests on the pre-norm baseline.")


def report(ctx, outcome):
    """docs/CLAIMS.md's MSC section and claims.json's ``msc``."""
    S, a = ctx.S, ctx.args

    def depth_variant(n):
        variant = n[4:].rstrip("0123456789")
        return int(n[4 + len(variant):]), variant

    def table_order(n):
        depth, variant = depth_variant(n)
        return depth, VARIANTS.index(variant)

    names = sorted(outcome["models"], key=table_order)
    depths = sorted({depth_variant(n)[0] for n in names})
    deg = {(r["variant"], r["depth"]): r for r in (S.result(f"{n}-train-bleu") for n in names)}
    rows, bleu, valid, record_models, curves, evals = [], {}, {}, {}, [], []
    for n in names:
        depth, variant = depth_variant(n)
        tr = trained(S, n)
        ev, which = selected(S, n, tr)
        evals.append(ev)
        bleu[(variant, depth)] = ev["bleu_test_beam4"]
        valid[(variant, depth)] = ev["bleu_valid_beam4"]
        d = deg.get((variant, depth), {})
        curves.append((n[4:], tr))
        rows.append([{"post": "post-norm transformer", "pre": "pre-norm transformer", "msc": "MSC"}[variant], depth,
                     which, R.fmt(ev["bleu_valid_beam4"]), R.fmt(ev["bleu_test_beam4"]), R.fmt(d.get("train_bleu")),
                     R.fmt(tr["valid_loss_best"], 3), R.fmt(tr["train_loss_last"], 3), tr["updates"],
                     f"{tr.get('train_minutes') or tr['minutes']:.0f}", curve_cell(tr)])
        record_models[n[4:]] = {"checkpoint": which, "valid_beam4": ev["bleu_valid_beam4"],
                                "test_beam4": ev["bleu_test_beam4"],
                                "valid_beam4_by_checkpoint": {
                                    "last3_average": S.result(f"{n}-eval")["bleu_valid_beam4"],
                                    "best_valid_loss": S.result(f"{n}-best-eval")["bleu_valid_beam4"]},
                                "train_bleu": d.get("train_bleu"), "valid_loss_best": tr["valid_loss_best"],
                                "updates": tr["updates"], "seed": tr.get("seed"),
                                "valid_loss_gain_last_20pct": flattened(tr.get("valid_curve", []))[0],
                                "minutes": round(tr.get("train_minutes") or tr["minutes"], 1)}
    v, reason = verdict(bleu, depths)
    control = untrained_controls(valid, depths)
    if control:
        reason += " " + control
    lo, hi = min(depths), max(depths)
    # the flatness gate reads the arms the targets compare; a control no target reads is named, not gated on
    compared = {f"msc{hi}", f"pre{hi}", f"msc{lo}"}
    falling = still_falling([c for c in curves if c[0] in compared])
    if falling:
        reason += " " + falling
    controls = [c for c in curves if c[0] not in compared and not flattened(c[1].get("valid_curve", []))[1]]
    if controls:
        reason += " " + still_falling(controls, end=f"; no target reads {'it' if len(controls) == 1 else 'them'}.")
    v, reason = R.past_early_regime(v, reason, falling, "--msc-updates")
    train = {k: r.get("train_bleu") for k, r in deg.items()}
    if all(train.get((var, d)) is not None for var in VARIANTS for d in (lo, hi)):
        reason += (f" Figure 2 (BLEU on training pairs, {lo} -> {hi} layers): "
                   + ", ".join(f"{var} {train[(var, lo)]:.2f} -> {train[(var, hi)]:.2f}" for var in VARIANTS)
                   + ".")
    curves = learning_curves(S, names, os.path.join(S.W, "msc_learning_curves.png"))
    n_train = a.msc_train_verses
    verses = (f"the first {n_train:,} training verses of one shuffled order (seed 1): on all 29,080 a budget long "
              f"enough for the curves to flatten does not fit the 12-layer models in one run of a few hours"
              if n_train else "all training verses")
    msc_hi = trained(S, f"msc-msc{hi}")
    deepest = msc_hi.get("train_minutes") or msc_hi["minutes"]
    deeper = (f" A {2 * hi}-layer MSC would train about {2 * deepest / 60:.1f} h on one core at this speed (twice the "
              f"{hi}-layer model's {deepest:.0f} min), more than one machine session: not run." if hi < 24 else "")
    chosen = "; ".join(f"{k} lr {c['lr']}, warm-up {c['warmup']}" for k, c in outcome["chosen"].items())
    prow = [[n[10:].replace("-lr", ", lr ").replace("-w", ", warm-up "), R.fmt(b)]
            for n, b in sorted(outcome["pilots"].items())]
    prov, prov_line = R.provenance([S.result(n) for n in S.results if n.startswith("msc-")], "msc")
    from fairseq_ext.msc.degradation import plot

    figure2 = os.path.join(S.W, "msc_degradation.png")
    plot(list(deg.values()), list(dict.fromkeys(v for v, _ in deg)), figure2)
    figures = [curves, figure2]
    md = f"""## MSC: multiscale collaborative deep encoders (Wei et al., ACL 2020)

**Claim** (Table 2, IWSLT'14 De-En): a plain deep Transformer degrades as its encoder grows (Figure 2: lower
BLEU even on its training data, so not over-fitting), while block-scale collaboration and the contextual GRU
state let deep encoders train and gain: 6-layer Transformer {PAPER['plain_6']}, MSC-6 {PAPER['msc_6']}, MSC-36
{PAPER['msc_36']}, MSC-54 {PAPER['msc_54']}, MSC-72 with L2 {PAPER['msc_72_l2']}. Targets here: MSC-{max(depths)}
>= pre-norm-{max(depths)} + 1.0 and >= MSC-{min(depths)} (test BLEU, beam 4), read only where these three models
trained past their early regime (their last 20% of updates gains < 1% valid loss).

**Verdict: {v}.** {reason}

```bash
{R.command(a, "msc")}
```

**Setup.** Encoders of {" / ".join(map(str, depths))} layers, {BLOCKS} decoder layers ({BLOCKS} MSC blocks), width
{a.dim} (FFN {4 * a.dim}, 4 heads), shared embeddings; for each depth fairseq's post-norm `transformer`, its
pre-norm one (`--encoder-normalize-before --decoder-normalize-before`) and `msc_transformer`; all with adam
(0.9, 0.98), inverse_sqrt, dropout {a.msc_dropout}, label smoothing 0.1, 1,024 tokens a batch, {a.msc_updates}
updates (no early stopping), one thread each, on {verses}. Each model is the one of two checkpoints with the higher
valid BLEU (beam 4): its last 3 interval checkpoints (every 500 updates) averaged, or its checkpoint of the best
valid loss (the table says which); its test BLEU is that checkpoint's (both are decoded on test, only valid
chooses). Each encoder's learning rate and warm-up chosen at each depth by the same {len(PILOTS)} pilots of
{a.msc_pilot_updates} updates on all training verses, on valid greedy BLEU, then, while a best pilot is at an edge
of the rates it tried, one more x2 beyond that edge (at most {EXTEND}; warm-up {PILOTS[-1][1]} above the grid,
{PILOTS[0][1]} below): {chosen}. Train BLEU: {a.msc_train_sample} training pairs drawn with a fixed seed,
beam 4, of the end of training (the average: how well the model fits its training data; the paper's Figure 2,
`python -m fairseq_ext.msc.degradation --checkpoints`).{deeper}
{prov_line}

{R.table(["encoder", "layers", "checkpoint (chosen on valid)", "valid BLEU (beam 4)", "test BLEU (beam 4)",
          "train BLEU", "best valid loss", "last train loss", "updates", "minutes", "valid loss gain, last 20%"], rows)}

Pilots (valid greedy BLEU):

{R.table(["encoder, lr, warm-up", "valid greedy"], prow)}

Signatures: {R.signatures(evals)}.

![valid loss against updates](claims_msc_learning_curves.png)
""" + ("""
![Figure 2: BLEU on training pairs and valid against depth](claims_msc_degradation.png)
""" if len(figures) > 1 else "")
    record = {"verdict": v, "reason": reason, "models": record_models, "paper": PAPER, "depths": depths,
              "train_verses": n_train or None,
              "chosen": outcome["chosen"], "pilots_valid_greedy": outcome["pilots"],
              "command": R.command(a, "msc"), **prov}
    return R.write(a.docs_dir, "msc", md, record, figures)
