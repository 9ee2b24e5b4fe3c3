"""msc_transformer (Wei et al., ACL 2020): equations, ablations, exactness of incremental decoding and
reordering, parameter counts of Table 2, the L2 criterion, per-layer gradient norms, activation
checkpointing, and the fairseq CLI (train / generate / interactive / plot) through --user-dir."""

import argparse
import contextlib
import json
import math
import os

import pytest
import torch

import fairseq_ext  # noqa: F401  (registers everything)
from fairseq.logging import metrics
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.models.transformer import TransformerModel

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.msc.criterion import (
    LabelSmoothedCrossEntropyL2Criterion,
    encoder_weight_matrices,
)
from fairseq_ext.msc import model as msc_model
from fairseq_ext.msc.model import MSCContextFFN, MSCContextGRU, MSCGate, msc_encoder_states
from tests.builders import MSC_ABLATIONS as ABLATIONS
from tests.helpers import ROOT
from tests.builders import MSC_BLOCKS as BLOCKS
from tests.builders import MscTask as _Task
from tests.builders import msc_build as build
from tests.builders import msc_flags as _flags
from tests.helpers import (
    assert_close,
    create_dummy_data,
    generate_main,
    hypotheses,
    preprocess_translation_data,
    run_module,
    train_translation_model,
)

from benchmarks.speed import msc_decode as bench_msc_decode  # the pre-17.3 decoding path the benchmark times


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(d, seed=0, bsz=3, src_len=7, tgt_len=6):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(d.nspecial, len(d), (bsz, src_len), generator=g)
    src[:, -1] = d.eos()
    src[1, :3] = d.pad()  # left-padded source, as fairseq batches it
    lengths = src.ne(d.pad()).sum(1)
    tgt = torch.randint(d.nspecial, len(d), (bsz, tgt_len), generator=g)
    tgt[:, 0] = d.eos()
    return src, lengths, tgt


# ------------------------------------------------------------------------------------------------------
# incremental decoding == full pass; reordering
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ABLATIONS))
def test_incremental_decoding_equals_full_pass(name):
    model, d = build(extra=_flags(name))
    model.eval()
    src, lengths, tgt = _batch(d)
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        full, extra = model.decoder(tgt, enc)
        inc = {}
        for t in range(tgt.size(1)):
            step, step_extra = model.decoder(tgt[:, : t + 1], enc, incremental_state=inc)
            assert_close(step[:, 0], full[:, t], 1e-5, f"{name} step {t}")
            assert_close(step_extra["attn"][0][:, 0], extra["attn"][0][:, t], 1e-5, f"{name} attn {t}")


@pytest.mark.parametrize("name", ["msc", "no_block_scale", "plain"])
@pytest.mark.parametrize("beam,beamable", [(1, False), (2, False), (2, True)])
def test_reorder_incremental_state_and_encoder_out_as_beam_search_does(name, beam, beamable, monkeypatch):
    """fairseq's contract (SequenceGenerator, fairseq's own transformer): the encoder output is expanded to
    `beam` rows per sentence, then every step permutes rows inside each sentence's beam, and finished sentences
    leave the batch. The cross-attention caches are stock fairseq's (one per sentence with beamable attention,
    read from the expansion; one per hypothesis below BEAMABLE_MIN_SENTENCES sentences), the MSC tensors are
    reordered lazily; every step equals the full pass."""
    monkeypatch.setattr(msc_model, "BEAMABLE_MIN_SENTENCES", 1 if beamable else 3)
    model, d = build(extra=_flags(name))
    model.eval()
    src, lengths, _ = _batch(d, bsz=2, tgt_len=8)
    g = torch.Generator().manual_seed(1)
    tgt = torch.randint(d.nspecial, len(d), (2 * beam, 8), generator=g)  # one prefix per hypothesis
    tgt[:, 0] = d.eos()
    expand = torch.arange(2).repeat_interleave(beam)
    within = torch.arange(2 * beam).view(2, beam).flip(1).reshape(-1)  # reverse each beam
    keep = torch.arange(beam, 2 * beam)  # sentence 0 finished: rows of sentence 1 stay
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        full, _ = model.decoder(tgt, model.encoder(src[expand], lengths[expand]))
        enc_b = model.encoder.reorder_encoder_out(enc, expand)
        inc, rows = {}, torch.arange(2 * beam)
        for t in range(tgt.size(1)):
            if t in (3, 5):
                new_order = within if t == 3 else keep
                model.decoder.reorder_incremental_state_scripting(inc, new_order)
                enc_b = model.encoder.reorder_encoder_out(enc_b, new_order)
                rows = rows[new_order]
            step, _ = model.decoder(tgt[rows, : t + 1], enc_b, incremental_state=inc)
            assert_close(step[:, 0], full[rows, t], 1e-5, f"{name} beam {beam} step {t}")
            if t == 0:  # the cross-attention keys: one per sentence (2) with beamable attention, else 2 * beam
                keys = model.decoder.layers[0].encoder_attn._get_input_buffer(inc)["prev_key"]
                assert keys.size(0) == (2 if beamable else 2 * beam)


