"""BERT-JAM: BERT-enhanced NMT with joint attention (Zhang et al. 2020, "BERT-JAM: Boosting BERT-Enhanced
Neural Machine Translation with Joint Attention"; official code HollowFire/bert-jam).

Read beside Section 2 of the paper:

* a pre-trained BERT (any BERT-architecture ``transformers.AutoModel``, loaded offline) runs *inside the
  encoder*; its L_B hidden layers B_1..B_L (the embedding output excluded) are kept in ``encoder_out`` as one
  (T_bert, B, C_bert, L_B) tensor and reordered with it, so fairseq's stock ``SequenceGenerator`` works;
* every encoder and decoder layer has its own :class:`BertLayerComposition` (:mod:`.composition`: the GLU of
  Eq. 8, initialised by Eq. 11, output doubled in phase 1 only);
* :class:`JointMultiheadAttention` (Section 2.2): queries from the primary sequence R, keys/values of R and of
  the secondary sequence S projected to d_model and concatenated;
* encoder layer (Eq. 9): joint attention over (E^i, B^{E,i}), then FFN; decoder layer (Eq. 10): the mean of
  joint attention over (D^i, B^{D,i}) and over (D^i, E^L), then FFN; residual + layer norm around each; decoded
  on the static decoder step by default (:mod:`fairseq_ext.bert_jam.static_step`);
* ``--bert-jam-phase {1,2,3}`` (Section 2.4): 1 = BERT and GLUs frozen, 2 = GLUs trainable, 3 = BERT fine-tuned
  (its pooler is never built). Every phase has the same parameter names, so a phase starts from the previous
  phase's checkpoint (``--restore-file ... --reset-optimizer``, which with ``--task translation_bert`` keeps the
  update counter and LR schedule, or ``--finetune-from-model``, which restarts them) with no key mismatch. A
  frozen BERT runs under ``torch.no_grad()`` and is not saved (phase 1-2 checkpoints record the content hash of
  the pre-trained weights and reload them from ``--bert-model-name``); the encoder also accepts BERT's
  precomputed features (``bert_out``, from ``--bert-feature-cache``) instead of running it.
* ablations of Table 7: ``--bert-composition linear`` (M1: sum_i alpha_i B_i, no gate) and ``last`` (M2: B_L);
  and of the decoder (not in the paper): ``--bert-jam-decoder standard``, fairseq's transformer decoder on the same
  joint encoder, which separates what Eq. 10's decoder costs or buys from the encoder's joint attention.
  ``--bert-jam-init-layer N`` (not in the paper either) starts Eq. 11 at B_N, so phase 1 reads BERT's layer N.

Use with ``--task translation_bert --bert-model-name DIR`` (see :mod:`fairseq_ext.bert_jam.task`).
"""

import logging
import math
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq import utils
from fairseq.distributed import fsdp_wrap
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (TransformerConfig, TransformerDecoderBase, TransformerEncoderBase,
                                       TransformerModel, base_architecture as transformer_base_architecture)
from fairseq.modules import FairseqDropout, LayerNorm
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from torch import Tensor

from fairseq_ext.bert_jam.bert import (BertInputBuilder, bert_content_sha256, build_bert, check_input_settings,
                                      check_tokenizer_fits, input_settings, leave_out_frozen_bert, refill_frozen_bert)
from fairseq_ext.bert_jam.composition import COMPOSITIONS, BertLayerComposition
from fairseq_ext.common.building import building_from_checkpoint
from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.common.decoder_features import decoder_output, embed_decoder_input, newest_positions

logger = logging.getLogger(__name__)

DECODERS = ("joint", "standard")  # --bert-jam-decoder: the paper's Eq. 10 decoder, or fairseq's (the ablation)


def Linear(in_features, out_features, bias=True, gain=1.0):
    m = nn.Linear(in_features, out_features, bias)
    nn.init.xavier_uniform_(m.weight, gain=gain)
    if bias:
        nn.init.constant_(m.bias, 0.0)
    return m


# --------------------------------------------------------------------------------------------------------
# Section 2.2: joint attention
# --------------------------------------------------------------------------------------------------------

