"""The opt-in int8 decoding of fairseq_ext.inference.speedups: Int8RowsLinear's kernel choice by row count,
quantize_decoder / quantize_encoder keeping the SAT's decoding and the encoder output close, and their refusals."""

import copy
import warnings

import pytest
import torch

import fairseq_ext  # noqa: F401  (registers the plugin)
import fairseq_ext.inference.speedups as inference_module
from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.inference.speedups import Int8RowsLinear, quantize_decoder, quantize_encoder
from fairseq_ext.sat.generator import SATSequenceGenerator
from tests.builders import SAT_DICT, sat_model, sat_sample
from tests.helpers import assert_close


def _int8_pair(seed=0, out=700, dim=64):
    """PyTorch's dynamically quantised Linear and the same module as Int8RowsLinear."""
    torch.manual_seed(seed)
    seq = torch.nn.Sequential(torch.nn.Linear(dim, out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(seq, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    plain = copy.deepcopy(seq[0])
    rows = seq[0]
    rows.__class__ = Int8RowsLinear
    return plain, rows


def test_int8_rows_linear_keeps_fbgemm_for_few_rows():
    plain, rows = _int8_pair()
    for M in (1, 4, Int8RowsLinear.MIN_ROWS - 1):
        assert rows.kernel(M) == "fbgemm"
        x = torch.randn(M, 1, 64)
        assert torch.equal(rows(x), plain(x))
    assert rows.kernel(Int8RowsLinear.MIN_ROWS) == ("onednn" if inference_module._AMX_INT8 else "fbgemm")


@pytest.mark.skipif(not inference_module._AMX_INT8, reason="no oneDNN int8 kernel with AMX on this CPU / build")
def test_int8_rows_linear_onednn_equals_fbgemm_and_follows_new_weights():
    plain, rows = _int8_pair(seed=1)
    with torch.inference_mode():
        for M in (Int8RowsLinear.MIN_ROWS, 40, 300):
            x = torch.randn(M // 4, 4, 64) * 3
            assert rows.kernel(M) == "onednn"
            assert_close(rows(x), plain(x), 1e-5, f"oneDNN vs fbgemm, {M} rows")
    # new weights (a checkpoint loaded into the quantised model): the oneDNN copy is made again
    other, _ = _int8_pair(seed=2)
    rows.load_state_dict(other.state_dict())
    x = torch.randn(20, 64)
    with torch.inference_mode():
        assert_close(rows(x), other(x), 1e-5, "after load_state_dict")
        assert (rows(x) - plain(x)).abs().max() > 0.1


# -- fairseq_ext.inference.speedups.quantize_decoder --------------------------------------------------------------
@pytest.mark.parametrize("layers", ["output", "decoder"])
def test_quantize_decoder_keeps_the_sat_decoding(layers):
    K = 2
    float_model = sat_model(K, seed=3)
    q = quantize_decoder(sat_model(K, seed=3), layers=layers)
    assert type(q.decoder.output_projection) is Int8RowsLinear  # PyTorch's dynamic int8 Linear, two kernels
    assert isinstance(q.decoder.output_projection, torch.ao.nn.quantized.dynamic.Linear)
    fc1 = q.decoder.layers[0].fc1
    assert (type(fc1) is torch.nn.Linear) == (layers == "output")
    assert type(q.encoder.layers[0].fc1) is torch.nn.Linear  # the encoder stays in float
    src = torch.tensor([[4, 5, 6, 7, 8, 2], [1, 9, 10, 11, 12, 2]])
    sample = sat_sample(src, torch.tensor([6, 5]))
    with torch.no_grad():
        enc = float_model.encoder(src, src_lengths=torch.tensor([6, 5]))
        prev = torch.tensor([[2, 2, 5, 6], [2, 2, 9, 10]])
        lp_f = float_model.get_normalized_probs(float_model.decoder(prev, encoder_out=enc), log_probs=True)
        lp_q = q.get_normalized_probs(q.decoder(prev, encoder_out=enc), log_probs=True)
    assert not torch.equal(lp_f, lp_q)  # the int8 weights change the numbers ...
    assert (lp_f - lp_q).abs().max() < (0.05 if layers == "output" else 0.15)  # ... a little (log-probs)
    opts = dict(max_len_a=0, max_len_b=7, min_len=7)
    for beam in (1, 3):
        out_f = SATSequenceGenerator([float_model], SAT_DICT, beam_size=beam, **opts).generate([float_model], sample)
        out_q = SATSequenceGenerator([q], SAT_DICT, beam_size=beam, **opts).generate([q], sample)
        for hf, hq in zip(out_f, out_q):
            assert len(hq) == beam and len(hq[0]["tokens"]) == len(hf[0]["tokens"]) == 8


def test_quantize_encoder_keeps_the_encoder_output_close():
    float_model = sat_model(2, seed=4)
    q = quantize_encoder(quantize_decoder(sat_model(2, seed=4), layers="decoder"))
    assert type(q.encoder.layers[0].fc1).__module__.startswith("torch.ao.nn.quantized.dynamic")
    assert type(q.encoder.layers[0].self_attn.q_proj).__module__.startswith("torch.ao.nn.quantized.dynamic")
    src, lengths = torch.tensor([[4, 5, 6, 7, 8, 2], [1, 9, 10, 11, 12, 2]]), torch.tensor([6, 5])
    with torch.no_grad():
        ef = float_model.encoder(src, src_lengths=lengths)["encoder_out"][0]
        eq = q.encoder(src, src_lengths=lengths)["encoder_out"][0]
    assert not torch.equal(ef, eq) and (ef - eq).abs().max() < 0.1
    out = SATSequenceGenerator([q], SAT_DICT, beam_size=2, max_len_a=0, max_len_b=5, min_len=5).generate(
        [q], sat_sample(src, lengths))
    assert [len(h[0]["tokens"]) for h in out] == [6, 6]


def test_quantize_decoder_refuses_bad_input():
    with pytest.raises(FairseqExtError, match="layers must be one of"):
        quantize_decoder(sat_model(1), layers="encoder")
    with pytest.raises(FairseqExtError, match="no .decoder"):
        quantize_decoder(torch.nn.Linear(2, 2))
    with pytest.raises(FairseqExtError, match="no .encoder"):
        quantize_encoder(torch.nn.Linear(2, 2))
