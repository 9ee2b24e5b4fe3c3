"""MSC (Wei et al., ACL 2020) depth with its controls, for benchmarks/claims.py --paper msc.

Claim: a plain deep Transformer degrades as its encoder grows (Figure 2: lower BLEU on its own training data, so
not over-fitting), while MSC's block-scale and contextual collaboration train deep encoders that gain 2-3 BLEU over
the 6-layer model (Table 1: IWSLT'14 De-En 6 -> 36 / 54 / 72 layers).

Here: encoders of 6 / 12 / 24 layers (3 decoder layers, so 3 MSC blocks of 2 / 4 / 8 layers), width ``--dim``
(128), for three encoders at each depth: fairseq's post-norm transformer, its pre-norm transformer (the paper's
baseline: layer norm at each sublayer's input) and MSC; the same optimiser, schedule, dropout, batch size (tokens)
and number of updates for all nine. Each is scored on the valid set (the learning curves), the test set (once), and
1,000 training pairs drawn with a fixed seed (the paper's Figure 2 measures on 3,000 training pairs:
``python -m fairseq_ext.msc.degradation --checkpoints`` does that scoring and draws the figure).
"""

import os

from claims_common import adam_args, eval_job, plateau_args, size_args, train_job
from claims_jobs import Job

# Table 2 of the paper (IWSLT'14 De->En, small models, BLEU): the 6-layer Transformer, MSC with 6 / 36 / 54 layers and
# 72 layers with L2 (the 72-layer MSC without L2 did not train)
PAPER = {"plain_6": 32.73, "msc_6": 33.10, "msc_36": 34.86, "msc_54": 35.16, "msc_72_l2": 35.81}
DEPTHS = (6, 12, 24)
BLOCKS = 3
VARIANTS = ("post", "pre", "msc")


def options(p):
    g = p.add_argument_group("msc")
    g.add_argument("--msc-updates", type=int, default=3000, help="updates of every model (default 3000)")
    g.add_argument("--msc-depths", default="6,12,24", help="encoder depths, multiples of 3 (default 6,12,24)")
    g.add_argument("--msc-lr", type=float, default=0.0015, help="peak learning rate of all (default 0.0015)")
    g.add_argument("--msc-dropout", type=float, default=0.1, help="dropout of all (default 0.1)")
    g.add_argument("--msc-train-sample", type=int, default=1000, help="training pairs scored (default 1000)")


def smoke(a):
    a.msc_updates, a.msc_depths, a.msc_train_sample = 30, "6,12", 20


class MSC:
    def __init__(self, ctx):
        self.ctx, self.S, self.a, self.corpus = ctx, ctx.S, ctx.args, ctx.corpus
        self.depths = [int(d) for d in self.a.msc_depths.split(",")]

    def argv(self, variant, depth):
        a = self.a
        opt = adam_args(a.msc_lr, warmup=500, dropout=a.msc_dropout)
        interval = 10 if a.smoke else 500
        common = ["--task", "translation", "--source-lang", "de", "--target-lang", "en",
                  *plateau_args(a.msc_updates, interval=interval, patience=1000, keep=3)]
        if variant == "msc":
            dims = size_args(a.dim, enc_layers=None, dec_layers=BLOCKS)
            return ["--arch", "msc_transformer", "--encoder-blocks", str(BLOCKS), "--encoder-layers-per-block",
                    str(depth // BLOCKS), *dims, *opt, *common]
        norm = ["--encoder-normalize-before", "--decoder-normalize-before"] if variant == "pre" else []
        return ["--arch", "transformer", *size_args(a.dim, enc_layers=depth, dec_layers=BLOCKS), *norm, *opt, *common]

    def run(self):
        S = self.S
        names = []
        for depth in self.depths:
            for variant in VARIANTS:
                name = f"msc-{variant}{depth}"
                kind = "MSC" if variant == "msc" else f"{variant}-norm transformer"
                S.add(train_job(name, S, self.corpus.bin, self.argv(variant, depth), ["data"], {},
                                what=f"{kind}, {depth} encoder layers"))
                S.add(eval_job(f"{name}-eval", S, lambda S, n=name: S.result(n)["checkpoint"], self.corpus,
                               [("valid", 4), ("test", 4)], [name]))
                names.append(name)

        def degradation(job, S):
            pairs = [f"{n[4:]}={S.result(n)['checkpoint']}" for n in names]
            out = S.dir("degradation")
            log = S.log("msc-degradation")
            S.sh([os.sys.executable, "-m", "fairseq_ext.msc.degradation", self.corpus.bin, "--src", "de",
                  "--tgt", "en", "--workdir", out, "--checkpoints", ",".join(pairs), "--sample",
                  str(self.a.msc_train_sample), "--plot", os.path.join(S.W, "msc_degradation.png"), "--cpu"],
                 log, job.threads, "msc.degradation")
            from claims_jobs import read_json
            return read_json(os.path.join(out, "degradation.json"))

        S.add(Job("msc-degradation", degradation, {"sample": self.a.msc_train_sample}, names + ["data"],
                  what="Figure 2: BLEU on training pairs and valid of every model"))
        S.run_all([f"{n}-eval" for n in names] + ["msc-degradation"])
        return {"models": names}
