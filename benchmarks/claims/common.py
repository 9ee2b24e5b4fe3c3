"""What the papers of python -m benchmarks.claims share: the Bible corpus prepared with the release's BPE and
dictionary, fairseq-train arguments of the quickstart-sized models, training to a valid plateau, evaluation jobs."""

import os
import random
import re
import shutil
import sys

from .jobs import ROOT, ClaimsError, Job, read_json, settings_hash

RELEASE_DE_EN = os.path.join(ROOT, "releases", "bible-de-en")
USER_DIR = os.path.join(ROOT, "fairseq_ext")
CORPUS_DIR = os.path.join(ROOT, "data", "bible-de-en")

# the quickstart's Bible transformer (examples/quickstart/transformer.sh): d 128, FFN 512, 4 heads, pre-norm, shared
# embeddings, no dropout, adam (0.9, 0.98), inverse_sqrt, label smoothing 0.1, 1,024 tokens a batch
def size_args(dim=128, ffn=None, heads=4, enc_layers=3, dec_layers=3):
    ffn = ffn or 4 * dim
    layers = [] if enc_layers is None else ["--encoder-layers", str(enc_layers)]
    return [*layers, "--decoder-layers", str(dec_layers), "--encoder-embed-dim", str(dim),
            "--decoder-embed-dim", str(dim), "--encoder-ffn-embed-dim", str(ffn), "--decoder-ffn-embed-dim", str(ffn),
            "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads)]


PRE_NORM = ["--encoder-normalize-before", "--decoder-normalize-before"]


def adam_args(lr, warmup=200, max_tokens=1024, dropout=0.0, clip=0.0, attention_dropout=True):
    att = ["--attention-dropout", str(dropout)] if attention_dropout else []
    return ["--share-all-embeddings", "--dropout", str(dropout), *att,
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", str(lr), "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", str(warmup), "--clip-norm", str(clip), "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--max-tokens", str(max_tokens)]


def plateau_args(max_update, interval=500, patience=3, keep=3, seed=1):
    """Validation (valid loss) every ``interval`` updates; training stops after ``patience`` validations without a
    new best (``patience=None``: never, every arm runs its ``max_update``), or at ``max_update``; the last ``keep``
    interval checkpoints are kept (averaged for evaluation)."""
    stop = [] if patience is None else ["--patience", str(patience)]
    return ["--max-update", str(max_update), "--validate-interval-updates", str(interval),
            "--save-interval-updates", str(interval), "--keep-interval-updates", str(keep),
            "--validate-interval", "100000", "--save-interval", "100000", "--no-epoch-checkpoints",
            *stop, "--best-checkpoint-metric", "loss", "--log-format", "json",
            "--log-interval", "50", "--num-workers", "0", "--seed", str(seed)]


def lr_pilots(S, grid, extend, add_pilot):
    """Learning rates from pilots by one rule for every arm: each arm's ``grid`` ({arm: [lr, ...]}, x2 apart), then,
    while an arm's best pilot is at an edge of what it tried, one more pilot x2 beyond that edge, at most ``extend``
    per arm, so that no arm's choice is an edge of its grid unless the extensions ran out. ``add_pilot(arm, lr)``
    adds a pilot's jobs (once) and returns the job whose result holds its ``bleu_valid_greedy``; ties go to the
    lower rate. Returns ({arm: chosen lr}, {(arm, lr): valid greedy BLEU} of every pilot)."""
    tried = {arm: sorted(lrs) for arm, lrs in grid.items()}
    for extension in range(extend + 1):
        names = {(arm, lr): add_pilot(arm, lr) for arm, lrs in tried.items() for lr in lrs}
        S.run_all(list(names.values()))
        scored = {key: S.result(n)["bleu_valid_greedy"] for key, n in names.items()}
        chosen = {arm: max(lrs, key=lambda lr, arm=arm: (scored[(arm, lr)], -lr)) for arm, lrs in tried.items()}
        edges = {arm: lr for arm, lr in chosen.items() if len(tried[arm]) > 1 and lr in (tried[arm][0],
                                                                                          tried[arm][-1])}
        if not edges or extension == extend:
            return chosen, scored
        for arm, lr in edges.items():
            tried[arm] = sorted(tried[arm] + [lr * 2 if lr == tried[arm][-1] else lr / 2])


def fixed_budget_args(max_update, interval=500, keep=3, seed=1):
    """Every arm trains exactly ``max_update`` updates (no early stopping: patience on valid loss against the real
    references stops a distilled student early), validated every ``interval`` updates for its curve; evaluated on
    the average of its last ``keep`` interval checkpoints."""
    return plateau_args(max_update, interval=interval, patience=None, keep=keep, seed=seed)


def flattened(curve, tail=0.2):
    """(relative valid-loss gain over the last ``tail`` of the updates, whether it is below 1%): the check that an
    arm trained past its early regime. ``curve``: [(updates, valid loss)]."""
    if len(curve) < 2:
        return None, False
    last_u = curve[-1][0]
    start = [loss for u, loss in curve if u <= (1 - tail) * last_u] or [curve[0][1]]
    start = start[-1]  # the last validation at or before the start of the tail
    gain = (start - curve[-1][1]) / start if start else 0.0
    return gain, gain < 0.01


def curve_cell(result):
    """A training result's :func:`flattened` as a table cell: "0.4%", "2.1% (still falling)" or "-"."""
    gain, flat = flattened(result.get("valid_curve", []))
    return "-" if gain is None else f"{100 * gain:.1f}%" + ("" if flat else " (still falling)")


def still_falling(named, sep=", ", end="."):
    """The sentence naming the trainings of ``named`` ([(label, result)]) whose valid loss still fell by 1% or more
    over the last 20% of their updates, closed by ``end``; "" when none did."""
    labels = [label for label, result in named if not flattened(result.get("valid_curve", []))[1]]
    return ("Still falling in the last 20% of their updates (>= 1% valid loss): " + sep.join(labels) + end
            if labels else "")


def json_records(log, kind):
    import json

    out = []
    if not os.path.exists(log):
        return out
    pat = re.compile(r"\| INFO \| (\S+) \| (\{.*\})\s*$")
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = pat.search(line)
            if m and m.group(1) == kind:
                try:
                    out.append(json.loads(m.group(2)))
                except ValueError:
                    pass
    return out


_LINE = re.compile(r"^(?:(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) )?\| INFO \| (\S+) \| (.*?)\s*$")


def update_walls(log):
    """[(updates, wall seconds of training so far)] from a training log: fairseq's ``wall`` of each record, added up
    over the processes of a training that was cut and resumed. A resumed process logs ``wall`` 0 throughout
    (fairseq restores the wall stopwatch from the checkpoint without starting it), so its records take the time
    since that process logged its configuration instead."""
    import json
    from datetime import datetime

    if not os.path.exists(log):
        return []
    kind, key = ("train_inner", "") if json_records(log, "train_inner") else ("train", "train_")
    recs, start, proc = [], None, 0  # (updates, wall, process)
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _LINE.match(line)
            if not m:
                continue
            when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() if m.group(1) else None
            if m.group(2) == "fairseq_cli.train" and m.group(3).startswith("{'_name'"):
                start, proc = when, proc + 1  # a process begins: it logs its configuration
            elif m.group(2) == kind and m.group(3).startswith("{"):
                try:
                    r = json.loads(m.group(3))
                    updates, wall = int(float(r[f"{key}num_updates"])), float(r[f"{key}wall"])
                except (ValueError, KeyError):
                    continue
                if wall == 0 and start is not None and when is not None and updates > 0:
                    wall = when - start
                recs.append((updates, wall, proc))
    out, offset, last, last_proc = [], 0.0, 0.0, None
    for updates, wall, p in recs:
        if last_proc is not None and (p != last_proc or wall < last):  # a new process
            offset += last
        last, last_proc = wall, p
        out.append((updates, offset + wall))
    return out


def train_summary(log):
    """Updates, tokens/s (median), the valid-loss curve [(updates, loss)] and the best valid loss of a training log
    (``--log-format json``)."""
    inner = json_records(log, "train_inner")
    if not inner:  # fewer updates than --log-interval: the epoch records
        inner = [{k[6:]: v for k, v in r.items() if k.startswith("train_")} for r in json_records(log, "train")]
    valid = json_records(log, "valid")
    if not inner:
        raise ClaimsError(f"{log}: no training records")
    wps = sorted(float(r["wps"]) for r in inner[1:] or inner)
    curve = [(int(float(r["valid_num_updates"])), float(r["valid_loss"])) for r in valid if "valid_num_updates" in r]
    walls = update_walls(log)
    return {"updates": int(float(inner[-1]["num_updates"])), "train_tokens_per_s": wps[len(wps) // 2],
            "train_minutes": round(walls[-1][1] / 60, 1) if walls else None,
            "train_loss_last": float(inner[-1]["loss"]), "valid_curve": curve,
            "valid_loss_best": min((loss for _, loss in curve), default=None),
            "train_curve": [(int(float(r["num_updates"])), float(r["loss"])) for r in inner]}


class Corpus:
    """The bundled Bible corpus encoded with the release's sentencepiece model and binarised with its joined
    dictionary (so that the release transformer reads it), in WORKDIR/data and WORKDIR/bin-de-en."""

    def __init__(self, sched, smoke=False):
        self.S = sched
        self.data = os.path.join(sched.W, "data")
        self.bin = os.path.join(sched.W, "bin-de-en")
        self.smoke = smoke

    def refs(self, tgt="en"):
        return {s: [os.path.join(self.data, f"{s}.{tgt}")] for s in ("valid", "test")}

    def job(self, name="data"):
        def run(job, S):
            src_corpus = "bible"
            if self.smoke:
                src_corpus = self.smoke_corpus()
            S.sh([sys.executable, os.path.join(ROOT, "tools", "prepare_bundled_corpus.py"),
                  "--corpus", src_corpus, "--out", self.data, "--spm-model",
                  os.path.join(RELEASE_DE_EN, "spm.model")], S.log(name), what="corpus preparation")
            done = os.path.join(self.bin, ".done")
            if not os.path.exists(done):
                shutil.rmtree(self.bin, ignore_errors=True)
                self._binarise(S, f"{self.data}/train.spm", self.bin, S.log(name))
                open(done, "w").close()
            with open(os.path.join(self.data, "train.de"), encoding="utf-8") as f:
                n = sum(1 for _ in f)
            return {"train_lines": n, "summary": f"{n} training verses"}

        return Job(name, run, {"corpus": "bible", "spm": "release", "smoke": self.smoke}, what="the Bible corpus "
                   "with the release's BPE and dictionary")

    def _binarise(self, S, trainpref, destdir, log):
        """fairseq-preprocess of ``trainpref`` with the full valid and test sets into ``destdir``, with the release's
        joined dictionary."""
        S.fairseq("preprocess", ["--source-lang", "de", "--target-lang", "en", "--trainpref", trainpref,
                                 "--validpref", f"{self.data}/valid.spm", "--testpref", f"{self.data}/test.spm",
                                 "--destdir", destdir, "--joined-dictionary", "--srcdict",
                                 os.path.join(RELEASE_DE_EN, "dict.txt"), "--workers", "1"], log, threads=1)

    def subset_bin(self, n):
        """WORKDIR/bin-de-en-N: :meth:`subset_job`'s ``n`` training verses, binarised."""
        return os.path.join(self.S.W, f"bin-de-en-{n}")

    def subset_job(self, n, name, text_dir):
        """The first ``n`` training verses of one shuffled order (seed 1, so that a smaller set lies inside a larger
        one) as sentencepiece text in WORKDIR/``text_dir``, binarised with the release's dictionary into
        :meth:`subset_bin` beside the full valid and test sets."""

        def run(job, S):
            out = S.dir(text_dir)
            bin_dir = self.subset_bin(n)
            text = {}
            for lang in ("de", "en"):
                with open(os.path.join(self.data, f"train.spm.{lang}"), encoding="utf-8") as f:
                    text[lang] = f.readlines()
            order = list(range(len(text["de"])))
            random.Random(1).shuffle(order)
            keep = sorted(order[:n])
            for lang in ("de", "en"):
                with open(os.path.join(out, f"train.spm.{lang}"), "w", encoding="utf-8") as f:
                    f.writelines(text[lang][i] for i in keep)
            shutil.rmtree(bin_dir, ignore_errors=True)
            self._binarise(S, f"{out}/train.spm", bin_dir, S.log(name))
            return {"verses": len(keep), "summary": f"{len(keep)} of {len(order)} training verses"}

        return Job(name, run, {"n": n, "seed": 1}, ["data"], what=f"{n} training verses, binarised")

    def smoke_corpus(self):
        """A slice of the corpus (short verses) for --smoke."""
        import gzip

        out = os.path.join(self.S.W, "smoke-corpus")
        os.makedirs(out, exist_ok=True)
        for split, n in (("train", 400), ("valid", 20), ("test", 20)):
            text = {}
            for lang in ("de", "en"):
                with gzip.open(os.path.join(CORPUS_DIR, f"{split}.{lang}.gz"), "rt", encoding="utf-8") as f:
                    text[lang] = f.readlines()
            keep = [i for i in range(len(text["de"])) if max(len(text["de"][i].split()),
                                                            len(text["en"][i].split())) <= 12][:n]
            for lang in ("de", "en"):
                with gzip.open(os.path.join(out, f"{split}.{lang}.gz"), "wt", encoding="utf-8") as g:
                    g.writelines(text[lang][i] for i in keep)
        return out


class SubsetCorpus:
    """What eval_job needs of a corpus: a training subset's binarised data (valid and test are the full ones) and
    the references."""

    def __init__(self, corpus, bin_dir):
        self.corpus, self.bin, self.data = corpus, bin_dir, corpus.data

    def refs(self, tgt="en"):
        return self.corpus.refs(tgt)


def train_job(name, S, bin_dir, argv, deps, settings, threads=1, what=""):
    """fairseq-train into WORKDIR/checkpoints/NAME (resumed from its checkpoint_last.pt when a run of the same
    settings was cut, or when only ``--max-update`` grew: the training goes on to the new budget, the same run as
    one trained to it from the start, since no schedule here reads the budget; started afresh when anything else
    changed), then the average of its last interval checkpoints (checkpoint_avg.pt). Result: the training
    summary."""

    def run(job, S):
        ck = S.dir("checkpoints", name)
        log = S.log(name, "train.log")
        _fresh_if_changed(S.job_hash(name), ck, [log, S.log(name, "average.log")], _shorter_budget_hash(S, job, log))
        cpu = S.fairseq("train", [bin_dir, "--user-dir", USER_DIR, "--save-dir", ck, *argv], log, threads)
        avg = S.worker("average", {"ckpt_dir": ck, "output": os.path.join(ck, "checkpoint_avg.pt")},
                       S.log(name, "average.log"))
        summ = train_summary(log)
        seed = argv[argv.index("--seed") + 1] if "--seed" in argv else None
        return {**summ, "cpu_minutes": round(cpu / 60, 1), "checkpoint": os.path.join(ck, "checkpoint_avg.pt"),
                "seed": seed,
                "averaged": avg["averaged"], "summary": f"{summ['updates']} updates, best valid loss "
                f"{summ['valid_loss_best']}"}

    return Job(name, run, {"argv": argv, "bin": os.path.basename(bin_dir), **settings}, deps, threads,
               what=what or f"fairseq-train {name}", training=True)


def _shorter_budget_hash(S, job, log):
    """The hash ``job`` would have with the smaller ``--max-update`` of the last training its log records (None:
    no such training): the settings of a directory whose training may go on to the new budget."""
    argv = job.settings["argv"]
    if "--max-update" not in argv or not os.path.exists(log):
        return None
    i = argv.index("--max-update") + 1
    before = None
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            words = line.split()
            if words[:1] == ["$"] and "--max-update" in words[:-1]:
                before = words[words.index("--max-update") + 1]
    if before is None or not before.isdigit() or int(before) >= int(argv[i]):
        return None
    return settings_hash({"settings": {**job.settings, "argv": [*argv[:i], before, *argv[i + 1:]]},
                          "deps": [S.job_hash(d) for d in job.deps]})


def _fresh_if_changed(settings_hash, ck, logs, extends=None):
    """A training directory keeps the hash of the settings its checkpoints were trained with (``.settings``); when
    they changed (but to the settings ``extends`` named, the same training with a larger budget), or a directory
    has checkpoints and no such file (nothing says which settings made them), its checkpoints and logs are removed
    so that fairseq does not resume another training."""
    stamp = os.path.join(ck, ".settings")
    try:
        with open(stamp, encoding="utf-8") as f:
            old = f.read().strip()
    except FileNotFoundError:
        old = None
    if old == settings_hash:
        return
    if old is None or old != extends:
        for f in os.listdir(ck):
            if f.endswith(".pt"):
                os.remove(os.path.join(ck, f))
        for f in logs:
            if os.path.exists(f):
                os.remove(f)
    with open(stamp + ".tmp", "w", encoding="utf-8") as f:
        f.write(settings_hash + "\n")
    os.replace(stamp + ".tmp", stamp)


def eval_job(name, S, ckpt_of, corpus, decodes, deps, task=None, settings=None, threads=1, src="de", tgt="en"):
    """sacreBLEU of a checkpoint (``ckpt_of(S)`` gives its path once the deps ran) for each (split, beam)."""

    def run(job, S):
        res = S.worker("evaluate", {"ckpt": ckpt_of(S), "bin_dir": corpus.bin, "src": src, "tgt": tgt,
                                    "refs": corpus.refs(tgt), "decodes": decodes,
                                    "out_dir": S.dir("hyps", name), "task": task}, S.log(name), threads)
        keys = [k for k in res if k.startswith("bleu_") and not k.endswith(("_signature", "_seconds"))]
        return {**res, "hyps_dir": os.path.join(S.W, "hyps", name),
                "summary": ", ".join(f"{k[5:]} {res[k]:.2f}" for k in keys)}

    return Job(name, run, {"decodes": decodes, "task": task, **(settings or {})}, deps, threads,
               what=f"sacreBLEU of {name}")


def trained(S, name):
    """A training job's result with its summary read again from its log (so that a resumed training counts the
    minutes of every process that trained it); as recorded when the training ran again only to make its files
    (its log is of that run)."""
    log, res = S.log(name, "train.log"), S.result(name)
    return {**res, **(train_summary(log) if os.path.exists(log) and "remade" not in res else {})}


def result_or_none(path):
    return read_json(path)
