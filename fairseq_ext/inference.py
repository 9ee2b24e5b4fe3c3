"""Opt-in CPU decoding speed-ups for a loaded model (any fairseq transformer decoder, SAT included).

    from fairseq_ext.inference import fast_attention, prepack_output, quantize_decoder, quantize_encoder
    prepack_output(model)                       # float32 softmax projection through MKL's packed GEMM
    fast_attention(model)                       # float32 decoder attention: fused QKV, SDPA, preallocated cache
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

Two float32 speed-ups keep the model's numbers up to the order of the sums (~1e-6; the same hypotheses except
at near-ties): :func:`prepack_output` runs the softmax projection through MKL's packed GEMM (the weight
reordered once, so a call with a few rows costs about what a one-row call does), and :func:`fast_attention`
gives the decoder's attention a lean incremental path (fused Q/K/V projection, a preallocated key/value cache,
``F.scaled_dot_product_attention``); :func:`fairseq_ext.lean_decoder.lean_decoder` replaces the whole incremental
decoder step by a lean one (the same products without fairseq's per-call bookkeeping; the SAT generator takes
that step by default, so the flag matters for other generators and for models it does not take by default), and
:func:`fairseq_ext.lean_encoder.lean_encoder` the encoder layers (one q/k/v call, PyTorch's attention kernel).
:func:`apply_speedups`
applies any of them by name; ``fairseq-generate --task translation_sat --inference-speedups
fast-attention,prepack`` (or ``lean-decoder,lean-encoder,prepack``) does it from the command line.

:func:`amx_quantize_decoder` / :func:`amx_quantize_encoder` (``amx-int8-decoder`` / ``amx-int8-encoder``) run
every ``nn.Linear`` through int8 products on AMX tiles where the CPU has them (:mod:`fairseq_ext.amx_int8`: one
scale per weight row and per input row; up to 16 rows cost what one row costs).

For inference: the model changes in place and its outputs change a little (int8 rounding of the weights),
so hypotheses can differ from the float model's; the benchmark reports BLEU (trained models) or agreement
with the float hypotheses. Training and saving checkpoints need the float model (quantised modules hold
packed int8 weights, not parameters). :func:`quantize_decoder` leaves the encoder in float;
:func:`quantize_encoder` quantises its projections too (one pass per sentence, but the part of a sentence's
time that no group size K shrinks).
"""

import warnings
import weakref

import torch
from fairseq.modules import MultiheadAttention

from fairseq_ext import amx_int8
from fairseq_ext.errors import FairseqExtError
from fairseq_ext.lean_decoder import (_DynamicQuantizedLinear, append_to_cache, int8_weight_rows, lean_decoder,
                                     merge_heads, qkv, split_heads)
from fairseq_ext.lean_encoder import lean_encoder

LAYERS = ("output", "decoder")


