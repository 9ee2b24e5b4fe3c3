"""fairseq_ext.inference's decoding speed-ups: ``prepack_output`` (MKL packed GEMM for the softmax projection), the
lean decoder step and encoder layer, int8 and the speed-ups by name. The float32 ones must give the plain model's
outputs (1e-5), keep incremental == full pass, reorder their caches with a permutation, and leave the generator's
hypotheses as they were."""

import os
import shutil

import pytest
import torch
from fairseq.models.transformer import TransformerModel
from fairseq.modules import MultiheadAttention
from fairseq.sequence_generator import SequenceGenerator

import fairseq_ext  # noqa: F401  (registers the plugin)
import fairseq_ext.inference.lean_decoder as lean_module
from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.inference.speedups import (PackedLinear, apply_speedups, prepack_output, quantize_decoder,
                                           quantize_encoder)
from fairseq_ext.inference.lean_decoder import LeanIncrementalDecoding, lean_decoder
from fairseq_ext.inference.lean_encoder import lean_encoder
from fairseq_ext.checkpoints.release import read_manifest, verify
from fairseq_ext.sat.generator import SATSequenceGenerator
from fairseq_ext.sat.model import SATModel, sat_decoder_input
from tests.builders import SAT_DICT as DICT
from tests.builders import SatTask, msc_build, sat_args, sat_model, sat_sample
from tests.helpers import ROOT, assert_close, run_cli
from tests.helpers import DEMO

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _OwnAttention(MultiheadAttention):
    """fairseq's attention with a forward of its own (the same numbers): not what the lean step computes."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def _batch(bsz=4, src_len=7, tgt_len=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(DICT.nspecial, len(DICT), (bsz, src_len), generator=g)
    src[:, -1] = DICT.eos()
    src[-1, :2] = DICT.pad()  # a left-padded shorter source: the cross-attention's key padding
    lengths = torch.full((bsz,), src_len)
    lengths[-1] = src_len - 2
    prev = torch.randint(DICT.nspecial, len(DICT), (bsz, tgt_len), generator=g)
    prev[:, 0] = DICT.eos()
    return src, lengths, prev


# -- PackedLinear ---------------------------------------------------------------------------------------------
def test_packed_linear_equals_linear_and_packs_per_row_count():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 300)
    p = PackedLinear(lin, max_rows=32, max_packs=2, pack_after=2)
    assert p.weight is lin.weight and p.bias is lin.bias
    with torch.no_grad():
        for M in (1, 2, 6, 24, 100):
            x = torch.randn(M, 1, 64)
            for _ in range(3):
                assert_close(p(x), torch.nn.functional.linear(x, lin.weight, lin.bias), 1e-5, f"M={M}")
    # M > max_rows is never packed; at most max_packs are kept, the oldest dropped
    assert sorted(p._packs) == [6, 24]
    with torch.no_grad():
        lin.weight.mul_(2)  # an in-place change of the weight drops the packs
        x = torch.randn(6, 64)
        assert_close(p(x), torch.nn.functional.linear(x, lin.weight, lin.bias), 1e-5, "after the change")
    assert p._version == lin.weight._version and list(p._packs) == [6]


def test_packed_linear_trains_through_autograd():
    lin = torch.nn.Linear(8, 5)
    p = PackedLinear(lin, pack_after=1)
    x = torch.randn(3, 8)
    p(x).sum().backward()  # grad enabled and a weight that needs it: the plain F.linear
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, x.sum(0).expand(5, 8))
    assert not p._packs


def test_prepack_output_keeps_tied_weights_state_dict_and_hypotheses():
    def tied():
        torch.manual_seed(5)
        args = sat_args("sat_transformer", 2, share_decoder_input_output_embed=True)
        return SATModel.build_model(args, SatTask()).eval()

    plain, m = tied(), prepack_output(tied())
    proj = m.decoder.output_projection
    assert isinstance(proj, PackedLinear) and proj.weight is m.decoder.embed_tokens.weight
    assert list(m.state_dict()) == list(plain.state_dict())
    src, lengths, _ = _batch()
    sample = sat_sample(src, lengths)
    for beam in (1, 3):
        a = SATSequenceGenerator([plain], DICT, beam_size=beam, max_len_a=0, max_len_b=8, lean_step=False).generate(
            [plain], sample)
        b = SATSequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=8).generate([m], sample)
        for ha, hb in zip(a, b):
            assert [h["tokens"].tolist() for h in ha] == [h["tokens"].tolist() for h in hb]
            assert all(abs(float(x["score"]) - float(y["score"])) < 1e-5 for x, y in zip(ha, hb))
    assert proj._packs  # the packed kernel did run


def _reorder_matches_full_pass(plain, m, K, src, lengths, prev, perms):
    """Two groups decoded incrementally, the caches reordered by each permutation, the third group: equal to the
    plain model's full pass over the permuted rows (outputs and alignment attention, 1e-5)."""
    sat_in = sat_decoder_input(prev, K, DICT.eos())
    with torch.no_grad():
        for perm in perms:
            enc = m.encoder(src, lengths)
            full, full_extra = plain.decoder(sat_in[perm], m.encoder.reorder_encoder_out(enc, perm))
            state = {}
            m.decoder(sat_in[:, : 2 * K], enc, incremental_state=state)
            m.decoder.reorder_incremental_state_scripting(state, perm)
            second, extra = m.decoder(sat_in[perm, : 3 * K], m.encoder.reorder_encoder_out(enc, perm),
                                      incremental_state=state)
            assert_close(second, full[:, 2 * K: 3 * K], 1e-5, f"after reorder {perm.tolist()}")
            assert_close(extra["attn"][0], full_extra["attn"][0][:, 2 * K: 3 * K], 1e-5, "attention after reorder")


