"""SAT (Wang et al., EMNLP 2018) as the paper trains it, for python -m benchmarks.claims --paper sat.

Claim (Table 3, WMT'14 En-De, beam 4): with sequence-level distillation by the Transformer and initialisation
from it, K = 2 / 4 / 6 keep 99 / 95 / 92% of the Transformer's BLEU (26.90 / 25.71 / 24.83 of 27.11), at 2.28 /
2.76 / 3.72x its batch-1 speed on a CPU (Table 5); distillation matters more as K grows (Figure 5); the
cross-entropy rises within a group (Figure 6, models trained without distillation).

Here, so that no arm is favoured: one teacher, the release transformer trained on in rounds until a round no longer
gains (each round ``--sat-teacher-updates`` updates from the previous round's average at the students' peak lr, a
warm restart; the teacher is the last round that gained at least ``--sat-teacher-gain`` valid BLEU, beam 4, over the
one before it, or the release itself), then trained on by self-distillation while that gains (round d: a K = 1
student on the training set re-translated by the teacher, from the teacher; it becomes the teacher while it beats it
by ``--sat-teacher-gain``, so that the final teacher's own K = 1 distilled student does not beat it by more). The
teacher is also where every student starts; the training set re-translated by it with beam 4. Every K of
``--sat-ks`` (K = 1: the same pipeline without the semi-autoregressive part) is trained twice, on the distilled
targets and on the real ones, each recipe with the learning rate and initialisation its own K = 2 pilots chose (the
same grid, the same pilot length and rule past the grid's edges, valid greedy BLEU), and every student runs the same
fixed number of updates (no early stopping: patience on the valid loss against the real references would stop the
distilled students early), evaluated on the average of its last 3 checkpoints. The verdict per K takes the better
recipe by valid BLEU (beam 4), read on the test set; both are reported.
"""

import argparse
import os
import platform

from . import report as R
from .common import (PRE_NORM, RELEASE_DE_EN, USER_DIR, adam_args, curve_cell, eval_job, fixed_budget_args,
                     lr_pilots, size_args, still_falling, train_job, trained)
from .jobs import ClaimsError, Job

RELEASE = os.path.join(RELEASE_DE_EN, "transformer.pt")
PAPER = {"ratio_to_teacher": {"2": 26.90 / 27.11, "4": 25.71 / 27.11, "6": 24.83 / 27.11},
         "speedup_cpu": {"2": 2.28, "4": 2.76, "6": 3.72}, "teacher_bleu": 27.11}
TARGET = {"2": 0.97, "4": 0.90}  # of the teacher's test BLEU (beam 4), the recipe better on valid
PILOT_LRS = (0.001, 0.002, 0.004)  # x2 apart; common.lr_pilots goes past an edge while the best is there
EXTEND = 2  # at most this many pilots past an edge, per recipe and initialisation
RECIPES = ("kd", "real")  # trained on the teacher's translations / on the real targets
KEYS = ("bleu_valid_greedy", "bleu_valid_beam4", "bleu_test_greedy", "bleu_test_beam4")


def options(p):
    g = p.add_argument_group("sat")
    g.add_argument("--sat-max-update", type=int, default=8000, help="updates of every student (default 8000)")
    g.add_argument("--sat-pilot-updates", type=int, default=800, help="updates of each pilot (default 800)")
    g.add_argument("--sat-pilot-inits", default="decoder", choices=("decoder", "paper", "decoder,paper"),
                   help="initialisations the pilots try, each with the same learning rates (default decoder: every "
                        "weight from the teacher; paper: its encoder and embeddings only, Sec. 4.1)")
    g.add_argument("--sat-ks", default="1,2,4,6", help="group sizes, each on distilled and real targets")
    g.add_argument("--sat-teacher", default=RELEASE, help="the teacher's starting point (default: the release)")
    g.add_argument("--sat-teacher-updates", type=int, default=8000,
                   help="updates of each teacher round (default 8000, a student's budget; 0: --sat-teacher as it is)")
    g.add_argument("--sat-teacher-lr", type=float, default=0.004,
                   help="peak lr of each round (default 0.004, what the students' pilots chose for both recipes; "
                        "at 0.002 a round lost 0.6 valid BLEU while K = 1 students at 0.004 beat the teacher)")
    g.add_argument("--sat-teacher-rounds", type=int, default=4,
                   help="at most this many rounds (default 4); the report says when the last one still gained")
    g.add_argument("--sat-teacher-distill-rounds", type=int, default=3,
                   help="then at most this many rounds of self-distillation (default 3; 0: none): a K = 1 student "
                        "on the teacher's beam-4 translations, from it, at --sat-teacher-lr for --sat-max-update "
                        "updates, which becomes the teacher while it gains --sat-teacher-gain")
    g.add_argument("--sat-release", metavar="DIR",
                   help="after the report, pack each K > 1's student of the better valid BLEU into the release "
                        "directory DIR as sat_transformer_kK.pt (e.g. releases/bible-de-en), replacing the one there")
    g.add_argument("--sat-teacher-gain", type=float, default=0.3,
                   help="a round gains when its valid BLEU (beam 4) beats the previous one's by this much "
                        "(default 0.3)")


