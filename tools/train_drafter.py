"""Train a SAT drafter for lossless speculative decoding (``--sat-draft-path``) of a release transformer, and pack it.

    python tools/train_drafter.py --verifier releases/bible-de-en/transformer.pt --k 2 --decoder-layers 3 \\
        --freeze-encoder --init-decoder --max-update 2000 --workdir work/drafter [--pack NAME] [--smoke]

Steps (each skipped when its output exists in --workdir):

1. data: the bundled corpus (--corpus, default bible) encoded with the release's sentencepiece model and binarised
   with its joined dictionary (tools/prepare_bundled_corpus.py, fairseq-preprocess), or --data-bin BIN;
2. greedy sequence-level distillation: the verifier translates the training set with the decoding the drafter
   will be checked against (fairseq-generate --task translation_sat --beam 1), and the drafter learns those
   translations (python -m fairseq_ext.sat.distill; valid and test stay the corpus's);
3. the drafter: fairseq-train --arch sat_transformer --sat-group-size K with the verifier's sizes (its encoder
   layers, --decoder-layers of them), initialised from the verifier (--sat-init-from; --init-decoder: the
   decoder layers too; --freeze-encoder: the encoder stays the verifier's, so that decoding shares its output),
   the quickstart's optimiser settings, one thread; the last 3 save points averaged;
4. the acceptance: mean accepted drafts per verifier call on the first --eval-sentences valid sentences, and
   that the output equals the verifier's greedy output; the drafter's own greedy valid BLEU (sacreBLEU);
5. with --pack NAME: ``python -m fairseq_ext.release pack`` into the verifier's release directory as NAME.pt,
   MANIFEST.json recording the command, updates, threads, wall and CPU time, the code commit and the acceptance.

--smoke: 1/50 of the training set distilled, 20 updates, 20 valid sentences (a check of every step).
"""

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools.prepare_bundled_corpus import resolve_corpus  # noqa: E402

# the quickstart's optimiser for the Bible models (examples/quickstart/transformer.sh; the SAT release's 0.003)
OPTIM = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr-scheduler", "inverse_sqrt",
         "--warmup-updates", "200", "--clip-norm", "0.0", "--criterion", "label_smoothed_cross_entropy",
         "--label-smoothing", "0.1", "--max-tokens", "1024", "--dropout", "0.0", "--attention-dropout", "0.0"]
SIZES = ["encoder_layers", "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim",
         "decoder_ffn_embed_dim", "encoder_attention_heads", "decoder_attention_heads"]
