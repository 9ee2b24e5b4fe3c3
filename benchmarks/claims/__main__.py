"""Test each paper's own claim with the control it needs, on the bundled Bible corpus (German -> English).

    python -m benchmarks.claims --paper sat|msc|bert_jam|convs2s [--workdir work/claims] [--jobs 2]
                                [--threads 2] [--dim 128] [--smoke] [--docs-dir docs] [--start-within MINUTES]

Each paper runs the experiment its claim needs (a control of equal depth, equal updates, equal data; see
benchmarks/claims/PAPER.py for the design), sized to fit about two hours on two CPU cores; the sizes are flags
(``--dim``, the per-paper ``--*-max-update`` and friends), so the same command runs larger on a GPU. Every step is a
job whose result is kept with a hash of its settings in WORKDIR/PAPER/results: a re-run skips what is done and
re-runs what changed; each result is also kept in benchmarks/claims/store/PAPER (``--store``), with the
checkpoints a later step reads (``Job.keep``), which a run long enough to need several machine sessions commits
between them; ``--start-within MINUTES`` starts no training after a run's first MINUTES, so that a session ends
with every training it started finished, evaluated and stored. ``--jobs 2`` trains two models side by side, one
thread each (the default on a 2-core machine); timings run alone. Hyper-parameters and checkpoints are chosen on the
valid set; the test set is decoded after training and chooses nothing.

Writes docs/CLAIMS.md (per paper: the claim, the paper's number, ours, the control, the figure, the command,
sacreBLEU signatures, update counts and minutes) and docs/claims.json (``PAPER.verdict``: one of
``report.VERDICTS``, reproduced / partly reproduced / not reproduced / not tested, and ``PAPER.reason``); a paper's
section is replaced when it is run
again, the others are kept. ``--smoke`` runs every step on a slice of the corpus with a few updates (the tests).
"""

import argparse
import importlib
import os
import sys
import time

from .common import Corpus
from .jobs import ROOT, ClaimsError, ClaimsPaused, Scheduler

PROG = "python -m benchmarks.claims"
CLASSES = {"sat": "SAT", "msc": "MSC", "bert_jam": "BertJam", "convs2s": "ConvS2S"}  # --paper: its module's class
PAPERS = tuple(CLASSES)


class Context:
    def __init__(self, args):
        self.args = args
        self.t0 = time.time()
        store = None if args.smoke or args.no_store else os.path.join(args.store, args.paper)
        self.S = Scheduler(os.path.join(args.workdir, args.paper), args.jobs, self.say, store)
        if args.start_within is not None:
            self.S.start_by = self.t0 + 60 * args.start_within
        self.corpus = Corpus(self.S, smoke=args.smoke)
        self.S.add(self.corpus.job())

    def say(self, msg):
        m = int(time.time() - self.t0) // 60
        print(f"[claims {self.args.paper} {m // 60}:{m % 60:02d}] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", required=True, choices=PAPERS)
    p.add_argument("--workdir", default=os.path.join(ROOT, "work", "claims"))
    p.add_argument("--docs-dir", default=os.path.join(ROOT, "docs"))
    p.add_argument("--store", default=os.path.join(ROOT, "benchmarks", "claims", "store"),
                   help="every step's result is also kept in STORE/PAPER, and a step found there is skipped: commit "
                        "it to go on in a new work directory, another session (default benchmarks/claims/store; "
                        "not with --smoke)")
    p.add_argument("--no-store", action="store_true", help="keep results in the work directory only")
    p.add_argument("--jobs", type=int, default=2, help="trainings side by side (default 2: one per core)")
    p.add_argument("--threads", type=int, default=2, help="threads of a step that runs alone (default 2)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128, the release's)")
    p.add_argument("--start-within", type=float, default=None, metavar="MINUTES",
                   help="start trainings only in the first MINUTES of this run: the running ones finish and are "
                        "evaluated, then it stops with exit status 3 and the same command goes on (for a machine "
                        "that is only lent for a while)")
    p.add_argument("--smoke", action="store_true", help="a slice of the corpus and a few updates: every step, fast")
    known, _ = p.parse_known_args(argv)
    module = importlib.import_module(f"benchmarks.claims.{known.paper}") if known.paper in PAPERS else None
    if module is not None and hasattr(module, "options"):
        module.options(p)
    a = p.parse_args(argv)
    a.defaults = {act.dest: act.default for act in p._actions}  # for the command a report names
    if a.smoke:
        if a.workdir == os.path.join(ROOT, "work", "claims"):
            a.workdir = os.path.join(ROOT, "work", "claims-smoke")
        if hasattr(module, "smoke"):
            module.smoke(a)
    return a, module


def main(argv=None):
    args, module = parse_args(argv)
    ctx = Context(args)
    try:
        cls = getattr(module, CLASSES[args.paper])
        outcome = cls(ctx).run()
        if hasattr(module, "report"):
            module.report(ctx, outcome)
    except ClaimsPaused as e:
        ctx.say(f"paused: {e}")
        return 3
    except ClaimsError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    ctx.say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