@with_incremental_state
class JointMultiheadAttention(nn.Module):
    """Attn_joint(R, S): queries Q from the primary sequence R; keys/values K = [K^S; K^R], V = [V^S; V^R],
    with K^R, V^R projected from R and K^S, V^S from the secondary sequence S (of another width) to d_model.
    Padding masks are concatenated the same way; ``causal`` masks the primary (self) part only.

    Incremental decoding caches the projected secondary keys/values once and appends the primary keys/values
    of each new step; all caches are reordered by :meth:`reorder_incremental_state`."""

    def __init__(self, embed_dim, secondary_dim, num_heads, dropout=0.0):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise FairseqExtError(f"embedding dim {embed_dim} is not divisible by {num_heads} attention heads; "
                                  "change --encoder/decoder-attention-heads")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.dropout_p = dropout
        g = 1 / math.sqrt(2)  # fairseq's MultiheadAttention init
        self.q_proj = Linear(embed_dim, embed_dim, gain=g)        # Q   from R
        self.k_proj = Linear(embed_dim, embed_dim, gain=g)        # K^R from R
        self.v_proj = Linear(embed_dim, embed_dim, gain=g)        # V^R from R
        self.k_sec_proj = Linear(secondary_dim, embed_dim, gain=g)  # K^S from S
        self.v_sec_proj = Linear(secondary_dim, embed_dim, gain=g)  # V^S from S
        self.out_proj = Linear(embed_dim, embed_dim)
        self.project_per_sentence = True  # False: select the beam rows first (for benchmarks and tests)

    def _heads(self, x: Tensor) -> Tensor:  # T x B x d -> B x H x T x d_h
        T, B, _ = x.shape
        return x.view(T, B, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    def _get_state(self, incremental_state) -> Dict[str, Tensor]:
        return self.get_incremental_state(incremental_state, "joint_attn") or {}

    def has_secondary_cache(self, incremental_state) -> bool:
        return incremental_state is not None and "secondary_key" in self._get_state(incremental_state)

    def forward(self, query: Tensor, secondary: Optional[Tensor], secondary_padding_mask: Optional[Tensor],
                self_padding_mask: Optional[Tensor] = None, causal: bool = False,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                need_weights: bool = False, secondary_order: Optional[Tensor] = None):
        """query: T x B x d (R); secondary: S x B' x d_s (None when cached); masks: B x S / B x T, True = pad.
        ``secondary_order`` (B): the rows of ``secondary`` that form the batch (beam search: B = B' x beam); the
        secondary keys/values are projected on the B' rows and then selected, once per sentence, not per beam.
        Returns (T x B x d, attention weights on the secondary part B x H x T x S or None)."""
        T, B, _ = query.shape
        q = self._heads(self.q_proj(query))
        k_r, v_r = self._heads(self.k_proj(query)), self._heads(self.v_proj(query))
        state = self._get_state(incremental_state) if incremental_state is not None else {}
        if "prev_key" in state:  # primary keys/values of the previous steps
            k_r = torch.cat([state["prev_key"], k_r], dim=2)
            v_r = torch.cat([state["prev_value"], v_r], dim=2)
            self_padding_mask = None  # one new token per step: never a pad
        if "secondary_key" in state:
            k_s, v_s = state["secondary_key"], state["secondary_value"]
            secondary_padding_mask = state.get("secondary_padding_mask")
        else:
            if secondary_order is not None and not self.project_per_sentence:  # the old way (benchmark)
                secondary, secondary_order = secondary.index_select(1, secondary_order), None
            k_s, v_s = self._heads(self.k_sec_proj(secondary)), self._heads(self.v_sec_proj(secondary))
            if secondary_order is not None:
                k_s, v_s = k_s.index_select(0, secondary_order), v_s.index_select(0, secondary_order)
        if incremental_state is not None:
            new_state = {"prev_key": k_r, "prev_value": v_r, "secondary_key": k_s, "secondary_value": v_s}
            if secondary_padding_mask is not None:
                new_state["secondary_padding_mask"] = secondary_padding_mask
            self.set_incremental_state(incremental_state, "joint_attn", new_state)

        S, Tr = k_s.size(2), k_r.size(2)
        k = torch.cat([k_s, k_r], dim=2)  # joint keys   [K^S; K^R]
        v = torch.cat([v_s, v_r], dim=2)  # joint values [V^S; V^R]
        allowed = None  # B x 1 x T x (S + Tr), True = may attend
        if secondary_padding_mask is not None or self_padding_mask is not None or (causal and T > 1):
            dev = query.device
            sec_ok = (~secondary_padding_mask.bool())[:, None, None, :] if secondary_padding_mask is not None \
                else torch.ones(B, 1, 1, S, dtype=torch.bool, device=dev)
            self_ok = (~self_padding_mask.bool())[:, None, None, :] if self_padding_mask is not None \
                else torch.ones(B, 1, 1, Tr, dtype=torch.bool, device=dev)
            self_ok = self_ok.expand(B, 1, T, Tr)
            if causal:  # query t sees primary keys up to its own position (self part only)
                self_ok = self_ok & torch.ones(T, Tr, dtype=torch.bool, device=dev).tril(diagonal=Tr - T)
            allowed = torch.cat([sec_ok.expand(B, 1, T, S), self_ok], dim=-1)
        dropout_p = self.dropout_p if self.training else 0.0
        weights = None
        if need_weights:
            scores = torch.matmul(q * self.scaling, k.transpose(-1, -2))
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            probs = utils.softmax(scores, dim=-1, onnx_trace=False).type_as(scores)
            out = torch.matmul(F.dropout(probs, p=dropout_p, training=self.training), v)
            weights = probs[..., :S]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
        out = out.permute(2, 0, 1, 3).reshape(T, B, self.embed_dim)
        return self.out_proj(out), weights

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        state = self.get_incremental_state(incremental_state, "joint_attn")
        if state:
            self.set_incremental_state(incremental_state, "joint_attn",
                                       {k: v.index_select(0, new_order) for k, v in state.items()})


# --------------------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------------------

class _FFNMixin:
    def upgrade_state_dict_named(self, state_dict, name):
        """Nothing to upgrade: every phase and version uses the same parameter names."""
        return state_dict

    def _build_ffn(self, cfg, embed_dim, ffn_dim):
        self.activation_fn = utils.get_activation_fn(activation=cfg.activation_fn)
        p = cfg.activation_dropout if cfg.activation_dropout else (cfg.relu_dropout or 0.0)
        self.activation_dropout_module = FairseqDropout(float(p), module_name=self.__class__.__name__)
        self.fc1 = Linear(embed_dim, ffn_dim)
        self.fc2 = Linear(ffn_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)

    def _ffn(self, x):
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.fc2(self.activation_dropout_module(self.activation_fn(self.fc1(x))))
        x = residual + self.dropout_module(x)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x


class BertJamEncoderLayer(nn.Module, _FFNMixin):
    """E'^i = Attn_joint(E^i, B^{E,i}) (Eq. 9), then the FFN; residual + layer norm around both."""

    def __init__(self, cfg, bert_dim, bert_layers, composition):
        super().__init__()
        d = cfg.encoder.embed_dim
        self.normalize_before = cfg.encoder.normalize_before
        self.dropout_module = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)
        self.bert_composition = BertLayerComposition(bert_layers, composition)  # B^{E,i}, Eq. 8
        self.joint_attn = JointMultiheadAttention(d, bert_dim, cfg.encoder.attention_heads, cfg.attention_dropout)
        self.joint_attn_layer_norm = LayerNorm(d)
        self._build_ffn(cfg, d, cfg.encoder.ffn_embed_dim)

    def forward(self, x, encoder_padding_mask, bert_layers, bert_padding_mask):
        residual = x
        if self.normalize_before:
            x = self.joint_attn_layer_norm(x)
        x, _ = self.joint_attn(x, self.bert_composition(bert_layers), bert_padding_mask,
                               self_padding_mask=encoder_padding_mask)
        x = residual + self.dropout_module(x)
        if not self.normalize_before:
            x = self.joint_attn_layer_norm(x)
        return self._ffn(x)