@pytest.mark.parametrize("K", [1, 2, 4])
def test_prepack_keeps_the_hypotheses(K):
    _same_hypotheses(sat_model(K, seed=4), prepack_output(sat_model(K, seed=4)), K)


def _same_hypotheses(plain, m, K, tol=1e-5):
    """Greedy and beam 4 (SAT generator) give the same hypotheses, scores and attention (within ``tol``) with
    both models; ``plain`` decoded through its own step (``lean_step=False``), ``m`` as the generator does by
    default."""
    src, lengths, _ = _batch(bsz=5, seed=7)
    sample = sat_sample(src, lengths)
    for beam in (1, 4):
        opts = dict(beam_size=beam, max_len_a=1.0, max_len_b=5)
        a = SATSequenceGenerator([plain], DICT, lean_step=False, **opts).generate([plain], sample)
        b = SATSequenceGenerator([m], DICT, **opts).generate([m], sample)
        for ha, hb in zip(a, b):
            assert [h["tokens"].tolist() for h in ha] == [h["tokens"].tolist() for h in hb], (K, beam)
            for x, y in zip(ha, hb):
                assert abs(float(x["score"]) - float(y["score"])) < tol
                assert_close(x["positional_scores"], y["positional_scores"], tol, "positional scores")
                assert_close(x["attention"], y["attention"], tol, "alignment attention")


def test_refusals():
    with pytest.raises(FairseqExtError, match="no .decoder"):
        quantize_decoder(torch.nn.Linear(2, 2))
    with pytest.raises(FairseqExtError, match="output_projection"):
        prepack_output(torch.nn.Linear(2, 2))


# -- lean_decoder ----------------------------------------------------------------------------------------------
def _lean_pair(K, seed, **kw):
    """A SAT model and a copy of it with the lean incremental step (same weights)."""
    torch.manual_seed(seed)
    plain = SATModel.build_model(sat_args("sat_transformer", K, **kw), SatTask()).eval()
    lean = SATModel.build_model(sat_args("sat_transformer", K, **kw), SatTask()).eval()
    lean.load_state_dict(plain.state_dict())
    return plain, lean_decoder(lean)


@pytest.mark.parametrize("K,kw", [(1, {}), (2, {}), (3, {}), (2, {"learned": True}),
                                  (2, {"decoder_normalize_before": True}), (1, {"decoder_normalize_before": True})])
