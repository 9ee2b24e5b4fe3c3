"""The static decoder step (fairseq_ext/inference/static_step.py) and the default generator of --task translation
(fairseq_ext/inference/default_generator.py): incremental == full pass (1e-5) for fairseq's transformer decoder and
the SAT's, across length buckets and with padded sources; reorders with permutations and with rows that share a
source; the generator's hypotheses equal fairseq's; the fallbacks say why in one line; and, through fairseq-generate
on the Acts test, the default path's output equals fairseq's own generator's, token for token."""

import argparse
import copy
import logging

import pytest
import torch
from fairseq.models.transformer import TransformerModel
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks.translation import TranslationTask

import fairseq_ext  # noqa: F401  (registers the plugin and the default generator)
from fairseq_ext.inference import default_generator
from fairseq_ext.inference import static_encoder
from fairseq_ext.inference import static_step as ss
from fairseq_ext.inference.static_encoder import encoder_refusal, static_encode
from fairseq_ext.inference.speedups import apply_speedups
from fairseq_ext.sat.generator import SATSequenceGenerator
from tests.builders import SAT_DICT as DICT
from tests.builders import SatTask, msc_build, sat_args, sat_model, sat_sample
from tests.helpers import ROOT, assert_close, hypotheses, run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def transformer(seed=0, learned=False, normalize_before=False):
    torch.manual_seed(seed)
    args = sat_args("transformer", learned=learned, decoder_normalize_before=normalize_before,
                    encoder_normalize_before=normalize_before)
    m = TransformerModel.build_model(args, SatTask()).eval()
    with torch.no_grad():
        m.decoder.output_projection.weight[DICT.eos()] *= 2.0
    return m


