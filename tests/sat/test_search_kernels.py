"""fairseq_ext.sat.search_kernels: the log-softmax a beam step reads and the enumerated group step, in C.

``log_softmax_top`` must give the exact log-softmax's values (within 1e-6 + 2.4e-7 of their size) and the words of
its top B, leave rows that are not finite to PyTorch, and make the generator's hypotheses those of PyTorch's path;
``enumerated_group`` must give exactly the numbers of the PyTorch step it replaces. Where the kernels cannot run,
the generator must decode through PyTorch's ops. The tests that run the kernels are skipped on a CPU without
AVX-512F; the fallback runs everywhere."""

import math

import pytest
import torch

import fairseq_ext  # noqa: F401  (registers the plugin)
from fairseq_ext.sat import search_kernels
from fairseq_ext.errors import FairseqExtError
from fairseq_ext.sat.generator import SATEnsembleModel, SATSequenceGenerator
from tests.builders import SAT_DICT as DICT
from tests.builders import sat_model
from tests.sat.test_sat import _batch, _same_hypos, _sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_kernels = pytest.mark.skipif(search_kernels.refusal() is not None, reason=f"{search_kernels.refusal()}")
needs_top = pytest.mark.skipif(search_kernels.top_refusal() is not None, reason=f"{search_kernels.top_refusal()}")
PAD, EOS = 1, 2


def _pytorch(x, B):
    """What the generator's PyTorch path reads: the top B of the log-softmax without pad and EOS, and EOS."""
    lp = torch.log_softmax(x.double(), -1).float()  # the exact log-softmax, rounded once
    lp[..., PAD] = -math.inf
    eos = lp[..., EOS].clone()
    lp[..., EOS] = -math.inf
    vals, words = lp.topk(B, dim=-1)
    return vals, words, eos


@needs_top
@pytest.mark.parametrize("shape", [(1, 5), (3, 16), (4, 17), (8, 8000), (2, 8003), (3, 2, 300)])
@pytest.mark.parametrize("B", [1, 3, 4])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_log_softmax_top_equals_pytorch(shape, B, scale):
    g = torch.Generator().manual_seed(shape[-1] + B)
    x = torch.randn(shape, generator=g) * scale
    x.view(-1, shape[-1])[0, -1] = -math.inf  # a word that cannot be chosen
    vals, words, eos = search_kernels.log_softmax_top(x, B, (PAD, EOS), EOS)
    want_vals, want_words, want_eos = _pytorch(x, B)
    assert vals.shape == words.shape == shape[:-1] + (B,) and eos.shape == shape[:-1]
    finite = want_vals.isfinite()
    assert torch.equal(vals.isfinite(), finite) and torch.equal(words[finite], want_words[finite])
    assert not ((words == PAD) | (words == EOS)).any()  # -inf places hold other words (topk's are arbitrary)
    for got, want in ((vals[finite], want_vals[finite]), (eos, want_eos)):  # 1e-6 + 2.4e-7 |want| of the exact value
        assert ((got - want).abs() <= 1e-6 + 2.4e-7 * want.abs()).all()
    # a view that is not contiguous: the same as its copy
    wide = torch.cat([x, torch.randn(shape, generator=g)], -1)[..., : shape[-1]]
    got = search_kernels.log_softmax_top(wide, B, (PAD, EOS), EOS)
    assert all(torch.equal(a, b) for a, b in zip(got, (vals, words, eos)))


