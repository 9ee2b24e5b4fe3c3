"""MSC: Multiscale Collaborative deep NMT (Wei et al., ACL 2020, "Multiscale Collaborative Deep Models for
Neural Machine Translation"), as a fairseq model ``msc_transformer``.

Read top to bottom beside the paper (Sec. 3, Eq. 5-13):

* The encoder is N blocks; block n is M_n pre-norm Transformer layers (``--encoder-blocks N``,
  ``--encoder-layers-per-block M`` or ``M_1,...,M_N``). ``B^n`` is the output of block n (Eq. 5-6).
* The decoder has N layers; decoder layer n attends to encoder block n (block-scale collaboration, Eq. 7).
* Contextual collaboration (Eq. 9): ``C^0`` = source embeddings, ``C^n = Q(C^{n-1}, B^n)`` with Q one GRU
  cell applied position-wise and shared by all blocks.
* Feature fusion (Eq. 12-13): every encoder layer of block n fuses its self-attention ``Attn_h`` with an
  attention over ``C^{n-1}`` (``Attn_c``) by the gate ``g = sigmoid(W1 Attn_h + W2 Attn_c + b)``;
  every decoder layer n fuses its attention over ``B^n`` with an attention over ``C^n`` the same way.

Choices where the paper is ambiguous (each one is tested in tests/msc/test_msc_transformer.py):

1. Pre-norm everywhere (Eq. 1-2). The residual stream runs un-normalised from block to block
   (``H^{n,0} = B^{n-1}``, Eq. 6); what leaves the encoder for the decoder and the GRU is
   ``LN_n(B^n)``, one LayerNorm per block (for the top block that is the usual final encoder LayerNorm of
   a pre-norm Transformer). Without block-scale collaboration only the top LayerNorm exists, which is
   exactly fairseq's pre-norm Transformer encoder.
2. ``C^0`` is the encoder input: the scaled token embeddings plus positional embeddings, after the input
   dropout, with padded positions zeroed (the tensor that enters block 1).
3. Q (Eq. 9) is ``torch.nn.GRUCell(input=LN_n(B^n), hidden=C^{n-1})`` on every position independently
   (the same cell for all blocks). Table 5's "Q as FFN" ablation (``--msc-context-cell ffn``) is
   ``C^n = W_2 ReLU(W_1 [C^{n-1}; LN_n(B^n)] + b_1) + b_2`` with the FFN inner size of the encoder.
4. The gate (Eq. 12-13) is element-wise: W1, W2 are d x d matrices (W1 without bias) and b a d-vector, and
   it is computed on the attention outputs before dropout; the residual dropout is applied to the fused
   sum ``g*Attn_h + (1-g)*Attn_c``. Both attentions take their queries from the same LayerNorm of the
   layer input (the layer's single pre-norm), as in Eq. 12 where both read H^{n,l-1}.
5. ``Attn_c`` uses the source padding mask (C has the source positions).
6. Table 5 ablations: ``--msc-fusion add`` (``Attn_h + Attn_c``, no gate parameters);
   ``--msc-context-cell ffn``; ``--no-context-attention`` removes the *encoder's* attention over C
   ("Cxt-Enc Attention"; the decoder still fuses C^n); ``--no-contextual-collaboration`` removes C,
   Q and all context attentions; ``--no-block-scale-collaboration`` makes every decoder layer attend to
   the top block (and to C^N). Both "no" flags together give the plain deep pre-norm Transformer.
7. The decoder has exactly N layers (one per block); ``--decoder-layers`` must equal N if given.
8. LayerDrop and ``--*-layers-to-keep`` are refused (blocks need every layer).

``encoder_out`` carries, besides fairseq's keys (``encoder_out`` = ``[LN_N(B^N)]``, padding mask, ...),
``msc_blocks`` = ``[LN_1(B^1), ..., LN_N(B^N)]`` and ``msc_contexts`` = ``[C^0, ..., C^N]`` (empty
without contextual collaboration), all ``T x B x C``; ``reorder_encoder_out`` reorders them lazily
(``msc_order``; ``msc_encoder_states`` applies it). Decoding uses fairseq's stock ``reorder_incremental_state``
and, for beam searches over at least ``BEAMABLE_MIN_SENTENCES`` sentences, fairseq's beamable cross attention.

``--log-layer-grad-norms`` logs the gradient norm of every encoder layer (``gnorm_enc_L01`` ...) at each
update into fairseq's training log and tensorboard (Fig. 5); plot them with
``python -m fairseq_ext.msc.plot_grad_norms``.
"""

