"""Safe checkpoint loading under torch >= 2.6 (weights_only=True with an allow-list), refusal of malicious,
truncated and corrupted files with one clear line, atomic checkpoint copies, and checkpoint averaging."""

import argparse
import collections
import os
import re
import shutil

import pytest
import torch

from fairseq_ext.checkpoints import average as avg
from fairseq_ext import checkpoints
from tests.helpers import USER_DIR, run_cli, run_module


class _Exploit:
    """Pickles as a call of os.system: what a malicious checkpoint does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _generate_args(data_dir, path):
    return [data_dir, "--task", "translation", "--path", path, "--user-dir", USER_DIR, "--gen-subset", "valid",
            "--beam", "2", "--batch-size", "64", "--num-workers", "0", "--source-lang", "in", "--target-lang", "out"]


def _assert_one_line_error(proc, *fragments):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


def test_torch_load_keeps_weights_only_after_importing_the_plugin(tmp_path):
    """After ``import fairseq_ext``: a plain ``torch.load`` keeps torch's weights-only default (the plugin widens
    nothing outside its loaders), and every load fairseq makes goes through the plugin's loader even where fairseq
    asks for ``weights_only=False`` (fairseq main does), so the pickled call never runs while a genuine checkpoint
    (argparse.Namespace and omegaconf objects) loads. Without the plugin's loader fairseq's own ``torch.load`` would
    run the payload (or refuse the genuine checkpoint)."""
    import pickle

    import fairseq_ext  # noqa: F401
    from fairseq import checkpoint_utils

    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in os.environ
    marker = tmp_path / "pwned"
    torch.save({"x": _Exploit(marker)}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(tmp_path / "evil.pt")
    with open(tmp_path / "evil.pt", "rb") as f, pytest.raises(pickle.UnpicklingError, match="system"):
        checkpoint_utils.torch.load(f, map_location="cpu", weights_only=False)  # as fairseq main calls it
    with pytest.raises(checkpoints.UnsafeCheckpointError, match="refusing to load checkpoint .*evil.pt"):
        checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "evil.pt"))
    assert not marker.exists()
    release = os.path.join(os.path.dirname(USER_DIR), "releases", "bible-de-en", "transformer.pt")
    if os.path.isfile(release):
        assert isinstance(checkpoint_utils.load_checkpoint_to_cpu(release)["cfg"]["model"], argparse.Namespace)


def test_real_checkpoint_loads_with_weights_only(tiny_transformer_dir):
    from fairseq import checkpoint_utils

    path = os.path.join(tiny_transformer_dir, "checkpoint_last.pt")
    state = checkpoints.load_checkpoint_file(path)  # weights_only=True with the allow-list
    assert isinstance(state["cfg"]["model"], argparse.Namespace)  # fairseq stores legacy model args so
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    assert "model" in state and state["cfg"]["model"].arch == "transformer_iwslt_de_en"


def test_malicious_checkpoint_is_refused_in_process(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "args": _Exploit(marker)}, path)
    from fairseq import checkpoint_utils

    with pytest.raises(checkpoints.UnsafeCheckpointError,
                       match=r"refusing to load checkpoint .*evil\.pt: it pickles (posix|os)\.system"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    with pytest.raises(checkpoints.UnsafeCheckpointError):
        checkpoints.load_checkpoint_file(str(path))
    assert not marker.exists()


def test_malicious_checkpoint_is_refused_by_fairseq_generate(tiny_transformer_dir, tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    state = checkpoints.load_checkpoint_file(os.path.join(tiny_transformer_dir, "checkpoint_last.pt"))
    state["extra_state"]["payload"] = _Exploit(marker)
    torch.save(state, path)
    proc = run_cli("generate", _generate_args(tiny_transformer_dir, str(path)), check=False)
    _assert_one_line_error(proc, "refusing to load checkpoint", str(path))
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_checkpoint_gives_one_clear_line(tiny_transformer_dir, tmp_path, damage):
    path = tmp_path / f"{damage}.pt"
    data = open(os.path.join(tiny_transformer_dir, "checkpoint_last.pt"), "rb").read()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00not a checkpoint" * 100)
    with pytest.raises(checkpoints.CorruptCheckpointError, match="is truncated or corrupted, or not a checkpoint"):
        checkpoints.load_checkpoint_file(str(path))
    if damage == "truncated":
        proc = run_cli("generate", _generate_args(tiny_transformer_dir, str(path)), check=False)
        _assert_one_line_error(proc, "is truncated or corrupted", str(path))


def test_checkpoint_copies_are_atomic(tmp_path, monkeypatch):
    from fairseq.file_io import PathManager

    src, dst = tmp_path / "checkpoint5.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(b"new" * 1000)
    dst.write_bytes(b"old")

    def dying_copyfile(a, b):  # the process dies half way through the copy
        open(b, "wb").write(b"ne")
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copyfile", dying_copyfile)
    with pytest.raises(KeyboardInterrupt):
        PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["checkpoint5.pt", "checkpoint_last.pt"]
    monkeypatch.undo()
    assert PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == src.read_bytes()


def test_broadcast_checkpoint_state_loads_on_other_ranks(tiny_transformer_dir):
    """``--restore-file`` on 2+ ranks: rank 0 reads the checkpoint and broadcasts it (fairseq's broadcast_object
    torch.saves it with its tensors replaced by placeholders); the other ranks' torch.load of it must accept
    what ours accepts, and nothing more."""
    import io
    import pickle

    from fairseq.distributed import utils as distributed_utils

    state = checkpoints.load_checkpoint_file(os.path.join(tiny_transformer_dir, "checkpoint_last.pt"))
    tensors = []
    buffer = io.BytesIO()
    torch.save(distributed_utils._split_tensors_from_obj(state, tensors), buffer)
    got = distributed_utils.torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu")  # what rank 1 runs
    got = distributed_utils._put_tensors_in_obj(got, tensors)
    assert got["cfg"]["model"].arch == "transformer_iwslt_de_en" and got["model"].keys() == state["model"].keys()
    with pytest.raises(pickle.UnpicklingError):  # the allow-list was for that load only
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    evil = io.BytesIO()
    torch.save({"x": _Exploit("/nonexistent/marker")}, evil)
    with pytest.raises(pickle.UnpicklingError, match="system"):
        distributed_utils.torch.load(io.BytesIO(evil.getvalue()), map_location="cpu")


@pytest.mark.slow
def test_restore_file_on_two_ranks(tiny_transformer_dir, tmp_path):
    """fairseq-train --restore-file with --distributed-world-size 2 (gloo on CPU): rank 1 gets the checkpoint
    from rank 0 (it failed with 'Unsupported global: GLOBAL omegaconf.dictconfig.DictConfig' /
    '_TensorPlaceholder')."""
    import socket
    import subprocess
    import sys

    from tests.conftest import TINY_TRANSFORMER
    from tests.helpers import train_args

    d = str(tmp_path / "data")
    shutil.copytree(tiny_transformer_dir, d)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in (0, 1):
        argv = train_args(d, "transformer_iwslt_de_en", TINY_TRANSFORMER + [
            "--restore-file", "checkpoint_last.pt", "--ddp-backend", "legacy_ddp", "--distributed-backend", "gloo",
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-world-size", "2",
            "--distributed-rank", str(rank), "--distributed-no-spawn", "--cpu"], max_epoch=3)
        procs.append(subprocess.Popen([sys.executable, "-m", "fairseq_cli.train"] + argv, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch 3 @ \d+ updates\)", outs[0]), outs[0][-3000:]
    assert os.path.isfile(os.path.join(d, "checkpoint3.pt"))


# ---- averaging ----

def _fake_checkpoints(directory, names, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = []
    for i, name in enumerate(names):
        model = collections.OrderedDict(
            w=torch.randn(7, 5, generator=g),
            h=torch.randn(3, generator=g).half(),
            steps=torch.tensor([i * 3 + 1, 2 * i]),
        )
        state = {"model": model, "args": argparse.Namespace(arch="x", i=i), "extra_state": {"epoch": i},
                 "optimizer_history": []}
        torch.save(state, os.path.join(directory, name))
        states.append(state)
    return states


def _expected_mean(states):
    mean = collections.OrderedDict()
    for k, ref in states[0]["model"].items():
        if ref.is_floating_point():
            mean[k] = (sum(s["model"][k].double() for s in states) / len(states)).to(ref.dtype)
        else:
            mean[k] = sum(s["model"][k] for s in states) // len(states)
    return mean


def test_average_is_the_exact_elementwise_mean(tmp_path):
    names = ["checkpoint1.pt", "checkpoint2.pt", "checkpoint3.pt", "checkpoint10.pt"]
    states = dict(zip(names, _fake_checkpoints(tmp_path, names)))
    out = tmp_path / "avg.pt"
    assert avg.main(["--inputs", str(tmp_path), "--num-epoch-checkpoints", "3", "--output", str(out)]) == 0
    got = checkpoints.load_checkpoint_file(str(out))
    chosen = [states["checkpoint10.pt"], states["checkpoint3.pt"], states["checkpoint2.pt"]]  # newest 3 epochs
    expected = _expected_mean(chosen)
    for k in expected:
        assert got["model"][k].dtype == expected[k].dtype and torch.equal(got["model"][k], expected[k]), k
    assert got["args"].i == states["checkpoint10.pt"]["args"].i  # the rest comes from the newest


def test_average_by_update_and_upper_bound_through_the_cli(tmp_path):
    names = ["checkpoint_1_100.pt", "checkpoint_1_200.pt", "checkpoint_2_300.pt", "checkpoint_2_400.pt",
             "checkpoint2.pt"]
    states = dict(zip(names, _fake_checkpoints(tmp_path, names, seed=1)))
    out = tmp_path / "avg.pt"
    run_module("fairseq_ext.average_checkpoints", ["--inputs", tmp_path, "--num-update-checkpoints", "2",
                                                   "--checkpoint-upper-bound", "300", "--output", out])
    got = checkpoints.load_checkpoint_file(str(out))["model"]
    expected = _expected_mean([states["checkpoint_2_300.pt"], states["checkpoint_1_200.pt"]])
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_average_errors_are_clear(tmp_path, capsys):
    _fake_checkpoints(tmp_path, ["checkpoint1.pt"])
    out = tmp_path / "avg.pt"
    assert avg.main(["--inputs", str(tmp_path), "--num-epoch-checkpoints", "2", "--output", str(out)]) == 1
    assert "found 1 epoch checkpoints" in capsys.readouterr().err and not out.exists()
    torch.save({"model": {"other": torch.zeros(1)}}, tmp_path / "b.pt")
    assert avg.main(["--inputs", str(tmp_path / "checkpoint1.pt"), str(tmp_path / "b.pt"), "--output", str(out)]) == 1
    assert "average checkpoints of one model only" in capsys.readouterr().err and not out.exists()


def test_batching_keeps_every_sentence():
    # fairseq main drops a last batch whose size is not a multiple of --required-batch-size-multiple
    import numpy as np

    import fairseq_ext  # noqa: F401
    from fairseq.data import data_utils

    for sizes, max_tokens, max_sentences in (([21] * 100, None, 64), (list(range(1, 78)), 300, None)):
        idx = np.arange(len(sizes), dtype=np.int64)
        for vec in (np.array(sizes, dtype=np.int64), None):
            batches = data_utils.batch_by_size(idx, num_tokens_fn=lambda i: sizes[i], num_tokens_vec=vec,
                                               max_tokens=max_tokens, max_sentences=max_sentences,
                                               required_batch_size_multiple=8)
            assert np.array_equal(np.concatenate(batches), idx)
            if max_sentences == 64:
                assert [len(b) for b in batches] == [64, 32, 4]


def test_one_line_error_and_the_traceback_on_request(tmp_path):
    """A FairseqExtError from a tool is one `error:` line; FAIRSEQ_EXT_TRACEBACK=1 adds the traceback."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    cmd = [sys.executable, "-m", "fairseq_ext.average_checkpoints", "--inputs", str(tmp_path / "missing.pt"),
           "--output", str(tmp_path / "avg.pt")]
    plain = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, FAIRSEQ_EXT_TRACEBACK="0"))
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert plain.stderr.strip().splitlines()[-1].startswith("error: ") and "missing.pt" in plain.stderr
    full = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, FAIRSEQ_EXT_TRACEBACK="1"))
    assert full.returncode == 1 and "Traceback" in full.stderr and full.stderr.strip().splitlines()[-1] == \
        plain.stderr.strip().splitlines()[-1]
