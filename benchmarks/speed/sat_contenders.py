"""The contenders of python -m benchmarks.speed.sat: the random-init models at the quickstart's size
(--random-init), their random sources, the trained models (corpus, teacher, distillation and students, trained
here), the CTranslate2 conversion of a fairseq transformer (anchor b), and :class:`Contender`, one decoder under
test with its generator or translator."""

import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# --random-init sizes: the quickstart transformer (Ding corpus) and a tiny one for the tests (--tiny)
RANDOM_SIZES = {
    "full": dict(dim=256, ffn=512, heads=4, layers=(3, 3), vocab=8000, src_mean=25, src_sd=6),
    "tiny": dict(dim=32, ffn=64, heads=2, layers=(2, 2), vocab=300, src_mean=8, src_sd=2),
}
DEEP_SHALLOW = (6, 1)  # encoder, decoder layers of anchors (c) and (d): 6 x 2/3 + 1 = 3 + 3 decoder-layer units



def build_random_models(args, workdir):
    """Transformer 3+3, SAT 3+3 per K, transformer 6+1 and SAT 6+1 per K, random weights (fairseq's
    initialisation, seeded), one joint dictionary; the two transformers are also saved as fairseq checkpoints
    (for the CTranslate2 converter). Returns (models by role, checkpoint paths by role, data dir, dictionary)."""
    import torch
    from fairseq import options, tasks

    import fairseq_ext  # noqa: F401  (registers sat_transformer)

    size = RANDOM_SIZES["tiny" if args.tiny else "full"]
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    n_words = size["vocab"] - 4  # + fairseq's 4 special symbols = the vocabulary size
    for lang in (args.source_lang, args.target_lang):
        with open(os.path.join(data, f"dict.{lang}.txt"), "w") as f:
            f.writelines(f"w{i} {n_words - i}\n" for i in range(n_words))

    def build(arch, layers, K=None):
        enc, dec = layers
        argv = [data, "--task", "translation", "-s", args.source_lang, "-t", args.target_lang, "--arch", arch,
                "--encoder-layers", str(enc), "--decoder-layers", str(dec),
                "--encoder-embed-dim", str(size["dim"]), "--decoder-embed-dim", str(size["dim"]),
                "--encoder-ffn-embed-dim", str(size["ffn"]), "--decoder-ffn-embed-dim", str(size["ffn"]),
                "--encoder-attention-heads", str(size["heads"]), "--decoder-attention-heads", str(size["heads"]),
                "--share-all-embeddings", "--dropout", "0", "--attention-dropout", "0", "--cpu"]
        if K is not None:
            argv += ["--sat-group-size", str(K)]
        cfg = options.parse_args_and_arch(options.get_training_parser(), argv)
        task = tasks.setup_task(cfg)
        torch.manual_seed(args.seed + 1000 * layers[1] + (K or 1))
        return task.build_model(cfg).eval(), cfg, task

    models, ckpts, task = {}, {}, None
    families = [("", size["layers"])] + ([] if args.no_deep_shallow else [("6+1 ", DEEP_SHALLOW)])
    for prefix, layers in families:
        m, cfg, task = build("transformer", layers)
        models[prefix + "K=1"] = m
        path = os.path.join(workdir, f"transformer-{layers[0]}-{layers[1]}.pt")
        torch.save({"args": cfg, "cfg": None, "model": m.state_dict()}, path)
        ckpts[prefix + "K=1"] = path
        for K in args.ks:
            models[f"{prefix}K={K}"] = build("sat_transformer", layers, K)[0]
    return models, ckpts, data, task


def random_sources(args, dictionary, n):
    """n random sources (token ids + EOS), lengths normal around the size's mean, as fairseq batches of one."""
    import torch

    size = RANDOM_SIZES["tiny" if args.tiny else "full"]
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    samples = []
    for i in range(n):
        L = min(max(int(round(rng.gauss(size["src_mean"], size["src_sd"]))), 5), 50)
        src = torch.randint(dictionary.nspecial, len(dictionary), (1, L + 1), generator=g)
        src[0, -1] = dictionary.eos()
        samples.append({"id": torch.tensor([i]), "nsentences": 1, "ntokens": L + 1,
                        "net_input": {"src_tokens": src, "src_lengths": torch.tensor([L + 1])}})
    return samples


# -- trained models ---------------------------------------------------------------------------------------------
# same sizes and optimisation as examples/quickstart/transformer.sh and sat_transformer.sh
MODEL_ARGS = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256",
              "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
              "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings",
              "--dropout", "0.2", "--attention-dropout", "0.1"]
