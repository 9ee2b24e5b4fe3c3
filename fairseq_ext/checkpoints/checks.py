"""What :mod:`fairseq_ext.checkpoints`'s safe loader checks besides the pickle and the config strings: the zip
records' CRC-32s (before unpickling), that everything but the config is plain data, the weights' dtypes and that
they are finite, the data iterator's position, and that the meters fairseq restores on ``--restore-file`` are
meters. Each check raises one line naming the file.

* **CRC-32.** torch writes a CRC-32 into every record of a checkpoint's zip file but does not check it when it
  reads one, so one changed bit in a weight loads silently (a flipped mantissa bit changed 4 of 40 hypotheses of a
  release; a flipped exponent bit made fairseq's search fail) and one in ``data.pkl`` renames a weight.
  :func:`verify_zip` reads every record and compares (``zipfile.ZipFile.testzip``; ``python -m
  benchmarks.speed.checkpoint_checks`` times it beside ``torch.load`` on the release checkpoints). It guarantees
  that the file is the one torch wrote, not that torch wrote what its author meant (a file changed and re-zipped
  has valid CRCs). Checkpoints in torch's legacy (non-zip) format have no CRCs: they are read as they are.
* **Plain data.** :func:`plain_data_problem` names the first object outside ``args`` and ``cfg`` (which
  :mod:`fairseq_ext.checkpoints.config` checks) that is not a dict, list, tuple, set, number, string, bytes, tensor
  or numpy number or array of numbers: an omegaconf node in ``extra_state`` resolves ``${oc.env:...}`` when
  fairseq reads it (and prints it: "Loaded checkpoint ... (epoch <value> @ ...)").
* **Dtypes.** :func:`odd_dtype_weight` names the first tensor of ``state["model"]`` whose dtype is not one of
  :data:`WEIGHT_DTYPES` (a complex NaN weight passed the finite check and loaded without its imaginary part).
* **Data iterator.** :func:`train_iterator_problem`: ``extra_state.train_iterator``'s epoch and position are
  whole numbers (fairseq computes with them on ``--restore-file``).
* **Finite weights.** :func:`non_finite_weight` names the first floating-point tensor of ``state["model"]`` that
  holds a NaN or an infinity (a training that diverged, or a file changed on purpose).
* **Meters.** fairseq's ``Trainer.load_checkpoint`` rebuilds ``extra_state["metrics"]`` by looking up each meter's
  class name among the globals of ``fairseq.logging.meters`` and calling it; :func:`metrics_problem` accepts only
  fairseq's meter classes and number-valued states, built once on the side to see that they load.
"""

import math
import numbers
import os
import re
import zipfile
from collections.abc import Mapping

import torch

from fairseq_ext.common.errors import FairseqExtError


class CorruptCheckpointError(FairseqExtError):
    pass


class UnsafeCheckpointError(FairseqExtError):
    pass


def verify_zip(f, path):
    """Raise :class:`CorruptCheckpointError` if ``f`` (a path or a binary file, left at its position) is a zip
    file with a record whose bytes do not match its CRC-32, or an unreadable zip directory. Other files (torch's
    legacy format, garbage) are left to ``torch.load``."""
    own = isinstance(f, (str, bytes, os.PathLike))
    fh = open(f, "rb") if own else f
    try:
        pos = fh.tell()
    except (AttributeError, OSError):  # not seekable: torch reads it as it comes
        return
    try:
        if not zipfile.is_zipfile(fh):
            return
        fh.seek(pos)
        with zipfile.ZipFile(fh) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError) as exc:
        raise CorruptCheckpointError(
            f"checkpoint {path} is truncated or corrupted ({type(exc).__name__}: {str(exc)[:100]}); use another "
            "copy or checkpoint (e.g. checkpoint_best.pt or an epoch checkpoint) or retrain") from None
    finally:
        fh.seek(pos)
        if own:
            fh.close()
    if bad is not None:
        raise CorruptCheckpointError(
            f"checkpoint {path} is damaged: the bytes of its record {bad} do not match their CRC-32 (changed on disk "
            "or in a copy since torch wrote it); use another copy or checkpoint (e.g. checkpoint_best.pt or an "
            "epoch checkpoint)")


MAX_DEPTH = 64  # containers in containers outside the config (fairseq's own: 5)
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_NAME = re.compile(r"[A-Za-z_]\w{0,63}")


def _kind(obj):
    """``an omegaconf DictConfig``, ``an argparse.Namespace``, ``a type``: what ``obj`` is, never its value."""
    t = type(obj)
    module = t.__module__ or ""
    if module.split(".")[0] == "omegaconf":
        return f"an omegaconf {t.__name__}"
    name = t.__qualname__ if module == "builtins" else f"{module}.{t.__qualname__}"
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name[:80]}"


def _child(where, key):
    """The path of ``where[key]``: ``extra_state.train_iterator``, ``optimizer_history[0]``, ``model['a.b']``."""
    if isinstance(key, str) and _NAME.fullmatch(key):
        return f"{where}.{key}" if where else key
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{where}[{key}]"
    return f"{where}[{repr(key)[:60]}]"


