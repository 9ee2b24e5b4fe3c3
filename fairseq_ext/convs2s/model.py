"""ConvS2S: "Convolutional Sequence to Sequence Learning" (Gehring et al., ICML 2017), as ``fconv_glu``.

A clean re-implementation of fairseq's ``fconv`` (``fairseq/models/fconv.py``), numerically identical to it
(tests/convs2s/test_fconv_glu.py copies weights across and compares logits, gradients and beam hypotheses), with
current weight normalisation and an inference weight cache. Symbols follow the paper:

* §3.1  e_j = w_j + p_j: token embedding + learned absolute position embedding (source), g_i likewise for
        the previous target tokens.
* §3.2  each block: one 1-D convolution of width k to 2d channels, a gated linear unit
        v([A B]) = A ⊗ σ(B), and a residual connection: h^l = (v(W^l [h^{l-1}_{i-k/2}..] + b^l) + h^{l-1})
        * sqrt(0.5) (the sqrt(0.5) of §3.4 keeps the variance of a sum). Decoder convolutions are causal
        (k-1 frames of left padding); encoder convolutions are centred.
* §3.3  multi-step attention in every decoder layer l:
        d_i^l = (W_d^l h_i^l + b_d^l + g_i) * sqrt(0.5)                                (1)
        a_ij^l = softmax_j(d_i^l . z_j^u)                                                (2)
        c_i^l = sum_j a_ij^l (z_j^u + e_j)   with (z_j^u + e_j) scaled by sqrt(0.5)       (3)
        z^u (keys) is the encoder output, z^u + e (values) adds the source embedding. c_i^l is scaled by
        m * sqrt(1/m) with m the number of (non-pad) source tokens (§3.4), projected back to the
        conv width and added to h_i^l: (W_o c_i^l + h_i^l) * sqrt(0.5).
* §3.4  the gradient reaching the encoder is scaled by 1 / (2 * number of attention layers).
* §3.5  weight normalisation on every linear and convolution layer, initialised N(0, sqrt(p_keep / n_in))
        (x 4 before a GLU); embeddings N(0, 0.1); dropout (p) on the embeddings, before every convolution
        and before the output projection.

Module names map one-to-one onto fairseq's ``fconv`` (see :func:`upgrade_fconv_state_dict`):
``convolutions.i`` -> ``layers.i.conv``, ``projections.i`` -> ``layers.i.residual_proj``,
``attention.i`` -> ``layers.i.attention``, ``weight_g``/``weight_v`` -> ``parametrizations.weight.
original0/1``. :mod:`fairseq_ext.convs2s.convert` converts a
trained fairseq ``fconv`` checkpoint into an ``fconv_glu`` one.
"""

import ast
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq import utils
from fairseq.models import (
    FairseqEncoder,
    FairseqEncoderDecoderModel,
    FairseqIncrementalDecoder,
    register_model,
    register_model_architecture,
)
from fairseq.modules import BeamableMM, FairseqDropout, GradMultiply, LearnedPositionalEmbedding

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.convs2s.layers import CausalConvTBC, WNConvTBC, WNLinear

SQRT_HALF = math.sqrt(0.5)


# --------------------------------------------------------------------------------------------------------
# layer specifications: "[(512, 3)] * 9 + [(1024, 3)] * 4" -> ((512, 3, 1), ...)
# --------------------------------------------------------------------------------------------------------


MAX_LAYERS = 1000  # a spec such as "[(8, 1)] * 100000000" (from a hostile checkpoint) is refused, not built