class BertJamDecoderLayer(nn.Module, _FFNMixin):
    """D'^i = 1/2 (Attn_joint(D^i, B^{D,i}) + Attn_joint(D^i, E^L)) (Eq. 10), then the FFN.

    With ``--bert-dropnet p`` > 0 the official code's drop-net replaces the 1/2, 1/2 while training: with
    probability p only the encoder branch, with probability p only the BERT branch (bert-nmt's scheme)."""

    def __init__(self, cfg, bert_dim, bert_layers, composition, dropnet=0.0):
        super().__init__()
        d = cfg.decoder.embed_dim
        self.normalize_before = cfg.decoder.normalize_before
        self.dropout_module = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)
        self.dropnet = float(dropnet)
        self.skip_dropped_branch = True  # False: compute both branches and weight one by 0 (benchmarks, tests)
        self.bert_composition = BertLayerComposition(bert_layers, composition)  # B^{D,i}, Eq. 8
        heads = cfg.decoder.attention_heads
        self.bert_attn = JointMultiheadAttention(d, bert_dim, heads, cfg.attention_dropout)
        self.encoder_attn = JointMultiheadAttention(d, cfg.encoder.embed_dim, heads, cfg.attention_dropout)
        self.joint_attn_layer_norm = LayerNorm(d)
        self._build_ffn(cfg, d, cfg.decoder.ffn_embed_dim)

    def branch_weights(self):
        if self.training and self.dropnet > 0:
            u = torch.rand(()).item()
            if u < self.dropnet:
                return 1.0, 0.0
            if u > 1.0 - self.dropnet:
                return 0.0, 1.0
        return 0.5, 0.5  # Eq. 10

    def forward(self, x, encoder_out, encoder_padding_mask, bert_layers, bert_padding_mask,
                incremental_state=None, self_padding_mask=None, causal=True, need_attn=False,
                bert_order: Optional[Tensor] = None):
        residual = x
        if self.normalize_before:
            x = self.joint_attn_layer_norm(x)
        w_enc, w_bert = self.branch_weights()
        skip = self.skip_dropped_branch
        out, attn = residual, None
        if w_enc != 0.0 or not skip:  # drop-net: a branch weighted 0 is not computed at all
            x_enc, attn = self.encoder_attn(x, encoder_out, encoder_padding_mask, self_padding_mask, causal,
                                            incremental_state, need_weights=need_attn)
            out = out + w_enc * self.dropout_module(x_enc)
        if w_bert != 0.0 or not skip:
            B = None
            if not self.bert_attn.has_secondary_cache(incremental_state):
                B = self.bert_composition(bert_layers)  # B^{D,i}, on the encoder's batch (per token)
            x_bert, _ = self.bert_attn(x, B, bert_padding_mask, self_padding_mask, causal, incremental_state,
                                       secondary_order=bert_order)
            out = out + w_bert * self.dropout_module(x_bert)
        x = out
        if not self.normalize_before:
            x = self.joint_attn_layer_norm(x)
        return self._ffn(x), attn