def test_encoder_out_carries_every_block_and_context_and_reorders_them():
    model, d = build(extra=BLOCKS)
    model.eval()
    src, lengths, _ = _batch(d, bsz=4)
    perm = torch.tensor([3, 1, 0, 2])
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        assert len(enc["msc_blocks"]) == 3 and len(enc["msc_contexts"]) == 4  # B^1..B^3, C^0..C^3
        assert enc["encoder_out"][0] is enc["msc_blocks"][-1]
        for x in enc["msc_blocks"] + enc["msc_contexts"]:
            assert x.shape == (src.size(1), 4, 16)
        # blocks and contexts are all different tensors
        for i in range(3):
            assert not torch.allclose(enc["msc_blocks"][i], enc["msc_blocks"][(i + 1) % 3])
        re = model.encoder.reorder_encoder_out(enc, perm)
        re = model.encoder.reorder_encoder_out(re, torch.tensor([1, 1, 0, 3]))  # composes with the first order
        enc2 = model.encoder(src[perm][[1, 1, 0, 3]], lengths[perm][[1, 1, 0, 3]])
    assert re["msc_blocks"] is enc["msc_blocks"]  # lazy: applied by msc_encoder_states when needed
    re["msc_blocks"], re["msc_contexts"] = msc_encoder_states(re)
    for key in ("msc_blocks", "msc_contexts", "encoder_out", "encoder_padding_mask", "encoder_embedding",
                "src_lengths"):
        assert len(re[key]) == len(enc2[key])
        for a, b in zip(re[key], enc2[key]):
            assert torch.equal(a, b) if a.dtype == torch.bool else torch.allclose(a.float(), b.float(), atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# the equations
# ------------------------------------------------------------------------------------------------------
def test_gate_is_eq12():
    torch.manual_seed(0)
    g = MSCGate(8)
    a_h, a_c = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    gate = torch.sigmoid(a_h @ g.W1.weight.t() + a_c @ g.W2.weight.t() + g.W2.bias)
    assert_close(g(a_h, a_c), gate * a_h + (1 - gate) * a_c, 1e-6, "gate")
    assert g.W1.bias is None and sum(p.numel() for p in g.parameters()) == 2 * 8 * 8 + 8


def test_encoder_follows_eq6_9_10_12_and_decoder_attends_block_n():
    """Recompute the encoder by hand from its sub-modules: C^0 = embedded input, each layer of block n fuses
    Attn_h with Attn_c over C^{n-1} by the gate, C^n = GRU(LN_n(B^n), C^{n-1}); and decoder layer n's
    attentions read B^n and C^n (checked with forward hooks)."""
    model, d = build(extra=["--encoder-layers-per-block", "2,1,3"])
    model.eval()
    enc_m = model.encoder
    src, lengths, tgt = _batch(d)
    mask = src.eq(d.pad())
    with torch.no_grad():
        out = enc_m(src, lengths)
        x = enc_m.forward_embedding(src)[0] * (~mask).unsqueeze(-1)
        x = x.transpose(0, 1)
        C = x
        assert_close(out["msc_contexts"][0], C, 1e-6, "C^0")
        li = 0
        for n, m in enumerate([2, 1, 3]):
            for _ in range(m):
                L = enc_m.layers[li]
                h = L.self_attn_layer_norm(x)
                a_h = L.self_attn(h, h, h, key_padding_mask=mask)[0]
                a_c = L.context_attn(h, C, C, key_padding_mask=mask)[0]
                g = torch.sigmoid(L.gate.W1(a_h) + L.gate.W2(a_c))
                o = g * a_h + (1 - g) * a_c + x  # Eq. 12
                x = L.fc2(torch.relu(L.fc1(L.final_layer_norm(o)))) + o
                li += 1
            ln = enc_m.layer_norm if n == 2 else enc_m.block_layer_norms[n]
            b = ln(x).masked_fill(mask.t().unsqueeze(-1), 0)
            assert_close(out["msc_blocks"][n], b, 1e-5, f"B^{n + 1}")
            T, B, D = b.shape
            C = enc_m.context_cell.cell(b.reshape(-1, D), C.reshape(-1, D)).view(T, B, D)  # Eq. 9
            C = C.masked_fill(mask.t().unsqueeze(-1), 0)
            assert_close(out["msc_contexts"][n + 1], C, 1e-5, f"C^{n + 1}")
        assert isinstance(enc_m.context_cell, MSCContextGRU)

        seen = {}
        hooks = []
        for n, layer in enumerate(model.decoder.layers):
            for attr in ("encoder_attn", "context_attn"):
                hooks.append(getattr(layer, attr).register_forward_hook(
                    lambda mod, args, kwargs, res, key=(n, attr): seen.__setitem__(key, kwargs["key"]),
                    with_kwargs=True))
        model.decoder(tgt, out)
        for h in hooks:
            h.remove()
    for n in range(3):
        assert seen[(n, "encoder_attn")] is out["msc_blocks"][n]  # Eq. 7: decoder block n <- encoder block n
        assert seen[(n, "context_attn")] is out["msc_contexts"][n + 1]  # Eq. 11: <- C^n


def test_ablation_structure():
    counts = {}
    for name in ABLATIONS:
        model, _ = build(extra=_flags(name))
        counts[name] = sum(p.numel() for p in model.parameters())
        enc, dec = model.encoder, model.decoder
        has_ctx_enc = all(layer.context_attn is not None for layer in enc.layers)
        has_ctx_dec = all(layer.context_attn is not None for layer in dec.layers)
        has_gate = all(layer.gate is not None for layer in list(dec.layers))
        assert len(enc.layers) == 6 and len(dec.layers) == 3
        if name in ("no_contextual", "plain"):
            assert enc.context_cell is None and not has_ctx_enc and not has_ctx_dec
        else:
            assert has_ctx_dec and has_ctx_enc == (name != "no_cxt_enc_attn")
            assert has_gate == (name != "add_fusion")
            assert isinstance(enc.context_cell, MSCContextFFN if name == "ffn_cell" else MSCContextGRU)
    d = 16
    attn, gate, gru = 4 * d * d + 4 * d, 2 * d * d + d, 6 * d * d + 6 * d
    assert counts["msc"] - counts["add_fusion"] == 9 * gate
    assert counts["msc"] - counts["no_cxt_enc_attn"] == 6 * (attn + gate)
    assert counts["msc"] - counts["no_contextual"] == 9 * (attn + gate) + gru
    assert counts["msc"] - counts["ffn_cell"] == gru - (2 * d * 24 + 24 + 24 * d + d)
    assert counts["no_contextual"] - counts["plain"] == 2 * 2 * d  # LN_1, LN_2 of the lower blocks
    assert counts["msc"] - counts["no_block_scale"] == 0


def test_plain_ablation_is_exactly_fairseq_prenorm_transformer():
    """--no-contextual-collaboration --no-block-scale-collaboration == fairseq's transformer with
    --encoder-normalize-before --decoder-normalize-before (same state dict, same outputs)."""
    model, d = build(extra=BLOCKS + ABLATIONS["plain"])
    p = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    TransformerModel.add_args(p)
    a = p.parse_args(["--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "24", "--encoder-attention-heads", "2",
                      "--decoder-attention-heads", "2", "--encoder-layers", "6", "--decoder-layers", "3",
                      "--dropout", "0", "--share-all-embeddings", "--encoder-normalize-before",
                      "--decoder-normalize-before"])
    ARCH_CONFIG_REGISTRY["transformer"](a)
    ref = TransformerModel.build_model(a, _Task(d))
    ref.load_state_dict(model.state_dict(), strict=True)
    model.eval()
    ref.eval()
    src, lengths, tgt = _batch(d)
    with torch.no_grad():
        assert_close(model(src, lengths, tgt)[0], ref(src, lengths, tgt)[0], 1e-5, "plain vs fairseq pre-norm")


@pytest.mark.parametrize("name", ["msc", "plain"])
def test_padding_is_respected(name):
    """A sentence alone and the same sentence padded inside a batch give the same encoder states and
    decoder outputs."""
    model, d = build(extra=_flags(name))
    model.eval()
    src, lengths, tgt = _batch(d)
    k = 1  # the left-padded sentence
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        out = model.decoder(tgt, enc)[0]
        alone_src = src[k: k + 1, 3:]
        enc1 = model.encoder(alone_src, lengths[k: k + 1])
        out1 = model.decoder(tgt[k: k + 1], enc1)[0]
    for key in ("msc_blocks", "msc_contexts"):
        for a, b in zip(enc[key], enc1[key]):
            assert_close(a[3:, k], b[:, 0], 1e-5, key)
            assert a[:3, k].abs().max() == 0  # padded positions are zero
    assert_close(out[k], out1[0], 1e-5, "decoder")


def test_checkpoint_activations_same_outputs_and_gradients():
    outs, grads = [], []
    for extra in ([], ["--checkpoint-activations"]):
        model, d = build(extra=BLOCKS + extra)
        model.train()  # dropout is 0
        src, lengths, tgt = _batch(d)
        y = model(src, lengths, tgt)[0]
        y.pow(2).mean().backward()
        outs.append(y.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert_close(outs[0], outs[1], 1e-6, "outputs")
    assert_close(grads[0], grads[1], 1e-6, "gradients")


def test_small_depth_smoke_trains_without_nan():
    """An 18-layer encoder (6 blocks x 3) at width 16 takes 20 Adam steps on a fixed batch: finite, loss falls.
    (The 72-layer check on the real corpus is python -m benchmarks.speed.msc_depth.)"""
    model, d = build(extra=["--encoder-layers-per-block", "3", "--encoder-blocks", "6"])
    assert len(model.encoder.layers) == 18
    src, lengths, tgt = _batch(d, bsz=4)
    target = torch.cat([tgt[:, 1:], tgt[:, :1]], 1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        lp = model.get_normalized_probs(model(src, lengths, tgt), log_probs=True)
        loss = -lp.gather(-1, target.unsqueeze(-1)).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.6 * losses[0] and min(losses[-5:]) < min(losses[:5])


# ------------------------------------------------------------------------------------------------------
# presets and parameter counts (Tables 1, 2, 4)
# ------------------------------------------------------------------------------------------------------
TABLE2 = [  # (arch, flags, paper count)
    ("msc_transformer_iwslt_de_en", ["--no-contextual-collaboration", "--no-block-scale-collaboration"], 10.5e6),
    ("msc_transformer_iwslt_de_en", [], 15.6e6),
    ("msc_transformer_iwslt_de_en_36l", [], 43.3e6),
    ("msc_transformer_iwslt_de_en_54l", [], 60.0e6),
    ("msc_transformer_iwslt_de_en_72l", [], 76.6e6),
]


@pytest.mark.parametrize("arch,flags,paper", TABLE2)
def test_parameter_counts_match_table2(arch, flags, paper):
    model, _ = build(arch, ["--share-all-embeddings"] + flags, vocab=10000, tiny=False)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - paper) / paper < 0.02, (arch, flags, n, paper)
    # exact count from the formula of the docstring (d=256, FFN 512, N=6 blocks of M layers)
    d, f, V, N = 256, 512, 10000, 6
    M = len(model.encoder.layers) // N
    attn, ffn, ln = 4 * d * d + 4 * d, 2 * d * f + f + d, 2 * d
    msc = not flags
    enc_layer = attn + ffn + 2 * ln + (attn + 2 * d * d + d if msc else 0)
    dec_layer = 2 * attn + ffn + 3 * ln + (attn + 2 * d * d + d if msc else 0)
    expect = V * d + N * M * enc_layer + N * dec_layer + 2 * ln + (6 * d * d + 6 * d + (N - 1) * ln if msc else 0)
    assert n == expect


def test_presets():
    cases = {
        "msc_transformer_iwslt_de_en": (256, 512, 4, [1] * 6, 0.1, 0.1),
        "msc_transformer_iwslt_de_en_36l": (256, 512, 4, [6] * 6, 0.3, 0.3),
        "msc_transformer_iwslt_de_en_54l": (256, 512, 4, [9] * 6, 0.3, 0.3),
        "msc_transformer_iwslt_de_en_72l": (256, 512, 4, [12] * 6, 0.3, 0.3),
        "msc_transformer_wmt_en_de": (512, 2048, 8, [1] * 6, 0.1, 0.1),
        "msc_transformer_wmt_en_de_36l": (512, 2048, 8, [6] * 6, 0.2, 0.1),
        "msc_transformer_wmt_en_de_48l": (512, 2048, 8, [8] * 6, 0.2, 0.1),
        "msc_transformer_wmt_en_de_big": (1024, 4096, 16, [1] * 6, 0.3, 0.1),
        "msc_transformer_wmt_en_de_big_18l": (1024, 4096, 16, [3] * 6, 0.3, 0.1),
    }
    for arch, (dim, ffn, heads, ms, dp, adp) in cases.items():
        a = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[arch](a)
        assert (a.encoder_embed_dim, a.encoder_ffn_embed_dim, a.encoder_attention_heads) == (dim, ffn, heads), arch
        assert a.msc_layers_per_block == ",".join(map(str, ms)), arch
        assert (a.encoder_layers, a.decoder_layers, a.encoder_blocks) == (sum(ms), 6, 6), arch
        assert (a.dropout, a.attention_dropout) == (dp, adp), arch
        assert a.encoder_normalize_before and a.decoder_normalize_before
    # a comma list sets N too, and the user's flags win over the preset
    a = argparse.Namespace(encoder_layers_per_block="2,3")
    ARCH_CONFIG_REGISTRY["msc_transformer_iwslt_de_en_72l"](a)
    assert (a.encoder_blocks, a.encoder_layers, a.decoder_layers) == (2, 5, 2)


@pytest.mark.parametrize("flags,needle", [
    (["--encoder-layers-per-block", "2,x"], "--encoder-layers-per-block"),
    (["--encoder-layers-per-block", "2,0"], "at least one layer"),
    (["--encoder-blocks", "3", "--encoder-layers-per-block", "1,2"], "--encoder-blocks is 3"),
    (["--encoder-blocks", "3", "--decoder-layers", "4"], "--decoder-layers 4"),
    (["--encoder-blocks", "3", "--encoder-layers", "5"], "--encoder-layers 5"),
    (["--encoder-layerdrop", "0.1"], "--encoder-layerdrop"),
])
def test_bad_flags_raise_clear_errors(flags, needle):
    with pytest.raises(FairseqExtError, match=needle.replace("-", r"\-")):
        build(extra=flags)


# ------------------------------------------------------------------------------------------------------
# L2 criterion and per-layer gradient norms
# ------------------------------------------------------------------------------------------------------
def test_l2_criterion_adds_lambda_sample_size_w2_and_logs_it():
    model, d = build(extra=BLOCKS)
    src, lengths, tgt = _batch(d)
    target = torch.cat([tgt[:, 1:], torch.full_like(tgt[:, :1], d.eos())], 1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": tgt},
              "target": target, "ntokens": int(target.ne(d.pad()).sum()), "id": torch.arange(3)}
    task = argparse.Namespace(target_dictionary=d)
    lam = 1e-3
    crit = LabelSmoothedCrossEntropyL2Criterion(task, False, 0.1, l2_lambda=lam)
    base = LabelSmoothedCrossEntropyL2Criterion(task, False, 0.1, l2_lambda=0.0)
    ws = encoder_weight_matrices(model)
    names = {id(p): n for n, p in model.encoder.named_parameters()}
    assert ws and all(p.dim() == 2 for p in ws)
    assert not any(names[id(p)].startswith("embed") for p in ws)
    assert any("context_cell" in names[id(p)] for p in ws) and any("gate.W1" in names[id(p)] for p in ws)
    sq = sum(float(p.detach().pow(2).sum()) for p in ws)
    model.train()
    loss, ss, log = crit(model, sample)
    loss0, ss0, log0 = base(model, sample)
    assert ss == ss0 == sample["ntokens"]
    assert math.isclose(loss.item() - loss0.item(), lam * ss * sq, rel_tol=1e-4)
    assert math.isclose(float(log["l2"]), lam * ss * sq, rel_tol=1e-5) and "l2" not in log0
    assert float(log["loss"]) == float(log0["loss"])  # "loss" is logged without the penalty
    # gradient of the penalty is 2 * lambda * sample_size * W on the encoder weight matrices only
    model.zero_grad()
    (loss - loss0.detach()).backward()
    g_pen = {id(p): p.grad.clone() for p in model.parameters() if p.grad is not None}
    model.zero_grad()
    loss0b, _, _ = base(model, sample)
    loss0b.backward()
    for p in ws:
        assert_close(g_pen[id(p)] - p.grad, 2 * lam * ss * p.detach(), 1e-5, "dL2/dW")
    dec_w = model.decoder.layers[0].fc1.weight
    assert_close(g_pen[id(dec_w)], dec_w.grad, 1e-6, "decoder untouched")
    # no penalty in eval mode; metrics reduce l2 to lambda * ||W||^2 in bits
    model.eval()
    loss_e, _, log_e = crit(model, sample)
    assert math.isclose(loss_e.item(), base(model, sample)[0].item(), rel_tol=1e-6)
    with metrics.aggregate() as agg:
        LabelSmoothedCrossEntropyL2Criterion.reduce_metrics([log, log])
    assert math.isclose(agg.get_smoothed_values()["l2"], round(lam * sq / math.log(2), 5), abs_tol=1e-5)


def test_layer_grad_norms_are_logged_at_optimizer_step():
    model, d = build(extra=BLOCKS + ["--log-layer-grad-norms"])
    model.train()
    src, lengths, tgt = _batch(d)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(src, lengths, tgt)[0].pow(2).mean().backward()
    expect = [math.sqrt(sum(float(p.grad.pow(2).sum()) for p in layer.parameters())) for layer in model.encoder.layers]
    assert all(v > 0 for v in expect)
    with metrics.aggregate(new_root=True) as agg:
        opt.step()
    vals = agg.get_smoothed_values()
    got = [vals[f"gnorm_enc_L{i}"] for i in range(1, 7)]
    assert got == [round(v, 4) for v in expect]
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)  # another optimizer: not logged
    other.param_groups[0]["params"][0].grad = torch.ones(2)
    with metrics.aggregate(new_root=True) as agg2:
        other.step()
    assert not any(k.startswith("gnorm_enc") for k in agg2.get_smoothed_values())


def _fp16_cfg(bf16, flatten):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "common": {"bf16": bf16, "fp16_no_flatten_grads": not flatten, "fp16_init_scale": 8, "fp16_scale_window": 128,
                   "fp16_scale_tolerance": 0.0, "threshold_loss_scale": None, "min_loss_scale": 1e-4,
                   "model_parallel_size": 1, "memory_efficient_bf16": False, "memory_efficient_fp16": False},
        "optimizer": {"_name": "adam", "adam_betas": "(0.9, 0.98)", "adam_eps": 1e-8, "weight_decay": 0.0,
                      "use_old_adam": False, "fp16_adam_stats": False, "tpu": False, "lr": [1e-3]},
        "optimization": {"lr": [1e-3], "update_freq": [1]},
        "distributed_training": {"distributed_world_size": 1}})


