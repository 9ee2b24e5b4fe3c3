"""Semi-Autoregressive Transformer (SAT), Wang, Zhang and Chen, EMNLP 2018 ("Semi-Autoregressive Neural
Machine Translation", arXiv 1808.08583), as a subclass of fairseq's ``transformer``.

The paper changes only the decoder (Sec. 3, Figure 2):

* group-level chain rule (Sec. 3.1): y_1..y_n is cut into groups G_1, G_2, ... of K consecutive words and
  p(y|x) = prod_t p(G_t | G_<t, x); the K words of a group are predicted in parallel;
* long-distance prediction (Sec. 3.2): the decoder input that predicts y_t is y_{t-K} (not y_{t-1}); the first
  group is predicted from K start symbols <s> (here K copies of fairseq's BOS, the EOS index, told apart
  only by their positions, as in the authors' sa-nmt code);
* relaxed causal mask (Sec. 3.3): M[i][j] = 1 iff j < (floor(i/K) + 1) * K (0-based i, j; the paper writes
  it 1-based in i), so a position sees every input of its own group and of earlier groups.

With K = 1 all three reduce to the Transformer, and this model equals fairseq's ``transformer`` exactly.

``--sat-freeze-encoder`` (with ``--sat-init-from``, not in the paper) keeps the encoder of the initialising
transformer and trains the decoder alone: a drafter for speculative decoding (:mod:`fairseq_ext.sat.speculative`)
that reads its verifier's encoder output, so that a sentence is encoded once.

Where the shift lives: :class:`SATDecoder` consumes *SAT decoder inputs* (K start symbols followed by the
target prefix). :meth:`SATModel.forward` builds them from fairseq's usual ``prev_output_tokens`` (one BOS +
target shifted by one) with :func:`sat_decoder_input`, so the data pipeline, the batches and the stock
``label_smoothed_cross_entropy`` criterion work unchanged. The generator
(:mod:`fairseq_ext.sat.generator`) feeds SAT decoder inputs directly, K new positions per call.
"""

import logging
import os
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq import checkpoint_utils
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoderBase, TransformerModel
from fairseq.models.transformer.transformer_legacy import (
    base_architecture,
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
)

from fairseq_ext.common.building import building_from_checkpoint
from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.common.decoder_features import cached_length, decoder_output, embed_decoder_input, new_positions

logger = logging.getLogger(__name__)


def sat_decoder_input(prev_output_tokens: Tensor, group_size: int, start: int) -> Tensor:
    """SAT decoder input from fairseq's ``prev_output_tokens`` = [<s>, y_1, ..., y_{T-1}] (right-padded).

    Position t (0-based) gets y_{t+1-K} (long-distance prediction, Sec. 3.2), i.e. K start symbols then the
    target: ``cat([<s>] * (K-1), prev_output_tokens)``. It is cut to ceil(T/K)*K positions, so that the last
    group is complete: under the relaxed mask a position sees all K inputs of its group, and at inference
    those are the K (already generated) words of the previous group. Every kept input is a real word of the
    sentence or <s>: position t < ceil(T_i/K)*K needs y_{t+1-K} with t+1-K <= T_i-1 (before its EOS).
    """
    if group_size == 1:
        return prev_output_tokens
    bsz, tgt_len = prev_output_tokens.size()
    n_groups = (tgt_len + group_size - 1) // group_size
    starts = prev_output_tokens.new_full((bsz, group_size - 1), start)
    return torch.cat([starts, prev_output_tokens], dim=1)[:, : n_groups * group_size]


def relaxed_causal_mask(first_query: int, num_keys: int, group_size: int, like: Tensor) -> Tensor:
    """Additive self-attention mask (0 or -inf) for query positions first_query..num_keys-1 over key
    positions 0..num_keys-1: M[i][j] = 1 iff j < (floor(i/K) + 1) * K (Sec. 3.3, Figure 4)."""
    i = torch.arange(first_query, num_keys, device=like.device).unsqueeze(1)
    j = torch.arange(num_keys, device=like.device).unsqueeze(0)
    visible = j < (torch.div(i, group_size, rounding_mode="floor") + 1) * group_size
    mask = torch.zeros(visible.shape, dtype=like.dtype, device=like.device)
    return mask.masked_fill_(~visible, float("-inf"))


