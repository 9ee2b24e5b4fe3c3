"""SAT decoding speed and quality on the bundled German->English corpus (issue #4, the paper's Tables 3-5).

    python benchmarks/bench_sat.py [--workdir work/bench-sat] [--minutes 8] [--ks 2 4 6] [--sentences 200]
                                   [--threads 1] [--batch 64]

1. Models (each step skipped when its output exists): a fairseq ``transformer`` teacher trained for
   --minutes, sequence-level distillation of the training set with it (--kd-beam; 0 = none), and one SAT
   student of the same size (3+3 layers, d 256, FFN 1024, as the quickstart) per K, trained for --minutes
   and initialised from the teacher. K=1 is the teacher itself (the SAT with K=1 is the Transformer).
2. Contenders, all in this one process, measured interleaved (each sentence / batch is decoded by every
   contender in turn, in a rotating order) so that the load of the machine affects all alike:
   fairseq's ``SequenceGenerator`` on the teacher, our generator with K=1 on the teacher, and our generator
   on each SAT student.
3. Latency per sentence at batch size 1 (greedy and beam 4) on the first --sentences test sentences;
   throughput at batch size --batch (greedy and beam 4) on the whole test set, whose outputs are scored
   with sacreBLEU against the detokenised references.

Prints the table and the speed-ups over our K=1 model, checked against the targets of the issue
(greedy 1.8x / 3.2x / 4.5x and beam-4 1.6x / 2.6x / 3.3x for K = 2 / 4 / 6 at batch 1; our K=1 >= 0.95x of
fairseq's generator). Timings on a shared machine are noisy: compare the ratios, which are measured in one
run.
"""

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TARGETS = {"greedy": {2: 1.8, 4: 3.2, 6: 4.5}, "beam4": {2: 1.6, 4: 2.6, 6: 3.3}}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(ROOT, "work", "bench-sat"))
    p.add_argument("--minutes", type=float, default=8, help="training minutes of the teacher and of each student")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--sentences", type=int, default=200, help="test sentences for the batch-1 latency")
    p.add_argument("--batch", type=int, default=64, help="batch size of the throughput runs")
    p.add_argument("--throughput-sentences", type=int, default=1000,
                   help="test sentences of the throughput runs and BLEU (default: the whole test set, 1000)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one sentence on one core)")
    p.add_argument("--no-throughput", action="store_true", help="only the batch-1 latencies")
    p.add_argument("--kd-beam", type=int, default=4,
                   help="beam of the teacher's distillation decode of the training set (0: no distillation)")
    p.add_argument("--fixed-length", type=int, default=0,
                   help="decode exactly N words + EOS with every contender (--min-len N --max-len-b N "
                        "--max-len-a 0): speed at equal output length, independent of how well (or badly) "
                        "the models are trained; BLEU is then meaningless")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--teacher", default=None,
                   help="benchmark these trained checkpoints instead of training: the K=1 transformer ...")
    p.add_argument("--student", action="append", default=[], metavar="K=PATH",
                   help="... and one SAT student per K (repeat), e.g. --student 2=ckpt/sat-k2/checkpoint_avg.pt")
    p.add_argument("--data", default=None, help="with --teacher: the binarised data directory of the test set")
    p.add_argument("--refs", default=None, help="with --teacher: detokenised test references, one per line")
    p.add_argument("--target-lang", default="en")
    a = p.parse_args()
    if a.teacher and not (a.student and a.data and a.refs):
        p.error("--teacher needs --student K=PATH (one or more), --data BIN and --refs FILE")
    return a


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


