r"""Safe loading and atomic writing of fairseq checkpoints under torch >= 2.6; installed by ``import fairseq_ext``.

torch >= 2.6 unpickles with ``torch.load(weights_only=True)``: only tensors, containers and allow-listed
classes may be rebuilt. fairseq checkpoints also hold ``argparse.Namespace``, omegaconf containers and nodes
and a few numpy objects, so ``fairseq-generate``, ``fairseq-interactive``, ``fairseq-validate``,
``--restore-file``, the hub (``from_pretrained``) and averaging failed with "Unsupported global". What this module
guarantees, and what it does not:

* **The pickle.** Our loaders (fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` and every other
  ``torch.load`` of ``fairseq.checkpoint_utils``, and :func:`load_checkpoint_file`) unpickle with
  ``weights_only=True`` and the allow-list :data:`SAFE_GLOBALS` (exactly the classes fairseq checkpoints hold),
  added for the duration of the load only (``torch.load`` elsewhere in the process is not widened). A checkpoint
  that pickles anything else (a function, a class with a ``__reduce__``, ``os.system``) is refused.
* **The bytes.** Before unpickling, the CRC-32 of every record of the checkpoint's zip file is checked
  (:func:`fairseq_ext.checkpoints.checks.verify_zip`): a bit changed on disk or in a copy is refused instead of
  loading as other weights. A file changed and re-zipped (valid CRCs) is not detected; torch's legacy format has
  no CRCs.
* **The config.** Unpickling safely is not enough: fairseq ``eval()``s some config strings when it builds the
  model, the task or the optimizer (fconv's ``encoder_layers``, every transformer layer's
  ``xformers_att_config``, ``character_filters``, ``adam_betas``, ...; :data:`EVAL_FIELDS`). Our loaders check
  every ``args``/``cfg`` value of a field named there, in every section and nested config, and refuse any that
  is not a plain literal (numbers, strings, True/False/None, lists, tuples, dicts, and ``+``/``*`` between
  them as in ``"[(512, 3)] * 20 + [(1024, 3)] * 2"``, at most :data:`MAX_LITERAL_ITEMS` items). They also
  refuse omegaconf ``${...}`` interpolations other than a plain reference to another key (``${oc.env:...}`` and
  other resolvers could read the environment or run a registered function), and registry names
  (:data:`REGISTRY_FIELDS`: task, arch, criterion, optimizer, bpe, tokenizer, scoring, ...) that are not
  ``^[\w.-]+$``: fairseq writes those of legacy ``args`` unquoted into Hydra overrides. A failure of Hydra while
  fairseq converts legacy ``args`` is reported as such, without Hydra's message (it may hold resolved values); a
  legacy value fairseq's ``ast.literal_eval`` cannot read is one line naming the field.
* **The contents.** Everything but ``args`` and ``cfg`` must be plain data (no omegaconf node: one in
  ``extra_state`` resolved ``${oc.env:...}`` when fairseq read it); weights of a dtype no model of the package has
  (complex, quantized, float8) or that are not finite are refused at load; ``extra_state["train_iterator"]``
  holds whole numbers; ``extra_state["metrics"]`` must hold fairseq's own meters with number states (fairseq
  builds them by class name on ``--restore-file``). A model whose outputs are not finite at decoding time is
  named in one line by :func:`fairseq_ext.common.fairseq_fixes.fix_non_finite_scores_crash`; weights that do not fit
  the model (missing or unexpected names, other shapes) are one line naming the file.
* **Archives.** The hub's ``.tar.gz`` model archives are unpacked by :mod:`fairseq_ext.checkpoints.archives`: every
  member checked before anything is written (regular files and directories only: no links, devices or FIFOs, no
  absolute or ``..`` names), size and member caps, written by the plugin into a private temporary directory, the archive
  left as it is.
* **Not covered.** The tensors of a checkpoint are still untrusted data (a model built from finite weights
  translates whatever they say); fields that other plugins ``eval()`` are not checked unless they are in
  :data:`EVAL_FIELDS`; paths named in a config (e.g. ``bert_model_name``) are opened as given (BERT directories
  are read as data only: :mod:`fairseq_ext.bert_jam.bert`).

Errors are :class:`FairseqExtError` subclasses with one line naming the file (and the field): from the command
line only that line is printed. :func:`install` also wraps ``load_model_ensemble_and_task`` and
``Trainer.load_checkpoint`` to name the dictionary file when a checkpoint does not fit the data's dictionaries
(also two different dictionaries for a model that shares one embedding), remembers which file each model came
from (:func:`checkpoint_of`), and makes fairseq's copies of a checkpoint (``checkpoint_last.pt``,
``checkpoint_best.pt``) atomic and durable (a temporary file in the same directory, fsynced, renamed; temporary
files a killed process left behind are removed at the next copy).
"""

