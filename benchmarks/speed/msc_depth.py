"""msc_transformer depth benchmarks (Wei et al., 2020), CPU by default.

Part ``speed``: training-step time and beam-search decoding speed of the paper's small MSC nets with 6, 36 and
72 encoder layers (msc_transformer_iwslt_de_en{,_36l,_72l}, 10k joint vocabulary, shared embeddings),
measured in one process with the contenders interleaved, printed as ratios to the 6-layer net (the paper,
Table 2: 72 layers decode 26% slower than 6 — 1340 vs 1800 tokens/s on a GPU, batch 32, beam 5). Decoding
is forced to a fixed output length (min_len = max_len) so that every net does the same number of steps on
random source sentences.

Part ``depth``: the 72-layer small MSC (msc_transformer_iwslt_de_en_72l, dropout 0.3, the L2 criterion with
lambda 1e-5) trains for ``--updates`` (50) updates with fairseq-train on the bundled De-En corpus (10k joint
sentencepiece BPE), without and with ``--checkpoint-activations``; checks every logged loss is finite and
the loss falls, and reports the seconds per update and the peak resident memory of each run (ru_maxrss of
the training process). The two runs go in parallel (they share the machine, so their times are comparable).

    python -m benchmarks.speed.msc_depth [--part speed|depth|all] [--workdir DIR] [--updates 50]
        [--max-tokens 256] [--reps 3] [--device cpu|cuda]

Timings on a shared machine are noisy: compare the ratios measured in one run, not absolute numbers.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build(arch, vocab=10000):
    import torch
    from fairseq.data import Dictionary
    from fairseq.models import ARCH_CONFIG_REGISTRY

    import fairseq_ext  # noqa: F401
    from fairseq_ext.msc.model import MSCTransformerModel

    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    p = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    MSCTransformerModel.add_args(p)
    a = p.parse_args(["--share-all-embeddings"])
    ARCH_CONFIG_REGISTRY[arch](a)

    class Task:
        source_dictionary = target_dictionary = d

    torch.manual_seed(0)
    return MSCTransformerModel.build_model(a, Task()), d


def part_speed(args):
    import torch
    from fairseq.sequence_generator import SequenceGenerator

    dev = torch.device(args.device)
    archs = [("6", "msc_transformer_iwslt_de_en"), ("36", "msc_transformer_iwslt_de_en_36l"),
             ("72", "msc_transformer_iwslt_de_en_72l")]
    models = {}
    for name, arch in archs:
        m, d = _build(arch)
        models[name] = m.to(dev)
        print(f"{arch}: {sum(p.numel() for p in m.parameters()) / 1e6:.2f}M parameters", flush=True)
    g = torch.Generator().manual_seed(0)
    bsz, slen, tlen = args.batch, 20, 20
    src = torch.randint(d.nspecial, len(d), (bsz, slen), generator=g)
    src[:, -1] = d.eos()
    lengths = torch.full((bsz,), slen)
    prev = torch.randint(d.nspecial, len(d), (bsz, tlen), generator=g)
    prev[:, 0] = d.eos()
    target = torch.cat([prev[:, 1:], torch.full((bsz, 1), d.eos())], 1)
    src, lengths, prev, target = (t.to(dev) for t in (src, lengths, prev, target))
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-4) for k, m in models.items()}
    gens = {k: SequenceGenerator([m], d, beam_size=5, max_len_a=0, max_len_b=tlen, min_len=tlen)
            for k, m in models.items()}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def train_step(k):
        m = models[k]
        m.train()
        opts[k].zero_grad()
        lp = m.get_normalized_probs(m(src, lengths, prev), log_probs=True)
        (-lp.gather(-1, target.unsqueeze(-1)).sum()).backward()
        opts[k].step()

    def decode(k):
        models[k].eval()
        with torch.no_grad():
            out = gens[k].generate([models[k]], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
        return sum(len(h[0]["tokens"]) for h in out)

    for k in models:  # warm-up
        train_step(k)
        decode(k)
    t_train = {k: [] for k in models}
    t_dec = {k: [] for k in models}
    ntok = {}
    for rep in range(args.reps):
        for k in models:  # interleaved
            sync()
            t = time.perf_counter()
            train_step(k)
            sync()
            t_train[k].append(time.perf_counter() - t)
            t = time.perf_counter()
            ntok[k] = decode(k)
            sync()
            t_dec[k].append(time.perf_counter() - t)
    res = {}
    base_tr, base_dec = statistics.median(t_train["6"]), statistics.median(t_dec["6"])
    print(f"\nbatch {bsz} x {slen} source tokens, {tlen} target tokens; beam 5; {args.reps} interleaved reps; "
          f"device {args.device}")
    print("| encoder layers | train step (s) | x 6-layer | decode tokens/s | decode time x 6-layer |")
    print("|---|---|---|---|---|")
    for k in models:
        tr, de = statistics.median(t_train[k]), statistics.median(t_dec[k])
        res[k] = dict(train_step_s=round(tr, 4), train_ratio=round(tr / base_tr, 3),
                      decode_tok_s=round(ntok[k] / de, 1), decode_time_ratio=round(de / base_dec, 3))
        print(f"| {k} | {tr:.3f} | {tr / base_tr:.2f} | {ntok[k] / de:.1f} | {de / base_dec:.2f} |")
    slow = 1 - res["6"]["decode_time_ratio"] / res["72"]["decode_time_ratio"]
    print(f"72 layers decode {100 * slow:.0f}% slower (tokens/s) than 6 layers (paper: 26%)")
    return res


PEAK = ("import resource, sys\n"
        "from fairseq_cli.train import cli_main\n"
        "sys.argv = ['fairseq-train'] + sys.argv[1:]\n"
        "try:\n    cli_main()\n"
        "finally:\n"
        "    print('PEAK_RSS_MB %.1f' % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), flush=True)\n")


def _prepare_data(workdir):
    data, bin_dir = os.path.join(workdir, "data"), os.path.join(workdir, "bin-de-en")
    if not os.path.isfile(os.path.join(bin_dir, "dict.de.txt")):
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prepare_bundled_corpus.py"), "--out", data,
                        "--vocab-size", "10000"], check=True, cwd=ROOT)
        subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en",
                        "--trainpref", f"{data}/train.spm", "--validpref", f"{data}/valid.spm", "--destdir", bin_dir,
                        "--joined-dictionary", "--workers", "2"], check=True, cwd=ROOT, capture_output=True)
    return bin_dir


def part_depth(args):
    bin_dir = _prepare_data(args.workdir)
    res = {}
    procs = {}
    for ckpt in (False, True):  # both runs at once (one process each, so peak RSS is per run)
        name = "checkpoint-activations" if ckpt else "plain-activations"
        save = os.path.join(args.workdir, f"ckpt72-{name}")
        cmd = [sys.executable, "-c", PEAK, bin_dir, "--user-dir", os.path.join(ROOT, "fairseq_ext"),
               "--task", "translation", "--source-lang", "de", "--target-lang", "en",
               "--arch", "msc_transformer_iwslt_de_en_72l", "--share-all-embeddings",
               "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.0007", "--lr-scheduler",
               "inverse_sqrt", "--warmup-updates", "20", "--warmup-init-lr", "1e-7",
               "--criterion", "label_smoothed_cross_entropy_l2", "--label-smoothing", "0.1", "--l2-lambda", "1e-5",
               "--max-tokens", str(args.max_tokens), "--max-update", str(args.updates), "--seed", "1",
               "--save-dir", save, "--no-save", "--disable-validation", "--log-format", "json",
               "--log-interval", "1", "--num-workers", "0", "--log-layer-grad-norms"]
        if args.device == "cpu":
            cmd.append("--cpu")
        if ckpt:
            cmd.append("--checkpoint-activations")
        log_path = os.path.join(args.workdir, f"train72-{name}.log")
        f = open(log_path, "w")  # streamed, so a long run can be followed with tail -f
        procs[name] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1")), f, log_path, time.perf_counter())
    for name, (proc, f, log_path, t0) in procs.items():
        rc = proc.wait()
        wall = time.perf_counter() - t0
        f.close()
        with open(log_path) as fh:
            log = fh.read()
        if rc != 0:
            print(log[-3000:])
            raise SystemExit(f"72-layer training ({name}) failed")
        recs = []
        for line in log.splitlines():
            i = line.find("{")
            if i >= 0 and '"loss"' in line and '"gnorm_enc_L01"' in line:
                recs.append(json.loads(line[i:]))
        losses = [float(r["loss"]) for r in recs]
        peak = float([ln.split()[1] for ln in log.splitlines() if ln.startswith("PEAK_RSS_MB")][-1])
        per_update = statistics.median(float(r["train_wall"]) for r in recs)  # train_inner: one update each
        k = max(1, min(10, len(losses) // 5))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        g_last = [float(recs[-1][f"gnorm_enc_L{i:02d}"]) for i in (1, 36, 72)]
        res[name] = dict(updates=len(losses), finite=all(math.isfinite(v) for v in losses),
                         loss_first=round(first, 3), loss_last=round(last, 3), falling=last < first,
                         s_per_update=round(per_update, 2), peak_rss_mb=peak, wall_s=round(wall, 1),
                         last_gnorm_L1_L36_L72=g_last)
        print(name, json.dumps(res[name]), flush=True)
        assert res[name]["finite"] and res[name]["falling"] and res[name]["updates"] == args.updates, res[name]
    a, b = res["plain-activations"], res["checkpoint-activations"]
    print(f"\n72-layer MSC, {args.updates} updates, --max-tokens {args.max_tokens}, device {args.device}:")
    print("| run | loss first->last | s/update | peak RSS (MB) |")
    print("|---|---|---|---|")
    for n, r in res.items():
        print(f"| {n} | {r['loss_first']} -> {r['loss_last']} | {r['s_per_update']} | {r['peak_rss_mb']:.0f} |")
    print(f"--checkpoint-activations: peak RSS x{b['peak_rss_mb'] / a['peak_rss_mb']:.2f}, "
          f"time per update x{b['s_per_update'] / a['s_per_update']:.2f}")
    return res


def main():
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.msc_depth", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["speed", "depth", "all"], default="all")
    p.add_argument("--workdir", default=os.path.join(ROOT, "work", "bench-msc"))
    p.add_argument("--updates", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    out = {}
    if args.part in ("speed", "all"):
        out["speed"] = part_speed(args)
    if args.part in ("depth", "all"):
        out["depth"] = part_depth(args)
    with open(os.path.join(args.workdir, "bench_msc_depth.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