@needs_top
def test_log_softmax_top_ties_short_rows_and_rows_that_are_not_finite():
    x = torch.tensor([[0.0, 0.0, 5.0, 1.0, 1.0, 1.0, 0.5]])
    vals, words, eos = search_kernels.log_softmax_top(x, 3, (PAD, EOS), EOS)
    assert words.tolist() == [[3, 4, 5]]  # equal values: the smaller word first; pad and EOS are not words here
    assert abs(float(eos[0]) - float(torch.log_softmax(x, -1)[0, EOS])) < 1e-6
    # fewer candidate words than B: the others score -inf
    vals, words, _ = search_kernels.log_softmax_top(torch.tensor([[0.5, 1.0, 2.0, -1.0]]), 3, (PAD, EOS), EOS)
    assert vals[0, :2].isfinite().all() and words[0, :2].tolist() == [0, 3] and vals[0, 2] == -math.inf
    # only EOS finite: computed (the words score -inf)
    x = torch.full((1, 40), -math.inf)
    x[0, EOS] = 3.0
    vals, _, eos = search_kernels.log_softmax_top(x, 2, (PAD, EOS), EOS)
    assert float(eos[0]) == 0.0 and (vals == -math.inf).all()
    for bad in ("nan", "nan-eos", "+inf", "all -inf"):
        x = torch.randn(3, 50)
        if bad == "nan":
            x[1, 30] = math.nan
        elif bad == "nan-eos":
            x[2, EOS] = math.nan
        elif bad == "+inf":
            x[0, 7] = math.inf
        else:
            x[1] = -math.inf
        assert search_kernels.log_softmax_top(x, 4, (PAD, EOS), EOS) is None, bad


def _random_step_inputs(n, P, K, B, seed):
    g = torch.Generator().manual_seed(seed)
    N = n * P
    scores = -torch.rand(N, generator=g) * 5
    vals = (-torch.rand(N, K, B, generator=g) * 4).sort(-1, descending=True).values
    vals[0, -1, -1] = -math.inf  # a position whose last word is forbidden
    words = torch.randint(4, 500, (N, K, B), generator=g)
    eos_lp = -torch.rand(N, K, generator=g) * 2
    if N > 1:
        eos_lp[-1, 0] = -math.inf  # --min-len
    return scores, vals, words, eos_lp


@needs_kernels
@pytest.mark.parametrize("K,B", [(1, 1), (1, 4), (2, 4), (3, 2), (4, 4), (6, 4), (2, 7)])
@pytest.mark.parametrize("n,P", [(1, 1), (3, 1), (1, "B"), (2, "B")])
def test_enumerated_group_kernel_gives_the_pytorch_steps_numbers(K, B, n, P):
    """Every output of the group step: the finished candidates of each position in rank order (row, words,
    cumulative scores), the scores of the full-length ones and the words and scores of any chosen one."""
    P = B if P == "B" else P
    gen = SATSequenceGenerator([sat_model(K, seed=1)], DICT, beam_size=B)
    cands = gen._rank_tuples(B, K, torch.device("cpu"))
    n_ended = 0
    for seed in range(3):
        inputs = _random_step_inputs(n, P, K, B, seed)
        for last in range(K):
            outs = []
            for native in (True, False):
                gen.native_group_step = native
                outs.append(gen._enumerated_group(*inputs, n, P, last, cands))
            (fin_c, ended_c, alive_c, X_c, chosen_c), (fin_t, ended_t, alive_t, X_t, chosen_t) = outs
            assert X_c == X_t and torch.equal(alive_c, alive_t)
            for j in range(last + 1):
                for s in range(n):
                    got = [(c >= 0) and ended_c(j, s, c) for c in fin_c[j][s]]
                    want = [(c >= 0) and ended_t(j, s, c) for c in fin_t[j][s]]
                    assert len(got) == len(want) == B
                    n_ended += sum(a is not False for a in got)
                    for a, b in zip(got, want):
                        assert (a is False) == (b is False)
                        if a is not False:
                            assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
            flat = torch.arange(n * P * X_c)
            assert all(torch.equal(a, b) for a, b in zip(chosen_c(flat), chosen_t(flat)))
    assert n_ended > 0  # candidates that end inside the group were compared


