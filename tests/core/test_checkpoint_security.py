"""Checkpoints that pass the weights_only allow-list but carry code for fairseq to run.

A checkpoint made only of allow-listed objects (an ``argparse.Namespace`` of strings, a cfg dict) still reaches
fairseq's model builders, which ``eval()`` some config strings (fconv's ``encoder_layers``, the
``xformers_att_config`` of every transformer layer, ...). fairseq_ext's loader refuses any such string that is
not a plain literal, any omegaconf ``${...}`` interpolation but a reference to another key, and says so in one
line naming the file and the field. Each hostile checkpoint here is a genuine one (``fairseq-train``'s tiny
transformer) whose ``cfg.model`` was edited: its payload touches a marker file, which must not exist afterwards.
Also: the allow-list is scoped to our loaders, layer specs have a size cap, refused pickles are called refused,
and checkpoint copies are fsynced and leave no temporary files behind after a kill.
"""

import argparse
import copy
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch

import fairseq_ext  # noqa: F401
from fairseq_ext import checkpoints
from fairseq_ext.checkpoints import UnsafeCheckpointError, load_checkpoint_file
from fairseq_ext.common.errors import FairseqExtError
from tests.builders import write_tiny_bert
from tests.conftest import TINY_TRANSFORMER
from tests.helpers import ROOT, USER_DIR, run_cli, run_module, train_args


def payload(marker, result):
    return f"__import__('pathlib').Path({str(marker)!r}).touch() or {result}"


# arch -> (fields of cfg.model, the field holding the payload, what the payload evaluates to)
ARCHS = {
    "fconv_iwslt_de_en": ({"decoder_layers": "[(16, 3)]", "decoder_attention": "True", "decoder_out_embed_dim": 16},
                          "encoder_layers", "[(16, 3)]"),
    "transformer_iwslt_de_en": ({}, "encoder_xformers_att_config", "None"),
    "fconv_glu_iwslt_de_en": ({"encoder_layers": "[(16, 3)]", "decoder_attention": "True",
                               "decoder_out_embed_dim": 16}, "decoder_layers", "[(16, 3)]"),
    "msc_transformer_iwslt_de_en": ({"encoder_blocks": 1, "encoder_layers_per_block": "2", "decoder_layers": 1},
                                    "decoder_xformers_att_config", "None"),
    "sat_transformer_iwslt_de_en": ({"sat_group_size": 2}, "encoder_xformers_att_config", "None"),
    # bert_jam's own attention evaluates no string; its decoder's output layer (fairseq's) does
    "bert_jam_iwslt_de_en": ({"bert_model_name": None}, "adaptive_softmax_cutoff", "[8]"),
}


@pytest.fixture(scope="module")
def genuine(tiny_transformer_dir):
    """The state of a checkpoint written by fairseq-train (read with our loader)."""
    return load_checkpoint_file(os.path.join(tiny_transformer_dir, "checkpoint_last.pt"))


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return write_tiny_bert(str(tmp_path_factory.mktemp("tinybert")))


def hostile(genuine, path, arch, marker, tiny_bert=None, **changes):
    """``genuine`` with cfg.model switched to ``arch`` and its payload field set, saved to ``path``."""
    extra, field, result = ARCHS[arch]
    state = copy.deepcopy(genuine)
    model = state["cfg"]["model"]
    for k, v in dict(extra, arch=arch, _name=arch, **{field: payload(marker, result)}, **changes).items():
        setattr(model, k, tiny_bert if k == "bert_model_name" else v)
    torch.save(state, path)
    return str(path), field


def load_args(data_dir, path):
    return [data_dir, "--task", "translation", "--path", path, "--user-dir", USER_DIR, "--num-workers", "0",
            "--source-lang", "in", "--target-lang", "out"]


def generate_args(data_dir, path):
    return load_args(data_dir, path) + ["--gen-subset", "valid", "--beam", "2", "--batch-size", "64"]


def assert_refused(proc, path, field, marker):
    assert not os.path.exists(marker), "the checkpoint's payload ran"
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: refusing to load checkpoint"), proc.stderr[-3000:]
    assert path in lines[-1] and field in lines[-1], lines[-1]


# ---- every architecture through fairseq-generate ----

