"""The static step compiled ahead of time (fairseq_ext/inference/aot_step.py): the background compile writes a
package that later searches take; the compiled graph equals the full pass (1e-5) across length buckets, with padded
sources, one row or a beam of rows per source, and reorders with permutations; the generators' hypotheses on it
equal fairseq's; a second load takes the package from the cache without compiling; a damaged package, a failed
compile, no C++ compiler and a bad FAIRSEQ_EXT_STEP_CAPTURE each say so in one line or a clear error. Slow: each
model compiles for ~30-60 s."""

import copy
import logging
import os

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.inference import aot_step
from fairseq_ext.inference import static_step as ss
from fairseq_ext.sat import search_graph, step_rules
from fairseq_ext.sat.generator import SATSequenceGenerator
from tests.builders import SAT_DICT as DICT
from tests.builders import sat_model, sat_sample
from tests.helpers import assert_close
from tests.inference.test_static_step import assert_reorders, batch, full_pass, static_pass, transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
slow = pytest.mark.slow  # the tests that take the compiled models


@pytest.fixture(scope="module")
def aot_env(tmp_path_factory):
    """FAIRSEQ_EXT_STEP_CAPTURE=aot with a cache of the module's own."""
    cache = str(tmp_path_factory.mktemp("aot-cache"))
    mp = pytest.MonkeyPatch()
    mp.setenv(aot_step.CAPTURE, "aot")
    mp.setenv(aot_step.CACHE, cache)
    yield cache
    mp.undo()


@pytest.fixture(scope="module")
def compiled(aot_env):
    """A transformer and a SAT K=2 whose steps were compiled in the background, waited for."""
    models = {"transformer": transformer(), "sat K=2": sat_model(2)}
    for m in models.values():
        step = ss.step_graph(m.decoder)
        assert isinstance(step.compiled, aot_step.Pending) and step.capture == "trace"  # decodes at once, traced
        assert step.compiled.wait() is not None, open(step.compiled.path[:-4] + ".log").read()[-3000:]
        assert ss.step_graph(m.decoder).capture == "aot"  # the next search takes the package
    return models


@slow
@pytest.mark.parametrize("name", ["transformer", "sat K=2"])
@pytest.mark.parametrize("bsz, src_len", [(3, 9), (1, 2)])
def test_compiled_step_equals_the_full_pass_across_length_buckets(compiled, name, bsz, src_len):
    m = compiled[name]
    K = int(getattr(m.decoder, "group_size", 1))
    src, lengths, prev = batch(bsz=bsz, src_len=src_len, tgt_len=2 * ss.LENGTH_BUCKET + 2 * K)
    if bsz == 1:  # one short source alone, no padding (greedy at batch 1: one row, one source)
        src = torch.randint(DICT.nspecial, len(DICT), (1, src_len), generator=torch.Generator().manual_seed(5))
        src[0, -1], lengths = DICT.eos(), torch.tensor([src_len])
    assert ss.step_graph(m.decoder).capture == "aot"
    lprobs, attn = static_pass(m, src, lengths, prev)
    full, full_attn = full_pass(m, src, lengths, prev)
    assert_close(lprobs, full, atol=1e-5)
    assert_close(attn, full_attn, atol=1e-5)


@slow
@pytest.mark.parametrize("name", ["transformer", "sat K=2"])
def test_compiled_step_reorders_with_a_permutation(compiled, name):
    assert ss.step_graph(compiled[name].decoder).capture == "aot"
    assert_reorders(compiled[name])


@slow
def test_compiled_step_serves_rows_that_share_a_source(compiled):
    """A beam: 4 rows per source (the source keys kept once per source), two sources, then one left."""
    m = compiled["transformer"]
    src, lengths, prev = batch(bsz=2, tgt_len=10)
    rows = torch.arange(2).repeat_interleave(4)
    with torch.no_grad():
        enc = m.encoder(src, lengths)
        state = ss.StaticState(m.decoder, enc, 8)
        out = torch.cat([ss.static_call(ss.step_graph(m.decoder), state, prev[rows][:, i: i + 1], i)[0]
                         for i in range(6)], 1)
    full, _ = full_pass(m, src[rows], lengths[rows], prev[rows][:, :6])
    assert state.rows_per_source == 4
    assert_close(out, full, atol=1e-5)


@slow
@pytest.mark.parametrize("beam", [1, 3])
def test_generator_on_the_compiled_step_gives_fairseqs_hypotheses(compiled, beam):
    m = compiled["transformer"]
    ours, a, b = ours_and_fairseqs(m, beam)
    assert ours.model.step_name == "static" and ss.step_graph(m.decoder).capture == "aot"
    assert a == b