# --------------------------------------------------------------------------------------------------------
# BERT, encoder, decoder
# --------------------------------------------------------------------------------------------------------

def wrap_layer(layer, cfg):
    """What fairseq's TransformerEncoderBase/DecoderBase do to each layer: ``--checkpoint-activations``
    (``--offload-activations``) and FSDP wrapping."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class BertJamEncoder(TransformerEncoderBase):
    """E^L from the source and BERT. While BERT is frozen (phases 1-2) its weights are left out of the state
    dict (so of every checkpoint): the checkpoint keeps ``bert_sha256``, the content hash of the pre-trained
    weights of ``--bert-model-name``, and loading it refills BERT from that directory after checking the hash."""

    def __init__(self, args, cfg, dictionary, embed_tokens, bert, bert_sha256=None):
        self.args = args  # read by build_encoder_layer, which the base constructor calls
        self._bert_dims = (bert.config.hidden_size, bert.config.num_hidden_layers)
        super().__init__(cfg, dictionary, embed_tokens)
        self.bert = bert
        self.bert_trainable = True
        self.bert_last_only = False  # set by BertJamModel: every composition selects B_L (phase 1, M2)
        self._bert_input_builder = None
        self.bert_pad_id = bert.config.pad_token_id
        if self.bert_pad_id is None:  # the config does not say: ask the tokenizer
            self.bert_pad_id = self.bert_input_builder().pad_id
        digest = torch.zeros(32, dtype=torch.long)  # int64: checkpoint averaging keeps it exact
        if bert_sha256:
            digest = torch.tensor(list(bytes.fromhex(bert_sha256)), dtype=torch.long)
        self.register_buffer("bert_sha256", digest)
        self.register_state_dict_post_hook(leave_out_frozen_bert)
        self.register_load_state_dict_pre_hook(refill_frozen_bert)

    def build_encoder_layer(self, cfg):
        return wrap_layer(BertJamEncoderLayer(cfg, *self._bert_dims, self.args.bert_composition), cfg)

    def bert_digest(self) -> str:
        return bytes(self.bert_sha256.tolist()).hex()

    # -- BERT input: from the batch, or derived from the source tokens (fairseq-interactive, unprepared data)
    def bert_input_builder(self):
        if self._bert_input_builder is None:
            a = self.args
            self._bert_input_builder = BertInputBuilder(
                a.bert_model_name, self.dictionary, getattr(a, "bert_remove_bpe", "auto"),
                getattr(a, "bert_detokenize", "auto"), getattr(a, "bert_max_length", 0))
            self.bert_pad_id = self._bert_input_builder.pad_id
        return self._bert_input_builder

    def forward_bert(self, bert_input: Tensor):
        """Step 1: BERT(X) = (B_1, ..., B_L) as one (T_bert, B, C_bert, L) tensor, plus its padding mask; only
        B_L, as (T_bert, B, C_bert), when every composition selects it (``bert_last_only``)."""
        bert_padding_mask = bert_input.eq(self.bert_pad_id)
        with torch.set_grad_enabled(self.bert_trainable and torch.is_grad_enabled()):
            out = self.bert(input_ids=bert_input, attention_mask=(~bert_padding_mask).long(),
                            output_hidden_states=not self.bert_last_only, return_dict=True)
            if self.bert_last_only:
                return out.last_hidden_state.transpose(0, 1), bert_padding_mask
            layers = torch.stack(out.hidden_states[1:], dim=-1)  # B x T x C x L (embedding output excluded)
        return layers.transpose(0, 1).contiguous(), bert_padding_mask

    def precomputed_bert(self, bert_out: Tensor, bert_input: Optional[Tensor]):
        """What :meth:`forward_bert` gives, from BERT's precomputed features (``--bert-feature-cache``):
        ``bert_out`` B x T_bert x C_bert (B_L) or B x T_bert x C_bert x L (every layer), in any float dtype, with
        the BERT input for its padding mask. Refused while BERT is trained (phase 3), and when it holds B_L alone
        but the compositions read every layer."""
        if self.bert_trainable:
            raise FairseqExtError("precomputed BERT features (--bert-feature-cache) were given but BERT is being "
                                  "fine-tuned (--bert-jam-phase 3): they would not follow its updates; drop "
                                  "--bert-feature-cache in phase 3")
        if bert_input is None:
            raise FairseqExtError("precomputed BERT features (bert_out) need the BERT input (bert_input) beside "
                                  "them for the padding mask")
        C, L = self._bert_dims
        if bert_out.dim() == 4 and bert_out.size(-1) == L and self.bert_last_only:
            bert_out = bert_out[..., -1]
        ok = bert_out.shape[:2] == bert_input.shape and bert_out.size(2) == C and (
            bert_out.dim() == 3 if self.bert_last_only else (bert_out.dim() == 4 and bert_out.size(3) == L))
        if not ok:
            need = "B_L alone (B x T x C)" if self.bert_last_only else f"all {L} layers (B x T x C x L)"
            raise FairseqExtError(
                f"precomputed BERT features of shape {tuple(bert_out.shape)} do not fit this model, which reads "
                f"{need} with C = {C} for BERT input {tuple(bert_input.shape)}" + (
                    "" if self.bert_last_only or bert_out.dim() != 3 else
                    "; the layer compositions have left Eq. 11 (phase 2, or a checkpoint trained in phase 2): use "
                    "--bert-feature-cache-layers all (another --bert-feature-cache directory)"))
        bert_out = bert_out.to(self.embed_tokens.weight.dtype).transpose(0, 1)
        return (bert_out if self.bert_last_only else bert_out.contiguous()), bert_input.eq(self.bert_pad_id)

    def forward(self, src_tokens, src_lengths: Optional[Tensor] = None, return_all_hiddens: bool = False,
                token_embeddings: Optional[Tensor] = None, bert_input: Optional[Tensor] = None,
                bert_out: Optional[Tensor] = None):
        """``bert_out``: BERT's precomputed features (``--bert-feature-cache``, see :meth:`precomputed_bert`);
        BERT then does not run."""
        if bert_out is not None:
            bert_layers, bert_padding_mask = self.precomputed_bert(bert_out, bert_input)
        else:
            if bert_input is None:
                bert_input = self.bert_input_builder().batch_from_source(src_tokens)
            bert_layers, bert_padding_mask = self.forward_bert(bert_input)

        encoder_padding_mask = src_tokens.eq(self.padding_idx)
        x, encoder_embedding = self.forward_embedding(src_tokens, token_embeddings)
        if encoder_padding_mask.any():
            x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))
        x = x.transpose(0, 1)  # T x B x C  (E^0)
        encoder_states = [x] if return_all_hiddens else []
        for layer in self.layers:
            x = layer(x, encoder_padding_mask, bert_layers, bert_padding_mask)
            if return_all_hiddens:
                encoder_states.append(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        if src_lengths is None:
            src_lengths = src_tokens.ne(self.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1)
        return {
            "encoder_out": [x],  # E^L: T x B x C
            "encoder_padding_mask": [encoder_padding_mask],  # B x T
            "encoder_embedding": [encoder_embedding],  # B x T x C
            "encoder_states": encoder_states,
            "fc_results": [],
            "src_tokens": [],
            "src_lengths": [src_lengths],
            "bert_out": [bert_layers],  # T_bert x B x C_bert x L, never reordered: see bert_order
            "bert_order": [],  # empty = batch order; else the rows of bert_out that form the current batch
            "bert_padding_mask": [bert_padding_mask],  # B x T_bert, reordered
        }

    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order):
        """Reorders E^L and the masks; BERT's L layers are not copied (beam search reorders at every step):
        only the index ``bert_order`` is composed, and each layer selects its (much smaller) composite."""
        new = super().reorder_encoder_out(encoder_out, new_order)
        new["bert_out"] = encoder_out["bert_out"]
        old = encoder_out["bert_order"]
        new["bert_order"] = [old[0].index_select(0, new_order) if len(old) else new_order]
        new["bert_padding_mask"] = [t.index_select(0, new_order) for t in encoder_out["bert_padding_mask"]]
        return new


class BertJamDecoder(TransformerDecoderBase):
    def __init__(self, args, cfg, dictionary, embed_tokens, bert_dims):
        self.args = args
        self._bert_dims = bert_dims
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=False)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return wrap_layer(BertJamDecoderLayer(cfg, *self._bert_dims, self.args.bert_composition,
                                              self.args.bert_dropnet), cfg)

    @staticmethod
    def static_step_graph():
        """The graph of this decoder's step on the static decoder step (fairseq_ext/bert_jam/static_step.py)."""
        from fairseq_ext.bert_jam.static_step import JointStepGraph

        return JointStepGraph

    def extract_features_scriptable(self, prev_output_tokens, encoder_out, incremental_state=None,
                                    full_context_alignment: bool = False, alignment_layer: Optional[int] = None,
                                    alignment_heads: Optional[int] = None):
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1
        enc = encoder_out["encoder_out"][0]
        enc_mask = encoder_out["encoder_padding_mask"][0] if len(encoder_out["encoder_padding_mask"]) else None
        bert_layers = encoder_out["bert_out"][0]
        bert_mask = encoder_out["bert_padding_mask"][0]
        bert_order = encoder_out["bert_order"][0] if len(encoder_out.get("bert_order", [])) else None

        prev_output_tokens, positions = newest_positions(self, prev_output_tokens, incremental_state)
        x = embed_decoder_input(self, prev_output_tokens, positions)  # D^0: T x B x C

        self_padding_mask = None
        if incremental_state is None and prev_output_tokens.eq(self.padding_idx).any():
            self_padding_mask = prev_output_tokens.eq(self.padding_idx)
        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x]
        for idx, layer in enumerate(self.layers):
            x, layer_attn = layer(x, enc, enc_mask, bert_layers, bert_mask, incremental_state,
                                  self_padding_mask, causal=not full_context_alignment,
                                  need_attn=idx == alignment_layer, bert_order=bert_order)
            inner_states.append(x)
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)  # B x H x T x S
        # attn: B x H x T x S -> B x T x S (weights on E^L inside the joint softmax)
        return decoder_output(self, x, attn, inner_states, alignment_heads, head_dim=1)


