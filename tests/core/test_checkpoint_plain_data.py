"""Everything of a checkpoint but its config (``args``, ``cfg``) must be plain data, and its weights of a dtype a
model of this package has; a legacy ``args`` value fairseq cannot convert is one line.

An omegaconf node in ``extra_state`` (or anywhere outside the config) resolves ``${oc.env:...}`` when fairseq reads
it: ``fairseq-train --restore-file`` printed the variable in its "Loaded checkpoint" line, then ended in a traceback
(``--finetune-from-model`` trained on). Such a file is refused at load, naming the key, before fairseq reads it; the
variable appears nowhere. Hostile checkpoints are genuine ones (``fairseq-train``'s tiny transformer, or a release)
edited with ``torch.save``.
"""

import copy
import os
import re

import pytest
import torch

import fairseq_ext  # noqa: F401
from fairseq_ext.checkpoints import ConfigConversionError, UnsafeCheckpointError, load_checkpoint_file
from tests.conftest import TINY_TRANSFORMER
from tests.helpers import ROOT, USER_DIR, assert_one_line_error, legacy_checkpoint, run_cli, train_args

DE_EN = os.path.join(ROOT, "releases", "bible-de-en")
RELEASE = os.path.join(DE_EN, "transformer.pt")
SECRET = "fairseq-ext-plain-data-secret-5513"
ENV = "FAIRSEQ_EXT_TEST_SECRET"
RESOLVER = "${oc.env:" + ENV + "}"


def _resolving(plain):
    """``plain`` (a dict of plain values) as an omegaconf DictConfig whose train_iterator.epoch reads $ENV."""
    from omegaconf import OmegaConf

    plain = copy.deepcopy(plain)
    plain["train_iterator"] = dict(plain["train_iterator"], epoch=RESOLVER)
    return OmegaConf.create(plain)


def _plain_extra_state(state, **changes):
    """The extra_state of ``state`` without its meters (tensors and tuples, which omegaconf cannot hold)."""
    extra = {k: v for k, v in state["extra_state"].items() if k != "metrics"}
    extra.update(changes)
    return {k: float(v) if k == "best" else v for k, v in extra.items()}


def _save(state, path):
    torch.save(state, path)
    return str(path)


# ---------------------------------------------------------------- through fairseq-train (a trained tiny model)

@pytest.fixture(scope="module")
def genuine(tiny_transformer_dir):
    return load_checkpoint_file(os.path.join(tiny_transformer_dir, "checkpoint_last.pt"))


def _train(data, flag, path, save_dir):
    return run_cli("train", train_args(data, "transformer_iwslt_de_en", TINY_TRANSFORMER + [
        "--save-dir", str(save_dir), flag, path, "--max-update", "3", "--max-epoch", "3"]), check=False,
        env={ENV: SECRET})


@pytest.mark.parametrize("flag, where", [("--restore-file", "extra_state"), ("--finetune-from-model", "extra_state"),
                                         ("--restore-file", "extra_state.train_iterator")])
def test_a_resolver_in_extra_state_is_refused_before_fairseq_reads_it(tiny_transformer_dir, genuine, tmp_path, flag,
                                                                      where):
    """It printed the variable ("Loaded checkpoint ... (epoch <secret> @ 0 updates)"), then a TypeError traceback;
    with --finetune-from-model it trained on."""
    state = copy.deepcopy(genuine)
    if where == "extra_state":
        state["extra_state"] = _resolving(_plain_extra_state(genuine))
    else:
        state["extra_state"]["train_iterator"] = _resolving(_plain_extra_state(genuine))["train_iterator"]
    path = _save(state, tmp_path / "resolver.pt")
    proc = _train(tiny_transformer_dir, flag, path, tmp_path / "save")
    assert SECRET not in proc.stdout + proc.stderr
    assert_one_line_error(proc, f"refusing to load checkpoint {path}: {where} is an omegaconf DictConfig, not plain "
                                "data")
    assert not any(name.endswith(".pt") for name in os.listdir(tmp_path / "save")), "it trained"