def ours_and_fairseqs(m, beam, min_len=1):
    """Our generator and the hypotheses (token lists) of it and of fairseq's on three sentences."""
    src, lengths, _ = batch(bsz=3, src_len=9)
    sample = sat_sample(src, lengths)
    ours = SATSequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12, min_len=min_len)
    ref = SequenceGenerator([m], DICT, beam_size=beam, max_len_a=0, max_len_b=12, min_len=min_len)
    a = ours.generate([m], sample)
    with torch.no_grad():
        b = ref.generate([m], sample)
    return ours, [h[0]["tokens"].tolist() for h in a], [h[0]["tokens"].tolist() for h in b]


@slow
def test_another_decoder_with_the_same_weights_loads_the_package_without_compiling(compiled, aot_env):
    twin = copy.deepcopy(compiled["transformer"])
    step = ss.step_graph(twin.decoder)
    assert isinstance(step.compiled, aot_step.AOTGraph) and step.capture == "aot"
    assert len([f for f in os.listdir(os.path.join(aot_env, "static_step")) if f.endswith(".pt2")]) == 2
    with torch.no_grad():  # a changed weight is another model: not this package
        twin.decoder.layers[0].fc1.weight[0, 0] += 1e-3
    module = ss.StepGraph(twin.decoder)
    example = ss.example_inputs(module, twin.decoder)
    assert aot_step.package_key(module, example) != aot_step.package_key(ss.StepGraph(
        compiled["transformer"].decoder), example)


@slow
def test_key_holds_the_cpu_capability(compiled, monkeypatch):
    dec = compiled["transformer"].decoder
    module = ss.StepGraph(dec)
    example = ss.example_inputs(module, dec)
    here = aot_step.package_key(module, example)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "NO_AVX")
    assert aot_step.package_key(module, example) != here


def test_damaged_package_is_removed_and_a_failed_compile_is_not_retried(aot_env, monkeypatch, caplog):
    m = transformer(seed=7)
    module = ss.aot_module(ss.StepGraph(m.decoder).eval())  # as step_graph makes it
    example = ss.example_inputs(module, m.decoder, N=6, B=3, S=7, T=3 * ss.LENGTH_BUCKET)
    key = os.path.join(aot_env, "static_step", aot_step.package_key(module, example))
    os.makedirs(os.path.dirname(key), mode=0o700, exist_ok=True)
    with open(key + ".pt2", "wb") as f:
        f.write(b"not a package")
    monkeypatch.setenv("CXX", "no-such-compiler")
    with caplog.at_level(logging.INFO, logger="fairseq_ext.inference.aot_step"):
        step = ss.step_graph(m.decoder)
    assert step.compiled is None and step.capture == "trace" and not os.path.exists(key + ".pt2")
    assert "does not load" in caplog.text and "no C++ compiler (no-such-compiler)" in caplog.text
    open(key + ".failed", "w").close()
    monkeypatch.delenv("CXX")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fairseq_ext.inference.aot_step"):
        assert aot_step.start(module, example) is None
    assert "failed earlier" in caplog.text and not os.path.exists(key + ".lock")


def test_capture_modes_and_a_bad_one(monkeypatch):
    m = transformer(seed=3)
    monkeypatch.setenv(aot_step.CAPTURE, "trace")
    assert ss.step_graph(m.decoder).capture == "trace" and ss.step_graph(m.decoder).compiled is None
    monkeypatch.setenv(aot_step.CAPTURE, "eager")
    assert ss.step_graph(copy.deepcopy(m).decoder).capture == "eager"
    monkeypatch.setenv(aot_step.CAPTURE, "jit")
    with pytest.raises(FairseqExtError, match="FAIRSEQ_EXT_STEP_CAPTURE='jit': use one of aot, trace, eager"):
        aot_step.mode()


@slow
def test_calls_of_few_positions_take_the_compiled_graph(compiled):
    step = ss.step_graph(compiled["transformer"].decoder)
    assert step.graph_for(ss.AOT_MAX_POSITIONS) is step.compiled
    assert step.graph_for(ss.AOT_MAX_POSITIONS + 1) is step.graph


