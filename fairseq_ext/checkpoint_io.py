"""Safe loading and atomic writing of fairseq checkpoints under torch >= 2.6; installed by ``import fairseq_ext``.

torch >= 2.6 unpickles with ``torch.load(weights_only=True)``: only tensors, containers and allow-listed
classes may be rebuilt. fairseq checkpoints also hold ``argparse.Namespace``, omegaconf containers and nodes
and a few numpy objects, so ``fairseq-generate``, ``fairseq-interactive``, ``fairseq-validate``,
``--restore-file`` and averaging failed with "Unsupported global". :func:`install`

* allow-lists exactly those classes (:data:`SAFE_GLOBALS`) with ``torch.serialization.add_safe_globals``,
  keeping ``weights_only=True`` (no ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``), so a checkpoint that pickles
  anything else (a function, a class with a ``__reduce__``, ``os.system``) is refused;
* wraps ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` so that a refused, truncated or corrupted file
  raises :class:`UnsafeCheckpointError` / :class:`CorruptCheckpointError`: one line naming the file, and
  from the command line only that line is printed (no traceback from deep inside torch);
* wraps ``fairseq.checkpoint_utils.load_model_ensemble_and_task`` so that a checkpoint whose tensors do not
  fit the dictionaries of the data directory (torch's "size mismatch for encoder.embed_tokens.weight") raises
  :class:`DictionaryMismatchError`: one line naming the dictionary file and the checkpoint;
* makes fairseq's copies of a checkpoint (``checkpoint_last.pt``, ``checkpoint_best.pt``) atomic: a kill
  during the copy leaves the previous file intact (fairseq already writes the first file atomically).
"""

import argparse
import collections
import enum
import functools
import os
import pickle
import re
import shutil
import typing
import zipfile

import torch

from fairseq_ext.errors import FairseqExtError


class UnsafeCheckpointError(FairseqExtError):
    pass


class CorruptCheckpointError(FairseqExtError):
    pass


class DictionaryMismatchError(FairseqExtError):
    pass


def _safe_globals():
    import numpy as np
    import omegaconf
    from omegaconf import base as oc_base
    from omegaconf import nodes as oc_nodes

    try:  # numpy >= 2
        from numpy._core import multiarray as np_multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray as np_multiarray

    allowed = [
        # the legacy ``args`` of every fairseq checkpoint
        argparse.Namespace,
        # ``cfg``: fairseq saves an OmegaConf DictConfig (converted to a plain dict since 0.10, but older
        # checkpoints and some tasks keep the container objects)
        omegaconf.DictConfig,
        omegaconf.ListConfig,
        oc_base.ContainerMetadata,
        oc_base.Metadata,
        oc_nodes.AnyNode,
        oc_nodes.StringNode,
        oc_nodes.IntegerNode,
        oc_nodes.FloatNode,
        oc_nodes.BooleanNode,
        oc_nodes.EnumNode,
        oc_nodes.BytesNode,
        oc_nodes.PathNode,
        typing.Any,  # the ref_type of untyped omegaconf nodes
        collections.defaultdict,
        collections.OrderedDict,
        # numpy values fairseq writes (e.g. np.float64 best_loss, numpy RNG states in extra_state)
        np_multiarray._reconstruct,
        np_multiarray.scalar,
        np.ndarray,
        np.dtype,
    ]
    # dtype classes that pickles of numpy arrays and scalars name (numpy >= 1.25 has np.dtypes)
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in ("Float64DType", "Float32DType", "Float16DType", "Int64DType", "Int32DType", "Int16DType",
                     "Int8DType", "UInt8DType", "UInt32DType", "UInt64DType", "BoolDType"):
            if hasattr(dtypes, name):
                allowed.append(getattr(dtypes, name))
    # fairseq's own enums that configs may store (ChoiceEnum values of dataclass fields)
    allowed.extend(_fairseq_enums())
    return allowed


def _fairseq_enums():
    try:
        from fairseq.dataclass import constants
    except ImportError:
        return []
    return [v for v in vars(constants).values()
            if isinstance(v, type) and issubclass(v, enum.Enum) and v is not enum.Enum and v.__module__ == constants.__name__]


SAFE_GLOBALS = None  # filled by install()
_installed = False


