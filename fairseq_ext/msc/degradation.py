"""The degradation experiment of Wei et al. (2020), Figure 2: plain and MSC nets of growing depth, compared
by their BLEU on a random sample of the *training* set (a plain deep net that scores lower on its own
training data than a shallower one is degraded, not over-fitted).

For every depth L in ``--depths`` (multiples of ``--blocks``) it trains, with fairseq-train and the same
settings and number of updates,

* ``plain``: ``msc_transformer --no-contextual-collaboration --no-block-scale-collaboration`` with L
  encoder layers (the plain pre-norm Transformer: N decoder layers attend to the top of an L-layer stack);
* ``msc``: ``msc_transformer`` with N blocks of L/N layers;

then decodes ``--sample`` training pairs drawn with a fixed seed (the paper: 3K) and the valid set, and
reports corpus BLEU (sacreBLEU on the subword-merged text), the final training loss and the parameter count.
At small size on CPU (the defaults: d 64, 6 blocks, depths 6/18/36, 200 updates) it takes minutes; for the
paper's setting use ``--embed-dim 256 --ffn-dim 512 --heads 4 --depths 36,72 --updates 15000 --sample 3000``
on a GPU.

    python -m fairseq_ext.msc.degradation BIN --src de --tgt en --workdir DIR \
        [--depths 6,18,36] [--updates 200] [--sample 300] [--plot fig2.png] [--dry-run]

Writes ``DIR/degradation.json`` and prints a table.
"""

import argparse
import json
import logging
import os
import random
import re
import shlex
import subprocess
import sys

from fairseq_ext.common.errors import FairseqExtError, command


def train_command(args, variant, depth, save_dir):
    n = args.blocks
    cmd = [sys.executable, "-m", "fairseq_cli.train", args.data, "--user-dir", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "--task", "translation", "--source-lang", args.src, "--target-lang", args.tgt,
        "--arch", "msc_transformer", "--encoder-blocks", str(n), "--encoder-layers-per-block", str(depth // n),
        "--encoder-embed-dim", str(args.embed_dim), "--decoder-embed-dim", str(args.embed_dim),
        "--encoder-ffn-embed-dim", str(args.ffn_dim), "--decoder-ffn-embed-dim", str(args.ffn_dim),
        "--encoder-attention-heads", str(args.heads), "--decoder-attention-heads", str(args.heads),
        "--share-all-embeddings", "--dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", str(args.lr), "--lr-scheduler",
        "inverse_sqrt", "--warmup-updates", str(args.warmup), "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--max-tokens", str(args.max_tokens), "--max-update", str(args.updates),
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--no-save-optimizer-state", "--log-format", "json",
        "--log-interval", "10", "--num-workers", "0", "--seed", str(args.seed), "--disable-validation"]
    if variant == "plain":
        cmd += ["--no-contextual-collaboration", "--no-block-scale-collaboration"]
    if args.cpu:
        cmd.append("--cpu")
    return cmd


def sample_bleu(checkpoint, args, subset, sample, seed):
    """Corpus BLEU of beam search on `sample` random pairs of `subset` (all when sample <= 0)."""
    import sacrebleu
    import torch
    from fairseq import checkpoint_utils, utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [checkpoint], arg_overrides={"data": args.data})
    model = models[0].eval()
    if not args.cpu and torch.cuda.is_available():
        model = model.cuda()
    task.load_dataset(subset)
    ds = task.dataset(subset)
    idx = list(range(len(ds)))
    if 0 < sample < len(idx):
        idx = sorted(random.Random(seed).sample(idx, sample))
    gen_args = argparse.Namespace(beam=args.beam, lenpen=1.0, max_len_a=1.2, max_len_b=10, min_len=1,
                                  unnormalized=False, sampling=False, temperature=1.0)
    generator = task.build_generator([model], gen_args)
    tgt_dict = task.target_dictionary
    hyps, refs = [], []
    for start in range(0, len(idx), args.batch_size):
        batch = ds.collater([ds[i] for i in idx[start: start + args.batch_size]])
        batch = utils.move_to_cuda(batch) if next(model.parameters()).is_cuda else batch
        with torch.no_grad():
            out = task.inference_step(generator, [model], batch)
        for j, sid in enumerate(batch["id"].tolist()):
            hyps.append(tgt_dict.string(out[j][0]["tokens"], bpe_symbol=args.remove_bpe))
            refs.append(tgt_dict.string(ds[sid]["target"], bpe_symbol=args.remove_bpe))
    return sacrebleu.corpus_bleu(hyps, [refs]).score, len(hyps)


def last_train_loss(log):
    loss = None
    for line in log.splitlines():
        i = line.find("{")
        if i >= 0 and '"loss"' in line:
            try:
                loss = float(json.loads(line[i:])["loss"])
            except (ValueError, KeyError):
                pass
    return loss


def _write_and_plot(args, results, variants):
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "degradation.json"), "w") as f:
        json.dump(dict(settings=vars(args), results=results), f, indent=1)
    print(f"\n| variant | depth | params | final train loss | train BLEU ({args.sample} pairs) | valid BLEU |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['depth']} | {r['params']} | {r['train_loss']} | {r['train_bleu']} | "
              f"{r['valid_bleu']} |")
    if args.plot:
        plot(results, variants, args.plot)


