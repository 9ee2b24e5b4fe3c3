"""fairseq_ext.inference.amx_int8: int8 linear layers on AMX tiles (``amx-int8-decoder`` / ``amx-int8-encoder``).

The kernel must compute its formula (int8 weights with one scale per output row, each input row quantised with
its own scale) for any row count and for sizes that are not multiples of a tile; a model with it must decode
incrementally as its full pass does (each row is quantised on its own, so batching rows changes nothing) and
reorder its state with a permutation; and it must be refused with one line where it cannot run. The tests that
run the kernel are skipped on a CPU without AMX; the refusals run everywhere."""

import os

import pytest
import torch

import fairseq_ext  # noqa: F401  (registers the plugin)
import fairseq_ext.inference.lean_decoder as lean_module
from fairseq_ext.inference import amx_int8
from fairseq_ext.inference.amx_int8 import AmxInt8Linear
from fairseq_ext.errors import FairseqExtError
from fairseq_ext.inference.speedups import apply_speedups
from fairseq_ext.inference.lean_decoder import lean_decoder
from fairseq_ext.inference.lean_encoder import lean_encoder
from fairseq_ext.sat.model import SATModel, sat_decoder_input
from tests.builders import SAT_DICT as DICT
from tests.builders import SatTask, sat_args, sat_model
from tests.helpers import assert_close
from tests.inference.test_speedups import _batch, _reorder_matches_full_pass, _same_hypotheses

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_amx = pytest.mark.skipif(amx_int8.refusal() is not None, reason=f"{amx_int8.refusal()}")
AMX = "amx-int8-decoder,amx-int8-encoder"


