"""One line instead of fairseq's traceback when a checkpoint does not fit the data or the model: the dictionary file
named when the embedding sizes differ (also two different dictionaries for a model that shares one embedding), the
weights named when names or shapes differ (:func:`install`); and which checkpoint each model was built from
(:func:`fairseq_ext.common.building.checkpoint_of`)."""

import functools
import os
import re

from fairseq_ext.common.building import checkpoint_of, remember_checkpoint  # noqa: F401  (checkpoint_of: public here too)
from fairseq_ext.common.errors import FairseqExtError


class DictionaryMismatchError(FairseqExtError):
    pass


class CheckpointMismatchError(FairseqExtError):
    pass


def _map_errors(owner, name, classify):
    """Replace ``owner.name`` by a wrapper that turns the errors ``classify(exc, *args, **kwargs)`` recognises
    into the FairseqExtError it returns (one line, no traceback) and re-raises any other unchanged; idempotent."""
    original = getattr(owner, name)
    if getattr(original, "_fairseq_ext_wrapped", False):
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unchanged unless classify maps it
            mapped = classify(exc, *args, **kwargs)
            if mapped is None:
                raise
            raise mapped from None

    wrapper._fairseq_ext_wrapped = True
    setattr(owner, name, wrapper)


_SIZE_MISMATCH = re.compile(
    r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) from checkpoint, "
    r"the shape in current model is torch\.Size\(\[([\d, ]*)\]\)")


def _dictionary_mismatch(filenames, task, exc):
    """A one-line error for torch's "size mismatch" when loading a checkpoint into the model built for the
    data directory (normally: the data was binarised with other dictionaries than the training data)."""
    m = _SIZE_MISMATCH.search(str(exc))
    if m is None:
        return None
    name, saved, built = m.group(1), m.group(2), m.group(3)
    ckpt = ":".join(str(f) for f in filenames)
    cfg = getattr(task, "cfg", None)
    side = "source" if name.startswith("encoder.") else "target" if name.startswith("decoder.") else None
    dictionary = getattr(task, f"{side}_dictionary", None) if side and task is not None else None
    rows = built.split(",")[0].strip()
    if dictionary is not None and rows == str(len(dictionary)):
        lang = getattr(cfg, "source_lang" if side == "source" else "target_lang", None)
        data = str(getattr(cfg, "data", "") or "").split(os.pathsep)[0]
        dict_file = os.path.join(data, f"dict.{lang}.txt") if lang else f"the {side} dictionary of {data}"
        return DictionaryMismatchError(
            f"the {side} dictionary {dict_file} ({len(dictionary)} symbols) does not match checkpoint {ckpt} "
            f"({name} has {saved.split(',')[0].strip()} rows there): use the dictionaries the model was "
            f"trained with (binarise new data with fairseq-preprocess --srcdict/--tgtdict of the training data's "
            f"dict files)")
    return DictionaryMismatchError(
        f"checkpoint {ckpt} does not fit the model built for it: {name} has shape [{saved}] in the checkpoint "
        f"but [{built}] here; use the settings and dictionaries the model was trained with "
        f"(check --model-overrides and the data directory)")


def _keys_mismatch(filenames, exc):
    """torch's "Missing key(s)" / "Unexpected key(s)" of ``load_state_dict`` as one line naming the checkpoint."""
    parts = []
    for kind in ("Missing", "Unexpected"):
        m = re.search(kind + r' key\(s\) in state_dict: ([^\n]*)', str(exc))
        names = re.findall(r'"([^"]*)"', m.group(1)) if m else []
        if names:
            parts.append(f"{len(names)} {kind.lower()} (e.g. {names[0][:80]})")
    if not parts:
        return None
    ckpt = ":".join(str(f) for f in filenames)
    return CheckpointMismatchError(
        f"checkpoint {ckpt} does not fit the model its config builds: weights {' and '.join(parts)}; the file is "
        "damaged or was written for another version of the model; use another checkpoint")


def _joined_dictionary_mismatch(filenames, task, exc, overrides=None):
    """fairseq's ValueError "--share-all-embeddings requires a joined dictionary" while building the model of a
    checkpoint (one embedding for both languages) from a data directory with two different dictionaries (the
    task's settings, or the hub's overrides when the task is made inside)."""
    if not isinstance(exc, ValueError) or "requires a joined dictionary" not in str(exc):
        return None
    ckpt = ":".join(str(f) for f in filenames)
    cfg = getattr(task, "cfg", None)
    overrides = overrides if isinstance(overrides, dict) else {}

    def setting(name):
        return getattr(cfg, name, None) or overrides.get(name)

    data = str(setting("data") or "").split(os.pathsep)[0]
    src, tgt = setting("source_lang"), setting("target_lang")
    files = (f"{os.path.join(data, f'dict.{src}.txt')} and {os.path.join(data, f'dict.{tgt}.txt')}" if src and tgt
             else "the data's source and target dictionaries")
    return DictionaryMismatchError(
        f"checkpoint {ckpt} shares one embedding between source and target (--share-all-embeddings), so it needs "
        f"one dictionary for both, but {files} differ: copy the dictionary it was trained with to both (a "
        f"release's dict.txt)")


def _ensemble_mismatch(exc, filenames, arg_overrides=None, task=None, *args, **kwargs):
    """load_model_ensemble_and_task (fairseq-generate, -interactive, -validate, hub) with a data directory whose
    dictionaries do not fit the checkpoint, or a checkpoint whose weights do not fit its model -> one line."""
    if isinstance(exc, RuntimeError):
        return _dictionary_mismatch(filenames, task, exc) or _keys_mismatch(filenames, exc)
    return _joined_dictionary_mismatch(filenames, task, exc, arg_overrides)


def _restore_mismatch(exc, trainer, filename, *args, **kwargs):
    """``fairseq-train --restore-file`` with such data: fairseq's Trainer replaces torch's size mismatch by
    "Cannot load model parameters ... ensure that the architectures match"; its cause says which tensor."""
    cause = exc.__context__
    if not isinstance(cause, RuntimeError):
        return None
    return _dictionary_mismatch([filename], trainer.task, cause) or _keys_mismatch([filename], cause)


def _remember_checkpoints(original):
    @functools.wraps(original)
    def load_model_ensemble_and_task(filenames, *args, **kwargs):
        out = original(filenames, *args, **kwargs)
        for model, name in zip(out[0], filenames):
            if model is not None:
                remember_checkpoint(model, name)
        return out

    load_model_ensemble_and_task._fairseq_ext_remembers = True
    return load_model_ensemble_and_task


def install():
    """Idempotent: fairseq's ensemble loader and ``Trainer.load_checkpoint`` map their mismatch errors, and the
    ensemble loader remembers each model's file."""
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    if not getattr(checkpoint_utils.load_model_ensemble_and_task, "_fairseq_ext_remembers", False):
        checkpoint_utils.load_model_ensemble_and_task = _remember_checkpoints(
            checkpoint_utils.load_model_ensemble_and_task)
    _map_errors(checkpoint_utils, "load_model_ensemble_and_task", _ensemble_mismatch)
    _map_errors(Trainer, "load_checkpoint", _restore_mismatch)