def test_lean_decoder_incremental_equals_full_pass(K, kw, monkeypatch):
    monkeypatch.setattr(lean_module, "CACHE_BLOCK", 4)  # the cache grows several times
    plain, m = _lean_pair(K, 21, **kw)
    assert isinstance(m.decoder, LeanIncrementalDecoding) and not isinstance(plain.decoder, LeanIncrementalDecoding)
    src, lengths, prev = _batch()
    sat_in = sat_decoder_input(prev, K, DICT.eos())
    with torch.no_grad():
        enc = m.encoder(src, lengths)
        full, full_extra = plain.decoder(sat_in, enc)
        state, outs, attns = {}, [], []
        # one group per call, then several groups at once (the relaxed mask within the step)
        for end in list(range(K, 4 * K + 1, K)) + [sat_in.size(1)]:
            out, extra = m.decoder(sat_in[:, :end], enc, incremental_state=state)
            outs.append(out)
            attns.append(extra["attn"][0])
    assert_close(torch.cat(outs, 1), full, 1e-5, f"K={K} {kw} lean incremental vs full pass")
    assert_close(torch.cat(attns, 1), full_extra["attn"][0], 1e-5, "alignment attention")
    lean_state = state[lean_module.STATE_KEY]
    assert lean_state["kbuf0"].size(2) >= sat_in.size(1) > 4  # grown past CACHE_BLOCK
    assert lean_state["k0"].data_ptr() == lean_state["kbuf0"].data_ptr()  # the cache is a view, not a copy
    assert not any(k != lean_module.STATE_KEY for k in state)  # fairseq's caches were not used


@pytest.mark.parametrize("K", [1, 2])
def test_lean_decoder_reorder_with_a_permutation(K):
    plain, m = _lean_pair(K, 22)
    # across sentences, with repeats and with rows dropped: the source keys and values follow the rows
    _reorder_matches_full_pass(plain, m, K, *_batch(),
                               (torch.tensor([3, 1, 1, 0]), torch.tensor([3, 2]), torch.tensor([2, 0, 3, 1])))


@pytest.mark.parametrize("K,used_only", [(1, False), (2, False), (2, True)])
def test_lean_decoder_keeps_sources_once_per_sentence_through_reorders(K, used_only, monkeypatch):
    """One state through a beam search's reorders: the expansion to the beam, permutations within sentences, a
    finished sentence dropped, then a permutation across sentences. The source keys / values are kept once per
    source while rows stay in equal runs per source and copied per row after that; the self-attention buffers
    alternate with a spare. Every group equals the plain model's full pass over the same rows (1e-5)."""
    if used_only:  # every buffer counts as large: reordered into the spare (a full one, n = capacity, too)
        monkeypatch.setattr(lean_module, "REORDER_USED_ONLY", 0)
        monkeypatch.setattr(lean_module, "CACHE_BLOCK", 2 * K)
    plain, m = _lean_pair(K, 27)
    src, lengths, prev = _batch(bsz=3, tgt_len=7 * K)
    sat_in = sat_decoder_input(prev, K, DICT.eos())
    stages = [  # (order of the current rows, sources kept, rows per source) after the reorder
        (torch.tensor([0, 0, 1, 1, 2, 2]), 3, 2),  # the first step's expansion to a beam of 2: no source copy
        (torch.tensor([1, 1, 2, 3, 5, 4]), 3, 2),  # each sentence's rows among its own hypotheses
        (torch.tensor([0, 1, 3, 3, 4, 5]), 3, 2),  # again (the buffers grew before this reorder) ...
        (torch.tensor([1, 0, 2, 3, 4, 4]), 3, 2),  # ... and again: same shape, the spare buffer is reused
        (torch.tensor([0, 1, 4, 5]), 2, 2),  # sentence 1 finished: its source is dropped
        (torch.tensor([2, 0, 3, 1]), 4, 1),  # across sentences: a copy per row again
    ]
    rows = torch.arange(3)  # original sentence of each current row
    reused = 0
    with torch.no_grad():
        enc = m.encoder(src, lengths)
        full, full_extra = plain.decoder(sat_in, enc)
        state = {}
        m.decoder(sat_in[:, :K], enc, incremental_state=state)
        lean = state[lean_module.STATE_KEY]
        for g, (order, sources, P) in enumerate(stages, start=1):
            spare = lean.get("kspare0")
            m.decoder.reorder_incremental_state_scripting(state, order)
            rows = rows[order]
            assert (lean["ck0"].size(0), lean.get("cross_rows", 1)) == (sources, P), f"stage {g}"
            if spare is not None and spare.size(0) == order.size(0) and spare.size(2) == lean["kbuf0"].size(2):
                assert lean["kbuf0"].data_ptr() == spare.data_ptr()  # same shape: the spare is reused
                reused += 1
            assert (lean.get("kspare0") is not None) == used_only
            # the encoder output is not passed reordered: the lean step holds the source keys and values
            assert m.decoder.holds_encoder_states(state)
            out, extra = m.decoder(sat_in[rows, : (g + 1) * K], enc, incremental_state=state)
            assert_close(out, full[rows, g * K: (g + 1) * K], 1e-5, f"stage {g}")
            assert_close(extra["attn"][0], full_extra["attn"][0][rows, g * K: (g + 1) * K], 1e-5, f"attn {g}")
    assert reused == (1 if used_only else 0)


