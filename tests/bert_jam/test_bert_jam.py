"""Unit behaviour of bert_jam (BERT-JAM) on a tiny random BertConfig with a vocab written here (no hub)."""

import argparse
import os

import pytest
import torch

import fairseq_ext  # noqa: F401  (registration)
from fairseq.data import Dictionary
from fairseq.modules import MultiheadAttention

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.bert_jam.model import (
    BertJamModel,
    BertLayerComposition,
    JointMultiheadAttention,
)
from fairseq_ext.bert_jam.bert import BertInputBuilder, detect_bpe, moses_detokenize, remove_bpe
from fairseq_ext.bert_jam.task import LanguagePairBertDataset, TranslationBertConfig, TranslationBertTask
from tests.builders import TINY_BERT_LAYERS as BERT_LAYERS
from tests.builders import bert_jam_build as build
from tests.builders import letter_dict, write_tiny_bert
from tests.helpers import assert_close

@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return write_tiny_bert(str(tmp_path_factory.mktemp("tinybert")))


def batch(d):
    """Two left-padded sources (fairseq's default) and right-padded previous target tokens."""
    enc = lambda s: [d.index(c) for c in s]  # noqa: E731
    src = torch.tensor([enc("hello") + [d.eos()], [d.pad()] * 2 + enc("abc") + [d.eos()]])
    prev = torch.tensor([[d.eos()] + enc("ifmmp"), [d.eos()] + enc("bcd") + [d.pad()] * 2])
    return src, torch.tensor([6, 4]), prev


# ------------------------------------------------------------------------------------------------ Eq. 8/11

def test_glu_init_gives_exactly_the_last_bert_layer_in_phase_1_and_half_of_it_after():
    torch.manual_seed(0)
    layers = torch.randn(5, 3, 16, 4)
    comp = BertLayerComposition(4, "glu")
    assert comp.alpha.tolist() == [0, 0, 0, 1] and comp.beta.tolist() == [0, 0, 0, 0]  # Eq. 11
    comp.scale = 2.0  # phase 1
    assert torch.equal(comp(layers), layers[..., -1])
    comp.scale = 1.0  # phases 2 and 3: g = 1/2
    assert torch.equal(comp(layers), layers[..., -1] / 2)
    # Eq. 8 with arbitrary weights
    with torch.no_grad():
        comp.alpha.copy_(torch.tensor([0.1, -0.2, 0.3, 0.4]))
        comp.beta.copy_(torch.tensor([0.5, 0.0, -1.0, 0.2]))
    a = sum(comp.alpha[i] * layers[..., i] for i in range(4))
    g = torch.sigmoid(sum(comp.beta[i] * layers[..., i] for i in range(4)))
    assert_close(comp(layers), g * a, atol=1e-6, msg="Eq. 8")
    # ablations: M1 linear (no gate, exact last layer at init), M2 last layer only (no parameters)
    assert torch.equal(BertLayerComposition(4, "linear")(layers), layers[..., -1])
    last = BertLayerComposition(4, "last")
    assert torch.equal(last(layers), layers[..., -1]) and len(list(last.parameters())) == 0