class SAT:
    def __init__(self, ctx):
        self.ctx, self.S, self.a, self.corpus = ctx, ctx.S, ctx.args, ctx.corpus
        self.kd_name, self.kd_bin = self.kd_names(0)
        self.k1_round = None  # the last self-distillation round when it did not gain: the teacher's K = 1 student
        self.k1_stage = None  # that round's number
        self.ks = [int(k) for k in self.a.sat_ks.split(",")]
        self.smoke = self.a.smoke

    def bin_of(self, recipe):
        return (self.kd_bin, self.kd_name) if recipe == "kd" else (self.corpus.bin, "data")

    def kd_names(self, stage):
        """(job, binarised directory) of the training set re-translated by the teacher of ``stage`` (0: after the
        rounds on the real targets; d: after d rounds of self-distillation)."""
        suffix = f"-d{stage}" if stage else ""
        return f"sat-kd-beam4{suffix}", os.path.join(self.S.W, f"bin-de-en-kd-beam4{suffix}")

    # -- jobs ----------------------------------------------------------------------------------------------
    def teacher(self):
        """The release trained on in rounds until one gains less than ``--sat-teacher-gain`` valid BLEU (beam 4):
        round r starts from round r - 1's average (round 1 from ``--sat-teacher``) with a fresh optimizer. Returns
        (the teacher's job name or None for ``--sat-teacher`` itself, [(round, valid BLEU beam 4)], whether the
        last round still gained); sets ``real_round``, the teacher's round (0: ``--sat-teacher`` itself)."""
        from fairseq_ext.checkpoints.release import sha256

        S, a = self.S, self.a
        # in the settings of what reads --sat-teacher: a new release at the same path re-runs the rounds
        start_digest = self.start_digest = {"start": a.sat_teacher, "sha256": sha256(a.sat_teacher)}
        start = S.add(eval_job("sat-teacher-r0-eval", S, lambda S: a.sat_teacher, self.corpus, [("valid", 4)],
                               ["data"], settings=start_digest))
        S.run_all([start.name])
        scores = [(0, S.result(start.name)["bleu_valid_beam4"])]
        best, prev, self.real_round = None, a.sat_teacher, 0
        for r in range(1, a.sat_teacher_rounds + 1 if a.sat_teacher_updates else 1):
            name = f"sat-teacher-r{r}"
            argv = ["--task", "translation", "--arch", "transformer", "--source-lang", "de", "--target-lang", "en",
                    "--finetune-from-model", prev, *size_args(a.dim), *PRE_NORM,
                    *adam_args(a.sat_teacher_lr, warmup=200),
                    *fixed_budget_args(a.sat_teacher_updates, interval=20 if self.smoke else 500)]
            deps = ["data"] + ([best] if best else [])
            S.add(train_job(name, S, self.corpus.bin, argv, deps, {} if best else start_digest, threads=a.threads,
                            what=f"the teacher, round {r}: {a.sat_teacher_updates} updates from "
                                 + (best or "the release")))
            S.add(eval_job(f"{name}-eval", S, lambda S, n=name: S.result(n)["checkpoint"], self.corpus,
                           [("valid", 4)], [name]))
            S.run_all([f"{name}-eval"])
            scores.append((r, S.result(f"{name}-eval")["bleu_valid_beam4"]))
            if scores[-1][1] - scores[-2][1] < a.sat_teacher_gain:
                return best, scores, False
            best, prev, self.real_round = name, S.result(name)["checkpoint"], r
        return best, scores, bool(a.sat_teacher_updates)

    def distill(self, teacher, score):
        """Self-distillation rounds from ``teacher`` (the job whose checkpoint it is, None: --sat-teacher) of valid
        BLEU ``score`` (beam 4): round d trains a K = 1 student on the training set re-translated by the teacher
        (beam 4), from the teacher (every weight), at --sat-teacher-lr for --sat-max-update updates; while it beats
        the teacher by --sat-teacher-gain it becomes the teacher, as the fairseq transformer it computes. Returns
        (the teacher's job or None, its stage, [(round, valid BLEU beam 4)], the last round when it did not gain,
        whether the last round allowed still gained); sets the distilled data the students read and
        ``teacher_training``, the job that trained the teacher (None: --sat-teacher)."""
        S, a = self.S, self.a
        scores, stage, self.teacher_training = [], 0, teacher
        for d in range(1, a.sat_teacher_distill_rounds + 1):
            path_of, deps = self.path_of(teacher), [teacher] if teacher else []
            kd_name, kd_bin = self.kd_names(d - 1)
            S.add(self.kd_job(d - 1, path_of, deps))
            name = f"sat-teacher-d{d}"
            argv = self.student_argv(1, a.sat_teacher_lr, "decoder", a.sat_max_update, path_of(S))
            S.add(train_job(name, S, kd_bin, argv, [kd_name, *deps], {}, threads=a.threads,
                            what=f"the teacher, self-distillation round {d}: K=1 on its translations"))
            S.add(eval_job(f"{name}-eval", S, lambda S, n=name: S.result(n)["checkpoint"], self.corpus,
                           [("valid", 1), ("valid", 4), ("test", 1), ("test", 4)], [name]))
            S.run_all([f"{name}-eval"])
            scores.append((d, S.result(f"{name}-eval")["bleu_valid_beam4"]))
            if scores[-1][1] - score < a.sat_teacher_gain:
                self.k1_round, self.k1_stage = (name, argv, kd_name, [kd_name, *deps]), d
                self.kd_name, self.kd_bin = kd_name, kd_bin
                return teacher, stage, scores, False
            export = f"{name}-transformer"
            S.add(Job(export, lambda job, S, n=name: S.worker(
                "as_transformer", {"ckpt": S.result(n)["checkpoint"],
                                   "output": os.path.join(S.dir("checkpoints", n), "checkpoint_transformer.pt")},
                S.log(f"{n}-transformer")), {"as": "transformer"}, [name],
                what=f"round {d} as a fairseq transformer checkpoint", keep=["checkpoint"]))
            S.run_all([export])
            teacher, stage, score, self.teacher_training = export, d, scores[-1][1], name
        self.kd_name, self.kd_bin = self.kd_names(stage)
        return teacher, stage, scores, bool(scores)

    def path_of(self, teacher):
        """The teacher's checkpoint path, from the scheduler, of the job ``teacher`` (None: --sat-teacher)."""
        return (lambda S: S.result(teacher)["checkpoint"]) if teacher else (lambda S: self.a.sat_teacher)

    def student_argv(self, K, lr, init, max_update, start=None):
        argv = ["--task", "translation_sat", "--arch", "sat_transformer", "--source-lang", "de",
                "--target-lang", "en", "--sat-group-size", str(K), "--sat-init-from", start or self.teacher_path,
                *size_args(self.a.dim), *PRE_NORM, *adam_args(lr, warmup=200)]
        if init == "decoder":
            argv.append("--sat-init-decoder")
        return argv + fixed_budget_args(max_update, interval=20 if self.smoke else 500)

    def kd_job(self, stage, teacher_of, deps):
        name, kd_bin = self.kd_names(stage)

        def run(job, S):
            out = S.dir(name[4:])
            log = S.log(name[4:])
            if not os.path.exists(os.path.join(kd_bin, ".done")):
                S.fairseq("generate", [self.corpus.bin, "--user-dir", USER_DIR, "--task", "translation_sat",
                                       "--source-lang", "de", "--target-lang", "en", "--path", teacher_of(S),
                                       "--gen-subset", "train", "--beam", "4", "--lenpen", "1.0", "--max-len-a",
                                       "1.2", "--max-len-b", "10", "--batch-size", "128", "--num-workers", "0",
                                       "--results-path", out], log, job.threads)
                S.sh([os.sys.executable, "-m", "fairseq_ext.sat.distill", "--generate-output",
                      f"{out}/generate-train.txt", "--source", f"{self.corpus.data}/train.spm.de", "--out-prefix",
                      f"{out}/train", "--source-lang", "de", "--target-lang", "en"], log, what="sat.distill")
                S.fairseq("preprocess", ["--source-lang", "de", "--target-lang", "en", "--trainpref", f"{out}/train",
                                         "--validpref", f"{self.corpus.data}/valid.spm", "--testpref",
                                         f"{self.corpus.data}/test.spm", "--srcdict", f"{self.corpus.bin}/dict.de.txt",
                                         "--tgtdict", f"{self.corpus.bin}/dict.en.txt", "--destdir", kd_bin,
                                         "--workers", "1"], log)
                open(os.path.join(kd_bin, ".done"), "w").close()
            with open(f"{out}/train.en", encoding="utf-8") as f:
                n = sum(1 for _ in f)
            return {"pairs": n, "summary": f"{n} pairs re-translated with beam 4"}

        return Job(name, run, {"teacher": self.start_digest, "beam": 4, "bound": [1.2, 10]},
                   ["data", *deps], threads=self.a.threads,
                   what="the training set re-translated by the teacher (beam 4)")

    def pilot(self, recipe, init, lr):
        """A K = 2 pilot of ``recipe`` from ``init`` at ``lr``; returns its evaluation's job name."""
        name = f"sat-pilot-{recipe}-{init}-lr{lr}"
        if name not in self.S.jobs:
            bin_dir, dep = self.bin_of(recipe)
            argv = self.student_argv(2, lr, init, self.a.sat_pilot_updates)
            self.S.add(train_job(name, self.S, bin_dir, argv, [dep, *self.teacher_deps], {},
                                 what=f"pilot K=2, {recipe}, init {init}, lr {lr}"))
            self.S.add(eval_job(f"{name}-eval", self.S, lambda S: S.result(name)["checkpoint"], self.corpus,
                                [("valid", 1)], [name]))
        return f"{name}-eval"

    def pilots(self):
        """The same K = 2 pilots for both recipes: per initialisation (``--sat-pilot-inits``) the learning rates of
        :data:`PILOT_LRS` and :func:`common.lr_pilots`'s rule (at most :data:`EXTEND` past an edge); per recipe
        the (init, lr) of its best pilot by valid greedy BLEU. Returns that and every pilot's score."""
        inits = self.a.sat_pilot_inits.split(",")
        grid = {(recipe, init): list(PILOT_LRS) for recipe in RECIPES for init in inits}
        best_lr, by = lr_pilots(self.S, grid, EXTEND, lambda arm, lr: self.pilot(*arm, lr))
        chosen = {recipe: max(((init, best_lr[(recipe, init)]) for init in inits),
                              key=lambda il, r=recipe: by[((r, il[0]), il[1])]) for recipe in RECIPES}
        return chosen, {f"sat-pilot-{r}-{i}-lr{lr}": b for ((r, i), lr), b in by.items()}

    def students(self, chosen):
        """Every K of ``--sat-ks`` on both recipes; returns their job names and sets ``student_of``, each name's
        (K, recipe)."""
        names, self.student_of = [], {}
        for K in self.ks:
            for recipe in RECIPES:
                init, lr = chosen[recipe]
                bin_dir, dep = self.bin_of(recipe)
                name = f"sat-k{K}-{recipe}"
                argv = self.student_argv(K, lr, init, self.a.sat_max_update)
                if self.k1_round and self.k1_round[1:] == (argv, dep, [dep, *self.teacher_deps]):
                    # the teacher's last self-distillation round is this very training: the same result
                    r = self.k1_round[0]
                    self.S.jobs[r].keep = ["checkpoint"]  # read by the timing as the K=1 student
                    self.S.add(Job(name, lambda job, S, r=r: _same_as(S, r), {"same_as": r}, [r],
                                   what=f"K=1, distilled targets: the same training as {r}"))
                else:
                    job = self.S.add(train_job(name, self.S, bin_dir, argv, [dep, *self.teacher_deps], {},
                                               what=f"K={K}, {'distilled' if recipe == 'kd' else 'real'} targets, "
                                                    f"init {init}, lr {lr}"))
                    if recipe == "kd":  # read by the timing and the release, which may run in a later session
                        job.keep = ["checkpoint"]
                self.S.add(eval_job(f"{name}-eval", self.S, lambda S, n=name: S.result(n)["checkpoint"],
                                    self.corpus, [("valid", 1), ("valid", 4), ("test", 1), ("test", 4)], [name]))
                names.append(name)
                self.student_of[name] = (K, recipe)
        return names

    def analysis_jobs(self, students):
        S = self.S
        fig_ks = [K for K in (2, 4) if K in self.ks]

        def fig6(job, S):
            paths = [self.teacher_path_of(S)] + [S.result(f"sat-k{K}-real")["checkpoint"] for K in fig_ks]
            return S.worker("position_ce", {"paths": paths, "labels": ["Transformer (teacher)"] + [
                f"SAT K={K}" for K in fig_ks], "bin_dir": self.corpus.bin, "src": "de", "tgt": "en",
                "split": "valid", "png": os.path.join(S.W, "sat_position_ce.png")}, S.log("sat-fig6"))

        S.add(Job("sat-fig6", fig6, {"split": "valid", "ks": fig_ks},
                  [f"sat-k{K}-real" for K in fig_ks] + ["data", *self.teacher_deps],
                  what="Figure 6: position-wise cross-entropy, models trained without distillation"))

        def repeats(job, S):
            files = [os.path.join(S.result(f"{n}-eval")["hyps_dir"], "test.beam4.spm") for n in students]
            Ks = [self.student_of[n][0] for n in students]
            return S.worker("group_repeats", {"spm_files": files, "Ks": Ks}, S.log("sat-repeats"))

        S.add(Job("sat-repeats", repeats, {}, [f"{n}-eval" for n in students],
                  what="repeated subwords inside and across groups"))

        def speed(job, S):
            teacher = self.teacher_path_of(S)
            models = [{"label": "teacher, fairseq's generator", "ckpt": teacher, "task": "translation"},
                      {"label": "teacher, ours", "ckpt": teacher, "task": "translation_sat"}]
            models += [{"label": f"K={K}", "ckpt": S.result(f"sat-k{K}-kd")["checkpoint"], "task": "translation_sat"}
                       for K in self.ks]
            return S.worker("speed", {"models": models, "bin_dir": self.corpus.bin, "src": "de", "tgt": "en",
                                      "sentences": 10 if self.smoke else 100, "repeat": 1 if self.smoke else 3},
                            S.log("sat-speed"), threads=1)

        S.add(Job("sat-speed", speed, {"sentences": 100, "repeat": 3, "compiled": "waited for"},
                  [f"sat-k{K}-kd" for K in self.ks] + ["data", *self.teacher_deps],
                  exclusive=True, what="batch-1 latency, one thread, interleaved (runs alone)"))
        if self.teacher_training and self.teacher_training != self.teacher_deps[0]:
            # the teacher is a self-distillation round as the transformer it computes: that round's scores
            r = f"{self.teacher_training}-eval"
            S.add(Job("sat-teacher-eval", lambda job, S: _same_as(S, r, ("workdir", "remade")), {"same_as": r}, [r],
                      what=f"the teacher's scores: those of {r}", reads_files=False))
        else:
            S.add(eval_job("sat-teacher-eval", S, self.teacher_path_of, self.corpus,
                           [("valid", 1), ("valid", 4), ("test", 1), ("test", 4)], ["data", *self.teacher_deps]))
        return ["sat-fig6", "sat-repeats", "sat-speed", "sat-teacher-eval"]

    # -- the run ---------------------------------------------------------------------------------------------
    def run(self):
        S = self.S
        teacher, rounds, still_gaining = self.teacher()
        real_rounds_teacher = teacher
        teacher, stage, distilled, distill_gaining = self.distill(teacher, dict(rounds)[self.real_round])
        self.teacher_path_of = self.path_of(teacher)
        self.teacher_deps = [teacher] if teacher else []
        self.teacher_path = self.teacher_path_of(S)
        self.ctx.say("sat: teacher rounds on valid (beam 4): " + ", ".join(f"{r}: {b:.2f}" for r, b in rounds)
                     + "; self-distillation rounds: " + (", ".join(f"{d}: {b:.2f}" for d, b in distilled) or "none")
                     + f" -> the teacher is {teacher or 'the starting point'}"
                     + (" (the last round still gained)" if still_gaining or distill_gaining else ""))
        if self.kd_name not in S.jobs:
            S.add(self.kd_job(stage, self.teacher_path_of, self.teacher_deps))
        chosen, scored = self.pilots()
        self.ctx.say("sat: pilots on valid (greedy BLEU): " + ", ".join(f"{n[10:]} {b:.2f}" for n, b in
                                                                         scored.items())
                     + " -> " + "; ".join(f"{r}: init {i}, lr {lr}" for r, (i, lr) in chosen.items()))
        students = self.students(chosen)
        analysis = self.analysis_jobs(students)
        S.run_all([f"{n}-eval" for n in students] + analysis)
        return {"chosen": {r: {"init": i, "lr": lr} for r, (i, lr) in chosen.items()}, "pilots": scored,
                "students": students, "teacher": teacher, "teacher_rounds": rounds,
                "teacher_real_rounds": real_rounds_teacher, "teacher_distill_rounds": distilled,
                "teacher_k1_round": self.k1_round[0] if self.k1_round else None,
                "teacher_still_gaining": still_gaining, "teacher_distill_still_gaining": distill_gaining,
                "kd_data": self.kd_name, "teacher_round": self.real_round, "teacher_stage": stage,
                "teacher_training": self.teacher_training, "teacher_k1_stage": self.k1_stage,
                "student_of": {n: [K, recipe] for n, (K, recipe) in self.student_of.items()}}