def test_lean_decoder_reorders_its_state_without_fairseqs_module_walk(monkeypatch):
    """The generators' entry point reorders only the lean state when no other module holds any: the same state as
    fairseq's walk over every submodule, without calling the attention modules; a state that fairseq's path wrote
    takes the walk."""
    from fairseq.models.fairseq_incremental_decoder import FairseqIncrementalDecoder
    from fairseq.modules import MultiheadAttention
    calls = []
    walk_one = MultiheadAttention.reorder_incremental_state
    monkeypatch.setattr(MultiheadAttention, "reorder_incremental_state",
                        lambda self, *a: calls.append(self) or walk_one(self, *a))
    K = 2
    _, m = _lean_pair(K, 31)
    src, lengths, prev = _batch()
    sat_in = sat_decoder_input(prev, K, DICT.eos())
    order = torch.tensor([2, 2, 0, 3])
    with torch.no_grad():
        enc = m.encoder(src, lengths)
        state = {}
        m.decoder(sat_in[:, :2 * K], enc, incremental_state=state)
        walked = {key: dict(value) for key, value in state.items()}
        m.decoder.reorder_incremental_state_scripting(state, order)
        assert calls == [] and list(state) == [lean_module.STATE_KEY]
        FairseqIncrementalDecoder.reorder_incremental_state_scripting(m.decoder, walked, order)  # fairseq's walk
        walked_modules = 2 * len(m.decoder.layers)  # every layer's self and encoder attention
        assert len(calls) == walked_modules
        lean, lean_walked = state[lean_module.STATE_KEY], walked[lean_module.STATE_KEY]
        assert set(lean) == set(lean_walked)
        n = lean["k0"].size(2)
        for name, value in lean.items():
            other = lean_walked[name]
            if not torch.is_tensor(value):
                assert value == other, name
                continue
            if "buf" in name or "spare" in name:  # preallocated: only the n cached positions hold values
                value, other = value[:, :, :n], other[:, :, :n]
            assert torch.equal(value, other), name
        # a state written by fairseq's attention module: the walk reorders it too
        att = m.decoder.layers[0].self_attn
        held = torch.randn(4, att.num_heads, 3, att.head_dim)
        att._set_input_buffer(state, {"prev_key": held})
        m.decoder.reorder_incremental_state_scripting(state, order)
        assert len(calls) == 2 * walked_modules and torch.equal(att._get_input_buffer(state)["prev_key"], held[order])


def test_int8_qkv_fused_bit_for_bit_and_remade_for_new_weights():
    m = quantize_decoder(sat_model(2, seed=29), layers="decoder")
    att = m.decoder.layers[0].self_attn
    x = torch.randn(3, 4, att.q_proj.in_features)
    with torch.inference_mode():
        fused = lean_module.qkv(att, x)
        assert lean_module.fused_qkv(att) is not None
        for got, proj in zip(fused, (att.q_proj, att.k_proj, att.v_proj)):
            assert torch.equal(got, proj(x))  # one int8 call, the three outputs exactly
    other = quantize_decoder(sat_model(2, seed=30), layers="decoder").decoder.layers[0].self_attn
    att.k_proj.load_state_dict(other.k_proj.state_dict())  # new weights: the fused module is made again
    with torch.inference_mode():
        q, k, v = lean_module.qkv(att, x)
        assert torch.equal(k, other.k_proj(x)) and torch.equal(q, att.q_proj(x))
    assert not any("fused" in key for key in m.state_dict())