@pytest.mark.parametrize("sums", [True, False])
def test_the_compiled_modules_explicit_attention_equals_the_fused_kernel(sums):
    """The module AOTInductor compiles (aot_module) computes attention in three operations, its two products as
    sums (the default) or batched products, the traced one calls PyTorch's fused kernel: the same step (1e-5) with
    masked cache positions and a padded source; the decoder's own module is left as it was."""
    m = transformer(seed=3)
    module = ss.StepGraph(m.decoder).eval()
    explicit = ss.aot_module(module) if sums else ss.aot_module(module, attention_sums=False)
    assert explicit.explicit_attention and not module.explicit_attention and explicit.layers is module.layers
    assert explicit.attention_sums == sums and not module.attention_sums
    g = torch.Generator().manual_seed(1)
    example = [t.clone() for t in ss.example_inputs(module, m.decoder, N=6, B=3, S=7, T=ss.LENGTH_BUCKET)]
    for i in (2, 3, 4, 5):
        example[i] = torch.randn(example[i].shape, generator=g)
    example[6][1, ..., 5:] = float("-inf")  # source 1 is padded
    example[1] = torch.tensor([9])
    with torch.no_grad():
        fused = module(*[t.clone() for t in example])
        ours = explicit(*[t.clone() for t in example])
    assert_close(ours[0], fused[0], atol=1e-5)
    assert_close(ours[1], fused[1], atol=1e-5)


# -- the searches' graphs (fairseq_ext.sat.search_graph.py) ----------------------------------------------------
def search_graphs(m, beam=0, margin=0.0):
    """The compiled greedy (beam 0) or beam graph of ``m``'s step: started (in the background) and waited for."""
    step = ss.step_graph(m.decoder)
    args = (step, m.decoder, DICT.eos(), margin)
    search_graph.ready(*args, beam=beam)
    search_graph.wait(step)
    graph = search_graph.ready(*args, beam=beam)
    assert isinstance(graph, aot_step.AOTGraph)
    return step, graph


@slow
@pytest.mark.parametrize("name", ["transformer", "sat K=2"])
def test_greedy_graph_equals_the_step_the_projection_and_the_scripted_rules(compiled, name):
    """Two rows, one padded source, a cache with positions before: the compiled greedy step gives the
    log-probabilities of the three calls it replaces (1e-5), the same words, status and caches."""
    m = compiled[name]
    K = int(getattr(m.decoder, "group_size", 1))
    step, graph = search_graphs(m)
    src, lengths, prev = batch(bsz=2, tgt_len=3 * K)
    bias = step_rules.rule_bias(torch.zeros(1, len(DICT)), DICT.eos(), 0, K, 100, 0).expand(K, -1).contiguous()
    bias[:, DICT.pad()] = float("-inf")
    results = []
    for fused in (False, True):
        with torch.no_grad():
            state = ss.StaticState(m.decoder, m.encoder(src, lengths), 2)
            ss.static_logits(step, state, prev[:, :K], 0)  # a first group, through the step
            if fused:
                lprobs, best_lp, best, status, attn = search_graph.greedy_call(graph, state, prev[:, K: 2 * K], K,
                                                                               bias)
            else:
                logits, attn = ss.static_logits(step, state, prev[:, K: 2 * K], K)
                lprobs, best_lp, best, status = step_rules._greedy_pick(logits, bias, DICT.eos(),
                                                                        0.0)
        results.append((lprobs, best_lp, best, status, attn, state.k.clone(), state.v.clone()))
    (lp0, b0, w0, s0, a0, k0, v0), (lp1, b1, w1, s1, a1, k1, v1) = results
    assert_close(lp1, lp0, atol=1e-5)
    assert_close(b1, b0, atol=1e-5)
    assert_close(a1, a0, atol=1e-5)
    assert_close(k1, k0, atol=1e-5) and assert_close(v1, v0, atol=1e-5)
    assert torch.equal(w1, w0) and torch.equal(s1, s0)


@slow
def test_beam_graph_equals_the_scripted_candidates_and_advance(compiled):
    """Two sentences of a beam of 3 over logits with an EOS among the best: the compiled candidates equal the scripted
    ones (scores 1e-5; parents, words, EOS flags, active rows and status exactly), and its advance the scripted
    advance of those candidates with both sentences kept (rows, buffers written at the step)."""
    step, graph = search_graphs(compiled["transformer"], beam=3)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 1, len(DICT), generator=g)
    logits[1, 0, DICT.eos()] = 8.0
    scores = -torch.rand(6, generator=g)
    bias = torch.zeros(1, len(DICT))
    bias[0, DICT.pad()] = float("-inf")
    k = 6
    tokens = torch.randint(4, 50, (6, 10), generator=g)
    cum, attn, step_attn = torch.randn(6, 9, generator=g), torch.rand(6, 5, 9, generator=g), torch.rand(6, 1, 5)
    step = 4
    rules = step_rules.scripted()
    ref = rules[1](logits, bias, scores, 2, 3, k, 3, DICT.eos(), 0.0)
    _, cand_sc, parents, words, _, active, _ = ref
    base = torch.arange(2).unsqueeze(1) * 3
    ref = ref + rules[2](tokens, cum, attn, step_attn, cand_sc, parents, words, active, base, torch.tensor([step]))
    ours = graph.run(logits, bias, scores, tokens, cum, attn, step_attn, torch.tensor(step))
    assert len(ours) == len(ref) == 12
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a.is_floating_point():
            assert_close(a, b, atol=1e-5)
        else:
            assert torch.equal(a, b), i