def test_model_phase_1_feeds_every_layer_the_last_bert_layer(tiny_bert):
    model, d = build(tiny_bert, phase=1)
    model.eval()
    src, lengths, prev = batch(d)
    bert_input = model.encoder.bert_input_builder().batch_from_source(src)
    hidden = model.encoder.bert(input_ids=bert_input, attention_mask=bert_input.ne(0).long(),
                                output_hidden_states=True).hidden_states
    assert len(hidden) == BERT_LAYERS + 1
    with torch.no_grad():
        # the fast path: every composition is frozen at Eq. 11 with the x2, so it selects B_L exactly; BERT's
        # other layers are neither stacked nor composed
        assert model.encoder.bert_last_only
        enc = model.encoder(src, lengths)
        assert enc["bert_out"][0].dim() == 3
        assert torch.equal(enc["bert_out"][0], hidden[-1].transpose(0, 1))
        fast = model(src, lengths, prev)[0]
        # the full path (all L layers, composed by each layer) gives the same model output, bit for bit
        model.encoder.bert_last_only = False
        enc = model.encoder(src, lengths)
        bert_layers = enc["bert_out"][0]
        assert bert_layers.shape[-1] == BERT_LAYERS  # all L layers, the embedding output excluded
        for i in range(BERT_LAYERS):
            assert torch.equal(bert_layers[..., i], hidden[i + 1].transpose(0, 1))
        for layer in list(model.encoder.layers) + list(model.decoder.layers):
            assert layer.bert_composition.scale == 2.0
            assert torch.equal(layer.bert_composition(bert_layers), bert_layers[..., -1])
        assert torch.equal(model(src, lengths, prev)[0], fast)
    model2, _ = build(tiny_bert, phase=2)
    assert all(layer.bert_composition.scale == 1.0 for layer in model2.encoder.layers)
    assert not model2.encoder.bert_last_only  # trainable compositions: all layers
    # phase 1 with compositions that left Eq. 11 (loaded from phase 2): the full path again
    with torch.no_grad():
        model2.encoder.layers[0].bert_composition.beta[0] = 0.25
    model.load_state_dict(model2.state_dict())
    assert not model.encoder.bert_last_only
    assert build(tiny_bert, phase=2, composition="last")[0].encoder.bert_last_only  # M2


def test_eq11_at_another_layer_makes_phase_1_read_exactly_that_layer(tiny_bert):
    torch.manual_seed(0)
    layers = torch.randn(5, 3, 16, 4)
    comp = BertLayerComposition(4, "glu")
    comp.start_at(2)
    comp.scale = 2.0
    assert comp.alpha.tolist() == [0, 1, 0, 0] and comp.beta.tolist() == [0, 0, 0, 0]
    assert torch.equal(comp(layers), layers[..., 1])
    with pytest.raises(FairseqExtError, match="--bert-jam-init-layer 5: BERT has layers 1..4"):
        comp.start_at(5)
    with pytest.raises(FairseqExtError, match="--bert-composition glu or linear"):
        BertLayerComposition(4, "last").start_at(1)
    # the model: every composition of the encoder and the decoder starts at layer 1; phase 1 then needs all
    # layers (not the B_L fast path), and its output is the default model's with B_1 put where B_L was
    model, d = build(tiny_bert, phase=1, bert_jam_init_layer=1)
    model.eval()
    assert not model.encoder.bert_last_only
    comps = model.compositions()
    assert len(comps) == 4 and all(c.alpha.tolist() == [1.0] + [0.0] * (BERT_LAYERS - 1) for c in comps)
    default, _ = build(tiny_bert, phase=1)
    default.eval()
    src, lengths, prev = batch(d)
    bert_input = model.encoder.bert_input_builder().batch_from_source(src)
    with torch.no_grad():
        hidden = model.encoder.bert(input_ids=bert_input, attention_mask=bert_input.ne(0).long(),
                                    output_hidden_states=True).hidden_states
        first = hidden[1].unsqueeze(-1).expand(*hidden[1].shape, BERT_LAYERS).contiguous()  # B_1 in every slot
        out = model(src, lengths, prev, bert_input=bert_input)[0]
        default.encoder.bert_last_only = False
        assert torch.equal(out, default(src, lengths, prev, bert_input=bert_input, bert_out=first)[0])
        assert not torch.equal(out, default(src, lengths, prev, bert_input=bert_input)[0])
    # a checkpoint's weights replace the start: phase 1 loaded into a default-built model reads layer 1 again
    default.load_state_dict(model.state_dict())
    assert not default.encoder.bert_last_only


# ------------------------------------------------------------------------------------------------ joint attention