@pytest.mark.parametrize("arch", list(ARCHS))
def test_config_payload_is_refused_by_fairseq_generate(tiny_transformer_dir, genuine, tiny_bert, tmp_path, arch):
    marker = tmp_path / "ran"
    path, field = hostile(genuine, tmp_path / "evil.pt", arch, marker, tiny_bert)
    proc = run_cli("generate", generate_args(tiny_transformer_dir, path), check=False)
    assert_refused(proc, path, field, marker)


# ---- every entry point for one architecture ----

@pytest.fixture
def evil_transformer(genuine, tmp_path):
    marker = tmp_path / "ran"
    path, field = hostile(genuine, tmp_path / "checkpoint_evil.pt", "transformer_iwslt_de_en", marker)
    return {"dir": str(tmp_path), "path": path, "field": field, "marker": str(marker)}


def test_config_payload_is_refused_by_fairseq_interactive(tiny_transformer_dir, evil_transformer):
    e = evil_transformer
    proc = run_cli("interactive", load_args(tiny_transformer_dir, e["path"]), input="a b c\n", check=False)
    assert_refused(proc, e["path"], e["field"], e["marker"])


def test_config_payload_is_refused_by_fairseq_validate(tiny_transformer_dir, evil_transformer):
    e = evil_transformer
    proc = run_cli("validate", load_args(tiny_transformer_dir, e["path"]) + ["--valid-subset", "valid",
                                                                            "--max-tokens", "500"], check=False)
    assert_refused(proc, e["path"], e["field"], e["marker"])


def test_config_payload_is_refused_by_fairseq_train_restore_file(tiny_transformer_dir, evil_transformer, tmp_path):
    e = evil_transformer
    proc = run_cli("train", train_args(tiny_transformer_dir, "transformer_iwslt_de_en", TINY_TRANSFORMER + [
        "--save-dir", str(tmp_path), "--restore-file", e["path"], "--max-update", "1"]), check=False)
    assert_refused(proc, e["path"], e["field"], e["marker"])


def test_config_payload_is_refused_by_average_checkpoints(tiny_transformer_dir, evil_transformer, tmp_path):
    e = evil_transformer
    out = tmp_path / "avg.pt"
    proc = run_module("fairseq_ext.average_checkpoints", [
        "--inputs", os.path.join(tiny_transformer_dir, "checkpoint1.pt"), e["path"], "--output", out], check=False)
    assert_refused(proc, e["path"], e["field"], e["marker"])
    assert not out.exists()


def test_config_payload_is_refused_by_the_hub(tiny_transformer_dir, evil_transformer):
    from fairseq.models.transformer import TransformerModel

    e = evil_transformer
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load checkpoint .*checkpoint_evil\.pt: .*"
                       + e["field"]):
        TransformerModel.from_pretrained(e["dir"], checkpoint_file="checkpoint_evil.pt",
                                         data_name_or_path=tiny_transformer_dir, source_lang="in", target_lang="out")
    assert not os.path.exists(e["marker"])


# ---- the config check in-process: every place a config string can hide, and what genuine configs hold ----

def _save(tmp_path, state, name="c.pt"):
    path = tmp_path / name
    torch.save(state, path)
    return str(path)


def _cfg_state(genuine, **model):
    state = copy.deepcopy(genuine)
    for k, v in model.items():
        setattr(state["cfg"]["model"], k, v)
    return state


@pytest.mark.parametrize("where", ["args", "cfg.model namespace", "cfg.model dict", "cfg.optimizer", "DictConfig",
                                   "nested"])
