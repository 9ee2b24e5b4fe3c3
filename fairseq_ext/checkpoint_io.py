"""Safe loading and atomic writing of fairseq checkpoints under torch >= 2.6; installed by ``import fairseq_ext``.

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
* **The config.** Unpickling safely is not enough: fairseq ``eval()``s some config strings when it builds the
  model, the task or the optimizer (fconv's ``encoder_layers``, every transformer layer's
  ``xformers_att_config``, ``character_filters``, ``adam_betas``, ...; :data:`EVAL_FIELDS`). Our loaders check
  every ``args``/``cfg`` value of a field named there, in every section and nested config, and refuse any that
  is not a plain literal (numbers, strings, True/False/None, lists, tuples, dicts, and ``+``/``*`` between
  them as in ``"[(512, 3)] * 20 + [(1024, 3)] * 2"``, at most :data:`MAX_LITERAL_ITEMS` items). They also
  refuse omegaconf ``${...}`` interpolations other than a plain reference to another key (``${oc.env:...}`` and
  other resolvers could read the environment or run a registered function).
* **Not covered.** The tensors of a checkpoint are still untrusted data (a model built from them translates
  whatever its weights say); fields that other plugins ``eval()`` are not checked unless they are in
  :data:`EVAL_FIELDS`; paths named in a config (e.g. ``bert_model_name``) are opened as given.

Errors are :class:`FairseqExtError` subclasses with one line naming the file (and the field): from the command
line only that line is printed. :func:`install` also wraps ``load_model_ensemble_and_task`` and
``Trainer.load_checkpoint`` to name the dictionary file when a checkpoint does not fit the data's dictionaries,
and makes fairseq's copies of a checkpoint (``checkpoint_last.pt``, ``checkpoint_best.pt``) atomic and durable
(a temporary file in the same directory, fsynced, renamed; temporary files a killed process left behind are
removed at the next copy).
"""

import argparse
import ast
import collections
import functools
import os
import pickle
import re
import shutil
import threading
import types
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
        dict, list, int,  # the object_type / element_type metadata of a pickled DictConfig or ListConfig
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
    # No enums: fairseq saves its ChoiceEnum values as strings (``enum_to_str=True``), and torch keys allowed
    # classes by ``module.qualname``, under which all of fairseq's ChoiceEnums are one name anyway.
    return allowed


SAFE_GLOBALS = None  # filled by install()
_installed = False


# --------------------------------------------------------------------------------------------------------
# the allow-list, for the duration of our loads only
# --------------------------------------------------------------------------------------------------------

_allow_lock = threading.Lock()
_allow_counts = collections.Counter()  # how many of our loads allowed each global now


class _allow_listed:
    """Add ``globals_`` (default :data:`SAFE_GLOBALS`) to torch's weights-only allow-list while our loader runs
    (re-entrant and thread-safe; what the user allowed himself with ``torch.serialization.add_safe_globals`` is
    left as it was). Other threads' ``torch.load`` calls see the same list meanwhile."""

    def __init__(self, globals_=None):
        self.globals_ = list(SAFE_GLOBALS if globals_ is None else globals_)
        self.owned = []

    def __enter__(self):
        with _allow_lock:
            present = set(torch.serialization.get_safe_globals())
            self.owned = [g for g in self.globals_ if _allow_counts[g] or g not in present]
            _allow_counts.update(self.owned)
            torch.serialization.add_safe_globals(self.owned)
        return self

    def __exit__(self, *exc):
        from torch import _weights_only_unpickler

        with _allow_lock:
            _allow_counts.subtract(self.owned)
            done = [g for g in self.owned if _allow_counts[g] <= 0]
            for g in done:
                del _allow_counts[g]
            _weights_only_unpickler._remove_safe_globals(done)
        return False


# --------------------------------------------------------------------------------------------------------
# the config strings fairseq eval()s
# --------------------------------------------------------------------------------------------------------