import logging
import weakref
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fairseq import utils
from fairseq.distributed import fsdp_wrap
from fairseq.logging import metrics
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import base_architecture
from fairseq.modules import LayerNorm, MultiheadAttention
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.common.decoder_features import decoder_output, embed_decoder_input, newest_positions

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------
# Building blocks: fusion gate (Eq. 12-13) and the contextual collaboration cell Q (Eq. 9)
# --------------------------------------------------------------------------------------------------------
class MSCGate(nn.Module):
    """g = sigmoid(W1 a_h + W2 a_c + b); returns g * a_h + (1 - g) * a_c (Eq. 12, 13)."""

    def __init__(self, embed_dim):
        super().__init__()
        self.W1 = nn.Linear(embed_dim, embed_dim, bias=False)
        self.W2 = nn.Linear(embed_dim, embed_dim, bias=True)  # its bias is b

    def forward(self, a_h, a_c):
        g = torch.sigmoid(self.W1(a_h) + self.W2(a_c))
        return g * a_h + (1.0 - g) * a_c


def _fuse(gate: Optional[MSCGate], a_h, a_c):
    if a_c is None:
        return a_h
    if gate is None:  # Table 5: "feature fusion with addition"
        return a_h + a_c
    return gate(a_h, a_c)


class MSCContextGRU(nn.Module):
    """Q(c, x) of Eq. 9: one GRU cell applied independently at every source position."""

    def __init__(self, embed_dim):
        super().__init__()
        self.cell = nn.GRUCell(embed_dim, embed_dim)

    def forward(self, c_prev, b):  # both T x B x C
        T, B, C = b.shape
        return self.cell(b.reshape(T * B, C), c_prev.reshape(T * B, C)).view(T, B, C)


class MSCContextFFN(nn.Module):
    """Table 5 ablation: Q(c, x) = W2 ReLU(W1 [c; x] + b1) + b2, position-wise."""

    def __init__(self, embed_dim, ffn_dim):
        super().__init__()
        self.fc1 = nn.Linear(2 * embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)

    def forward(self, c_prev, b):
        return self.fc2(torch.relu(self.fc1(torch.cat([c_prev, b], dim=-1))))


def _context_attention(embed_dim, heads, cfg, context_dim):
    """Attn_c: queries of the layer's width ``embed_dim``, keys/values C^n of the encoder width ``context_dim``
    (they differ in the decoder when ``--decoder-embed-dim`` != ``--encoder-embed-dim``, as fairseq's
    encoder-decoder attention allows)."""
    return MultiheadAttention(embed_dim, heads, kdim=context_dim, vdim=context_dim, dropout=cfg.attention_dropout,
                              encoder_decoder_attention=True)


# --------------------------------------------------------------------------------------------------------
# Layers: F(H, C) of Eq. 10/12 and G(B_d, B_e, C) of Eq. 11/13 (pre-norm)
# --------------------------------------------------------------------------------------------------------
class MSCEncoderLayer(TransformerEncoderLayerBase):
    """H^{n,l} = FFN(LN(O)) + O,  O = fuse(Attn_h(LN H), Attn_c(LN H, C^{n-1})) + H   (Eq. 10, 12)."""

    def __init__(self, cfg, context_attention: bool, gated: bool):
        super().__init__(cfg)
        d = self.embed_dim
        self.context_attn = (_context_attention(d, cfg.encoder.attention_heads, cfg, d)
                             if context_attention else None)
        self.gate = MSCGate(d) if (context_attention and gated) else None

    def forward(self, x, encoder_padding_mask: Optional[Tensor], context: Optional[Tensor] = None):
        residual = x
        h = self.self_attn_layer_norm(x)
        a_h, _ = self.self_attn(query=h, key=h, value=h, key_padding_mask=encoder_padding_mask,
                                need_weights=False)
        a_c = None
        if self.context_attn is not None and context is not None:
            a_c, _ = self.context_attn(query=h, key=context, value=context,
                                       key_padding_mask=encoder_padding_mask, need_weights=False)
        x = residual + self.dropout_module(_fuse(self.gate, a_h, a_c))  # O^{n,l}
        residual = x
        x = self.fc2(self.activation_dropout_module(self.activation_fn(self.fc1(self.final_layer_norm(x)))))
        return residual + self.dropout_module(x)  # H^{n,l}


