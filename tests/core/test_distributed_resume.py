"""Multi-process training and exact resume of every architecture.

* 2 ranks (``--distributed-world-size 2``, gloo on CPU, explicit ``tcp://127.0.0.1`` init, one process per
  rank, ``--ddp-backend legacy_ddp`` and ``pytorch_ddp --find-unused-parameters``) see exactly the batches of
  one process with ``--update-freq 2`` (rank r takes batches r, r+2, ...; one process takes batches 2u, 2u+1
  for update u), and their losses and final parameters agree. Dropout is 0 in this comparison: fairseq reseeds
  once per update, so the second batch of an update draws other dropout masks on rank 1 than in one process.
* A run killed with SIGKILL right after a checkpoint in the middle of epoch 2 and resumed with ``--restore-file
  checkpoint_last.pt`` replays the same batches with the same losses (bit for bit, dropout 0.1) into epoch 3
  and ends with the same parameters, optimizer and iterator state as an uninterrupted run (this needs
  fairseq_ext.common.fairseq_fixes' fix of the batches of a resumed run, see docs/RELIABILITY.md).
* A kill inside the write of a checkpoint, or inside fairseq's copy of it to ``checkpoint_last.pt``, leaves the
  previous ``checkpoint_last.pt`` byte for byte and loadable.
* ``python -m fairseq_ext.checkpoints.long_run_check`` in its smallest mode.

Every training is the real ``fairseq-train`` entry point (``fairseq_cli.train.cli_main``) in its own process,
with ``--user-dir fairseq_ext``. To stay within the test budget on 2 cores, the processes are forked from one
server process that has imported torch, fairseq and the plugin once (about 9 s of CPU per fresh
``fairseq-train`` otherwise); a child only parses its command line and trains. A child can record, per update,
the sample ids of each batch and the unrounded loss the json log prints, or stop at a chosen point (after a
checkpoint, inside a save) so that the test kills it there deterministically.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import TINY_TRANSFORMER
from tests.helpers import ROOT, USER_DIR, create_dummy_data, run_module, train_args

# ------------------------------------------------------------------------------------------------------
# the fork server
# ------------------------------------------------------------------------------------------------------

_SERVER = r'''
import json, os, shutil, sys, time, traceback
import torch
torch.set_num_threads(1)
from argparse import Namespace
import fairseq_cli.preprocess as fairseq_preprocess
import fairseq_cli.train as fairseq_train
from fairseq import utils as fairseq_utils
fairseq_utils.import_user_module(Namespace(user_dir=sys.argv[1]))
try:  # bert_jam imports transformers lazily: once here rather than in every child
    import transformers.models.bert.modeling_bert  # noqa: F401
except ImportError:
    pass


def pause(req):
    open(req["log"] + ".paused", "w").close()
    time.sleep(3600)


def patch(req):
    from fairseq import checkpoint_utils, trainer
    from fairseq.logging import metrics

    if req.get("record"):
        train_step = trainer.Trainer.train_step

        def recorded_train_step(self, samples, *a, **k):
            ids = [s["id"].tolist() if s else [] for s in samples]
            out = train_step(self, samples, *a, **k)
            meter = metrics.get_meter("train_inner", "loss")
            with open(req["record"], "a") as f:
                f.write(json.dumps({"update": self.get_num_updates(), "ids": ids,
                                    "loss": float(meter.val)}) + "\n")
            return out
        trainer.Trainer.train_step = recorded_train_step
    if req.get("pause_after_save"):
        save = checkpoint_utils.save_checkpoint

        def save_then_pause(cfg, trainer, epoch_itr, val_loss):
            out = save(cfg, trainer, epoch_itr, val_loss)
            if trainer.get_num_updates() == req["pause_after_save"]:
                pause(req)
            return out
        checkpoint_utils.save_checkpoint = save_then_pause
    if req.get("pause_in_write"):  # inside torch.save of this file: half of it written
        torch_save, name = torch.save, req["pause_in_write"]

        def half_save(obj, f, *a, **k):
            if getattr(f, "name", "").endswith(name):
                import io
                buf = io.BytesIO()
                torch_save(obj, buf, *a, **k)
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                pause(req)
            return torch_save(obj, f, *a, **k)
        torch.save = half_save
    if req.get("pause_in_copy"):  # inside the copy of this file to checkpoint_last.pt: half copied
        copyfile, name = shutil.copyfile, req["pause_in_copy"]

        def half_copy(src, dst, *a, **k):
            if str(src).endswith(name) and "checkpoint_last.pt" in str(dst):
                data = open(src, "rb").read()
                with open(dst, "wb") as f:
                    f.write(data[: len(data) // 2])
                pause(req)
            return copyfile(src, dst, *a, **k)
        shutil.copyfile = half_copy


def child(req):
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    code = 1
    try:
        patch(req)
        tool = req.get("tool", "train")
        sys.argv = ["fairseq-" + tool] + req["argv"]
        (fairseq_preprocess if tool == "preprocess" else fairseq_train).cli_main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


out = sys.stdout
print(json.dumps({"ready": True}), file=out, flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["cmd"] == "start":
        out.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(req)
        print(json.dumps({"pid": pid}), file=out, flush=True)
    elif req["cmd"] == "wait":
        deadline = time.time() + req["timeout"]
        while True:
            done, status = os.waitpid(req["pid"], os.WNOHANG)
            if done:
                print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=out, flush=True)
                break
            if time.time() > deadline:
                os.kill(req["pid"], 9)
                os.waitpid(req["pid"], 0)
                print(json.dumps({"rc": "timeout"}), file=out, flush=True)
                break
            time.sleep(0.05)
    else:
        break
'''


class TrainServer:
    """Forks ``fairseq-train`` runs (``fairseq_cli.train.cli_main`` with the given argv) from one process."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, USER_DIR], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def _call(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, argv, log, **patches):
        """Fork ``fairseq-train argv`` (or ``tool="preprocess"``), stdout and stderr to ``log``; its pid."""
        return self._call(cmd="start", argv=[str(a) for a in argv], log=str(log), **patches)["pid"]

    def wait(self, pid, log, timeout=240, expect=0):
        rc = self._call(cmd="wait", pid=pid, timeout=timeout)["rc"]
        if rc != expect:
            tail = open(log).read()[-5000:] if os.path.exists(log) else "(no log)"
            raise AssertionError(f"fairseq-train exited with {rc}, expected {expect}; log {log}:\n{tail}")

    def close(self):
        self.proc.kill()  # every child has been waited for
        self.proc.wait()