# Fields whose string value fairseq 0.12 passes to eval() (``eval(args.x)``, ``utils.eval_str_list``,
# ``utils.eval_str_dict``, ``utils.eval_bool``) when it builds a model, task, optimizer or criterion from a
# checkpoint's config (grep fairseq for "eval(" to extend this list), and the layer specs of fconv_glu.
EVAL_FIELDS = frozenset({
    # fconv, fconv_lm, fconv_self_att (and fconv_glu, which parses them without eval)
    "encoder_layers", "decoder_layers", "encoder_attention", "decoder_attention", "self_attention",
    "project_input", "gated_attention", "downsample", "pretrained",
    # transformer_lm, lightconv_lm, lstm, lstm_lm, transformer and lightconv decoders
    "character_filters", "adaptive_input_cutoff", "adaptive_softmax_cutoff",
    # every MultiheadAttention of the transformer family (also as encoder_/decoder_xformers_att_config)
    "xformers_att_config",
    # optimizers
    "adam_betas", "adamax_betas", "adafactor_eps", "lamb_betas",
    # criterion ctc; wav2vec, hubert, speech-to-text feature extractors; raw audio datasets
    "wer_args", "conv_feature_layers", "conv_aggregator_layers", "feature_encoder_spec",
    # multilingual tasks
    "left_pad_source", "left_pad_target",
    # pipeline model parallelism
    "pipeline_balance", "pipeline_devices", "pipeline_encoder_devices", "pipeline_decoder_devices",
    # fairseq-validate evals the model overrides
    "model_overrides",
})
_EVAL_FIELD_SUFFIXES = ("_xformers_att_config",)

MAX_LITERAL_ITEMS = 1000  # items in a list, tuple, dict or string that + or * may build
MAX_LITERAL_CHARS = 100_000  # characters of an eval'd config string
_NUMBERS = (int, float, complex)
_PLAIN_REFERENCE = re.compile(r"\$\{\.*[A-Za-z_][\w.]*\}")  # ${model.encoder_embed_dim}, ${..foo}


def is_eval_field(name):
    return isinstance(name, str) and (name in EVAL_FIELDS or name.endswith(_EVAL_FIELD_SUFFIXES))


def literal_value(text):
    """The value of ``text`` if it is a plain literal expression (what :data:`EVAL_FIELDS` may hold), else
    ValueError saying why. Evaluating such a string with ``eval`` has no side effects and a bounded size."""
    if not isinstance(text, str):  # eval() of bytes honours a coding cookie: what it runs is not what we parse
        raise ValueError(f"{type(text).__name__}, not text")
    text = text.lstrip(" \t")  # what eval() skips (a str's coding cookie it ignores, as ast.parse does)
    if len(text) > MAX_LITERAL_CHARS:
        raise ValueError(f"longer than {MAX_LITERAL_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not a Python literal ({type(exc).__name__})") from None

    def sized(value):
        if isinstance(value, (list, tuple, dict, set, str, bytes)) and len(value) > MAX_LITERAL_ITEMS:
            raise ValueError(f"builds more than {MAX_LITERAL_ITEMS} items")
        return value

    def ev(node):
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, _NUMBERS + (str, bytes))):
            return sized(node.value)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [ev(e) for e in node.elts]  # a Starred element is refused below
            return sized(tuple(items) if isinstance(node, ast.Tuple) else items if isinstance(node, ast.List)
                         else set(map(_hashable, items)))
        if isinstance(node, ast.Dict) and None not in node.keys:
            return sized({_hashable(ev(k)): ev(v) for k, v in zip(node.keys, node.values)})
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            if isinstance(v, _NUMBERS):
                return -v if isinstance(node.op, ast.USub) else +v
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            if isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS):
                if isinstance(node.op, ast.Mult) and isinstance(a, int) and isinstance(b, int) and \
                        a.bit_length() + b.bit_length() > 4096:
                    raise ValueError("multiplies numbers of more than 4096 bits")
                return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
            seqs = (list, tuple, str, bytes)
            if isinstance(node.op, ast.Add) and isinstance(a, seqs) and type(a) is type(b):
                if len(a) + len(b) > MAX_LITERAL_ITEMS:
                    raise ValueError(f"builds more than {MAX_LITERAL_ITEMS} items")
                return a + b
            if isinstance(node.op, ast.Mult) and isinstance(b, seqs) and isinstance(a, int):
                a, b = b, a
            if isinstance(node.op, ast.Mult) and isinstance(a, seqs) and isinstance(b, int):
                if len(a) * max(b, 0) > MAX_LITERAL_ITEMS:
                    raise ValueError(f"builds more than {MAX_LITERAL_ITEMS} items")
                return a * b
            raise ValueError(f"{type(node.op).__name__} of {type(a).__name__} and {type(b).__name__}")
        what = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.BoolOp)) else node).__name__
        raise ValueError(f"{what} is not allowed (only literals, lists, tuples, dicts, + and *)")

    try:
        return ev(tree.body)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except TypeError as exc:  # e.g. an unhashable dict key
        raise ValueError(str(exc)) from None