@needs_top
@pytest.mark.parametrize("K,beam", [(1, 1), (1, 4), (2, 1), (2, 4), (3, 3), (4, 4)])
def test_generator_through_the_kernels_equals_pytorchs_path(K, beam, monkeypatch):
    """The default generator reads the log-softmax through the kernel and steps through the C group step; its
    hypotheses are those of PyTorch's ops (--min-len and --max-len both bite). A NaN in the logits of one call
    leaves that call to PyTorch, where fairseq's rule (NaN is -inf) applies: the same hypotheses again."""
    m = sat_model(K, seed=40 + K, eos_boost=1.5)
    src, src_lengths, _, _ = _batch(bsz=3, src_len=6, seed=K)
    sample = _sample(src, src_lengths)
    opts = dict(beam_size=beam, len_penalty=0.8, max_len_a=0, max_len_b=9, min_len=3)
    reads, steps, refused = [], [], []
    top, group = search_kernels.log_softmax_top, search_kernels.enumerated_group

    def counted_top(*a):
        out = top(*a)
        reads.append(1)
        refused.append(out is None)
        return out
    monkeypatch.setattr(search_kernels, "log_softmax_top", counted_top)
    monkeypatch.setattr(search_kernels, "enumerated_group", lambda *a: steps.append(1) or group(*a))
    output_layer = m.decoder.output_layer
    calls = []

    def poisoned(x):  # NaN in one word of one row of the logits at the second call
        x = output_layer(x)
        calls.append(1)
        if len(calls) == 2:
            x[-1, 0, 7] = math.nan
        return x

    def decode(kernels, poison=False):
        gen = SATSequenceGenerator([m], DICT, **opts)
        assert gen.reads_top_only and gen.native_group_step
        gen.reads_top_only = gen.native_group_step = kernels
        calls.clear()
        with monkeypatch.context() as patch:
            if poison:
                patch.setattr(m.decoder, "output_layer", poisoned)
            return gen.generate([m], sample)

    want = decode(False)
    assert not reads and not steps
    _same_hypos(decode(True), want, f"K={K} beam={beam}")
    assert reads and not any(refused) and (beam == 1 or steps)
    assert any(len(h["tokens"]) == 10 for hs in want for h in hs) or beam == 1  # --max-len reached
    reads.clear()
    got, want = decode(True, poison=True), decode(False, poison=True)
    assert refused.count(True) == 1
    # a NaN logit makes its whole row NaN, so -inf: greedy's last sentence scores -inf either way
    for hs, ws in zip(got, want):
        assert [h["tokens"].tolist() for h in hs] == [w["tokens"].tolist() for w in ws]
        for h, w in zip(hs, ws):
            assert float(h["score"]) == float(w["score"]) == -math.inf or \
                abs(float(h["score"]) - float(w["score"])) <= 1e-5


def _forget_the_library(monkeypatch):
    monkeypatch.setattr(search_kernels.LIBRARY, "lib", None)
    monkeypatch.setattr(search_kernels.LIBRARY, "why", None)
    monkeypatch.setattr(search_kernels, "_top_cpu", None)


