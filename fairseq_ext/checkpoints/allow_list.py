"""The pickle allow-list of fairseq checkpoints: exactly the classes they hold (``argparse.Namespace``, omegaconf
containers and nodes, the numpy objects fairseq writes), added to torch's weights-only allow-list only while
one of the package's loads runs (:class:`allow_listed`), so other ``torch.load`` calls in the process are not
widened."""

import argparse
import collections
import threading
import typing

import torch


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


SAFE_GLOBALS = _safe_globals()

_allow_lock = threading.Lock()
_allow_counts = collections.Counter()  # how many of our loads allowed each global now


class allow_listed:
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