def _hashable(value):
    if isinstance(value, list):
        raise ValueError("a list cannot be a dict key or set item")
    return value


def _config_items(obj):
    """(key, value) of a config container without resolving interpolations, or None for a leaf."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(obj, (DictConfig, ListConfig)):
        obj = OmegaConf.to_container(obj, resolve=False)
    if isinstance(obj, argparse.Namespace):
        return list(vars(obj).items())
    if isinstance(obj, dict):
        return list(obj.items())
    if isinstance(obj, (list, tuple)):
        return list(enumerate(obj))
    return None


def config_problem(state):
    """``(field, reason)`` for the first value of ``state["args"]`` / ``state["cfg"]`` that fairseq could run
    code from (see the module docstring), or None."""

    def walk(obj, where, name, depth):
        if depth > 64:
            return where, "is nested more than 64 levels deep"
        if isinstance(obj, (str, bytes)):
            if isinstance(obj, str) and "${" in obj:
                rest = _PLAIN_REFERENCE.sub("", obj)
                if "${" in rest:  # a resolver (${oc.env:HOME}), a nested or an unterminated interpolation
                    return where, f"is an omegaconf interpolation ({obj[:80]!r}), which could read the environment"
            if is_eval_field(name):
                try:
                    literal_value(obj)
                except ValueError as exc:
                    return where, f"= {obj[:80]!r} is not a plain literal ({exc}), and fairseq eval()s it"
            return None
        if (id(obj), name) in seen:  # a pickle may share one container many times (2^depth paths otherwise)
            return None
        seen.add((id(obj), name))
        try:
            items = _config_items(obj)
        except Exception as exc:  # noqa: BLE001 - a malformed omegaconf container
            return where, f"is not a readable config ({type(exc).__name__})"
        for key, value in items or ():
            sub = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"
            found = walk(value, sub, key if not isinstance(key, int) else name, depth + 1)
            if found:
                return found
        return None

    if not isinstance(state, dict):
        return None
    seen = set()
    for section in ("args", "cfg"):
        try:
            found = walk(state.get(section), section, section, 0)
        except RecursionError:
            found = section, "is nested too deeply"
        if found:
            return found
    return None


def check_config(state, path):
    """Raise :class:`UnsafeCheckpointError` if :func:`config_problem` finds something in ``state``."""
    found = config_problem(state)
    if found:
        where, reason = found
        raise UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: config field {where} {reason}; only load checkpoints from a "
            "source you trust (a genuine fairseq checkpoint holds plain literals there)")


# --------------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------------

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


def _check_readable(path, exc):
    """Map errors of torch.load to FairseqExtError subclasses; None for anything else (re-raised as is)."""
    if isinstance(exc, FairseqExtError):
        return None
    if isinstance(exc, pickle.UnpicklingError) and _refused_global(exc):
        return UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: it pickles {_refused_global(exc)}, which fairseq checkpoints "
            "never hold and which could run code; only load checkpoints from a source you trust (if this one "
            "is a genuine fairseq checkpoint, report the object so it can join fairseq_ext.checkpoint_io.SAFE_GLOBALS)"
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
        isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("PytorchStreamReader", "zip archive", "unexpected EOF", "storage has wrong"))
    ):
        return CorruptCheckpointError(
            f"checkpoint {path} is truncated or corrupted, or not a checkpoint ({_short_reason(exc)}); "
            "use another checkpoint (e.g. checkpoint_best.pt or an epoch checkpoint) or retrain"
        )
    return None


_local = threading.local()


def _safe_load(f, path, map_location=None):
    """``torch.load(f)`` with ``weights_only=True`` and :data:`SAFE_GLOBALS`, then :func:`check_config`."""
    with _allow_listed():
        state = torch.load(f, map_location=map_location, weights_only=True)
    check_config(state, path)
    _local.loads = getattr(_local, "loads", 0) + 1
    return state


def load_checkpoint_file(path):
    """Read a fairseq checkpoint to CPU the safe way (see the module docstring), with this module's errors."""
    install()
    if not os.path.isfile(path):
        raise FairseqExtError(f"checkpoint {path} does not exist")
    try:
        with open(path, "rb") as f:
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

        with _allow_listed(SAFE_GLOBALS + [_TensorPlaceholder]):
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