@slow
@pytest.mark.parametrize("beam", [1, 3])
def test_generator_on_the_searches_graphs_gives_fairseqs_hypotheses(compiled, beam, monkeypatch):
    """The default generator with its search's graph ready takes it at every step but the beam's first (the beam:
    its advance too, at every step where no sentence is done), and decodes fairseq's hypotheses."""
    m = compiled["transformer"]
    step, _ = search_graphs(m, beam=0 if beam == 1 else beam)
    calls, advances = [], []
    real = aot_step.AOTGraph.run if beam > 1 else search_graph.greedy_call
    if beam > 1:
        monkeypatch.setattr(aot_step.AOTGraph, "run", lambda self, *a: calls.append(1) or real(self, *a))
        greedy, candidates, advance = step_rules.scripted()
        monkeypatch.setattr(step_rules, "scripted", lambda: (greedy, candidates,
                                                             lambda *a: advances.append(1) or advance(*a)))
    else:
        monkeypatch.setattr(search_graph, "greedy_call", lambda *a: calls.append(1) or real(*a))
    ours, a, b = ours_and_fairseqs(m, beam, min_len=6)  # (this random model ends a search in 3 steps without)
    assert a == b
    assert len(calls) == ours.model.decoder_calls - (beam > 1)
    if beam > 1:  # the scripted advance after the first step (one row a sentence) and where a sentence left, the
        # graph's at every other step
        assert 1 < len(advances) < len(calls) - 2


@slow
def test_a_search_graph_compile_names_the_graph_and_what_runs_meanwhile(compiled, monkeypatch, caplog):
    """Its log lines say which graph compiles and that the search runs its scripted rules until then (not the
    step's "decoding on the traced step"); a graph that cannot compile leaves the search as it was (None)."""
    m = compiled["transformer"]
    step = ss.step_graph(m.decoder)
    failed = []

    def no_compiler():
        failed.append(1)
        return "no C++ compiler (g++) on PATH"

    monkeypatch.setattr(aot_step, "compiler_missing", no_compiler)
    with caplog.at_level(logging.INFO, logger="fairseq_ext.inference.aot_step"):
        assert search_graph.ready(step, m.decoder, DICT.eos(), 1e-3, beam=5) is None
    assert failed and "the beam search's graph: not compiled ahead of time (no C++ compiler (g++) on PATH); the " \
        "search runs its scripted rules" in caplog.text


def group_beam_graph(gen, m, B, K):
    """The compiled group beam graph of the SAT ``m`` for a beam of ``B``, started and waited for."""
    step = ss.step_graph(m.decoder)
    slots = gen._group_slots(gen._rank_tuples(B, K, torch.device("cpu")), K)
    search_graph.ready(step, m.decoder, DICT.eos(), gen._tie_margin, beam=B, slots=slots)
    search_graph.wait(step)
    graph = search_graph.ready(step, m.decoder, DICT.eos(), gen._tie_margin, beam=B, slots=slots)
    assert isinstance(graph, aot_step.AOTGraph)
    return graph