class SATDecoder(TransformerDecoderBase):
    """fairseq's Transformer decoder with the relaxed causal mask and K new positions per incremental step.

    Input: SAT decoder inputs (see :func:`sat_decoder_input`). In incremental mode the input is the whole
    prefix (K start symbols and the words generated so far); the positions not yet in the cache (normally
    exactly one group of K) are embedded at their true positions and attend, in every layer, to the cached
    keys and to each other. fairseq's own ``extract_features`` keeps only the last token and its positional
    embeddings return a single position, so :meth:`extract_features_scriptable` is overridden here; the
    layers, attention modules and their caches are fairseq's (``MultiheadAttention`` appends any number of
    new keys to its cache, and ``reorder_incremental_state`` is inherited).
    """

    # the lean decoder step of fairseq_ext.inference computes this decoder's incremental step: fairseq's layers over
    # the group_size new positions of a call, under incremental_self_attn_mask when a call adds several groups
    supports_lean_step = True

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        self.group_size = int(getattr(cfg, "sat_group_size", 1))
        self.start_symbol = dictionary.eos()  # the K start symbols <s> (fairseq's BOS is the EOS index)
        self._relaxed_mask = torch.empty(0)

    # -- relaxed causal mask for the full (training) pass ------------------------------------------------
    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        if (self._relaxed_mask.size(0) < dim or self._relaxed_mask.device != tensor.device
                or self._relaxed_mask.dtype != tensor.dtype):
            self._relaxed_mask = relaxed_causal_mask(0, max(dim, 64), self.group_size, tensor)
        return self._relaxed_mask[:dim, :dim]

    def incremental_self_attn_mask(self, first_query: int, num_keys: int, like: Tensor) -> Tensor:
        """Rows first_query..num_keys-1 of the relaxed causal mask (Sec. 3.3): an incremental call of several
        groups."""
        return relaxed_causal_mask(first_query, num_keys, self.group_size, like)

    def max_positions(self):
        # the SAT decoder input is up to K-1 positions longer than the target (K start symbols, last group)
        return super().max_positions() - (self.group_size - 1)

    def extract_features_scriptable(
        self,
        prev_output_tokens,
        encoder_out: Optional[Dict[str, List[Tensor]]],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        bs, slen = prev_output_tokens.size()
        K = self.group_size
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1

        enc: Optional[Tensor] = None
        padding_mask: Optional[Tensor] = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
        if encoder_out is not None and len(encoder_out["encoder_padding_mask"]) > 0:
            padding_mask = encoder_out["encoder_padding_mask"][0]

        n_cached = 0
        if incremental_state is not None:
            n_cached = cached_length(self, incremental_state)
            if slen % K != 0:  # a group's outputs depend on all K of its inputs (relaxed mask)
                raise FairseqExtError(
                    f"sat_transformer with --sat-group-size {K} was asked to decode a prefix of {slen} "
                    f"position(s): incremental decoding consumes whole groups of {K} (K start symbols, then "
                    f"{K} new positions per step). Decode it with --task translation_sat (fairseq-generate, "
                    f"fairseq-interactive, --eval-bleu); fairseq's SequenceGenerator adds one token per step."
                )
            if slen <= n_cached:
                raise FairseqExtError(
                    f"SATDecoder: the decoder input ({slen} positions) must extend the {n_cached} cached ones")

        # embed tokens and positions (only the positions not yet cached in incremental mode)
        positions = None
        if self.embed_positions is not None:
            if incremental_state is None:
                positions = self.embed_positions(prev_output_tokens)
            else:
                positions = new_positions(self, prev_output_tokens, n_cached)
        tokens = prev_output_tokens[:, n_cached:].contiguous()

        x = embed_decoder_input(self, tokens, positions)  # T x B x C

        # padding keys exist only in the full pass (right-padded targets); the prefix of incremental decoding
        # has none, so no host sync (.any()) is spent there
        self_attn_padding_mask: Optional[Tensor] = None
        if self.cross_self_attention or (incremental_state is None and tokens.eq(self.padding_idx).any()):
            self_attn_padding_mask = tokens.eq(self.padding_idx)

        # relaxed causal mask (Sec. 3.3). Incremental: rows n_cached..slen-1 of M; when the new positions are
        # exactly one group every entry is visible (the new K queries see the cache and each other): no mask.
        self_attn_mask: Optional[Tensor] = None
        if not full_context_alignment:
            if incremental_state is None:
                self_attn_mask = self.buffered_future_mask(x)
            elif slen > (n_cached // K + 1) * K:
                self_attn_mask = relaxed_causal_mask(n_cached, slen, K, x)

        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x]
        for idx, layer in enumerate(self.layers):
            x, layer_attn, _ = layer(
                x,
                enc,
                padding_mask,
                incremental_state,
                self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask,
                need_attn=bool((idx == alignment_layer)),
                need_head_weights=bool((idx == alignment_layer)),
            )
            inner_states.append(x)
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)

        return decoder_output(self, x, attn, inner_states, alignment_heads)


