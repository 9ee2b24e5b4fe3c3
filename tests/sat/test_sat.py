"""Tests of the Semi-Autoregressive Transformer: fairseq_ext.sat.model,
fairseq_ext.sat.task, fairseq_ext.sat.generator and the SAT scripts.

In-process checks on tiny random models (exactness), then one module-scoped set of CLI runs
(fairseq-train / -generate / -interactive with --user-dir) on the dummy data of tests/helpers.py.
"""

import argparse
import itertools
import math
import os
import re

import pytest
import torch

import fairseq_ext  # noqa: F401  (registers the plugin)
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.models.transformer import TransformerModel
from fairseq.sequence_generator import SequenceGenerator

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.sat.generator import SATSequenceGenerator
from fairseq_ext.sat.model import SATModel, relaxed_causal_mask, sat_decoder_input
from tests.builders import SAT_DICT as DICT
from tests.builders import SatTask as _Task
from tests.builders import sat_args as _args
from tests.builders import sat_dictionary, sat_model, sat_sample as _sample
from tests.helpers import (
    ROOT,
    TINY_SHARED_CLI,
    assert_close,
    create_dummy_data,
    generate_main,
    hypotheses,
    preprocess_translation_data,
    run_cli,
    run_module,
    train_translation_model,
)

# tiny in-process models: one intra-op thread (two threads fight over the shared 2-core machine)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# --------------------------------------------------------------------------------------------------------
# tiny random models


def transformer_with_weights_of(sat):
    t = TransformerModel.build_model(_args("transformer"), _Task()).eval()
    t.load_state_dict(sat.state_dict(), strict=True)
    return t


def _batch(bsz=3, src_len=7, tgt_len=11, seed=1, pad_last=True):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(DICT.nspecial, len(DICT), (bsz, src_len), generator=g)
    src[:, -1] = DICT.eos()
    src_lengths = torch.full((bsz,), src_len)
    if pad_last and bsz > 1:  # left-padded source (fairseq's default) of a shorter sentence
        src[-1, :2] = DICT.pad()
        src_lengths[-1] = src_len - 2
    tgt = torch.randint(DICT.nspecial, len(DICT), (bsz, tgt_len), generator=g)
    tgt[:, -1] = DICT.eos()
    if pad_last and bsz > 1:  # right-padded target of a shorter sentence
        tgt[-1, -4:] = DICT.pad()
        tgt[-1, -5] = DICT.eos()
    prev = torch.cat([torch.full((bsz, 1), DICT.eos()), tgt[:, :-1]], dim=1)
    prev[prev.eq(DICT.eos()) & (torch.arange(tgt_len) > 0)] = DICT.pad() if pad_last else DICT.eos()
    return src, src_lengths, tgt, prev


# --------------------------------------------------------------------------------------------------------
# the model: mask, shift, incremental decoding, K = 1 equals the Transformer