import functools
import os
import pickle
import re
import threading
import types
import zipfile

import torch

from fairseq_ext.checkpoints.allow_list import SAFE_GLOBALS, allow_listed
from fairseq_ext.checkpoints.checks import (CorruptCheckpointError, UnsafeCheckpointError, metrics_problem,
                                            non_finite_weight, odd_dtype_weight, plain_data_problem,
                                            train_iterator_problem, verify_zip)
from fairseq_ext.checkpoints.config import check_config, conversion_failure
from fairseq_ext.common.errors import FairseqExtError


class ConfigConversionError(FairseqExtError):
    pass


def check_contents(state, path):
    """Raise one line naming ``path`` if ``state`` outside its config is not plain data, its weights are of a dtype
    no model has or not finite, its data iterator's position is not numbers or its meters are not fairseq's
    (:mod:`fairseq_ext.checkpoints.checks`)."""
    found = plain_data_problem(state)
    if found is not None:
        where, what = found
        raise UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: {where} {what} (fairseq writes dicts, lists, numbers, strings and "
            "tensors there; an omegaconf value could read the environment when fairseq reads it); only load "
            "checkpoints from a source you trust")
    found = odd_dtype_weight(state)
    if found is not None:
        name, dtype = found
        raise UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: weight {name} is of dtype {dtype}, which no model of fairseq_ext "
            "has (they hold floating-point, integer and bool tensors); the file was changed or is not such a "
            "model; use another checkpoint")
    why = train_iterator_problem(state)
    if why is not None:
        raise UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: {why} (fairseq writes the epoch and position of its data "
            "iterator there); use another checkpoint")
    name = non_finite_weight(state)
    if name is not None:
        raise CorruptCheckpointError(
            f"checkpoint {path} holds weights that are not finite (NaN or inf in {name}): its training diverged or "
            "the file was changed; use another checkpoint (e.g. checkpoint_best.pt or an earlier epoch)")
    why = metrics_problem(state)
    if why is not None:
        raise UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: extra_state.metrics{why}; fairseq writes only its own meters "
            "there (resume with --reset-meters, or use another checkpoint)")


def _refused_global(exc):
    """The name of the object torch's weights-only unpickler refused (e.g. ``posix.system``), or None."""
    m = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return m.group(1) if m else None


# what torch's weights-only unpickler says when it refuses something (rather than failing to read the bytes)
_REFUSALS = ("Unsupported", "Can only", "Trying to", "is blocked", "persistent_load", "allowlisted",
             "Only persistent_load")


def _short_reason(exc):
    lines = [line.strip().split("WeightsUnpickler error: ")[-1] for line in str(exc).splitlines() if line.strip()]
    for line in lines:  # torch's own detail line, not its boilerplate
        if line.startswith(("invalid load key", "PytorchStreamReader", "unexpected EOF") + _REFUSALS):
            return line
    return lines[0] if lines else type(exc).__name__