def test_equal_runs():
    assert lean_module.equal_runs([3, 3, 5, 5]) == ([3, 5], 2)
    assert lean_module.equal_runs([3, 5, 5, 3]) == ([3, 5, 5, 3], 1)
    assert lean_module.equal_runs([4, 4, 4]) == ([4], 3)
    assert lean_module.equal_runs([1, 1, 2, 2, 2, 2]) == ([1, 2, 2], 2)  # a source in two runs: copied twice
    assert lean_module.equal_runs([3, 3, 5]) is None and lean_module.equal_runs([3, 3, 5, 5, 5, 6]) is None
    assert lean_module.equal_runs([]) is None


def test_sat_generator_skips_the_encoder_reorder_with_the_lean_step(monkeypatch):
    plain, m = _lean_pair(2, 28)
    src, lengths, _ = _batch(bsz=3, seed=8)
    calls = {}
    for name, model, lean_step in (("plain", plain, False), ("lean", m, False), ("default", plain, True)):
        gen = SATSequenceGenerator([model], DICT, beam_size=3, max_len_a=1.0, max_len_b=5, lean_step=lean_step)
        orig = gen.model.reorder_encoder_out
        monkeypatch.setattr(gen.model, "reorder_encoder_out",
                            lambda e, o, name=name, orig=orig: calls.__setitem__(name, calls.get(name, 0) + 1)
                            or orig(e, o))
        gen.generate([model], sat_sample(src, lengths))
    assert calls.get("plain", 0) >= 2 and "lean" not in calls and "default" not in calls


@pytest.mark.parametrize("K", [1, 2, 4])
def test_lean_decoder_keeps_the_hypotheses(K):
    plain, m = _lean_pair(K, 23)
    with torch.no_grad():
        for mm in (plain, m):
            mm.decoder.output_projection.weight[DICT.eos()] *= 2.0  # hypotheses end at different lengths
    _same_hypotheses(plain, apply_speedups(m, "prepack"), K)


def test_sat_generator_steps_static_by_default_then_lean_then_own_without_changing_the_model(monkeypatch):
    """The generator's default: every decoder call through the static step (fairseq_ext/inference/static_step.py);
    static_step=False: every call through lean_decoder.lean_step; lean_step=False: the decoder's own step; the
    model's class unchanged throughout; the own step where neither computes the decoder or is not for it
    (attention modules with their own code, float64; MSC without the static step)."""
    import fairseq_ext.sat.generator as generator_module
    calls = {"lean": [], "static": []}
    for name, attr in (("lean", "lean_step"), ("static", "static_call"), ("static", "static_logits")):
        real = getattr(generator_module, attr)
        monkeypatch.setattr(generator_module, attr,
                            lambda *a, _real=real, _name=name, **k: calls[_name].append(1) or _real(*a, **k))
    m = sat_model(2, seed=31)
    cls = type(m.decoder)
    src, lengths, _ = _batch(bsz=3, seed=10)
    sample = sat_sample(src, lengths)
    opts = dict(beam_size=1, max_len_a=0, max_len_b=6, min_len=6)
    for beam in (1, 3):
        opts["beam_size"] = beam
        for kw, step in (({}, "static"), ({"static_step": False}, "lean"), ({"lean_step": False}, "own")):
            gen = SATSequenceGenerator([m], DICT, **opts, **kw)
            assert gen.model.step_name == step
            gen.generate([m], sample)
            assert gen.decoder_calls > 2 and type(m.decoder) is cls
            assert {k: len(v) for k, v in calls.items()} == {
                "static": gen.decoder_calls if step == "static" else 0,
                "lean": gen.decoder_calls if step == "lean" else 0}, step
            calls["lean"].clear()
            calls["static"].clear()
    own_attention = sat_model(2, seed=31)
    for layer in own_attention.decoder.layers:  # attention modules of another class: their own code runs
        layer.self_attn.__class__ = _OwnAttention
    for other in (own_attention, sat_model(2, seed=31).double()):
        assert SATSequenceGenerator([other], DICT, beam_size=2).model.step_name == "own"
    # MSC declares its memories: the static step, not the lean one
    assert SATSequenceGenerator([msc_build()[0]], DICT, beam_size=2, static_step=False).model.step_name == "own"
    mixed = lean_decoder(sat_model(2, seed=31))  # lean-decoder applied: the same step, counted as the lean one
    assert SATSequenceGenerator([mixed], DICT, beam_size=2, static_step=False).uses_lean_step
    # the dtype and device are checked on every call: a model cast after its generator was built takes its own
    # step (fairseq-train builds the --eval-bleu generator before it moves or casts the model)
    gen = SATSequenceGenerator([m], DICT, beam_size=3, max_len_a=0, max_len_b=6, min_len=6)
    m.double()
    assert gen.model.step_name == "own"
    out = gen.generate([m], sat_sample(src, lengths))
    assert not calls["lean"] and not calls["static"] and [len(h[0]["tokens"]) for h in out] == [7, 7, 7]
    m.float()
    assert gen.model.step_name == "static"


