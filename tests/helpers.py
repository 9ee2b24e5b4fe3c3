"""Shared test helpers: small data, and the real fairseq command-line tools run as subprocesses
(``python -m fairseq_cli.<tool>``, what the ``fairseq-<tool>`` entry points run) with ``--user-dir``."""

import os
import random
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(ROOT, "fairseq_ext")

DEMO = {  # examples/quickstart.sh's demo sentences and words their translation must contain
    "Und der König sandte Boten in die Stadt und ließ das Volk versammeln.": ("king", "sent", "city", "people"),
    "Fürchtet euch nicht, denn der Herr ist mit euch.": ("afraid", "Lord", "with you"),
}
# the MSC release (17.4 test BLEU, the weakest) translates "der König sandte Boten" as "the messengers sent
# messengers" (after the quickstart's 400 more updates: "The king sent messengers to the city")
DEMO_MSC = [("sent messengers", "city", "people"), ("afraid", "Lord", "with you")]
# the SAT K=6 release (13.2 test BLEU) repeats a word inside a group where the verb should be: "The king messengers
# messengers into the city, and the people people."
DEMO_SAT_K6 = [("king", "messengers", "city", "people"), ("afraid", "Lord", "with you")]


def create_dummy_data(data_dir, num_examples=100, maxlen=20, seed=0, splits=("train", "valid", "test")):
    """Random a-z "words" in ``{split}.in`` / ``{split}.out`` whose target is a function of the source
    (each letter shifted by one, so a model can learn it), like fairseq's tests/utils.create_dummy_data."""
    rng = random.Random(seed)
    for split in splits:
        with open(os.path.join(data_dir, f"{split}.in"), "w") as fs, \
                open(os.path.join(data_dir, f"{split}.out"), "w") as ft:
            for _ in range(num_examples):
                n = rng.randint(1, maxlen)
                src = [chr(ord("a") + rng.randint(0, 24)) for _ in range(n)]
                fs.write(" ".join(src) + "\n")
                ft.write(" ".join(chr(ord(c) + 1) for c in src) + "\n")


def run_cli(tool, args, input=None, check=True, timeout=900, env=None, cwd=ROOT):
    """Run ``fairseq-<tool>`` (train, generate, interactive, validate, preprocess) in a fresh process."""
    cmd = [sys.executable, "-m", f"fairseq_cli.{tool}"] + [str(a) for a in args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"fairseq-{tool} failed with exit {proc.returncode}\ncmd: {' '.join(cmd)}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def run_module(module, args, check=True, timeout=900, input=None):
    """Run ``python -m <module>`` from the repository root."""
    cmd = [sys.executable, "-m", module] + [str(a) for a in args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, input=input,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def preprocess_translation_data(data_dir, extra_flags=()):
    run_cli("preprocess", [
        "--source-lang", "in", "--target-lang", "out",
        "--trainpref", os.path.join(data_dir, "train"), "--validpref", os.path.join(data_dir, "valid"),
        "--testpref", os.path.join(data_dir, "test"), "--thresholdtgt", "0", "--thresholdsrc", "0",
        "--destdir", data_dir, "--workers", "1", *extra_flags,
    ])


def train_args(data_dir, arch, extra_flags=(), task="translation", user_dir=USER_DIR, max_epoch=1):
    args = [
        data_dir, "--task", task, "--arch", arch, "--save-dir", data_dir,
        "--optimizer", "nag", "--lr", "0.05", "--max-tokens", "500", "--max-epoch", str(max_epoch),
        "--no-progress-bar", "--num-workers", "0", "--source-lang", "in", "--target-lang", "out", "--seed", "1",
        "--log-format", "json", "--log-interval", "1",
    ]
    if user_dir:
        args += ["--user-dir", user_dir]
    return args + list(extra_flags)


def train_translation_model(data_dir, arch, extra_flags=(), task="translation", run_validation=False,
                            user_dir=USER_DIR, max_epoch=1):
    proc = run_cli("train", train_args(data_dir, arch, extra_flags, task, user_dir, max_epoch))
    if run_validation:
        run_cli("validate", [data_dir, "--task", task, "--path", os.path.join(data_dir, "checkpoint_last.pt"),
                             "--valid-subset", "valid", "--max-tokens", "500", "--num-workers", "0",
                             "--source-lang", "in", "--target-lang", "out"]
                + (["--user-dir", user_dir] if user_dir else []))
    return proc


def generate_main(data_dir, extra_flags=None, path=None, task="translation", user_dir=USER_DIR, interactive=True):
    """fairseq-generate on the valid set (beam 3), then fairseq-interactive on "h e l l o", like fairseq's
    tests/utils.generate_main. Returns (generate stdout, interactive stdout or None)."""
    extra_flags = ["--print-alignment"] if extra_flags is None else list(extra_flags)
    path = path or os.path.join(data_dir, "checkpoint_last.pt")
    common = [data_dir, "--task", task, "--path", path, "--beam", "3", "--max-len-b", "5",
              "--no-progress-bar", "--num-workers", "0", "--source-lang", "in", "--target-lang", "out"]
    if user_dir:
        common += ["--user-dir", user_dir]
    gen = run_cli("generate", common + ["--batch-size", "64", "--gen-subset", "valid"] + extra_flags).stdout
    inter = None
    if interactive:
        inter = run_cli("interactive", common + ["--buffer-size", "0"] + extra_flags, input="h e l l o\n").stdout
    return gen, inter


def hypotheses(generate_stdout):
    """{sentence id: (score, hypothesis string)} of the first hypothesis per sentence ('H-' lines)."""
    out = {}
    for line in generate_stdout.splitlines():
        if line.startswith("H-"):
            head, score, text = line.split("\t", 2) if line.count("\t") >= 2 else (*line.split("\t"), "")
            idx = int(head[2:])
            out.setdefault(idx, (float(score), text))
    return out


def assert_close(a, b, atol=1e-5, msg=""):
    assert a.shape == b.shape, f"{msg}: shapes {tuple(a.shape)} != {tuple(b.shape)}"
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, atol=atol, rtol=0), f"{msg}: max abs diff {diff} > {atol}"


# a 2+2-layer width-32 transformer with shared embeddings: the tiny models the SAT CLI tests train
TINY_SHARED_CLI = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
                   "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
                   "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--share-all-embeddings",
                   "--dropout", "0.0"]


def assert_one_line_error(proc, *fragments):
    """A command that failed with one ``error:`` line (the last of stderr, no traceback) holding every fragment."""
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


def legacy_checkpoint(state, **args):
    """A copy of a checkpoint ``state`` with legacy ``args`` (what fairseq < 0.10 wrote): the flat args, no cfg;
    ``args`` set on them."""
    import copy

    state = copy.deepcopy(state)
    state["args"] = copy.deepcopy(state["cfg"]["model"])
    state["cfg"] = None
    for k, v in args.items():
        setattr(state["args"], k, v)
    return state


def run_parallel(jobs, workers=2):
    """{name: job()} for ``jobs`` ({name: a function of no arguments}), ``workers`` at a time (command lines that
    wait on their child processes)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}