class MSCDecoderLayer(TransformerDecoderLayerBase):
    """B_d^n = FFN(LN S) + S,  S = fuse(Attn_h(LN O, B_e^n), Attn_c(LN O, C^n)) + O,
    O = SelfAttn(LN B_d^{n-1}) + B_d^{n-1}   (Eq. 2, 11, 13)."""

    def __init__(self, cfg, context_attention: bool, gated: bool):
        super().__init__(cfg, no_encoder_attn=False)
        d = self.embed_dim
        self.context_attn = (_context_attention(d, cfg.decoder.attention_heads, cfg, cfg.encoder.embed_dim)
                             if context_attention else None)
        self.gate = MSCGate(d) if (context_attention and gated) else None

    def forward(
        self,
        x,
        encoder_out: Optional[Tensor],
        encoder_padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        context: Optional[Tensor] = None,
        self_attn_mask: Optional[Tensor] = None,
        self_attn_padding_mask: Optional[Tensor] = None,
        need_attn: bool = False,
        need_head_weights: bool = False,
    ):
        if need_head_weights:
            need_attn = True
        residual = x
        h = self.self_attn_layer_norm(x)
        h, _ = self.self_attn(query=h, key=h, value=h, key_padding_mask=self_attn_padding_mask,
                              incremental_state=incremental_state, need_weights=False, attn_mask=self_attn_mask)
        x = residual + self.dropout_module(h)  # O_d^n
        residual = x
        q = self.encoder_attn_layer_norm(x)
        a_h, attn = self.encoder_attn(query=q, key=encoder_out, value=encoder_out,
                                      key_padding_mask=encoder_padding_mask, incremental_state=incremental_state,
                                      static_kv=True, need_weights=need_attn or (not self.training and self.need_attn),
                                      need_head_weights=need_head_weights)
        a_c = None
        if self.context_attn is not None:  # context is None when its keys/values are cached
            a_c, _ = self.context_attn(query=q, key=context, value=context, key_padding_mask=encoder_padding_mask,
                                       incremental_state=incremental_state, static_kv=True, need_weights=False)
        x = residual + self.dropout_module(_fuse(self.gate, a_h, a_c))  # S_d^n
        residual = x
        x = self.fc2(self.activation_dropout_module(self.activation_fn(self.fc1(self.final_layer_norm(x)))))
        return residual + self.dropout_module(x), attn, None  # B_d^n


# --------------------------------------------------------------------------------------------------------
# Options shared by encoder and decoder
# --------------------------------------------------------------------------------------------------------
def parse_layers_per_block(value, blocks):
    """``"M"`` or ``"M_1,...,M_N"`` -> [M_1..M_N] (validated against ``blocks`` = N, which may be None)."""
    text = str(value).strip()
    try:
        ms = [int(v) for v in text.split(",") if v.strip() != ""]
    except ValueError:
        raise FairseqExtError(f"--encoder-layers-per-block {value!r}: expected an integer M or a comma list "
                              f"M_1,...,M_N of integers, e.g. 6 or 6,6,6,6,6,6")
    if not ms or any(m < 1 for m in ms):
        raise FairseqExtError(f"--encoder-layers-per-block {value!r}: every block needs at least one layer")
    if len(ms) == 1:
        n = 6 if blocks is None else int(blocks)
        if n < 1:
            raise FairseqExtError(f"--encoder-blocks {blocks}: need at least one block")
        return ms * n
    if blocks is not None and int(blocks) != len(ms):
        raise FairseqExtError(f"--encoder-layers-per-block {value} lists {len(ms)} blocks but --encoder-blocks is "
                              f"{blocks}; give one M per block or a single M")
    return ms


class MSCOptions:
    """The resolved MSC switches (read from the model args/cfg)."""

    def __init__(self, cfg):
        g = lambda k, d=None: utils.safe_getattr(cfg, k, d)  # noqa: E731
        self.layers_per_block = [int(m) for m in str(g("msc_layers_per_block")).split(",")]
        self.blocks = len(self.layers_per_block)
        self.gated = g("msc_fusion", "gate") == "gate"
        self.context_cell = g("msc_context_cell", "gru")
        self.contextual = not g("no_contextual_collaboration", False)
        self.encoder_context_attention = self.contextual and not g("no_context_attention", False)
        self.block_scale = not g("no_block_scale_collaboration", False)