def test_relaxed_causal_mask_is_the_papers():
    # Figure 4 (right): n = 6, K = 2; M[i][j] = 1 iff j < (floor(i/K)+1)*K
    visible = relaxed_causal_mask(0, 6, 2, torch.zeros(1)).eq(0).int()
    expected = torch.tensor([
        [1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert torch.equal(visible, expected)
    for K in (1, 3, 4):
        v = relaxed_causal_mask(0, 10, K, torch.zeros(1)).eq(0)
        for i in range(10):
            for j in range(10):
                assert bool(v[i, j]) == (j < (i // K + 1) * K)
    assert torch.equal(relaxed_causal_mask(0, 7, 1, torch.zeros(1)).eq(0), torch.ones(7, 7).tril().bool())
    # rows of the incremental mask are rows of the full one
    assert torch.equal(relaxed_causal_mask(4, 9, 3, torch.zeros(1)), relaxed_causal_mask(0, 9, 3, torch.zeros(1))[4:])


def test_sat_decoder_input_long_distance_prediction():
    e, p = DICT.eos(), DICT.pad()
    prev = torch.tensor([[e, 11, 12, 13, 14, 15, 16], [e, 21, 22, 23, p, p, p]])
    # K = 3: position t holds y_{t-K} (1-based y: t-th word predicted from the word K before it)
    assert sat_decoder_input(prev, 3, e).tolist() == [
        [e, e, e, 11, 12, 13, 14, 15, 16], [e, e, e, 21, 22, 23, p, p, p]]
    assert sat_decoder_input(prev, 2, e).tolist() == [[e, e, 11, 12, 13, 14, 15, 16], [e, e, 21, 22, 23, p, p, p]]
    assert sat_decoder_input(prev, 1, e) is prev


@pytest.mark.parametrize("K", [2, 3])
def test_training_output_sees_exactly_its_group_and_earlier(K):
    """Invariant of the relaxed mask + long-distance prediction: the output at target position t changes
    when the decoder input of any position in t's group or earlier changes, and never for later ones."""
    m = sat_model(K)
    src, src_lengths, tgt, prev = _batch(bsz=1, tgt_len=9, pad_last=False)
    sat_in = sat_decoder_input(prev, K, DICT.eos())
    enc = m.encoder(src, src_lengths)
    base, _ = m.decoder(sat_in, enc)
    for j in range(sat_in.size(1)):
        changed = sat_in.clone()
        changed[0, j] = DICT.nspecial + (int(changed[0, j]) - DICT.nspecial + 1) % (len(DICT) - DICT.nspecial)
        out, _ = m.decoder(changed, enc)
        moved = (out - base).abs().amax(-1)[0] > 1e-6
        for i in range(sat_in.size(1)):
            assert bool(moved[i]) == (j < (i // K + 1) * K), (i, j)


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("K", [1, 2, 3, 4, 6])
def test_incremental_k_positions_equal_full_pass(K, learned):
    m = sat_model(K, learned=learned)
    src, src_lengths, tgt, prev = _batch(bsz=3, tgt_len=13, pad_last=False)
    enc = m.encoder(src, src_lengths)
    sat_in = sat_decoder_input(prev, K, DICT.eos())
    full, full_extra = m.decoder(sat_in, enc)
    state, outs, attns = {}, [], []
    for end in range(K, sat_in.size(1) + 1, K):
        out, extra = m.decoder(sat_in[:, :end], enc, incremental_state=state)
        assert out.size(1) == K
        outs.append(out)
        attns.append(extra["attn"][0])
    assert_close(torch.cat(outs, 1), full, 1e-5, f"K={K} incremental vs full")
    assert_close(torch.cat(attns, 1), full_extra["attn"][0], 1e-5, f"K={K} attention")
    # the model's training forward is the same pass, cut to the target length
    out, _ = m(src, src_lengths, prev)
    assert_close(out, full[:, : prev.size(1)], 0, "model.forward")


@pytest.mark.parametrize("K", [2, 3])
def test_incremental_uneven_steps_and_reorder(K):
    """Steps of several whole groups at once (the mask then covers the later groups), a prefix that is not
    whole groups is refused, and reorder_incremental_state with a permutation."""
    m = sat_model(K)
    src, src_lengths, tgt, prev = _batch(bsz=4, tgt_len=12, pad_last=False)
    enc = m.encoder(src, src_lengths)
    sat_in = sat_decoder_input(prev, K, DICT.eos())
    full, _ = m.decoder(sat_in, enc)
    state, outs = {}, []
    for end in [K, 3 * K, sat_in.size(1)]:
        out, _ = m.decoder(sat_in[:, :end], enc, incremental_state=state)
        outs.append(out)
    assert_close(torch.cat(outs, 1), full, 1e-5, "uneven steps")
    with pytest.raises(FairseqExtError, match="whole groups"):
        m.decoder(sat_in[:, : K + 1], enc, incremental_state={})

    # reorders as beam search makes them: rows 2s, 2s+1 are two hypotheses of sentence s (same source);
    # a hypothesis may be continued twice, and finished sentences leave the batch
    src2 = src[:2].repeat_interleave(2, dim=0)
    enc = m.encoder(src2, src_lengths[:4])
    full, _ = m.decoder(sat_in, enc)
    for perm in (torch.tensor([1, 1, 3, 2]), torch.tensor([3, 2]), torch.tensor([0, 1, 2, 3])):
        state = {}
        m.decoder(sat_in[:, : 2 * K], enc, incremental_state=state)
        m.decoder.reorder_incremental_state_scripting(state, perm)
        enc_p = m.encoder.reorder_encoder_out(enc, perm)
        second, _ = m.decoder(sat_in[perm, : 3 * K], enc_p, incremental_state=state)
        assert_close(second, full[perm, 2 * K: 3 * K], 1e-5, f"after reorder {perm.tolist()}")


def test_k1_training_loss_equals_fairseq_transformer():
    sat = sat_model(1)
    ref = transformer_with_weights_of(sat)
    src, src_lengths, tgt, prev = _batch(bsz=3, tgt_len=11)
    sample = _sample(src, src_lengths, tgt, prev)
    crit = LabelSmoothedCrossEntropyCriterion(_Task(), sentence_avg=False, label_smoothing=0.1)
    loss_sat, _, log_sat = crit(sat, sample)
    loss_ref, _, log_ref = crit(ref, sample)
    assert loss_sat.item() == loss_ref.item()
    assert log_sat["nll_loss"].item() == log_ref["nll_loss"].item()
    # gradients too
    sat.train(), ref.train()
    crit(sat, sample)[0].backward()
    crit(ref, sample)[0].backward()
    for (n, a), (_, b) in zip(sat.named_parameters(), ref.named_parameters()):
        assert_close(a.grad, b.grad, 1e-6, n)


def test_k2_loss_is_label_smoothed_ce_of_group_predictions():
    """The stock criterion on the SAT output = the loss computed by hand from the relaxed-mask pass."""
    m = sat_model(2)
    src, src_lengths, tgt, prev = _batch(bsz=3, tgt_len=9)
    sample = _sample(src, src_lengths, tgt, prev)
    crit = LabelSmoothedCrossEntropyCriterion(_Task(), sentence_avg=False, label_smoothing=0.0)
    loss, _, _ = crit(m, sample)
    enc = m.encoder(src, src_lengths)
    full, _ = m.decoder(sat_decoder_input(prev, 2, DICT.eos()), enc)
    lp = torch.log_softmax(full[:, :9].float(), -1)
    mask = tgt.ne(DICT.pad())
    manual = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)[mask].sum()
    assert abs(loss.item() - manual.item()) < 1e-4


# --------------------------------------------------------------------------------------------------------
# the generator


def _gen(models, **kw):
    return SATSequenceGenerator(models, DICT, **kw)


def _same_hypos(a, b, what, atol=1e-5, attention=False):
    assert len(a) == len(b), what
    for s, (ha, hb) in enumerate(zip(a, b)):
        assert len(ha) == len(hb), f"{what} sentence {s}: {len(ha)} vs {len(hb)} hypotheses"
        for x, y in zip(ha, hb):
            assert x["tokens"].tolist() == y["tokens"].tolist(), f"{what} sentence {s}"
            assert abs(float(x["score"]) - float(y["score"])) <= atol, f"{what} sentence {s} score"
            assert_close(x["positional_scores"], y["positional_scores"], atol, f"{what} sentence {s}")
            if attention:
                assert_close(x["attention"], y["attention"], atol, f"{what} sentence {s} attention")


@pytest.mark.parametrize("lean_step", [True, False])
@pytest.mark.parametrize("beam,lenpen,unkpen", [(1, 1.0, 0.3), (2, 0.6, 0.3), (4, 1.0, 0.3), (5, 1.6, 0.3),
                                                (1, 1.0, 0.0), (4, 0.6, 0.0)])
def test_k1_generator_equals_fairseq_sequence_generator(beam, lenpen, unkpen, lean_step):
    """Through the lean step (the generator's default) and through the decoder's own step."""
    sat = sat_model(1)
    ref = transformer_with_weights_of(sat)
    src, src_lengths, _, _ = _batch(bsz=4, src_len=6)
    sample = _sample(src, src_lengths)
    opts = dict(beam_size=beam, len_penalty=lenpen, max_len_a=1.0, max_len_b=6, min_len=2, unk_penalty=unkpen)
    gen = _gen([sat], lean_step=lean_step, **opts)
    assert gen.uses_lean_step == lean_step
    ours = gen.generate([sat], sample)
    theirs = SequenceGenerator([ref], DICT, **opts).generate([ref], sample)
    _same_hypos(ours, theirs, f"beam {beam} lenpen {lenpen}", attention=True)
    lengths = {len(h["tokens"]) for hs in theirs for h in hs}
    assert len(lengths) > 1  # the comparison covers hypotheses of several lengths


def test_group_beam_search_finds_the_reordering_modules_once_per_search(monkeypatch):
    """fairseq's reorder asks every submodule on every call; the generator makes the same calls in the same order
    with the modules found once per search (same hypotheses as fairseq's generator, see the test above), and again
    for the next search (a module added in between is reordered too)."""
    sat = sat_model(2)
    src, src_lengths, _, _ = _batch(bsz=2, src_len=6)
    sample = _sample(src, src_lengths)
    walks, reorders = [], []
    modules = type(sat.decoder).modules
    monkeypatch.setattr(type(sat.decoder), "modules", lambda self: walks.append(self) or modules(self))
    from fairseq.modules import MultiheadAttention
    own = MultiheadAttention.reorder_incremental_state
    monkeypatch.setattr(MultiheadAttention, "reorder_incremental_state",
                        lambda self, *a: reorders.append(self) or own(self, *a))
    gen = _gen([sat], lean_step=False, beam_size=2, max_len_a=0, max_len_b=8, min_len=8)
    gen.generate([sat], sample)
    groups = gen.decoder_calls
    attention_modules = [m for m in sat.decoder.modules() if isinstance(m, MultiheadAttention)]
    walks.clear()
    assert groups > 2 and len(reorders) == (groups - 1) * len(attention_modules)  # every module, every reorder
    gen.generate([sat], sample)
    assert len(walks) == 1
    extra = MultiheadAttention(16, 2, self_attention=True)
    sat.decoder.extra_attention = extra  # a new module: the next search finds it
    reorders.clear()
    gen.generate([sat], sample)
    assert sum(m is extra for m in reorders) == groups - 1


def _reference_search(model, src, src_lengths, beam, max_len, min_len=1, lenpen=1.0, unkpen=0.0):
    """Slow beam search with the semantics of fairseq's BeamSearch (2*beam candidates; EOS among the top
    beam finalises; the first beam non-EOS continue), scoring every candidate by a full forward pass of
    the model on the hypothesis (relaxed mask, no cache). One sentence at a time."""
    eos, pad, unk = DICT.eos(), DICT.pad(), DICT.unk()
    results = []
    for b in range(src.size(0)):
        s, sl = src[b: b + 1], src_lengths[b: b + 1]
        n_pad = int(s.eq(pad).sum())
        s, sl = s[:, n_pad:], sl  # drop the left padding
        hyps = [([], torch.zeros(()), [])]
        finalized = []
        for step in range(max_len + 1):
            live = hyps if step > 0 else hyps[:1]
            # every hypothesis has `step` words: one full forward pass (no cache) scores all of them
            prev = torch.tensor([[eos] + toks for toks, _, _ in live])
            out, _ = model(s.expand(len(live), -1), sl.expand(len(live)), prev)
            lp = model.get_normalized_probs((out, None), log_probs=True)[:, -1].clone()
            lp[:, pad] = -math.inf
            lp[:, unk] -= unkpen
            if step >= max_len:
                keep = lp[:, eos].clone()
                lp[:] = -math.inf
                lp[:, eos] = keep
            if step < min_len:
                lp[:, eos] = -math.inf
            total = lp + torch.stack([score for _, score, _ in live]).unsqueeze(1)  # [hyps, V]
            order = torch.sort(total.view(-1), descending=True, stable=True).indices[: 2 * beam].tolist()
            new_hyps = []
            for rank, flat in enumerate(order):
                h, v = divmod(flat, len(DICT))
                toks, score, pos = live[h]
                cand, lpv = total[h, v], lp[h, v]
                if v == eos and cand.item() != -math.inf:
                    if rank < beam and len(finalized) < beam:
                        finalized.append((toks + [eos], cand / (step + 1) ** lenpen, pos + [lpv]))
                    continue
                if len(new_hyps) < beam:
                    new_hyps.append((toks + [v], cand, pos + [lpv]))
            if len(finalized) >= beam or step == max_len:
                break
            hyps = new_hyps
        finalized.sort(key=lambda f: -float(f[1]))
        results.append(finalized)
    return results


TINY_DICT = sat_dictionary(2)  # 6 symbols: <s> <pad> </s> <unk> a b


class _TinyTask:
    source_dictionary = TINY_DICT
    target_dictionary = TINY_DICT


def _tiny_sat(K, seed):
    torch.manual_seed(seed)
    m = SATModel.build_model(_args("sat_transformer", K), _TinyTask()).eval()
    with torch.no_grad():  # hypotheses of several lengths, and EOS inside groups
        m.decoder.output_projection.weight.mul_(3.0)
        m.decoder.output_projection.weight[TINY_DICT.eos()] *= 0.5
    return m


def _brute_force_group_search(model, src, src_lengths, K, beam, max_len, min_len, lenpen, unkpen):
    """The group beam search of fairseq_ext.sat.generator by enumeration, one sentence at a time: for every
    hypothesis, the K distributions of its next group come from a full forward pass (no cache); every
    K-word continuation (and every hypothesis ending at position j of the group) is enumerated. Position j of a
    group: the hypotheses ending at j compete with all non-EOS prefixes of length j+1 (all parents); those in
    the top `beam` are finalised (fairseq's rule at every step); the next hypotheses are the top `beam` K-word
    continuations of all parents."""
    import itertools

    d = model.decoder.dictionary
    eos, pad, unk, V = d.eos(), d.pad(), d.unk(), len(d)
    words = [v for v in range(V) if v != eos]
    results = []
    for b in range(src.size(0)):
        s = src[b: b + 1, int(src[b].eq(pad).sum()):]
        hyps = [([], 0.0, [])]  # words, score, cumulative scores
        finalized = []
        step = 0
        while True:
            # the K distributions of each hypothesis' next group: outputs step..step+K-1 of a full pass, which
            # see the decoder inputs up to y_step only (relaxed mask); the K-1 filler words are cut away
            prev = torch.tensor([[eos] + toks + [eos] * K for toks, _, _ in hyps])[:, : step + K]
            out, _ = model(s.expand(len(hyps), -1), src_lengths[b: b + 1].expand(len(hyps)), prev)
            lp = model.get_normalized_probs((out, None), log_probs=True)[:, step: step + K].clone()
            lp[:, :, pad] = -math.inf
            lp[:, :, unk] -= unkpen
            for k in range(K):
                if step + k >= max_len:
                    keep = lp[:, k, eos].clone()
                    lp[:, k] = -math.inf
                    lp[:, k, eos] = keep
                if step + k < min_len:
                    lp[:, k, eos] = -math.inf
            lp = lp.tolist()

            def extend(h, seq):
                toks, score, cums = hyps[h]
                cums = list(cums)
                for k, v in enumerate(seq):
                    score = score + lp[h][k][v]
                    cums.append(score)
                return toks + list(seq), score, cums

            done = False
            for j in range(min(K, max_len - step + 1)):
                ending = [extend(h, p + (eos,)) for h in range(len(hyps)) for p in itertools.product(words, repeat=j)]
                ending = [(e, True) for e in ending]
                prefixes = [(extend(h, p), False) for h in range(len(hyps))
                            for p in itertools.product(words, repeat=j + 1)]
                ranked = sorted(ending + prefixes, key=lambda c: -c[0][1])[:beam]
                for (toks, score, cums), ends in ranked:
                    if ends and score != -math.inf and len(finalized) < beam:
                        finalized.append((toks, score / len(toks) ** lenpen, cums))
                if len(finalized) >= beam:
                    done = True
                    break
            if done or step + K > max_len:
                break
            conts = [extend(h, p) for h in range(len(hyps)) for p in itertools.product(words, repeat=K)]
            hyps = sorted(conts, key=lambda c: -c[1])[:beam]
            step += K
        finalized.sort(key=lambda f: -f[1])
        results.append(finalized)
    return results


def _tiny_batch(bsz, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(TINY_DICT.nspecial, len(TINY_DICT), (bsz, 5), generator=g)
    src[:, -1] = TINY_DICT.eos()
    src_lengths = torch.full((bsz,), 5)
    if bsz > 1:
        src[-1, :2] = TINY_DICT.pad()
        src_lengths[-1] = 3
    return src, src_lengths


@pytest.mark.parametrize("K,beam", [(2, 2), (2, 3), (3, 2), (3, 3), (2, 1), (3, 1), (1, 3)])
@pytest.mark.parametrize("step", ["enumerated", "pruned"])
def test_group_beam_search_equals_brute_force_enumeration(K, beam, step, monkeypatch):
    """The search keeps the exact top-B K-word continuations (and finalises exactly the hypotheses that end in
    a group and rank in the top B at their length): equal to enumerating every continuation of every
    hypothesis, on a 6-symbol vocabulary. beam 1 is the greedy loop. Every group step: the rank-tuple
    enumeration (the default for K > 1) and the position-by-position prune (beams too wide for the enumeration);
    K = 1 takes fairseq's beam search step (``_beam_search``)."""
    if step == "pruned":
        monkeypatch.setattr(SATSequenceGenerator, "ENUMERATE_MAX_CANDIDATES", 0)
    ran = set()
    for method in ("_enumerated_group", "_pruned_group", "_beam_search"):
        own = getattr(SATSequenceGenerator, method)
        monkeypatch.setattr(SATSequenceGenerator, method,
                            lambda self, *a, _own=own, _name=method: ran.add(_name) or _own(self, *a))
    checked_lengths = set()
    for seed in range(4):
        m = _tiny_sat(K, seed=100 * K + seed)
        src, src_lengths = _tiny_batch(3, seed)
        for lenpen, min_len, max_len, unkpen in ((1.0, 1, 7, 0.3), (0.6, 3, 8, 0.0)):
            gen = SATSequenceGenerator([m], TINY_DICT, beam_size=beam, len_penalty=lenpen, max_len_a=0,
                                       max_len_b=max_len, min_len=min_len, unk_penalty=unkpen)
            ours = gen.generate([m], _sample(src, src_lengths))
            ref = _brute_force_group_search(m, src, src_lengths, K, beam, max_len, min_len, lenpen, unkpen)
            for s, (hs, rs) in enumerate(zip(ours, ref)):
                what = f"K={K} beam={beam} seed={seed} lenpen={lenpen} sentence {s}"
                assert len(hs) == len(rs), what
                for h, (toks, score, cums) in zip(hs, rs):
                    assert h["tokens"].tolist() == toks, what
                    assert abs(float(h["score"]) - score) < 1e-4, what
                    pos = torch.tensor(cums)
                    pos[1:] = pos[1:] - pos[:-1].clone()
                    assert_close(h["positional_scores"], pos.float(), 1e-4, what)
                    checked_lengths.add(len(toks) % max(K, 2))
    assert len(checked_lengths) > 1  # hypotheses ending at different positions of a group were compared
    # the step under test is the one that ran (the greedy loop has none; K = 1 is fairseq's beam search)
    expected = "_beam_search" if K == 1 else "_enumerated_group" if step == "enumerated" else "_pruned_group"
    assert ran == (set() if beam == 1 else {expected})


@pytest.mark.parametrize("B,K", [(1, 3), (2, 2), (3, 4), (4, 6), (5, 3)])
def test_rank_tuples_are_those_with_a_product_of_at_most_the_beam(B, K):
    gen = _gen([sat_model(K, seed=1)], beam_size=B)
    ranks, lengths, length_list = gen._rank_tuples(B, K, torch.device("cpu"))
    got = {tuple(r[:L]) for r, L in zip(ranks.tolist(), length_list)}
    want = {t for L in range(K + 1) for t in itertools.product(range(B), repeat=L)
            if math.prod(r + 1 for r in t) <= B}
    assert got == want and len(got) == ranks.size(0) and lengths.tolist() == length_list
    assert (B, K) != (4, 6) or ranks.size(0) == 105  # the figure in the module docstring


@pytest.mark.parametrize("K,beam", [(2, 4), (4, 4), (6, 4), (3, 5), (2, 6)])
def test_enumerated_and_pruned_group_steps_agree(K, beam, monkeypatch):
    """The two group steps on a larger model and vocabulary, hypotheses that end inside groups included."""
    src, src_lengths, _, _ = _batch(bsz=4, src_len=6, seed=K)
    opts = dict(beam_size=beam, len_penalty=0.8, max_len_a=0, max_len_b=11, min_len=2)
    ends = set()
    for seed in range(3):
        for eos_boost in (1.0, 2.0):
            m = sat_model(K, seed=20 + K + seed, eos_boost=eos_boost)
            with monkeypatch.context() as patch:  # the default step must be the enumeration here
                patch.setattr(SATSequenceGenerator, "_pruned_group", None)
                enumerated = _gen([m], **opts).generate([m], _sample(src, src_lengths))
            with monkeypatch.context() as patch:
                patch.setattr(SATSequenceGenerator, "ENUMERATE_MAX_CANDIDATES", 0)
                pruned = _gen([m], **opts).generate([m], _sample(src, src_lengths))
            _same_hypos(enumerated, pruned, f"K={K} beam={beam} seed={seed} eos_boost={eos_boost}", atol=1e-5)
            ends |= {len(h["tokens"]) % K for hs in enumerated for h in hs}
    assert K not in (2, 4, 6) or len(ends) > 1  # hypotheses ended at different positions of a group


@pytest.mark.parametrize("K,beam", [(2, 3), (3, 2), (4, 4), (1, 4), (3, 1)])
def test_batch_equals_one_sentence_at_a_time(K, beam):
    m = sat_model(K, seed=K)
    src, src_lengths, _, _ = _batch(bsz=4, src_len=6, seed=K)
    gen = _gen([m], beam_size=beam, len_penalty=0.8, max_len_a=0, max_len_b=9, min_len=2, unk_penalty=0.5)
    batch = gen.generate([m], _sample(src, src_lengths))
    calls = gen.decoder_calls
    longest = 0
    for b in range(src.size(0)):
        n_pad = int(src[b].eq(DICT.pad()).sum())
        one = gen.generate([m], _sample(src[b: b + 1, n_pad:], src_lengths[b: b + 1]))
        _same_hypos(one, batch[b: b + 1], f"K={K} beam={beam} sentence {b}", atol=1e-5)
        longest = max(longest, max(len(h["tokens"]) for h in one[0]))
    # one decoder call per group: the batch runs until its longest finalised hypothesis
    assert calls <= math.ceil(longest / K) and calls >= 1


def test_top_b_equals_topk():
    """The chunked top-B of the beam: the values of ``topk`` (the indices too where no two values tie), rows
    with a tail shorter than a chunk, NaN first, all -inf rows, and short rows (plain ``topk``)."""
    from fairseq_ext.sat.generator import top_b
    g = torch.Generator().manual_seed(0)
    for V in (8000, 8003, 64 * 16, 100):
        for B in (1, 4, 5):
            x = torch.randn(3, 2, V, generator=g)
            x[0, 1, :-3] = -math.inf  # the best words in the tail
            x[2, 0, :] = -math.inf
            vals, idx = top_b(x, B)
            ref_vals, ref_idx = x.topk(B, dim=-1)
            assert torch.equal(vals, ref_vals), (V, B)
            finite = ref_vals.isfinite().all(-1)
            assert torch.equal(idx[finite], ref_idx[finite]), (V, B)
            assert torch.equal(x.gather(-1, idx), vals) and bool((idx < V).all())
            x[1, 1, V // 2] = float("nan")
            vals, idx = top_b(x, B)
            assert vals[1, 1, 0].isnan() and int(idx[1, 1, 0]) == V // 2


def test_greedy_choice_of_many_rows_equals_topk(monkeypatch):
    """The greedy choice takes its best two words per position through chunked_topk from 2 rows x positions on: the
    values, words and near-tie flags of ``topk``'s (words where the best is unique), a NaN chosen first, an exact
    tie flagged; scripted and as Python alike."""
    from fairseq_ext.sat import step_rules

    greedy_step = step_rules.scripted()[0]  # scripted before chunked_topk is wrapped below
    assert isinstance(greedy_step, torch.jit.ScriptFunction)
    calls = []
    chunked = step_rules.chunked_topk
    monkeypatch.setattr(step_rules, "chunked_topk", lambda *a: calls.append(1) or chunked(*a))
    g = torch.Generator().manual_seed(0)
    V, margin = 7840, 2e-5
    for N, K in ((1, 1), (1, 2), (3, 1), (64, 1), (8, 4)):
        calls.clear()
        lprobs = torch.log_softmax(torch.randn(N, K, V, generator=g) * 3, dim=-1)
        lprobs[0, 0, V - 1] = lprobs[0, 0].max() + 1.0  # the best word in the tail after the last chunk
        if N > 1:
            lprobs[1, 0, 7] = lprobs[1, 0, 9] = lprobs[1, 0].max() + 0.5  # an exact tie: a near-tie
            lprobs[N - 1, K - 1, 100] = float("nan")
        best_lp, best, near = step_rules._greedy_choice(lprobs, margin)
        assert bool(calls) == (N * K >= 2), (N, K)
        ref = lprobs.topk(2, dim=-1)
        torch.testing.assert_close(best_lp, ref.values[..., 0], rtol=0, atol=0, equal_nan=True)
        unique = (ref.values[..., 0] != ref.values[..., 1]) & ref.values[..., 0].isfinite()
        assert torch.equal(best[unique], ref.indices[..., 0][unique])
        assert torch.equal(near, (ref.values[..., 0] - ref.values[..., 1] < margin).any(dim=1))
        if N > 1:
            assert bool(near[1]) and best_lp[N - 1, K - 1].isnan() and int(best[N - 1, K - 1]) == 100
        assert int(best[0, 0]) == V - 1
        bias, cum = torch.zeros(1, V), torch.zeros(N, 8)
        tokens = torch.zeros(N, 2 * K + 8, dtype=torch.long)
        logits = lprobs.clone()
        out_s = greedy_step(logits, bias, 2, tokens.clone(), cum.clone(), None, None, 0, margin)
        out_p = step_rules._greedy_step(logits, bias, 2, tokens.clone(), cum.clone(), None, None, 0, margin)
        assert torch.equal(out_s[1], out_p[1])


def test_beam_candidates_of_long_rows_equal_topks(monkeypatch):
    """The K = 1 beam's top 2B + 1 over a sentence's P x V scores goes through chunked_topk for long rows: the same
    candidates as ``topk`` over the flat scores (values; parents and words where no two values tie), with a tail
    shorter than a chunk, the best words in the tail, a NaN first; scripted and as Python alike."""
    from fairseq_ext.sat import step_rules

    # this torch scripts every rule (a function TorchScript refuses falls back to Python with one log line only)
    rules = step_rules.scripted()
    assert all(isinstance(f, torch.jit.ScriptFunction) for f in rules)
    calls = []
    chunked = step_rules.chunked_topk
    monkeypatch.setattr(step_rules, "chunked_topk", lambda *a: calls.append(1) or chunked(*a))
    g = torch.Generator().manual_seed(0)
    n, P, B, V, eos = 3, 4, 4, 8003, 2
    k = 2 * B
    lprobs = torch.log_softmax(torch.randn(n * P, 1, V, generator=g) * 3, dim=-1)
    lprobs[4:8, 0, : V - 2] = -math.inf  # sentence 1: its best words in the tail
    lprobs[9, 0, 100] = float("nan")
    scores = torch.randn(n * P, generator=g)
    flat = (lprobs.view(n, P, V) + scores.view(n, P, 1)).view(n, P * V)
    ref_vals, ref_i = flat.topk(k + 1, dim=1)
    cand_sc, parents, words, finite_eos, near = step_rules._top_candidates(lprobs, scores, n, P, k, B, eos, 2e-5)
    assert calls, "a beam of 4 over 8,003 words takes the chunked top-k"
    assert torch.equal(cand_sc[[0, 1]], ref_vals[[0, 1], :k]) and cand_sc[2, 0].isnan()
    assert torch.equal(cand_sc[0], ref_vals[0, :k]) and torch.equal(parents[0] * V + words[0], ref_i[0, :k])
    assert torch.equal(flat.gather(1, parents * V + words)[:2], cand_sc[:2])
    args = (lprobs[:8], torch.zeros(1, V), scores[:8], 2, P, k, B, eos, 2e-5)  # the sentences without a NaN
    script, python = rules[1](*args), step_rules._beam_candidates(*args)
    assert all(torch.equal(a, b) for a, b in zip(script, python))
    # a beam wider than the chunks of its first row (200 beams, 2 x 200 + 1 candidates, 256 chunks): topk
    wide = torch.log_softmax(torch.randn(1, 1, 256 * 64, generator=g), dim=-1)
    cand_sc, *_ = step_rules._top_candidates(wide, torch.zeros(1), 1, 1, 400, 200, eos, 2e-5)
    assert torch.equal(cand_sc, wide.view(1, -1).topk(400, dim=1).values)


@pytest.mark.parametrize("where", ["words", "eos"])
@pytest.mark.parametrize("K,beam", [(1, 1), (1, 3), (2, 1), (2, 3), (3, 2)])
def test_nan_log_probabilities_count_as_minus_infinity(K, beam, where, monkeypatch):
    """fairseq's rule, a NaN log-probability is -inf, which the searches apply only when a value they select is
    NaN: the hypotheses equal (exactly) those of the same distributions with the NaNs already -inf. NaNs in
    single words, the EOS column and a whole distribution, or in the EOS column only; the corrected path must
    have run."""
    from fairseq_ext.sat.generator import SATEnsembleModel
    m = _tiny_sat(K, seed=7 + K)
    src, src_lengths = _tiny_batch(3, seed=K)
    decode_group = SATEnsembleModel.decode_group
    corrections = []
    fix = SATSequenceGenerator._nan_to_neg_inf
    monkeypatch.setattr(SATSequenceGenerator, "_nan_to_neg_inf",
                        staticmethod(lambda t: corrections.append(1) or fix(t)))

    def run(fill):
        def poisoned(self, *a, **k):
            lprobs, attn = decode_group(self, *a, **k)
            g = torch.Generator().manual_seed(self.decoder_calls)
            mask = torch.rand(lprobs.shape, generator=g) < (0.15 if where == "words" else 0.0)
            mask[:, :, TINY_DICT.eos()] |= torch.rand(lprobs.shape[:2], generator=g) < 0.3
            mask[0, -1, TINY_DICT.eos()] = True
            if where == "words":
                mask[-1, -1] = True
            return lprobs.masked_fill(mask, fill), attn
        monkeypatch.setattr(SATEnsembleModel, "decode_group", poisoned)
        # the searches' op-by-op rules (the static step's scripted rules: the next test)
        gen = SATSequenceGenerator([m], TINY_DICT, beam_size=beam, max_len_a=0, max_len_b=7, min_len=1,
                                   static_step=False)
        return gen.generate([m], _sample(src, src_lengths))

    expected = run(-math.inf)
    assert not corrections
    got = run(float("nan"))
    assert corrections  # a selected value was NaN, and the step was redone
    _same_hypos(got, expected, f"K={K} beam={beam}", atol=0.0)
    assert all(math.isfinite(float(h["score"])) for hs in got for h in hs)


@pytest.mark.parametrize("K,beam", [(1, 1), (1, 3), (2, 1), (3, 1)])
def test_scripted_rules_count_nan_log_probabilities_as_minus_infinity(K, beam, monkeypatch):
    """On the static step the rules and the choice are scripted (fairseq_ext/sat/step_rules.py): NaN logits (a
    whole distribution NaN) give the hypotheses of the op-by-op rules on the same distributions at -inf, and the
    corrected path runs."""
    from fairseq_ext.sat.generator import SATEnsembleModel
    m = _tiny_sat(K, seed=7 + K)
    src, src_lengths = _tiny_batch(3, seed=K)
    corrections = []
    fix = SATSequenceGenerator._nan_to_neg_inf
    monkeypatch.setattr(SATSequenceGenerator, "_nan_to_neg_inf",
                        staticmethod(lambda t: corrections.append(1) or fix(t)))

    def rows(self, n):
        mask = torch.rand(n, generator=torch.Generator().manual_seed(self.decoder_calls)) < 0.3
        mask[-1] = self.decoder_calls == 2
        return mask.view(n, 1, 1)

    def generate():
        gen = SATSequenceGenerator([m], TINY_DICT, beam_size=beam, max_len_a=0, max_len_b=7, min_len=1)
        return gen, gen.generate([m], _sample(src, src_lengths))

    decode_logits, decode_group = SATEnsembleModel.decode_logits, SATEnsembleModel.decode_group

    def nan_logits(self, *a, **k):
        logits, attn = decode_logits(self, *a, **k)
        return logits.masked_fill(rows(self, logits.size(0)), float("nan")), attn
    monkeypatch.setattr(SATEnsembleModel, "decode_logits", nan_logits)
    gen, got = generate()
    assert gen.model.step_name == "static" and corrections

    def minus_inf(self, *a, **k):
        lprobs, attn = decode_group(self, *a, **k)
        return lprobs.masked_fill(rows(self, lprobs.size(0)), -math.inf), attn
    monkeypatch.setattr(SATEnsembleModel, "decode_group", minus_inf)
    monkeypatch.setattr(SATSequenceGenerator, "_scripted_rules", lambda self, device: None)
    _, expected = generate()
    assert [len(hs) for hs in got] == [len(hs) for hs in expected]
    for x, y in zip(itertools.chain(*got), itertools.chain(*expected)):  # scores -inf (and NaN steps) alike
        assert x["tokens"].tolist() == y["tokens"].tolist()
        for key in ("score", "positional_scores"):
            torch.testing.assert_close(x[key], y[key], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_greedy_k_words_per_call(K):
    m = sat_model(K, seed=10 + K)
    src, src_lengths, _, _ = _batch(bsz=4, src_len=6, seed=3)
    opts = dict(beam_size=1, len_penalty=1.3, max_len_a=1.0, max_len_b=5, min_len=3, unk_penalty=0.2)
    fast = _gen([m], **opts)
    ours = fast.generate([m], _sample(src, src_lengths))
    # the same search through the group beam search with B = 1
    with torch.inference_mode():
        group = fast._group_beam_search(_sample(src, src_lengths))
    _same_hypos(ours, group, f"greedy K={K}", attention=True)
    # and the argmax of full forward passes
    ref = _reference_search(m, src, src_lengths, 1, max_len=int(1.0 * src.size(1) + 5), min_len=3,
                            lenpen=1.3, unkpen=0.2)
    for h, r in zip(ours, ref):
        assert h[0]["tokens"].tolist() == r[0][0]
    # ceil(len / K) decoder calls for one sentence at a time
    for b in range(src.size(0)):
        hyp = fast.generate([m], _sample(src[b: b + 1], src_lengths[b: b + 1]))[0][0]
        assert fast.decoder_calls == math.ceil(len(hyp["tokens"]) / K), (b, len(hyp["tokens"]))


def test_nbest_alignment_and_hypothesis_fields():
    m = sat_model(2)
    src, src_lengths, _, _ = _batch(bsz=2, src_len=5)
    gen = _gen([m], beam_size=3, max_len_b=8, print_alignment="hard")
    out = gen.generate([m], _sample(src, src_lengths))
    for hs in out:
        assert len(hs) == 3
        assert [float(h["score"]) for h in hs] == sorted([float(h["score"]) for h in hs], reverse=True)
        for h in hs:
            assert h["tokens"][-1].item() == DICT.eos() and DICT.pad() not in h["tokens"].tolist()
            assert h["positional_scores"].shape == h["tokens"].shape
            assert h["attention"].shape == (src.size(1), len(h["tokens"]))
            assert len(h["alignment"]) > 0 and all(len(pair) == 2 for pair in h["alignment"])


def test_misuse_fails_clearly():
    m = sat_model(3)
    src, src_lengths, _, _ = _batch(bsz=2, src_len=5)
    with pytest.raises(FairseqExtError, match="translation_sat"):  # fairseq's one-token-per-step generator
        SequenceGenerator([m], DICT, beam_size=2).generate([m], _sample(src, src_lengths))
    with pytest.raises(FairseqExtError, match="ensemble"):
        _gen([m, m], beam_size=2)
    with pytest.raises(FairseqExtError, match="--sat-group-size"):
        SATModel.build_model(_args("sat_transformer", 0), _Task())
    with pytest.raises(FairseqExtError, match="--prefix-size"):
        _gen([m], beam_size=2).generate([m], _sample(src, src_lengths), prefix_tokens=src[:, :1])
    with pytest.raises(FairseqExtError, match="--match-source-len"):
        _gen([m], beam_size=2, match_source_len=True)
    with pytest.raises(FairseqExtError, match="--no-repeat-ngram-size"):
        _gen([m], beam_size=2, no_repeat_ngram_size=2)


def test_k1_no_repeat_ngram_equals_fairseq():
    sat = sat_model(1)
    ref = transformer_with_weights_of(sat)
    src, src_lengths, _, _ = _batch(bsz=3, src_len=6)
    opts = dict(beam_size=3, max_len_a=0, max_len_b=10, min_len=6, no_repeat_ngram_size=2)
    ours = _gen([sat], **opts).generate([sat], _sample(src, src_lengths))
    theirs = SequenceGenerator([ref], DICT, **opts).generate([ref], _sample(src, src_lengths))
    _same_hypos(ours, theirs, "no-repeat-ngram 2")  # fairseq's blocker on fairseq's token buffer


# --------------------------------------------------------------------------------------------------------
# command line: fairseq-train / -generate / -interactive with --user-dir, init, hub, analysis, recipes

TINY = TINY_SHARED_CLI  # tests/helpers.py


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fairseq transformer teacher, and a SAT K=2 student initialised from it, trained with --eval-bleu."""
    d = str(tmp_path_factory.mktemp("sat_cli"))
    create_dummy_data(d, num_examples=80, maxlen=12)
    preprocess_translation_data(d, ["--joined-dictionary"])
    teacher_dir, sat_dir = os.path.join(d, "teacher"), os.path.join(d, "sat2")
    train_translation_model(d, "transformer", TINY + ["--save-dir", teacher_dir])
    teacher = os.path.join(teacher_dir, "checkpoint_last.pt")
    proc = train_translation_model(d, "sat_transformer", TINY + [
        "--save-dir", sat_dir, "--sat-group-size", "2", "--sat-init-from", teacher,
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--eval-bleu", "--eval-bleu-args", '{"beam": 2, "max_len_b": 6}',
    ], task="translation_sat")
    return {"data": d, "teacher": teacher, "sat": os.path.join(sat_dir, "checkpoint_last.pt"),
            "train_log": proc.stdout + proc.stderr}


def test_cli_train_init_from_transformer_and_eval_bleu(trained):
    log = trained["train_log"]
    assert re.search(r"sat_transformer: initialised \d+ tensors from .*teacher/checkpoint_last.pt", log)
    assert re.search(r'"valid_bleu": "[0-9.]+"', log), log[-2000:]  # --eval-bleu decoded with our generator

    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([trained["sat"]])
    assert models[0].sat_group_size == 2 and type(models[0]) is SATModel
    # the checkpoint records where the weights came from, but does not ask for an initialisation any more
    assert cfg.model.sat_init_from is None and cfg.model.sat_initialised_from == trained["teacher"]
    teacher = checkpoint_utils.load_checkpoint_to_cpu(trained["teacher"])["model"]
    # rebuild the untrained student: encoder, embeddings and softmax come from the teacher, decoder is new
    cfg.model.restore_file = None  # a new training (the saved options name the run's checkpoint_last.pt)
    for with_decoder in (False, True):
        cfg.model.sat_init_from = trained["teacher"]
        cfg.model.sat_init_decoder = with_decoder
        fresh = task.build_model(cfg.model).state_dict()
        for k, v in fresh.items():
            if k.endswith(("_float_tensor", "version")) or k not in teacher:
                continue
            copied = (k.startswith("encoder.") or k in ("decoder.embed_tokens.weight",
                                                        "decoder.output_projection.weight") or with_decoder)
            assert torch.equal(v, teacher[k]) == copied, (k, with_decoder)
    # a checkpoint is rebuilt without reading --sat-init-from again (the file may be gone)
    cfg.model.sat_init_from = "/nonexistent/teacher.pt"
    task.build_model(cfg.model, from_checkpoint=True)
    cfg.model.sat_init_from = "/nonexistent/teacher.pt"
    with pytest.raises(FairseqExtError, match="--sat-init-from /nonexistent/teacher.pt"):
        task.build_model(cfg.model)
    # nor when fairseq-train is about to restore a checkpoint (--restore-file that exists)
    cfg.model.sat_init_from, cfg.model.restore_file = "/nonexistent/teacher.pt", trained["sat"]
    task.build_model(cfg.model)
    # unsupported generation options fail clearly
    for flag, value in (("sampling", True), ("prefix_size", 1), ("diverse_beam_groups", 2)):
        gen_args = argparse.Namespace(beam=2, **{flag: value})
        with pytest.raises(FairseqExtError, match="not supported by --task translation_sat"):
            task.build_generator(models, gen_args)


def test_cli_generate_and_interactive(trained):
    d = trained["data"]
    gen, inter = generate_main(d, path=trained["sat"], task="translation_sat")  # beam 3, --print-alignment
    hyps = hypotheses(gen)
    assert len(hyps) == 80
    assert len(re.findall(r"^A-\d+\t", gen, re.M)) == 80  # alignments
    assert re.search(r"^H-0\t", inter, re.M)
    greedy = run_cli("generate", [
        d, "--task", "translation_sat", "--path", trained["sat"], "--user-dir", os.path.join(ROOT, "fairseq_ext"),
        "--beam", "1", "--batch-size", "16", "--gen-subset", "valid", "--max-len-b", "5", "--num-workers", "0"]).stdout
    assert len(hypotheses(greedy)) == 80
    # the in-process generator on the same checkpoint gives the same greedy translations
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([trained["sat"]])
    task.load_dataset("valid")
    gen_obj = task.build_generator(models, argparse.Namespace(beam=1, max_len_b=5))
    first = task.dataset("valid")[0]
    sample = task.dataset("valid").collater([first])
    hyp = gen_obj.generate(models, sample)[0][0]
    text = task.target_dictionary.string(hyp["tokens"])
    assert hypotheses(greedy)[first["id"]][1] == text
    assert gen_obj.decoder_calls == math.ceil(len(hyp["tokens"]) / 2)

    # a K=2 model decoded by fairseq's own generator (--task translation) fails with one clear line
    bad = run_cli("generate", [
        d, "--task", "translation", "--path", trained["sat"], "--user-dir", os.path.join(ROOT, "fairseq_ext"),
        "--beam", "2", "--gen-subset", "valid", "--num-workers", "0"], check=False)
    assert bad.returncode != 0
    assert "--task translation_sat" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_cli_k1_generate_equals_fairseq(trained):
    """K = 1 (the teacher, a fairseq transformer) through fairseq-generate: --task translation_sat gives
    fairseq's hypotheses and scores, greedy and beam."""
    d = trained["data"]
    for beam in ("1", "3"):
        common = [d, "--path", trained["teacher"], "--user-dir", os.path.join(ROOT, "fairseq_ext"), "--beam", beam,
                  "--lenpen", "0.7", "--min-len", "2", "--batch-size", "16", "--gen-subset", "valid",
                  "--max-len-b", "8", "--num-workers", "0"]
        ours = hypotheses(run_cli("generate", common + ["--task", "translation_sat"]).stdout)
        theirs = hypotheses(run_cli("generate", common + ["--task", "translation"]).stdout)
        assert len(ours) == len(theirs) == 80
        for i, (score, text) in theirs.items():
            assert ours[i][1] == text, (beam, i)
            assert abs(ours[i][0] - score) < 1e-5, (beam, i)


@pytest.mark.slow
def test_cli_translation_task_checkpoint_needs_no_teacher(trained, tmp_path):
    """A SAT trained with --task translation --sat-init-from T is loaded by the hub,
    fairseq-validate and fairseq-generate, and its training resumes, after T is deleted."""
    import shutil

    from tests.helpers import train_args

    d = trained["data"]
    teacher = str(tmp_path / "teacher_tmp.pt")
    shutil.copy(trained["teacher"], teacher)
    save = str(tmp_path / "sat_tr")
    flags = TINY + ["--save-dir", save, "--sat-group-size", "2", "--sat-init-from", teacher]
    proc = train_translation_model(d, "sat_transformer", flags, task="translation")
    assert "sat_transformer: initialised" in proc.stdout + proc.stderr
    os.remove(teacher)
    ckpt = os.path.join(save, "checkpoint_last.pt")
    user_dir = os.path.join(ROOT, "fairseq_ext")

    hub = SATModel.from_pretrained(save, checkpoint_file="checkpoint_last.pt", data_name_or_path=d)
    assert isinstance(hub.translate("h e l l o", beam=2, max_len_b=6), str)
    run_cli("validate", [d, "--task", "translation", "--path", ckpt, "--user-dir", user_dir, "--valid-subset", "valid",
                         "--max-tokens", "500", "--num-workers", "0"])
    gen = run_cli("generate", [d, "--task", "translation_sat", "--path", ckpt, "--user-dir", user_dir, "--beam", "2",
                               "--gen-subset", "valid", "--max-len-b", "5", "--num-workers", "0"]).stdout
    assert len(hypotheses(gen)) == 80
    # resume: the same training command, whose --sat-init-from file is gone, for one more epoch
    proc = run_cli("train", train_args(d, "sat_transformer", flags, "translation", max_epoch=2))
    log = proc.stdout + proc.stderr
    assert re.search(r"Loaded checkpoint \S*checkpoint_last\.pt", log), log[-3000:]
    assert os.path.exists(os.path.join(save, "checkpoint2.pt"))
    assert "sat_transformer: initialised" not in log


def test_hub_interface(trained):
    d = trained["data"]
    hub = SATModel.from_pretrained(os.path.dirname(trained["sat"]), checkpoint_file="checkpoint_last.pt",
                                   data_name_or_path=d)
    out = hub.translate("h e l l o", beam=2, max_len_b=6)
    assert isinstance(out, str) and len(out.split()) >= 1
    greedy = hub.generate(hub.encode("h e l l o"), beam=1, max_len_b=6)[0]
    assert greedy["tokens"][-1].item() == hub.task.target_dictionary.eos()


def test_position_wise_cross_entropy_command(trained, tmp_path):
    png = str(tmp_path / "pce.png")
    proc = run_module("fairseq_ext.sat.position_ce", [
        trained["data"], "--path", trained["teacher"], "--path", trained["sat"], "--split", "valid",
        "--max-position", "8", "--png", png])
    out = proc.stdout
    assert "position\ttransformer\tsat_transformer K=2" in out
    rows = [line.split("\t") for line in out.splitlines() if re.match(r"^\d+\t", line)]
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 5
    assert all(float(c) > 0 for r in rows for c in r[1:] if c != "-")
    assert re.search(r"by position in group \(sat_transformer K=2\): 1:[0-9.]+  2:[0-9.]+", out)
    assert os.path.getsize(png) > 1000 and open(png, "rb").read(4) == b"\x89PNG"
    # the table is the mean token NLL: for position 1 it equals the NLL of the first target word computed here
    from fairseq import checkpoint_utils

    from fairseq_ext.sat.position_ce import position_ce

    K, _, ce, counts, gce = position_ce(trained["sat"], trained["data"], "valid", max_position=8)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([trained["sat"]])
    task.load_dataset("valid")
    ds = task.dataset("valid")
    batch = ds.collater([ds[i] for i in range(len(ds))])
    with torch.no_grad():
        lp = models[0].get_normalized_probs(models[0](**batch["net_input"]), log_probs=True)
    nll0 = -lp[:, 0].gather(-1, batch["target"][:, :1]).mean().item()
    assert K == 2 and abs(ce[0] - nll0) < 1e-4 and counts[0] == len(ds)
    assert abs(float(rows[0][2]) - ce[0]) < 1e-4


def test_distill_turns_teacher_output_into_a_corpus(tmp_path):
    from fairseq_ext.sat.distill import distill

    (tmp_path / "src.de").write_text("a b\nc d e\nf\n")
    (tmp_path / "gen.txt").write_text(
        "S-2\tf\nH-2\t-0.5\tF1\nD-2\t-0.5\tF1\nH-2\t-0.9\tF2\n"  # the first H line of a sentence is the best
        "S-0\ta b\nH-0\t-0.1\tA B\n"  # sentence 1 was skipped by the teacher
    )
    kept, dropped = distill(str(tmp_path / "gen.txt"), str(tmp_path / "src.de"), str(tmp_path / "kd" / "train"),
                            "de", "en")
    assert (kept, dropped) == (2, 1)
    assert (tmp_path / "kd" / "train.de").read_text() == "a b\nf\n"
    assert (tmp_path / "kd" / "train.en").read_text() == "A B\nF1\n"
    with pytest.raises(FairseqExtError, match="--source"):
        distill(str(tmp_path / "gen.txt"), str(tmp_path / "missing.de"), str(tmp_path / "x"), "de", "en")


@pytest.mark.parametrize("recipe", ["wmt14_en_de", "iwslt14_de_en"])
def test_recipe_dry_run(recipe, tmp_path):
    import subprocess

    proc = subprocess.run(["bash", os.path.join(ROOT, "recipes", "sat", f"{recipe}.sh"), "--dry-run",
                           "--workdir", str(tmp_path / "w")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmds = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert not os.path.exists(tmp_path / "w")  # nothing ran
    kinds = [c.split()[1] if c.split()[1] != "python" else c.split()[3] for c in cmds]
    # teacher, average, KD decode + corpus + binarise, 3 x (student, average), 4 models x 2 beams x 2 runs
    assert kinds[:5] == ["fairseq-train", "fairseq_ext.average_checkpoints", "fairseq-generate",
                         "fairseq_ext.sat.distill", "fairseq-preprocess"]
    assert kinds[5:11] == ["fairseq-train", "fairseq_ext.average_checkpoints"] * 3
    assert kinds[11:] == ["fairseq-generate"] * 16
    assert "--task translation --arch transformer_" in cmds[0]
    assert "--gen-subset train" in cmds[2] and "--srcdict" in cmds[4]
    for K, c in zip((2, 4, 6), cmds[5:11:2]):
        assert "--task translation_sat --arch sat_transformer_" in c and f"--sat-group-size {K} " in c
        assert "--sat-init-from" in c and "data-bin-kd" in c
    evals = cmds[11:]
    assert sum("--beam 4 " in c for c in evals) == 8 and sum("--beam 1 " in c for c in evals) == 8
    assert sum("--batch-size 1 " in c for c in evals) == 8


def test_position_wise_cross_entropy_command_refuses_labels_that_do_not_match_paths(capsys):
    """A --label per --path: a mismatch is one line naming the flag and exit status 1, not a traceback."""
    from fairseq_ext.sat import position_ce

    assert position_ce.main(["data", "--path", "a.pt", "--path", "b.pt", "--label", "only one"]) == 1
    err = capsys.readouterr().err
    assert "--label must be given once per --path" in err and "Traceback" not in err