def _safe_eval(expr, flag):
    """Evaluate a layer spec made of list/tuple/int/bool literals, + and * only (no ``eval``), of at most
    :data:`MAX_LAYERS` items."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, bool)):
            return node.value
        if isinstance(node, ast.Tuple):
            return tuple(ev(e) for e in node.elts)
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            n = len(a) if isinstance(a, (list, tuple)) else len(b) if isinstance(b, (list, tuple)) else 0
            times = b if isinstance(a, (list, tuple)) else a
            if isinstance(node.op, ast.Mult) and n and isinstance(times, int) and n * times > MAX_LAYERS:
                raise FairseqExtError(f"{flag} {str(expr)[:200]!r} builds more than {MAX_LAYERS} layers")
            out = a + b if isinstance(node.op, ast.Add) else a * b
            if isinstance(out, (list, tuple)) and len(out) > MAX_LAYERS:
                raise FairseqExtError(f"{flag} {str(expr)[:200]!r} builds more than {MAX_LAYERS} layers")
            return out
        raise ValueError(ast.dump(node))

    try:
        return ev(ast.parse(str(expr).strip(), mode="eval"))
    except (SyntaxError, ValueError, TypeError, RecursionError) as exc:
        raise FairseqExtError(
            f"{flag} {expr!r} is not a valid layer spec: write a Python-style list such as "
            f"\"[(512, 3)] * 9 + [(1024, 3)] * 4\" (only lists, tuples, integers, True/False, + and *)"
        ) from exc


def parse_conv_spec(expr, flag):
    """``(out_channels, kernel_width[, residual])`` per layer; residual defaults to 1 (the previous layer),
    0 disables it, r > 1 adds the output of the layer r steps back (through a projection if the width
    differs)."""
    spec = _safe_eval(expr, flag)
    if isinstance(spec, tuple):
        spec = list(spec)
    if not isinstance(spec, list) or not spec:
        raise FairseqExtError(f"{flag} {expr!r} must be a non-empty list of (channels, kernel_width) tuples")
    out = []
    for i, layer in enumerate(spec):
        if not isinstance(layer, tuple) or len(layer) not in (2, 3) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in layer
        ):
            raise FairseqExtError(
                f"{flag}: layer {i} is {layer!r}; each layer must be (channels, kernel_width) or "
                f"(channels, kernel_width, residual) with integers"
            )
        channels, kw, residual = layer if len(layer) == 3 else layer + (1,)
        if channels < 1 or kw < 1 or residual < 0 or residual > i + 1:
            raise FairseqExtError(
                f"{flag}: layer {i} {layer!r} needs channels >= 1, kernel width >= 1 and "
                f"0 <= residual <= {i + 1} (how many layers back the residual comes from)"
            )
        out.append((channels, kw, residual))
    return out


def parse_attention_spec(expr, num_layers, flag="--decoder-attention"):
    spec = _safe_eval(expr, flag)
    if isinstance(spec, bool):
        spec = [spec] * num_layers
    if not isinstance(spec, list) or len(spec) != num_layers or not all(isinstance(a, bool) for a in spec):
        raise FairseqExtError(
            f"{flag} {expr!r} must be True, False or a list of {num_layers} booleans "
            f"(one per decoder layer of --decoder-layers)"
        )
    return spec


# --------------------------------------------------------------------------------------------------------
# embeddings (§3.1)
# --------------------------------------------------------------------------------------------------------


def Embedding(num_embeddings, embedding_dim, padding_idx):
    m = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
    nn.init.normal_(m.weight, 0, 0.1)
    nn.init.constant_(m.weight[padding_idx], 0)
    return m


def PositionEmbedding(num_embeddings, embedding_dim, padding_idx):
    """Learned absolute positions p_1, p_2, ... (fairseq counts them from padding_idx + 1)."""
    m = LearnedPositionalEmbedding(num_embeddings, embedding_dim, padding_idx)
    nn.init.normal_(m.weight, 0, 0.1)
    nn.init.constant_(m.weight[padding_idx], 0)
    return m


def _residual_proj(layer_in_channels, channels, residual):
    if residual == 0:
        return None
    residual_dim = layer_in_channels[-residual]
    return WNLinear(residual_dim, channels) if residual_dim != channels else None


# --------------------------------------------------------------------------------------------------------
# encoder
# --------------------------------------------------------------------------------------------------------


class EncoderBlock(nn.Module):
    """§3.2: h^l = (GLU(conv(dropout(h^{l-1}))) + h^{l-r}) * sqrt(0.5), centred convolution."""

    def __init__(self, in_channels, channels, kernel_width, residual, residual_proj, dropout):
        super().__init__()
        self.kernel_width = kernel_width
        self.residual = residual
        self.residual_proj = residual_proj
        # odd widths pad inside the convolution; even widths pad (k-1)//2 left and k//2 right (forward)
        self.conv = WNConvTBC(in_channels, 2 * channels, kernel_width, dropout=dropout,
                              padding=kernel_width // 2 if kernel_width % 2 == 1 else 0)


class FConvGluEncoder(FairseqEncoder):
    def __init__(self, dictionary, embed_dim, convolutions, dropout, max_positions, num_attention_layers,
                 embed_dict=None):
        super().__init__(dictionary)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        # §3.4: the encoder receives gradients from every attention layer, so scale them down
        self.grad_scale = 1.0 / (2.0 * num_attention_layers) if num_attention_layers > 0 else 1.0
        self.padding_idx = dictionary.pad()
        self.embed_tokens = Embedding(len(dictionary), embed_dim, self.padding_idx)
        if embed_dict:
            self.embed_tokens = utils.load_embedding(embed_dict, self.dictionary, self.embed_tokens)
        self.embed_positions = PositionEmbedding(max_positions, embed_dim, self.padding_idx)

        in_channels = convolutions[0][0]
        self.fc1 = WNLinear(embed_dim, in_channels, dropout=dropout)  # e -> conv width
        self.layers = nn.ModuleList()
        layer_in_channels = [in_channels]
        for channels, kw, residual in convolutions:
            proj = _residual_proj(layer_in_channels, channels, residual)
            self.layers.append(EncoderBlock(in_channels, channels, kw, residual, proj, dropout))
            in_channels = channels
            layer_in_channels.append(channels)
        self.fc2 = WNLinear(in_channels, embed_dim)  # conv width -> e, gives z^u

    def forward(self, src_tokens, src_lengths=None, **unused):
        """Returns ``{"encoder_out": (z, z_plus_e), "encoder_padding_mask": B x S or None}`` where z is the
        attention keys z^u and z_plus_e the values (z^u + e) * sqrt(0.5), both B x S x embed_dim."""
        e = self.embed_tokens(src_tokens) + self.embed_positions(src_tokens)
        e = self.dropout_module(e)
        x = self.fc1(e)

        pad_mask = src_tokens.eq(self.padding_idx)  # B x S
        if not pad_mask.any():
            pad_mask = None
        pad_mask_tb = pad_mask.t().unsqueeze(-1) if pad_mask is not None else None

        x = x.transpose(0, 1)  # S x B x C (ConvTBC layout)
        outputs = [x]  # h^0, h^1, ... for the residual connections
        for layer in self.layers:
            residual = None
            if layer.residual > 0:
                residual = outputs[-layer.residual]
                if layer.residual_proj is not None:
                    residual = layer.residual_proj(residual)
            if pad_mask_tb is not None:
                x = x.masked_fill(pad_mask_tb, 0)  # padding must not leak into the convolution
            x = self.dropout_module(x)
            if layer.kernel_width % 2 == 0:
                x = F.pad(x, (0, 0, 0, 0, (layer.kernel_width - 1) // 2, layer.kernel_width // 2))
            x = F.glu(layer.conv(x), dim=2)  # v([A B]) = A ⊗ σ(B)
            if residual is not None:
                x = (x + residual) * SQRT_HALF
            outputs.append(x)

        z = self.fc2(x.transpose(0, 1))
        if pad_mask is not None:
            z = z.masked_fill(pad_mask.unsqueeze(-1), 0)
        z = GradMultiply.apply(z, self.grad_scale)  # §3.4 (backward only)
        z_plus_e = (z + e) * SQRT_HALF
        return {"encoder_out": (z, z_plus_e), "encoder_padding_mask": pad_mask}

    def reorder_encoder_out(self, encoder_out, new_order):
        z, z_plus_e = encoder_out["encoder_out"]
        mask = encoder_out["encoder_padding_mask"]
        return {
            "encoder_out": (z.index_select(0, new_order), z_plus_e.index_select(0, new_order)),
            "encoder_padding_mask": mask.index_select(0, new_order) if mask is not None else None,
        }

    def max_positions(self):
        return self.embed_positions.max_positions


# --------------------------------------------------------------------------------------------------------
# multi-step attention (§3.3) and decoder
# --------------------------------------------------------------------------------------------------------


class MultiStepAttention(nn.Module):
    def __init__(self, conv_channels, embed_dim):
        super().__init__()
        self.in_projection = WNLinear(conv_channels, embed_dim)  # W_d, b_d
        self.out_projection = WNLinear(embed_dim, conv_channels)  # back to the conv width
        self.bmm = torch.bmm

    def forward(self, h, g, keys_t, values, pad_mask, src_len):
        """h: B x T x C decoder state h^l; g: B x T x E target embeddings; keys_t: B x E x S (z^u
        transposed); values: B x S x E ((z^u + e) * sqrt(0.5)); src_len: B x 1 x 1 or an int."""
        d = (self.in_projection(h) + g) * SQRT_HALF  # (1)
        scores = self.bmm(d, keys_t)  # B x T x S
        if pad_mask is not None:
            scores = scores.float().masked_fill(pad_mask.unsqueeze(1), float("-inf")).type_as(scores)
        a = F.softmax(scores, dim=-1)  # (2)
        c = self.bmm(a, values)  # (3)
        # §3.4: scale by m * sqrt(1/m) = sqrt(m) for m source tokens (as fairseq: m * rsqrt(m))
        c = c * (src_len * src_len.rsqrt()) if torch.is_tensor(src_len) else c * (src_len * math.sqrt(1.0 / src_len))
        return (self.out_projection(c) + h) * SQRT_HALF, a

    def make_generation_fast_(self, beamable_mm_beam_size=None, **kwargs):
        """During beam search, attend once per sentence instead of once per beam (fairseq's BeamableMM)."""
        if beamable_mm_beam_size is not None:
            del self.bmm
            self.add_module("bmm", BeamableMM(beamable_mm_beam_size))


class DecoderBlock(nn.Module):
    """§3.2 + §3.3: causal conv, GLU, multi-step attention, residual * sqrt(0.5)."""

    def __init__(self, in_channels, channels, kernel_width, residual, residual_proj, attention, embed_dim,
                 dropout):
        super().__init__()
        self.residual = residual
        self.residual_proj = residual_proj
        self.conv = CausalConvTBC(in_channels, 2 * channels, kernel_width, dropout=dropout)
        self.attention = MultiStepAttention(channels, embed_dim) if attention else None


class FConvGluDecoder(FairseqIncrementalDecoder):
    def __init__(self, dictionary, embed_dim, convolutions, attention, out_embed_dim, dropout, max_positions,
                 share_embed=False, embed_dict=None):
        super().__init__(dictionary)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.need_attn = True
        padding_idx = dictionary.pad()
        self.embed_tokens = Embedding(len(dictionary), embed_dim, padding_idx)
        if embed_dict:
            self.embed_tokens = utils.load_embedding(embed_dict, self.dictionary, self.embed_tokens)
        self.embed_positions = PositionEmbedding(max_positions, embed_dim, padding_idx)

        in_channels = convolutions[0][0]
        self.fc1 = WNLinear(embed_dim, in_channels, dropout=dropout)
        self.layers = nn.ModuleList()
        layer_in_channels = [in_channels]
        for (channels, kw, residual), att in zip(convolutions, attention):
            proj = _residual_proj(layer_in_channels, channels, residual)
            self.layers.append(DecoderBlock(in_channels, channels, kw, residual, proj, att, embed_dim, dropout))
            in_channels = channels
            layer_in_channels.append(channels)
        self.num_attention_layers = sum(att for att in attention)

        self.fc2 = WNLinear(in_channels, out_embed_dim)
        if share_embed:
            # tied input/output embeddings (plain linear: the weight is the embedding matrix)
            self.fc3 = nn.Linear(out_embed_dim, len(dictionary))
            self.fc3.weight = self.embed_tokens.weight
        else:
            self.fc3 = WNLinear(out_embed_dim, len(dictionary), dropout=dropout)

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **unused):
        x, attn = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        return self.output_layer(x), attn

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None, **unused):
        incremental = incremental_state is not None
        keys_t = values = pad_mask = src_len = None
        if encoder_out is not None:
            pad_mask = encoder_out["encoder_padding_mask"]
            keys_t, values, src_len = self._attention_memory(encoder_out, incremental_state)

        pos = self.embed_positions(prev_output_tokens, incremental_state)  # positions from the full prefix
        if incremental:
            prev_output_tokens = prev_output_tokens[:, -1:]
        g = self.dropout_module(self.embed_tokens(prev_output_tokens) + pos)  # §3.1
        x = self.fc1(g)

        # full pass: T x B x C for the convolutions; incremental pass: B x 1 x C throughout
        if not incremental:
            x = x.transpose(0, 1)
        avg_attn = None
        outputs = [x]
        for layer in self.layers:
            residual = None
            if layer.residual > 0:
                residual = outputs[-layer.residual]
                if layer.residual_proj is not None:
                    residual = layer.residual_proj(residual)
            x = self.dropout_module(x)
            x = F.glu(layer.conv(x, incremental_state), dim=2)
            if layer.attention is not None:
                if not incremental:
                    x = x.transpose(0, 1)
                x, a = layer.attention(x, g, keys_t, values, pad_mask, src_len)
                if not self.training and self.need_attn:
                    # alignment = mean over the attention layers (fairseq divides by all layers)
                    a = a / self.num_attention_layers
                    avg_attn = a if avg_attn is None else avg_attn.add_(a)
                if not incremental:
                    x = x.transpose(0, 1)
            if residual is not None:
                x = (x + residual) * SQRT_HALF
            outputs.append(x)
        if not incremental:
            x = x.transpose(0, 1)
        return x, avg_attn

    def output_layer(self, x):
        return self.fc3(self.dropout_module(self.fc2(x)))

    def _attention_memory(self, encoder_out, incremental_state):
        """(z^u transposed to B x E x S, (z^u + e) * sqrt(0.5), source lengths m), cached while decoding."""
        cached = utils.get_incremental_state(self, incremental_state, "encoder_out")
        if cached is not None:
            return cached
        z, z_plus_e = encoder_out["encoder_out"]
        pad_mask = encoder_out["encoder_padding_mask"]
        if pad_mask is None:
            src_len = z_plus_e.size(1)
        else:
            src_len = (z_plus_e.size(1) - pad_mask.type_as(z_plus_e).sum(dim=1, keepdim=True)).unsqueeze(-1)
        result = (z.transpose(1, 2).contiguous(), z_plus_e, src_len)
        if incremental_state is not None:
            utils.set_incremental_state(self, incremental_state, "encoder_out", result)
        return result

    def reorder_incremental_state(self, incremental_state, new_order):
        """Reorder every cache of the decoder (conv input buffers, attention memory) along the batch."""
        for layer in self.layers:
            layer.conv.reorder_incremental_state(incremental_state, new_order)
        cached = utils.get_incremental_state(self, incremental_state, "encoder_out")
        if cached is not None:
            keys_t, values, src_len = cached
            if torch.is_tensor(src_len):
                src_len = src_len.index_select(0, new_order)
            utils.set_incremental_state(self, incremental_state, "encoder_out", (
                keys_t.index_select(0, new_order), values.index_select(0, new_order), src_len))

    def reorder_incremental_state_scripting(self, incremental_state, new_order):
        # SequenceGenerator's entry point; the default visits every sub-module, which would reorder the
        # conv buffers twice
        self.reorder_incremental_state(incremental_state, new_order)

    def max_positions(self):
        return self.embed_positions.max_positions

    def make_generation_fast_(self, need_attn=False, **kwargs):
        self.need_attn = need_attn


