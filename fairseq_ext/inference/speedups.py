"""Opt-in CPU decoding speed-ups for a loaded model, by name (``--inference-speedups LIST`` of ``--task
translation_sat``, or :func:`apply_speedups`), for fairseq's transformer and the SAT (a decoder that declares the
lean step, :mod:`fairseq_ext.inference.lean_decoder`):

    lean-decoder       the lean incremental step mixed into the decoder's class, so that any generator takes it
                       (the SAT generator takes it by default without changing the model)
    lean-encoder       the encoder's layers outside training in one q/k/v call and PyTorch's attention kernel
    prepack            float32 softmax projection through MKL's packed GEMM (a few rows cost about one row)
    int8-output        int8 softmax projection (PyTorch's dynamic quantisation: fbgemm; oneDNN for many rows)
    int8-decoder       every nn.Linear of the decoder in int8 (the same)
    int8-encoder       every nn.Linear of the encoder in int8 (the same)

The float32 ones keep the model's numbers up to the order of the sums (~1e-6; the same hypotheses except at
near-ties); the int8 ones change the outputs a little (int8 rounding), so hypotheses can differ from the float
model's: ``benchmarks/speed/sat.py`` reports BLEU or the agreement with the float hypotheses beside the speed.
At batch 1 on a CPU a decoder call is bound by reading the weights, and the largest is the V x d softmax
projection: int8 reads 4x fewer bytes, and a call with a few rows (a SAT group, a beam) costs little more than one
row. Inference only: the model changes in place; training and saving need the float model (quantised modules hold
packed int8 weights, not parameters).
"""

import warnings
import weakref

import torch

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.inference.lean_decoder import _DynamicQuantizedLinear, int8_weight_rows, lean_decoder
from fairseq_ext.inference.lean_encoder import lean_encoder

LAYERS = ("output", "decoder")


class PackedLinear(torch.nn.Linear):
    """``nn.Linear`` in float32 on a CPU through MKL's packed GEMM (``torch.ops.mkl._mkl_linear``, the kernel of
    torch's ``optimize_for_inference``): the weight is reordered once into MKL's panel layout, so a call with a
    few rows no longer repacks the whole weight as the plain ``sgemm`` does: a call with a few rows costs about
    what one row costs (``python -m benchmarks.speed.sat --random-init --fixed-length 27 --no-throughput --float-opt
    prepack`` measures what it buys per sentence). Same float32 products; the sums may be ordered differently
    (differences ~1e-6 relative).

    A packed copy is made per row count M (MKL packs for a given M) on the ``pack_after``-th call with that M,
    for M <= ``max_rows`` only, and at most ``max_packs`` are kept (the oldest is dropped); other calls, training
    (autograd), other dtypes and devices run the plain ``F.linear``. A weight changed in place (its version
    counter moves) drops the packs. The weight and bias are the original module's parameters (shared, tied
    weights stay tied); ``state_dict`` is unchanged."""

    def __init__(self, linear: torch.nn.Linear, max_rows: int = 64, max_packs: int = 4, pack_after: int = 2):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.max_rows, self.max_packs, self.pack_after = max_rows, max_packs, pack_after
        self._packs = {}  # M -> MKL-packed weight (an opaque MkldnnCPU tensor)
        self._seen = {}  # M -> calls so far
        self._version = None

    def forward(self, x):
        w = self.weight
        if (x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return torch.nn.functional.linear(x, w, self.bias)
        M = x.numel() // self.in_features
        if w._version != self._version:
            self._packs.clear()
            self._version = w._version
        pack = self._packs.get(M)
        if pack is None:
            self._seen[M] = seen = self._seen.get(M, 0) + 1
            if M > self.max_rows or seen < self.pack_after:
                return torch.nn.functional.linear(x, w, self.bias)
            if len(self._packs) >= self.max_packs:
                self._packs.pop(next(iter(self._packs)))
            with torch.no_grad():
                pack = self._packs[M] = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), M)
        return torch.ops.mkl._mkl_linear(x, pack, w, self.bias, M)


def prepack_output(model, max_rows: int = 64):
    """The decoder's output (softmax) projection through :class:`PackedLinear`, in place; returns the model (in
    eval mode). Float32 stays float32: the hypotheses are the float model's up to the order of the sums."""
    decoder = getattr(model, "decoder", None)
    proj = getattr(decoder, "output_projection", None)
    if isinstance(proj, PackedLinear):  # applied before
        return model.eval()
    if not isinstance(proj, torch.nn.Linear):
        raise FairseqExtError("prepack_output: the model's decoder has no nn.Linear output_projection (adaptive "
                              "softmax, or not a fairseq encoder-decoder model); decode it without prepack_output")
    if not torch.backends.mkl.is_available():
        raise FairseqExtError("prepack_output: this PyTorch build has no MKL; decode without prepack_output")
    model.eval()
    decoder.output_projection = PackedLinear(proj, max_rows=max_rows)
    return model


def _amx_int8() -> bool:
    """oneDNN's int8 linear with AMX tiles is there (PyTorch's onednn engine and op, a CPU with AMX)."""
    try:
        return (torch.cpu._is_amx_tile_supported() and "onednn" in torch.backends.quantized.supported_engines
                and hasattr(torch.ops.onednn, "qlinear_pointwise"))
    except (AttributeError, RuntimeError):  # pragma: no cover - an older or different PyTorch build
        return False