class PackedLinear(torch.nn.Linear):
    """``nn.Linear`` in float32 on a CPU through MKL's packed GEMM (``torch.ops.mkl._mkl_linear``, the kernel of
    torch's ``optimize_for_inference``): the weight is reordered once into MKL's panel layout, so a call with a
    few rows no longer repacks the whole weight as the plain ``sgemm`` does. Measured on the 8,000 x 256 softmax
    projection (one thread): 0.30 ms for 1 row either way, 0.59 vs 0.33 ms for 4 rows, 0.60 vs 0.36 ms for 6,
    0.91 vs 0.61 ms for 24. Same float32 products; the sums may be ordered differently (differences ~1e-6
    relative).

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
    fbgemm's cost grows by about 10 us per row, oneDNN's by about 3 up to 24 rows and less beyond, but oneDNN
    starts higher (``python benchmarks/bench_kernels.py``, one thread, fbgemm / oneDNN: 184 / 277 us for 4
    rows, 325 / 304 for 16, 769 / 438 for 64, 20.7 / 6.1 ms for 1,024). So one-row and beam-4 calls keep
    fbgemm, and the K x B rows of a SAT group and batched decoding take oneDNN.

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


def amx_quantize_decoder(model):
    """Every ``nn.Linear`` of ``model.decoder`` (the softmax projection too) as an int8 layer on AMX tiles
    (:class:`fairseq_ext.amx_int8.AmxInt8Linear`), in place; returns the model in eval mode. Refused with one line
    where the CPU, the OS or the compiler cannot run the kernel."""
    return _amx_quantize(model, "decoder")


def amx_quantize_encoder(model):
    """Every ``nn.Linear`` of ``model.encoder`` as an int8 layer on AMX tiles, in place; returns the model."""
    return _amx_quantize(model, "encoder")


def _amx_quantize(model, part):
    module = getattr(model, part, None)
    if module is None:
        raise FairseqExtError(f"amx_quantize_{part}: the model has no .{part} (give a fairseq encoder-decoder model)")
    model.eval()
    _unfuse_attention(module)
    if not amx_int8.replace_linears(module, f"amx-int8-{part}"):
        raise FairseqExtError(f"amx-int8-{part}: the {part} has no nn.Linear to quantise")
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


class FastIncrementalAttention(MultiheadAttention):
    """fairseq's ``MultiheadAttention`` with a leaner path for incremental decoding (the class of a decoder's
    attention modules after :func:`fast_attention`; parameters, state_dict and every other path unchanged).

    Self-attention step (T new positions, any T: a SAT group or one word): one fused Q/K/V projection (the three
    weights concatenated once, re-made when one changes), the new keys and values written into a key/value
    cache preallocated for ``CACHE_BLOCK`` positions at a time (grown by doubling) instead of fairseq's
    ``torch.cat`` of the whole prefix on every call, and ``F.scaled_dot_product_attention`` instead of fairseq's
    bmm / mask / softmax / bmm and its transposes. The cache keeps fairseq's layout: ``prev_key`` /
    ``prev_value`` are [B, H, n, d] views of the buffers, so code that reads the cache length
    (``SATDecoder``) and fairseq's own path work on it. Encoder-decoder attention: the same with the keys and
    values of the source (computed on the first step, as fairseq does). fairseq's path is taken whenever the
    fast one does not apply: no incremental state, attention weights asked for (the alignment layer),
    key-padding of the decoder input, bias_k / zero attention, dropout in training, autograd, beam-reduced
    cross attention (``set_beam_size`` > 1).

    Float32 stays float32; the sums are ordered differently (differences ~1e-6), so hypotheses equal the plain
    model's except at near-ties."""

    CACHE_BLOCK = 64

    def _fast(self, incremental_state, need_weights, need_head_weights, before_softmax):
        return (incremental_state is not None and not (need_weights or need_head_weights or before_softmax)
                and self.bias_k is None and not self.add_zero_attn and not self.onnx_trace
                and not (self.training and self.dropout_module.p > 0)
                and not (torch.is_grad_enabled() and getattr(getattr(self.q_proj, "weight", None), "requires_grad",
                                                             False)))

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, need_weights=True,
                static_kv=False, attn_mask=None, before_softmax=False, need_head_weights=False):
        if self._fast(incremental_state, need_weights, need_head_weights, before_softmax):
            if self.self_attention and key_padding_mask is None:
                return self._self_step(query, incremental_state, attn_mask), None
            if self.encoder_decoder_attention and static_kv and self.beam_size == 1 and attn_mask is None:
                return self._cross_step(query, key, key_padding_mask, incremental_state), None
        return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                               incremental_state=incremental_state, need_weights=need_weights, static_kv=static_kv,
                               attn_mask=attn_mask, before_softmax=before_softmax,
                               need_head_weights=need_head_weights)

    def _heads(self, x):  # [T, B, C] -> [B, H, T, d]
        return split_heads(x, self.num_heads)

    def _merge(self, attn):  # [B, H, T, d] -> [T, B, C] through out_proj
        return self.out_proj(merge_heads(attn))

    def _self_step(self, query, incremental_state, attn_mask):
        q, k, v = (self._heads(t) for t in qkv(self, query))
        state = self._get_input_buffer(incremental_state)
        prev = state.get("prev_key")
        n = 0 if prev is None else prev.size(2)
        for name, new in (("key", k), ("value", v)):  # a cache that fairseq's path wrote is copied in once
            state[f"cache_{name}"], state[f"prev_{name}"] = append_to_cache(
                state.get(f"cache_{name}"), state.get(f"prev_{name}"), new, n, self.CACHE_BLOCK)
        state["prev_key_padding_mask"] = None
        self._set_input_buffer(incremental_state, state)
        mask = attn_mask.to(q.dtype) if attn_mask is not None else None
        attn = torch.nn.functional.scaled_dot_product_attention(
            q, state["prev_key"], state["prev_value"], attn_mask=mask, scale=self.scaling)
        return self._merge(attn)

    def _cross_step(self, query, key, key_padding_mask, incremental_state):
        state = self._get_input_buffer(incremental_state)
        if state.get("prev_key") is None:  # first step: the source's keys and values, kept for every later step
            state["prev_key"] = self._heads(self.k_proj(key))
            state["prev_value"] = self._heads(self.v_proj(key))
            state["prev_key_padding_mask"] = key_padding_mask
            self._set_input_buffer(incremental_state, state)
        pad = state.get("prev_key_padding_mask")
        mask = None if pad is None else ~pad.to(torch.bool).view(pad.size(0), 1, 1, pad.size(1))
        q = self._heads(self.q_proj(query))
        attn = torch.nn.functional.scaled_dot_product_attention(
            q, state["prev_key"], state["prev_value"], attn_mask=mask, scale=self.scaling)
        return self._merge(attn)

    def reorder_incremental_state(self, incremental_state, new_order):
        state = self._get_input_buffer(incremental_state)
        if state.get("cache_key") is None or state.get("prev_key") is None:
            return super().reorder_incremental_state(incremental_state, new_order)
        n = state["prev_key"].size(2)
        for name in ("key", "value"):  # the preallocated buffers follow the hypotheses; prev_* stay views of them
            buf = state[f"cache_{name}"].index_select(0, new_order)
            state[f"cache_{name}"] = buf
            state[f"prev_{name}"] = buf[:, :, :n]
        self._set_input_buffer(incremental_state, state)
        return incremental_state