def test_generator_uses_pytorchs_ops_where_the_kernels_cannot_run(monkeypatch, tmp_path):
    """A CPU without AVX-512F: the group step in C, the log-softmax through PyTorch; no C compiler: PyTorch's ops
    for both, with the reason in one line. The hypotheses are the same either way; --unkpen (which reads every
    word) and --no-lean-step also keep PyTorch's log-softmax."""
    m = sat_model(2, seed=5)
    src, src_lengths, _, _ = _batch(bsz=2, src_len=6, seed=2)
    sample = _sample(src, src_lengths)
    opts = dict(beam_size=3, max_len_a=0, max_len_b=8, min_len=2)
    want = SATSequenceGenerator([m], DICT, **opts, lean_step=False).generate([m], sample)
    for kw in (dict(unk_penalty=0.5), dict(lean_step=False)):
        assert not SATSequenceGenerator([m], DICT, **opts, **kw).reads_top_only
    _forget_the_library(monkeypatch)
    monkeypatch.setattr(search_kernels, "_avx512f_refusal", lambda: "this CPU lacks avx512f")
    assert search_kernels.top_refusal() == "log-softmax kernel unavailable: this CPU lacks avx512f"
    with pytest.raises(FairseqExtError, match="this CPU lacks avx512f"):
        search_kernels.log_softmax_top(torch.zeros(1, 8), 2, (PAD, EOS), EOS)
    gen = SATSequenceGenerator([m], DICT, **opts)
    assert not gen.reads_top_only and gen.native_group_step == (search_kernels.refusal() is None)
    _same_hypos(gen.generate([m], sample), want, "without AVX-512F")
    # a library built without the AVX-512F function (another CPU architecture): the same, said so
    _forget_the_library(monkeypatch)
    monkeypatch.setattr(search_kernels, "_avx512f_refusal", lambda: None)
    monkeypatch.setattr(search_kernels.LIBRARY, "cflags", search_kernels.CFLAGS + ["-DFX_NO_AVX512"])
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(tmp_path / "other-cpu"))
    if search_kernels.refusal() is None:
        assert search_kernels.top_refusal() == ("log-softmax kernel unavailable: the library was built for a CPU "
                                                "without AVX-512F intrinsics")
        gen = SATSequenceGenerator([m], DICT, **opts)
        assert not gen.reads_top_only and gen.native_group_step
        _same_hypos(gen.generate([m], sample), want, "a library without the AVX-512F function")
    # no compiler: nothing built, PyTorch's ops
    _forget_the_library(monkeypatch)
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    why = search_kernels.refusal()
    assert why.startswith("search kernels unavailable: cannot run the C compiler") and "set CC" in why
    assert search_kernels.top_refusal() == why
    gen = SATSequenceGenerator([m], DICT, **opts)
    assert not gen.reads_top_only and not gen.native_group_step
    _same_hypos(gen.generate([m], sample), want, "without the kernels")
    assert isinstance(gen.model, SATEnsembleModel)


@needs_top
def test_many_rows_on_more_than_two_threads_take_pytorchs_parallel_ops():
    gen = SATSequenceGenerator([sat_model(2, seed=1)], DICT, beam_size=4)
    rows = search_kernels.SERIAL_MAX_ROWS // 2 + 1  # x 2 positions: just over the limit
    x = torch.randn(rows, 2, len(DICT))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert gen._logits_top(x, 4, 0, 100) is not None
        assert gen._logits_top(x[:-1], 4, 0, 100) is not None
        torch.set_num_threads(3)
        assert gen._logits_top(x, 4, 0, 100) is None
        assert gen._logits_top(x[:-1], 4, 0, 100) is not None
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_the_wrappers_refuse_what_c_must_not_read(monkeypatch):
    """Every argument is checked before a pointer reaches C: a dtype or device C would misread, shapes that do not
    fit, and index values the C code reads memory at (a rank of B reads past a row). One line each."""
    gen = SATSequenceGenerator([sat_model(2, seed=1)], DICT, beam_size=4)
    K, B, n, P = 2, 4, 1, 4
    ranks, lengths, _ = gen._rank_tuples(B, K, torch.device("cpu"))
    good = dict(scores=torch.randn(n * P), vals=torch.randn(n * P, K, B), words=torch.randint(0, 9, (n * P, K, B)),
                eos_lp=torch.randn(n * P, K), n=n, P=P, J=K, ranks=ranks, lengths=lengths)
    search_kernels.enumerated_group(**good)  # accepted
    bad_ranks = ranks.clone()
    bad_ranks[-1, 0] = B  # one past the row
    bad_lengths = lengths.clone()
    bad_lengths[0] = K + 1
    for change, message in [
        (dict(scores=good["scores"].double()), "must be float32"),
        (dict(words=good["words"].int()), "int64"),
        (dict(vals=good["vals"][:, :, :2]), "shapes that do not fit"),
        (dict(n=2), "shapes that do not fit"),
        (dict(J=K + 1), "shapes that do not fit"),
        (dict(ranks=ranks.int()), "ranks must be an int64 CPU tensor"),
        (dict(ranks=bad_ranks), r"ranks must lie in \[0, 4\)"),
        (dict(lengths=bad_lengths), r"lengths in \[0, 2\]"),
    ]:
        with pytest.raises(FairseqExtError, match=message) as e:
            search_kernels.enumerated_group(**dict(good, **change))
        assert "\n" not in str(e.value)
    # a cached pair changed in place after it was checked is checked again
    cached_ranks = ranks.clone()
    search_kernels.enumerated_group(**dict(good, ranks=cached_ranks))
    cached_ranks[-1, 0] = B
    with pytest.raises(FairseqExtError, match="ranks must lie"):
        search_kernels.enumerated_group(**dict(good, ranks=cached_ranks))


