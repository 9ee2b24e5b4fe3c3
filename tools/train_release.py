"""Train the release checkpoint of one architecture, the one examples/quickstart.sh starts from by default.

    python tools/train_release.py --arch transformer [--corpus bible] [--max-update 5000] [--workdir work/release]

Runs ``examples/quickstart.sh --from-scratch`` with the arch's quickstart settings and ``--max-update`` updates
(no time cap below ``--minutes``), then scores the averaged checkpoint on the valid set (beam 5, sacreBLEU) and
packs it with ``python -m fairseq_ext.release pack`` into ``releases/CORPUS-SRC-TGT/ARCH.pt`` (fp16, no optimizer
state, no path of this machine, sha256 in MANIFEST.json). The manifest records the command (directories outside
the repository as ``DIR``), the updates, the wall-clock and CPU time of the whole run (``resource.getrusage`` of
the child processes: preparation, training, decoding), the valid and test BLEU and the machine's core count. The
models of one release directory share its sentencepiece model and dictionary: once the directory has an
``spm.model``, the run encodes with it (``--spm-model``). The valid BLEU is a report, not a selection: the settings
and the update count are fixed before training.
"""

import argparse
import glob
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_UPDATES = {"transformer": 5000, "fconv_glu": 3000, "msc_transformer": 3000, "sat_transformer": 8000,
                   "bert_jam": 2000}
DIRECTIONS = {"bert_jam": "en-de"}


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd, log, env=None):
    """Run cmd with its output streamed to the console and appended to log; stop on failure."""
    with open(log, "a", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=env)
        out = []
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            f.write(line)
            out.append(line)
        if proc.wait() != 0:
            raise SystemExit(f"train_release: '{cmd[0]} {cmd[1]}' failed; see {log}")
    return "".join(out)


def bleu_of(path):
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    return round(d["score"], 2), d["signature"]


def summary(arch, updates, wall, cpu, threads, valid_bleu, distilled=False):
    """The one line the quickstart prints about a release."""
    how = "distilled from and initialised by the release's transformer," if distilled else "from scratch"
    return (f"{arch} trained {updates} updates {how} in {wall / 60:.0f} min ({cpu / 60:.0f} CPU-minutes, "
            f"{threads} thread{'s' if threads != 1 else ''}) by tools/train_release.py; valid BLEU {valid_bleu:.2f}")