def fast_attention(model):
    """Every ``MultiheadAttention`` of ``model.decoder`` becomes a :class:`FastIncrementalAttention`, in place
    (its class changes; parameters and state_dict stay); returns the model in eval mode."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise FairseqExtError("fast_attention: the model has no .decoder (give a fairseq encoder-decoder model)")
    n = 0
    for m in decoder.modules():
        if type(m) is MultiheadAttention:
            m.__class__ = FastIncrementalAttention
            n += 1
    for layer in getattr(decoder, "layers", []):
        # a decoder layer computes its encoder attention's weights when its need_attn is set (fairseq's default
        # until make_generation_fast_), though the decoder keeps only the alignment layer's, which it asks for
        # explicitly: the other layers then take the fast path
        if hasattr(layer, "need_attn"):
            layer.need_attn = False
    if n == 0 and not any(isinstance(m, FastIncrementalAttention) for m in decoder.modules()):
        raise FairseqExtError("fast_attention: the decoder has no fairseq MultiheadAttention module to speed up")
    return model.eval()


SPEEDUPS = {  # name -> function(model); applied in this order
    "int8-output": lambda m: quantize_decoder(m, layers="output"),
    "int8-decoder": lambda m: quantize_decoder(m, layers="decoder"),
    "int8-encoder": quantize_encoder,
    "amx-int8-decoder": amx_quantize_decoder,
    "amx-int8-encoder": amx_quantize_encoder,
    "fast-attention": fast_attention,
    "prepack": prepack_output,
    "lean-decoder": lean_decoder,
    "lean-encoder": lean_encoder,
}


def apply_speedups(model, names: str, flag: str = "speedups"):
    """Applies the comma-separated speed-ups ``names`` (keys of :data:`SPEEDUPS`) to ``model``, int8 ones first,
    each once (one already applied to this model is skipped); returns the model."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SPEEDUPS]
    if unknown:
        raise FairseqExtError(f"{flag}: unknown speed-up {unknown[0]!r}; choose from {', '.join(SPEEDUPS)}")
    for what, group in (("the softmax projection", ("int8-decoder", "int8-output", "amx-int8-decoder", "prepack")),
                        ("the encoder's projections", ("int8-encoder", "amx-int8-encoder"))):
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