def main():
    args = parse_args()
    if args.teacher:
        teacher_path, bin_ = args.teacher, args.data
        student_paths = {int(ks.split("=", 1)[0]): ks.split("=", 1)[1] for ks in args.student}
        refs_path = args.refs
    else:
        teacher_path, student_paths, bin_ = ensure_models(args)
        refs_path = os.path.join(args.workdir, "data", f"test.{args.target_lang}")

    import torch
    import sacrebleu

    torch.set_num_threads(args.threads)
    import fairseq_ext  # noqa: F401
    from fairseq import checkpoint_utils
    from fairseq.sequence_generator import SequenceGenerator

    from fairseq_ext.sat.generator import SATSequenceGenerator

    overrides = {"data": bin_}

    def load(path):
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
        return models[0].eval(), task

    teacher, task = load(teacher_path)
    students = {K: load(p)[0] for K, p in student_paths.items()}
    n_params = {"transformer": sum(p.numel() for p in teacher.parameters())}
    n_params.update({f"K={K}": sum(p.numel() for p in m.parameters()) for K, m in students.items()})
    tgt_dict = task.target_dictionary
    task.load_dataset("test")
    ds = task.dataset("test")
    with open(refs_path, encoding="utf-8") as f:
        refs = [l.rstrip("\n") for l in f]

    gen_opts = dict(max_len_a=1.2, max_len_b=10)
    if args.fixed_length:
        gen_opts = dict(max_len_a=0, max_len_b=args.fixed_length, min_len=args.fixed_length)

    def contenders(beam):
        c = [("fairseq SequenceGenerator (transformer)", 1, teacher,
              SequenceGenerator([teacher], tgt_dict, beam_size=beam, **gen_opts)),
             ("ours K=1 (transformer)", 1, teacher, SATSequenceGenerator([teacher], tgt_dict, beam_size=beam, **gen_opts))]
        for K, m in students.items():
            c.append((f"ours SAT K={K}", K, m, SATSequenceGenerator([m], tgt_dict, beam_size=beam, **gen_opts)))
        return c

    def run(gen, model, sample):
        if hasattr(model, "set_beam_size"):
            model.set_beam_size(gen.beam_size)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = gen.generate([model], sample)
        return time.perf_counter() - t0, out

    rng = random.Random(0)
    load_before = os.getloadavg()
    results = {}
    for mode, beam in (("greedy", 1), ("beam4", 4)):
        cs = contenders(beam)
        # batch 1 latency, interleaved
        ids = list(range(min(args.sentences, len(ds))))
        tot = [0.0] * len(cs)
        calls = [0] * len(cs)
        toks = [0] * len(cs)
        per_sentence = [[] for _ in cs]  # (output length of ours K=1, seconds)
        enc_s = 0.0
        for c in cs:  # warm-up
            run(c[3], c[2], ds.collater([ds[0]]))
        for i in ids:
            sample = ds.collater([ds[i]])
            order = list(range(len(cs)))
            rng.shuffle(order)
            lens, dts = [0] * len(cs), [0.0] * len(cs)
            for j in order:
                dts[j], out = run(cs[j][3], cs[j][2], sample)
                tot[j] += dts[j]
                calls[j] += getattr(cs[j][3], "decoder_calls", 0)
                lens[j] = len(out[0][0]["tokens"])
                toks[j] += lens[j]
            for j in range(len(cs)):  # bucketed by the output length of ours K=1 (contender 1)
                per_sentence[j].append((lens[1], dts[j]))
            t0 = time.perf_counter()  # the encoder pass alone: the part of a sentence's time no K can shrink
            with torch.no_grad():
                teacher.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
            enc_s += time.perf_counter() - t0
        results.setdefault("_analysis", {})[f"{mode}_encoder_ms"] = 1000 * enc_s / len(ids)
        for j, c in enumerate(cs):
            buckets = {}
            for (n, dt), (_, dt1) in zip(per_sentence[j], per_sentence[1]):
                b = "1-9" if n < 10 else ("10-19" if n < 20 else "20+")
                acc = buckets.setdefault(b, [0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += dt
                acc[2] += dt1
            results.setdefault(c[0], {"K": c[1]})[f"{mode}_b1_speedup_by_len"] = {
                b: {"sentences": v[0], "speedup": v[2] / v[1]} for b, v in buckets.items()}
        for j, c in enumerate(cs):
            r = results.setdefault(c[0], {"K": c[1]})
            r[f"{mode}_b1_ms"] = 1000 * tot[j] / len(ids)
            r[f"{mode}_b1_len"] = toks[j] / len(ids)
            if calls[j]:
                r[f"{mode}_b1_calls"] = calls[j] / len(ids)
        print(f"[{mode}] batch 1 done ({len(ids)} sentences)", flush=True)
        if args.no_throughput:
            continue
        # batch --batch throughput over the whole test set (batches of similar source length), interleaved
        n_tp = min(args.throughput_sentences, len(ds))
        order_by_len = sorted(range(n_tp), key=lambda i: ds.src_sizes[i])
        batches = [order_by_len[s: s + args.batch] for s in range(0, n_tp, args.batch)]
        tot = [0.0] * len(cs)
        hyps = [dict() for _ in cs]
        for b in batches:
            sample = ds.collater([ds[i] for i in b])
            order = list(range(len(cs)))
            rng.shuffle(order)
            for j in order:
                dt, out = run(cs[j][3], cs[j][2], sample)
                tot[j] += dt
                for sid, h in zip(sample["id"].tolist(), out):
                    hyps[j][sid] = tgt_dict.string(h[0]["tokens"], "sentencepiece")
        for j, c in enumerate(cs):
            r = results[c[0]]
            r[f"{mode}_b{args.batch}_sent_per_s"] = n_tp / tot[j]
            sys_out = [hyps[j][i] for i in range(n_tp)]
            r[f"{mode}_bleu"] = sacrebleu.corpus_bleu(sys_out, [refs[:n_tp]]).score
        print(f"[{mode}] batch {args.batch} done", flush=True)
    load_after = os.getloadavg()

    analysis = results.pop("_analysis")
    base = results["ours K=1 (transformer)"]
    fs = results["fairseq SequenceGenerator (transformer)"]
    print()
    print(f"SAT decoding benchmark: bundled de-en test set, batch 1 on {min(args.sentences, len(ds))} sentences, "
          f"batch {args.batch} and BLEU on {min(args.throughput_sentences, len(ds))}, torch threads {args.threads}, "
          f"load average {load_before[0]:.1f} before / {load_after[0]:.1f} after on {os.cpu_count()} cores "
          f"(shared machine: compare ratios)"
          + (f"; every output forced to {args.fixed_length} words + EOS" if args.fixed_length else ""))
    print("parameters: " + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in n_params.items()))
    cols = ["greedy_b1_ms", "beam4_b1_ms"] + ([] if args.no_throughput else
                                             [f"greedy_b{args.batch}_sent_per_s", f"beam4_b{args.batch}_sent_per_s",
                                              "greedy_bleu", "beam4_bleu"])
    header = "contender\t" + "\t".join(cols) + "\tgreedy_b1_speedup\tbeam4_b1_speedup" + \
        ("" if args.no_throughput else f"\tgreedy_b{args.batch}_speedup\tbeam4_b{args.batch}_speedup") + \
        "\tgreedy_calls/sent\tgreedy_len"
    print(header)
    for name, r in results.items():
        cells = [f"{r[c]:.2f}" for c in cols]
        cells += [f"{base['greedy_b1_ms'] / r['greedy_b1_ms']:.2f}x", f"{base['beam4_b1_ms'] / r['beam4_b1_ms']:.2f}x"]
        if not args.no_throughput:
            for m in ("greedy", "beam4"):
                k = f"{m}_b{args.batch}_sent_per_s"
                cells.append(f"{r[k] / base[k]:.2f}x")
        cells.append(f"{r.get('greedy_b1_calls', float('nan')):.2f}")
        cells.append(f"{r['greedy_b1_len']:.2f}")
        print(name + "\t" + "\t".join(cells))
    print()
    # where the time goes at batch 1 (greedy): the encoder pass E is paid once per sentence whatever K is;
    # with c = (T - E) / calls the cost of one decoder call (incl. search), T_K = E + ceil(n/K) c_K, and the
    # best a K can give at the measured length n is (E + n' c_1) / (E + ceil(n'/K) c_1) with n' = calls of K=1
    E = analysis["greedy_encoder_ms"]
    c1 = (base["greedy_b1_ms"] - E) / base["greedy_b1_calls"]
    print(f"greedy batch 1: encoder {E:.2f} ms/sentence, one K=1 decoder call {c1:.2f} ms, "
          f"{base['greedy_b1_calls']:.2f} calls/sentence")
    for name, r in results.items():
        if name.startswith("ours SAT"):
            K = r["K"]
            cK = (r["greedy_b1_ms"] - E) / r["greedy_b1_calls"]
            calls1 = base["greedy_b1_calls"]
            bound = (E + calls1 * c1) / (E + math.ceil(calls1 / K) * c1)
            r["greedy_b1_call_ms"] = cK
            r["greedy_b1_bound_if_call_cost_equal_k1"] = bound
            by_len = ", ".join(f"len {b}: {v['speedup']:.2f}x ({v['sentences']})"
                               for b, v in sorted(r["greedy_b1_speedup_by_len"].items()))
            print(f"  {name}: one call {cK:.2f} ms ({cK / c1:.2f}x a K=1 call); speed-up bound at this length if "
                  f"a call cost what a K=1 call costs: {bound:.2f}x; greedy speed-up by K=1 output length: {by_len}")
    results_analysis = {"encoder_ms": E, "k1_call_ms": c1}
    print()
    ok = True
    for mode in ("greedy", "beam4"):
        for K, target in TARGETS[mode].items():
            name = f"ours SAT K={K}"
            if name not in results:
                continue
            got = base[f"{mode}_b1_ms"] / results[name][f"{mode}_b1_ms"]
            flag = "ok" if got >= target else "BELOW TARGET"
            ok &= got >= target
            print(f"target {mode} batch-1 speed-up K={K}: >= {target}x, measured {got:.2f}x  {flag}")
    for mode in ("greedy", "beam4"):
        ratio = fs[f"{mode}_b1_ms"] / base[f"{mode}_b1_ms"]
        flag = "ok" if ratio >= 0.95 else "BELOW TARGET"
        ok &= ratio >= 0.95
        print(f"target ours K=1 vs fairseq SequenceGenerator, {mode} batch 1: >= 0.95, measured {ratio:.2f}  {flag}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "analysis": results_analysis, "params": n_params,
                       "load": [load_before, load_after]}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