# --------------------------------------------------------------------------------------------------------
# Encoder (Eq. 5, 6, 9, 10)
# --------------------------------------------------------------------------------------------------------
class MSCEncoder(TransformerEncoderBase):
    def __init__(self, cfg, dictionary, embed_tokens):
        self.msc = MSCOptions(cfg)
        super().__init__(cfg, dictionary, embed_tokens)  # builds sum(M_n) MSCEncoderLayers and LN_N (layer_norm)
        d = embed_tokens.embedding_dim
        o = self.msc
        # LN_n for n < N (LN_N is fairseq's final encoder LayerNorm, self.layer_norm)
        self.block_layer_norms = nn.ModuleList(
            [LayerNorm(d, export=cfg.export) for _ in range(o.blocks - 1)] if o.block_scale or o.contextual else [])
        if o.contextual:
            self.context_cell = (MSCContextGRU(d) if o.context_cell == "gru"
                                 else MSCContextFFN(d, cfg.encoder.ffn_embed_dim))
        else:
            self.context_cell = None
        self.block_ends = []
        end = 0
        for m in o.layers_per_block:
            end += m
            self.block_ends.append(end)

    def build_encoder_layer(self, cfg):
        layer = MSCEncoderLayer(cfg, self.msc.encoder_context_attention, self.msc.gated)
        if cfg.checkpoint_activations:
            layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
        # as fairseq: with --ddp-backend fully_sharded each (checkpointed) layer is its own FSDP unit
        return fsdp_wrap(layer, min_num_params=0 if cfg.checkpoint_activations else cfg.min_params_to_wrap)

    def _block_norm(self, n, x):
        return self.layer_norm(x) if n == self.msc.blocks - 1 else self.block_layer_norms[n](x)

    def forward(self, src_tokens, src_lengths: Optional[Tensor] = None, return_all_hiddens: bool = False,
                token_embeddings: Optional[Tensor] = None):
        padding_mask = src_tokens.eq(self.padding_idx)
        has_pads = bool(padding_mask.any())
        key_padding_mask = padding_mask if has_pads else None
        x, encoder_embedding = self.forward_embedding(src_tokens, token_embeddings)
        if has_pads:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        x = x.transpose(0, 1)  # T x B x C
        o = self.msc
        encoder_states = [x] if return_all_hiddens else []
        C = x if o.contextual else None  # C^0 (Eq. 9)
        contexts = [C] if o.contextual else []
        blocks = []
        n, start = 0, 0
        for n, end in enumerate(self.block_ends):
            ctx = C if o.encoder_context_attention else None  # C^{n-1} for block n (1-based n)
            for i in range(start, end):  # Eq. 6 / 10
                x = self.layers[i](x, key_padding_mask, ctx)
                if return_all_hiddens:
                    encoder_states.append(x)
            start = end
            if o.block_scale or o.contextual or n == o.blocks - 1:
                b = self._block_norm(n, x)  # LN_n(B^n)
                if has_pads:
                    b = b.masked_fill(padding_mask.t().unsqueeze(-1), 0.0)
                blocks.append(b)
                if o.contextual:
                    C = self.context_cell(C, b)  # C^n = Q(C^{n-1}, B^n)  (Eq. 9)
                    if has_pads:
                        C = C.masked_fill(padding_mask.t().unsqueeze(-1), 0.0)
                    contexts.append(C)
        src_lengths_out = src_tokens.ne(self.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()
        return {
            "encoder_out": [blocks[-1]],  # LN_N(B^N), T x B x C
            "encoder_padding_mask": [padding_mask],  # B x T
            "encoder_embedding": [encoder_embedding],  # B x T x C
            "encoder_states": encoder_states,  # List[T x B x C] (every layer, if return_all_hiddens)
            "msc_blocks": blocks,  # [LN_1(B^1) .. LN_N(B^N)] (only the top one without Bsc and context)
            "msc_contexts": contexts,  # [C^0 .. C^N] (empty without contextual collaboration)
            "fc_results": [],
            "src_tokens": [],
            "src_lengths": [src_lengths_out],
        }

    @torch.jit.export
    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order):
        """fairseq's keys are reordered as by fairseq's encoder; the 2N+1 MSC tensors are reordered lazily:
        ``msc_order`` composes the batch index (one small index op per search step) and
        ``msc_encoder_states`` applies it only when the decoder computes its cross-attention keys and values
        (the first search step; the keys and values are cached after it)."""
        out = super().reorder_encoder_out(encoder_out, new_order)
        order = encoder_out.get("msc_order", [])
        out["msc_order"] = [order[0].index_select(0, new_order) if order else new_order]
        out["msc_blocks"] = encoder_out["msc_blocks"]
        out["msc_contexts"] = encoder_out["msc_contexts"]
        return out