_AMX_INT8 = _amx_int8()


class Int8RowsLinear(_DynamicQuantizedLinear):
    """PyTorch's dynamically quantised ``Linear`` (fbgemm) for the softmax projection, with oneDNN's int8 kernel
    for calls of :attr:`MIN_ROWS` rows or more where the CPU has AMX tiles. On the 8,000 x 256 projection
    fbgemm's cost grows faster with the row count than oneDNN's, but oneDNN starts higher; they cross near
    :attr:`MIN_ROWS` (``python -m benchmarks.speed.kernels --parts 1`` times both by row count). So one-row and
    beam-4 calls keep fbgemm, and the K x B rows of a SAT group and batched decoding take oneDNN.

    Both kernels get the same int8 weights and the same 7-bit activation quantisation (``reduce_range``, as
    fbgemm's), so the outputs agree up to the order of the float sums (~1e-7 relative, tested). The oneDNN
    copy of the weight is made on the first call that needs it and made again when the packed weight is
    replaced (``load_state_dict``, ``set_weight_bias``); ``state_dict`` is the quantised module's."""

    MIN_ROWS = 12
    _onednn = weakref.WeakKeyDictionary()  # module -> (its packed params, (oneDNN pack, scales, zps, bias) or None)

    def kernel(self, rows: int) -> str:
        """The kernel a call with ``rows`` rows runs: "onednn" or "fbgemm"."""
        return "fbgemm" if self._onednn_for(rows) is None else "onednn"

    def _onednn_for(self, rows: int):
        """(oneDNN pack, scales, zero points, bias) when a call with ``rows`` rows runs oneDNN's kernel, else None.
        The pack is made on first use and again when the packed weight is replaced."""
        if rows < self.MIN_ROWS or not _AMX_INT8:
            return None
        src = self._packed_params._packed_params
        cached = self._onednn.get(self)
        if cached is None or cached[0] is not src:
            w, b = self._packed_params._weight_bias()
            rows_of_w = int8_weight_rows(w)
            pack = None if rows_of_w is None else (
                torch.ops.onednn.qlinear_prepack(rows_of_w[0], None), rows_of_w[1].float(),
                torch.zeros(w.size(0), dtype=torch.int64), b)
            cached = self._onednn[self] = (src, pack)  # pack None: a weight oneDNN's kernel does not take
        return cached[1]

    def forward(self, x):
        pack = None
        if x.dtype == torch.float32 and x.device.type == "cpu":
            pack = self._onednn_for(x.numel() // self.in_features)
        if pack is None:
            return super().forward(x)
        packed, scales, zps, bias = pack
        qx = torch.quantize_per_tensor_dynamic(x.reshape(-1, self.in_features), torch.quint8, True)
        y = torch.ops.onednn.qlinear_pointwise(qx.int_repr(), qx.q_scale(), qx.q_zero_point(), packed, scales, zps,
                                               bias, 1.0, 0, torch.float32, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


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
    if type(decoder.output_projection) is _DynamicQuantizedLinear:  # fbgemm for few rows, oneDNN for many
        decoder.output_projection.__class__ = Int8RowsLinear
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


SPEEDUPS = {  # name -> function(model); applied in this order
    "int8-output": lambda m: quantize_decoder(m, layers="output"),
    "int8-decoder": lambda m: quantize_decoder(m, layers="decoder"),
    "int8-encoder": quantize_encoder,
    "prepack": prepack_output,
    "lean-decoder": lean_decoder,
    "lean-encoder": lean_encoder,
}


RETIRED = {"fast-attention": "the lean decoder step does what it did (fused q/k/v, a preallocated cache, PyTorch's "
                             "attention kernel); the SAT generator takes it by default, lean-decoder gives it to any "
                             "generator: use lean-decoder"}


def apply_speedups(model, names: str, flag: str = "speedups"):
    """Applies the comma-separated speed-ups ``names`` (keys of :data:`SPEEDUPS`) to ``model``, int8 ones first,
    each once (one already applied to this model is skipped); returns the model."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    retired = [n for n in wanted if n in RETIRED]
    if retired:
        raise FairseqExtError(f"{flag}: {retired[0]} was retired: {RETIRED[retired[0]]}")
    unknown = [n for n in wanted if n not in SPEEDUPS]
    if unknown:
        raise FairseqExtError(f"{flag}: unknown speed-up {unknown[0]!r}; choose from {', '.join(SPEEDUPS)}")
    for what, group in (("the softmax projection", ("int8-decoder", "int8-output", "prepack")),
                        ("the encoder's projections", ("int8-encoder",))):
        # int8-decoder quantises int8-output's layer too: that pair is allowed
        clash = [n for n in group if n in wanted and not (n == "int8-output" and "int8-decoder" in wanted)]
        if len(clash) > 1:
            raise FairseqExtError(f"{flag}: {clash[0]} and {clash[1]} both replace {what}; keep one")
    done = getattr(model, "_fairseq_ext_speedups", set())
    for name in SPEEDUPS:  # the order of SPEEDUPS: int8 first
        if name in wanted and name not in done:
            SPEEDUPS[name](model)
            done.add(name)
    model._fairseq_ext_speedups = done
    return model