@pytest.mark.parametrize("causal", [False, True])
def test_joint_attention_equals_standard_attention_over_the_concatenation(causal):
    torch.manual_seed(0)
    d, heads, T, S, B = 16, 4, 5, 7, 3
    joint = JointMultiheadAttention(d, d, heads).eval()
    with torch.no_grad():  # share the primary and secondary projections: then K = proj([S; R])
        joint.k_sec_proj.weight.copy_(joint.k_proj.weight)
        joint.k_sec_proj.bias.copy_(torch.randn(d))
        joint.k_proj.bias.copy_(joint.k_sec_proj.bias)
        joint.v_sec_proj.weight.copy_(joint.v_proj.weight)
        joint.v_sec_proj.bias.copy_(torch.randn(d))
        joint.v_proj.bias.copy_(joint.v_sec_proj.bias)
        joint.q_proj.bias.copy_(torch.randn(d))
    mha = MultiheadAttention(d, heads, kdim=d, vdim=d, dropout=0.0).eval()
    mha.load_state_dict({k: v for k, v in joint.state_dict().items() if "sec" not in k})
    R, Sx = torch.randn(T, B, d), torch.randn(S, B, d)
    sec_pad = torch.zeros(B, S, dtype=torch.bool)
    sec_pad[1, -3:] = True
    self_pad = torch.zeros(B, T, dtype=torch.bool)
    self_pad[2, -2:] = True
    attn_mask = None
    if causal:  # the causal mask covers the primary part only
        attn_mask = torch.cat([torch.zeros(T, S), torch.triu(torch.full((T, T), float("-inf")), 1)], dim=1)
    ref, ref_w = mha(R, torch.cat([Sx, R]), torch.cat([Sx, R]), key_padding_mask=torch.cat([sec_pad, self_pad], 1),
                     attn_mask=attn_mask, need_weights=True, need_head_weights=True)
    for need_weights in (False, True):
        out, w = joint(R, Sx, sec_pad, self_pad, causal=causal, need_weights=need_weights)
        assert_close(out, ref, atol=1e-5, msg=f"joint attention (need_weights={need_weights})")
    if ref_w.dim() == 4:  # H x B x T x S+T (fairseq's own path) or B x T x S+T (torch's fast path, head mean)
        ref_w = ref_w.mean(0)
    assert_close(w.mean(1), ref_w[..., :S], atol=1e-6, msg="weights on the secondary part")
    assert (w[1, :, :, -3:] == 0).all()  # padded BERT positions get no weight


# ------------------------------------------------------------------------------------------------ phases

def test_freezing_per_phase_parameter_by_parameter_and_bert_without_autograd(tiny_bert):
    for phase in (1, 2, 3):
        model, d = build(tiny_bert, phase=phase)
        names = [n for n, _ in model.named_parameters()]
        assert not any("pooler" in n for n in names)  # never built, so never trained or synchronised
        for n, p in model.named_parameters():
            is_bert = n.startswith("encoder.bert.")
            is_glu = ".bert_composition." in n
            expected = (phase == 3) if is_bert else (phase >= 2) if is_glu else True
            assert p.requires_grad == expected, (phase, n)
        n_glu = sum(".bert_composition." in n for n in names)
        assert n_glu == 2 * (2 + 2)  # alpha and beta in each of the 2 encoder and 2 decoder layers
        src, lengths, prev = batch(d)
        model.train()
        enc = model.encoder(src, lengths)
        assert enc["bert_out"][0].requires_grad == (phase == 3)  # phases 1-2: BERT ran under no_grad
        out = model(src, lengths, prev)[0]
        out.sum().backward()
        for n, p in model.named_parameters():
            assert (p.grad is not None) == p.requires_grad, (phase, n)
    # the same parameter names in every phase and ablation-free: a phase-1 state dict loads strictly in phase 3
    m1, _ = build(tiny_bert, phase=1)
    m3, _ = build(tiny_bert, phase=3)
    m3.load_state_dict(m1.state_dict(), strict=True)
    s1, s3 = m1.state_dict(), m3.state_dict()
    assert all(torch.equal(v, s3[k]) for k, v in s1.items())
    # phases 1-2 leave the frozen BERT out (it is the pre-trained one, refilled from its directory); phase 3 keeps it
    assert not any(k.startswith("encoder.bert.") for k in s1)
    assert sum(k.startswith("encoder.bert.") for k in s3) == len(m1.encoder.bert.state_dict()) > 20
    assert all(torch.equal(v, s3["encoder.bert." + k]) for k, v in m1.encoder.bert.state_dict().items())