def test_every_config_section_is_checked(genuine, tmp_path, where):
    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    marker = tmp_path / "ran"
    evil = payload(marker, "None")
    state = copy.deepcopy(genuine)
    cfg, field = state["cfg"], "cfg.model.encoder_xformers_att_config"
    if where == "args":  # a legacy checkpoint: args only
        state["args"], state["cfg"] = copy.deepcopy(cfg["model"]), None
        state["args"].encoder_xformers_att_config = evil
        field = "args.encoder_xformers_att_config"
    elif where == "cfg.model namespace":
        cfg["model"].encoder_xformers_att_config = evil
    elif where == "cfg.model dict":
        cfg["model"] = dict(vars(cfg["model"]), encoder_xformers_att_config=evil)
    elif where == "cfg.optimizer":
        cfg["optimizer"] = {"_name": "adam", "adam_betas": evil}
        field = "cfg.optimizer.adam_betas"
    elif where == "DictConfig":  # the pickled omegaconf container of older checkpoints
        cfg["model"] = OmegaConf.create(dict(vars(cfg["model"]), xformers_att_config=evil))
        field = "cfg.model.xformers_att_config"
    else:  # a config nested in the model config (as wav2vec's w2v_args), inside a list
        cfg["model"].w2v_args = {"model": [{"encoder": {"xformers_att_config": evil}}]}
        field = "cfg.model.w2v_args.model[0].encoder.xformers_att_config"
    path = _save(tmp_path, state)
    for load in (checkpoint_utils.load_checkpoint_to_cpu, load_checkpoint_file):
        with pytest.raises(UnsafeCheckpointError) as info:
            load(path)
        assert str(info.value).startswith(f"refusing to load checkpoint {path}: config field {field} = ")
        assert "is not a plain literal" in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("value", [
    "${oc.env:HOME}", "prefix ${oc.env:HOME}", "${oc.decode:'1'}", "${foo:bar}", "${${model.arch}}", "${model.arch",
])
def test_omegaconf_interpolations_are_refused(genuine, tmp_path, value):
    state = copy.deepcopy(genuine)
    state["cfg"]["task"]["data"] = value
    path = _save(tmp_path, state)
    with pytest.raises(UnsafeCheckpointError, match=r"config field cfg\.task\.data is an omegaconf interpolation"):
        load_checkpoint_file(path)


def test_plain_literals_and_key_references_still_load(genuine, tmp_path):
    from fairseq import checkpoint_utils

    state = _cfg_state(genuine, encoder_xformers_att_config="{'name': 'scaled_dot_product', 'dropout': 0.1}",
                       decoder_xformers_att_config=None, adaptive_softmax_cutoff="10000,50000",
                       conv_feature_layers="[(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2",
                       encoder_attention="True", character_filters=" [(1, 64), (2, 128)]")
    state["cfg"]["optimizer"] = {"_name": "adam", "adam_betas": "(0.9, 0.98)", "adam_eps": 1e-8}
    state["cfg"]["dataset"]["max_tokens_valid"] = "${dataset.max_tokens}"  # a reference, as fairseq's II()
    from omegaconf import OmegaConf  # a pickled omegaconf container, as older checkpoints hold

    state["cfg"]["bpe"] = OmegaConf.create({"_name": "subword_nmt", "codes": ["a", 1, 2.5, None], "x": {"y": True}})
    path = _save(tmp_path, state)
    assert load_checkpoint_file(path)["cfg"]["optimizer"]["adam_betas"] == "(0.9, 0.98)"
    assert checkpoint_utils.load_checkpoint_to_cpu(path)["cfg"].dataset.max_tokens_valid == \
        genuine["cfg"]["dataset"]["max_tokens"]


def test_a_config_sharing_one_list_many_times_is_checked_quickly(genuine, tmp_path):
    import time

    shared = ["x"]
    for _ in range(60):  # 2^60 paths through 61 lists
        shared = [shared, shared]
    state = _cfg_state(genuine, shared=shared)
    state["cfg"]["task"]["adam_betas"] = "[(8, 1)] * 100000000"  # found after the walk through cfg.model
    start = time.perf_counter()
    with pytest.raises(UnsafeCheckpointError, match=r"cfg\.task\.adam_betas"):
        checkpoints.check_config(state, "c.pt")
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("spec, reason", [
    ("[(8, 1)] * 100000000", "builds more than 1000 items"),
    ("'x' * 10 ** 9", "Pow"),
    ("[(8, 1)] * 600 + [(8, 1)] * 600", "builds more than 1000 items"),
    ("(lambda: 0)()", "Call"),
    ("[].__class__", "Attribute"),
    ("[*range(3)]", "Starred"),
    ("x", "Name"),
    (b"# coding: utf-7\n'+ACc-+AF8AXw-import+AF8AXw-('os')'", "bytes, not text"),  # eval() would decode utf-7
    ("[" * 5000 + "]" * 5000, "not a Python literal|nested too deeply"),
    ("-" * 50000 + "1", "not a Python literal|nested too deeply"),
])
def test_eval_fields_must_be_small_literals(spec, reason):
    with pytest.raises(ValueError, match=reason):
        checkpoints.literal_value(spec)


