r"""The config strings of a checkpoint that fairseq would run as code or hand to Hydra: the check behind
:func:`fairseq_ext.checkpoints.check_config` (the module docstring there says what it guarantees).

* :data:`EVAL_FIELDS`: strings fairseq ``eval()``s when it builds a model, task or optimizer; each must be a
  plain literal (:func:`literal_value`).
* omegaconf ``${...}`` interpolations other than a plain reference to another key (a resolver could read the
  environment or run a registered function).
* :data:`REGISTRY_FIELDS`: names of registry entries, which fairseq writes unquoted into Hydra overrides for a
  checkpoint with legacy ``args``; each must match ``^[\w.-]+$``.
"""

import argparse
import ast
import os
import re

from fairseq_ext.checkpoints.checks import UnsafeCheckpointError


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

# Fields naming an entry of a fairseq registry. For a checkpoint with legacy ``args`` fairseq writes their values
# unquoted into Hydra overrides ("scoring=VALUE"), where Hydra unescapes ``\{`` and resolves ``${...}`` and a path
# picks a .yaml file: such a field must be a plain name. (Also every other registry fairseq.registry knows.)
REGISTRY_FIELDS = frozenset({"task", "arch", "criterion", "optimizer", "lr_scheduler", "bpe", "tokenizer", "scoring",
                             "simul_type", "_name"})
_REGISTRY_NAME = re.compile(r"[\w.-]+")


def _registry_fields():
    try:
        from fairseq.registry import REGISTRIES
    except ImportError:
        return REGISTRY_FIELDS
    return REGISTRY_FIELDS | set(REGISTRIES)

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
            if name in registry and not (isinstance(obj, str) and _REGISTRY_NAME.fullmatch(obj)):
                return where, (f"= {obj[:80]!r} is not a registry name (letters, digits, '_', '.' and '-'), and "
                               "fairseq hands it to Hydra unquoted")
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
    seen, registry = set(), _registry_fields()
    for section in ("args", "cfg"):
        try:
            found = walk(state.get(section), section, section, 0)
        except RecursionError:
            found = section, "is nested too deeply"
        if found:
            return found
    return None


def conversion_failure(exc):
    """``(field, value shown)`` if ``exc`` was raised while fairseq turned legacy ``args`` into config values
    (``fairseq.dataclass.utils._override_attr``: ``ast.literal_eval`` of the string of every field whose type is not
    a string, then ``list(map(int or float, ...))`` for lists of numbers), read from the traceback; else None."""
    try:
        from fairseq.dataclass import utils as dc_utils
    except ImportError:
        return None
    source = os.path.normcase(os.path.abspath(dc_utils.__file__))
    frames, tb = [], exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_override_attr" and os.path.normcase(os.path.abspath(code.co_filename)) == source:
            frames.append(tb.tb_frame.f_locals)
        tb = tb.tb_next
    if not frames or not isinstance(frames[-1].get("k"), str):
        return None
    # a nested Namespace is converted by a call on it (other args): its field name is part of the path
    names = [str(f.get("k")) for f, inner in zip(frames, frames[1:] + [None])
             if inner is None or inner.get("args") is not f.get("args")]
    value = getattr(frames[-1].get("args"), frames[-1]["k"], None)
    return "args." + ".".join(names), repr(value)[:80]


def check_config(state, path):
    """Raise :class:`UnsafeCheckpointError` if :func:`config_problem` finds something in ``state``."""
    found = config_problem(state)
    if found:
        where, reason = found
        raise UnsafeCheckpointError(
            f"refusing to load checkpoint {path}: config field {where} {reason}; only load checkpoints from a "
            "source you trust (a genuine fairseq checkpoint holds plain literals there)")