def batch(bsz=3, src_len=9, tgt_len=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(DICT.nspecial, len(DICT), (bsz, src_len), generator=g)
    src[:, -1] = DICT.eos()
    src[0, :3] = DICT.pad()  # a left-padded shorter source
    lengths = (src != DICT.pad()).sum(1)
    prev = torch.randint(DICT.nspecial, len(DICT), (bsz, tgt_len), generator=g)
    prev[:, 0] = DICT.eos()
    return src, lengths, prev


MODELS = {
    "transformer": lambda: transformer(),
    "transformer pre-norm, learned positions": lambda: transformer(learned=True, normalize_before=True),
    "sat K=2": lambda: sat_model(2),
    "sat K=3 learned": lambda: sat_model(3, learned=True),
}


def full_pass(m, src, lengths, prev):
    """fairseq's full pass: log-probabilities and the alignment attention."""
    with torch.no_grad():
        logits, extra = m.decoder(prev, encoder_out=m.encoder(src, lengths))
    return m.get_normalized_probs((logits, extra), log_probs=True), extra["attn"][0]


def static_pass(m, src, lengths, prev, order=None, at=None):
    """The log-probabilities and attention of every position of ``prev`` through static calls of K positions; with
    ``order``, the state is reordered by it before position ``at`` (and ``prev`` follows)."""
    dec = m.decoder
    K = int(getattr(dec, "group_size", 1))
    graph = ss.step_graph(dec)
    with torch.no_grad():
        enc = m.encoder(src, lengths)
        state = ss.StaticState(dec, enc, src.size(0))
        outs, atts = [], []
        for first in range(0, prev.size(1), K):
            if order is not None and first == at:
                state.reorder(order)
                outs = [o.index_select(0, order) for o in outs]
                atts = [a.index_select(0, order) for a in atts]
                prev = prev.index_select(0, order)
            logits, attn = ss.static_call(graph, state, prev[:, first: first + K], first)
            outs.append(logits)
            atts.append(attn)
    return torch.cat(outs, 1), torch.cat(atts, 1)


@pytest.mark.parametrize("name", list(MODELS))
def test_static_step_equals_the_full_pass_across_length_buckets(name):
    m = MODELS[name]()
    assert ss.static_refusal(m.decoder) is None
    K = int(getattr(m.decoder, "group_size", 1))
    src, lengths, prev = batch(tgt_len=2 * ss.LENGTH_BUCKET + 2 * K)  # three buckets, cache grown twice
    lprobs, attn = static_pass(m, src, lengths, prev)
    full, full_attn = full_pass(m, src, lengths, prev)
    assert_close(lprobs, full, atol=1e-5)
    assert_close(attn, full_attn, atol=1e-5)


@pytest.mark.parametrize("name", ["transformer", "sat K=2"])
def test_static_state_reorders_with_a_permutation(name):
    assert_reorders(MODELS[name]())


def assert_reorders(m):
    """The static step of ``m`` with its state reordered by a permutation midway equals the full pass."""
    K = int(getattr(m.decoder, "group_size", 1))
    src, lengths, prev = batch(bsz=4, tgt_len=12 * K)
    order = torch.tensor([2, 0, 3, 1])
    lprobs, attn = static_pass(m, src, lengths, prev, order=order, at=5 * K)
    full, full_attn = full_pass(m, src[order], lengths[order], prev[order])
    assert_close(lprobs, full, atol=1e-5)
    assert_close(attn, full_attn, atol=1e-5)


def test_static_state_keeps_one_source_per_beam_and_selects_sources_when_sentences_leave():
    m = MODELS["transformer"]()
    src, lengths, prev = batch(bsz=3, tgt_len=10)
    B = 2
    expand = torch.arange(3).repeat_interleave(B)  # the first step's expansion to the beam: rows 0,0,1,1,2,2
    with torch.no_grad():
        enc = m.encoder(src, lengths)
        state = ss.StaticState(m.decoder, enc, 3)
        ss.static_call(ss.step_graph(m.decoder), state, prev[:, :1], 0)
        state.reorder(expand)
        assert state.rows_per_source == B and state.src_k.size(1) == 3  # the sources are not copied per row
        state.reorder(torch.tensor([1, 0, 2, 2, 5, 4]))  # within each sentence's beam: sources kept
        assert state.rows_per_source == B and state.src_k.size(1) == 3
        state.reorder(torch.tensor([4, 5]))  # sentences 0 and 1 left: source 2 only
        assert state.rows_per_source == B and state.src_k.size(1) == 1
        assert torch.equal(state.src_bias, torch.zeros(1, 1, 1, src.size(1)))  # source 2 has no padding


def test_static_step_takes_int8_projections_and_matches_the_int8_lean_step():
    m = apply_speedups(transformer(), "int8-decoder")
    assert ss.static_refusal(m.decoder) is None
    src, lengths, _ = batch(bsz=5)
    sample = sat_sample(src, lengths)
    for beam in (1, 3):
        static = SATSequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12)
        lean = SATSequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12, static_step=False)
        a, b = static.generate([m], sample), lean.generate([m], sample)
        assert [h[0]["tokens"].tolist() for h in a] == [h[0]["tokens"].tolist() for h in b]


def test_static_refusal_names_what_it_does_not_compute():
    m = transformer()
    m.decoder.output_projection = torch.nn.utils.parametrizations.weight_norm(m.decoder.output_projection)
    assert "neither a float nn.Linear" in ss.static_refusal(m.decoder)

    class OwnSoftmax(type(m.decoder)):
        def get_normalized_probs(self, net_output, log_probs, sample=None):
            return super().get_normalized_probs(net_output, log_probs, sample)

    m = transformer()
    m.decoder.__class__ = OwnSoftmax
    assert "its own get_normalized_probs" in ss.static_refusal(m.decoder)
    normformer = TransformerModel.build_model(sat_args("transformer", scale_attn=True), SatTask())
    assert "NormFormer" in ss.static_refusal(normformer.decoder)


