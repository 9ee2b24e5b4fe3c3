"""Process runner of python -m benchmarks.compare: every job (a fairseq CLI, a package tool, checkpoint averaging, the
evaluation of a checkpoint) runs in a child forked from one server that has imported fairseq once; the child's
``ru_maxrss`` is the job's peak memory."""

import json
import multiprocessing
import os
import re
import sys
import time
import traceback
from unittest import mock

from .specs import GEN_BOUND


class CompareError(Exception):
    """A one-line error for the user (bad flag, missing file, a failed step with its log)."""


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)  # insertion order: the models in the order of the run
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------------------
# jobs: run in children forked from a server that imported fairseq once
# ---------------------------------------------------------------------------------------------------------
def _cli(module, argv):
    import importlib

    sys.argv = [module] + [str(a) for a in argv]
    importlib.import_module(module).cli_main()


def _module_main(module, argv):
    import importlib

    rc = importlib.import_module(module).main([str(a) for a in argv])
    if isinstance(rc, int) and rc != 0:
        raise SystemExit(rc)


def _average(ckpt_dir, output):
    """Average the newest two epoch checkpoints and checkpoint_last (when it is newer), as the quickstart's
    averaging but without dropping the updates of a last, unfinished epoch."""
    from fairseq_ext import checkpoints
    from fairseq_ext.checkpoints.average import average_checkpoints

    def updates(path):
        return checkpoints.load_checkpoint_file(path)["optimizer_history"][-1]["num_updates"]

    epochs = sorted((int(m.group(1)), n) for n in os.listdir(ckpt_dir)
                    if (m := re.fullmatch(r"checkpoint(\d+)\.pt", n)))
    paths = [os.path.join(ckpt_dir, n) for _, n in epochs[-2:]]
    last = os.path.join(ckpt_dir, "checkpoint_last.pt")
    if not paths or updates(last) != updates(paths[-1]):
        paths.append(last)
    checkpoints.atomic_torch_save(average_checkpoints(paths), output)
    return {"averaged": [os.path.basename(p) for p in paths]}


def _read_refs(path, n):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f][:n]