def msc_encoder_states(encoder_out: Dict[str, List[Tensor]]):
    """``([LN_1(B^1) .. LN_N(B^N)], [C^0 .. C^N])`` of ``encoder_out`` in its current batch order (applies the
    pending lazy reorder of ``reorder_encoder_out``)."""
    blocks, contexts = encoder_out["msc_blocks"], encoder_out["msc_contexts"]
    order = encoder_out.get("msc_order", [])
    if order:
        blocks = [b.index_select(1, order[0]) for b in blocks]
        contexts = [c.index_select(1, order[0]) for c in contexts]
    return blocks, contexts


# fairseq's beamable cross attention (keys/values once per sentence) runs its scores through an einsum that costs
# more than the per-hypothesis bmm on small batches: on CPU with beam 4 it is slower with 1 sentence, about even
# with 2-4, and faster from 8 sentences on (``python -m benchmarks.speed.msc_decode --batch N`` times its
# ``beamable always`` and ``beamable never`` contenders).
BEAMABLE_MIN_SENTENCES = 8


def _beam_of(encoder_out: Dict[str, List[Tensor]]) -> int:
    """k if ``encoder_out`` was expanded for a beam search of width k (each sentence repeated k times in a
    row, as ``SequenceGenerator`` does before its first step) over at least ``BEAMABLE_MIN_SENTENCES``
    sentences, else 1 (one cross-attention cache per hypothesis)."""
    order = encoder_out.get("msc_order", [])
    if not order or not encoder_out["msc_blocks"]:
        return 1
    n, total = encoder_out["msc_blocks"][0].size(1), order[0].numel()
    if n < BEAMABLE_MIN_SENTENCES or total <= n or total % n != 0:
        return 1
    k = total // n
    expanded = torch.arange(n, device=order[0].device).repeat_interleave(k)
    return k if torch.equal(order[0], expanded) else 1