def test_lean_decoder_on_a_fairseq_transformer_with_fairseq_and_sat_generators():
    """The plain ``transformer`` (bench_sat's 'ours K=1'): fairseq's SequenceGenerator feeds one token a step
    and reorders the caches after every step; the SAT generator decodes it as K = 1."""
    torch.manual_seed(24)
    plain = TransformerModel.build_model(sat_args("transformer"), SatTask()).eval()
    m = TransformerModel.build_model(sat_args("transformer"), SatTask()).eval()
    m.load_state_dict(plain.state_dict())
    apply_speedups(m, "lean-decoder")
    src, lengths, _ = _batch(bsz=3, seed=9)
    sample = sat_sample(src, lengths)
    for gen, own in ((SequenceGenerator, {}), (SATSequenceGenerator, {"lean_step": False})):
        a = gen([plain], DICT, beam_size=3, max_len_b=6, **own).generate([plain], sample)
        b = gen([m], DICT, beam_size=3, max_len_b=6).generate([m], sample)
        for ha, hb in zip(a, b):
            assert [h["tokens"].tolist() for h in ha] == [h["tokens"].tolist() for h in hb], gen.__name__
            assert all(abs(float(x["score"]) - float(y["score"])) < 1e-5 for x, y in zip(ha, hb))


def test_lean_decoder_falls_back_where_it_does_not_apply():
    # int8 projections: called one by one; greedy and beam decode
    m = lean_decoder(quantize_decoder(sat_model(2, seed=25), layers="decoder"))
    src, lengths, prev = _batch(bsz=2)
    out = SATSequenceGenerator([m], DICT, beam_size=2, max_len_a=0, max_len_b=4, min_len=4).generate(
        [m], sat_sample(src, lengths))
    assert [len(h[0]["tokens"]) for h in out] == [5, 5]
    # training: fairseq's path (autograd, dropout), so the loss and its gradients are the plain model's
    plain, t = _lean_pair(2, 26)
    plain.train(), t.train()
    lp, lt = plain(src, lengths, prev)[0].sum(), t(src, lengths, prev)[0].sum()
    lp.backward(), lt.backward()
    assert float(lp) == float(lt)
    assert torch.equal(plain.decoder.layers[0].fc1.weight.grad, t.decoder.layers[0].fc1.weight.grad)
    # fairseq's SequenceGenerator on a K = 2 model (one token a step) keeps the decoder's own clear refusal
    with pytest.raises(FairseqExtError, match="--task translation_sat"):
        SequenceGenerator([t.eval()], DICT, beam_size=1, max_len_b=3).generate([t], sat_sample(src, lengths))


def test_lean_decoder_refuses_what_it_does_not_compute():
    with pytest.raises(FairseqExtError, match="no .decoder"):
        lean_decoder(torch.nn.Linear(2, 2))
    torch.manual_seed(0)
    m = SATModel.build_model(sat_args("sat_transformer", 2, cross_self_attention=True), SatTask())
    with pytest.raises(FairseqExtError, match="decoder layer 0 has cross-self-attention.*without lean-decoder"):
        lean_decoder(m)
    # decoders that compute other features (MSC's block-scale collaboration) are refused, not run wrongly
    from tests.builders import msc_build
    with pytest.raises(FairseqExtError, match="MSCDecoder does not declare supports_lean_step.*without lean-decoder"):
        lean_decoder(msc_build()[0])