def plain_data_problem(state):
    """``(where, what)`` for the first object of ``state`` outside ``state["args"]`` and ``state["cfg"]`` that is not
    plain data (see the module docstring), or None. Only types are looked at: no omegaconf value is read."""
    import numpy as np

    seen = set()

    def walk(obj, where, depth):
        if isinstance(obj, _PLAIN_LEAVES) or torch.is_tensor(obj):
            return None
        if isinstance(obj, (np.generic, np.ndarray)):
            return (where, "is a numpy array of Python objects") if obj.dtype.hasobject else None
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, (list, tuple)):
            items = list(enumerate(obj))
        elif isinstance(obj, (set, frozenset)):
            items = [(None, v) for v in obj]
        else:
            return where, f"is {_kind(obj)}, not plain data"
        if depth >= MAX_DEPTH:
            return where, f"is nested more than {MAX_DEPTH} levels deep"
        if id(obj) in seen:  # a pickle may share one container many times
            return None
        seen.add(id(obj))
        for key, value in items:
            if depth == 0 and where == "" and isinstance(obj, dict) and key in ("args", "cfg"):
                continue  # the config: config.py's check
            if isinstance(obj, dict):
                found = walk(key, f"{where or 'the top level'} (a key)", depth + 1)
                if found:
                    return found
            found = walk(value, where if key is None else _child(where, key), depth + 1)
            if found:
                return found
        return None

    try:
        found = walk(state, "", 0)
    except RecursionError:
        found = "", "is nested too deeply"
    if found and not found[0]:
        return "its top level", found[1]
    return found


# the dtypes of the tensors of this package's models (weights, and fairseq's version counters and masks)
WEIGHT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                           torch.int16, torch.int32, torch.int64, torch.bool})


def _weight_name(name):
    return name if isinstance(name, str) and re.fullmatch(r"[\w.-]{1,200}", name) else repr(name)[:80]


def odd_dtype_weight(state):
    """``(name, dtype)`` of the first tensor of ``state["model"]`` whose dtype is not in :data:`WEIGHT_DTYPES`
    (complex, quantized, float8, ...), or None."""
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        return None
    for name, t in model.items():
        if torch.is_tensor(t) and t.dtype not in WEIGHT_DTYPES:
            return _weight_name(name), t.dtype
    return None


def train_iterator_problem(state):
    """Why ``state["extra_state"]["train_iterator"]`` is not what fairseq writes (a dict whose epoch, position and
    version are whole numbers), or None."""
    extra = state.get("extra_state") if isinstance(state, dict) else None
    itr = extra.get("train_iterator") if isinstance(extra, dict) else None
    if itr is None:
        return None
    if not isinstance(itr, dict):
        return f"extra_state.train_iterator is {_kind(itr)}, not a dict"
    for key in ("epoch", "iterations_in_epoch", "version"):
        value = itr.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return f"extra_state.train_iterator.{key} is {_kind(value)}, not a whole number"
    return None


# the dtype in which a sum of finite values of a dtype cannot overflow (so the sum is finite iff every value is)
_SUM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float64, torch.float32: torch.float64}


def non_finite_weight(state):
    """The name of the first floating-point tensor of ``state["model"]`` that holds a NaN or an infinity, or None.
    A tensor whose sum (in a dtype its finite values cannot overflow) is finite is finite: one reduction, 15-50 times
    faster than ``isfinite`` on a CPU; the others are looked at element by element."""
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        return None
    for name, t in model.items():
        if not (torch.is_tensor(t) and t.is_floating_point() and t.numel()):
            continue
        acc = _SUM_DTYPE.get(t.dtype)
        if acc is not None and math.isfinite(t.sum(dtype=acc)):
            continue
        if not bool(torch.isfinite(t).all()):
            return str(name)
    return None


def _meter_classes():
    from fairseq.logging import meters

    return {name: cls for name, cls in vars(meters).items()
            if isinstance(cls, type) and issubclass(cls, meters.Meter) and cls is not meters.Meter}


def _plain_number(v):
    """None, a number, or a tensor or numpy array of numbers (what fairseq's meters hold, e.g. --eval-bleu's
    counts)."""
    import numpy as np

    if v is None or isinstance(v, (numbers.Number, np.number, np.bool_)):
        return True
    if torch.is_tensor(v):
        return not v.is_complex()
    return isinstance(v, np.ndarray) and (np.issubdtype(v.dtype, np.number) or v.dtype == np.bool_)


def metrics_problem(state):
    """Why ``state["extra_state"]["metrics"]`` is not what fairseq writes (``metrics.state_dict()``: per
    aggregator a list of (priority, name, meter class, meter state)), or None."""
    extra = state.get("extra_state") if isinstance(state, dict) else None
    if isinstance(extra, Mapping) and not isinstance(extra, dict):  # an omegaconf DictConfig: not read here
        return f" cannot be checked: extra_state is {_kind(extra)}, not a dict"
    metrics = extra.get("metrics") if isinstance(extra, dict) else None
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        return f"is a {type(metrics).__name__}, not a dict of meters"
    from fairseq.logging.meters import MetersDict

    classes = _meter_classes()
    for agg_name, agg in metrics.items():
        if not isinstance(agg_name, str) or not isinstance(agg, (list, tuple)):
            return f"[{agg_name!r}] is not a list of meters"
        for item in agg:
            if not (isinstance(item, (list, tuple)) and len(item) == 4):
                return f"[{agg_name!r}] holds {type(item).__name__} where fairseq writes (priority, name, class, state)"
            pri, key, cls, meter_state = item
            if not isinstance(pri, numbers.Number) or not isinstance(key, str) or cls not in classes:
                return f"[{agg_name!r}] names meter class {str(cls)[:40]!r}, which is not one of fairseq's meters"
            if not isinstance(meter_state, dict) or not all(_plain_number(v) for v in meter_state.values()):
                return f"[{agg_name!r}][{key[:40]!r}] holds a state that is not numbers"
        try:
            loaded = MetersDict()
            loaded.load_state_dict(agg)
            for name in list(loaded):
                loaded.get_smoothed_value(name)
        except Exception as exc:  # noqa: BLE001 - what fairseq would have raised at --restore-file
            return f"[{agg_name!r}] does not load as fairseq's meters ({type(exc).__name__})"
    return None