# --------------------------------------------------------------------------------------------------------
# Decoder (Eq. 7, 11, 13)
# --------------------------------------------------------------------------------------------------------
class MSCDecoder(TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens):
        self.msc = MSCOptions(cfg)
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=False)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer = MSCDecoderLayer(cfg, self.msc.contextual, self.msc.gated)
        if cfg.checkpoint_activations:
            layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
        # as fairseq: with --ddp-backend fully_sharded each (checkpointed) layer is its own FSDP unit
        return fsdp_wrap(layer, min_num_params=0 if cfg.checkpoint_activations else cfg.min_params_to_wrap)

    def static_step_memories(self, encoder_out):
        """For the static decoder step (fairseq_ext/inference/static_step.py): the memory each layer attends
        (B_e^n with block-scale collaboration, else the top block; Eq. 7), each layer's context (C^n or C^N;
        Eq. 11, fused by the layer's gate, Eq. 12-13) or None, and the source padding."""
        blocks, contexts = msc_encoder_states(encoder_out)
        n_layers = len(self.layers)
        memories = [blocks[n] if self.msc.block_scale else blocks[-1] for n in range(n_layers)]
        ctx = [(contexts[n + 1] if self.msc.block_scale else contexts[-1]) if contexts else None
               for n in range(n_layers)]
        pads = encoder_out["encoder_padding_mask"]
        return memories, ctx, pads[0] if pads else None

    def _cross_attention_cached(self, incremental_state) -> bool:
        """True once the cross attentions hold their static keys/values (every search step after the first)."""
        if incremental_state is None:
            return False
        buf = self.layers[0].encoder_attn._get_input_buffer(incremental_state)
        return "prev_key" in buf

    def extract_features_scriptable(
        self,
        prev_output_tokens,
        encoder_out: Optional[Dict[str, List[Tensor]]],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1
        assert encoder_out is not None, "msc_transformer's decoder needs the encoder output"
        blocks: List[Tensor] = []
        contexts: List[Tensor] = []
        padding_mask: Optional[Tensor] = None
        if not self._cross_attention_cached(incremental_state):
            # full pass, or the first step of a search: the cross attentions compute keys/values from B^n, C^n.
            # In a beam search of width k they do it once per sentence (fairseq's beamable encoder-decoder
            # attention; stock reorder_incremental_state keeps one static cache per sentence). The width is read
            # from the expansion of encoder_out here rather than trusted from set_beam_size, which fairseq calls
            # only for k > 1 and never resets (a later greedy search or training step would see a stale k).
            self.set_beam_size(_beam_of(encoder_out) if incremental_state is not None else 1)
            blocks, contexts = msc_encoder_states(encoder_out)
            if encoder_out["encoder_padding_mask"]:
                padding_mask = encoder_out["encoder_padding_mask"][0]
                if not padding_mask.any():
                    padding_mask = None

        prev_output_tokens, positions = newest_positions(self, prev_output_tokens, incremental_state)
        x = embed_decoder_input(self, prev_output_tokens, positions)  # B_d^0, T x B x C

        self_attn_padding_mask = None
        if prev_output_tokens.eq(self.padding_idx).any():
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)
        self_attn_mask = None
        if incremental_state is None and not full_context_alignment:
            self_attn_mask = self.buffered_future_mask(x)

        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x]
        for n, layer in enumerate(self.layers):
            # Eq. 7/11: decoder layer n attends to B_e^n and C^n; without Bsc to the top block and C^N
            # (after the first search step the keys/values are cached: enc = ctx = None)
            enc: Optional[Tensor] = None
            ctx: Optional[Tensor] = None
            if blocks:
                enc = blocks[n] if self.msc.block_scale else blocks[-1]
            if contexts:
                ctx = contexts[n + 1] if self.msc.block_scale else contexts[-1]
            x, layer_attn, _ = layer(x, enc, padding_mask, incremental_state, ctx,
                                     self_attn_mask=self_attn_mask, self_attn_padding_mask=self_attn_padding_mask,
                                     need_attn=bool(n == alignment_layer),
                                     need_head_weights=bool(n == alignment_layer))
            inner_states.append(x)
            if layer_attn is not None and n == alignment_layer:
                attn = layer_attn.float().to(x)
        return decoder_output(self, x, attn, inner_states, alignment_heads)