def _formula(layer: AmxInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """The module docstring's formula in float64, from the float32 input quantisation the kernel does."""
    x = x.reshape(-1, layer.in_features)
    a = x.abs().amax(dim=1)
    inv = torch.where(a > 0, 127.0 / a, torch.zeros_like(a))  # float32, as the kernel
    qx = torch.round(x * inv[:, None]).clamp(-128, 127)  # half to even
    sx = (a / 127.0).double()
    y = (qx.double() @ layer.weight_int8.double().t()) * sx[:, None] * layer.weight_scale.double()
    return y + (0 if layer.bias is None else layer.bias.double())


@needs_amx
@pytest.mark.parametrize("N,K", [(48, 16), (100, 70), (33, 256), (520, 130), (64, 1024)])
def test_amx_linear_computes_its_formula_for_any_rows_and_sizes(N, K):
    g = torch.Generator().manual_seed(N * K)
    lin = torch.nn.Linear(K, N, bias=N != 33)
    with torch.no_grad():
        lin.weight.normal_(0, K ** -0.5, generator=g)
        lin.weight[3] = 0  # an all-zero weight row
    layer = AmxInt8Linear.from_linear(lin)
    assert layer.weight_int8.dtype == torch.int8 and layer.weight_int8.abs().max() == 127
    for M in (1, 3, 15, 16, 17, 40):
        x = torch.randn(M, K, generator=g) * 3
        with torch.inference_mode():
            got = layer(x)
            want = _formula(layer, x)
            assert got.shape == (M, N) and got.dtype == torch.float32
            assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max(), (M, N, K)
            # int8 rounding: close to the float layer (within 3% of the output's scale)
            assert (got - lin(x)).abs().max() < 0.03 * lin(x).abs().max()


@needs_amx
def test_amx_linear_shapes_strides_special_rows_and_stacking():
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(96, 40)
    layer = AmxInt8Linear.from_linear(lin)
    x = torch.randn(5, 3, 96, generator=g)
    x[1, 2] = 0  # an all-zero row: the bias
    x[2, 0, 7] = float("nan")  # NaN (and inf) reach that row's outputs, and only those
    x[4, 1, 3] = float("inf")
    with torch.inference_mode():
        y = layer(x)
        assert y.shape == (5, 3, 40)
        assert torch.equal(y[1, 2], lin.bias.detach())
        assert y[2, 0].isnan().all() and y[4, 1].isnan().all()
        finite = torch.ones(5, 3, dtype=torch.bool)
        finite[2, 0] = finite[4, 1] = False
        assert y[finite].isfinite().all()
        # every row is quantised on its own: a row's output does not depend on the other rows of the call
        for i, j in ((0, 0), (3, 2)):
            assert torch.equal(layer(x[i, j: j + 1]), y[i, j: j + 1])
        t = torch.randn(96, 7, generator=g)  # a non-contiguous input
        assert torch.equal(layer(t.t()), layer(t.t().contiguous()))
        assert layer(torch.empty(0, 96)).shape == (0, 40)
        # many rows: the outputs split over threads, the same numbers
        big = AmxInt8Linear.from_linear(torch.nn.Linear(96, 300))
        rows = torch.randn(amx_int8.THREADED_WORK // (96 * 300) + 5, 96, generator=g)
        one = big(rows)
        torch.set_num_threads(2)
        try:
            assert torch.equal(big(rows), one) and torch.equal(big(rows[:3]), one[:3])
            # a thread started for a call frees its quantised inputs when it ends: these 300 threaded calls
            # (1,024 x 64 inputs, 68 KB each) kept ~20 MB before that was fixed
            def rss_mb():
                with open("/proc/self/statm") as f:
                    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
            wide_layer = AmxInt8Linear.from_linear(torch.nn.Linear(64, amx_int8.THREADED_WORK // (1024 * 64)))
            wide = torch.randn(1024, 64, generator=g)
            for _ in range(20):
                wide_layer(wide)
            before = rss_mb()
            for _ in range(300):
                wide_layer(wide)
            assert rss_mb() - before < 8
        finally:
            torch.set_num_threads(1)
        # stacked modules: the outputs side by side, bit for bit
        parts = [AmxInt8Linear.from_linear(torch.nn.Linear(96, n)) for n in (40, 17, 64)]
        parts[1].bias = None
        stacked = AmxInt8Linear.stacked(parts)
        z = x[0]
        assert torch.equal(stacked(z), torch.cat([p(z) for p in parts], dim=-1))


@needs_amx
def test_amx_linear_refuses_what_it_does_not_compute():
    layer = AmxInt8Linear.from_linear(torch.nn.Linear(8, 4))
    with pytest.raises(FairseqExtError, match="float32 CPU inference without autograd .*torch.float64"):
        layer(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(FairseqExtError, match="that requires grad"):
        layer(torch.randn(2, 8, requires_grad=True))
    with pytest.raises(FairseqExtError, match="input of 9 features, the layer takes 8"):
        layer(torch.randn(2, 9))
    with pytest.raises(FairseqExtError, match="amx-int8 layers run on the CPU; this model is on meta"):
        AmxInt8Linear.from_linear(torch.nn.Linear(8, 4, device="meta"))
    m = apply_speedups(sat_model(2, seed=3), AMX)
    assert not any(isinstance(p, torch.Tensor) and p.dtype == torch.int8 for p in m.state_dict().values())
    assert sum(isinstance(x, AmxInt8Linear) for x in m.modules()) > 0
    assert not any(type(x) is torch.nn.Linear for x in m.modules())
    with pytest.raises(FairseqExtError, match="int8-decoder and amx-int8-decoder both replace the softmax projection"):
        apply_speedups(sat_model(2), "amx-int8-decoder,int8-decoder")
    with pytest.raises(FairseqExtError, match="amx-int8-decoder and prepack both replace"):
        apply_speedups(sat_model(2), "prepack,amx-int8-decoder")
    with pytest.raises(FairseqExtError, match="int8-encoder and amx-int8-encoder both replace the encoder's"):
        apply_speedups(sat_model(2), "amx-int8-encoder,int8-encoder")


def test_amx_flags_are_refused_with_one_line_where_the_kernel_cannot_run(monkeypatch, tmp_path):
    monkeypatch.setattr(amx_int8.LIBRARY, "lib", None)
    monkeypatch.setattr(amx_int8.LIBRARY, "why", None)
    monkeypatch.setattr(amx_int8, "_cpu_refusal", lambda: "this CPU lacks amx_int8 (AMX int8 needs ...)")
    with pytest.raises(FairseqExtError) as e:
        apply_speedups(sat_model(2), "amx-int8-decoder", flag="--inference-speedups")
    assert str(e.value) == ("amx-int8-decoder: AMX int8 kernel unavailable: this CPU lacks amx_int8 (AMX int8 "
                            "needs ...); decode with int8-decoder / int8-encoder instead")
    # a compiler that fails: its first error line, and nothing half-written in the cache
    monkeypatch.setattr(amx_int8.LIBRARY, "why", None)
    monkeypatch.setattr(amx_int8, "_cpu_refusal", lambda: None)
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(tmp_path))
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\necho 'amx_int8.c:1: error: unknown option -mamx-tile' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(FairseqExtError, match="amx-int8-encoder: AMX int8 kernel unavailable: .*fake-cc could not "
                                              "build amx_int8.c .*: amx_int8.c:1: error: unknown option"):
        apply_speedups(sat_model(2), "amx-int8-encoder")
    assert list(tmp_path.iterdir()) == [fake]
    monkeypatch.setattr(amx_int8.LIBRARY, "why", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))  # a compiler that is not there
    with pytest.raises(FairseqExtError, match="cannot run the C compiler .*no-such-cc.*; set CC"):
        apply_speedups(sat_model(2), "amx-int8-decoder")


@needs_amx
def test_amx_kernel_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(amx_int8.LIBRARY, "lib", None)
    monkeypatch.setattr(amx_int8.LIBRARY, "why", None)
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(tmp_path / "cache"))
    lib = amx_int8._build()
    assert lib.parent == tmp_path / "cache" and lib.name.startswith("amx_int8-") and lib.suffix == ".so"
    stamp = lib.stat().st_mtime_ns
    assert amx_int8._build() == lib and lib.stat().st_mtime_ns == stamp  # cached: not built again
    assert amx_int8.kernel() is not None and amx_int8.refusal() is None
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # others could put a library there: refused, nothing loaded
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(shared))
    with pytest.raises(FairseqExtError, match="shared is not a directory of this user's alone"):
        amx_int8._build()


def _amx_pair(K, seed, lean=True, **kw):
    """A SAT model with AMX int8 layers and fairseq's own code, and a copy with the same layers and the lean
    decoder step and encoder layers."""
    torch.manual_seed(seed)
    plain = SATModel.build_model(sat_args("sat_transformer", K, **kw), SatTask()).eval()
    other = SATModel.build_model(sat_args("sat_transformer", K, **kw), SatTask()).eval()
    other.load_state_dict(plain.state_dict())
    apply_speedups(plain, AMX)
    apply_speedups(other, AMX + (",lean-decoder,lean-encoder" if lean else ""))
    return plain, other


@needs_amx
@pytest.mark.parametrize("K,lean,kw", [(1, False, {}), (2, False, {}), (1, True, {}), (2, True, {}),
                                       (3, True, {"decoder_normalize_before": True})])
def test_amx_model_incremental_equals_full_pass(K, lean, kw, monkeypatch):
    """The full pass runs fairseq's code with every row in one call; the incremental steps (fairseq's or the lean
    step, one group per call, then several groups at once) give the same outputs: rows are quantised one by
    one. The lean step's q/k/v run as one stacked call."""
    monkeypatch.setattr(lean_module, "CACHE_BLOCK", 4)
    plain, m = _amx_pair(K, 31, lean=lean, **kw)
    src, lengths, prev = _batch()
    sat_in = sat_decoder_input(prev, K, DICT.eos())
    with torch.no_grad():
        enc = m.encoder(src, lengths)
        assert_close(enc["encoder_out"][0], plain.encoder(src, lengths)["encoder_out"][0], 1e-5, "encoder")
        full, full_extra = plain.decoder(sat_in, enc)
        state, outs = {}, []
        for end in list(range(K, 4 * K + 1, K)) + [sat_in.size(1)]:
            out, extra = m.decoder(sat_in[:, :end], enc, incremental_state=state)
            outs.append(out)
    assert_close(torch.cat(outs, 1), full, 1e-5, f"K={K} lean={lean} amx incremental vs full pass")
    fused = getattr(m.decoder.layers[0].self_attn, "_fairseq_ext_fused_qkv", None)
    assert (fused is not None) == lean and (not lean or isinstance(fused[1], AmxInt8Linear))


@needs_amx
@pytest.mark.parametrize("K", [1, 2])
def test_amx_model_reorder_with_a_permutation(K):
    plain, m = _amx_pair(K, 32)
    _reorder_matches_full_pass(plain, m, K, *_batch(),
                               (torch.tensor([3, 1, 1, 0]), torch.tensor([3, 2]), torch.tensor([2, 0, 3, 1])))


@needs_amx
@pytest.mark.parametrize("K", [1, 4])
def test_amx_model_hypotheses_with_and_without_the_lean_step(K):
    """Greedy and beam 4: the lean step on AMX layers gives the hypotheses of fairseq's code on the same layers.
    The scores agree to 0.02, not 1e-5: the two codes sum in different orders (~1e-7), and where an input of a
    layer lies that close to a rounding boundary of its int8 quantisation, the int8 value moves by one (in these
    16-wide test models a step of ~1% of a row's largest value)."""
    _same_hypotheses(*_amx_pair(K, 33), K, tol=0.02)


@needs_amx
def test_amx_layers_replace_shared_modules_once():
    m = sat_model(2, seed=34)
    m.decoder.layers[1].fc1 = m.decoder.layers[0].fc1  # one module in two places
    apply_speedups(m, "amx-int8-decoder")
    assert isinstance(m.decoder.layers[0].fc1, AmxInt8Linear)
    assert m.decoder.layers[1].fc1 is m.decoder.layers[0].fc1
    lean_encoder(lean_decoder(m))  # the lean step and layers take them


def test_amx_layer_refuses_weights_c_must_not_read():
    """The weights, scales and bias the C code reads are checked before the kernel is asked for (on every CPU)."""
    w = torch.zeros(3, 5, dtype=torch.int8)
    for args in ((w.float(), torch.ones(3), None), (w[None], torch.ones(3), None), (w, torch.ones(5), None),
                 (w, torch.ones(3, dtype=torch.int32), None), (w, torch.ones(3), torch.ones(4)),
                 (torch.zeros(0, 5, dtype=torch.int8), torch.ones(0), None)):
        with pytest.raises(FairseqExtError, match=r"AmxInt8Linear: takes an int8 CPU weight \[N, K\]"):
            amx_int8.AmxInt8Linear(*args)
