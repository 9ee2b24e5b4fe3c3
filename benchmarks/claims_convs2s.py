"""ConvS2S (Gehring et al., ICML 2017) against what its paper beat, for benchmarks/claims.py --paper convs2s.

Claim: a fully convolutional encoder-decoder with GLUs and multi-step attention beats strong recurrent
(LSTM) models in accuracy (WMT'16 En-Ro, WMT'14 En-De / En-Fr) while training and translating faster; attention in
every decoder layer (multi-step attention) is better than attention in the last layer only (Table 5: removing
attention from all but the top layer costs BLEU).

Here: ``fconv_glu`` (4 + 3 GLU convolutions of width ``--dim``, kernel 3: the quickstart's) against fairseq's ``lstm``
with attention of similar size (a bidirectional LSTM encoder and an LSTM decoder of hidden size 2 * ``--dim``, shared
embeddings), and ``fconv_glu`` with attention in its last decoder layer only. Each trains with its own optimiser (the
quickstart's NAG for ConvS2S as in the paper; adam for the LSTM, its learning rate chosen by short pilots on the
valid set) for the same number of updates of the same batches (tokens), two at a time, one thread each, so their
wall clocks compare; interval checkpoints give the equal-minutes comparison (each model at the largest checkpoint
it reached within the minutes the faster one needed for all its updates).
"""

import os

from claims_common import adam_args, eval_job, plateau_args, train_job
from claims_jobs import Job

PAPER = {"en_ro": {"convs2s": 30.02, "gru_bpe_sennrich": 28.1},  # Table 1: WMT'16 En-Ro, ConvS2S vs Sennrich's GRU
         "en_de": {"convs2s": 25.16, "gnmt_lstm": 24.61},  # Table 1: WMT'14 En-De, ConvS2S vs GNMT (word-piece LSTM)
         "attention_last_layer_only_delta": -0.3}  # Table 5 on WMT'16 En-Ro: attention only in the top decoder layer
LSTM_LRS = (0.001, 0.003)


def options(p):
    g = p.add_argument_group("convs2s")
    g.add_argument("--convs2s-updates", type=int, default=3000, help="updates of every model (default 3000)")
    g.add_argument("--convs2s-pilot-updates", type=int, default=600, help="updates of each LSTM pilot (600)")


def smoke(a):
    a.convs2s_updates, a.convs2s_pilot_updates = 30, 10


class ConvS2S:
    def __init__(self, ctx):
        self.ctx, self.S, self.a, self.corpus = ctx, ctx.S, ctx.args, ctx.corpus

    def common(self, updates):
        interval = 10 if self.a.smoke else 250
        return ["--task", "translation", "--source-lang", "de", "--target-lang", "en", "--max-tokens", "1024",
                *plateau_args(updates, interval=interval, patience=1000, keep=1000)]

    def fconv(self, attention="True"):
        d = self.a.dim
        return ["--arch", "fconv_glu", "--encoder-embed-dim", str(d), "--encoder-layers", f"[({d}, 3)] * 4",
                "--decoder-embed-dim", str(d), "--decoder-layers", f"[({d}, 3)] * 3", "--decoder-out-embed-dim",
                str(d), "--decoder-attention", attention, "--share-input-output-embed", "--dropout", "0.0",
                "--optimizer", "nag", "--lr", "0.25", "--clip-norm", "0.1", "--lr-scheduler", "fixed",
                "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]

    def lstm(self, lr):
        d = self.a.dim
        argv = ["--arch", "lstm", "--encoder-embed-dim", str(d), "--encoder-hidden-size", str(2 * d),
                "--encoder-layers", "1", "--encoder-bidirectional", "--decoder-embed-dim", str(d),
                "--decoder-hidden-size", str(2 * d), "--decoder-layers", "1", "--decoder-out-embed-dim", str(d),
                "--decoder-attention", "1", *adam_args(lr, warmup=200, attention_dropout=False)]
        return argv

    def run(self):
        S, a = self.S, self.a
        pilots = []
        for lr in LSTM_LRS:
            name = f"convs2s-lstm-pilot-lr{lr}"
            S.add(train_job(name, S, self.corpus.bin, self.lstm(lr) + self.common(a.convs2s_pilot_updates), ["data"],
                            {}, what=f"LSTM pilot, lr {lr}"))
            S.add(eval_job(f"{name}-eval", S, lambda S, n=name: S.result(n)["checkpoint"], self.corpus,
                           [("valid", 1)], [name]))
            pilots.append(name)
        S.run_all([f"{n}-eval" for n in pilots])
        scored = sorted(((S.result(f"{n}-eval")["bleu_valid_greedy"], n) for n in pilots), reverse=True)
        lr = float(scored[0][1].rsplit("lr", 1)[1])
        self.ctx.say("convs2s: LSTM pilots on valid (greedy BLEU): " + ", ".join(f"{n[20:]} {b:.2f}"
                                                                               for b, n in scored) + f" -> lr {lr}")
        runs = {"convs2s-fconv": self.fconv("True"), "convs2s-lstm": self.lstm(lr),
                "convs2s-fconv-lastattn": self.fconv("[False, False, True]")}
        for name, argv in runs.items():
            S.add(train_job(name, S, self.corpus.bin, argv + self.common(a.convs2s_updates), ["data"], {},
                            what=name[8:]))
            S.add(eval_job(f"{name}-eval", S, lambda S, n=name: S.result(n)["checkpoint"], self.corpus,
                           [("valid", 4), ("test", 1), ("test", 4)], [name]))

        def equal_minutes(job, S):
            """The checkpoint of each model at the minutes the faster of fconv / lstm needed for all its updates."""
            from claims_common import json_records

            times = {}
            for name in ("convs2s-fconv", "convs2s-lstm"):
                recs = [r for r in json_records(S.log(name, "train.log"), "train_inner")]
                times[name] = [(int(float(r["num_updates"])), float(r["wall"])) for r in recs]
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
        S.run_all([f"{n}-eval" for n in runs] + ["convs2s-equal-minutes"])
        return {"lstm_lr": lr, "pilots": {n: b for b, n in scored}}
