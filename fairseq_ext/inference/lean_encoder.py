"""A lean encoder layer for CPU decoding (opt-in: ``--inference-speedups lean-encoder``, or :func:`lean_encoder`):
what fairseq's ``TransformerEncoderLayerBase`` computes outside training, without its per-call bookkeeping.

A generator runs the encoder once per batch, and at batch 1 it is a fixed cost per sentence that no K of the
semi-autoregressive decoder shrinks (``python -m benchmarks.speed.beam_parts`` prints its share of a sentence;
``python -m benchmarks.speed.kernels --parts 4`` times these layers against fairseq's). With int8 projections
fairseq's ``MultiheadAttention`` cannot take PyTorch's fused path (it needs the float weights) and runs its own:
three projections, two ``bmm`` and a softmax, and the padding mask filled in. Per layer this runs instead:

* self-attention (:func:`fairseq_ext.inference.lean_decoder.self_attention`): the queries, keys and values from one
  projection call (one float product or one int8 call whose outputs equal the three calls' bit for bit), then
  ``F.scaled_dot_product_attention`` with the source padding as its mask;
* the feed-forward block (:func:`fairseq_ext.inference.lean_decoder.feed_forward`); layer norms before or after each
  block as the model was trained.

The encoder's own code is unchanged around the layers (embedding, padding, ``return_all_hiddens``, the final
layer norm), so its output dictionary is fairseq's. Float32 gives fairseq's output (its fused path uses the
same attention kernel; ``tests/inference/test_speedups.py`` checks 1e-6); with int8 projections the attention's sums
are ordered as in that fused path, not as in fairseq's own, so outputs differ from fairseq's int8 encoder by
the rounding that int8 activations amplify. The lean layer runs outside training and autograd without an
attention mask and without ``return_fc``; anything else takes the layer's own code.

Refused with one line: encoder layers with their own code (MSC, BERT-JAM), ``bias_k`` / zero attention, and keys
or values of another size than the queries.
"""

from typing import Optional

import torch
from torch import Tensor

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.inference.lean_decoder import attention_refusal, feed_forward, mix_in, needs_autograd, self_attention


class LeanEncoderLayer:
    """Mixed into an encoder layer's class by :func:`lean_encoder` (before the layer's own class)."""

    def forward(self, x, encoder_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor] = None):
        if self.training or attn_mask is not None or getattr(self, "return_fc", False) or needs_autograd(self):
            return super().forward(x, encoder_padding_mask, attn_mask)
        nb = self.normalize_before
        # self-attention (x: [T, B, C]); the mask is True where a key is a word, not padding
        mask = None
        if encoder_padding_mask is not None:
            mask = ~encoder_padding_mask.to(torch.bool).view(x.size(1), 1, 1, x.size(0))
        residual = x
        h = self.self_attn_layer_norm(x) if nb else x
        x = residual + self_attention(self.self_attn, h, mask)
        if not nb:
            x = self.self_attn_layer_norm(x)
        return feed_forward(self, x)


def _check(encoder):
    from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

    layers = list(getattr(encoder, "layers", []))
    if not layers:
        raise FairseqExtError(f"lean_encoder: {type(encoder).__name__} has no transformer layers; "
                              f"decode it without lean-encoder")
    for i, layer in enumerate(layers):
        if not (isinstance(layer, TransformerEncoderLayerBase)
                and type(layer).forward in (TransformerEncoderLayerBase.forward, LeanEncoderLayer.forward)):
            why = f"its own layer code ({type(layer).__name__})"
        else:
            why = attention_refusal(layer.self_attn)
        if why:
            raise FairseqExtError(f"lean_encoder: encoder layer {i} has {why}, which the lean layer does not "
                                  f"compute; decode this model without lean-encoder")


def lean_encoder(model):
    """Every layer of ``model.encoder`` runs through :class:`LeanEncoderLayer` outside training (its class
    becomes a subclass of its own class with the mixin; parameters and state_dict unchanged); returns the model
    in eval mode. Raises a one-line error for an encoder the lean layer does not compute."""
    encoder = getattr(model, "encoder", None)
    if encoder is None:
        raise FairseqExtError("lean_encoder: the model has no .encoder (give a fairseq encoder-decoder model)")
    _check(encoder)
    for layer in encoder.layers:
        mix_in(layer, LeanEncoderLayer)
    return model.eval()