def test_bad_input_errors_name_the_flag(tiny_bert, tmp_path):
    with pytest.raises(FairseqExtError, match="--bert-model-name"):
        build(str(tmp_path / "missing"))
    with pytest.raises(FairseqExtError, match="--bert-dropnet"):
        build(tiny_bert, bert_dropnet=0.7)
    d = letter_dict()
    task = TranslationBertTask(TranslationBertConfig(source_lang="in", target_lang="out"), d, d)
    with pytest.raises(FairseqExtError, match="--bert-model-name"):
        BertJamModel.build_model(argparse.Namespace(arch="bert_jam"), task)
    assert BertJamModel.hub_models() == {}  # not TransformerModel's plain transformer archives


# ------------------------------------------------------------------------------------------------ decoding

@pytest.mark.parametrize("composition,decoder", [("glu", "joint"), ("linear", "joint"), ("last", "joint"),
                                                 ("glu", "standard")])
def test_incremental_decoding_equals_full_pass_and_reorder(tiny_bert, composition, decoder):
    model, d = build(tiny_bert, phase=2, composition=composition, bert_jam_decoder=decoder)
    assert (type(model.decoder).__name__ == "BertJamDecoder") == (decoder == "joint")
    model.eval()
    with torch.no_grad():  # make the GLUs non-trivial
        for comp in model.compositions():
            for p in comp.parameters():
                p.add_(torch.randn_like(p) * 0.5)
    src, lengths, prev = batch(d)
    prev = prev[:, :5].clone()
    prev[1, 4] = d.index("e")
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        full, extra = model.decoder(prev, encoder_out=enc)
        assert extra["attn"][0].shape == (2, 5, src.size(1))
        inc_state = {}
        steps = []
        for t in range(prev.size(1)):
            out, ex = model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=inc_state)
            steps.append(out)
            assert_close(ex["attn"][0][:, -1], extra["attn"][0][:, t], atol=1e-5, msg=f"attn step {t}")
        assert_close(torch.cat(steps, 1), full, atol=1e-5, msg="incremental vs full")

        # reorder with a permutation (beam search): caches and encoder output follow the new order
        perm = torch.tensor([1, 0, 1])
        inc_state = {}
        for t in range(3):
            model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=inc_state)
        model.decoder.reorder_incremental_state_scripting(inc_state, perm)
        enc_p = model.encoder.reorder_encoder_out(enc, perm)
        for t in range(3, prev.size(1)):
            out, _ = model.decoder(prev[perm, : t + 1], encoder_out=enc_p, incremental_state=inc_state)
        full_p, _ = model.decoder(prev[perm], encoder_out=enc_p)
        assert_close(out[:, -1], full_p[:, -1], atol=1e-5, msg="after reorder")
        assert_close(full_p, full[perm], atol=1e-5, msg="reordered encoder_out")


def test_alignment_weights_are_on_the_source_inside_the_joint_softmax(tiny_bert):
    model, d = build(tiny_bert)
    model.eval()
    src, lengths, prev = batch(d)
    with torch.no_grad():
        attn = model(src, lengths, prev)[1]["attn"][0]
    assert attn.shape == (2, prev.size(1), src.size(1))
    assert (attn[1, :, :2] == 0).all()  # left padding of the second source
    s = attn.sum(-1)
    assert ((s > 0) & (s < 1 + 1e-6)).all()  # the rest of the mass is on the decoder's own prefix


def test_dropnet_branch_weights():
    from fairseq_ext.bert_jam.model import BertJamDecoderLayer

    layer = BertJamDecoderLayer.__new__(BertJamDecoderLayer)
    torch.nn.Module.__init__(layer)
    layer.dropnet = 0.5
    layer.train()
    torch.manual_seed(0)
    seen = {layer.branch_weights() for _ in range(200)}
    assert seen == {(1.0, 0.0), (0.0, 1.0)}
    layer.eval()
    assert layer.branch_weights() == (0.5, 0.5)  # Eq. 10 at inference


# ------------------------------------------------------------------------------------------------ BERT input

