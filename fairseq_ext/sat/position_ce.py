"""Position-wise cross-entropy of translation models (SAT paper, Sec. 5 and Figure 6).

    python -m fairseq_ext.sat.position_ce DATA_BIN --path transformer.pt --path sat2.pt --path sat4.pt \
        [--split valid] [--max-position 24] [--png position_ce.png] [--source-lang de --target-lang en]

For every checkpoint, the reference targets of the split are scored by teacher forcing and the mean token
cross-entropy (nats, no label smoothing) is reported at each target position t = 1..--max-position and, for
a SAT model with group size K, at each position inside a group (1..K; the paper finds it rises within a
group: long-distance dependencies are harder). Prints both tables and, with --png, plots the first one like
Figure 6 (one line per checkpoint). Works for ``sat_transformer`` (K from its checkpoint) and any fairseq
translation model (K = 1).
"""

import argparse
import os
import sys

import torch

from fairseq_ext.common.errors import FairseqExtError, command


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fairseq_ext.sat.position_ce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="binarised data directory (fairseq-preprocess --destdir)")
    p.add_argument("--path", action="append", required=True, help="checkpoint; repeat to compare models")
    p.add_argument("--label", action="append", help="legend label per --path (default: derived from the model)")
    p.add_argument("--split", default="valid", help="data split to score (default: valid)")
    p.add_argument("--source-lang", default=None)
    p.add_argument("--target-lang", default=None)
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--max-position", type=int, default=24, help="last target position to report (default 24)")
    p.add_argument("--png", default=None, help="write the plot here (PNG)")
    p.add_argument("--cpu", action="store_true", help="(decoding runs on CPU unless CUDA is available)")
    return p.parse_args(argv)


@torch.no_grad()
def position_ce(path, data, split, source_lang=None, target_lang=None, max_tokens=4000, max_position=24,
                use_cuda=False):
    """Returns (K, label, ce_by_position[list], count_by_position, ce_by_group_position[list])."""
    from fairseq import checkpoint_utils, utils

    if not os.path.isfile(path):
        raise FairseqExtError(f"--path {path}: no such checkpoint")
    if not os.path.isdir(data):
        raise FairseqExtError(f"{data}: no such data directory (give the fairseq-preprocess --destdir)")
    overrides = {"data": data}
    if source_lang:
        overrides["source_lang"] = source_lang
    if target_lang:
        overrides["target_lang"] = target_lang
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    model = models[0].eval()
    if use_cuda:
        model.cuda()
    K = int(getattr(getattr(model, "decoder", None), "group_size", 1))
    try:
        task.load_dataset(split)
    except FileNotFoundError as e:
        raise FairseqExtError(f"--split {split}: {e}")
    itr = task.get_batch_iterator(
        dataset=task.dataset(split), max_tokens=max_tokens, max_positions=utils.resolve_max_positions(
            task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, num_workers=0).next_epoch_itr(shuffle=False)
    pad = task.target_dictionary.pad()
    sums = torch.zeros(max_position, dtype=torch.double)
    counts = torch.zeros(max_position, dtype=torch.double)
    gsums = torch.zeros(K, dtype=torch.double)
    gcounts = torch.zeros(K, dtype=torch.double)
    for sample in itr:
        if use_cuda:
            sample = utils.move_to_cuda(sample)
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True).float()
        target = sample["target"]
        nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        mask = target.ne(pad)
        pos = torch.arange(target.size(1), device=target.device).expand_as(target)
        nll, pos = nll[mask].double().cpu(), pos[mask].cpu()
        keep = pos < max_position
        sums.index_add_(0, pos[keep], nll[keep])
        counts.index_add_(0, pos[keep], torch.ones_like(nll[keep]))
        gsums.index_add_(0, pos % K, nll)
        gcounts.index_add_(0, pos % K, torch.ones_like(nll))
    ce = (sums / counts.clamp(min=1)).tolist()
    gce = (gsums / gcounts.clamp(min=1)).tolist()
    arch = getattr(cfg.model, "arch", type(model).__name__) if cfg.model is not None else type(model).__name__
    label = f"{arch} K={K}" if K > 1 else f"{arch}"
    return K, label, ce, counts.tolist(), gce


def plot(results, split, png):
    """Writes the position-wise cross-entropy of ``results`` ([(K, label, ce, counts, by group position)], as
    :func:`main` returns) to ``png``: one line per model over the positions it has tokens at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(int(sum(1 for c in r[3] if c > 0)) for r in results)
    fig, ax = plt.subplots(figsize=(7, 4))
    for K, label, ce, counts, _ in results:
        xs = [t + 1 for t in range(n) if counts[t] > 0]
        ax.plot(xs, [ce[t - 1] for t in xs], marker="o", markersize=3, label=label)
    ax.set_xlabel("position")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(f"position-wise cross-entropy ({split})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


@command
def main(argv=None):
    args = parse_args(argv)
    if args.label and len(args.label) != len(args.path):
        raise FairseqExtError("--label must be given once per --path (or not at all)")
    use_cuda = torch.cuda.is_available() and not args.cpu
    results = []
    for i, path in enumerate(args.path):
        K, label, ce, counts, gce = position_ce(path, args.data, args.split, args.source_lang, args.target_lang,
                                                args.max_tokens, args.max_position, use_cuda)
        if args.label:
            label = args.label[i]
        results.append((K, label, ce, counts, gce))

    n = max(int(sum(1 for c in r[3] if c > 0)) for r in results)
    print(f"position-wise cross-entropy (nats/token) on '{args.split}', target positions 1..{n}")
    print("position\t" + "\t".join(r[1] for r in results))
    for t in range(n):
        cells = [f"{r[2][t]:.4f}" if r[3][t] > 0 else "-" for r in results]
        print(f"{t + 1}\t" + "\t".join(cells))
    for K, label, _, _, gce in results:
        print(f"by position in group ({label}): " + "  ".join(f"{k + 1}:{v:.4f}" for k, v in enumerate(gce)))

    if args.png:
        plot(results, args.split, args.png)
        print(f"wrote {args.png}")
    return results


if __name__ == "__main__":
    sys.exit(1 if main() == 1 else 0)