def _refusal(path, exc):
    """torch's reason if ``exc`` is its weights-only unpickler refusing the pickle (not a damaged file)."""
    if not isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" not in str(exc):
        return None
    reason = _short_reason(exc)
    if reason.startswith("Unsupported operand"):  # an opcode it does not implement (e.g. protocol 4's FRAME),
        try:  # in the pickle of a readable torch zip file, or just garbage bytes
            readable = zipfile.is_zipfile(path)
        except (OSError, TypeError):
            readable = False
        return reason if readable else None
    return reason if reason.startswith(_REFUSALS) else None


def _hydra_failure(path, exc):
    """fairseq turns the ``args`` of a legacy checkpoint into a config with Hydra: its errors are reported as
    such, by type only (their messages may hold values Hydra resolved, such as an environment variable)."""
    try:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException
    except ImportError:
        return None
    if not isinstance(exc, (HydraException, OmegaConfBaseException)):
        return None
    return ConfigConversionError(
        f"checkpoint {path}: fairseq could not turn its legacy args into a config (Hydra/OmegaConf "
        f"{type(exc).__name__}); a value in its args is not one fairseq writes, so it is not loaded (only load "
        "checkpoints from a source you trust)")


def _legacy_args_failure(path, exc):
    """fairseq reads the string of every non-string field of legacy ``args`` with ``ast.literal_eval`` before
    Hydra: a value that is not such a literal (or not a list of numbers where one is needed) ended in a SyntaxError,
    ValueError or TypeError traceback. One line naming the file and the field."""
    found = conversion_failure(exc)
    if found is None:
        return None
    field, shown = found
    return ConfigConversionError(
        f"checkpoint {path}: config field {field} = {shown} cannot be converted by fairseq ({type(exc).__name__} "
        "while it turns legacy args into a config: it reads the field as a Python literal of the field's type), so "
        "it is not loaded; a genuine fairseq checkpoint holds such a literal there (only load checkpoints from a "
        "source you trust)")


def _check_readable(path, exc):
    """Map errors of torch.load to FairseqExtError subclasses; None for anything else (re-raised as is)."""
    if isinstance(exc, FairseqExtError):
        return None
    legacy = _legacy_args_failure(path, exc)
    if legacy is not None:
        return legacy
    hydra = _hydra_failure(path, exc)
    if hydra is not None:
        return hydra
    if isinstance(exc, pickle.UnpicklingError) and _refused_global(exc):
        return UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: it pickles {_refused_global(exc)}, which fairseq checkpoints "
            "never hold and which could run code; only load checkpoints from a source you trust (if this one "
            "is a genuine fairseq checkpoint, report the object so it can join fairseq_ext.checkpoints.SAFE_GLOBALS)"
        )
    if _refusal(path, exc):
        return UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: torch's weights_only unpickler refuses it ({_refusal(path, exc)}), "
            "and fairseq checkpoints never need that; only load checkpoints from a source you trust (a genuine "
            "checkpoint saved with another pickle protocol can be re-saved with torch.save's default protocol)"
        )
    # torch's zip reader reports some truncations as a bare OSError ("[Errno 22] Invalid argument")
    damaged_zip = (isinstance(exc, OSError) and os.path.isfile(str(path))
                   and not isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)))
    if damaged_zip or isinstance(exc, (EOFError, zipfile.BadZipFile, pickle.UnpicklingError)) or (
        isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("PytorchStreamReader", "zip archive",
                                                                      "unexpected EOF", "storage has wrong"))
    ):
        return CorruptCheckpointError(
            f"checkpoint {path} is truncated or corrupted, or not a checkpoint ({_short_reason(exc)}); "
            "use another checkpoint (e.g. checkpoint_best.pt or an epoch checkpoint) or retrain"
        )
    return None


_local = threading.local()


def _safe_load(f, path, map_location=None):
    """The zip's CRCs checked, then ``torch.load(f)`` with ``weights_only=True`` and :data:`SAFE_GLOBALS`, then
    :func:`check_config` and :func:`check_contents`."""
    verify_zip(f, path)
    with allow_listed():
        state = torch.load(f, map_location=map_location, weights_only=True)
    check_config(state, path)
    check_contents(state, path)
    _local.loads = getattr(_local, "loads", 0) + 1
    return state