# --------------------------------------------------------------------------------------------------------
# atomic, durable writes
# --------------------------------------------------------------------------------------------------------

def _tmp_name(path):
    return f"{path}.tmp.{os.getpid()}"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def remove_stale_temporaries(path):
    """Delete the ``<path>.tmp.<pid>`` files that a process of this machine, now dead, left behind (a kill
    during a copy or save: ``finally`` does not run on SIGKILL). Returns the removed paths. (A process of another
    machine writing the same file in a shared directory would look dead: fairseq saves from rank 0 only.)"""
    directory, base = os.path.split(os.path.abspath(path))
    prefix = f"{base}.tmp."
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):]
        if name.startswith(prefix) and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            try:
                os.remove(os.path.join(directory, name))
                removed.append(os.path.join(directory, name))
            except OSError:
                pass
    return removed


def _fsync(path, directory=False):
    try:
        fd = os.open(path, os.O_RDONLY if directory else os.O_RDWR)
    except OSError:
        if not directory:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # some file systems cannot fsync a directory
            raise
    finally:
        os.close(fd)


def _atomic_write(path, fill):
    """``fill(tmp)`` a temporary file beside ``path``, fsync it, rename it to ``path``, fsync the directory:
    a kill leaves the previous ``path`` intact, and after the rename the new content is on disk."""
    remove_stale_temporaries(path)
    tmp = _tmp_name(path)
    try:
        fill(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(os.path.dirname(os.path.abspath(path)), directory=True)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_torch_save(obj, path):
    """Write ``obj`` to ``path`` through a temporary file in the same directory and an atomic rename."""
    _atomic_write(path, lambda tmp: torch.save(obj, tmp))


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

        _atomic_write(dst_path, lambda tmp: shutil.copyfile(src_path, tmp))
        return True

    copy._fairseq_ext_wrapped = True
    PathManager.copy = staticmethod(copy)


def install():
    """Idempotent; called by ``import fairseq_ext``."""
    global SAFE_GLOBALS, _installed
    if _installed:
        return
    SAFE_GLOBALS = _safe_globals()
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    from fairseq.distributed import utils as distributed_utils

    if not isinstance(checkpoint_utils.torch, _CheckpointUtilsTorch):
        checkpoint_utils.torch = _CheckpointUtilsTorch()
    if not isinstance(distributed_utils.torch, _DistributedUtilsTorch):
        distributed_utils.torch = _DistributedUtilsTorch()
    if not getattr(checkpoint_utils.load_checkpoint_to_cpu, "_fairseq_ext_wrapped", False):
        checkpoint_utils.load_checkpoint_to_cpu = _load_checkpoint_to_cpu(checkpoint_utils.load_checkpoint_to_cpu)
    _map_errors(checkpoint_utils, "load_model_ensemble_and_task", _ensemble_mismatch)
    _map_errors(Trainer, "load_checkpoint", _restore_mismatch)
    _make_checkpoint_copies_atomic()
    _installed = True