OPT_ARGS = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.002", "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", "400", "--clip-norm", "0.0", "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--max-tokens", "4096", "--num-workers", "0", "--seed", "1",
            "--no-save-optimizer-state", "--log-format", "simple", "--log-interval", "100", "--no-epoch-checkpoints"]


def sh(cmd, stdout=None):
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, stdout=stdout)


def ensure_models(args):
    """Bundled corpus (joint 8k BPE), a transformer teacher, optional sequence-level KD, and one SAT student
    per K initialised from the teacher; every step is skipped when its output exists."""
    W, py = args.workdir, sys.executable
    data, bin_ = os.path.join(W, "data"), os.path.join(W, "bin-de-en")
    sh([py, os.path.join(ROOT, "tools", "prepare_bundled_corpus.py"), "--out", data, "--vocab-size", "8000"])
    if not os.path.isfile(os.path.join(bin_, ".done")):
        sh([py, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en",
            "--trainpref", f"{data}/train.spm", "--validpref", f"{data}/valid.spm", "--testpref", f"{data}/test.spm",
            "--destdir", bin_, "--joined-dictionary", "--workers", "2"], stdout=subprocess.DEVNULL)
        open(os.path.join(bin_, ".done"), "w").close()
    hours = str(args.minutes / 60)
    user_dir = os.path.join(ROOT, "fairseq_ext")
    teacher_dir = os.path.join(W, "checkpoints", "teacher")
    teacher = os.path.join(teacher_dir, "checkpoint_last.pt")
    if not os.path.isfile(os.path.join(teacher_dir, ".done")):
        sh([py, "-m", "fairseq_cli.train", bin_, "--user-dir", user_dir, "--task", "translation", "--arch",
            "transformer", "--save-dir", teacher_dir, "--stop-time-hours", hours] + MODEL_ARGS + OPT_ARGS)
        open(os.path.join(teacher_dir, ".done"), "w").close()
    student_bin = bin_
    if args.kd_beam > 0:
        kd, kd_bin = os.path.join(W, "kd"), os.path.join(W, "bin-de-en-kd")
        if not os.path.isfile(os.path.join(kd_bin, ".done")):
            os.makedirs(kd, exist_ok=True)
            with open(os.path.join(kd, "generate-train.txt"), "w") as f:
                sh([py, "-m", "fairseq_cli.generate", bin_, "--user-dir", user_dir, "--task", "translation_sat",
                    "--path", teacher, "--gen-subset", "train", "--beam", str(args.kd_beam), "--max-len-a", "1.2",
                    "--max-len-b", "10", "--batch-size", "256", "--num-workers", "0"], stdout=f)
            sh([py, "-m", "fairseq_ext.sat.distill", "--generate-output", f"{kd}/generate-train.txt",
                "--source", f"{data}/train.spm.de", "--out-prefix", f"{kd}/train", "--source-lang", "de",
                "--target-lang", "en"])
            sh([py, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en", "--trainpref",
                f"{kd}/train", "--validpref", f"{data}/valid.spm", "--testpref", f"{data}/test.spm", "--srcdict",
                f"{bin_}/dict.de.txt", "--tgtdict", f"{bin_}/dict.en.txt", "--destdir", kd_bin, "--workers", "2"],
               stdout=subprocess.DEVNULL)
            open(os.path.join(kd_bin, ".done"), "w").close()
        student_bin = kd_bin
    students = {}
    for K in args.ks:
        d = os.path.join(W, "checkpoints", f"sat-k{K}")
        if not os.path.isfile(os.path.join(d, ".done")):
            sh([py, "-m", "fairseq_cli.train", student_bin, "--user-dir", user_dir, "--task", "translation_sat",
                "--arch", "sat_transformer", "--sat-group-size", K, "--sat-init-from", teacher, "--save-dir", d,
                "--stop-time-hours", hours] + MODEL_ARGS + OPT_ARGS)
            open(os.path.join(d, ".done"), "w").close()
        students[K] = os.path.join(d, "checkpoint_last.pt")
    return teacher, students, bin_