def test_graph_is_made_again_when_a_weight_or_module_changes():
    m = transformer()
    g = ss.step_graph(m.decoder)
    assert ss.step_graph(m.decoder) is g
    src, lengths, prev = batch(tgt_len=4)
    with torch.no_grad():
        m.decoder.output_projection.weight.mul_(0.5)
    g2 = ss.step_graph(m.decoder)
    assert g2 is not g
    lprobs, _ = static_pass(m, src, lengths, prev)
    assert_close(lprobs, full_pass(m, src, lengths, prev)[0], atol=1e-5)
    apply_speedups(m, "int8-decoder")  # the modules replaced in place: the float graph must not be reused
    step = ss.step_graph(m.decoder)
    int8_modules = list(step.graph.int8.children())
    assert step is not g2 and len(int8_modules) == 12  # 6 a layer: q/k/v fused, out, cq, co, fc1, fc2



@pytest.mark.parametrize("normalize_before", [False, True])
def test_traced_encoder_equals_fairseqs_encoder_with_and_without_padding_and_after_a_weight_change(
        normalize_before):
    """The static path's encoder (fairseq_ext/inference/static_encoder.py) is fairseq's own code traced: its output
    is fairseq's bit for bit, for padded and unpadded batches (one trace each) at several shapes, and it follows a
    weight changed in place."""
    m = transformer(normalize_before=normalize_before, learned=normalize_before)
    enc = m.encoder

    def check(src):
        net_input = {"src_tokens": src, "src_lengths": src.ne(DICT.pad()).sum(1)}
        with torch.no_grad():
            got, expected = static_encode(enc, net_input), enc.forward_torchscript(net_input)
        for key in ("encoder_out", "encoder_padding_mask", "encoder_embedding", "src_lengths"):
            assert torch.equal(got[key][0], expected[key][0]), key
        return got["encoder_out"][0]

    shapes = [(3, 9), (1, 5), (4, 23)]
    for bsz, src_len in shapes:
        src, _, _ = batch(bsz=bsz, src_len=src_len, seed=src_len)
        check(src)  # row 0 left-padded when bsz > 1
        check(src[-1:])  # no padding
    assert len(static_encoder._TRACES[enc][1]) == 2  # one trace per branch of fairseq's code, for every shape
    src, _, _ = batch()
    before = check(src)
    with torch.no_grad():
        enc.layers[0].fc1.weight.mul_(1.5)
    assert not torch.equal(check(src), before)
    seen = []  # a forward hook runs: the encoder itself runs while one is on it
    handle = enc.layers[-1].register_forward_hook(lambda module, inputs, output: seen.append(1))
    check(src)
    handle.remove()
    assert len(seen) == 2  # the static path's call and fairseq's
    assert encoder_refusal(enc) is None
    assert "own forward" in encoder_refusal(msc_build()[0].encoder)

# -- the generators ------------------------------------------------------------------------------------------
def gen_args(**kw):
    base = dict(beam=3, nbest=1, max_len_a=0, max_len_b=12, min_len=1, lenpen=1.0, unkpen=0.0, temperature=1.0,
                no_repeat_ngram_size=0, unnormalized=False, sampling=False, print_alignment=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("beam", [1, 3])
def test_sat_generator_on_the_static_step_gives_the_lean_steps_hypotheses(beam):
    for m in (sat_model(2), transformer()):
        src, lengths, _ = batch(bsz=5)
        sample = sat_sample(src, lengths)
        static = SATSequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12)
        lean = SATSequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12, static_step=False)
        a = static.generate([m], sample)
        assert m.encoder in static_encoder._TRACES  # the encoder ran as fairseq's code traced
        b = lean.generate([m], sample)
        with torch.inference_mode():
            assert static.model.step_name == "static" and lean.model.step_name == "lean"
        for ha, hb in zip(a, b):
            assert [h["tokens"].tolist() for h in ha] == [h["tokens"].tolist() for h in hb]
            assert_close(torch.stack([h["score"] for h in ha]), torch.stack([h["score"] for h in hb]), atol=1e-5)