def _evaluate(ckpt, bin_dir, src, tgt, refs, latency_sentences, batch, valid_only=False):
    """Parameters, BLEU and decoding speed of one checkpoint. ``refs``: {"test": path, "valid": path,
    "test_extra": [paths], "valid_extra": [paths]} (the extra ones line-aligned further references: multi-reference
    BLEU). The valid set is decoded greedily (``bleu_valid_greedy``: what the SAT teacher is chosen by); the test
    set with beam 4 and greedy, timed. ``valid_only``: the valid BLEU alone (BERT-JAM's phase 1-2 checkpoints)."""
    from argparse import Namespace

    import torch
    from fairseq import checkpoint_utils
    from sacrebleu.metrics import BLEU

    import fairseq_ext  # noqa: F401
    from fairseq_ext.inference.default_generator import OFF

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [ckpt], arg_overrides={"data": bin_dir, "source_lang": src, "target_lang": tgt})
    model = models[0].eval()

    def decode(gen, sample):
        with torch.no_grad():
            return task.inference_step(gen, [model], sample)

    def translate(ds, gen):
        """Hypotheses of the whole split in id order (batches of ``batch`` sorted by length), seconds decoding."""
        src_sizes = ds.src_sizes if hasattr(ds, "src_sizes") else ds.dataset.src_sizes  # BERT-JAM: a wrapper
        order = sorted(range(len(ds)), key=lambda i: src_sizes[i])
        hyps, elapsed = {}, 0.0
        for s in range(0, len(order), batch):
            sample = ds.collater([ds[i] for i in order[s: s + batch]])
            t0 = time.perf_counter()
            outs = decode(gen, sample)
            elapsed += time.perf_counter() - t0
            for sid, h in zip(sample["id"].tolist(), outs):
                hyps[sid] = task.target_dictionary.string(h[0]["tokens"], "sentencepiece")
        return [hyps[i] for i in range(len(ds))], elapsed

    def score(hyps, paths):
        bleu = BLEU()
        return bleu.corpus_score(hyps, [_read_refs(p, len(hyps)) for p in paths]).score, str(bleu.get_signature())

    # --task translation decodes with fairseq's SequenceGenerator here, as docs/RESULTS.md says (the package's
    # default generator turned off; --task translation_sat keeps its own)
    with mock.patch.dict(os.environ, {OFF: "1"}):
        generators = {name: task.build_generator([model], Namespace(beam=beam, lenpen=1.0, **GEN_BOUND))
                      for name, beam in (("greedy", 1), ("beam4", 4))}
    out = {"params": sum(p.numel() for p in model.parameters()),
           "params_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    # valid (greedy): the model-selection number; the test set is not looked at for it
    task.load_dataset("valid")
    vds = task.dataset("valid")
    hyps, _ = translate(vds, generators["greedy"])
    out["valid_sentences"] = len(vds)
    out["bleu_valid_greedy"], _ = score(hyps, [refs["valid"]])
    if refs.get("valid_extra"):
        out["bleu_valid_greedy_multiref"], _ = score(hyps, [refs["valid"]] + list(refs["valid_extra"]))
    if valid_only:
        return out
    task.load_dataset("test")
    ds = task.dataset("test")
    out.update({"test_sentences": len(ds), "latency_sentences": min(latency_sentences, len(ds))})
    for name, gen in generators.items():
        decode(gen, ds.collater([ds[0]]))  # warm-up
        t0 = time.perf_counter()
        for i in range(out["latency_sentences"]):
            decode(gen, ds.collater([ds[i]]))
        out[f"latency_b1_ms_{name}"] = 1000 * (time.perf_counter() - t0) / max(1, out["latency_sentences"])
        hyps, elapsed = translate(ds, gen)
        out[f"throughput_b{batch}_sent_s_{name}"] = len(ds) / elapsed
        out[f"bleu_{name}"], out["bleu_signature"] = score(hyps, [refs["test"]])
        if refs.get("test_extra"):
            out[f"bleu_{name}_multiref"], out["bleu_signature_multiref"] = score(
                hyps, [refs["test"]] + list(refs["test_extra"]))
    return out


JOBS = {"cli": _cli, "module": _module_main, "average": _average, "evaluate": _evaluate}


def _child(job, args, log_path, result_path, threads):
    """Body of a child process: output to ``log_path``, the job's return value and peak RSS to ``result_path``."""
    import resource

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    torch.set_num_threads(threads)
    rc, value = 0, None
    try:
        value = JOBS[job](*args)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: B902  (reported in the log, one line in the parent)
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    write_json(result_path, {"rc": rc, "value": value, "maxrss_mb": usage.ru_maxrss / 1024,
                             "cpu_s": usage.ru_utime + usage.ru_stime})


class Runner:
    """Starts jobs as children of one fork server that has imported fairseq and fairseq_ext (it never computes
    anything itself, so forking it is safe), and waits for them, calling ``poll`` every ``poll_s`` seconds."""

    def __init__(self, workdir, threads):
        self.workdir, self.threads, self.ctx = workdir, threads, None
        self.cpu_seconds = 0.0  # CPU time of all jobs

    def run(self, job, args, log_path, what, poll=None, poll_s=2.0, threads=None):
        if self.ctx is None:
            self.ctx = multiprocessing.get_context("forkserver")
            # torch._dynamo: imported by torch's optimizers on first use, slowly: preloaded once here
            self.ctx.set_forkserver_preload(["fairseq_cli.train", "fairseq_cli.generate", "fairseq_cli.preprocess",
                                             "fairseq_ext", "torch._dynamo"])
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        result_path = os.path.join(self.workdir, "tmp", "job-result.json")
        if os.path.exists(result_path):
            os.remove(result_path)
        p = self.ctx.Process(target=_child, args=(job, args, log_path, result_path, threads or self.threads))
        p.start()
        while p.is_alive():
            p.join(poll_s)
            if poll is not None:
                poll()
        res = read_json(result_path)
        self.cpu_seconds += res["cpu_s"] if res else 0.0
        if p.exitcode != 0 or res is None or res["rc"] != 0:
            raise CompareError(f"{what} failed (exit {res['rc'] if res else p.exitcode}); see {log_path}")
        return res

