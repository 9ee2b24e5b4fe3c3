"""Plot the per-encoder-layer gradient norms of an MSC run (Wei et al., 2020, Figure 5).

Train with ``--log-layer-grad-norms`` (``msc_transformer``), keep fairseq's log (``--log-file`` or the captured
stdout/stderr; ``--log-format json``, ``simple`` or ``tqdm``), then::

    python -m fairseq_ext.msc.plot_grad_norms train.log [more.log ...] --out gnorm.png \
        [--layers 1,12,24,36,48,60,72] [--max-updates 10000] [--csv gnorm.csv] [--logy]

One curve per encoder layer ("L1" = the bottom layer) against the update number; several logs (e.g. plain vs
MSC) are drawn side by side with a shared y axis. Also prints, per log, the mean norm of the bottom and the top
layer and their ratio (Fig. 5's point: MSC keeps the bottom layers' gradients alive).
"""

import argparse
import json
import logging
import os
import re
import sys

from fairseq_ext.common.errors import FairseqExtError, command

_KEY = re.compile(r"^gnorm_enc_L(\d+)$")
_SIMPLE = re.compile(r"(gnorm_enc_L\d+|num_updates)[=\s]+([-+0-9.eE]+|nan|inf)")


def parse_log(path):
    """[(num_updates, {layer: norm})] from the train_inner records of a fairseq log."""
    if not os.path.isfile(path):
        raise FairseqExtError(f"plot_grad_norms: log file {path} does not exist")
    records = []
    with open(path, errors="replace") as f:
        for line in f:
            if "gnorm_enc_L" not in line:
                continue
            values = {}
            brace = line.find("{")
            if brace >= 0:
                try:
                    values = {k: v for k, v in json.loads(line[brace:]).items()}
                except ValueError:
                    values = {}
            if not values:
                values = dict(_SIMPLE.findall(line))
            layers = {int(m.group(1)): float(v) for k, v in values.items() if (m := _KEY.match(k))}
            if not layers:
                continue
            step = values.get("num_updates")
            step = int(float(step)) if step is not None else (records[-1][0] + 1 if records else 1)
            records.append((step, layers))
    if not records:
        raise FairseqExtError(f"plot_grad_norms: no gnorm_enc_L* values in {path}; train msc_transformer with "
                              f"--log-layer-grad-norms and pass its training log")
    return records


def summarize(records):
    layers = sorted(records[0][1])
    mean = {i: sum(r[1].get(i, 0.0) for r in records) / len(records) for i in layers}
    bottom, top = mean[layers[0]], mean[layers[-1]]
    return layers, mean, bottom / top if top > 0 else float("inf")


@command
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="fairseq training log(s) of runs with --log-layer-grad-norms")
    p.add_argument("--out", required=True, help="image to write (.png, .pdf, .svg)")
    p.add_argument("--layers", help="comma list of layers to draw (1 = bottom); default: all, or 8 spread out")
    p.add_argument("--max-updates", type=int, help="only the first N updates (Fig. 5 shows the first 10k)")
    p.add_argument("--csv", help="also write update,layer,norm rows here")
    p.add_argument("--logy", action="store_true", help="logarithmic y axis")
    p.add_argument("--labels", help="comma list of titles, one per log")
    args = p.parse_args(argv)
    runs = []
    for path in args.logs:
        recs = parse_log(path)
        if args.max_updates:
            recs = [r for r in recs if r[0] <= args.max_updates]
        runs.append((path, recs))
    labels = args.labels.split(",") if args.labels else [os.path.basename(p) for p in args.logs]
    if len(labels) != len(runs):
        raise FairseqExtError(f"plot_grad_norms: --labels has {len(labels)} names for {len(runs)} logs")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq configures verbose logging
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), sharey=True, squeeze=False)
    csv_rows = []
    for ax, label, (path, recs) in zip(axes[0], labels, runs):
        layers, mean, ratio = summarize(recs)
        if args.layers:
            try:
                show = [int(v) for v in args.layers.split(",")]
            except ValueError:
                raise FairseqExtError(f"plot_grad_norms: --layers {args.layers!r} must be integers")
            missing = [v for v in show if v not in layers]
            if missing:
                raise FairseqExtError(f"plot_grad_norms: --layers {missing} not in {path} "
                                      f"(it has layers 1..{layers[-1]})")
        elif len(layers) <= 8:
            show = layers
        else:
            show = sorted({layers[round(k * (len(layers) - 1) / 7)] for k in range(8)})
        cmap = plt.get_cmap("viridis")
        for j, layer in enumerate(show):
            xs = [s for s, v in recs if layer in v]
            ys = [v[layer] for s, v in recs if layer in v]
            ax.plot(xs, ys, label=f"L{layer}", color=cmap(j / max(1, len(show) - 1)), linewidth=1)
        for s, v in recs:
            csv_rows.extend((label, s, layer, v[layer]) for layer in sorted(v))
        ax.set_title(label)
        ax.set_xlabel("update")
        if args.logy:
            ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2)
        print(f"{path}: {len(recs)} records, {len(layers)} encoder layers; mean gradient norm L1 "
              f"{mean[layers[0]]:.4g}, L{layers[-1]} {mean[layers[-1]]:.4g}, bottom/top {ratio:.3g}")
    axes[0][0].set_ylabel("gradient norm")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("run,update,layer,norm\n")
            f.writelines(f"{r},{s},{layer},{v}\n" for r, s, layer, v in csv_rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