def test_literal_values_are_what_eval_gives():
    for text in ("[(512, 3)] * 9 + [(1024, 3)] * 4", "(0.9, 0.98)", "10000,50000", "True", "None", "-1e-8",
                 "{'a': [1, 2], 'b': (3,)}", "'ab' * 3", " [1]", "[(8, 1)] * 1000"):
        assert checkpoints.literal_value(text) == eval(text.lstrip()), text


def test_huge_layer_spec_from_a_checkpoint_is_refused_quickly(genuine, tmp_path):
    import time

    state = _cfg_state(genuine, arch="fconv_glu_iwslt_de_en", _name="fconv_glu_iwslt_de_en",
                       encoder_layers="[(8, 1)] * 100000000")
    path = _save(tmp_path, state)
    start = time.perf_counter()
    with pytest.raises(UnsafeCheckpointError, match=r"config field cfg\.model\.encoder_layers = .*builds more than "
                                                    r"1000 items"):
        load_checkpoint_file(path)
    assert time.perf_counter() - start < 5  # (10^8 layers would take minutes and gigabytes)


def test_fconv_glu_layer_spec_has_a_size_cap():
    from fairseq_ext.convs2s.model import MAX_LAYERS, parse_conv_spec

    assert len(parse_conv_spec(f"[(8, 1)] * {MAX_LAYERS}", "--encoder-layers")) == MAX_LAYERS
    for spec in ("[(8, 1)] * 100000000", f"[(8, 1)] * {MAX_LAYERS} + [(8, 1)]", "[(8, 1)] * 10 * 10 * 10 * 10"):
        with pytest.raises(FairseqExtError, match=f"--encoder-layers .* builds more than {MAX_LAYERS} layers"):
            parse_conv_spec(spec, "--encoder-layers")


def test_fconv_glu_huge_layer_spec_on_the_command_line(tiny_transformer_dir, tmp_path):
    proc = run_cli("train", train_args(tiny_transformer_dir, "fconv_glu_iwslt_de_en", [
        "--encoder-layers", "[(8, 1)] * 100000000", "--save-dir", str(tmp_path), "--max-update", "1"]), check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("error: --encoder-layers '[(8, 1)] * 100000000' builds more than 1000 layers")


# ---- every load of fairseq.checkpoint_utils is ours, whatever weights_only fairseq passes ----

def test_fairseq_asking_for_weights_only_false_still_gets_the_safe_load(tmp_path):
    from fairseq import checkpoint_utils

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": _Evil()}, path)
    with open(path, "rb") as f, pytest.raises(pickle.UnpicklingError, match="system"):
        checkpoint_utils.torch.load(f, map_location="cpu", weights_only=False)  # as fairseq main calls it


def test_a_fairseq_that_loads_without_our_loader_is_refused(genuine, tmp_path, monkeypatch):
    from fairseq import checkpoint_utils

    path = _save(tmp_path, genuine)
    monkeypatch.setattr(checkpoint_utils, "torch", torch)  # a fairseq whose load_checkpoint_to_cpu bypasses us
    with torch.serialization.safe_globals(checkpoints.SAFE_GLOBALS):
        with pytest.raises(UnsafeCheckpointError, match=r"refusing checkpoint .*c\.pt: fairseq .* read it without "
                                                        r"fairseq_ext's safe loader"):
            checkpoint_utils.load_checkpoint_to_cpu(path)


# ---- the allow-list is ours only ----

def test_allow_list_does_not_widen_other_torch_loads(genuine, tmp_path):
    path = _save(tmp_path, {"model": {}, "args": argparse.Namespace(arch="x")})
    with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace"):
        torch.load(path, weights_only=True)  # a third party's load in the same process
    assert load_checkpoint_file(path)["args"].arch == "x"  # ours
    with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace"):
        torch.load(path, weights_only=True)  # and again after ours
    # what the user allowed himself stays allowed after our loader ran
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        load_checkpoint_file(path)
        assert torch.load(path, weights_only=True)["args"].arch == "x"
    finally:
        from torch import _weights_only_unpickler

        _weights_only_unpickler._remove_safe_globals([argparse.Namespace])


def test_genuine_checkpoints_need_no_enum_on_the_allow_list(tiny_transformer_dir):
    """fairseq writes ChoiceEnum values as strings: a genuine checkpoint names only these globals."""
    names = set(torch.serialization.get_unsafe_globals_in_checkpoint(
        os.path.join(tiny_transformer_dir, "checkpoint_last.pt")))
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in checkpoints.SAFE_GLOBALS}
    assert names <= allowed and "argparse.Namespace" in names, names - allowed
    assert not any(n.startswith("fairseq.") for n in allowed)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo SHOULD-NOT-RUN",))