# --------------------------------------------------------------------------------------------------------
# the model and the three phases
# --------------------------------------------------------------------------------------------------------

@register_model("bert_jam")
class BertJamModel(TransformerModel):
    """BERT-JAM; ``--task translation_bert --bert-model-name DIR --bert-jam-phase {1,2,3}``."""

    def __init__(self, args, encoder, decoder):
        super().__init__(args, encoder, decoder)
        self.set_phase(args.bert_jam_phase)

    @classmethod
    def hub_models(cls):
        return {}  # not the plain transformer archives that TransformerModel lists

    @classmethod
    def add_args(cls, parser):
        TransformerModel.add_args(parser)
        parser.add_argument("--bert-jam-phase", type=int, choices=[1, 2, 3],
                            help="three-phase optimisation (Section 2.4): 1 = BERT and GLUs frozen (GLU output "
                                 "x2), 2 = GLUs trainable, 3 = BERT fine-tuned too; start phase N+1 from phase "
                                 "N's checkpoint with --restore-file CKPT --reset-optimizer (optimizer state "
                                 "reset, update counter and LR schedule continued) or --finetune-from-model CKPT "
                                 "(all restarted)")
        parser.add_argument("--bert-composition", choices=COMPOSITIONS,
                            help="how each layer composes BERT's layers: glu (Eq. 8), linear (ablation M1: "
                                 "weighted sum, no gate), last (ablation M2: last BERT layer only)")
        parser.add_argument("--bert-jam-decoder", choices=DECODERS,
                            help="joint (default): the paper's decoder, one joint attention over [source; "
                                 "history] and over the composed BERT layers (Eq. 10); standard: fairseq's "
                                 "transformer decoder layers (self-attention, then attention over the joint "
                                 "encoder's output), the ablation that isolates the decoder")
        parser.add_argument("--bert-jam-init-layer", type=int, metavar="N",
                            help="the BERT layer Eq. 11 initialises every composition to, so the one phase 1 reads "
                                 "(1..L; default L, the paper's): the layer-choice control")
        parser.add_argument("--bert-dropnet", type=float, metavar="P",
                            help="drop-net of the official code in the decoder while training: with "
                                 "probability P each branch alone (0 = Eq. 10's mean always; at most 0.5)")

    @classmethod
    def build_model(cls, args, task):
        bert_jam_base_architecture(args)
        if not 0.0 <= args.bert_dropnet <= 0.5:
            raise FairseqExtError(f"--bert-dropnet {args.bert_dropnet}: must be in [0, 0.5]")
        if args.bert_jam_decoder not in DECODERS:
            raise FairseqExtError(f"--bert-jam-decoder {args.bert_jam_decoder!r}: choose from {', '.join(DECODERS)}")
        name = getattr(getattr(task, "cfg", None), "bert_model_name", None) or getattr(args, "bert_model_name", None)
        if not name:
            raise FairseqExtError("--arch bert_jam* needs --task translation_bert --bert-model-name DIR (a "
                                  "local BERT-architecture model directory)")
        args.bert_model_name = name
        if args.encoder_layers_to_keep or args.decoder_layers_to_keep:
            raise FairseqExtError("--encoder/decoder-layers-to-keep is not supported by bert_jam")
        # from a checkpoint of phase 3 only the architecture is built: the checkpoint holds the fine-tuned BERT;
        # phase 1-2 checkpoints do not hold BERT, which is loaded from the directory (and its hash checked)
        from_checkpoint = building_from_checkpoint()
        bert = build_bert(name, from_checkpoint=from_checkpoint and args.bert_jam_phase == 3)
        digest = None if from_checkpoint and args.bert_jam_phase == 3 else bert_content_sha256(bert)

        cfg = TransformerConfig.from_namespace(args)
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        if args.share_all_embeddings:
            if src_dict != tgt_dict:
                raise FairseqExtError("--share-all-embeddings requires a joined dictionary "
                                      "(fairseq-preprocess --joined-dictionary)")
            if args.encoder_embed_dim != args.decoder_embed_dim:
                raise FairseqExtError("--share-all-embeddings requires --encoder-embed-dim == --decoder-embed-dim")
            encoder_embed = cls.build_embedding(args, src_dict, args.encoder_embed_dim, args.encoder_embed_path)
            decoder_embed = encoder_embed
            args.share_decoder_input_output_embed = True
            cfg.share_decoder_input_output_embed = True
        else:
            encoder_embed = cls.build_embedding(args, src_dict, args.encoder_embed_dim, args.encoder_embed_path)
            decoder_embed = cls.build_embedding(args, tgt_dict, args.decoder_embed_dim, args.decoder_embed_path)
        encoder = BertJamEncoder(args, cfg, src_dict, encoder_embed, bert, digest)
        builder = encoder.bert_input_builder()
        check_tokenizer_fits(name, builder.tokenizer, bert.config)
        # the BERT input settings travel in the checkpoint (args): at generation the model derives its input
        # with the training's settings, and they are checked against what the tokenizer gives now
        meta = input_settings(builder.meta())
        saved = getattr(args, "bert_input_meta", None)
        if from_checkpoint and saved:
            check_input_settings(saved, meta, "the BERT input settings saved in the checkpoint",
                                 f"what --bert-model-name {name} gives now")
        args.bert_input_meta = meta
        if args.bert_jam_decoder == "joint":
            decoder = BertJamDecoder(args, cfg, tgt_dict, decoder_embed, encoder._bert_dims)
        else:  # the ablation: fairseq's own decoder on the same joint encoder
            decoder = TransformerDecoderBase(cfg, tgt_dict, decoder_embed, no_encoder_attn=False)
        if args.bert_jam_init_layer:  # Eq. 11 at another layer; a checkpoint's weights replace it when loaded
            for module in (encoder, decoder):
                for comp in module.modules():
                    if isinstance(comp, BertLayerComposition):
                        comp.start_at(args.bert_jam_init_layer)
        return cls(args, encoder, decoder)

    def compositions(self):
        return [m for m in self.modules() if isinstance(m, BertLayerComposition)]

    def set_phase(self, phase: int):
        """Section 2.4. Phase 1: BERT and the GLUs frozen, GLU output x2 (Eq. 11 compensation); phase 2: GLUs
        trainable, x1; phase 3: BERT fine-tuned as well (its pooler does not exist)."""
        if phase not in (1, 2, 3):
            raise FairseqExtError(f"--bert-jam-phase {phase}: must be 1, 2 or 3")
        self.phase = phase
        for p in self.encoder.bert.parameters():
            p.requires_grad_(phase == 3)
        self.encoder.bert_trainable = phase == 3
        for comp in self.compositions():
            for p in comp.parameters():
                p.requires_grad_(phase >= 2)
            comp.scale = 2.0 if (phase == 1 and comp.mode == "glu") else 1.0
        self.refresh_bert_last_only()

    def refresh_bert_last_only(self):
        """Compute only what the compositions select: when every one of them gives exactly B_L (phase 1 at
        Eq. 11, M2), BERT's other layers are neither stacked nor composed. Run by set_phase and load_state_dict;
        run it again after changing frozen composition weights by hand."""
        self.encoder.bert_last_only = all(c.selects_last_layer() for c in self.compositions())

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        out = super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)
        self.refresh_bert_last_only()
        return out

    def forward(self, src_tokens, src_lengths, prev_output_tokens, bert_input: Optional[Tensor] = None,
                return_all_hiddens: bool = True, features_only: bool = False,
                alignment_layer: Optional[int] = None, alignment_heads: Optional[int] = None,
                bert_out: Optional[Tensor] = None):
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths, return_all_hiddens=return_all_hiddens,
                                   bert_input=bert_input, bert_out=bert_out)
        return self.decoder(prev_output_tokens, encoder_out=encoder_out, features_only=features_only,
                            alignment_layer=alignment_layer, alignment_heads=alignment_heads,
                            src_lengths=src_lengths, return_all_hiddens=return_all_hiddens)