@pytest.fixture(scope="module")
def server():
    s = TrainServer()
    yield s
    s.close()


# ------------------------------------------------------------------------------------------------------
# data and architectures
# ------------------------------------------------------------------------------------------------------

FCONV = ["--encoder-embed-dim", "16", "--encoder-layers", "[(16, 3)] * 2", "--decoder-embed-dim", "16",
         "--decoder-layers", "[(16, 3)] * 2", "--decoder-out-embed-dim", "16"]
MSC = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
       "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
       "--encoder-blocks", "2", "--encoder-layers-per-block", "1", "--share-all-embeddings",
       "--criterion", "label_smoothed_cross_entropy_l2", "--label-smoothing", "0.1", "--l2-lambda", "1e-5"]
BERT_JAM = TINY_TRANSFORMER + ["--share-all-embeddings", "--criterion", "label_smoothed_cross_entropy",
                               "--label-smoothing", "0.1"]
# name: (task, arch, flags); bert_jam's --bert-model-name is added by the data fixture
ARCHS = {
    "transformer": ("translation", "transformer", TINY_TRANSFORMER),
    "fconv_glu": ("translation", "fconv_glu", FCONV),
    "sat_transformer": ("translation_sat", "sat_transformer", TINY_TRANSFORMER + [
        "--sat-group-size", "2", "--share-all-embeddings", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1"]),
    "msc_transformer": ("translation", "msc_transformer", MSC),
    "bert_jam_phase1": ("translation_bert", "bert_jam", BERT_JAM + ["--bert-jam-phase", "1"]),
    "bert_jam_phase2": ("translation_bert", "bert_jam", BERT_JAM + ["--bert-jam-phase", "2"]),
}
# 64 sentences in fixed batches of 8: 8 batches per epoch, 4 updates of 2 batches; 6 updates cross into epoch 2
UPDATES = 6
BATCHES = ["--batch-size", "8", "--max-tokens", "4096", "--required-batch-size-multiple", "1",
           "--max-update", str(UPDATES), "--max-epoch", "5", "--disable-validation", "--save-interval-updates", "2",
           "--no-epoch-checkpoints", "--cpu"]


@pytest.fixture(scope="module")
def data(server, tmp_path_factory):
    from tests.builders import write_tiny_bert

    d = str(tmp_path_factory.mktemp("dist_data"))
    create_dummy_data(d, num_examples=64, maxlen=12)
    log = os.path.join(d, "preprocess.log")
    server.wait(server.start([  # = tests.helpers.preprocess_translation_data, forked
        "--source-lang", "in", "--target-lang", "out", "--joined-dictionary", "--trainpref", f"{d}/train",
        "--validpref", f"{d}/valid", "--testpref", f"{d}/test", "--thresholdtgt", "0", "--thresholdsrc", "0",
        "--destdir", d, "--workers", "1"],
        log, tool="preprocess"), log)
    bert = write_tiny_bert(os.path.join(d, "tinybert"))
    # BERT-JAM runs BERT in train mode, so BERT's own dropout (0.1 in BertConfig) is active even while it is
    # frozen (phases 1-2): without --dropout's reach, it would draw other masks on rank 1 (see the module doc)
    with open(os.path.join(bert, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with open(os.path.join(bert, "config.json"), "w") as f:
        json.dump(config, f)
    return {"dir": d, "bert": bert}


def argv(data, name, save_dir, extra=()):
    task, arch, flags = ARCHS[name]
    if task == "translation_bert":
        flags = flags + ["--bert-model-name", data["bert"]]
    return train_args(data["dir"], arch, flags + BATCHES + ["--save-dir", save_dir] + list(extra), task=task)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed(rank, port, backend):
    flags = ["--ddp-backend", backend, "--distributed-backend", "gloo", "--distributed-init-method",
             f"tcp://127.0.0.1:{port}", "--distributed-world-size", "2", "--distributed-rank", str(rank),
             "--distributed-no-spawn"]
    return flags + (["--find-unused-parameters"] if backend == "pytorch_ddp" else [])


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def json_log(path):
    """The train_inner records of a --log-format json log, by num_updates."""
    out = {}
    for line in open(path):
        if "train_inner" in line and "{" in line:
            rec = json.loads(line[line.index("{"):])
            out[int(rec["num_updates"])] = rec
    return out


def load(path):
    from fairseq_ext.checkpoints import load_checkpoint_file

    return load_checkpoint_file(path)


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


class Run:
    def __init__(self, root, name):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir, exist_ok=True)
        self.log, self.rec = os.path.join(self.dir, "log"), os.path.join(self.dir, "rec")
        self.ckpt = os.path.join(self.dir, "checkpoint_last.pt")


# ------------------------------------------------------------------------------------------------------
# 2 ranks == 1 process with --update-freq 2
# ------------------------------------------------------------------------------------------------------

_single = {}


@pytest.mark.parametrize("backend", ["legacy_ddp", "pytorch_ddp"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_two_ranks_equal_one_process_with_update_freq_2(server, data, tmp_path, name, backend):
    nodrop = ["--dropout", "0"]
    single = _single.get(name)
    pids = []
    if single is None:  # shared by both backends
        single = _single[name] = Run(os.path.join(data["dir"], "single"), name)
        pids.append((single, server.start(argv(data, name, single.dir, nodrop + ["--update-freq", "2"]),
                                          single.log, record=single.rec)))
    port = free_port()
    ranks = [Run(str(tmp_path), f"rank{r}") for r in (0, 1)]
    for r, run in enumerate(ranks):
        pids.append((run, server.start(argv(data, name, run.dir, nodrop + distributed(r, port, backend)),
                                       run.log, record=run.rec)))
    for run, pid in pids:
        server.wait(pid, run.log)

    one, r0, r1 = records(single.rec), records(ranks[0].rec), records(ranks[1].rec)
    assert [x["update"] for x in one] == [x["update"] for x in r0] == [x["update"] for x in r1] == \
        list(range(1, UPDATES + 1))
    losses = []
    for a, b, c in zip(one, r0, r1):
        # the same batches: update u of one process is batch 2u-1 and 2u; rank 0 takes the first, rank 1 the second
        assert len(a["ids"]) == 2 and len(a["ids"][0]) == 8 and len(a["ids"][1]) == 8, a
        assert b["ids"] == [a["ids"][0]] and c["ids"] == [a["ids"][1]], (a, b, c)
        # the loss of the update (both batches: the ranks log the all-reduced value)
        assert abs(a["loss"] - b["loss"]) < 1e-4 and b["loss"] == c["loss"], (a["loss"], b["loss"], c["loss"])
        losses.append(a["loss"])
    assert len(set(ids for rec in one for ids in map(tuple, rec["ids"]))) == 8  # the whole epoch, and more
    assert losses[-1] < losses[0]  # the model learns: the comparison is not between two untrained models
    # the json log prints the same losses, rounded to 3 decimals
    log_one, log_r0 = json_log(single.log), json_log(ranks[0].log)
    for u in range(1, UPDATES + 1):
        assert abs(float(log_one[u]["loss"]) - float(log_r0[u]["loss"])) <= 1.001e-3
        assert abs(float(log_one[u]["loss"]) - losses[u - 1]) <= 5.01e-4
    # final parameters
    a, b = load(single.ckpt), load(ranks[0].ckpt)
    assert a["optimizer_history"][-1]["num_updates"] == b["optimizer_history"][-1]["num_updates"] == UPDATES
    assert max_diff(a["model"], b["model"]) < 1e-5
    assert not os.path.exists(os.path.join(ranks[1].dir, "checkpoint_last.pt"))  # rank 0 saves
    if name.startswith("bert_jam"):
        _check_frozen(a["model"], b["model"], data["bert"], phase=int(name[-1]))


def _check_frozen(one, dist, bert_dir, phase):
    """BERT stays bit for bit the pre-trained one in phases 1 and 2; the GLUs stay at Eq. 11 in phase 1 only."""
    from safetensors.torch import load_file

    files = [f for f in os.listdir(bert_dir) if f.endswith(".safetensors")]
    pretrained = load_file(os.path.join(bert_dir, files[0]))
    bert = {k: v for k, v in one.items() if ".bert." in k or k.startswith("bert.")}
    if not bert:  # phase 1-2 checkpoints hold the content hash of the pre-trained BERT, not its weights
        from fairseq_ext.bert_jam.bert import bert_content_sha256, build_bert

        digest = bert_content_sha256(build_bert(bert_dir))
        assert bytes(one["encoder.bert_sha256"].tolist()).hex() == digest, list(one)[:20]
        assert torch.equal(dist["encoder.bert_sha256"], one["encoder.bert_sha256"])
    for k, v in bert.items():
        name = k.split("bert.", 1)[1]
        ref = pretrained.get(name, pretrained.get("bert." + name))
        assert ref is not None and torch.equal(v, ref) and torch.equal(dist[k], ref), k
    alphas = [k for k in one if k.endswith("bert_composition.alpha")]
    assert alphas
    for k in alphas:
        at_init = torch.zeros_like(one[k])
        at_init[-1] = 1
        assert torch.equal(one[k], at_init) == (phase == 1), (k, one[k])


# ------------------------------------------------------------------------------------------------------
# SIGKILL after a mid-epoch checkpoint, resume, same trajectory and model
# ------------------------------------------------------------------------------------------------------

# 10 updates: epoch 1 (updates 1-4), epoch 2 (5-8), epoch 3; a checkpoint every 3 updates, the kill after update 6
RESUME = ["--dropout", "0.1", "--update-freq", "2", "--max-update", "10", "--save-interval-updates", "3"]
_reference = {}


def reference(server, data, name):
    """The uninterrupted run (RESUME: dropout 0.1, --update-freq 2, 10 updates), once per arch."""
    if name not in _reference:
        run = Run(os.path.join(data["dir"], "reference"), name)
        server.wait(server.start(argv(data, name, run.dir, RESUME), run.log, record=run.rec), run.log)
        _reference[name] = run
    return _reference[name]


def kill_when_paused(server, pid, run, timeout=240):
    deadline = time.time() + timeout
    while not os.path.exists(run.log + ".paused"):
        assert time.time() < deadline, open(run.log).read()[-3000:]
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    server.wait(pid, run.log, expect=-signal.SIGKILL)


@pytest.mark.parametrize("name", list(ARCHS))
def test_sigkill_mid_epoch_and_resume_is_exact(server, data, tmp_path, name):
    run = Run(str(tmp_path), "killed")
    pid = server.start(argv(data, name, run.dir, RESUME), run.log, record=run.rec, pause_after_save=6)
    ref = reference(server, data, name)  # runs meanwhile
    kill_when_paused(server, pid, run)
    state = load(run.ckpt)
    itr = state["extra_state"]["train_iterator"]
    assert state["optimizer_history"][-1]["num_updates"] == 6
    assert (itr["epoch"], itr["iterations_in_epoch"]) == (2, 4)  # mid-epoch 2: 4 of 8 batches
    killed = records(run.rec)
    assert [r["update"] for r in killed] == [1, 2, 3, 4, 5, 6]

    server.wait(server.start(argv(data, name, run.dir, RESUME + ["--restore-file", "checkpoint_last.pt"]),
                             run.log + ".resumed", record=run.rec), run.log + ".resumed")
    resumed, uninterrupted = records(run.rec), records(ref.rec)
    # the same batches (the rest of epoch 2, then epoch 3) and bit-identical losses
    assert resumed == uninterrupted and len(resumed) == 10
    log_a, log_b = json_log(ref.log), json_log(run.log + ".resumed")
    assert sorted(log_b) == [7, 8, 9, 10]
    for u in log_b:
        assert (log_a[u]["loss"], log_a[u]["gnorm"]) == (log_b[u]["loss"], log_b[u]["gnorm"])
    a, b = load(ref.ckpt), load(run.ckpt)
    assert a["optimizer_history"][-1]["num_updates"] == b["optimizer_history"][-1]["num_updates"] == 10
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert _tensors(a["last_optimizer_state"]) == _tensors(b["last_optimizer_state"])
    assert a["extra_state"]["train_iterator"] == b["extra_state"]["train_iterator"]


def _tensors(obj):
    """Nested state as comparable Python values (tensors as lists)."""
    if torch.is_tensor(obj):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tensors(v) for v in obj]
    return obj


@pytest.mark.parametrize("where", ["pause_in_write", "pause_in_copy"])
def test_kill_during_a_save_leaves_the_previous_checkpoint(server, data, tmp_path, where):
    """A checkpoint every update. Kill while checkpoint_1_2.pt is half written (fairseq writes it to .tmp, then
    renames it) or while fairseq copies it to checkpoint_last.pt (fairseq_ext.checkpoints makes that copy atomic):
    checkpoint_last.pt is still the update-1 checkpoint, byte for byte, and loads; resuming from it ends with
    the uninterrupted run's model."""
    name = "transformer"
    run = Run(str(tmp_path), "killed")
    every = RESUME + ["--save-interval-updates", "1"]
    target = "checkpoint_1_2.pt" + (".tmp" if where == "pause_in_write" else "")
    pid = server.start(argv(data, name, run.dir, every), run.log, **{where: target})
    kill_when_paused(server, pid, run)
    with open(os.path.join(run.dir, "checkpoint_1_1.pt"), "rb") as f, open(run.ckpt, "rb") as g:
        assert f.read() == g.read()
    assert load(run.ckpt)["optimizer_history"][-1]["num_updates"] == 1
    half = os.path.join(run.dir, target if where == "pause_in_write" else f"checkpoint_last.pt.tmp.{pid}")
    assert os.path.getsize(half) > 0  # the kill did hit a half-written file
    with pytest.raises(Exception, match="truncated or corrupted"):
        load(half)
    if where == "pause_in_write":
        assert not os.path.exists(os.path.join(run.dir, "checkpoint_1_2.pt"))
    else:
        assert load(os.path.join(run.dir, "checkpoint_1_2.pt"))["optimizer_history"][-1]["num_updates"] == 2
    server.wait(server.start(argv(data, name, run.dir, every), run.log + ".resumed"), run.log + ".resumed")
    assert "Loaded checkpoint" in open(run.log + ".resumed").read()
    a, b = load(reference(server, data, name).ckpt), load(run.ckpt)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


# ------------------------------------------------------------------------------------------------------
# the long-run check, smallest mode
# ------------------------------------------------------------------------------------------------------

def test_long_run_check_small_mode(data, tmp_path):
    out = run_module("fairseq_ext.checkpoints.long_run_check", [
        "--arch", "transformer", "--data", data["dir"], "--source-lang", "in", "--target-lang", "out",
        "--tiny", "--minutes", "0.05", "--kills", "1", "--kill-every", "0.3", "--workdir", str(tmp_path),
        "--save-interval-updates", "2",
        "--max-tokens", "200",
    ], timeout=300).stdout
    resumed = re.search(r"^kills: 1; resumed from update \[(\d+)\]; both runs end at update (\d+)$", out, re.M)
    assert resumed and 0 < int(resumed.group(1)) < int(resumed.group(2)), out  # it did resume from a checkpoint
    assert re.search(r"^logged losses compared: \d+ records of the interrupted segments, 0 differ", out, re.M), out
    assert re.search(r"^max abs parameter difference: 0 over \d+ tensors", out, re.M), out
    assert out.splitlines()[-1].startswith("OK: 1 kills and resumes"), out