# --------------------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------------------


@register_model("fconv_glu")
class FConvGluModel(FairseqEncoderDecoderModel):
    """Convolutional sequence to sequence model (Gehring et al., 2017)."""

    @staticmethod
    def add_args(parser):
        # fmt: off
        parser.add_argument('--dropout', type=float, metavar='D', help='dropout probability')
        parser.add_argument('--encoder-embed-dim', type=int, metavar='N', help='encoder embedding dimension')
        parser.add_argument('--encoder-embed-path', type=str, metavar='STR',
                            help='path to pre-trained encoder embedding')
        parser.add_argument('--encoder-layers', type=str, metavar='EXPR',
                            help='encoder layers [(dim, kernel_size[, residual]), ...], e.g. "[(512, 3)] * 20"')
        parser.add_argument('--decoder-embed-dim', type=int, metavar='N', help='decoder embedding dimension')
        parser.add_argument('--decoder-embed-path', type=str, metavar='STR',
                            help='path to pre-trained decoder embedding')
        parser.add_argument('--decoder-layers', type=str, metavar='EXPR',
                            help='decoder layers [(dim, kernel_size[, residual]), ...]')
        parser.add_argument('--decoder-out-embed-dim', type=int, metavar='N',
                            help='decoder output embedding dimension')
        parser.add_argument('--decoder-attention', type=str, metavar='EXPR',
                            help='decoder attention: True, False or [True, False, ...] per layer')
        parser.add_argument('--share-input-output-embed', action='store_true',
                            help='tie the decoder input and output embeddings (needs '
                                 '--decoder-out-embed-dim equal to --decoder-embed-dim)')
        # fmt: on

    @classmethod
    def build_model(cls, args, task):
        base_architecture(args)
        if not 0.0 <= args.dropout < 1.0:
            raise FairseqExtError(f"--dropout {args.dropout} must be in [0, 1)")
        enc_convs = parse_conv_spec(args.encoder_layers, "--encoder-layers")
        dec_convs = parse_conv_spec(args.decoder_layers, "--decoder-layers")
        attention = parse_attention_spec(args.decoder_attention, len(dec_convs))
        if args.share_input_output_embed and args.decoder_out_embed_dim != args.decoder_embed_dim:
            raise FairseqExtError(
                f"--share-input-output-embed needs --decoder-out-embed-dim ({args.decoder_out_embed_dim}) equal "
                f"to --decoder-embed-dim ({args.decoder_embed_dim}); set them to the same value"
            )

        def load_embed(path, dictionary, flag):
            if not path:
                return None
            if not os.path.isfile(path):
                raise FairseqExtError(f"{flag} {path}: no such file (a text file 'word v1 v2 ...' per line)")
            embed_dict = utils.parse_embedding(path)
            utils.print_embed_overlap(embed_dict, dictionary)
            return embed_dict

        encoder = FConvGluEncoder(
            task.source_dictionary, args.encoder_embed_dim, enc_convs, args.dropout,
            getattr(args, "max_source_positions", 1024), num_attention_layers=sum(attention),
            embed_dict=load_embed(args.encoder_embed_path, task.source_dictionary, "--encoder-embed-path"),
        )
        decoder = FConvGluDecoder(
            task.target_dictionary, args.decoder_embed_dim, dec_convs, attention, args.decoder_out_embed_dim,
            args.dropout, getattr(args, "max_target_positions", 1024), share_embed=args.share_input_output_embed,
            embed_dict=load_embed(args.decoder_embed_path, task.target_dictionary, "--decoder-embed-path"),
        )
        return cls(encoder, decoder)

    def upgrade_state_dict_named(self, state_dict, name):
        prefix = name + "." if name else ""
        upgrade_fconv_state_dict(state_dict, prefix, self)
        super().upgrade_state_dict_named(state_dict, name)