def smoke(a):
    """--smoke: a few updates of everything (the corpus slice has 400 training verses)."""
    a.sat_max_update, a.sat_pilot_updates = 40, 20
    if a.sat_teacher_updates:
        a.sat_teacher_updates, a.sat_teacher_rounds = 40, min(a.sat_teacher_rounds, 2)
    a.sat_teacher_distill_rounds = min(a.sat_teacher_distill_rounds, 1)


def _bleu_rows(outcome, ev, tr, teacher, teacher_tr):
    """The BLEU table: the teacher, then every student with its updates, minutes, curve check and ratio."""
    made = _teacher_label(outcome)
    label = f"Transformer (teacher: {made})" if made != "the release" else "Transformer (teacher, release)"
    rows = [[label, *(R.fmt(teacher[k]) for k in KEYS), teacher_tr.get("updates", "-") if teacher_tr else "-",
             curve_cell(teacher_tr) if teacher_tr else "-", "100%", "-"]]
    for n in outcome["students"]:
        K, recipe = outcome["student_of"][n]
        ratio = ev[n]["bleu_test_beam4"] / teacher["bleu_test_beam4"] if teacher["bleu_test_beam4"] else None
        rows.append([f"K={K}, {'distilled' if recipe == 'kd' else 'real'} targets", *(R.fmt(ev[n][k]) for k in KEYS),
                     tr[n]["updates"], curve_cell(tr[n]), "-" if ratio is None else f"{100 * ratio:.0f}%",
                     f"{100 * PAPER['ratio_to_teacher'][str(K)]:.0f}%" if str(K) in PAPER["ratio_to_teacher"]
                     and recipe == "kd" else "-"])
    return rows