@pytest.mark.parametrize("beam", [1, 3])
def test_a_search_of_more_rows_than_static_max_rows_takes_the_lean_step_with_the_same_hypotheses(beam, monkeypatch):
    """Above STATIC_MAX_ROWS rows a call (sentences x beam) a search runs on the lean step; one row fewer than the
    search takes it off the static step, the bound itself keeps it there; the hypotheses are the same."""
    from fairseq_ext.sat import generator as generator_module
    lean_calls = []
    real = generator_module.lean_step
    monkeypatch.setattr(generator_module, "lean_step", lambda *a: lean_calls.append(1) or real(*a))
    m = transformer()
    src, lengths, _ = batch(bsz=5)
    sample = sat_sample(src, lengths)
    outs = {}
    for bound in (5 * beam, 5 * beam - 1):
        gen = SATSequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12)
        assert gen.model.static_max_rows == generator_module.STATIC_MAX_ROWS
        gen.model.static_max_rows = bound
        lean_calls.clear()
        outs[bound] = gen.generate([m], sample)
        with torch.inference_mode():
            assert gen.model.step_name == ("static" if bound == 5 * beam else "lean")
        assert bool(lean_calls) == (bound < 5 * beam)
    for ha, hb in zip(outs[5 * beam], outs[5 * beam - 1]):
        assert [h["tokens"].tolist() for h in ha] == [h["tokens"].tolist() for h in hb]
        assert_close(torch.stack([h["score"] for h in ha]), torch.stack([h["score"] for h in hb]), atol=1e-5)
    # a decoder the lean step refuses (MSC's) stays on the static step at any width
    msc, d = msc_build()
    msc.eval()
    src = torch.randint(d.nspecial, len(d), (5, 7), generator=torch.Generator().manual_seed(3))
    src[:, -1] = d.eos()
    gen = SATSequenceGenerator([msc], d, beam_size=beam, max_len_a=0, max_len_b=12)
    gen.model.static_max_rows = 0
    gen.generate([msc], sat_sample(src, torch.full((5,), 7)))
    with torch.inference_mode():
        assert gen.model.step_name == "static"


@pytest.mark.parametrize("beam", [1, 4])
def test_scripted_rules_and_op_by_op_rules_give_the_same_hypotheses_and_can_alternate(beam, monkeypatch):
    """The static step's searches run fairseq's rules as scripted functions up to SCRIPTED_MAX_ROWS rows a step and
    op by op above: the hypotheses and scores are the same bit for bit whichever runs, and a search that crosses
    the bound mid-way (sentences leave) switches without a trace."""
    from fairseq_ext.sat import generator as generator_module
    from fairseq_ext.sat import step_rules
    m = transformer()
    src, lengths, _ = batch(bsz=6, src_len=7, seed=3)
    sample = sat_sample(src, lengths)
    calls = {"decode_logits": 0, "decode_group": 0}
    for name in calls:
        real = getattr(generator_module.SATEnsembleModel, name)
        monkeypatch.setattr(generator_module.SATEnsembleModel, name,
                            lambda self, *a, _real=real, _name=name, **k: calls.__setitem__(_name, calls[_name] + 1)
                            or _real(self, *a, **k))
    outs = {}
    for bound in (0, 5, 10 ** 6):  # never, crossed mid-search, always
        monkeypatch.setattr(step_rules, "SCRIPTED_MAX_ROWS", bound)
        calls.update(decode_logits=0, decode_group=0)
        gen = SATSequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12)
        outs[bound] = gen.generate([m], sample)
        assert gen.model.step_name == "static"
        assert (calls["decode_logits"] > 0) == (bound > 0) and (calls["decode_group"] > 0) == (bound < 10 ** 6)
    for bound in (5, 10 ** 6):
        for ha, hb in zip(outs[0], outs[bound]):
            assert [h["tokens"].tolist() for h in ha] == [h["tokens"].tolist() for h in hb]
            for key in ("score", "positional_scores", "attention"):
                for a, b in zip(ha, hb):
                    assert torch.equal(a[key], b[key]), key