# --------------------------------------------------------------------------------------------------------
# fairseq fconv / old weight-norm checkpoints
# --------------------------------------------------------------------------------------------------------

_RENAMES = [
    (re.compile(r"^(encoder|decoder)\.convolutions\.(\d+)\."), r"\1.layers.\2.conv."),
    (re.compile(r"^(encoder|decoder)\.projections\.(\d+)\."), r"\1.layers.\2.residual_proj."),
    (re.compile(r"^decoder\.attention\.(\d+)\."), r"decoder.layers.\1.attention."),
]


def upgrade_fconv_state_dict(state_dict, prefix="", model=None):
    """In place: map a fairseq ``fconv`` state dict (or one saved with ``torch.nn.utils.weight_norm``) onto
    ``fconv_glu`` names. ``X.weight_g``/``X.weight_v`` become ``X.parametrizations.weight.original0/1``;
    decoder convolutions of version-1 fconv checkpoints (weight norm over dim 0, a fairseq bug fixed in
    2017) are re-normalised over the output channel. As in fairseq's ``FConvDecoder.upgrade_state_dict``, an
    fconv state dict (``decoder.convolutions.*`` keys) without ``decoder.version`` is version 1."""
    old_version = None
    if prefix + "decoder.version" in state_dict:
        old_version = float(state_dict.pop(prefix + "decoder.version").reshape(-1)[0])
    elif any(k.startswith(prefix + "decoder.convolutions.") for k in state_dict):
        old_version = 1.0  # fairseq: a missing version is version 1 (its buffer was added with version 2)
    for key in list(state_dict.keys()):
        if not key.startswith(prefix):
            continue
        new = key[len(prefix):]
        for pattern, repl in _RENAMES:
            new = pattern.sub(repl, new)
        if new.endswith("._linearized_weight"):
            del state_dict[key]
            continue
        if new.endswith(".weight_g"):
            new = new[: -len("weight_g")] + "parametrizations.weight.original0"
        elif new.endswith(".weight_v"):
            new = new[: -len("weight_v")] + "parametrizations.weight.original1"
        if new != key[len(prefix):]:
            state_dict[prefix + new] = state_dict.pop(key)
    # decoder convolutions: g must have shape (1, 1, out) (norm over dims 0 and 1 of the kw x in x out kernel)
    for key in list(state_dict.keys()):
        m = re.match(re.escape(prefix) + r"decoder\.layers\.\d+\.conv\.parametrizations\.weight\.original0$", key)
        if m is None:
            continue
        g, v_key = state_dict[key], key[:-1] + "1"
        v = state_dict[v_key]
        if g.dim() == 3 and g.shape[:2] == (1, 1) and (old_version is None or old_version >= 2):
            continue
        w = torch._weight_norm(v, g, 0)  # old layout: norm over dim 0
        state_dict[key] = torch.norm_except_dim(w, 2, 2)
        state_dict[v_key] = w
    return state_dict