def _teacher_line(a, outcome):
    """The Setup's teacher sentence: the rounds, each one's valid BLEU, the stop rule and where it stopped."""
    start = ("the release transformer (`releases/bible-de-en/transformer.pt`)" if a.sat_teacher == RELEASE
             else f"`{os.path.basename(a.sat_teacher)}`")
    if not a.sat_teacher_updates:
        return start
    by_round = ", ".join(("start" if r == 0 else f"round {r}") + f" {b:.2f}" for r, b in outcome["teacher_rounds"])
    r = outcome["teacher_round"]
    stop = (f"the last round allowed (--sat-teacher-rounds {a.sat_teacher_rounds}) still gained"
            if outcome["teacher_still_gaining"] else f"round {len(outcome['teacher_rounds']) - 1} gained less")
    line = (f"{start} trained on in rounds of {a.sat_teacher_updates} updates on the real targets, each from the "
            f"previous round's average with a fresh adam (lr {a.sat_teacher_lr}, warmup 200, label smoothing 0.1, the "
            f"average of its last 3 checkpoints), until a round gains less than {a.sat_teacher_gain} valid BLEU "
            f"(beam 4) over the one before: valid BLEU by round {by_round}; {stop}, so "
            + (f"round {r}" if r else "the starting point"))
    distilled = outcome.get("teacher_distill_rounds") or []
    if not distilled:
        return line + " is the teacher"
    d, k1 = outcome["teacher_stage"], outcome.get("teacher_k1_stage")
    return (line + " was trained on by rounds of self-distillation, each a K = 1 student of "
            f"{a.sat_max_update} updates (lr {a.sat_teacher_lr}, every weight from the teacher) on the training set "
            "re-translated by the teacher (beam 4), which becomes the teacher while it gains at least "
            f"{a.sat_teacher_gain} valid BLEU (beam 4) over it, so that the final teacher's own K = 1 distilled "
            "student does not beat it by more: valid BLEU by round "
            + ", ".join(f"{b:.2f}" for _, b in distilled) + "; the teacher is "
            + (f"self-distillation round {d}" if d else "that round")
            + (f" (round {k1}, which gained less, is its K = 1 distilled student)" if k1 is not None else
               f" (the last round allowed, --sat-teacher-distill-rounds {a.sat_teacher_distill_rounds}, still "
               "gained)"))