@pytest.mark.parametrize("kind", ["bf16", "fp16_flat", "memory_efficient_fp16"])
def test_layer_grad_norms_are_logged_behind_fairseq_fp16_optimizers(kind, monkeypatch):
    """--fp16 / --bf16 train through fairseq's FP16Optimizer, whose torch optimizer steps fp32 copies of the
    parameters (one per parameter for --bf16, one flat vector for --fp16); --memory-efficient-fp16 steps the
    model's parameters. The trainer's sequence (scaled backward, multiply_grads(1/sample_size),
    clip_grad_norm, step) must log each layer's norm of the unscaled, normalised gradient."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer, MemoryEfficientFP16Optimizer

    if kind == "fp16_flat":  # fairseq keys the flat fp32 copy by the CUDA device; on CPU the params' index is None
        monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    model, d = build(extra=BLOCKS + ["--log-layer-grad-norms"])
    if kind == "bf16":
        model = model.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = _fp16_cfg(bf16=kind == "bf16", flatten=kind == "fp16_flat")
    if kind == "memory_efficient_fp16":
        opt = MemoryEfficientFP16Optimizer.build_optimizer(cfg, params, allow_unsupported=True)
    else:
        opt = FP16Optimizer.build_optimizer(cfg, params)
    model.train()
    src, lengths, tgt = _batch(d)
    opt.zero_grad()  # as the trainer: also sets the fp16 unscaling factor 1 / loss scale
    opt.backward(model(src, lengths, tgt)[0].float().pow(2).sum())
    loss_scale = 1.0 if kind == "bf16" else 8.0  # fp16: the DynamicLossScaler's initial scale
    expect = [math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in layer.parameters())) / loss_scale * 0.5
              for layer in model.encoder.layers]
    assert all(v > 1e-2 for v in expect)
    opt.multiply_grads(0.5)  # 1 / sample_size
    opt.clip_grad_norm(0.0)
    with metrics.aggregate(new_root=True) as agg:
        opt.step()
    vals = agg.get_smoothed_values()
    got = [vals.get(f"gnorm_enc_L{i}") for i in range(1, 7)]
    assert None not in got, sorted(vals)
    assert got == pytest.approx(expect, rel=1e-3, abs=1e-4)


def test_layer_grad_norms_are_unscaled_when_the_optimizer_unscales_inside_its_step():
    """fairseq's FP16Optimizer passes scale= to optimizers that unscale inside step() (FusedAdam on GPU):
    their gradients are still multiplied by `scale` when the hook runs."""

    class ScaledSGD(torch.optim.SGD):
        def step(self, closure=None, scale=1.0):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.div_(scale)
            return super().step(closure)

    model, d = build(extra=BLOCKS + ["--log-layer-grad-norms"])
    model.train()
    opt = ScaledSGD(model.parameters(), lr=0.0)
    src, lengths, tgt = _batch(d)
    model(src, lengths, tgt)[0].pow(2).mean().backward()
    expect = [math.sqrt(sum(float(p.grad.pow(2).sum()) for p in layer.parameters())) / 4
              for layer in model.encoder.layers]
    with metrics.aggregate(new_root=True) as agg:
        opt.step(scale=4.0)
    vals = agg.get_smoothed_values()
    assert [vals[f"gnorm_enc_L{i}"] for i in range(1, 7)] == pytest.approx(expect, abs=1e-4)


# ------------------------------------------------------------------------------------------------------
# L2 criterion: training only; refused under FSDP
# ------------------------------------------------------------------------------------------------------
def _l2_sample(d):
    src, lengths, tgt = _batch(d)
    target = torch.cat([tgt[:, 1:], torch.full_like(tgt[:, :1], d.eos())], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": tgt},
            "target": target, "ntokens": int(target.ne(d.pad()).sum()), "id": torch.arange(3)}


def test_l2_term_is_not_computed_outside_training(monkeypatch):
    from fairseq_ext.msc import criterion as crit_mod

    model, d = build(extra=BLOCKS)
    crit = LabelSmoothedCrossEntropyL2Criterion(argparse.Namespace(target_dictionary=d), False, 0.1, l2_lambda=1e-3)
    calls = []
    real = crit_mod.encoder_l2
    monkeypatch.setattr(crit_mod, "encoder_l2", lambda *a, **k: calls.append(1) or real(*a, **k))
    model.eval()
    _, _, log = crit(model, _l2_sample(d))
    assert not calls and "l2" not in log and "enc_wsq" not in log
    model.train()
    _, _, log = crit(model, _l2_sample(d))
    assert calls == [1] and float(log["l2"]) > 0


def test_l2_criterion_refuses_fully_sharded_data_parallel():
    """--ddp-backend fully_sharded flattens each layer's parameters into 1-D shards (fairscale's
    FullyShardedDataParallel, `..._fsdp_wrapped_module.flat_param_0`): the encoder's weight matrices are gone, so
    the penalty would silently be 0. Refused from the config, and from the model if it reaches the criterion."""
    from fairseq.dataclass.configs import FairseqConfig
    from omegaconf import OmegaConf

    from fairseq_ext.msc.criterion import LabelSmoothedCrossEntropyL2Config

    model, d = build(extra=BLOCKS)
    task = argparse.Namespace(target_dictionary=d)
    cfg = OmegaConf.structured(FairseqConfig())
    cfg.distributed_training.ddp_backend = "fully_sharded"
    cfg.criterion = OmegaConf.structured(LabelSmoothedCrossEntropyL2Config())
    assert cfg.criterion.ddp_backend == "fully_sharded"  # II("distributed_training.ddp_backend")
    with pytest.raises(FairseqExtError, match="--ddp-backend fully_sharded"):
        LabelSmoothedCrossEntropyL2Criterion.build_criterion(cfg.criterion, task)
    cfg.criterion.l2_lambda = 0.0
    LabelSmoothedCrossEntropyL2Criterion.build_criterion(cfg.criterion, task)  # no L2 term: fine
    cfg.distributed_training.ddp_backend = "legacy_ddp"
    cfg.criterion.l2_lambda = 1e-5
    crit = LabelSmoothedCrossEntropyL2Criterion.build_criterion(cfg.criterion, task)

    class FullyShardedDataParallel(torch.nn.Module):  # what fsdp_wrap leaves of a layer: one flat 1-D parameter
        def __init__(self, layer):
            super().__init__()
            self.flat_param_0 = torch.nn.Parameter(torch.cat([p.detach().flatten() for p in layer.parameters()]))
            self.__dict__["layer"] = layer  # not a submodule: its parameters live in flat_param_0

        def forward(self, *args, **kwargs):
            return self.layer(*args, **kwargs)

    model.encoder.layers[0] = FullyShardedDataParallel(model.encoder.layers[0])
    model.train()
    with pytest.raises(FairseqExtError, match="--ddp-backend fully_sharded"):
        crit(model, _l2_sample(d))


# ------------------------------------------------------------------------------------------------------
# beam search: fairseq's beamable cross attention, stock reordering, lazy MSC tensors
# ------------------------------------------------------------------------------------------------------
def _search(model, d, src, lengths, beam):
    from fairseq.sequence_generator import SequenceGenerator

    gen = SequenceGenerator([model], d, beam_size=beam, max_len_b=12)
    with torch.no_grad():
        out = gen.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
    return [[(h["tokens"].tolist(), h["score"].item(), h["positional_scores"].tolist()) for h in hyps]
            for hyps in out]


@pytest.mark.parametrize("name", ["msc", "no_block_scale", "plain"])
@pytest.mark.parametrize("beamable", [False, True])
def test_beam_search_gives_the_hypotheses_and_scores_of_the_legacy_path(name, beamable, monkeypatch):
    """Beam 4 and greedy over a batch whose sentences finish at different steps (the batch shrinks): the same
    hypotheses, scores and positional scores as the per-hypothesis path with eager reordering (bit for bit
    without beamable attention; its einsum sums in another order: 1e-6)."""
    monkeypatch.setattr(msc_model, "BEAMABLE_MIN_SENTENCES", 1 if beamable else 7)
    results = []
    for legacy in (False, True):
        model, d = build(extra=_flags(name))
        with torch.no_grad():
            model.decoder.output_projection.weight[d.eos()] *= 1.3  # sentences end at different steps
        model.eval()
        src, lengths, _ = _batch(d, bsz=6, src_len=9)
        # the per-hypothesis path with eager reordering (the legacy path), as benchmarks/speed/msc_decode.py
        # times it
        with bench_msc_decode.legacy(model) if legacy else contextlib.nullcontext():
            results.append((_search(model, d, src, lengths, 4), _search(model, d, src, lengths, 1)))
    (beam_new, greedy_new), (beam_old, greedy_old) = results
    assert len({len(hyps[0][0]) for hyps in beam_new}) > 1  # lengths differ: finished sentences left the batch
    for new, old in ((beam_new, beam_old), (greedy_new, greedy_old)):
        for hyps_new, hyps_old in zip(new, old):
            assert [h[0] for h in hyps_new] == [h[0] for h in hyps_old]
            tol = 1e-6 if beamable else 0.0
            for (_, s_new, pos_new), (_, s_old, pos_old) in zip(hyps_new, hyps_old):
                assert math.isclose(s_new, s_old, rel_tol=0, abs_tol=tol)
                assert all(math.isclose(a, b, rel_tol=0, abs_tol=tol) for a, b in zip(pos_new, pos_old))


def test_a_stale_beam_size_does_not_leak_into_greedy_search_or_training(monkeypatch):
    """fairseq calls set_beam_size only for beam > 1 and never resets it: after a beam-4 search, a greedy search
    of 4 sentences and a training forward must still be exact (the decoder reads the width from the expansion
    of the encoder output and uses width 1 outside a search)."""
    monkeypatch.setattr(msc_model, "BEAMABLE_MIN_SENTENCES", 1)
    model, d = build(extra=BLOCKS)
    model.eval()
    src, lengths, tgt = _batch(d, bsz=4)
    greedy = _search(model, d, src, lengths, 1)
    with torch.no_grad():
        full = model(src, lengths, tgt)[0]
    _search(model, d, src, lengths, 4)
    assert all(m.beam_size == 4 for m in (model.decoder.layers[0].encoder_attn, model.decoder.layers[0].context_attn))
    assert _search(model, d, src, lengths, 1) == greedy
    with torch.no_grad():
        assert torch.equal(model(src, lengths, tgt)[0], full)
    model.train()
    assert torch.equal(model(src, lengths, tgt)[0].detach(), full)  # dropout is 0


# ------------------------------------------------------------------------------------------------------
# encoder and decoder of different widths
# ------------------------------------------------------------------------------------------------------
def test_encoder_and_decoder_widths_may_differ():
    """As fairseq's transformer: the decoder's attentions over B^n and C^n take keys/values of the encoder width."""
    model, d = build(extra=BLOCKS + ["--encoder-embed-dim", "16", "--decoder-embed-dim", "24",
                                     "--encoder-ffn-embed-dim", "24", "--decoder-ffn-embed-dim", "32",
                                     "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
                                     "--dropout", "0", "--attention-dropout", "0"], tiny=False)
    for layer in model.decoder.layers:
        assert (layer.context_attn.kdim, layer.context_attn.vdim, layer.context_attn.embed_dim) == (16, 16, 24)
    model.eval()
    src, lengths, tgt = _batch(d)
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        assert enc["msc_contexts"][1].size(-1) == 16
        full, _ = model.decoder(tgt, enc)
        inc = {}
        for t in range(tgt.size(1)):
            step, _ = model.decoder(tgt[:, : t + 1], enc, incremental_state=inc)
            assert_close(step[:, 0], full[:, t], 1e-5, f"step {t}")
    assert all(len(h) == 4 for h in _search(model, d, src, lengths, 4))
    model.train()
    model(src, lengths, tgt)[0].sum().backward()
    assert model.decoder.layers[0].context_attn.k_proj.weight.grad.shape == (24, 16)


# ------------------------------------------------------------------------------------------------------
# fairseq CLI through --user-dir: train (L2 criterion, grad norms, tensorboard), generate, interactive, plot
# ------------------------------------------------------------------------------------------------------
TINY_CLI = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
            "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
            "--encoder-blocks", "2", "--encoder-layers-per-block", "2", "--dropout", "0.1",
            "--share-all-embeddings"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    data = str(tmp_path_factory.mktemp("msc_cli"))
    create_dummy_data(data, num_examples=60, maxlen=10)
    preprocess_translation_data(data, ["--joined-dictionary"])
    proc = train_translation_model(
        data, "msc_transformer_iwslt_de_en",
        TINY_CLI + ["--criterion", "label_smoothed_cross_entropy_l2", "--label-smoothing", "0.1",
                    "--l2-lambda", "1e-5", "--log-layer-grad-norms", "--max-epoch", "2",
                    "--tensorboard-logdir", os.path.join(data, "tb")],
        run_validation=True)
    return data, proc.stdout + proc.stderr


def _train_inner_records(log):
    recs = []
    for line in log.splitlines():
        i = line.find("{")
        if i >= 0 and '"gnorm_enc_L1"' in line:
            recs.append(json.loads(line[i:]))
    return recs


def test_cli_train_logs_l2_and_layer_grad_norms(trained):
    data, log = trained
    recs = _train_inner_records(log)
    assert recs, log[-3000:]
    for r in recs:
        layers = [float(r[f"gnorm_enc_L{i}"]) for i in range(1, 5)]
        assert all(v > 0 and math.isfinite(v) for v in layers)
        assert "l2" in r and float(r["l2"]) > 0 and "enc_wnorm" in r
    events = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(data, "tb")) for f in fs if "tfevents" in f]
    assert events, "no tensorboard event file"
    blob = b"".join(open(f, "rb").read() for f in events)
    assert b"gnorm_enc_L1" in blob and b"gnorm_enc_L4" in blob and b"l2" in blob  # scalar tags in tensorboard
    ck = torch.load(os.path.join(data, "checkpoint_last.pt"), weights_only=False)
    a = ck["args"] if ck.get("args") is not None else ck["cfg"]["model"]
    assert a.arch == "msc_transformer_iwslt_de_en" and a.msc_layers_per_block == "2,2"


def test_cli_generate_and_interactive(trained):
    data, _ = trained
    gen, inter = generate_main(data)
    hyps = hypotheses(gen)
    assert len(hyps) == 60 and all(math.isfinite(s) for s, _ in hyps.values())
    assert "A-0" in gen  # --print-alignment works (attention is returned)
    assert "H-0" in inter


def test_plot_grad_norms_command(trained, tmp_path, capsys):
    data, log = trained
    log_file = tmp_path / "train.log"
    log_file.write_text(log)
    out = tmp_path / "gnorm.png"
    proc = run_module("fairseq_ext.msc.plot_grad_norms", [str(log_file), "--out", str(out)])
    assert out.exists() and out.stat().st_size > 1000
    assert "4 encoder layers" in proc.stdout
    from fairseq_ext.msc import plot_grad_norms as msc_plot_grad_norms

    assert msc_plot_grad_norms.main([str(tmp_path / "missing.log"), "--out", str(out)]) == 1
    assert "missing.log does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.log"
    empty.write_text("epoch 001: loss=3.2, num_updates=1\n")
    assert msc_plot_grad_norms.main([str(empty), "--out", str(out)]) == 1
    assert "--log-layer-grad-norms" in capsys.readouterr().err
    # simple (non-json) log format is parsed too
    simple = tmp_path / "simple.log"
    simple.write_text("epoch 001:  1 / 3 loss=2.1, gnorm_enc_L1=0.5, gnorm_enc_L2=0.25, num_updates=1\n"
                      "epoch 001:  2 / 3 loss=2.0, gnorm_enc_L1=0.7, gnorm_enc_L2=0.35, num_updates=2\n")
    recs = msc_plot_grad_norms.parse_log(str(simple))
    assert recs == [(1, {1: 0.5, 2: 0.25}), (2, {1: 0.7, 2: 0.35})]
    assert msc_plot_grad_norms.summarize(recs)[2] == 2.0


# ------------------------------------------------------------------------------------------------------
# recipes: --dry-run prints the paper's pipeline; the fairseq-train line parses with fairseq's own parser
# ------------------------------------------------------------------------------------------------------
RECIPES = [
    ("iwslt14_de_en.sh", ["--depth", "72"],
     dict(arch="msc_transformer_iwslt_de_en_72l", lr=[0.000699], warmup_updates=8000, max_update=15000,
          criterion="label_smoothed_cross_entropy_l2", l2_lambda=1e-5, source_lang="de", update_freq=[4]),
     ["--beam 5", "--lenpen 1.0", "--num-epoch-checkpoints 5", "vocab_size=10000", "-lc"]),
    ("iwslt14_en_de.sh", ["--depth", "6", "--plain"],
     dict(arch="msc_transformer_iwslt_de_en", lr=[0.000988], warmup_updates=4000, source_lang="en",
          criterion="label_smoothed_cross_entropy", no_contextual_collaboration=True,
          no_block_scale_collaboration=True),
     ["--beam 5", "--lenpen 1.0"]),
    ("iwslt17_en_fr.sh", ["--depth", "36", "--gpus", "2"],
     dict(arch="msc_transformer_iwslt_de_en_36l", target_lang="fr", update_freq=[2], max_tokens=4096),
     ["--beam 5"]),
    ("wmt14_en_de.sh", ["--size", "base", "--depth", "48"],
     dict(arch="msc_transformer_wmt_en_de_48l", adam_betas="(0.9, 0.98)", warmup_updates=8000,
          max_update=100000, update_freq=[2], max_tokens=4096, label_smoothing=0.1),
     ["--beam 4", "--lenpen 0.6", "--num-epoch-checkpoints 5", "vocab_size=32000", "##AT##-##AT##"]),
    ("wmt14_en_de.sh", ["--size", "big", "--depth", "18"],
     dict(arch="msc_transformer_wmt_en_de_big_18l", adam_betas="(0.9, 0.998)", warmup_updates=16000,
          max_update=300000, lr=[0.000247]),
     ["--beam 4", "--lenpen 0.6", "--num-epoch-checkpoints 20"]),
]


@pytest.mark.parametrize("script,flags,expect,needles", RECIPES)
def test_recipe_dry_run(script, flags, expect, needles, tmp_path):
    import shlex
    import subprocess

    from fairseq import options

    root = ROOT
    proc = subprocess.run(["bash", os.path.join(root, "recipes", "msc", script), "--dry-run", "--data-dir",
                           "/nonexistent", "--workdir", str(tmp_path / "w")] + flags,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(tmp_path / "w")  # nothing was run
    out = proc.stdout
    for needle in needles:
        assert needle in out, needle
    train = [line for line in out.splitlines() if line.startswith("+ fairseq-train ")]
    assert len(train) == 1
    argv = shlex.split(train[0])[2:]
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, argv)
    for k, v in expect.items():
        assert getattr(args, k) == v, (k, getattr(args, k), v)
    assert args.share_all_embeddings and args.optimizer == "adam" and args.lr_scheduler == "inverse_sqrt"


def test_recipe_rejects_depth_not_in_the_paper(tmp_path):
    import subprocess

    root = ROOT
    proc = subprocess.run(["bash", os.path.join(root, "recipes", "msc", "iwslt.sh"), "--dry-run", "--data-dir",
                           "/x", "--depth", "40"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--depth must be 6, 36, 54 or 72" in proc.stderr
    proc = subprocess.run(["bash", os.path.join(root, "recipes", "msc", "iwslt.sh"), "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "missing" in proc.stderr and "train.de" in proc.stderr


# ------------------------------------------------------------------------------------------------------
# degradation experiment (Figure 2): commands, validation, and training-set BLEU on the trained fixture
# ------------------------------------------------------------------------------------------------------
def test_degradation_dry_run_and_errors(capsys):
    import shlex

    from fairseq import options

    from fairseq_ext.msc import degradation as msc_degradation

    assert msc_degradation.main(["/bin", "--src", "de", "--tgt", "en", "--workdir", "/tmp/x", "--depths", "6,12",
                                 "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4  # plain6, msc6, plain12, msc12
    parsed = []
    for line in lines:
        argv = shlex.split(line)
        assert argv[1:3] == ["-m", "fairseq_cli.train"]
        args = options.parse_args_and_arch(options.get_training_parser(), argv[3:])
        parsed.append(args)
    assert [a.encoder_layers for a in parsed] == [6, 6, 12, 12]
    assert [a.no_contextual_collaboration for a in parsed] == [True, False, True, False]
    assert [a.no_block_scale_collaboration for a in parsed] == [True, False, True, False]
    assert all(a.decoder_layers == 6 and a.encoder_embed_dim == 64 for a in parsed)
    assert msc_degradation.main(["/bin", "--src", "de", "--tgt", "en", "--workdir", "/tmp/x", "--depths", "6,8",
                                 "--dry-run"]) == 1
    assert "multiple of --blocks 6" in capsys.readouterr().err
    assert msc_degradation.main(["/nonexistent", "--src", "de", "--tgt", "en", "--workdir", "/tmp/x"]) == 1
    assert "dict.de.txt" in capsys.readouterr().err


def test_degradation_training_set_bleu(trained):
    from fairseq_ext.msc import degradation as msc_degradation

    data, _ = trained
    args = argparse.Namespace(data=data, cpu=True, beam=2, batch_size=8, remove_bpe=None)
    bleu, n = msc_degradation.sample_bleu(os.path.join(data, "checkpoint_last.pt"), args, "train", 20, 1)
    assert n == 20 and 0.0 <= bleu <= 100.0
    bleu2, n2 = msc_degradation.sample_bleu(os.path.join(data, "checkpoint_last.pt"), args, "train", 20, 1)
    assert (bleu2, n2) == (bleu, n)  # same sample, same model: same score


def test_degradation_scores_given_checkpoints(trained, tmp_path, capsys):
    """--checkpoints scores models trained elsewhere (python -m benchmarks.claims --paper msc): one row per
    VARIANTDEPTH, the same BLEU as sample_bleu, the table and figure written; a malformed item or a missing file is
    one line."""
    from fairseq_ext.msc import degradation as msc_degradation

    data, _ = trained
    ckpt = os.path.join(data, "checkpoint_last.pt")
    work, png = str(tmp_path / "deg"), str(tmp_path / "fig2.png")
    argv = [data, "--src", "in", "--tgt", "out", "--workdir", work, "--sample", "20", "--beam", "2", "--cpu",
            "--remove-bpe", "none", "--checkpoints", f"msc6={ckpt},pre12={ckpt}", "--plot", png]
    assert msc_degradation.main(argv) == 0
    rows = json.load(open(os.path.join(work, "degradation.json")))["results"]
    assert [(r["variant"], r["depth"], r["sampled"]) for r in rows] == [("msc", 6, 20), ("pre", 12, 20)]
    args = argparse.Namespace(data=data, cpu=True, beam=2, batch_size=64, remove_bpe="none")
    bleu, _ = msc_degradation.sample_bleu(ckpt, args, "train", 20, 1)
    assert rows[0]["train_bleu"] == rows[1]["train_bleu"] == round(bleu, 2)
    assert os.path.getsize(png) > 0
    capsys.readouterr()
    assert msc_degradation.main(argv[:-4] + ["--checkpoints", "msc=" + ckpt]) == 1
    assert "is not VARIANTDEPTH=PATH" in capsys.readouterr().err
    assert msc_degradation.main(argv[:-4] + ["--checkpoints", "msc6=/no/such.pt"]) == 1
    assert "/no/such.pt: no such file" in capsys.readouterr().err