FLAGS = ["encoder_normalize_before", "decoder_normalize_before", "share_all_embeddings",
         "share_decoder_input_output_embed", "encoder_learned_pos", "decoder_learned_pos", "no_scale_embedding",
         "layernorm_embedding"]


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd, log, env):
    """cmd with its output appended to log; stop with the log's tail on failure."""
    with open(log, "a", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode != 0:
        with open(log, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-2000:]
        raise SystemExit(f"train_drafter: {' '.join(cmd[:3])} failed; see {log}\n{tail}")


def fairseq(tool, args, log, env):
    run([sys.executable, "-m", f"fairseq_cli.{tool}", *args], log, env)


def verifier_args(path):
    """The verifier's model options as fairseq-train flags (the drafter's sizes), and its source/target langs."""
    import fairseq_ext  # noqa: F401  (the safe loader)
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    model = state["cfg"]["model"]
    get = (lambda k: model.get(k)) if hasattr(model, "get") else (lambda k: getattr(model, k, None))
    out = []
    for k in SIZES:
        if get(k) is not None:
            out += ["--" + k.replace("_", "-"), str(get(k))]
    out += ["--" + k.replace("_", "-") for k in FLAGS if get(k)]
    task = state["cfg"]["task"]
    return out, task.get("source_lang") or "de", task.get("target_lang") or "en"


def prepare_data(args, work, src, tgt, env, log):
    """The binarised corpus with the release's BPE and dictionary (step 1)."""
    if args.data_bin:
        return args.data_bin
    release = os.path.dirname(os.path.abspath(args.verifier))
    data, bin_dir = os.path.join(work, "data"), os.path.join(work, "bin")
    corpus = resolve_corpus(args.corpus)
    run([sys.executable, os.path.join(ROOT, "tools", "prepare_bundled_corpus.py"), "--corpus", corpus, "--out", data,
         "--spm-model", os.path.join(release, "spm.model")], log, env)
    if not os.path.exists(os.path.join(bin_dir, ".done")):
        shutil.rmtree(bin_dir, ignore_errors=True)
        fairseq("preprocess", ["--source-lang", src, "--target-lang", tgt, "--trainpref", f"{data}/train.spm",
                               "--validpref", f"{data}/valid.spm", "--testpref", f"{data}/test.spm",
                               "--destdir", bin_dir, "--joined-dictionary", "--srcdict",
                               os.path.join(release, "dict.txt"), "--workers", "1"], log, env)
        open(os.path.join(bin_dir, ".done"), "w").close()
    return bin_dir


def distil(args, work, bin_dir, src, tgt, env, log):
    """The verifier's greedy translations of the training set, binarised beside the corpus's valid/test (step 2)."""
    kd, kd_bin = os.path.join(work, "kd"), os.path.join(work, "bin-kd")
    if os.path.exists(os.path.join(kd_bin, ".done")):
        return kd_bin
    os.makedirs(kd, exist_ok=True)
    out = os.path.join(kd, "generate-train.txt")
    done = os.path.isfile(out) and "Generate train with beam=1" in open(out, encoding="utf-8", errors="replace").read()
    gen = [bin_dir, "--user-dir", os.path.join(ROOT, "fairseq_ext"), "--task", "translation_sat", "--source-lang", src,
           "--target-lang", tgt, "--path", args.verifier, "--gen-subset", "train", "--beam", "1",
           "--max-len-a", "1.2", "--max-len-b", "10", "--batch-size", "128", "--num-workers", "0",
           "--results-path", kd]
    if args.smoke:  # 1/50 of the training set (fairseq shards by the distributed rank)
        gen += ["--distributed-world-size", "50", "--distributed-rank", "0"]
    if not done:
        fairseq("generate", gen, log, env)
    # the source side of the training set as text: the binarised corpus, read back
    source = os.path.join(kd, f"train.source.{src}")
    run([sys.executable, "-c", "import sys; from fairseq.data import Dictionary, data_utils; "
         "d = Dictionary.load(sys.argv[2]); ds = data_utils.load_indexed_dataset(sys.argv[1], d); "
         "open(sys.argv[3], 'w', encoding='utf-8').writelines(d.string(ds[i]) + '\\n' for i in range(len(ds)))",
         os.path.join(bin_dir, f"train.{src}-{tgt}.{src}"), os.path.join(bin_dir, f"dict.{src}.txt"), source],
        log, env)
    run([sys.executable, "-m", "fairseq_ext.sat.distill", "--generate-output", os.path.join(kd, "generate-train.txt"),
         "--source", source, "--out-prefix", os.path.join(kd, "train"), "--source-lang", src, "--target-lang", tgt],
        log, env)
    shutil.rmtree(kd_bin, ignore_errors=True)
    fairseq("preprocess", ["--source-lang", src, "--target-lang", tgt, "--trainpref", os.path.join(kd, "train"),
                           "--destdir", kd_bin, "--srcdict", os.path.join(bin_dir, f"dict.{src}.txt"),
                           "--tgtdict", os.path.join(bin_dir, f"dict.{tgt}.txt"), "--workers", "1"], log, env)
    for split in ("valid", "test"):  # the corpus's own, binarised with the same dictionary
        for lang in (src, tgt):
            for ext in ("bin", "idx"):
                name = f"{split}.{src}-{tgt}.{lang}.{ext}"
                shutil.copyfile(os.path.join(bin_dir, name), os.path.join(kd_bin, name))
    open(os.path.join(kd_bin, ".done"), "w").close()
    return kd_bin


def train(args, work, kd_bin, src, tgt, sizes, env, log):
    """fairseq-train the drafter and average its last save points (step 3); returns (checkpoint, updates)."""
    ck = os.path.join(work, "checkpoints")
    avg = os.path.join(ck, "checkpoint_avg.pt")
    updates = 20 if args.smoke else args.max_update
    every = max(1, updates // 10)
    if not os.path.exists(avg):
        fairseq("train", [kd_bin, "--user-dir", os.path.join(ROOT, "fairseq_ext"), "--task", "translation_sat",
                          "--arch", "sat_transformer", "--source-lang", src, "--target-lang", tgt,
                          "--sat-group-size", str(args.k), "--decoder-layers", str(args.decoder_layers), *sizes,
                          "--sat-init-from", args.verifier, *(["--sat-init-decoder"] if args.init_decoder else []),
                          *(["--sat-freeze-encoder"] if args.freeze_encoder else []), *OPTIM, "--lr", str(args.lr),
                          "--max-update", str(updates), "--save-dir", ck, "--save-interval-updates", str(every),
                          "--keep-interval-updates", "3", "--validate-after-updates", str(updates - 3 * every),
                          "--no-epoch-checkpoints", "--no-save-optimizer-state", "--log-format", "json",
                          "--log-interval", "50", "--num-workers", "0", "--seed", "1", "--cpu"], log, env)
        run([sys.executable, "-m", "fairseq_ext.average_checkpoints", "--inputs", ck, "--num-update-checkpoints",
             "3", "--output", avg], log, env)
    return avg, updates


def acceptance(args, kd_bin, avg, src, tgt):
    """Speculative decoding of the first valid sentences at batch 1 (step 4): accepted drafts per verifier call and
    whether every output equals the verifier's own greedy output."""
    import torch

    import fairseq_ext  # noqa: F401
    from fairseq import checkpoint_utils, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_ext.sat.generator import SATSequenceGenerator
    from fairseq_ext.sat.speculative import SpeculativeSATGenerator, load_drafter

    torch.set_num_threads(1)
    ns = options.parse_args_and_arch(options.get_generation_parser(), [
        kd_bin, "--user-dir", os.path.join(ROOT, "fairseq_ext"), "--task", "translation_sat", "--source-lang", src,
        "--target-lang", tgt])
    task = tasks.setup_task(convert_namespace_to_omegaconf(ns).task)
    task.load_dataset("valid")
    ds = task.dataset("valid")
    verifier = checkpoint_utils.load_model_ensemble([args.verifier], task=task)[0][0].eval()
    drafter = load_drafter(avg, task, verifier)
    opts = dict(beam_size=1, max_len_a=1.2, max_len_b=10)
    ref = SATSequenceGenerator([verifier], task.target_dictionary, **opts)
    spec = SpeculativeSATGenerator([verifier], drafter, task.target_dictionary, **opts)
    n = min(len(ds), 20 if args.smoke else args.eval_sentences)
    same = 0
    for i in range(n):
        sample = ds.collater([ds[i]])
        a, b = ref.generate([verifier], sample), spec.generate([verifier], sample)
        same += int(torch.equal(a[0][0]["tokens"], b[0][0]["tokens"]))
    st = spec.stats
    out = {"valid_sentences": n, "identical": same,
           "accepted_per_call": round(st["accepted"] / st["verifier_calls"], 3),
           "words_per_call": round((st["accepted"] + st["verifier_calls"]) / st["verifier_calls"], 3),
           "fallbacks": st["fallbacks"], "shares_encoder": spec.shares_encoder}
    out.update(drafter_bleu(args, ds, drafter, task.target_dictionary, tgt, opts))
    return out


def drafter_bleu(args, ds, drafter, tgt_dict, tgt, opts):
    """The drafter's own greedy translation of the valid set (batch 64), scored by sacreBLEU against the corpus's
    references (data/CORPUS/valid.TGT.gz): what the drafter is worth alone."""
    import gzip

    import sacrebleu
    from fairseq_ext.sat.generator import SATSequenceGenerator

    refs_path = os.path.join(resolve_corpus(args.corpus), f"valid.{tgt}.gz")
    if not os.path.isfile(refs_path):
        return {}
    with gzip.open(refs_path, "rt", encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    gen = SATSequenceGenerator([drafter], tgt_dict, **opts)
    n = min(len(ds), 64 if args.smoke else len(ds))
    hyps = {}
    for first in range(0, n, 64):
        sample = ds.collater([ds[i] for i in range(first, min(first + 64, n))])
        for sid, h in zip(sample["id"].tolist(), gen.generate([drafter], sample)):
            hyps[sid] = tgt_dict.string(h[0]["tokens"], "sentencepiece")
    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score([hyps[i] for i in range(n)], [refs[:n]])
    return {"valid_bleu": round(score.score, 2), "valid_signature": str(bleu.get_signature())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default=os.path.join(ROOT, "releases", "bible-de-en", "transformer.pt"))
    p.add_argument("--k", type=int, default=2, help="the drafter's group size K (words drafted per call)")
    p.add_argument("--decoder-layers", type=int, default=3)
    p.add_argument("--init-decoder", action="store_true", help="initialise the decoder layers from the verifier's")
    p.add_argument("--freeze-encoder", action="store_true", help="keep the verifier's encoder (shared at decoding)")
    p.add_argument("--max-update", type=int, default=2000)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--corpus", default="bible")
    p.add_argument("--data-bin", help="a binarised corpus with the verifier's dictionary (skips step 1)")
    p.add_argument("--workdir", default=os.path.join(ROOT, "work", "drafter"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-sentences", type=int, default=300)
    p.add_argument("--pack", metavar="NAME", help="pack into the verifier's release directory as NAME.pt")
    p.add_argument("--smoke", action="store_true", help="1/50 of the data distilled, 20 updates (checks every step)")
    args = p.parse_args(argv)
    args.verifier = os.path.abspath(args.verifier)
    work = os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)
    log = os.path.join(work, "train_drafter.log")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    wall0, cpu0 = time.time(), cpu_seconds()
    sizes, src, tgt = verifier_args(args.verifier)
    bin_dir = prepare_data(args, work, src, tgt, env, log)
    kd_bin = distil(args, work, bin_dir, src, tgt, env, log)
    avg, updates = train(args, work, kd_bin, src, tgt, sizes, env, log)
    wall, cpu = time.time() - wall0, cpu_seconds() - cpu0
    acc = acceptance(args, kd_bin, avg, src, tgt)
    print(f"train_drafter: K={args.k}, {args.decoder_layers} decoder layer(s), {updates} updates: "
          f"{acc['accepted_per_call']} accepted drafts per verifier call on {acc['valid_sentences']} valid sentences "
          f"({acc['identical']} identical to the verifier's greedy output); the drafter alone: valid BLEU "
          f"{acc.get('valid_bleu')}; {avg}", flush=True)
    if args.pack:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        commit += " with uncommitted changes" if dirty else ""
        release = os.path.dirname(args.verifier)
        meta = {"arch": "sat_transformer", "name": args.pack, "role": "speculative drafter (--sat-draft-path)",
                "verifier": os.path.basename(args.verifier), "sat_group_size": args.k,
                "command": "python tools/train_drafter.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "updates_trained": updates, "threads": args.threads, "code_commit": commit,
                "valid_bleu": acc.pop("valid_bleu", None), "valid_signature": acc.pop("valid_signature", None),
                "wall_seconds": round(wall), "cpu_seconds": round(cpu),
                "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}", "valid_acceptance": acc,
                "summary": f"SAT drafter K={args.k} ({args.decoder_layers} decoder "
                           f"layer{'s' if args.decoder_layers != 1 else ''}) distilled greedily from "
                           f"and initialised by {os.path.basename(args.verifier)}, {updates} updates on "
                           f"{args.threads} thread(s) by tools/train_drafter.py; {acc['accepted_per_call']} accepted "
                           f"drafts per verifier call on valid"}
        meta_path = os.path.join(work, "release-meta.json")
        with open(meta_path, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        run([sys.executable, "-m", "fairseq_ext.release", "pack", "--checkpoint", avg, "--name", args.pack,
             "--release-dir", release, "--dict", os.path.join(release, "dict.txt"), "--spm-model",
             os.path.join(release, "spm.model"), "--meta", meta_path], log, env)
        print(f"train_drafter: packed {os.path.join(release, args.pack + '.pt')}")


if __name__ == "__main__":
    sys.exit(main())
