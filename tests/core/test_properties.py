"""Property-based tests (hypothesis) on tiny random models built in-process.

Over random group sizes K, beam sizes, length penalties, source lengths and batch compositions (left-padded
sources of different lengths):

* the SAT generator's hypotheses are sorted by score, each score is the length-normalised sum of its
  positional scores (sum / len ** lenpen), each ends in exactly one EOS, and the decoder is called
  ceil(len / K) times for the longest hypothesis;
* the relaxed causal mask is the paper's M[i][j] = 1 iff j < (floor(i/K) + 1) * K, for any first query row;
* incremental decoding equals the full pass (1e-5) for fconv_glu, sat_transformer, msc_transformer and
  bert_jam (tiny random BERT).

Deterministic in CI: derandomize=True and no example database.
"""

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fairseq_ext  # noqa: F401  (registers the plugin)

from fairseq_ext.sat.generator import SATSequenceGenerator
from fairseq_ext.sat.model import relaxed_causal_mask, sat_decoder_input
from tests.helpers import assert_close

PROFILE = dict(database=None, derandomize=True, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random_batch(data, dictionary, max_bsz=4, max_src=8, min_src=1, letters=None):
    """Left-padded sources of random lengths (each ends in EOS), as fairseq's collater makes them."""
    bsz = data.draw(st.integers(1, max_bsz), label="bsz")
    lengths = data.draw(st.lists(st.integers(min_src, max_src), min_size=bsz, max_size=bsz), label="src lengths")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    g = torch.Generator().manual_seed(seed)
    T = max(lengths) + 1
    src = torch.full((bsz, T), dictionary.pad())
    for b, n in enumerate(lengths):
        if letters is None:
            words = torch.randint(dictionary.nspecial, len(dictionary), (n,), generator=g)
        else:
            words = torch.tensor([letters[int(i)] for i in torch.randint(0, len(letters), (n,), generator=g)])
        src[b, T - n - 1: T - 1] = words
        src[b, T - 1] = dictionary.eos()
    return src, torch.tensor([n + 1 for n in lengths]), g


# ------------------------------------------------------------------------------------------------ SAT


@functools.lru_cache(maxsize=None)
def _sat(K, seed):
    from tests.builders import sat_model

    return sat_model(K, seed=seed)


@settings(max_examples=25, **PROFILE)
@given(K=st.integers(1, 4), beam=st.integers(1, 4), lenpen=st.sampled_from([0.6, 1.0, 1.5]),
       max_len_b=st.integers(1, 9), seed=st.integers(0, 2), data=st.data())
def test_sat_generator_hypotheses(K, beam, lenpen, max_len_b, seed, data):
    from tests.builders import SAT_DICT as DICT

    model = _sat(K, seed)
    src, src_lengths, _ = _random_batch(data, DICT)
    gen = SATSequenceGenerator([model], DICT, beam_size=beam, len_penalty=lenpen, max_len_a=0,
                               max_len_b=max_len_b, min_len=1)
    out = gen.generate([model], {"id": torch.arange(src.size(0)),
                                 "net_input": {"src_tokens": src, "src_lengths": src_lengths}})
    assert len(out) == src.size(0)
    longest = 0
    for hyps in out:
        assert len(hyps) == beam
        scores = [float(h["score"]) for h in hyps]
        assert scores == sorted(scores, reverse=True)
        for h in hyps:
            toks = h["tokens"].tolist()
            assert toks[-1] == DICT.eos() and toks.count(DICT.eos()) == 1, toks
            assert DICT.pad() not in toks and 1 <= len(toks) <= max_len_b + 1
            assert h["positional_scores"].shape == h["tokens"].shape
            expected = float(h["positional_scores"].double().sum()) / len(toks) ** lenpen
            assert abs(float(h["score"]) - expected) <= 1e-4 * max(1.0, abs(expected)), (h["score"], expected)
            longest = max(longest, len(toks))
    assert gen.decoder_calls == math.ceil(longest / K), (gen.decoder_calls, longest, K)


@settings(max_examples=60, **PROFILE)
@given(K=st.integers(1, 8), n=st.integers(1, 24), data=st.data())
def test_relaxed_mask_is_the_papers_formula(K, n, data):
    first = data.draw(st.integers(0, n - 1), label="first query")
    mask = relaxed_causal_mask(first, n, K, torch.zeros(1))
    assert mask.shape == (n - first, n)
    assert set(mask.unique().tolist()) <= {0.0, float("-inf")}
    expected = torch.tensor([[j < (i // K + 1) * K for j in range(n)] for i in range(first, n)])
    assert torch.equal(mask.eq(0), expected)


# ------------------------------------------------------------------------------------------------ incremental


def _step_by_step(decoder, prev, enc, sizes):
    """Outputs of the decoder fed prefixes growing by ``sizes`` positions, concatenated."""
    state, outs, attns, end = {}, [], [], 0
    for k in sizes:
        end += k
        out, extra = decoder(prev[:, :end], enc, incremental_state=state)
        outs.append(out[:, -k:])
        attn = extra["attn"][0] if isinstance(extra, dict) else extra
        if attn is not None:
            attns.append(attn[:, -k:])
    return torch.cat(outs, 1), (torch.cat(attns, 1) if attns else None)


def _check_incremental(model, src, src_lengths, prev, sizes, what):
    with torch.no_grad():
        enc = model.encoder(src, src_lengths)
        full, extra = model.decoder(prev, enc)
        full_attn = extra["attn"][0] if isinstance(extra, dict) else extra
        inc, inc_attn = _step_by_step(model.decoder, prev, enc, sizes)
    assert_close(inc, full, 1e-5, f"{what}: incremental vs full")
    if full_attn is not None and inc_attn is not None:
        assert_close(inc_attn, full_attn, 1e-5, f"{what}: attention")


def _prev(g, dictionary, bsz, tgt_len, letters=None):
    if letters is None:
        prev = torch.randint(dictionary.nspecial, len(dictionary), (bsz, tgt_len), generator=g)
    else:
        prev = torch.tensor(letters)[torch.randint(0, len(letters), (bsz, tgt_len), generator=g)]
    prev[:, 0] = dictionary.eos()
    return prev


@functools.lru_cache(maxsize=None)
def _fconv(config):
    from tests.builders import FCONV_ODD_SPEC as ODD_SPEC, FconvTask as _Task, fconv_pair as _pair

    task = _Task()
    _, model = _pair(task, **({} if config == "iwslt" else ODD_SPEC))
    return model.eval(), task.source_dictionary


@settings(max_examples=8, **PROFILE)
@given(config=st.sampled_from(["iwslt", "odd_spec"]), tgt_len=st.integers(1, 7), data=st.data())
def test_incremental_equals_full_fconv_glu(config, tgt_len, data):
    model, d = _fconv(config)
    src, lengths, g = _random_batch(data, d)
    _check_incremental(model, src, lengths, _prev(g, d, src.size(0), tgt_len), [1] * tgt_len, f"fconv_glu {config}")


@settings(max_examples=10, **PROFILE)
@given(K=st.integers(1, 4), learned=st.booleans(), groups=st.integers(1, 4), data=st.data())
def test_incremental_equals_full_sat_transformer(K, learned, groups, data):
    from tests.builders import SAT_DICT as DICT, sat_model

    model = sat_model(K, learned=learned)
    src, lengths, g = _random_batch(data, DICT)
    tgt_len = data.draw(st.integers(1, groups * K), label="target length")
    prev = sat_decoder_input(_prev(g, DICT, src.size(0), tgt_len), K, DICT.eos())  # whole groups of K
    # steps of one or more whole groups (the generator's step is one group)
    n_groups = prev.size(1) // K
    sizes, left = [], n_groups
    while left:
        k = data.draw(st.integers(1, left), label="groups per step")
        sizes.append(k * K)
        left -= k
    _check_incremental(model, src, lengths, prev, sizes, f"sat K={K}")


@functools.lru_cache(maxsize=None)
def _msc(name):
    from tests.builders import msc_build as build, msc_flags as _flags

    model, d = build(extra=_flags(name))
    return model.eval(), d


@settings(max_examples=8, **PROFILE)
@given(name=st.sampled_from(["msc", "uneven_blocks", "plain"]), tgt_len=st.integers(1, 7), data=st.data())
def test_incremental_equals_full_msc_transformer(name, tgt_len, data):
    model, d = _msc(name)
    src, lengths, g = _random_batch(data, d)
    _check_incremental(model, src, lengths, _prev(g, d, src.size(0), tgt_len), [1] * tgt_len, f"msc {name}")


@pytest.fixture(scope="module")
def tiny_bert_jam(tmp_path_factory):
    from tests.builders import bert_jam_build as build, write_tiny_bert

    bert = write_tiny_bert(str(tmp_path_factory.mktemp("props_bert")))
    models = {}
    for composition in ("glu", "last"):
        model, d = build(bert, phase=2, composition=composition)
        model.eval()
        with torch.no_grad():  # non-trivial GLUs
            for comp in model.compositions():
                for p in comp.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
        models[composition] = model
    letters = [d.index(c) for c in "abcdefghijklmnopqrstuvwxyz"]
    return models, d, letters


@settings(max_examples=6, **PROFILE)
@given(composition=st.sampled_from(["glu", "last"]), tgt_len=st.integers(1, 6), data=st.data())
def test_incremental_equals_full_bert_jam(tiny_bert_jam, composition, tgt_len, data):
    models, d, letters = tiny_bert_jam
    src, lengths, g = _random_batch(data, d, max_src=10, letters=letters)
    _check_incremental(models[composition], src, lengths, _prev(g, d, src.size(0), tgt_len, letters),
                       [1] * tgt_len, f"bert_jam {composition}")