@slow
def test_group_beam_graph_equals_the_enumerated_group_step(compiled):
    """SAT K=2, two sentences of a beam of 3, EOS among the best at each position: the compiled group step's ending
    candidates, their hypotheses, the candidates' words and scores and the next hypotheses with both sentences kept
    equal the enumerated step's on the op path (scores 1e-5, words, rows and ending slots exactly); a NaN selected
    hands the group back to the op path (None)."""
    m, K, B = compiled["sat K=2"], 2, 3
    gen = SATSequenceGenerator([m], DICT, beam_size=B)
    graph = group_beam_graph(gen, m, B, K)
    cands = gen._rank_tuples(B, K, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    N, V, step = 2 * B, len(DICT), 4
    logits = torch.randn(N, K, V, generator=g)
    logits[1, 0, DICT.eos()] = 8.0  # ends at the group's first position
    logits[4, 1, DICT.eos()] = 8.0  # ... and at its second
    scores = -torch.rand(N, generator=g)
    bias = torch.zeros(K, V)
    bias[:, DICT.pad()] = float("-inf")
    tokens = torch.randint(4, 50, (N, 2 * K + step + 2), generator=g)
    cum, attn, group_attn = torch.randn(N, 10, generator=g), torch.rand(N, 5, 10, generator=g), torch.rand(N, K, 5)

    lprobs = torch.log_softmax(logits, dim=-1) + bias  # the op path (_group_beam_search)
    eos_lp = lprobs[:, :, DICT.eos()].clone()
    lprobs[:, :, DICT.eos()] = float("-inf")
    vals, words = lprobs.topk(B, dim=-1)
    fin0, ended0, alive0, X0, chosen0 = gen._enumerated_group(scores, vals, words, eos_lp, 2, B, K - 1, cands)
    scores0, sel = alive0.reshape(2, B * X0).topk(B, dim=1)
    rows0 = (torch.arange(2).unsqueeze(1) * B + torch.div(sel, X0, rounding_mode="floor")).view(-1)
    words0, new_cum0 = chosen0(rows0 * X0 + sel.view(-1) % X0)
    tokens0, cum0, attn0 = tokens.index_select(0, rows0), cum.index_select(0, rows0), attn.index_select(0, rows0)
    tokens0[:, K + step: 2 * K + step], cum0[:, step: step + K] = words0, new_cum0
    attn0[:, :, step: step + K] = group_attn.index_select(0, rows0).transpose(1, 2)

    (fin1, ended1, alive1, X1, chosen1), (rows1, scores1, tokens1, cum1, attn1) = gen._fused_group(
        graph, logits, bias, scores, tokens, cum, attn, group_attn, step, cands, B)
    assert fin1 == fin0 and X1 == X0 and any(i >= 0 for j in fin0 for s in j for i in s)
    assert_close(alive1, alive0, atol=1e-5)
    for j, per_sentence in enumerate(fin0):
        for s, slots in enumerate(per_sentence):
            for i in (i for i in slots if i >= 0):
                (r0, w0, c0), (r1, w1, c1) = ended0(j, s, i), ended1(j, s, i)
                assert r1 == r0 and torch.equal(w1, w0)
                assert_close(c1, c0, atol=1e-5)
    flat = torch.arange(N * X0)
    assert torch.equal(chosen1(flat)[0], chosen0(flat)[0])
    assert_close(chosen1(flat)[1], chosen0(flat)[1], atol=1e-5)
    assert torch.equal(rows1, rows0) and torch.equal(tokens1, tokens0)
    for a, b in ((scores1, scores0.view(-1)), (cum1, cum0), (attn1, attn0)):
        assert_close(a, b, atol=1e-5)
    logits[3, 1, :] = float("nan")
    assert gen._fused_group(graph, logits, bias, scores, tokens, cum, attn, group_attn, step, cands, B) is None


@slow
def test_generator_on_the_group_beam_graph_gives_the_op_paths_hypotheses(compiled, monkeypatch):
    """SAT K=2, beam 3, three sentences: with the group beam graph ready the search takes it at every group of
    B parents that runs to its end, and its n-best lists (tokens, scores 1e-5) are those of the op path."""
    m, K, B = compiled["sat K=2"], 2, 3
    src, lengths, _ = batch(bsz=3, src_len=9)
    sample = sat_sample(src, lengths)
    gen = SATSequenceGenerator([m], DICT, beam_size=B, max_len_a=0, max_len_b=12, min_len=5)
    group_beam_graph(gen, m, B, K)
    calls = []
    fused = type(gen)._fused_group
    monkeypatch.setattr(type(gen), "_fused_group", lambda self, *a: calls.append(1) or fused(self, *a))
    with torch.no_grad():
        ours = gen.generate([m], sample)
    assert len(calls) > 2
    ready = search_graph.ready
    monkeypatch.setattr(search_graph, "ready", lambda *a, **k: None if k.get("slots") is not None else ready(*a, **k))
    n = len(calls)
    with torch.no_grad():
        ref = gen.generate([m], sample)
    assert len(calls) == n
    for a, b in zip(ours, ref):
        assert [h["tokens"].tolist() for h in a] == [h["tokens"].tolist() for h in b]
        for x, y in zip(a, b):
            assert_close(x["positional_scores"], y["positional_scores"], atol=1e-5)