def _train_will_restore(args) -> bool:
    """Whether fairseq-train, run with these options, loads model weights from a checkpoint after building the
    model (the resolution of fairseq's ``checkpoint_utils.load_checkpoint``: ``--restore-file``, by default
    SAVE_DIR/checkpoint_last.pt, else ``--continue-once`` / ``--finetune-from-model`` on a first launch)."""
    restore = getattr(args, "restore_file", None)
    if not restore:
        return False
    suffix = getattr(args, "checkpoint_suffix", "") or ""
    if restore == "checkpoint_last.pt":
        last = os.path.join(getattr(args, "save_dir", None) or "checkpoints", f"checkpoint_last{suffix}.pt")
        if os.path.exists(last):
            return True
        return bool(getattr(args, "continue_once", None) or getattr(args, "finetune_from_model", None))
    return os.path.exists(restore.replace(".pt", suffix + ".pt") if suffix else restore)


def group_size(model) -> int:
    """K of a built model, read in this one place (a plain ``transformer`` decodes as K = 1). The decoder takes
    it from ``--sat-group-size`` when it is built; :meth:`SATModel.build_model` validates it before."""
    return int(getattr(getattr(model, "decoder", None), "group_size", 1))


@register_model("sat_transformer")
class SATModel(TransformerModel):
    """Semi-Autoregressive Transformer: fairseq's Transformer with :class:`SATDecoder`.

    ``--sat-group-size K`` is stored in the checkpoint. Decode with ``--task translation_sat`` (its
    generator calls the decoder once per group of K words).
    """

    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="model.pt", data_name_or_path=".", **kwargs):
        """fairseq's hub interface; ``.translate()``/``.generate()`` use the semi-autoregressive generator
        even when the checkpoint was trained with ``--task translation`` (a fairseq ``transformer`` checkpoint too).
        ``sat_draft_path=SAT.pt`` (and ``sat_draft_speedups``): lossless speculative greedy decoding of the loaded
        model with that drafter (:mod:`fairseq_ext.sat.speculative`)."""
        import functools

        from fairseq.tasks import TASK_REGISTRY  # the SAT generator by the task's registered name

        draft = {k[4:]: kwargs.pop(k) for k in ("sat_draft_path", "sat_draft_speedups") if kwargs.get(k)}
        hub = super().from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path, **kwargs)
        if not getattr(hub.task, "builds_sat_generator", False) or draft:
            build = hub.task.build_generator if getattr(hub.task, "builds_sat_generator", False) else \
                functools.partial(TASK_REGISTRY["translation_sat"].sat_generator, hub.task)
            hub.task.build_generator = functools.partial(build, **draft)
        return hub

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        parser.add_argument("--sat-group-size", type=int, metavar="K",
                            help="group size K: words produced in parallel per decoder step (K=1: Transformer)")
        parser.add_argument("--sat-init-from", type=str, metavar="PATH",
                            help="initialise from a trained transformer checkpoint: encoder, word embeddings "
                                 "and pre-softmax weights (Sec. 4.1 'Initialization')")
        parser.add_argument("--sat-freeze-encoder", action="store_true",
                            help="with --sat-init-from: keep the encoder (and the embeddings it shares) as initialised "
                                 "and train the decoder alone, so that a speculative drafter reads its verifier's "
                                 "encoder output (--sat-draft-path)")
        parser.add_argument("--sat-init-decoder", action="store_true",
                            help="with --sat-init-from, also copy the decoder layers (not done in the paper)")

    @classmethod
    def build_model(cls, args, task):
        sat_base_architecture(args)
        K = getattr(args, "sat_group_size", None)
        if not isinstance(K, int) or K < 1:
            raise FairseqExtError(f"--sat-group-size must be a positive integer (got {K!r})")
        from fairseq.models.transformer import DEFAULT_MAX_TARGET_POSITIONS

        max_tgt = getattr(args, "max_target_positions", None) or DEFAULT_MAX_TARGET_POSITIONS
        if K > max_tgt:  # the decoder input is K-1 positions longer than the target
            raise FairseqExtError(
                f"--sat-group-size {K} is larger than --max-target-positions {max_tgt}: a group must fit in the "
                f"decoder's positions; use a smaller K (the paper uses 2, 4 or 6) or raise --max-target-positions")
        if getattr(args, "left_pad_target", False):
            raise FairseqExtError("sat_transformer needs right-padded targets: remove --left-pad-target")
        model = super().build_model(args, task)
        init_from = getattr(args, "sat_init_from", None)
        if getattr(args, "sat_freeze_encoder", False):
            if not init_from and not getattr(args, "sat_initialised_from", None):
                raise FairseqExtError("--sat-freeze-encoder keeps the encoder of --sat-init-from: give --sat-init-from "
                                      "TRANSFORMER.pt")
            for p in model.encoder.parameters():  # fairseq's optimizer takes the parameters that require grad
                p.requires_grad_(False)
        if init_from:
            # only a new training is initialised: not a model rebuilt from its checkpoint (fairseq_ext.common.building)
            # nor a training that fairseq-train is about to restore from a checkpoint
            if not building_from_checkpoint() and not _train_will_restore(args):
                model.init_from_transformer(init_from, include_decoder=getattr(args, "sat_init_decoder", False))
            # the checkpoints of this model then store where the weights came from (sat_initialised_from), not a
            # request to initialise: rebuilding the model, with any task, never reads that file again
            args.sat_init_from = None
            args.sat_initialised_from = init_from
        return model

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return SATDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    @property
    def sat_group_size(self) -> int:
        return group_size(self)

    def forward(
        self,
        src_tokens,
        src_lengths,
        prev_output_tokens,
        return_all_hiddens: bool = True,
        features_only: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        """Training / scoring pass on fairseq's ``prev_output_tokens``: the output has one row per target
        position t (predicting y_t from its group's inputs and earlier ones), as the criterion expects."""
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths, return_all_hiddens=return_all_hiddens)
        tgt_len = prev_output_tokens.size(1)
        decoder_in = sat_decoder_input(prev_output_tokens, self.decoder.group_size, self.decoder.start_symbol)
        x, extra = self.decoder(
            decoder_in,
            encoder_out=encoder_out,
            features_only=features_only,
            alignment_layer=alignment_layer,
            alignment_heads=alignment_heads,
            src_lengths=src_lengths,
            return_all_hiddens=return_all_hiddens,
        )
        if decoder_in.size(1) != tgt_len:  # drop the completion of the last group
            x = x[:, :tgt_len]
            extra["attn"] = [a[:, :tgt_len] if a is not None else None for a in extra["attn"]]
            extra["inner_states"] = [h[:tgt_len] if h is not None else None for h in extra["inner_states"]]
        return x, extra

    # -- initialisation from a trained Transformer (Sec. 4.1) ----------------------------------------------
    def init_from_transformer(self, path: str, include_decoder: bool = False):
        """Copy the encoder, the source/target word embeddings and the pre-softmax weights of a trained
        Transformer checkpoint (all decoder parameters with ``include_decoder``); the rest stays random."""
        if not os.path.isfile(path):
            raise FairseqExtError(
                f"--sat-init-from {path}: no such file (give a trained transformer checkpoint; a SAT checkpoint "
                f"that stores this path is decoded with --task translation_sat, which does not need it)")
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
        teacher = state["model"]
        own = self.state_dict()

        def wanted(key):
            if key.startswith("encoder."):
                return True
            if include_decoder and key.startswith("decoder."):
                return True
            return key in ("decoder.embed_tokens.weight", "decoder.output_projection.weight")

        keys = [k for k in own if wanted(k) and not k.endswith("._float_tensor")
                and not k.endswith("embed_positions.weights")]
        missing = [k for k in keys if k not in teacher]
        if missing:
            raise FairseqExtError(
                f"--sat-init-from {path}: the checkpoint has no {missing[0]} ({len(missing)} missing tensors); "
                f"it must be a fairseq transformer with the same layer sizes")
        for k in keys:
            if teacher[k].shape != own[k].shape:
                raise FairseqExtError(
                    f"--sat-init-from {path}: {k} has shape {tuple(teacher[k].shape)} there and "
                    f"{tuple(own[k].shape)} here; train the SAT with the same sizes and dictionaries "
                    f"(binarise the distilled data with --srcdict/--tgtdict of the teacher's data)")
            own[k] = teacher[k].to(own[k].dtype)
        self.load_state_dict(own, strict=True)
        logger.info(f"sat_transformer: initialised {len(keys)} tensors from {path}"
                    f"{' (decoder included)' if include_decoder else ''}")