def test_meters_in_an_omegaconf_extra_state_are_refused_by_restore_file(tiny_transformer_dir, genuine, tmp_path):
    """The meters check looked only into a dict: in a DictConfig extra_state, a meter class 'OrderedDict' reached
    fairseq's ``globals()[name]()`` (an AttributeError traceback)."""
    from omegaconf import OmegaConf

    extra = _plain_extra_state(genuine, metrics={"train": [[10, "loss", "OrderedDict", {}]]})
    extra["train_iterator"] = dict(extra["train_iterator"], iterations_in_epoch=1)  # mid-epoch: meters restored
    state = dict(copy.deepcopy(genuine), extra_state=OmegaConf.create(extra))
    path = _save(state, tmp_path / "meters.pt")
    proc = _train(tiny_transformer_dir, "--restore-file", path, tmp_path / "save")
    assert_one_line_error(proc, f"refusing to load checkpoint {path}: extra_state is an omegaconf DictConfig")


def test_a_train_iterator_epoch_that_is_not_a_number_is_one_line(tiny_transformer_dir, genuine, tmp_path):
    """A plain string where fairseq writes the epoch ended in a TypeError traceback in fairseq's translation task."""
    state = copy.deepcopy(genuine)
    state["extra_state"]["train_iterator"]["epoch"] = "2"
    path = _save(state, tmp_path / "epoch.pt")
    proc = _train(tiny_transformer_dir, "--restore-file", path, tmp_path / "save")
    assert_one_line_error(proc, f"refusing to load checkpoint {path}: extra_state.train_iterator.epoch is a str, "
                                "not a whole number")


# ---------------------------------------------------------------------------- in-process, on a release (fast)

needs_release = pytest.mark.skipif(not os.path.isfile(RELEASE), reason="no release in releases/bible-de-en")


@pytest.fixture(scope="module")
def release_state():
    return load_checkpoint_file(RELEASE)


def _hub(path, data):
    from fairseq.models.transformer import TransformerModel

    return TransformerModel.from_pretrained(os.path.dirname(path), checkpoint_file=os.path.basename(path),
                                           data_name_or_path=data, source_lang="de", target_lang="en",
                                           bpe="sentencepiece", sentencepiece_model=os.path.join(DE_EN, "spm.model"))


def _hostile(state, where):
    from omegaconf import OmegaConf

    state = copy.deepcopy(state)
    if where == "extra_state":
        state["extra_state"] = _resolving(state["extra_state"])
    elif where == "extra_state.train_iterator":
        state["extra_state"]["train_iterator"] = _resolving(state["extra_state"])["train_iterator"]
    elif where == "optimizer_history[0].lr_scheduler_state":
        state["optimizer_history"][0]["lr_scheduler_state"] = OmegaConf.create({"best": RESOLVER})
    elif where == "last_optimizer_state":
        state["last_optimizer_state"] = OmegaConf.create({"state": {}, "param_groups": [{"lr": RESOLVER}]})
    elif where == "release.notes[1]":
        state["release"]["notes"] = ["a", OmegaConf.create([RESOLVER])]
    elif where == "model['encoder.version']":
        state["model"]["encoder.version"] = OmegaConf.create({"v": RESOLVER})
    return state


@needs_release
@pytest.mark.parametrize("where", ["extra_state", "extra_state.train_iterator",
                                   "optimizer_history[0].lr_scheduler_state", "last_optimizer_state",
                                   "release.notes[1]", "model['encoder.version']"])
def test_an_omegaconf_node_anywhere_outside_the_config_is_refused_by_every_loader(release_state, release_data,
                                                                                  tmp_path, monkeypatch, where):
    """fairseq's loader (generate, interactive, validate, train, the hub), the plugin's (averaging, releases)."""
    from fairseq import checkpoint_utils

    monkeypatch.setenv(ENV, SECRET)
    path = _save(_hostile(release_state, where), tmp_path / "node.pt")
    loads = [checkpoint_utils.load_checkpoint_to_cpu, load_checkpoint_file, lambda p: _hub(p, release_data)]
    for load in loads:
        with pytest.raises(UnsafeCheckpointError) as info:
            load(path)
        msg = str(info.value)
        assert msg.startswith(f"refusing to load checkpoint {path}: {where} is an omegaconf "), msg
        assert SECRET not in msg and "\n" not in msg