# --------------------------------------------------------------------------------------------------------
# architectures (sizes of the paper / fairseq's fconv)
# --------------------------------------------------------------------------------------------------------


@register_model_architecture("fconv_glu", "fconv_glu")
def base_architecture(args):
    args.dropout = getattr(args, "dropout", 0.1)
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 512)
    args.encoder_embed_path = getattr(args, "encoder_embed_path", None)
    args.encoder_layers = getattr(args, "encoder_layers", "[(512, 3)] * 20")
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 512)
    args.decoder_embed_path = getattr(args, "decoder_embed_path", None)
    args.decoder_layers = getattr(args, "decoder_layers", "[(512, 3)] * 20")
    args.decoder_out_embed_dim = getattr(args, "decoder_out_embed_dim", 256)
    args.decoder_attention = getattr(args, "decoder_attention", "True")
    args.share_input_output_embed = getattr(args, "share_input_output_embed", False)


@register_model_architecture("fconv_glu", "fconv_glu_iwslt_de_en")
def fconv_glu_iwslt_de_en(args):
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 256)
    args.encoder_layers = getattr(args, "encoder_layers", "[(256, 3)] * 4")
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 256)
    args.decoder_layers = getattr(args, "decoder_layers", "[(256, 3)] * 3")
    args.decoder_out_embed_dim = getattr(args, "decoder_out_embed_dim", 256)
    base_architecture(args)