def test_lean_step_reads_the_declaration_of_the_class_that_defines_the_features():
    """A decoder opts in with supports_lean_step in the class that defines extract_features_scriptable: a subclass
    that only inherits keeps it; a subclass that overrides the features without declaring again is refused (its
    own step runs, even in the SAT generator); one that declares again is taken. fairseq's own transformer
    decoder needs no declaration."""
    from fairseq.models.transformer import TransformerDecoderBase

    from fairseq_ext.inference.lean_decoder import declares_lean_step, lean_refusal
    from fairseq_ext.sat.model import SATDecoder

    class Inherits(SATDecoder):
        pass

    class Overrides(SATDecoder):
        def extract_features_scriptable(self, *args, **kwargs):
            return super().extract_features_scriptable(*args, **kwargs)

    class Declares(Overrides):
        supports_lean_step = True

        def extract_features_scriptable(self, *args, **kwargs):
            return super().extract_features_scriptable(*args, **kwargs)

    m = sat_model(2, seed=3)
    assert declares_lean_step(m.decoder) and lean_refusal(m.decoder) is None
    for cls, takes in ((Inherits, True), (Overrides, False), (Declares, True)):
        m.decoder.__class__ = cls
        assert declares_lean_step(m.decoder) == takes, cls.__name__
        assert SATSequenceGenerator([m], DICT, beam_size=2).uses_lean_step == takes, cls.__name__
    m.decoder.__class__ = Overrides
    assert lean_refusal(m.decoder).startswith("lean_decoder: Overrides does not declare supports_lean_step")
    t = TransformerModel.build_model(sat_args("transformer"), SatTask())
    assert type(t.decoder).extract_features_scriptable is TransformerDecoderBase.extract_features_scriptable
    assert declares_lean_step(t.decoder) and lean_refusal(t.decoder) is None


# -- lean_encoder ---------------------------------------------------------------------------------------------
def _count_layer_code(monkeypatch):
    """Counts the calls of fairseq's own encoder-layer code (the lean layer's fallback)."""
    from fairseq.modules.transformer_layer import TransformerEncoderLayerBase
    calls = []
    own = TransformerEncoderLayerBase.forward
    monkeypatch.setattr(TransformerEncoderLayerBase, "forward",
                        lambda self, *a, **k: calls.append(self) or own(self, *a, **k))
    return calls


@pytest.mark.parametrize("kw", [{}, {"encoder_normalize_before": True}])
def test_lean_encoder_equals_fairseqs_encoder(kw, monkeypatch):
    """Float32: fairseq's encoder output and every layer's state, on a batch with a padded source, without
    fairseq's layer code; in training or under autograd the layers' own code runs."""
    torch.manual_seed(41)
    plain = SATModel.build_model(sat_args("sat_transformer", 2, **kw), SatTask()).eval()
    lean = SATModel.build_model(sat_args("sat_transformer", 2, **kw), SatTask())
    lean.load_state_dict(plain.state_dict())
    lean_encoder(lean)
    calls = _count_layer_code(monkeypatch)
    src, lengths, _ = _batch()
    with torch.inference_mode():
        want = plain.encoder(src, src_lengths=lengths, return_all_hiddens=True)
        n_layers = len(calls)
        got = lean.encoder(src, src_lengths=lengths, return_all_hiddens=True)
    assert n_layers == len(plain.encoder.layers) and len(calls) == n_layers  # the lean layers ran
    assert_close(got["encoder_out"][0], want["encoder_out"][0], 1e-6, "encoder output")
    for i, (g, w) in enumerate(zip(got["encoder_states"], want["encoder_states"])):
        assert_close(g, w, 1e-6, f"state {i}")
    assert torch.equal(got["encoder_padding_mask"][0], want["encoder_padding_mask"][0])
    with torch.enable_grad():  # autograd: the layers' own code, gradients flow
        out = lean.encoder(src, src_lengths=lengths)["encoder_out"][0]
    assert out.requires_grad and len(calls) == 2 * n_layers
    lean.train()
    lean.encoder(src, src_lengths=lengths)
    assert len(calls) == 3 * n_layers


