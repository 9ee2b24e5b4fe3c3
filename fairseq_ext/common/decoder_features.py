"""The first and last lines of fairseq's ``TransformerDecoderBase.extract_features_scriptable``, for the decoders
that override that method (``msc_transformer``, ``bert_jam``, ``sat_transformer``) and so cannot call fairseq's:
the decoder input (token embeddings, scaled, quant-noised and projected as fairseq does, plus positions, layer
norm and dropout) and the decoder output (head-averaged alignment attention, final layer norm, output
projection); and for decoders that add several positions per incremental step (``sat_transformer``, the lean
step of ``fairseq_ext.inference.lean_decoder``), the length of fairseq's self-attention cache and the positional
embeddings of the new positions."""

from typing import Dict, List, Optional, Tuple

from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding
from torch import Tensor


def newest_positions(decoder, prev_output_tokens: Tensor,
                     incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]]
                     ) -> Tuple[Tensor, Optional[Tensor]]:
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


def decoder_output(decoder, x: Tensor, attn: Optional[Tensor], inner_states: List[Optional[Tensor]],
                   alignment_heads: Optional[int] = None, head_dim: int = 0):
    """The features of the last layer's output x (T x B x C) as fairseq returns them: B x T x C after the final
    layer norm and output projection, with ``attn`` averaged over its first ``alignment_heads`` heads (the
    heads are dimension ``head_dim`` of ``attn``)."""
    if attn is not None:
        if alignment_heads is not None:
            attn = attn.narrow(head_dim, 0, min(alignment_heads, attn.size(head_dim)))
        attn = attn.mean(dim=head_dim)
    if decoder.layer_norm is not None:
        x = decoder.layer_norm(x)
    x = x.transpose(0, 1)
    if decoder.project_out_dim is not None:
        x = decoder.project_out_dim(x)
    return x, {"attn": [attn], "inner_states": inner_states}


def cached_length(decoder, incremental_state) -> int:
    """Number of positions in the first layer's self-attention cache of fairseq (0 before the first step)."""
    buf = decoder.layers[0].self_attn._get_input_buffer(incremental_state)
    prev_key = buf.get("prev_key") if buf is not None else None
    return 0 if prev_key is None else prev_key.size(2)


def new_positions(decoder, prev_output_tokens: Tensor, n_cached: int) -> Tensor:
    """Positional embeddings [B, slen - n_cached, C] of the new positions n_cached..slen-1 of an incremental
    step. The prefix of incremental decoding has no padding, so position t is ``padding_idx + 1 + t`` (what
    fairseq's ``make_positions`` gives): the rows are sliced from the table, without embedding the prefix."""
    bsz, slen = prev_output_tokens.size()
    ep = decoder.embed_positions
    first = ep.padding_idx + 1 + n_cached
    if isinstance(ep, SinusoidalPositionalEmbedding):
        table = ep.weights
    elif isinstance(ep, LearnedPositionalEmbedding):
        table = ep.weight
    else:
        table = None
    if table is None or ep.padding_idx + 1 + slen > table.size(0):
        # another positional module, or past the table (fairseq grows a sinusoidal one, a learned one raises)
        return ep(prev_output_tokens)[:, n_cached:]
    return table[first: ep.padding_idx + 1 + slen].unsqueeze(0).expand(bsz, -1, -1)
