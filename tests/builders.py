"""Tiny random models of every paper, shared by the test files (instead of tests importing other test files).

Each builder gives a model small enough to build in milliseconds, with deterministic weights."""

import argparse
import os

import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.models.fconv import FConvModel

from fairseq_ext.bert_jam.model import BertJamModel
from fairseq_ext.bert_jam.task import TranslationBertConfig, TranslationBertTask
from fairseq_ext.convs2s.model import FConvGluModel
from fairseq_ext.msc.model import MSCTransformerModel
from fairseq_ext.sat.model import SATModel


# --------------------------------------------------------------------------------------------------------
# SAT (sat_transformer): a 16-symbol dictionary, 2+2 layers, d 16
# --------------------------------------------------------------------------------------------------------

def sat_dictionary(n=16):
    d = Dictionary()
    for i in range(n):
        d.add_symbol(chr(ord("a") + i))
    return d


SAT_DICT = sat_dictionary()


class SatTask:
    source_dictionary = SAT_DICT
    target_dictionary = SAT_DICT


def sat_args(arch, K=None, learned=False, **kw):
    args = argparse.Namespace(
        arch=arch, encoder_layers=2, decoder_layers=2, encoder_embed_dim=16, decoder_embed_dim=16,
        encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32, encoder_attention_heads=2, decoder_attention_heads=2,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_learned_pos=learned,
        encoder_learned_pos=learned, **kw)
    if K is not None:
        args.sat_group_size = K
    ARCH_CONFIG_REGISTRY[arch](args)
    return args


def sat_model(K, learned=False, seed=0, eos_boost=2.0):
    torch.manual_seed(seed)
    m = SATModel.build_model(sat_args("sat_transformer", K, learned), SatTask()).eval()
    with torch.no_grad():  # make EOS likely enough that hypotheses end at different lengths
        m.decoder.output_projection.weight[SAT_DICT.eos()] *= eos_boost
    return m


def sat_sample(src, src_lengths, tgt=None, prev=None):
    s = {"id": torch.arange(src.size(0)), "net_input": {"src_tokens": src, "src_lengths": src_lengths}}
    if tgt is not None:
        s["target"] = tgt
        s["net_input"]["prev_output_tokens"] = prev
        s["ntokens"] = int(tgt.ne(SAT_DICT.pad()).sum())
    return s


# --------------------------------------------------------------------------------------------------------
# ConvS2S (fconv_glu next to fairseq's fconv)
# --------------------------------------------------------------------------------------------------------

# a spec with everything the layer syntax allows: width changes (residual projections), an even kernel,
# a residual from two layers back, no residual, and a decoder layer without attention
FCONV_ODD_SPEC = dict(encoder_embed_dim=12, decoder_embed_dim=12, decoder_out_embed_dim=10,
                encoder_layers="[(16, 3), (24, 2), (24, 3, 2), (24, 5, 0)]",
                decoder_layers="[(16, 3), (24, 2), (24, 3, 2), (20, 1)]",
                decoder_attention="[True, False, True, True]")


class FconvTask:
    def __init__(self, n=40):
        d = Dictionary()
        for i in range(n):
            d.add_symbol(f"w{i}")
        self.source_dictionary = self.target_dictionary = d


def fconv_args(arch, **kw):
    args = argparse.Namespace(dropout=0.0, max_source_positions=1024, max_target_positions=1024, **kw)
    ARCH_CONFIG_REGISTRY[arch](args)  # the architecture's defaults, as fairseq-train applies them
    return args


def fconv_pair(task, suffix="_iwslt_de_en", seed=0, **kw):
    """fairseq's fconv<suffix> and our fconv_glu<suffix> with fairseq's weights copied into ours."""
    torch.manual_seed(seed)
    ref = FConvModel.build_model(fconv_args("fconv" + suffix, **kw), task)
    ours = FConvGluModel.build_model(fconv_args("fconv_glu" + suffix, **kw), task)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    ours.load_state_dict(sd, strict=True)  # runs upgrade_state_dict_named: the fconv -> fconv_glu mapping
    return ref, ours


# --------------------------------------------------------------------------------------------------------
# MSC (msc_transformer): d 16, and the ablations of Table 5
# --------------------------------------------------------------------------------------------------------

class MscTask:
    def __init__(self, d):
        self.source_dictionary = self.target_dictionary = d


def msc_dictionary(vocab):
    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    return d


def msc_build(arch="msc_transformer", extra=(), vocab=40, tiny=True):
    d = msc_dictionary(vocab)
    p = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    MSCTransformerModel.add_args(p)
    flags = list(extra)
    if tiny:
        flags = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "24",
                 "--decoder-ffn-embed-dim", "24", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
                 "--dropout", "0", "--attention-dropout", "0", "--share-all-embeddings"] + flags
    a = p.parse_args(flags)
    ARCH_CONFIG_REGISTRY[arch](a)
    torch.manual_seed(0)
    return MSCTransformerModel.build_model(a, MscTask(d)), d


MSC_ABLATIONS = {
    "msc": [],
    "uneven_blocks": ["--encoder-layers-per-block", "1,3,2"],
    "add_fusion": ["--msc-fusion", "add"],
    "ffn_cell": ["--msc-context-cell", "ffn"],
    "no_cxt_enc_attn": ["--no-context-attention"],
    "no_contextual": ["--no-contextual-collaboration"],
    "no_block_scale": ["--no-block-scale-collaboration"],
    "plain": ["--no-contextual-collaboration", "--no-block-scale-collaboration"],
}
MSC_BLOCKS = ["--encoder-blocks", "3", "--encoder-layers-per-block", "2"]


def msc_flags(name):
    return (MSC_BLOCKS if name != "uneven_blocks" else []) + MSC_ABLATIONS[name]


# --------------------------------------------------------------------------------------------------------
# BERT-JAM: a 3-layer BERT of hidden 16 with a WordPiece vocabulary of letters, saved offline
# --------------------------------------------------------------------------------------------------------

BERT_LETTERS = "abcdefghijklmnopqrstuvwxyz"
TINY_BERT_LAYERS = 3


def write_tiny_bert(path, seed=0):
    """A random 3-layer BertModel (hidden 16) and an uncased WordPiece vocab of letters, saved offline."""
    from transformers import BertConfig, BertModel, BertTokenizer

    os.makedirs(path, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(BERT_LETTERS) + ["##" + c for c in BERT_LETTERS] + \
        [".", ",", "!", "?", "'", "-", "hello", "world"]
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=TINY_BERT_LAYERS, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=24)
    BertModel(cfg).save_pretrained(path)
    BertTokenizer(os.path.join(path, "vocab.txt"), do_lower_case=True).save_pretrained(path)
    return path


def letter_dict(extra=()):
    d = Dictionary()
    for c in list(BERT_LETTERS) + list(extra):
        d.add_symbol(c)
    return d


def bert_jam_build(tiny_bert, phase=1, composition="glu", dictionary=None, dropout=0.0, **overrides):
    d = dictionary or letter_dict()
    task = TranslationBertTask(TranslationBertConfig(bert_model_name=tiny_bert, source_lang="in",
                                                     target_lang="out"), d, d)
    args = argparse.Namespace(arch="bert_jam", encoder_embed_dim=32, encoder_ffn_embed_dim=48,
                              encoder_attention_heads=4, encoder_layers=2, decoder_layers=2, decoder_embed_dim=32,
                              decoder_ffn_embed_dim=48, decoder_attention_heads=4, dropout=dropout,
                              bert_jam_phase=phase, bert_composition=composition, **overrides)
    torch.manual_seed(1)
    return BertJamModel.build_model(args, task), d