def _speed_rows(speed, ks):
    """The speed table: each distilled student over our K=1 (the paper's CPU Table 5 beside it), the teachers."""
    srows = []
    fs = "teacher, fairseq's generator"
    for K in sorted(ks):
        lab = f"K={K}"
        srows.append([lab, *(f"{speed[(lab, b)]:.1f}" for b in (1, 4)),
                      *(f"{speed[('K=1', b)] / speed[(lab, b)]:.2f}x" if ("K=1", b) in speed else "-" for b in (1, 4)),
                      *(f"{speed[(fs, b)] / speed[(lab, b)]:.2f}x" for b in (1, 4)),
                      f"{PAPER['speedup_cpu'][str(K)]:.2f}x" if str(K) in PAPER["speedup_cpu"] else "-"])
    for lab in ("teacher, ours", fs):
        srows.append([lab, *(f"{speed[(lab, b)]:.1f}" for b in (1, 4)), "", "", "", "", ""])
    return srows


def _repeat_rows(reps, outcome):
    """One row per student of the outcome (in the order of ``reps``), its recipe from ``student_of``."""
    return [[f"K={f['K']}, {'distilled' if outcome['student_of'][n][1] == 'kd' else 'real'} targets",
             f["repeats_inside_groups"], f["pairs_inside"],
             f"{100 * f['repeats_inside_groups'] / max(1, f['pairs_inside']):.1f}%",
             f["repeats_across_groups"], f["pairs_across"],
             f"{100 * f['repeats_across_groups'] / max(1, f['pairs_across']):.1f}%"]
            for f, n in zip(reps, outcome["students"])]


def ratios(ev, teacher, ks, key="bleu_test_beam4"):
    """{K: {recipe: ratio to the teacher}}, {K: the better recipe's ratio} and {K: that recipe}: the better recipe
    is the one with the higher valid BLEU (beam 4; the distilled one on a tie), never chosen on the test set."""
    by = {K: {r: ev[f"sat-k{K}-{r}"][key] / teacher[key] if teacher[key] else 0.0 for r in RECIPES
              if f"sat-k{K}-{r}" in ev} for K in ks}
    better = {K: max(v, key=lambda r, K=K: (ev[f"sat-k{K}-{r}"]["bleu_valid_beam4"], r == "kd"))
              for K, v in by.items() if v}
    return by, {K: by[K][r] for K, r in better.items()}, better