def code_commit() -> str:
    """The repository's HEAD, marked when tracked files differ from it (what the release was trained with)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return (head or "unknown") + (" with uncommitted changes" if dirty else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True)
    p.add_argument("--corpus", default="bible")
    p.add_argument("--max-update", type=int, help="default: " + ", ".join(f"{a} {n}" for a, n in
                                                                            DEFAULT_UPDATES.items()))
    p.add_argument("--minutes", type=float, default=240, help="cap on the training wall-clock (default 240)")
    p.add_argument("--workdir", default=os.path.join(ROOT, "work", "release"))
    p.add_argument("--release-root", default=os.path.join(ROOT, "releases"))
    p.add_argument("--sat-k", type=int, default=2, help="sat_transformer: the group size K (default 2); the "
                   "student is distilled from and initialised by the release's transformer when there is one")
    p.add_argument("--smoke", action="store_true", help="the quickstart's --smoke (20 updates) and a bounded valid "
                   "decode: a fast check of every step, used by the tests")
    args = p.parse_args(argv)
    from fairseq_ext.checkpoints.release import public_text

    # fairseq-generate and sacrebleu of this Python's environment, activated or not
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    direction = DIRECTIONS.get(args.arch, "de-en")
    src, tgt = direction.split("-")
    updates = args.max_update or DEFAULT_UPDATES.get(args.arch, 3000)
    release_dir = os.path.join(args.release_root, f"{args.corpus}-{direction}")
    os.makedirs(args.workdir, exist_ok=True)
    log = os.path.join(args.workdir, f"train_release-{args.arch}.log")
    cmd = ["bash", "examples/quickstart.sh", "--from-scratch", "--arch", args.arch, "--corpus", args.corpus,
           "--direction", direction, "--max-update", str(updates), "--minutes", str(args.minutes),
           "--workdir", args.workdir]
    if args.smoke:
        cmd.append("--smoke")
    # the releases of one corpus share one BPE (the quickstart keeps one encoded copy of the corpus for all of them)
    shared = [os.path.join(release_dir, "spm.model")] + sorted(glob.glob(os.path.join(args.release_root,
                                                                                     f"{args.corpus}-*", "spm.model")))
    shared = [f for f in shared if os.path.isfile(f)]
    if shared:
        cmd += ["--spm-model", shared[0]]
    env = dict(os.environ)
    name = args.arch
    if args.arch == "sat_transformer":
        name = f"sat_transformer_k{args.sat_k}"
        env["SAT_K"] = str(args.sat_k)
        teacher = os.path.join(release_dir, "transformer.pt")
        if os.path.isfile(teacher):
            from fairseq_ext.checkpoints.release import verify

            env["SAT_TEACHER"] = verify(release_dir, "transformer")
    wall0, cpu0 = time.time(), cpu_seconds()
    console = run(cmd, log, env)
    wall, cpu = time.time() - wall0, cpu_seconds() - cpu0
    run_name = f"{args.arch}-{src}-{tgt}" + (f"-k{args.sat_k}" if args.arch == "sat_transformer" else "")
    ckpt_dir = os.path.join(args.workdir, "checkpoints", run_name)
    out_dir = os.path.join(args.workdir, "out", run_name)
    checkpoint = os.path.join(ckpt_dir, "checkpoint_avg.pt")
    trained = re.findall(r"trained (\d+) updates", console)
    bin_dir = os.path.join(args.workdir, f"bin-{src}-{tgt}")
    if args.arch == "sat_transformer":
        bin_dir += "-kd" + ("-transformer" if "SAT_TEACHER" in env else "")
    task = {"sat_transformer": "translation_sat", "bert_jam": "translation_bert"}.get(args.arch, "translation")
    # the valid set, for the record, with the decoding options the quickstart's test step printed (the arch's)
    gen_args = re.findall(r"5/6 fairseq-generate the test set \((.*)\) and score it", console)[-1].split()
    gen = ["fairseq-generate", bin_dir, "--user-dir", os.path.join(ROOT, "fairseq_ext"), "--task", task,
           "--source-lang", src, "--target-lang", tgt, "--path", checkpoint, "--gen-subset", "valid",
           "--batch-size", "64", "--remove-bpe", "sentencepiece", "--num-workers", "0", *gen_args,
           "--results-path", out_dir]
    print(f"train_release: scoring {checkpoint} on the valid set")
    with open(os.path.join(args.workdir, f"generate-valid-{args.arch}.log"), "w") as f:
        subprocess.run(gen, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    with open(os.path.join(out_dir, "generate-valid.txt"), encoding="utf-8") as f:
        hyps = sorted((int(m.group(1)), m.group(2)) for m in re.finditer(r"^D-(\d+)\t[^\t]*\t(.*)$", f.read(), re.M))
    with open(os.path.join(out_dir, "valid.hyp"), "w", encoding="utf-8") as f:
        f.writelines(h + "\n" for _, h in hyps)
    data_dir = os.path.join(args.workdir, "data")
    score = subprocess.run(["sacrebleu", os.path.join(data_dir, f"valid.{tgt}"),
                            "-i", os.path.join(out_dir, "valid.hyp"), "-m", "bleu", "-w", "2"],
                           check=True, capture_output=True, text=True)
    valid = json.loads(score.stdout)
    test_bleu, test_sig = bleu_of(os.path.join(out_dir, "bleu.json"))
    n_updates = int(trained[-1]) if trained else updates
    with open(os.path.join(args.workdir, "logs", f"train-{run_name}.log"), encoding="utf-8") as f:
        done = re.findall(r"done training in ([\d.]+) seconds", f.read())
    threads = int(env.get("OMP_NUM_THREADS", "2"))
    meta = {
        "arch": args.arch, "name": name, "corpus": args.corpus, "direction": direction,
        # a release is public: paths in the repository relative to it, any other shown as DIR
        "command": public_text("python tools/train_release.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                               ROOT),
        "quickstart_command": public_text(" ".join(cmd[1:]), ROOT),
        # what the quickstart command needs to run as this one did: the thread count included
        "quickstart_environment": {**{k: public_text(env[k], ROOT) for k in ("SAT_K", "SAT_TEACHER") if k in env},
                                   "OMP_NUM_THREADS": str(threads)},
        "code_commit": code_commit(),
        "updates_trained": n_updates,
        "wall_seconds": round(wall), "cpu_seconds": round(cpu),
        "train_seconds": round(float(done[-1])) if done else None,
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
        "threads": threads,
        "valid_bleu": round(valid["score"], 2), "valid_signature": valid["signature"],
        "test_bleu": test_bleu, "test_signature": test_sig,
        "summary": summary(args.arch, n_updates, wall, cpu, threads, valid["score"], "SAT_TEACHER" in env),
    }
    meta_path = os.path.join(args.workdir, f"release-{args.arch}.json")
    with open(meta_path, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    subprocess.run([sys.executable, "-m", "fairseq_ext.release", "pack", "--checkpoint", checkpoint, "--name",
                    name, "--release-dir", release_dir, "--dict", os.path.join(bin_dir, f"dict.{src}.txt"),
                    "--spm-model", os.path.join(data_dir, "spm.model"), "--meta", meta_path], check=True, cwd=ROOT)
    print(f"train_release: {meta['summary']}; test BLEU {test_bleu}")


if __name__ == "__main__":
    sys.exit(main())