def _refused_global(exc):
    """The name of the object torch's weights-only unpickler refused (e.g. ``posix.system``), or None."""
    m = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return m.group(1) if m else None


def _short_reason(exc):
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:  # torch's own detail line, not its boilerplate
        if line.startswith(("Unsupported", "invalid load key", "PytorchStreamReader", "unexpected EOF")):
            return line
    return lines[0] if lines else type(exc).__name__


def _check_readable(path, exc):
    """Map errors of torch.load to FairseqExtError subclasses; re-raise anything else."""
    if isinstance(exc, pickle.UnpicklingError) and _refused_global(exc):
        return UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: it pickles {_refused_global(exc)}, which fairseq checkpoints "
            "never hold and which could run code; only load checkpoints from a source you trust (if this one "
            "is a genuine fairseq checkpoint, report the object so it can join fairseq_ext.checkpoint_io.SAFE_GLOBALS)"
        )
    # torch's zip reader reports some truncations as a bare OSError ("[Errno 22] Invalid argument")
    damaged_zip = (isinstance(exc, OSError) and os.path.isfile(str(path))
                   and not isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)))
    if damaged_zip or isinstance(exc, (EOFError, zipfile.BadZipFile, pickle.UnpicklingError)) or (
        isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("PytorchStreamReader", "zip archive", "unexpected EOF", "storage has wrong"))
    ):
        return CorruptCheckpointError(
            f"checkpoint {path} is truncated or corrupted, or not a checkpoint ({_short_reason(exc)}); "
            "use another checkpoint (e.g. checkpoint_best.pt or an epoch checkpoint) or retrain"
        )
    return None


def load_checkpoint_file(path):
    """``torch.load`` a fairseq checkpoint to CPU with the allow-list, with the errors of this module."""
    install()
    if not os.path.isfile(path):
        raise FairseqExtError(f"checkpoint {path} does not exist")
    try:
        with open(path, "rb") as f:
            return torch.load(f, map_location=torch.device("cpu"), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - classified below, re-raised when unknown
        mapped = _check_readable(path, exc)
        if mapped is None:
            raise
        raise mapped from None


def atomic_torch_save(obj, path):
    """Write ``obj`` to ``path`` through a temporary file in the same directory and an atomic rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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


def _ensemble_mismatch(exc, filenames, arg_overrides=None, task=None, *args, **kwargs):
    """load_model_ensemble_and_task (fairseq-generate, -interactive, -validate, hub) with a data directory whose
    dictionaries do not fit the checkpoint: torch's size mismatch -> one line."""
    return _dictionary_mismatch(filenames, task, exc) if isinstance(exc, RuntimeError) else None


def _restore_mismatch(exc, trainer, filename, *args, **kwargs):
    """``fairseq-train --restore-file`` with such data: fairseq's Trainer replaces torch's size mismatch by
    "Cannot load model parameters ... ensure that the architectures match"; its cause says which tensor."""
    cause = exc.__context__
    return _dictionary_mismatch([filename], trainer.task, cause) if isinstance(cause, RuntimeError) else None


def _make_checkpoint_copies_atomic():
    from fairseq.file_io import PathManager

    original = PathManager.copy
    if getattr(original, "_fairseq_ext_wrapped", False):
        return

    def copy(src_path, dst_path, overwrite=False):
        if "://" in str(src_path) or "://" in str(dst_path):
            return original(src_path, dst_path, overwrite)
        if not overwrite and os.path.exists(dst_path):
            return False
        tmp = f"{dst_path}.tmp.{os.getpid()}"
        try:
            shutil.copyfile(src_path, tmp)
            os.replace(tmp, dst_path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return True

    copy._fairseq_ext_wrapped = True
    PathManager.copy = staticmethod(copy)


def install():
    """Idempotent; called by ``import fairseq_ext``."""
    global SAFE_GLOBALS, _installed
    if _installed:
        return
    SAFE_GLOBALS = _safe_globals()
    torch.serialization.add_safe_globals(SAFE_GLOBALS)
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    _map_errors(checkpoint_utils, "load_checkpoint_to_cpu", lambda exc, path, *a, **k: _check_readable(path, exc))
    _map_errors(checkpoint_utils, "load_model_ensemble_and_task", _ensemble_mismatch)
    _map_errors(Trainer, "load_checkpoint", _restore_mismatch)
    _make_checkpoint_copies_atomic()
    _installed = True