class _Task(TranslationTask):
    def __init__(self):  # only what build_generator reads
        self.src_dict = self.tgt_dict = DICT
        self.cfg = argparse.Namespace()


@pytest.mark.parametrize("beam", [1, 3])
def test_a_sentence_with_a_near_tie_is_decoded_again_by_fairseqs_generator(beam, monkeypatch):
    """--task translation's generator stands in for fairseq's: a sentence where two candidates that decide a step,
    or two finished hypotheses, are closer than TIE_MARGIN is decoded again by fairseq's generator on its rows of
    the batch. A margin of 0 sends none there, a huge one every sentence (then the outputs are fairseq's bit for
    bit); the default sends none of these (no tie)."""
    from fairseq_ext.sat import step_rules
    m = transformer()
    src, lengths, _ = batch(bsz=5)
    sample = sat_sample(src, lengths)
    ref = SequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12).generate([m], sample)
    for margin, redone in ((0.0, 0), (step_rules.TIE_MARGIN, 0), (1e9, 5)):
        monkeypatch.setattr(step_rules, "TIE_MARGIN", margin)
        gen = _Task().build_generator([m], gen_args(beam=beam))
        with torch.no_grad():
            out = gen.generate([m], sample)
        assert gen.near_tie_sentences == redone
        if redone:  # fairseq-generate --remove-bpe adds the words it prints to the target dictionary meanwhile
            grown = copy.deepcopy(DICT)
            task = _Task()
            task.tgt_dict = grown
            gen = task.build_generator([m], gen_args(beam=beam))
            for i in range(9):
                grown.add_symbol(f"printed{i}")
            with torch.no_grad():
                assert [[h["tokens"].tolist() for h in hs] for hs in gen.generate([m], sample)] == [
                    [h["tokens"].tolist() for h in hs] for hs in out]
        for ha, hb in zip(out, ref):
            assert [h["tokens"].tolist() for h in ha] == [h["tokens"].tolist() for h in hb]
            if redone:
                assert all(torch.equal(a["positional_scores"], b["positional_scores"]) for a, b in zip(ha, hb))


def test_near_ties_count_only_the_candidates_whose_order_decides_the_beam_step():
    """Of the top 2B + 1 candidates: any two of the first B + 1 (which EOS are finalised, in which order) and the
    B-th that is not a finite EOS with the next (which hypotheses go on); the others may swap freely."""
    from fairseq_ext.sat.step_rules import _near_ties
    B, margin = 4, 1e-3
    values = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -6.0001, -8.0, -9.0]])  # a tie at candidates 5, 6
    no_eos = torch.zeros(1, 8, dtype=torch.bool)
    assert not _near_ties(values, no_eos, B, margin)
    two_eos = no_eos.clone()
    two_eos[0, 1] = two_eos[0, 3] = True  # the 4th non-EOS is candidate 5: its order with 6 decides
    assert _near_ties(values, two_eos, B, margin)
    for i in range(B):  # any two of the first B + 1
        tied = values.clone()
        tied[0, i + 1] = tied[0, i]
        assert _near_ties(tied, no_eos, B, margin)
    assert not _near_ties(values, no_eos, B, 0.5e-4)


@pytest.mark.parametrize("beam", [1, 3])
def test_translation_task_decodes_with_the_static_step_and_fairseqs_hypotheses(beam, caplog):
    m = transformer()
    src, lengths, _ = batch(bsz=5)
    sample = sat_sample(src, lengths)
    with caplog.at_level(logging.INFO, logger="fairseq_ext"):
        gen = _Task().build_generator([m], gen_args(beam=beam))
    assert isinstance(gen, SATSequenceGenerator)
    assert "decoding with the static decoder step" in caplog.text
    ref = SequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12)
    with torch.no_grad():
        ours, theirs = gen.generate([m], sample), ref.generate([m], sample)
    for ha, hb in zip(ours, theirs):
        assert [h["tokens"].tolist() for h in ha] == [h["tokens"].tolist() for h in hb]
        for x, y in zip(ha, hb):
            assert_close(x["score"], y["score"], atol=1e-5)
            assert_close(x["positional_scores"], y["positional_scores"], atol=1e-5)