def score_checkpoints(args):
    """--checkpoints: the scoring and figure of a degradation run for models trained elsewhere."""
    results, variants = [], []
    for item in args.checkpoints.split(","):
        name, _, path = item.partition("=")
        m = re.fullmatch(r"([A-Za-z_-]+?)(\d+)", name.strip())
        if not m or not path:
            raise FairseqExtError(f"--checkpoints: {item!r} is not VARIANTDEPTH=PATH (e.g. pre24=checkpoint.pt)")
        if not os.path.isfile(path):
            raise FairseqExtError(f"--checkpoints: {path}: no such file")
        variant, depth = m.group(1), int(m.group(2))
        if variant not in variants:
            variants.append(variant)
        train_bleu, n = sample_bleu(path, args, "train", args.sample, args.seed)
        valid_bleu, _ = sample_bleu(path, args, "valid", args.sample, args.seed)
        from fairseq_ext.checkpoints import load_checkpoint_file

        state = load_checkpoint_file(path)
        params = sum(v.numel() for v in state["model"].values() if hasattr(v, "numel"))
        row = dict(variant=variant, depth=depth, train_bleu=round(train_bleu, 2), valid_bleu=round(valid_bleu, 2),
                   train_loss=None, params=params, sampled=n, checkpoint=path)
        results.append(row)
        print(json.dumps(row), flush=True)
    _write_and_plot(args, results, variants)
    return 0


@command
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="fairseq-preprocess output (joined dictionary)")
    p.add_argument("--src", required=True)
    p.add_argument("--tgt", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--depths", default="6,18,36", help="encoder depths, multiples of --blocks")
    p.add_argument("--variants", default="plain,msc")
    p.add_argument("--blocks", type=int, default=6, help="N (also the number of decoder layers)")
    p.add_argument("--embed-dim", type=int, default=64)
    p.add_argument("--ffn-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--updates", type=int, default=200)
    p.add_argument("--sample", type=int, default=300, help="training pairs to decode (paper: 3000)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--remove-bpe", default="sentencepiece")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cpu", action="store_true", help="train and decode on CPU even if CUDA is there")
    p.add_argument("--plot", help="write Figure 2 (training BLEU against depth) to this image")
    p.add_argument("--dry-run", action="store_true", help="print the training commands only")
    p.add_argument("--checkpoints", help="score these trained models instead of training: a comma list of "
                   "VARIANTDEPTH=PATH (e.g. pre24=ckpt.pt,msc24=ckpt2.pt; python -m benchmarks.claims --paper msc)")
    args = p.parse_args(argv)
    if args.checkpoints:
        return score_checkpoints(args)
    depths, variants = _checked(args)
    results = []
    for depth in depths:
        for variant in variants:
            save = os.path.join(args.workdir, f"{variant}{depth}")
            cmd = train_command(args, variant, depth, save)
            if args.dry_run:
                print(shlex.join(cmd))
                continue
            row = train_and_measure(args, variant, depth, save, cmd)
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.dry_run:
        return 0
    _write_and_plot(args, results, variants)
    return 0


def _checked(args):
    """The depths and variants of ``args``, refused with one line when they make no sense."""
    try:
        depths = [int(d) for d in args.depths.split(",")]
    except ValueError:
        raise FairseqExtError(f"--depths {args.depths!r}: give a comma list of integers, e.g. 6,18,36")
    bad = [d for d in depths if d < args.blocks or d % args.blocks]
    if bad:
        raise FairseqExtError(f"--depths {bad}: each depth must be a positive multiple of --blocks {args.blocks}")
    variants = args.variants.split(",")
    if set(variants) - {"plain", "msc"}:
        raise FairseqExtError(f"--variants {args.variants!r}: choose from plain,msc")
    if not args.dry_run and not os.path.isfile(os.path.join(args.data, f"dict.{args.src}.txt")):
        raise FairseqExtError(f"{args.data}: no dict.{args.src}.txt; pass the fairseq-preprocess output directory")
    return depths, variants


def train_and_measure(args, variant, depth, save, cmd):
    """Trains one net with ``cmd`` (its log in ``save``/train.log) and returns its row: BLEU on the training sample
    and the valid set, the final training loss, the parameter count."""
    os.makedirs(save, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    with open(os.path.join(save, "train.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise FairseqExtError(f"training {variant}{depth} failed; see {save}/train.log")
    ck = os.path.join(save, "checkpoint_last.pt")
    train_bleu, n = sample_bleu(ck, args, "train", args.sample, args.seed)
    valid_bleu, _ = sample_bleu(ck, args, "valid", args.sample, args.seed)
    params = None
    m = re.search(r"num\. (?:shared )?model params: ([\d,]+)", proc.stdout + proc.stderr)
    if m:
        params = int(m.group(1).replace(",", ""))
    return dict(variant=variant, depth=depth, train_bleu=round(train_bleu, 2), valid_bleu=round(valid_bleu, 2),
                train_loss=last_train_loss(proc.stdout + proc.stderr), params=params, sampled=n)


def plot(results, variants, path):
    """Figure 2: training (and valid) BLEU against encoder depth, one line per variant."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq configures verbose logging
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for variant in variants:
        rs = sorted((r for r in results if r["variant"] == variant), key=lambda r: r["depth"])
        line = ax.plot([r["depth"] for r in rs], [r["train_bleu"] for r in rs], marker="o",
                       label=f"{variant} train")[0]
        ax.plot([r["depth"] for r in rs], [r["valid_bleu"] for r in rs], marker="x", linestyle="--",
                color=line.get_color(), label=f"{variant} valid")
    ax.set_xticks(sorted({r["depth"] for r in results}))  # the depths that were run
    ax.set_xlabel("encoder layers")
    ax.set_ylabel("BLEU")
    ax.set_title("BLEU on training pairs and valid against depth (Fig. 2)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