def test_bert_text_from_sentencepiece_and_subword_nmt_sources(tiny_bert):
    spm = Dictionary()
    for s in ["\u2581hel", "lo", "\u2581wor", "ld", "\u2581!", "\u2581a", "b"]:
        spm.add_symbol(s)
    assert detect_bpe(spm) == "sentencepiece"
    b = BertInputBuilder(tiny_bert, spm)
    assert (b.bpe, b.detokenize) == ("sentencepiece", "none")
    row = torch.tensor([spm.pad(), spm.index("\u2581hel"), spm.index("lo"), spm.index("\u2581wor"), spm.index("ld"),
                        spm.unk(), spm.eos()])
    assert b.text_from_source(row) == "hello world [UNK]"

    bpe = Dictionary()
    for s in ["hel@@", "lo", "wor@@", "ld", "&apos;s", ".", "don", "&apos;t", "e@@", "-@@", "@-@", "x"]:
        bpe.add_symbol(s)
    assert detect_bpe(bpe) == "subword_nmt"
    b = BertInputBuilder(tiny_bert, bpe)
    assert (b.bpe, b.detokenize) == ("subword_nmt", "moses")
    ids = [bpe.index(s) for s in ["hel@@", "lo", "wor@@", "ld", "&apos;s", "x", "@-@", "x", "."]] + [bpe.eos()]
    assert b.text_from_source(torch.tensor(ids)) == "hello world's x-x."
    assert remove_bpe("a@@ b c", "subword_nmt") == "ab c"
    assert moses_detokenize("( a , b ) don &apos;t &quot;") == "(a, b) don't \""

    # ids: the tokenizer's own special tokens, right padding with BERT's pad id, truncation to the limit
    tok = b.tokenizer
    out = b.batch_from_source(torch.stack([torch.tensor(ids),
                                           torch.tensor([bpe.pad()] * 8 + [bpe.index("x"), bpe.eos()])]))
    assert out[0].tolist() == tok("hello world's x-x.")["input_ids"]
    assert out[1].tolist()[:3] == [tok.cls_token_id, tok.convert_tokens_to_ids("x"), tok.sep_token_id]
    assert set(out[1].tolist()[3:]) == {tok.pad_token_id}
    long = BertInputBuilder(tiny_bert, bpe, max_length=6)
    assert long.max_length == 6
    enc = long.encode(["a b c d e f g h"])[0]
    assert enc == [tok.cls_token_id] + tok.convert_tokens_to_ids(list("abcd")) + [tok.sep_token_id]
    assert long.n_truncated == 1
    assert BertInputBuilder(tiny_bert, bpe).max_length == 24  # max_position_embeddings of the tiny BERT


def test_dataset_collates_bert_input_in_batch_order(tiny_bert):
    from fairseq.data import LanguagePairDataset, ListDataset

    d = letter_dict()
    srcs = [torch.tensor([d.index(c) for c in w] + [d.eos()]) for w in ["ab", "abcde", "abc"]]
    berts = [torch.tensor([2, 5 + i, 3]) for i in range(3)]
    base = LanguagePairDataset(srcs, torch.tensor([len(s) for s in srcs]), d,
                               srcs, torch.tensor([len(s) for s in srcs]), d)
    ds = LanguagePairBertDataset(base, ListDataset(berts), bert_pad=0)
    b = ds.collater([ds[i] for i in range(3)])
    assert b["id"].tolist() == [1, 2, 0]  # fairseq sorts by source length
    assert b["net_input"]["bert_input"].tolist() == [[2, 6, 3], [2, 7, 3], [2, 5, 3]]
    with pytest.raises(FairseqExtError, match="bert_jam.prepare"):
        LanguagePairBertDataset(base, ListDataset(berts[:2]), bert_pad=0)


# ------------------------------------------------------------------------------------------------ recipes

