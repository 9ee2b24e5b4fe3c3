"""The decoder input of fairseq's ``TransformerDecoderBase.extract_features_scriptable`` (its first lines), for
the decoders that override that method (``msc_transformer``, ``bert_jam``, ``sat_transformer``) and so cannot
call fairseq's: token embeddings, scaled, quant-noised and projected as fairseq does, plus positions, layer
norm and dropout."""

from typing import Dict, Optional, Tuple

from torch import Tensor


def newest_positions(decoder, prev_output_tokens: Tensor,
                     incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]]) -> Tuple[Tensor, Optional[Tensor]]:
    """The tokens to embed and their positional embeddings: all of them, or in incremental decoding (one new
    token per step, as fairseq's SequenceGenerator feeds it) only the newest."""
    positions = None
    if decoder.embed_positions is not None:
        positions = decoder.embed_positions(prev_output_tokens, incremental_state=incremental_state)
    if incremental_state is not None:
        prev_output_tokens = prev_output_tokens[:, -1:]
        if positions is not None:
            positions = positions[:, -1:]
    return prev_output_tokens, positions


def embed_decoder_input(decoder, tokens: Tensor, positions: Optional[Tensor]) -> Tensor:
    """D^0 of the tokens [B, T] with their positional embeddings [B, T, C] (or None): T x B x C."""
    x = decoder.embed_scale * decoder.embed_tokens(tokens.contiguous())
    if decoder.quant_noise is not None:
        x = decoder.quant_noise(x)
    if decoder.project_in_dim is not None:
        x = decoder.project_in_dim(x)
    if positions is not None:
        x = x + positions
    if decoder.layernorm_embedding is not None:
        x = decoder.layernorm_embedding(x)
    return decoder.dropout_module(x).transpose(0, 1)