def _reason(met, by, best, better, kd_effect, k1_over, unflat, speed, ks):
    """Why the verdict: per K both recipes against the target, the K = 1 check on the teacher, distillation's
    effect, the curves, the speed-ups over our K = 1 beside the paper's CPU figures."""
    Ks = [K for K in sorted(ks) if K > 1]
    parts = []
    for K in Ks:
        target = TARGET.get(str(K))
        both = " / ".join(f"{'distilled' if r == 'kd' else 'real'} {100 * v:.0f}%" for r, v in by[K].items())
        parts.append(f"K = {K}: {100 * best[K]:.0f}% of the teacher's test BLEU, "
                     f"{'distilled' if better[K] == 'kd' else 'real'} targets, the better on valid ({both}"
                     + (f"; target {100 * target:.0f}%, {'met' if met[K] else 'missed'}" if target else
                        "; no target") + ")")
    text = "; ".join(parts) + ". "
    if k1_over is not None:  # (valid, test, valid BLEU over the teacher's, the rule's margin): as the teacher's rule
        valid, test, over, gain = k1_over
        text += (f"The K = 1 student reaches {100 * valid:.0f}% of the teacher's valid BLEU ({100 * test:.0f}% on "
                 "test)" + (f", {over:.2f} above it (the teacher's rounds stop below {gain}): the teacher had not "
                            "converged, so the ratios are optimistic. " if over >= gain
                            else ", so the pipeline itself loses nothing the groups do not. "))
    text += ("Distillation against the real targets (valid BLEU, beam 4): "
             + ", ".join(f"{d:+.2f} at K = {K}" for K, d in sorted(kd_effect.items()))
             + " (paper, Figure 5: it helps, more as K grows). ")
    if unflat:
        text += unflat + " "
    if ("K=1", 4) in speed:
        text += ("Speed-ups over our own K = 1 (beam 4, batch 1, one thread): "
                 + " / ".join(f"{speed[('K=1', 4)] / speed[(f'K={K}', 4)]:.2f}x" for K in Ks if (f"K={K}", 4) in speed)
                 + " (paper, CPU Table 5: " + " / ".join(f"{PAPER['speedup_cpu'][str(K)]:.2f}x" for K in Ks
                                                        if str(K) in PAPER["speedup_cpu"]) + ").")
    return text


def _markdown(S, a, outcome, verdict, reason, tables, ev, teacher, fig6, prov_line):
    """The SAT section of CLAIMS.md; ``tables``: the BLEU, pilot, speed and repeat rows."""
    rows, prow, srows, rrows = tables
    timed = [n for n, (_, r) in outcome["student_of"].items() if r == "kd"] + [outcome["teacher"]] * bool(
        outcome["teacher"])  # what the timing reads
    remade = [n for n in timed if n in S.results and "remade" in S.result(n)]
    remade = (f" The timing read {', '.join(remade)} trained again with the run's settings (the run's files were "
              f"not kept); the BLEU above is the run's." if remade else "")
    chosen = "; ".join(f"{'distilled' if r == 'kd' else 'real'} targets: init **{c['init']}**, lr **{c['lr']}**"
                       for r, c in outcome["chosen"].items())
    teacher_line = _teacher_line(a, outcome)
    kd_pairs = S.result(outcome.get("kd_data", "sat-kd-beam4"))["pairs"]
    inits = " and ".join(f"`{i}`" for i in a.sat_pilot_inits.split(","))
    npilots = ", ".join(f"{sum(n.startswith(f'sat-pilot-{r}-') for n in outcome['pilots'])} pilots "
                        f"{'distilled' if r == 'kd' else 'real'}" for r in RECIPES)
    return f"""## SAT: semi-autoregressive decoding (Wang et al., EMNLP 2018)

**Claim** (Table 3, WMT'14 En-De, beam 4): with sequence-level distillation by the Transformer and initialisation
from it, K = 2 / 4 / 6 keep 99 / 95 / 92% of the Transformer's BLEU (targets here: K = 2 >= 97%, K = 4 >= 90%, on
the test set, with the recipe of the better valid BLEU: distilled or real targets), at 2.28 / 2.76 / 3.72x its
speed on a CPU (Table 5); distillation matters more as K grows (Figure 5); the cross-entropy rises with the position
inside a group (Figure 6).

**Verdict: {verdict}.** {reason}

```bash
{R.command(a, "sat")}
```

**Setup.** Teacher: {teacher_line}; pre-norm, d {a.dim}, 3 + 3 layers; it is also every student's starting point.
The training set re-translated by it with beam 4 ({kd_pairs} pairs). Every K trained on
those distilled targets and on the real ones, {a.sat_max_update} updates each (no early stopping), adam,
inverse_sqrt, warmup 200, label smoothing 0.1, 1,024 tokens a batch, validated every 500 updates, the last 3
checkpoints averaged. Each recipe's initialisation and learning rate chosen by K = 2 pilots of
{a.sat_pilot_updates} updates on valid greedy BLEU under one rule for both: initialisation {inits}, learning rates
{', '.join(map(str, PILOT_LRS))}, then, while a recipe's best pilot is at an edge of the rates it tried, one more
x2 beyond that edge (at most {EXTEND}; {npilots}): {chosen} (`decoder`: every weight from the teacher,
`--sat-init-decoder`; `paper`: encoder and embeddings only; `--sat-pilot-inits` sets which are tried). {prov_line}

### BLEU (sacreBLEU; ratio = test beam 4 over the teacher)

{R.table(["model", "valid greedy", "valid beam 4", "test greedy", "test beam 4", "updates",
          "valid loss gain, last 20%", "ratio", "paper"], rows)}

Signatures: {R.signatures(list(ev.values()) + [teacher])}.

### Pilots (K = 2, valid greedy BLEU after {a.sat_pilot_updates} updates)

{R.table(["recipe, init, lr", "valid greedy"], prow)}

### Speed (batch 1, one thread, first 100 test sentences, ms per sentence; fastest of 3 interleaved passes)

{R.table(["model", "greedy ms", "beam 4 ms", "over K=1 greedy", "over K=1 beam 4", "over fairseq greedy",
          "over fairseq beam 4", "paper (CPU, Table 5)"], srows)}

"over K=1": against our K = 1 student in our generator, which isolates what the groups buy (the paper's Table 5
compares with its own Transformer); "over fairseq": against the teacher decoded by fairseq's
`SequenceGenerator`.{remade}

### Figure 6: cross-entropy by position (valid, teacher-forced; models trained on the real targets)

![position-wise cross-entropy](claims_sat_position_ce.png)

Mean cross-entropy by position inside a group: {"; ".join(f"{m['label']}: " + " / ".join(f"{c:.2f}" for c in
                                                           m['by_position_in_group']) for m in fig6)}.

### Repeated subwords (test, beam 4): the same subword twice in a row, inside a group and across groups

{R.table(["model", "repeats inside", "pairs inside", "rate", "repeats across", "pairs across", "rate"], rrows)}
"""