@register_model_architecture("fconv_glu", "fconv_glu_wmt_en_ro")
def fconv_glu_wmt_en_ro(args):
    args.decoder_out_embed_dim = getattr(args, "decoder_out_embed_dim", 512)
    base_architecture(args)


@register_model_architecture("fconv_glu", "fconv_glu_wmt_en_de")
def fconv_glu_wmt_en_de(args):
    convs = "[(512, 3)] * 9 + [(1024, 3)] * 4 + [(2048, 1)] * 2"  # 15 layers (paper, WMT'14 En-De)
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 768)
    args.encoder_layers = getattr(args, "encoder_layers", convs)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 768)
    args.decoder_layers = getattr(args, "decoder_layers", convs)
    args.decoder_out_embed_dim = getattr(args, "decoder_out_embed_dim", 512)
    base_architecture(args)


@register_model_architecture("fconv_glu", "fconv_glu_wmt_en_fr")
def fconv_glu_wmt_en_fr(args):
    convs = "[(512, 3)] * 6 + [(768, 3)] * 4 + [(1024, 3)] * 3 + [(2048, 1)] * 1 + [(4096, 1)] * 1"
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 768)
    args.encoder_layers = getattr(args, "encoder_layers", convs)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 768)
    args.decoder_layers = getattr(args, "decoder_layers", convs)
    args.decoder_out_embed_dim = getattr(args, "decoder_out_embed_dim", 512)
    base_architecture(args)