# --------------------------------------------------------------------------------------------------------
# architectures (Section 3.1 and the official bt_glu_joint presets)
# --------------------------------------------------------------------------------------------------------

@register_model_architecture("bert_jam", "bert_jam")
def bert_jam_base_architecture(args):
    """Transformer-base sizes (512/2048/8 heads, 6+6), post-norm, phase 1 with GLU composition."""
    args.bert_jam_phase = getattr(args, "bert_jam_phase", None) or 1
    args.bert_composition = getattr(args, "bert_composition", None) or "glu"
    args.bert_dropnet = getattr(args, "bert_dropnet", None) or 0.0
    args.bert_jam_decoder = getattr(args, "bert_jam_decoder", None) or "joint"
    args.bert_jam_init_layer = getattr(args, "bert_jam_init_layer", None) or 0  # 0: L, the paper's Eq. 11
    transformer_base_architecture(args)


@register_model_architecture("bert_jam", "bert_jam_iwslt_de_en")
def bert_jam_iwslt_de_en(args):
    """IWSLT: d_model 512, d_ff 1024, 4 heads, 6+6 layers, dropout 0.3."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 512)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 1024)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 4)
    args.encoder_layers = getattr(args, "encoder_layers", 6)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 512)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 1024)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    args.decoder_layers = getattr(args, "decoder_layers", 6)
    args.dropout = getattr(args, "dropout", 0.3)
    bert_jam_base_architecture(args)


@register_model_architecture("bert_jam", "bert_jam_wmt_en_de_big")
def bert_jam_wmt_en_de_big(args):
    """WMT: d_model 1024, d_ff 4096, 16 heads, 6+6 layers, dropout 0.3."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 1024)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 4096)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 16)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 1024)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 4096)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 16)
    args.dropout = getattr(args, "dropout", 0.3)
    bert_jam_base_architecture(args)