def load_checkpoint_file(path):
    """Read a fairseq checkpoint to CPU the safe way (see the module docstring), with this module's errors."""
    if not os.path.isfile(path):
        raise FairseqExtError(f"checkpoint {path} does not exist")
    with open(path, "rb") as f:
        return load_checkpoint_fileobj(f, path)


def load_checkpoint_fileobj(f, path):
    """:func:`load_checkpoint_file` of an open binary file (or a ``BytesIO``) read from ``path``: what is checked is
    what is loaded."""
    try:
        return _safe_load(f, path, torch.device("cpu"))
    except Exception as exc:  # noqa: BLE001 - classified below, re-raised when unknown
        mapped = _check_readable(path, exc)
        if mapped is None:
            raise
        raise mapped from None


class _CheckpointUtilsTorch(types.ModuleType):
    """What ``fairseq.checkpoint_utils`` sees as ``torch``: torch, except that ``torch.load`` is our safe load
    (whatever ``weights_only`` fairseq passes: fairseq main passes ``weights_only=False``)."""

    def __init__(self):
        super().__init__("torch", torch.__doc__)

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(f, map_location=None, *args, **kwargs):
        return _safe_load(f, getattr(f, "name", f), map_location)


class _DistributedUtilsTorch(_CheckpointUtilsTorch):
    """What ``fairseq.distributed.utils`` sees as ``torch``: its ``torch.load`` reads what rank 0 broadcasts with
    ``broadcast_object`` (``--restore-file`` on 2+ ranks: the checkpoint state rank 0 read with our loader, its
    tensors replaced by ``_TensorPlaceholder``) with the same allow-list, instead of failing on the first
    Namespace, DictConfig or placeholder."""

    @staticmethod
    def load(f, map_location=None, *args, **kwargs):
        from fairseq.distributed.utils import _TensorPlaceholder

        with allow_listed(SAFE_GLOBALS + [_TensorPlaceholder]):
            return torch.load(f, map_location=map_location, weights_only=True)


def _load_checkpoint_to_cpu(original):
    """fairseq's ``load_checkpoint_to_cpu`` (fairseq-generate, -interactive, -validate, ``--restore-file``,
    ``--finetune-from-model``, the hub), refusing what our loader refuses with one line naming ``path``, and
    refusing to return a state that did not come through our loader (a fairseq that loads otherwise)."""

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        loads = getattr(_local, "loads", 0)
        try:
            state = original(path, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unchanged unless classified
            mapped = _check_readable(path, exc)
            if mapped is None:
                raise
            raise mapped from None
        if getattr(_local, "loads", 0) == loads:
            import fairseq

            raise UnsafeCheckpointError(
                f"refusing checkpoint {path}: fairseq {getattr(fairseq, '__version__', '?')} read it without "
                "fairseq_ext's safe loader (fairseq.checkpoint_utils no longer calls torch.load); use the "
                "fairseq version of install.sh")
        check_config(state, path)  # also the user's --model-overrides, applied by fairseq after loading
        return state

    load_checkpoint_to_cpu._fairseq_ext_wrapped = True
    return load_checkpoint_to_cpu


def install():
    """Idempotent: every ``torch.load`` of ``fairseq.checkpoint_utils`` and of its distributed broadcast is the safe
    load, and ``load_checkpoint_to_cpu`` maps its errors to one line."""
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    if not isinstance(checkpoint_utils.torch, _CheckpointUtilsTorch):
        checkpoint_utils.torch = _CheckpointUtilsTorch()
    if not isinstance(distributed_utils.torch, _DistributedUtilsTorch):
        distributed_utils.torch = _DistributedUtilsTorch()
    if not getattr(checkpoint_utils.load_checkpoint_to_cpu, "_fairseq_ext_wrapped", False):
        checkpoint_utils.load_checkpoint_to_cpu = _load_checkpoint_to_cpu(checkpoint_utils.load_checkpoint_to_cpu)
