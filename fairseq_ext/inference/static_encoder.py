"""The encoder call of the static path: fairseq's own ``TransformerEncoder`` code, traced.

A search runs the encoder once per batch; at batch 1 that is a cost per sentence, mostly Python and dispatch
around small products (~30 layer and attention calls). The trace records the same operations fairseq's code runs
(so the output is fairseq's bit for bit, ``tests/inference/test_static_step.py`` checks it) and replays them
without the Python. fairseq's code takes one data-dependent branch, whether the batch has padding (the layers get
the padding mask or None), so there are two traces per encoder, one per branch, chosen with one host read.

Only an encoder whose code is fairseq's own is traced (:func:`encoder_refusal`: the encoder's, its layers' and
their attention's ``forward``); anything else, or a PyTorch without ``torch.jit.trace``, runs the encoder as it is.
The traces are made again when a weight changes (in place or replaced), as the decoder's step graph is. While a
forward hook is on the encoder or one of its modules, the encoder runs as it is, so that the hook runs.
"""

import logging
import warnings
import weakref
from typing import Dict, List, Optional

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


def encoder_refusal(encoder) -> Optional[str]:
    """Why the encoder is not traced (one line), or None."""
    from fairseq.models.transformer import TransformerEncoderBase
    from fairseq.modules import MultiheadAttention
    from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

    if not isinstance(encoder, TransformerEncoderBase):
        return f"the encoder is a {type(encoder).__name__}, not fairseq's TransformerEncoder"
    for name in ("forward", "forward_scriptable", "forward_embedding", "forward_torchscript"):
        if getattr(type(encoder), name) is not getattr(TransformerEncoderBase, name):
            return f"the encoder has its own {name}"
    for i, layer in enumerate(encoder.layers):
        if type(layer).forward is not TransformerEncoderLayerBase.forward or getattr(layer, "return_fc", False):
            return f"encoder layer {i} has its own forward"
        if type(layer.self_attn).forward is not MultiheadAttention.forward:
            return f"encoder layer {i}'s attention has its own forward"
    return None


class _Encoder(torch.nn.Module):
    """fairseq's encoder call as a module with tensor outputs (what is traced)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, src_tokens: Tensor):
        out = self.encoder.forward_scriptable(src_tokens, None)
        return (out["encoder_out"][0], out["encoder_padding_mask"][0], out["encoder_embedding"][0],
                out["src_lengths"][0])


def _weights_key(encoder) -> tuple:
    return tuple((id(p), p.data_ptr(), p._version) for p in encoder.parameters())


_TRACES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # encoder -> (weights key, {has_pads: trace})


def _trace(encoder, src_tokens: Tensor, has_pads: bool):
    key = _weights_key(encoder)
    cached = _TRACES.get(encoder)
    if cached is None or cached[0] != key:
        cached = _TRACES[encoder] = (key, {})
    traces = cached[1]
    if has_pads not in traces:
        module = _Encoder(encoder).eval()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the has_pads branch (one trace per branch) and TorchScript's end
                traces[has_pads] = torch.jit.trace(module, (src_tokens,), check_trace=False)
        except Exception as e:  # a PyTorch without TorchScript: fairseq's encoder as it is
            logger.info(f"static step: torch.jit.trace is not available for the encoder ({type(e).__name__}); "
                        f"it runs as it is")
            traces[has_pads] = module
    return traces[has_pads]


def _hooked(encoder) -> bool:
    """Whether a forward hook would run inside the encoder (a trace would skip it)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in encoder.modules())


def static_encode(encoder, net_input: Dict[str, Tensor]) -> Dict[str, List[Tensor]]:
    """``encoder.forward_torchscript(net_input)``'s output dictionary, computed by the trace of its branch; by the
    encoder itself while a forward hook is on it or on any of its modules (a trace runs no hook: fairseq_ext's
    diagnosis of non-finite outputs, a user's own)."""
    if _hooked(encoder):
        return encoder.forward_torchscript(net_input)
    src_tokens = net_input["src_tokens"]
    has_pads = bool(src_tokens.eq(encoder.padding_idx).any())
    x, pad, emb, lengths = _trace(encoder, src_tokens, has_pads)(src_tokens)
    return {"encoder_out": [x], "encoder_padding_mask": [pad], "encoder_embedding": [emb], "encoder_states": [],
            "fc_results": [], "src_tokens": [], "src_lengths": [lengths]}
