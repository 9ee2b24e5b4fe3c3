"""Opt-in CPU decoding speed-ups for a loaded model (any fairseq transformer decoder, SAT included).

    from fairseq_ext.inference import quantize_decoder, quantize_encoder
    quantize_decoder(model)                     # int8 softmax projection (the default, ``layers="output"``)
    quantize_decoder(model, layers="decoder")   # every nn.Linear of the decoder
    quantize_encoder(model)                     # and every nn.Linear of the encoder

At batch 1 on a CPU a decoder call is bound by reading the weights, and the largest single weight is the
V x d output (softmax) projection (8,000 x 256 floats = 8 MB for the quickstart model, larger than the L2
cache). :func:`quantize_decoder` replaces it (or every ``nn.Linear`` of the decoder) by PyTorch's int8
dynamic quantisation (``torch.ao.quantization.quantize_dynamic``: int8 weights per tensor, activations
quantised on the fly, fbgemm kernels): 4x fewer bytes to read per call, and a call with K rows (the SAT's K
new positions, a beam's B hypotheses) costs little more than a call with one row, where MKL's float kernels
for 2-6 rows are markedly slower than its one-row path. ``benchmarks/bench_sat.py --quantize output`` measures
it beside the float models (docs/sat_transformer.md, speed section).

For inference: the model changes in place and its outputs change a little (int8 rounding of the weights),
so hypotheses can differ from the float model's; the benchmark reports BLEU (trained models) or agreement
with the float hypotheses. Training and saving checkpoints need the float model (quantised modules hold
packed int8 weights, not parameters). :func:`quantize_decoder` leaves the encoder in float;
:func:`quantize_encoder` quantises its projections too (one pass per sentence, but the part of a sentence's
time that no group size K shrinks).
"""

import warnings

import torch

from fairseq_ext.errors import FairseqExtError

LAYERS = ("output", "decoder")


def quantize_decoder(model, layers: str = "output"):
    """Int8 dynamic quantisation of ``model.decoder``'s output projection (``layers="output"``) or of all
    its ``nn.Linear`` modules (``layers="decoder"``), in place; returns the model (in eval mode)."""
    if layers not in LAYERS:
        raise FairseqExtError(f"quantize_decoder: layers must be one of {', '.join(LAYERS)} (got {layers!r})")
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise FairseqExtError("quantize_decoder: the model has no .decoder (give a fairseq encoder-decoder model)")
    _check_engine("quantize_decoder")
    if layers == "output":
        proj = getattr(decoder, "output_projection", None)
        if not isinstance(proj, torch.nn.Linear):
            raise FairseqExtError(
                "quantize_decoder: the decoder has no nn.Linear output_projection (adaptive softmax?); "
                "use layers='decoder' or the float model")
        spec = {"output_projection"}
    else:
        spec = {torch.nn.Linear}
    model.eval()
    if layers == "decoder":
        _unfuse_attention(decoder)
    _quantize(decoder, spec, "quantize_decoder")
    return model


def quantize_encoder(model):
    """Int8 dynamic quantisation of every ``nn.Linear`` of ``model.encoder``, in place; returns the model."""
    encoder = getattr(model, "encoder", None)
    if encoder is None:
        raise FairseqExtError("quantize_encoder: the model has no .encoder (give a fairseq encoder-decoder model)")
    _check_engine("quantize_encoder")
    model.eval()
    _unfuse_attention(encoder)
    _quantize(encoder, {torch.nn.Linear}, "quantize_encoder")
    return model


def _check_engine(name):
    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines and "x86" not in engines:
        raise FairseqExtError(
            f"{name}: this PyTorch build has no x86 int8 engine (supported: {engines}); decode with the float model")


def _unfuse_attention(module):
    """fairseq's MultiheadAttention hands q_proj.weight etc. to F.multi_head_attention_forward in a full pass (no
    incremental state); a quantised projection has no such tensor. skip_embed_dim_check only turns that
    shortcut (and a shape assertion) off, so the projections are called as modules."""
    from fairseq.modules import MultiheadAttention

    for m in module.modules():
        if isinstance(m, MultiheadAttention):
            m.skip_embed_dim_check = True


def _quantize(module, spec, name):
    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
        warnings.simplefilter("ignore")
        try:
            from torch.ao.quantization import quantize_dynamic
        except ImportError as e:  # pragma: no cover - a future PyTorch without torch.ao.quantization
            raise FairseqExtError(f"{name} needs torch.ao.quantization.quantize_dynamic: {e}")
        quantize_dynamic(module, qconfig_spec=spec, dtype=torch.qint8, inplace=True)