# -- architectures ------------------------------------------------------------------------------------------


@register_model_architecture("sat_transformer", "sat_transformer")
def sat_base_architecture(args):
    args.sat_group_size = getattr(args, "sat_group_size", 2)
    args.sat_init_from = getattr(args, "sat_init_from", None)
    args.sat_init_decoder = getattr(args, "sat_init_decoder", False)
    args.sat_freeze_encoder = getattr(args, "sat_freeze_encoder", False)
    base_architecture(args)


@register_model_architecture("sat_transformer", "sat_transformer_iwslt_de_en")
def sat_transformer_iwslt_de_en(args):
    transformer_iwslt_de_en(args)
    sat_base_architecture(args)


@register_model_architecture("sat_transformer", "sat_transformer_wmt_en_de")
def sat_transformer_wmt_en_de(args):
    """The paper's base setting as in the authors' configs (sa-nmt configs/sat-K.yaml): d 512, FFN 1024,
    6+6 layers, 8 heads, residual dropout 0.1, attention dropout 0, tied target embedding and softmax."""
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 1024)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 1024)
    args.dropout = getattr(args, "dropout", 0.1)
    args.attention_dropout = getattr(args, "attention_dropout", 0.0)
    args.share_decoder_input_output_embed = getattr(args, "share_decoder_input_output_embed", True)
    sat_base_architecture(args)


@register_model_architecture("sat_transformer", "sat_transformer_wmt_en_de_big")
def sat_transformer_wmt_en_de_big(args):
    transformer_vaswani_wmt_en_de_big(args)
    sat_base_architecture(args)