@pytest.mark.parametrize("recipe,arch,bert,gen", [
    ("iwslt14_de_en", "bert_jam_iwslt_de_en", "bert-base-german-dbmdz-uncased", {"beam": 5, "lenpen": 1.0}),
    ("wmt14_en_de", "bert_jam_wmt_en_de_big", "bert-large-uncased", {"beam": 4, "lenpen": 0.6}),
])
def test_recipe_dry_run_parses_with_fairseq(recipe, arch, bert, gen):
    import shlex
    import subprocess

    from fairseq import options

    from tests.helpers import ROOT

    out = subprocess.run(["bash", os.path.join(ROOT, "recipes", "bert_jam", f"{recipe}.sh"), "--dry-run"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    lines = [shlex.split(x.split(" > ")[0]) for x in out.splitlines() if x.strip()]
    assert [x[0] if x[0] != "python" else x[2] for x in lines[:6]] == [
        "fairseq_ext.bert_jam.prepare", "fairseq-train", "fairseq-train", "fairseq-train",
        "fairseq_ext.average_checkpoints", "fairseq-generate"]
    phases = []
    for argv in lines[1:4]:
        a = options.parse_args_and_arch(options.get_training_parser(), argv[1:])
        assert (a.arch, a.task, a.bert_model_name, a.lr, a.warmup_updates, a.label_smoothing, a.dropout,
                a.max_tokens, a.bert_dropnet, a.keep_last_epochs) == (arch, "translation_bert", bert, [0.0005], 4000,
                                                                      0.1, 0.3, 4000, 0.5, 10)
        assert a.adam_betas == "(0.9,0.98)" and a.share_all_embeddings and a.ddp_backend == "legacy_ddp"
        phases.append((a.bert_jam_phase, a.max_epoch, a.restore_file, a.reset_optimizer, a.patience))
    save = lines[1][lines[1].index("--save-dir") + 1].rsplit("/", 1)[0]
    assert [p[:4] for p in phases] == [(1, 40, "checkpoint_last.pt", False),
                                       (2, 50, f"{save}/phase1/checkpoint_last.pt", True),
                                       (3, 60, f"{save}/phase2/checkpoint_last.pt", True)]
    assert lines[4][lines[4].index("--num-epoch-checkpoints") + 1] == "10"
    g = options.parse_args_and_arch(options.get_generation_parser(), lines[5][1:])
    assert (g.beam, g.lenpen, g.path, g.task) == (gen["beam"], gen["lenpen"], f"{save}/phase3/checkpoint_avg10.pt",
                                                  "translation_bert")


# ------------------------------------------------------------------------------------------------ speed paths

def _count_calls(module, log, name):
    return module.register_forward_hook(lambda m, inp, out: log.append((name, inp[0].shape if inp else None)))


def test_dropnet_computes_only_the_branch_it_keeps(tiny_bert):
    model, d = build(tiny_bert, phase=2, bert_dropnet=0.5)
    model.train()  # dropout 0: the only randomness is drop-net's draw
    src, lengths, prev = batch(d)
    calls = []
    for layer in model.decoder.layers:
        _count_calls(layer.encoder_attn, calls, "enc")
        _count_calls(layer.bert_attn, calls, "bert")
    for seed in range(6):
        calls.clear()
        torch.manual_seed(seed)
        fast = model(src, lengths, prev)[0]
        n_fast = len(calls)
        assert n_fast == len(model.decoder.layers)  # one joint attention per decoder layer, not two
        for layer in model.decoder.layers:
            layer.skip_dropped_branch = False
        calls.clear()
        torch.manual_seed(seed)
        ref = model(src, lengths, prev)[0]  # both branches computed, one weighted by 0
        assert len(calls) == 2 * len(model.decoder.layers)
        assert torch.equal(fast, ref)
        for layer in model.decoder.layers:
            layer.skip_dropped_branch = True


def test_beam_search_projects_bert_keys_once_per_sentence(tiny_bert):
    from fairseq.sequence_generator import SequenceGenerator

    model, d = build(tiny_bert, phase=2)
    model.eval()
    with torch.no_grad():  # non-trivial GLUs
        for comp in model.compositions():
            for p in comp.parameters():
                p.add_(torch.randn_like(p) * 0.5)
    src, lengths, _ = batch(d)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    rows = []
    for layer in model.decoder.layers:
        _count_calls(layer.bert_attn.k_sec_proj, rows, "k")
    results = {}
    for per_sentence in (True, False):
        for layer in model.decoder.layers:
            layer.bert_attn.project_per_sentence = per_sentence
        rows.clear()
        with torch.no_grad():
            hyps = SequenceGenerator([model], d, beam_size=3, max_len_b=6).generate([model], sample)
        results[per_sentence] = [[(h["tokens"].tolist(), float(h["score"])) for h in beam] for beam in hyps]
        # K^S of the BERT branch is projected at the first step only, on 2 sentences, not 2 x 3 beams
        assert [r[1][1] for r in rows] == [2 if per_sentence else 6] * len(model.decoder.layers)
    assert [[t for t, _ in b] for b in results[True]] == [[t for t, _ in b] for b in results[False]]
    for a, b in zip(results[True], results[False]):
        assert all(abs(x[1] - y[1]) < 1e-5 for x, y in zip(a, b))


def test_checkpoint_activations_wraps_the_layers_and_keeps_the_gradients(tiny_bert):
    grads = {}
    for ckpt in (False, True):
        model, d = build(tiny_bert, phase=3, checkpoint_activations=ckpt)
        wrapped = [hasattr(layer, "precheckpoint_forward") for layer in
                   list(model.encoder.layers) + list(model.decoder.layers)]
        assert wrapped == [ckpt] * 4  # fairseq's checkpoint_wrapper, as TransformerEncoderBase/DecoderBase
        model.train()
        src, lengths, prev = batch(d)
        model(src, lengths, prev)[0].float().pow(2).mean().backward()
        grads[ckpt] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 50
    for n in grads[True]:
        assert_close(grads[True][n], grads[False][n], atol=1e-6, msg=n)


def test_frozen_bert_is_not_saved_and_a_directory_with_other_weights_is_refused(tiny_bert, tmp_path):
    import shutil

    from transformers import BertModel

    m1, d = build(tiny_bert, phase=1)
    state = m1.state_dict()
    assert not any(k.startswith("encoder.bert.") for k in state)
    assert m1.encoder.bert_digest() != "00" * 32
    # the same directory: BERT refilled from it, strictly
    m2, _ = build(tiny_bert, phase=2)
    m2.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(m2.encoder.bert.state_dict().values(),
                                                 m1.encoder.bert.state_dict().values()))
    # a copy of the directory whose weights differ in one number: refused with one line naming the flag
    other = str(tmp_path / "other_bert")
    shutil.copytree(tiny_bert, other)
    bert = BertModel.from_pretrained(other)
    with torch.no_grad():
        bert.encoder.layer[0].output.dense.bias[0] += 1e-3
    bert.save_pretrained(other)
    m3, _ = build(other, phase=2)
    with pytest.raises(FairseqExtError, match=r"^--bert-model-name .*other_bert: its weights \(sha256 [0-9a-f]+\) "
                                              r"are not the pre-trained BERT this checkpoint was trained with"):
        m3.load_state_dict(state)
    # phase 3 fine-tunes BERT: it is saved, and loads whatever the directory holds
    m3.set_phase(3)
    full = m3.state_dict()
    assert any(k.startswith("encoder.bert.") for k in full)
    m1.set_phase(3)
    m1.load_state_dict(full)
    assert torch.equal(m1.encoder.bert.encoder.layer[0].output.dense.bias, bert.encoder.layer[0].output.dense.bias)


# ------------------------------------------------------------------------------------------------ data on disk

@pytest.fixture(scope="module")
def prepared(tiny_bert, tmp_path_factory):
    """Dummy letters data with a second validation set (valid1), binarised and BERT-prepared in-process."""
    from fairseq import options
    from fairseq_cli import preprocess

    from fairseq_ext.bert_jam import prepare
    from tests.helpers import create_dummy_data

    d = str(tmp_path_factory.mktemp("bert_data"))
    create_dummy_data(d, num_examples=20, maxlen=8)
    create_dummy_data(d, num_examples=7, maxlen=8, seed=1, splits=("valid1",))
    preprocess.main(options.get_preprocessing_parser().parse_args([
        "--source-lang", "in", "--target-lang", "out", "--trainpref", f"{d}/train",
        "--validpref", f"{d}/valid,{d}/valid1", "--testpref", f"{d}/test", "--destdir", d, "--workers", "1"]))
    prepare.main([d, "-s", "in", "-t", "out", "--bert-model-name", tiny_bert, "--trainpref", f"{d}/train",
                  "--validpref", f"{d}/valid,{d}/valid1", "--testpref", f"{d}/test"])
    return d


def _task(data, tiny_bert):
    cfg = TranslationBertConfig(data=data, bert_model_name=tiny_bert, source_lang="in", target_lang="out",
                                dataset_impl="mmap", required_seq_len_multiple=1)
    return TranslationBertTask.setup_task(cfg)


def test_a_second_validation_set_is_a_subset_of_its_own(prepared, tiny_bert):
    task = _task(prepared, tiny_bert)
    for split, n in (("valid", 20), ("valid1", 7)):
        task.load_dataset(split, combine=False)  # what fairseq-train does for --valid-subset valid,valid1
        ds = task.datasets[split]
        assert len(ds) == len(ds.bert) == n
        b = ds.collater([ds[i] for i in range(n)])
        assert b["net_input"]["bert_input"].size(0) == n


def test_bert_input_prepared_with_other_settings_is_refused(prepared, tiny_bert, tmp_path):
    import json
    import shutil

    task = _task(prepared, tiny_bert)
    args = argparse.Namespace(arch="bert_jam", encoder_embed_dim=32, encoder_ffn_embed_dim=48,
                              encoder_attention_heads=4, encoder_layers=1, decoder_layers=1, decoder_embed_dim=32,
                              decoder_ffn_embed_dim=48, decoder_attention_heads=4, bert_jam_phase=1)
    model = task.build_model(argparse.Namespace(**vars(args)))  # same settings: fine, and they are recorded
    meta = json.load(open(os.path.join(prepared, "bert_input.in.json")))
    assert model.args.bert_input_meta == {k: meta[k] for k in model.args.bert_input_meta}
    assert model.args.bert_input_meta["detokenize"] == "moses"
    other = str(tmp_path / "data")
    shutil.copytree(prepared, other)
    meta["detokenize"] = "none"  # prepared with --bert-detokenize none
    json.dump(meta, open(os.path.join(other, "bert_input.in.json"), "w"))
    with pytest.raises(FairseqExtError,
                       match=r"^--bert-detokenize: .*bert_input\.in\.json has detokenize=none but "
                             r"the BERT input that the model's flags derive\(s\) has detokenize=moses"):
        _task(other, tiny_bert).build_model(argparse.Namespace(**vars(args)))
    # the settings saved in a checkpoint are the model's: generation from it refuses the same data
    saved = argparse.Namespace(**vars(model.args))
    task2 = _task(other, tiny_bert)
    task2.building_from_checkpoint = True
    with pytest.raises(FairseqExtError, match="--bert-detokenize: .*the checkpoint"):
        task2.build_model(saved, from_checkpoint=True)
    saved.bert_detokenize = "none"  # a checkpoint trained with --bert-detokenize none fits that data
    saved.bert_input_meta = dict(saved.bert_input_meta, detokenize="none")
    _task(other, tiny_bert).build_model(saved, from_checkpoint=True)


@pytest.mark.parametrize("recipe", ["iwslt14_de_en", "wmt14_en_de"])
def test_recipe_phase_3_writes_every_epoch_checkpoint_it_averages(recipe):
    """Phase 3 has its own save directory; early stopping there leaves fewer epoch checkpoints than
    --num-epoch-checkpoints averages (average_checkpoints then refuses)."""
    import shlex
    import subprocess

    from fairseq import options

    from tests.helpers import ROOT

    out = subprocess.run(["bash", os.path.join(ROOT, "recipes", "bert_jam", f"{recipe}.sh"), "--dry-run"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    lines = [shlex.split(x) for x in out.splitlines() if x.strip()]
    p2, p3 = (options.parse_args_and_arch(options.get_training_parser(), argv[1:]) for argv in lines[2:4])
    avg = lines[4]
    n = int(avg[avg.index("--num-epoch-checkpoints") + 1])
    assert avg[avg.index("--inputs") + 1] == p3.save_dir
    assert p3.max_epoch - p2.max_epoch >= n  # phase 3 writes at least the n epochs averaged ...
    assert p3.patience <= 0  # ... and nothing stops it before