@needs_release
def test_other_objects_outside_the_config_are_refused(release_state, tmp_path):
    import argparse

    state = copy.deepcopy(release_state)
    state["release"]["args"] = argparse.Namespace(lr=1)
    path = _save(state, tmp_path / "namespace.pt")
    with pytest.raises(UnsafeCheckpointError, match=re.escape(
            f"refusing to load checkpoint {path}: release.args is an argparse.Namespace, not plain data")):
        load_checkpoint_file(path)


def test_the_meters_check_looks_into_any_mapping():
    from omegaconf import OmegaConf

    from fairseq_ext.checkpoints.checks import metrics_problem

    state = {"extra_state": OmegaConf.create({"metrics": {"train": [[10, "loss", "OrderedDict", {}]]}})}
    assert metrics_problem(state) is not None


def _with_weight(state, name, tensor):
    state = copy.deepcopy(state)
    state["model"][name] = tensor
    return state


@needs_release
@pytest.mark.parametrize("dtype", ["complex64", "complex64 nan", "float8_e4m3fn", "qint8"])
def test_a_weight_of_a_dtype_no_model_has_is_refused_by_the_hub(release_state, release_data, tmp_path, dtype):
    """A complex64 NaN weight loaded (torch drops the imaginary part with a warning; the finite-weights check
    skipped it); a float8 one ended in a NotImplementedError traceback of isfinite."""
    name = "encoder.layers.0.fc1.weight"
    w = release_state["model"][name].float()
    if dtype.startswith("complex64"):
        t = w.to(torch.complex64)
        if dtype.endswith("nan"):
            t[0, 0] = complex(float("nan"), 0.0)
    elif dtype == "qint8":
        t = torch.quantize_per_tensor(w, 0.01, 0, torch.qint8)
    else:
        t = w.to(getattr(torch, dtype))
    path = _save(_with_weight(release_state, name, t), tmp_path / "dtype.pt")
    with pytest.raises(UnsafeCheckpointError, match=re.escape(
            f"refusing to load checkpoint {path}: weight {name} is of dtype {t.dtype}")):
        _hub(path, release_data)


@needs_release
def test_every_dtype_of_the_package_models_loads(release_state, tmp_path):
    state = copy.deepcopy(release_state)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
                  torch.int32, torch.int64, torch.bool):
        state["model"][f"extra.{dtype}"] = torch.ones(2, dtype=dtype)
    load_checkpoint_file(_save(state, tmp_path / "dtypes.pt"))


# ---------------------------------------------------------------------- legacy args that fairseq cannot convert


@needs_release
def test_a_legacy_value_that_is_not_a_literal_is_one_line_in_fairseq_interactive(release_state, release_data, tmp_path):
    """fairseq reads a non-string field of legacy args with ast.literal_eval: a SyntaxError traceback."""
    path = _save(legacy_checkpoint(release_state, max_tokens="not a literal"), tmp_path / "legacy.pt")
    proc = run_cli("interactive", [release_data, "--path", path, "--task", "translation", "--source-lang", "de",
                                   "--target-lang", "en", "--user-dir", USER_DIR, "--bpe", "sentencepiece",
                                   "--sentencepiece-model", os.path.join(DE_EN, "spm.model"), "--num-workers", "0"],
                   input="Der Herr.\n", check=False)
    assert_one_line_error(proc, f"checkpoint {path}: config field args.max_tokens = 'not a literal'")


@needs_release
@pytest.mark.parametrize("field, value, error", [("max_tokens", "[1, x]", "ValueError"),
                                                 ("update_freq", "5", "TypeError"),
                                                 ("lr", "'abc'", "ValueError")])
def test_legacy_values_fairseq_cannot_convert_are_named(release_state, tmp_path, field, value, error):
    from fairseq import checkpoint_utils

    path = _save(legacy_checkpoint(release_state, **{field: value}), tmp_path / "legacy.pt")
    with pytest.raises(ConfigConversionError, match=re.escape(
            f"checkpoint {path}: config field args.{field} = {value!r} cannot be converted by fairseq ({error}")):
        checkpoint_utils.load_checkpoint_to_cpu(path)