def test_lean_encoder_with_int8_projections_and_refusals(monkeypatch):
    """int8: one fused q/k/v call per layer (outputs bit for bit the three calls', see the test above), the
    attention sums ordered as in fairseq's float fused path: as close to the float encoder as fairseq's int8
    encoder is. Encoders the lean layer does not compute are refused with one line."""
    float_model = sat_model(2, seed=42)
    plain = quantize_encoder(sat_model(2, seed=42))
    lean = lean_encoder(quantize_encoder(sat_model(2, seed=42)))
    fused = []
    make = lean_module.fused_qkv
    monkeypatch.setattr(lean_module, "fused_qkv", lambda att: fused.append(att) or make(att))
    src, lengths, _ = _batch()
    with torch.inference_mode():
        want = float_model.encoder(src, src_lengths=lengths)["encoder_out"][0]
        fairseq_int8 = plain.encoder(src, src_lengths=lengths)["encoder_out"][0]
        got = lean.encoder(src, src_lengths=lengths)["encoder_out"][0]
    assert len(fused) == len(lean.encoder.layers)
    assert (got - want).abs().max() <= 2 * (fairseq_int8 - want).abs().max() + 1e-6
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    with pytest.raises(FairseqExtError, match="lean_encoder: encoder layer 0 has its own layer code"):
        lean_encoder(msc_build()[0])
    with pytest.raises(FairseqExtError, match="lean_encoder: the model has no .encoder"):
        lean_encoder(torch.nn.Linear(2, 2))


# -- apply_speedups and --inference-speedups ------------------------------------------------------------------
def test_apply_speedups_by_name_once_each():
    m = apply_speedups(sat_model(2, seed=10), "prepack, lean-decoder")
    assert isinstance(m.decoder.output_projection, PackedLinear)
    proj = m.decoder.output_projection
    apply_speedups(m, "prepack")  # already applied: nothing changes
    assert m.decoder.output_projection is proj
    with pytest.raises(FairseqExtError, match="unknown speed-up 'fast'; choose from int8-output"):
        apply_speedups(sat_model(2), "fast", flag="--inference-speedups")
    with pytest.raises(FairseqExtError, match="int8-decoder and prepack both replace the softmax projection"):
        apply_speedups(sat_model(2), "prepack,int8-decoder")
    with pytest.raises(FairseqExtError, match="--inference-speedups: fast-attention was retired: the lean decoder "
                                              "step does what it did .* use lean-decoder"):
        apply_speedups(sat_model(2), "fast-attention,prepack", flag="--inference-speedups")


@pytest.mark.slow
def test_inference_speedups_flag_keeps_the_release_translations(tmp_path):
    """fairseq-interactive --task translation_sat on the shipped SAT release: --inference-speedups prepack and
    lean-decoder,lean-encoder give the float model's translations (and int8-decoder translations with the meaning
    kept); an unknown name stops it with one line naming the flag."""
    release_dir = os.path.join(ROOT, "releases", "bible-de-en")
    if "sat_transformer_k2" not in read_manifest(release_dir)["models"]:
        pytest.skip("no sat_transformer_k2 in releases/bible-de-en")
    path = verify(release_dir, "sat_transformer_k2")
    for lang in ("de", "en"):
        shutil.copyfile(os.path.join(release_dir, "dict.txt"), tmp_path / f"dict.{lang}.txt")
    base = ["--user-dir", os.path.join(ROOT, "fairseq_ext"), "--path", path, "--task", "translation_sat",
            "--source-lang", "de", "--target-lang", "en", "--bpe", "sentencepiece", "--sentencepiece-model",
            os.path.join(release_dir, "spm.model"), "--beam", "4", "--max-len-a", "1.2", "--max-len-b", "10",
            "--num-workers", "0", "--buffer-size", "4", "--batch-size", "4"]
    sentences = "\n".join(DEMO) + "\n"

    def translate(*extra):
        proc = run_cli("interactive", [tmp_path] + base + list(extra), input=sentences)
        return [line.split("\t")[2] for line in proc.stdout.splitlines() if line.startswith("D-")]

    plain = translate()  # through the generator's default lean step
    assert len(plain) == len(DEMO)
    assert translate("--no-lean-step") == plain  # the decoder's own step
    assert translate("--inference-speedups", "prepack") == plain
    assert translate("--inference-speedups", "lean-decoder,lean-encoder") == plain
    for out, words in zip(translate("--inference-speedups", "int8-decoder"), DEMO.values()):
        assert all(w in out for w in words), out
    proc = run_cli("interactive", [tmp_path] + base + ["--inference-speedups", "fast"], input=sentences, check=False)
    assert proc.returncode != 0 and "--inference-speedups: unknown speed-up 'fast'" in proc.stderr