# --------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------
@register_model("msc_transformer")
class MSCTransformerModel(TransformerModel):
    """Multiscale Collaborative deep Transformer (Wei et al., 2020); see the module docstring."""

    @classmethod
    def add_args(cls, parser):
        TransformerModel.add_args(parser)
        parser.add_argument("--encoder-blocks", type=int, metavar="N",
                            help="number of encoder blocks N (= number of decoder layers)")
        parser.add_argument("--encoder-layers-per-block", type=str, metavar="M",
                            help="layers per encoder block: one M for all blocks, or a comma list M_1,...,M_N")
        parser.add_argument("--msc-fusion", choices=["gate", "add"],
                            help="fuse Attn_h and Attn_c with the gate of Eq. 12-13 (gate) or by addition "
                                 "(Table 5 ablation)")
        parser.add_argument("--msc-context-cell", choices=["gru", "ffn"],
                            help="the contextual collaboration cell Q of Eq. 9: GRU (paper) or FFN (ablation)")
        parser.add_argument("--no-context-attention", action="store_true",
                            help="ablation: encoder layers do not attend to C^{n-1} (Cxt-Enc attention)")
        parser.add_argument("--no-contextual-collaboration", action="store_true",
                            help="ablation: no context states C^n, no GRU, no context attention")
        parser.add_argument("--no-block-scale-collaboration", action="store_true",
                            help="every decoder layer attends to the top encoder block only; with "
                                 "--no-contextual-collaboration this is the plain deep pre-norm Transformer")
        parser.add_argument("--log-layer-grad-norms", action="store_true",
                            help="log the gradient norm of every encoder layer at every update "
                                 "(gnorm_enc_L01, ...; training log and tensorboard)")

    @classmethod
    def build_model(cls, args, task):
        msc_base_architecture(args)
        for side in ("encoder", "decoder"):
            if float(utils.safe_getattr(args, f"{side}_layerdrop", 0) or 0) > 0:
                raise FairseqExtError(f"--{side}-layerdrop is not supported by msc_transformer (blocks need all "
                                      f"their layers); remove it")
            if utils.safe_getattr(args, f"{side}_layers_to_keep", None):
                raise FairseqExtError(f"--{side}-layers-to-keep is not supported by msc_transformer; remove it")
        if utils.safe_getattr(args, "cross_self_attention", False):
            raise FairseqExtError("--cross-self-attention is not supported by msc_transformer; remove it")
        model = super().build_model(args, task)
        if utils.safe_getattr(args, "log_layer_grad_norms", False):
            model.install_layer_grad_norm_logging()
        return model

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return MSCEncoder(TransformerConfig.from_namespace(cfg), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return MSCDecoder(TransformerConfig.from_namespace(cfg), tgt_dict, embed_tokens)

    def set_beam_size(self, beam):
        """Called by fairseq's SequenceGenerator (beam > 1): fairseq's beamable encoder-decoder attention, i.e.
        the 2N cross attentions compute their keys/values once per sentence instead of once per hypothesis. The
        decoder checks the width again at the first step of every search (see ``_beam_of``)."""
        self.decoder.set_beam_size(beam)

    # ---- Fig. 5: per-encoder-layer gradient norms -------------------------------------------------------
    def encoder_layer_grad_norms(self) -> List[float]:
        """L2 norm of the gradient of every encoder layer's parameters (0.0 for a layer without grads)."""
        layers = [[(p, None) for p in layer.parameters()] for layer in self.encoder.layers]
        return _layer_grad_norms(layers).tolist()

    def _layer_grads_in(self, optimizer):
        """Where ``optimizer`` keeps the gradients of each encoder layer: per layer a list of (parameter, slice
        of it or None), or None if ``optimizer`` does not train this model.

        * fp32 training, fairseq's ``--memory-efficient-fp16/bf16``: the model's own parameters.
        * fairseq's ``FP16Optimizer`` (``--fp16``, ``--bf16``): the torch optimizer steps fp32 copies of the
          trainable parameters, in ``model.parameters()`` order, either one copy per parameter (``--bf16``,
          ``--fp16-no-flatten-grads``) or one flat vector (``--fp16``). Its gradients are the model's,
          unscaled (and clipped) before the step; the copies are recognised by their shapes and by their values
          (equal to the model's parameters up to the model's dtype)."""
        trainable = [p for p in self.parameters() if p.requires_grad]
        index = {id(p): i for i, p in enumerate(trainable)}
        per_layer = [[index[id(p)] for p in layer.parameters() if id(p) in index] for layer in self.encoder.layers]
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if not trainable or not opt_params:
            return None
        if any(id(p) in index for p in opt_params[:64]):
            return [[(trainable[i], None) for i in layer] for layer in per_layer]

        def same_values(copy, p):
            n = min(p.numel(), 16)
            return torch.equal(copy.detach().reshape(-1)[:n].to(p.dtype), p.detach().reshape(-1)[:n])

        if (len(opt_params) >= len(trainable) and all(c.shape == p.shape for c, p in zip(opt_params, trainable))
                and same_values(opt_params[0], trainable[0])):
            return [[(opt_params[i], None) for i in layer] for layer in per_layer]
        flat = opt_params[0]
        offsets = [0]
        for p in trainable:
            offsets.append(offsets[-1] + p.numel())
        if (len(opt_params) == 1 and flat.dim() == 1 and flat.numel() >= offsets[-1]
                and same_values(flat, trainable[0])):
            return [[(flat, slice(offsets[i], offsets[i + 1])) for i in layer] for layer in per_layer]
        return None

    def install_layer_grad_norm_logging(self):
        """Log ``gnorm_enc_L{i}`` right before every optimizer step, i.e. after fairseq has normalised (and
        clipped) the gradients, inside the trainer's ``train``/``train_inner`` metric aggregation.
        A global optimizer pre-hook is used because the gradients are final only there; it finds this model's
        gradients in fp32 training and behind fairseq's fp16/bf16 optimizers (``_layer_grads_in``), ignores
        other optimizers and does nothing once the model is gone."""
        if getattr(self, "_grad_norm_hook", None) is not None:
            return
        ref = weakref.ref(self)
        width = len(str(len(self.encoder.layers)))
        sources = weakref.WeakKeyDictionary()  # optimizer -> per-layer gradient sources (None: not this model)

        def hook(optimizer, args, kwargs):
            model = ref()
            if model is None or not model.training:
                return None
            if optimizer not in sources:
                sources[optimizer] = model._layer_grads_in(optimizer)
            layers = sources[optimizer]
            if layers is None:
                return None  # another model's optimizer
            norms = _layer_grad_norms(layers)
            scale = kwargs.get("scale", 1.0)  # FP16Optimizer + an optimizer that unscales inside step()
            if torch.is_tensor(scale) or scale != 1.0:
                norms = norms / scale
            for i, v in enumerate(norms.tolist()):
                metrics.log_scalar(f"gnorm_enc_L{i + 1:0{width}d}", v, weight=1, round=4, priority=2000 + i)
            return None

        self._grad_norm_hook = register_optimizer_step_pre_hook(hook)


def _layer_grad_norms(layers) -> Tensor:
    """One L2 norm per layer (0 for a layer without gradients) of the gradients named by ``(parameter, slice or
    None)`` pairs; a CPU tensor (one host sync)."""
    norms: List[Optional[Tensor]] = []
    device = None
    for layer in layers:
        grads = [(p.grad if s is None else p.grad[s]).detach().float() for p, s in layer if p.grad is not None]
        v = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else None
        if v is not None:
            device = v.device
        norms.append(v)
    if device is None:
        return torch.zeros(len(norms))
    return torch.stack([v if v is not None else torch.zeros((), device=device) for v in norms]).cpu()


# --------------------------------------------------------------------------------------------------------
# Architectures (Tables 1, 2, 4)
# --------------------------------------------------------------------------------------------------------
@register_model_architecture("msc_transformer", "msc_transformer")
def msc_base_architecture(args):
    """Defaults: transformer base sizes, N = 6 blocks of M = 1 layer, gate fusion, GRU context cell.
    Resolves ``msc_layers_per_block`` (canonical ``M_1,...,M_N``), ``--encoder-layers`` = sum M_n and
    ``--decoder-layers`` = N. Idempotent (fairseq calls it at parse time and again in build_model)."""
    blocks = getattr(args, "encoder_blocks", None)
    lpb = getattr(args, "encoder_layers_per_block", None)
    if lpb is None:
        lpb = "1"
    if blocks is not None and int(blocks) < 1:
        raise FairseqExtError(f"--encoder-blocks {blocks}: need at least one block")
    ms = parse_layers_per_block(lpb, blocks)
    args.encoder_blocks = len(ms)
    args.encoder_layers_per_block = ",".join(map(str, ms)) if len(set(ms)) > 1 else str(ms[0])
    args.msc_layers_per_block = ",".join(map(str, ms))
    total = sum(ms)
    if getattr(args, "encoder_layers", None) is not None and int(args.encoder_layers) != total:
        raise FairseqExtError(f"--encoder-layers {args.encoder_layers} disagrees with --encoder-blocks {len(ms)} x "
                              f"--encoder-layers-per-block {args.encoder_layers_per_block} = {total}; set the depth "
                              f"with the block flags only")
    args.encoder_layers = total
    if getattr(args, "decoder_layers", None) is not None and int(args.decoder_layers) != len(ms):
        raise FairseqExtError(f"--decoder-layers {args.decoder_layers}: msc_transformer has one decoder layer per "
                              f"encoder block, so it must equal --encoder-blocks {len(ms)} (or be left out)")
    args.decoder_layers = len(ms)
    args.msc_fusion = getattr(args, "msc_fusion", None) or "gate"
    args.msc_context_cell = getattr(args, "msc_context_cell", None) or "gru"
    args.no_context_attention = getattr(args, "no_context_attention", False)
    args.no_contextual_collaboration = getattr(args, "no_contextual_collaboration", False)
    args.no_block_scale_collaboration = getattr(args, "no_block_scale_collaboration", False)
    args.log_layer_grad_norms = getattr(args, "log_layer_grad_norms", False)
    args.encoder_normalize_before = True  # MSC is pre-norm (Eq. 1-2)
    args.decoder_normalize_before = True
    base_architecture(args)