def report(ctx, outcome):
    """docs/CLAIMS.md's SAT section and claims.json's ``sat``: per K both recipes against the teacher, the verdict
    per K from the better one, distillation's effect, Figure 6, repeats inside groups and speed-ups."""
    S, a = ctx.S, ctx.args
    ev = {n: S.result(f"{n}-eval") for n in outcome["students"]}
    tr = {n: trained(S, n) for n in outcome["students"]}
    teacher = S.result("sat-teacher-eval")
    teacher_tr = trained(S, outcome["teacher_training"]) if outcome["teacher_training"] else None
    ks = sorted({outcome["student_of"][n][0] for n in outcome["students"]})
    by, best, better = ratios(ev, teacher, ks)
    by_valid, _, _ = ratios(ev, teacher, ks, "bleu_valid_beam4")
    met = {K: best[K] >= TARGET[str(K)] for K in ks if str(K) in TARGET}
    verdict = R.verdict_of(met) if met else "not tested"
    not_run = [K for K in TARGET if int(K) not in ks]  # a run of some group sizes (--sat-ks) tests only those
    if not_run and verdict == "reproduced":
        verdict = "partly reproduced"
    kd_effect = {K: ev[f"sat-k{K}-kd"]["bleu_valid_beam4"] - ev[f"sat-k{K}-real"]["bleu_valid_beam4"]
                 for K in ks if K > 1 and f"sat-k{K}-kd" in ev and f"sat-k{K}-real" in ev}
    k1_over = ((by_valid[1][better[1]], best[1], ev[f"sat-k1-{better[1]}"]["bleu_valid_beam4"]
                - teacher["bleu_valid_beam4"], a.sat_teacher_gain) if 1 in better else None)
    unflat = still_falling(([("the teacher", teacher_tr)] if teacher_tr is not None else [])
                           + [(n, tr[n]) for n in outcome["students"]])
    speed = {(m["label"], m["beam"]): m["ms"] for m in S.result("sat-speed")["ms"]}
    fig6 = S.result("sat-fig6")["models"]
    reps = S.result("sat-repeats")["files"]
    reason = _reason(met, by, best, better, kd_effect, k1_over, unflat, speed, ks)
    if not_run:
        reason += (f" Not run here (--sat-ks {a.sat_ks}): K = {', '.join(not_run)}, so "
                   f"{'its target is' if len(not_run) == 1 else 'their targets are'} not tested.")
    gaining = outcome["teacher_still_gaining"] or outcome.get("teacher_distill_still_gaining", False)
    flag = ("--sat-teacher-distill-rounds" if outcome.get("teacher_distill_still_gaining")
            else "--sat-teacher-rounds")
    if gaining:
        reason += (f" The teacher's last round still gained {a.sat_teacher_gain} valid BLEU or more: a longer "
                   f"teacher ({flag}) would change every ratio.")
    # the students' curves, and the teacher's rounds (a teacher still gaining makes every ratio optimistic)
    verdict, reason = R.past_early_regime(
        verdict, reason, " ".join(filter(None, [still_falling([(n, tr[n]) for n in outcome["students"]]),
                                                "the teacher's rounds" * gaining])),
        "--sat-max-update" + f" / {flag}" * gaining)
    used = [S.result(n) for n in S.results if n.startswith("sat-")]
    prov, prov_line = R.provenance(used, "sat")
    prow = [[n[10:].replace("-lr", ", lr ").replace("-", ", ", 1), R.fmt(b)]
            for n, b in sorted(outcome["pilots"].items())]
    tables = (_bleu_rows(outcome, ev, tr, teacher, teacher_tr), prow, _speed_rows(speed, ks),
              _repeat_rows(reps, outcome))
    md = _markdown(S, a, outcome, verdict, reason, tables, ev, teacher, fig6, prov_line)
    record = {"verdict": verdict, "reason": reason,
              "ratio_to_teacher": {str(K): round(best[K], 4) for K in ks if K > 1},
              "recipe_by_valid": {str(K): r for K, r in better.items() if K > 1},
              "ratio_to_teacher_by_recipe": {str(K): {r: round(v, 4) for r, v in by[K].items()} for K in ks},
              "ratio_to_teacher_valid_by_recipe": {str(K): {r: round(v, 4) for r, v in by_valid[K].items()}
                                                   for K in ks},
              "paper_ratio_to_teacher": {k: round(v, 4) for k, v in PAPER["ratio_to_teacher"].items()},
              "paper_speedup_cpu": PAPER["speedup_cpu"], "targets": TARGET,
              "teacher": {**{k: teacher[k] for k in KEYS}, "round": outcome["teacher_round"],
                          "self_distillation_round": outcome["teacher_stage"],
                          "valid_beam4_by_self_distillation_round": outcome.get("teacher_distill_rounds", []),
                          "round_updates": a.sat_teacher_updates, "valid_beam4_by_round": outcome["teacher_rounds"],
                          "still_gaining": gaining},
              "students": {n: {**{k: ev[n][k] for k in KEYS}, "updates": tr[n]["updates"],
                               "minutes": round(tr[n].get("train_minutes") or tr[n]["minutes"], 1),
                               "seed": tr[n].get("seed")} for n in outcome["students"]},
              "speed_ms": {f"{lab} beam {b}": ms for (lab, b), ms in speed.items()},
              "chosen": outcome["chosen"], "pilots_valid_greedy": outcome["pilots"],
              "command": R.command(a, "sat"), **prov}
    png = os.path.join(S.W, "sat_position_ce.png")
    if not os.path.isfile(png):  # Figure 6's step ran in another work directory: drawn again from its result
        from fairseq_ext.sat.position_ce import plot

        plot([(m["K"], m["label"], m["ce"], m["counts"], m["by_position_in_group"]) for m in fig6], "valid", png)
    written = R.write(a.docs_dir, "sat", md, record, [png])
    if getattr(a, "sat_release", None):
        for K in (K for K in ks if K > 1):
            release(ctx, K, better[K], ev, tr, outcome)
    return written