def test_default_generator_hands_a_call_with_prefix_tokens_to_fairseqs(caplog):
    m = transformer()
    src, lengths, _ = batch(bsz=2)
    sample = sat_sample(src, lengths)
    gen = _Task().build_generator([m], gen_args(beam=2))
    prefix = torch.full((2, 1), DICT.nspecial + 1)
    with caplog.at_level(logging.INFO, logger="fairseq_ext"):
        out = gen.generate([m], sample, prefix_tokens=prefix)
    assert "this call is decoded by fairseq's SequenceGenerator" in caplog.text
    ref = SequenceGenerator([m], DICT, beam_size=2, max_len_a=0, max_len_b=12).generate([m], sample,
                                                                                      prefix_tokens=prefix)
    assert [h[0]["tokens"].tolist() for h in out] == [h[0]["tokens"].tolist() for h in ref]
    assert all(h[0]["tokens"][0] == DICT.nspecial + 1 for h in out)


@pytest.mark.parametrize("case, expect", [
    ("print_alignment", "--print-alignment"),
    ("sampling", "--sampling"),
    ("ensemble", "an ensemble of 2 models"),
    ("env", "FAIRSEQ_EXT_STOCK_GENERATOR is set"),
    ("own softmax", "its own get_normalized_probs"),
    ("sat", "a SAT decoder (K > 1)"),
])
def test_translation_task_falls_back_to_fairseqs_generator_with_one_line(case, expect, caplog, monkeypatch):
    models = [transformer()]
    args = gen_args()
    if case == "print_alignment":
        args.print_alignment = "hard"
    elif case == "sampling":
        args.sampling = True
    elif case == "ensemble":
        models.append(transformer(seed=1))
    elif case == "env":
        monkeypatch.setenv(default_generator.OFF, "1")
    elif case == "own softmax":
        class OwnSoftmax(TransformerModel):
            def get_normalized_probs(self, net_output, log_probs, sample=None):
                return super().get_normalized_probs(net_output, log_probs, sample)
        models[0].__class__ = OwnSoftmax
    elif case == "sat":
        models = [sat_model(2)]
    with caplog.at_level(logging.INFO, logger="fairseq_ext"):
        gen = _Task().build_generator(models, args)
    assert not isinstance(gen, SATSequenceGenerator)
    lines = [r.getMessage() for r in caplog.records if r.name == "fairseq_ext"]
    assert len(lines) == 1 and "fairseq's SequenceGenerator" in lines[0] and expect in lines[0], lines


# -- fairseq-generate on the Acts test: the default path against fairseq's own generator -------------------------
def _first_verses(acts_bin, n, out):
    """The first ``n`` verses of the Acts test binarised as ``acts_bin`` is (its encoded text beside it)."""
    import os
    import subprocess
    import sys
    text = os.path.join(os.path.dirname(acts_bin), "acts-text")
    for lang in ("de", "en"):
        with open(os.path.join(text, f"test.spm.{lang}"), encoding="utf-8") as f:
            lines = f.readlines()[:n]
        with open(os.path.join(out, f"test.spm.{lang}"), "w", encoding="utf-8") as g:
            g.writelines(lines)
    d = os.path.join(acts_bin, "dict.de.txt")
    subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en",
                    "--testpref", os.path.join(out, "test.spm"), "--destdir", os.path.join(out, "bin"),
                    "--srcdict", d, "--tgtdict", d, "--workers", "1"], check=True, capture_output=True)
    return os.path.join(out, "bin")