@pytest.mark.parametrize("protocol", [2, 4])
def test_refused_pickles_are_reported_as_refused(tmp_path, protocol):
    """A hostile pickle of protocol 4 (torch reports 'Unsupported operand 149') is refused, not 'corrupted'."""
    from fairseq import checkpoint_utils

    path = tmp_path / f"evil{protocol}.pt"
    torch.save({"model": {}, "x": _Evil()}, path, pickle_protocol=protocol)
    for load in (checkpoint_utils.load_checkpoint_to_cpu, load_checkpoint_file):
        with pytest.raises(UnsafeCheckpointError, match=rf"refusing to load checkpoint {path}: .*(pickles|refuses)"):
            load(str(path))


# ---- atomic copies: fsync, and no temporary files left after a kill ----

def test_checkpoint_copies_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    from fairseq.file_io import PathManager

    src, dst = tmp_path / "checkpoint3.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(b"x" * 100_000)
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_size)), real_fsync(fd)))
    monkeypatch.setattr(os, "replace",
                        lambda a, b: (events.append(("replace", os.path.basename(b))), real_replace(a, b)))
    assert PathManager.copy(str(src), str(dst), overwrite=True)
    assert events[:2] == [("fsync", 100_000), ("replace", "checkpoint_last.pt")], events
    assert dst.read_bytes() == src.read_bytes()


_KILLED_COPY = """
import os, shutil, signal, sys
import fairseq_ext
from fairseq.file_io import PathManager
def dying(src, dst):  # half the checkpoint is written when the process is killed
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(150_000)); g.flush()
    os.kill(os.getpid(), signal.SIGKILL)
shutil.copyfile = dying
PathManager.copy(sys.argv[1], sys.argv[2], overwrite=True)
"""


def test_temporary_files_of_a_killed_copy_are_removed_at_the_next_copy(tmp_path):
    from fairseq.file_io import PathManager

    src, dst = tmp_path / "checkpoint3.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(b"new" * 100_000)
    dst.write_bytes(b"old")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_COPY, str(src), str(dst)], cwd=ROOT)
    assert proc.wait(timeout=300) == -signal.SIGKILL
    left = sorted(p.name for p in tmp_path.iterdir() if ".tmp." in p.name)
    assert len(left) == 1 and left[0].startswith("checkpoint_last.pt.tmp.") and left[0].endswith(f".{proc.pid}")
    assert dst.read_bytes() == b"old"  # the previous file is intact
    live = tmp_path / left[0].replace(f".{proc.pid}", f".{os.getppid()}")  # a live writer's file is kept
    live.write_bytes(b"in progress")
    assert PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["checkpoint3.pt", "checkpoint_last.pt", live.name])


# ---- meters restored by --restore-file ----

@pytest.mark.parametrize("metrics", [{"train": [(10, "loss", "OrderedDict", {})]},
                                     {"train": [(10, "loss", "AverageMeter", {"val": "x", "sum": 1, "count": 1})]},
                                     {"train": "not a list"}])
def test_crafted_meters_are_refused_by_fairseq_train_restore_file(tiny_transformer_dir, genuine, tmp_path, metrics):
    """fairseq rebuilds extra_state.metrics by looking each meter's class name up among the globals of
    fairseq.logging.meters and calling it; a crafted entry ended --restore-file in a traceback (or in one at the
    first log line). Refused at load with one line naming the file."""
    state = copy.deepcopy(genuine)
    state["extra_state"]["metrics"] = metrics
    state["extra_state"]["train_iterator"]["iterations_in_epoch"] = 1  # mid-epoch: fairseq restores the meters
    path = _save(tmp_path, state, "crafted.pt")
    proc = run_cli("train", train_args(tiny_transformer_dir, "transformer_iwslt_de_en", TINY_TRANSFORMER + [
        "--save-dir", str(tmp_path / "save"), "--restore-file", path, "--max-update", "3", "--max-epoch", "3"]),
        check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith(f"error: refusing to load checkpoint {path}: extra_state.metrics"), last
    assert "--reset-meters" in last