def release(ctx, K, recipe, ev, tr, outcome):
    """Packs K's student of ``recipe`` (K > 1) into --sat-release as ``sat_transformer_k{K}.pt`` with its manifest
    entry: how it was trained (the command and the step), its valid / test BLEU (beam 4) and what it cost."""
    from fairseq_ext.checkpoints.release import pack

    a, S = ctx.args, ctx.S
    student = {(k, r): n for n, (k, r) in outcome["student_of"].items()}
    name, other = student[K, recipe], student[K, "kd" if recipe == "real" else "real"]
    targets = "the real targets" if recipe == "real" else "the teacher's beam-4 translations"
    t, e = tr[name], ev[name]
    if not os.path.isfile(t["checkpoint"]):
        raise ClaimsError(f"--sat-release: {name}'s checkpoint {t['checkpoint']} is not here (its result came from "
                          "the store): run --sat-release in the work directory that trained it")
    remade = "remade" in S.result(name)
    if remade:  # trained again with the same settings (the run's file was not kept): its own scores
        job = eval_job(f"{name}-remade-eval", S, lambda S: t["checkpoint"], ctx.corpus, [("valid", 4), ("test", 4)],
                       [name])
        e = job.run(job, S)
        t = {**t, **S.result(name)["remade"]}
    run_command = R.command(argparse.Namespace(**{**vars(a), "sat_release": None}), "sat")  # how it was trained
    meta = {"arch": "sat_transformer", "name": f"sat_transformer_k{K}", "corpus": "bible", "direction": "de-en",
            "command": f"{run_command} (its student {name}: K={K} on {targets}, every weight initialised "
                       f"from the claims run's teacher ({_teacher_label(outcome)}), {t['updates']} updates; chosen "
                       f"over {other}, {ev[other]['bleu_valid_beam4']:.2f} valid, on valid BLEU (beam 4)"
                       + (f"; this file trained again with the same settings, the run's scoring "
                          f"{ev[name]['bleu_valid_beam4']:.2f} valid)" if remade else ")"),
            "code_commit": f"{t.get('code_commit', 'unknown')} (the SAT claims run)",
            "updates_trained": t["updates"], "threads": t.get("threads", 1),
            "wall_seconds": round(60 * (t.get("train_minutes") or t["minutes"])),
            "cpu_seconds": round(60 * t["cpu_minutes"]) if t.get("cpu_minutes") is not None else None,
            "valid_bleu": round(e["bleu_valid_beam4"], 2), "valid_signature": e["bleu_valid_beam4_signature"],
            "test_bleu": round(e["bleu_test_beam4"], 2), "test_signature": e["bleu_test_beam4_signature"],
            "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
            "summary": f"sat_transformer K={K} trained {t['updates']} updates on {targets} from the SAT claims run's "
                       f"teacher by the SAT claims run; valid BLEU {e['bleu_valid_beam4']:.2f} (beam 4)"}
    out, _ = pack(t["checkpoint"], f"sat_transformer_k{K}", a.sat_release,
                  os.path.join(ctx.corpus.bin, "dict.de.txt"), os.path.join(RELEASE_DE_EN, "spm.model"), meta)
    ctx.say(f"sat: {name} packed as {out} (test BLEU {e['bleu_test_beam4']:.2f}, beam 4)")


def _same_as(S, r, drop=()):
    """The result of step ``r`` as another step's (a K = 1 student that is the teacher's last round, the teacher's
    scores), without what describes ``r``'s own run and the keys of ``drop``."""
    return {k: v for k, v in S.result(r).items()
            if k not in ("ok", "settings_hash", "minutes", "threads", "code_commit", *drop)} | {"same_as": r}


def _teacher_label(outcome):
    """What made the teacher: "the release", then its rounds on the real targets and of self-distillation."""
    r, d = outcome["teacher_round"], outcome["teacher_stage"]
    parts = [f"{r} round{'s' * (r != 1)}"] * bool(r) + [f"{d} self-distillation round{'s' * (d != 1)}"] * bool(d)
    return " + ".join(["the release", *parts])