# batch 64: the search's rules op by op at most steps, all verses; batch 4: scripted (step_rules.SCRIPTED_MAX_ROWS),
# the first 250 verses (a quarter of the time)
@pytest.mark.parametrize("release, batch_size", [("transformer", 64), ("msc_transformer", 64), ("transformer", 4)])
@pytest.mark.parametrize("beam", [1, 4])
def test_fairseq_generate_default_path_equals_fairseqs_generator_on_all_acts_verses(acts_bin, beam, release,
                                                                                       batch_size, tmp_path):
    verses = 1003 if batch_size == 64 else 250
    data = acts_bin if verses == 1003 else _first_verses(acts_bin, verses, str(tmp_path))
    argv = [data, "--user-dir", "fairseq_ext", "--path", f"{ROOT}/releases/bible-de-en/{release}.pt",
            "--gen-subset", "test", "--beam", str(beam), "--batch-size", str(batch_size), "--no-progress-bar"]
    ours = run_cli("generate", argv)
    stock = run_cli("generate", argv, env={default_generator.OFF: "1"})
    assert "decoding with the static decoder step" in ours.stderr
    assert "fairseq's SequenceGenerator: FAIRSEQ_EXT_STOCK_GENERATOR is set" in stock.stderr
    a, b = hypotheses(ours.stdout), hypotheses(stock.stdout)
    assert len(a) == verses and a.keys() == b.keys()
    assert [a[i][1] for i in sorted(a)] == [b[i][1] for i in sorted(b)]
    assert max(abs(a[i][0] - b[i][0]) for i in a) < 1e-3  # scores printed to 4 decimals


@pytest.mark.parametrize("beam", [1, 4])
def test_sat_static_step_equals_its_lean_step_on_all_acts_verses(acts_bin, beam):
    argv = [acts_bin, "--user-dir", "fairseq_ext", "--task", "translation_sat",
            "--path", f"{ROOT}/releases/bible-de-en/sat_transformer_k2.pt",
            "--gen-subset", "test", "--beam", str(beam), "--batch-size", "64", "--no-progress-bar"]
    static, lean = run_cli("generate", argv), run_cli("generate", argv + ["--no-static-step"])
    assert "decoder step: static" in static.stderr and "decoder step: lean" in lean.stderr
    a, b = hypotheses(static.stdout), hypotheses(lean.stdout)
    assert len(a) == 1003 and [a[i][1] for i in sorted(a)] == [b[i][1] for i in sorted(b)]


@pytest.mark.parametrize("name", ["msc", "add_fusion", "no_contextual", "no_block_scale", "uneven_blocks"])
def test_static_step_equals_the_full_pass_for_msc_decoders(name):
    """msc_transformer's decoder declares its memories (block n, the context C^n fused by the gate): the static
    step computes it, incremental == full pass, and its greedy / beam hypotheses equal fairseq's generator's."""
    from tests.builders import msc_flags

    m, d = msc_build(extra=msc_flags(name))
    m.eval()
    assert ss.static_refusal(m) is None
    g = torch.Generator().manual_seed(3)
    src = torch.randint(d.nspecial, len(d), (3, 7), generator=g)
    src[:, -1] = d.eos()
    src[0, :2] = d.pad()
    lengths = (src != d.pad()).sum(1)
    prev = torch.randint(d.nspecial, len(d), (3, 2 * ss.LENGTH_BUCKET + 3), generator=g)
    prev[:, 0] = d.eos()
    lprobs, attn = static_pass(m, src, lengths, prev)
    full, full_attn = full_pass(m, src, lengths, prev)
    assert_close(lprobs, full, atol=1e-5)
    assert_close(attn, full_attn, atol=1e-5)
    sample = sat_sample(src, lengths)
    for beam in (1, 3):
        ours = SATSequenceGenerator([m], d, beam_size=beam, max_len_a=0, max_len_b=10)
        ref = SequenceGenerator([m], d, beam_size=beam, max_len_a=0, max_len_b=10)
        a = ours.generate([m], sample)
        with torch.no_grad():
            b = ref.generate([m], sample)
        assert ours.model.step_name == "static"
        assert [h[0]["tokens"].tolist() for h in a] == [h[0]["tokens"].tolist() for h in b]