# -- CTranslate2 -----------------------------------------------------------------------------------------------
def ct2_convert(checkpoint, data_dir, out_dir, args):
    """The fairseq transformer ``checkpoint`` as a CTranslate2 model directory (float32 weights; int8 is chosen
    when loading). Returns the directory, or None with the reason printed (ctranslate2 missing, unsupported)."""
    try:
        import ctranslate2  # noqa: F401
        from ctranslate2.converters import FairseqConverter
    except ImportError:
        print("CTranslate2 anchors skipped: ctranslate2 is not installed "
              "(pip install --no-deps ctranslate2==4.8.5)", flush=True)
        return None
    import torch

    from fairseq_ext import checkpoints

    try:  # the converter loads with weights_only=True: allow what fairseq checkpoints hold (as fairseq_ext does)
        with torch.serialization.safe_globals(checkpoints.SAFE_GLOBALS):
            FairseqConverter(checkpoint, data_dir, source_lang=args.source_lang, target_lang=args.target_lang
                             ).convert(out_dir, force=True)
    except Exception as e:  # an anchor, not the subject: report and go on
        print(f"CTranslate2 anchor skipped: converting {checkpoint} failed: {type(e).__name__}: {e}", flush=True)
        return None
    return out_dir


def ct2_contenders(checkpoint, data_dir, out_dir, args, task, label="CTranslate2 {}", types=("int8", "float32")):
    """The CTranslate2 conversion of ``checkpoint`` as one :class:`Contender` per compute type (``label`` formatted
    with the type), one inter-thread and ``args.threads`` intra-threads each; [] when it cannot be converted (the
    reason printed by :func:`ct2_convert`)."""
    out = ct2_convert(checkpoint, data_dir, out_dir, args)
    if out is None:
        return []
    import ctranslate2

    return [Contender(label.format(ct), 1, "ct2", dictionary=task.target_dictionary, src_dict=task.source_dictionary,
                      translator=ctranslate2.Translator(out, device="cpu", compute_type=ct, inter_threads=1,
                                                        intra_threads=args.threads))
            for ct in types]


class Contender:
    """One decoder of the benchmark. ``decode(sample, beam)`` -> (seconds, hypotheses as token-id lists with
    the final EOS, decoder calls or 0)."""

    def __init__(self, name, K, family, variant="float", model=None, make_gen=None, translator=None,
                 dictionary=None, src_dict=None, of=None):
        self.name, self.K, self.family, self.variant, self.model = name, K, family, variant, model
        self.make_gen, self.translator, self.dict, self.src_dict = make_gen, translator, dictionary, src_dict
        self.of = of  # the float contender this one is a variant of (agreement)
        self._gens = {}

    def decode(self, sample, beam, gen_opts):
        if self.translator is not None:
            return self._decode_ct2(sample, beam, gen_opts)
        import torch

        gen = self._gens.get(beam)
        if gen is None:
            gen = self._gens[beam] = self.make_gen(beam)
        t0 = time.perf_counter()
        with torch.no_grad():  # as fairseq-generate (task.inference_step)
            out = gen.generate([self.model], sample)
        dt = time.perf_counter() - t0
        return dt, [h[0]["tokens"].tolist() for h in out], getattr(gen, "decoder_calls", 0)

    def decoder_step(self, beam):
        """"lean" / "own" for our generator (its default lean step or the decoder's own), None for the others."""
        uses = getattr(self._gens.get(beam), "uses_lean_step", None)
        return None if uses is None else ("lean" if uses else "own")

    def _decode_ct2(self, sample, beam, gen_opts):
        src, lens = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"].tolist()
        pad = self.src_dict.pad()
        batch = []
        for row, n in zip(src.tolist(), lens):
            toks = [t for t in row if t != pad][: n - 1]  # without fairseq's EOS: the model adds it
            batch.append([self.src_dict[t] for t in toks])
        if "min_len" in gen_opts:  # N words + EOS: N+1 decoding steps, EOS only allowed (and taken) at the last
            lim = dict(min_decoding_length=gen_opts["min_len"], max_decoding_length=gen_opts["max_len_b"] + 1)
        else:  # fairseq's bound a * src_len + b on the batch's padded source length (EOS included)
            lim = dict(max_decoding_length=int(gen_opts["max_len_a"] * src.size(1) + gen_opts["max_len_b"]) + 1)
        t0 = time.perf_counter()
        res = self.translator.translate_batch(batch, beam_size=beam, return_end_token=True,
                                              max_batch_size=0, **lim)
        dt = time.perf_counter() - t0
        hyps = [[self.dict.index(t) for t in r.hypotheses[0]] for r in res]
        if "min_len" in gen_opts:  # CTranslate2 takes the N+1-th step but does not force EOS there (fairseq does)
            eos = self.dict.eos()
            hyps = [h[:-1] + [eos] if len(h) == gen_opts["min_len"] + 1 else h for h in hyps]
        return dt, hyps, 0