@needs_top
def test_log_softmax_top_refuses_logits_c_would_misread():
    x = torch.randn(3, 40)
    for bad in (x.double(), x.half(), x.to(torch.bfloat16), torch.tensor(1.0)):
        with pytest.raises(FairseqExtError, match="log_softmax_top: the logits must be a float32 CPU tensor"):
            search_kernels.log_softmax_top(bad, 2, (PAD, EOS), EOS)
    for B, keep in ((0, EOS), (41, EOS), (2, 40), (2, -1)):
        with pytest.raises(FairseqExtError, match="log_softmax_top: B="):
            search_kernels.log_softmax_top(x, B, (PAD, EOS), keep)


def test_a_compiler_that_hangs_leaves_the_generator_on_pytorchs_ops(monkeypatch, tmp_path):
    """A CC that never finishes is stopped after COMPILE_TIMEOUT_S (shortened here): the reason in one line, no
    temporary library left, and the generator decodes through PyTorch's ops with the same hypotheses."""
    from fairseq_ext.inference import native

    m = sat_model(2, seed=3)
    src, src_lengths, _, _ = _batch(bsz=2, src_len=5, seed=4)
    opts = dict(beam_size=3, max_len_a=0, max_len_b=6)
    want = SATSequenceGenerator([m], DICT, **opts, lean_step=False).generate([m], _sample(src, src_lengths))
    _forget_the_library(monkeypatch)
    hanging = tmp_path / "hanging-cc"
    hanging.write_text("#!/bin/sh\nsleep 30\n")
    hanging.chmod(0o755)
    monkeypatch.setenv("CC", str(hanging))
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "COMPILE_TIMEOUT_S", 0.5)
    assert search_kernels.refusal() == (f"search kernels unavailable: {hanging} did not build search_kernels.c within "
                                        "0.5 s (stopped); set CC to a working compiler or FAIRSEQ_EXT_NATIVE=0")
    gen = SATSequenceGenerator([m], DICT, **opts)
    assert not gen.reads_top_only and not gen.native_group_step
    _same_hypos(gen.generate([m], _sample(src, src_lengths)), want, "after a compiler that hangs")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_decode_that_cannot_use_the_kernels_never_builds_them(monkeypatch):
    """The library is built when a CPU search first needs it: never for a greedy decode with --no-lean-step, nor
    for a greedy decode of a model that is not float32 on the CPU (a bfloat16 model here: the check a GPU model
    fails too); a beam asks for the C group step on a CPU device only."""
    from fairseq_ext.inference import native

    built = []
    _forget_the_library(monkeypatch)
    monkeypatch.setattr(native, "build", lambda *a, **k: built.append(a) or (_ for _ in ()).throw(AssertionError))
    m = sat_model(2, seed=5)
    src, src_lengths, _, _ = _batch(bsz=2, src_len=6, seed=2)
    sample = _sample(src, src_lengths)
    opts = dict(max_len_a=0, max_len_b=8, min_len=2)
    SATSequenceGenerator([m], DICT, beam_size=1, lean_step=False, **opts).generate([m], sample)
    half = sat_model(2, seed=5).to(torch.bfloat16)
    gen = SATSequenceGenerator([half], DICT, beam_size=1, **opts)
    gen.generate([half], sample)
    assert not SATSequenceGenerator([m], DICT, beam_size=3, **opts)._group_step_in_c(3, torch.device("cuda"))
    assert built == [] and search_kernels.LIBRARY.why is None
    # a float32 CPU search looks it up (here the builder is the one that refuses)
    gen = SATSequenceGenerator([m], DICT, beam_size=1, **opts)
    with pytest.raises(AssertionError):
        gen.generate([m], sample)
    assert len(built) == 1
