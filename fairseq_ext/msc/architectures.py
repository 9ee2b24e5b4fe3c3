"""The presets of ``msc_transformer`` (Tables 1, 2 and 4 of Wei et al., 2020): the IWSLT small models of 6, 36,
54 and 72 encoder layers, the WMT base models of 6, 36 and 48 and the big models of 6 and 18, as
``--arch msc_transformer_<data>[_<depth>l]``. Each sets the blocks N and layers per block M; everything else is
:func:`fairseq_ext.msc.model.msc_base_architecture`."""

from fairseq.models import register_model_architecture

from fairseq_ext.msc.model import msc_base_architecture


def _set_blocks(args, blocks, per_block):
    """Preset N x M unless the user gave their own (a comma list of M_n also sets N)."""
    lpb = getattr(args, "encoder_layers_per_block", None)
    if lpb is None:
        args.encoder_layers_per_block = str(per_block)
    if getattr(args, "encoder_blocks", None) is None and (lpb is None or "," not in str(lpb)):
        args.encoder_blocks = blocks
    msc_base_architecture(args)


def _small(args, blocks, per_block, dropout):
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 256)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 512)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 4)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 256)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 512)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    args.dropout = getattr(args, "dropout", dropout)  # dp_r (Table 2)
    args.attention_dropout = getattr(args, "attention_dropout", dropout)  # dp_a (Table 2)
    _set_blocks(args, blocks, per_block)


@register_model_architecture("msc_transformer", "msc_transformer_iwslt_de_en")
def msc_transformer_iwslt_de_en(args):
    """Table 2 row 2: small (emb 256, FFN 512, 4 heads), 6 blocks x 1 layer, dp_a = dp_r = 0.1."""
    _small(args, 6, 1, 0.1)


@register_model_architecture("msc_transformer", "msc_transformer_iwslt_de_en_36l")
def msc_transformer_iwslt_de_en_36l(args):
    """Tables 1-2: 36-layer encoder (6 x 6), dp_a = dp_r = 0.3."""
    _small(args, 6, 6, 0.3)


@register_model_architecture("msc_transformer", "msc_transformer_iwslt_de_en_54l")
def msc_transformer_iwslt_de_en_54l(args):
    """Tables 1-2: 54-layer encoder (6 x 9), dp_a = dp_r = 0.3."""
    _small(args, 6, 9, 0.3)


@register_model_architecture("msc_transformer", "msc_transformer_iwslt_de_en_72l")
def msc_transformer_iwslt_de_en_72l(args):
    """Tables 1-2: 72-layer encoder (6 x 12), dp_a = dp_r = 0.3 (train with the L2 criterion, lambda 1e-5)."""
    _small(args, 6, 12, 0.3)


def _base(args, blocks, per_block, dropout):
    args.dropout = getattr(args, "dropout", dropout)
    args.attention_dropout = getattr(args, "attention_dropout", 0.1)
    args.activation_dropout = getattr(args, "activation_dropout", 0.1)
    _set_blocks(args, blocks, per_block)


@register_model_architecture("msc_transformer", "msc_transformer_wmt_en_de")
def msc_transformer_wmt_en_de(args):
    """Table 4: transformer_base sizes (512/2048/8 heads), 6 x 1, dropout 0.1."""
    _base(args, 6, 1, 0.1)


@register_model_architecture("msc_transformer", "msc_transformer_wmt_en_de_36l")
def msc_transformer_wmt_en_de_36l(args):
    """Table 4: base, 36-layer encoder (6 x 6); dropout 0.2 (the paper only says "larger")."""
    _base(args, 6, 6, 0.2)


@register_model_architecture("msc_transformer", "msc_transformer_wmt_en_de_48l")
def msc_transformer_wmt_en_de_48l(args):
    """Table 4: base, 48-layer encoder (6 x 8); dropout 0.2 (the paper only says "larger")."""
    _base(args, 6, 8, 0.2)


def _big(args, blocks, per_block):
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 1024)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 4096)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 16)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 1024)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 4096)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 16)
    args.dropout = getattr(args, "dropout", 0.3)
    args.attention_dropout = getattr(args, "attention_dropout", 0.1)
    args.activation_dropout = getattr(args, "activation_dropout", 0.1)
    _set_blocks(args, blocks, per_block)


@register_model_architecture("msc_transformer", "msc_transformer_wmt_en_de_big")
def msc_transformer_wmt_en_de_big(args):
    """Table 4: transformer_big sizes (1024/4096/16 heads), 6 x 1, dropout 0.3."""
    _big(args, 6, 1)


@register_model_architecture("msc_transformer", "msc_transformer_wmt_en_de_big_18l")
def msc_transformer_wmt_en_de_big_18l(args):
    """Table 4: big, 18-layer encoder (6 x 3), dropout 0.3."""
    _big(args, 6, 3)
