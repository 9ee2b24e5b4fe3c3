"""A lean incremental decoder step for CPU decoding: the same float32 products as fairseq's
``TransformerDecoderLayerBase`` and ``MultiheadAttention``, without their per-call bookkeeping. The SAT generator
(``--task translation_sat``) decodes through it by default where :func:`lean_refusal` finds nothing against the
decoder and the call is float32 on the CPU (:func:`lean_applies`), calling :func:`lean_step` without changing the
model (``--no-lean-step``: the decoder's own step); ``--inference-speedups lean-decoder`` (:func:`lean_decoder`)
mixes it into the decoder's class, so that any generator (fairseq's too) takes it.

At batch 1 a decoder call of a small model (d 128-256, 3 layers) multiplies a handful of rows by each weight; most
of its time is not in those products but in the hundreds of PyTorch operations and Python calls around them
(fairseq's incremental-state dictionaries with their string keys, module calls, dropout and residual helpers,
shape checks; ``python -m benchmarks.speed.beam_parts`` shows where a call's time goes). This step does per layer
what the layer computes and nothing else:

* self-attention: one fused Q/K/V projection, the new keys and values written into a key/value cache
  preallocated ``CACHE_BLOCK`` positions at a time, ``F.scaled_dot_product_attention``;
* encoder-decoder attention: the source keys and values projected on the first step and kept once per source:
  the rows of a sentence's beam query them as one block, so a beam step's reorder moves no source tensor (only
  a sentence that leaves the batch does), and a generator need not reorder the encoder output
  (``holds_encoder_states``); the alignment layer (fairseq's default: the last) computes its weights
  explicitly, as the generator returns them as the hypothesis attention;
* the feed-forward block; layer norms before or after each block as the model was trained.

Which decoders. The lean step computes fairseq's ``TransformerDecoderBase`` (its own class, known here) and any
decoder class that declares, in the class that defines its ``extract_features_scriptable``::

    supports_lean_step = True          # "my incremental step is fairseq's layers over my new positions"

(as transformers' ``_supports_sdpa``). Such a decoder adds ``self.group_size`` positions a call (1 when it has no
such attribute) and, when a call adds several groups, gives their self-attention mask with
``incremental_self_attn_mask(first_query, num_keys, like)`` (an additive 0 / -inf mask; without it the causal
mask). A subclass that overrides ``extract_features_scriptable`` without declaring it again takes its own step:
the declaration is read from the class that defines the method, never inherited past an override.

It runs when the decoder is called with an incremental state, outside training and autograd, for any number of
new positions that is a multiple of the decoder's group size K. Everything else (training, full passes, fairseq's
own ``SequenceGenerator``, which feeds one token at a time to a K > 1 model) takes the decoder's own code. The
state lives in the incremental state under one key and is reordered by ``reorder_incremental_state`` like
fairseq's (large key/value buffers into a spare buffer kept for the next reorder, only their cached positions:
``reorder_cache``). Float32 stays float32; the sums are ordered differently (differences ~1e-6), so hypotheses
equal the plain model's except at near-ties (``tests/inference/``: incremental == full pass within 1e-5,
reorders with permutations, same hypotheses as the plain model).

Speculative decoding (``fairseq_ext/sat/speculative.py``) needs two more things of the state: :func:`rows_step`, a call
whose rows have cached lengths of their own (each row's new keys and values written at its own positions, its keys
masked per row), and :func:`cut_back`, which cuts the cache back to fewer positions by shortening the views of the
preallocated buffers (no copy; the next call writes over the rest).

Decoders the lean step refuses, with one line (:func:`lean_refusal`; the SAT generator decodes them through their
own step): no declaration (MSC, BERT-JAM), layers with cross-self-attention, NormFormer's extra norms or scaled
residuals (``attn_ln``, ``ffn_layernorm``, ``c_attn``, ``w_resid``), ``bias_k`` / zero attention, no encoder
attention, attention modules with their own code, an adaptive softmax.
"""

import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

with warnings.catch_warnings():  # torch.ao announces its move to torchao
    warnings.simplefilter("ignore")
    from torch.ao.nn.quantized.dynamic import Linear as _DynamicQuantizedLinear

from fairseq_ext.common.decoder_features import cached_length, decoder_output, embed_decoder_input, new_positions
from fairseq_ext.common.errors import FairseqExtError

STATE_KEY = "fairseq_ext.lean_decoder"
CACHE_BLOCK = 64  # positions a key/value cache grows by (the lean step's and the lean encoder's)
REORDER_USED_ONLY = 1 << 16  # buffers of this many elements or more: reorder only the cached positions


def declares_lean_step(decoder) -> bool:
    """Whether the class that defines ``decoder``'s ``extract_features_scriptable`` is fairseq's transformer decoder
    or declares ``supports_lean_step = True`` itself (module docstring)."""
    from fairseq.models.transformer import TransformerDecoderBase

    if not isinstance(decoder, TransformerDecoderBase):
        return False
    owner = next(c for c in type(decoder).__mro__ if "extract_features_scriptable" in vars(c))
    return owner is TransformerDecoderBase or bool(vars(owner).get("supports_lean_step", False))


def attention_refusal(att) -> Optional[str]:
    """Why the lean code does not compute fairseq's ``MultiheadAttention`` ``att``, or None."""
    from fairseq.modules import MultiheadAttention

    if type(att).forward is not MultiheadAttention.forward:
        return f"attention with its own code ({type(att).__name__})"
    if att.bias_k is not None or att.add_zero_attn:
        return "bias_k / zero attention"
    if not (att.qkv_same_dim and att.head_dim * att.num_heads == att.embed_dim):
        return "keys and values of another size than the queries"
    return None


def lean_refusal(decoder) -> Optional[str]:
    """Why the lean step does not compute ``decoder``'s step exactly (one line naming it), or None."""
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

    layers = list(getattr(decoder, "layers", []))
    if not layers or not declares_lean_step(decoder):
        return (f"lean_decoder: {type(decoder).__name__} does not declare supports_lean_step (fairseq's transformer "
                f"decoder and the SAT decoder do); decode it with its own step, without lean-decoder")
    for i, layer in enumerate(layers):
        why = None
        if not (isinstance(layer, TransformerDecoderLayerBase)
                and type(layer).forward is TransformerDecoderLayerBase.forward):
            why = f"its own layer code ({type(layer).__name__})"
        else:
            why = layer_refusal(layer)
        if why:
            return (f"lean_decoder: decoder layer {i} has {why}, which the lean step does not compute; decode this "
                    f"model without lean-decoder")
    if getattr(decoder, "adaptive_softmax", None) is not None:
        return "lean_decoder: the decoder has an adaptive softmax; decode it without lean-decoder"
    return None


def layer_refusal(layer, extra_attentions=()) -> Optional[str]:
    """What in a ``TransformerDecoderLayerBase`` (and its ``extra_attentions``) neither the lean nor the static step
    computes, or None: cross-self-attention, NormFormer's extras, no encoder attention, non-standard attention."""
    if getattr(layer, "cross_self_attention", False):
        return "cross-self-attention"
    if any(getattr(layer, a, None) is not None for a in ("attn_ln", "ffn_layernorm", "c_attn", "w_resid")):
        return "NormFormer's extra layer norms / scaled residuals"
    if getattr(layer, "encoder_attn", None) is None:
        return "no encoder attention"
    return next(filter(None, (attention_refusal(a) for a in (layer.self_attn, layer.encoder_attn)
                              + tuple(extra_attentions))), None)


def float32_on_cpu(decoder) -> bool:
    """The decoder's word embeddings are float32 on the CPU (checked on every call: a model can be moved or
    cast after its generator was built, e.g. fairseq-train's ``--eval-bleu`` generator)."""
    weight = getattr(getattr(decoder, "embed_tokens", None), "weight", None)
    return weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"


def _check(decoder):
    why = lean_refusal(decoder)
    if why:
        raise FairseqExtError(why)


def int8_weight_rows(w: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """(int8 values [out, in], the scale of each output row, float64) of a quantised qint8 weight with zero points
    0, per tensor or per row (PyTorch's dynamic quantisation gives these); None for any other weight."""
    if w.dtype != torch.qint8:
        return None
    if w.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric) and w.q_zero_point() == 0:
        return w.int_repr(), torch.full((w.size(0),), w.q_scale(), dtype=torch.double)
    if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric) and w.q_per_channel_axis() == 0 \
            and not w.q_per_channel_zero_points().any():
        return w.int_repr(), w.q_per_channel_scales().double()
    return None


def _stacked_float(ws):
    with torch.no_grad():
        weight = torch.cat([m.weight for m in ws]).detach()
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in ws]).detach()
    return lambda x: F.linear(x, weight, bias)


def _stacked_int8(ws):
    """PyTorch's dynamically quantised ``Linear`` of the three stacked int8 weights, each row keeping its scale
    (per-channel scales): the outputs equal the three calls' bit for bit (the activations are quantised once, as
    each call did with the same input); None when a weight is not symmetric int8 (:func:`int8_weight_rows`)."""
    weights = [m._packed_params._weight_bias() for m in ws]
    rows = [int8_weight_rows(w) for w, _ in weights]
    if any(r is None for r in rows):
        return None
    ints = torch.cat([r[0] for r in rows])
    scales = torch.cat([r[1] for r in rows])
    wq = torch._make_per_channel_quantized_tensor(ints, scales, torch.zeros_like(scales, dtype=torch.long), 0)
    bias = torch.cat([b if b is not None else w.new_zeros(w.size(0), dtype=torch.float) for w, b in weights])
    fused = _DynamicQuantizedLinear(ws[0].in_features, ints.size(0), dtype=torch.qint8)
    fused.set_weight_bias(wq, bias)
    return fused


def _projection_key(ws):
    """What identifies the three projections' weights now (a change makes the fused one again)."""
    if all(type(m) is torch.nn.Linear for m in ws):
        return "float", tuple((m.weight._version, m.weight.data_ptr()) for m in ws)
    if all(isinstance(m, _DynamicQuantizedLinear) for m in ws):
        return "int8", tuple(m._packed_params._packed_params for m in ws)
    return None, None


def _same_key(a, b) -> bool:
    return a[0] == b[0] and all(x is y or (isinstance(x, tuple) and x == y) for x, y in zip(a[1], b[1]))


def fused_qkv(att) -> Optional[Callable[[Tensor], Tensor]]:
    """The three projections of ``att`` (a fairseq ``MultiheadAttention``) as one call x -> [q | k | v], whatever
    they are: float ``nn.Linear`` (one [3C, C] product), PyTorch's int8 ``Linear`` (one int8 call, bit for bit the
    three calls); made once and again when a weight changes;
    None for any other mix (then they are called one by one). One int8 call instead of three costs well under half
    (``python -m benchmarks.speed.kernels``)."""
    ws = (att.q_proj, att.k_proj, att.v_proj)
    kind, key = _projection_key(ws)
    if kind is None:
        return None
    cached = getattr(att, "_fairseq_ext_fused_qkv", None)
    if cached is None or not _same_key(cached[0], (kind, key)):
        make = {"float": _stacked_float, "int8": _stacked_int8}[kind]
        cached = ((kind, key), make(ws))
        object.__setattr__(att, "_fairseq_ext_fused_qkv", cached)  # a tuple: not a submodule, no state_dict entry
    return cached[1]


def qkv(att, x: Tensor):
    """Queries, keys and values of x [T, B, C] through ``att``'s projections: one fused call (:func:`fused_qkv`)
    where it can, else one by one."""
    fused = fused_qkv(att)
    if fused is not None:
        return fused(x).chunk(3, dim=-1)
    return att.q_proj(x), att.k_proj(x), att.v_proj(x)


def split_heads(x: Tensor, H: int) -> Tensor:  # [T, B, C] -> [B, H, T, d]
    T, B, C = x.shape
    return x.view(T, B, H, C // H).permute(1, 2, 0, 3)


def merge_heads(a: Tensor) -> Tensor:  # [B, H, T, d] -> [T, B, H * d]
    B, H, T, d = a.shape
    return a.permute(2, 0, 1, 3).reshape(T, B, H * d)


def self_attention(att, h: Tensor, mask: Optional[Tensor], cache=None) -> Tensor:
    """What fairseq's ``MultiheadAttention`` ``att`` returns for self-attention over h [T, B, C] outside training:
    one q/k/v call (:func:`qkv`), the keys and values through ``cache(k, v)`` (the decoder's cache: the keys and
    values of every position so far) when given, ``F.scaled_dot_product_attention`` with ``mask`` (True:
    attend), the output projection."""
    q, k, v = (split_heads(t, att.num_heads) for t in qkv(att, h))
    if cache is not None:
        k, v = cache(k, v)
    return att.out_proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=att.scaling)))


def feed_forward(layer, x: Tensor) -> Tensor:
    """A fairseq transformer layer's feed-forward block outside training, with its residual and its layer norm
    before or after (``normalize_before``)."""
    nb = layer.normalize_before
    h = layer.final_layer_norm(x) if nb else x
    x = x + layer.fc2(layer.activation_fn(layer.fc1(h)))
    return x if nb else layer.final_layer_norm(x)


def append_to_cache(buf: Optional[Tensor], old: Optional[Tensor], new: Tensor, n: int, block: int):
    """Writes the new keys or values [B, H, T, d] at positions n..n+T-1 of a buffer preallocated ``block``
    positions at a time (re-made, with the n cached positions ``old`` copied in, when there is none, it is too
    small, or ``old`` is not a view of it, e.g. a cache that fairseq's path wrote); returns (buffer, view of
    positions 0..n+T-1)."""
    B, H, T, d = new.shape
    if buf is None or old is None or buf.size(0) != B or old.data_ptr() != buf.data_ptr() or n + T > buf.size(2):
        grown = new.new_empty(B, H, max(block, 2 * (n + T)), d)
        if n:
            grown[:, :, :n] = old
        buf = grown
    buf[:, :, n: n + T] = new
    return buf, buf[:, :, : n + T]


def by_source(x: Tensor, P: int) -> Tensor:  # [N, H, T, d] -> [N / P, H, P * T, d]: rows r // P together
    if P == 1:
        return x
    N, H, T, d = x.shape
    return x.reshape(N // P, P, H, T, d).transpose(1, 2).reshape(N // P, H, P * T, d)


def by_row(x: Tensor, P: int) -> Tensor:  # the inverse of by_source: [N / P, H, P * T, e] -> [N, H, T, e]
    if P == 1:
        return x
    M, H, PT, e = x.shape
    return x.reshape(M, H, P, PT // P, e).transpose(1, 2).reshape(M * P, H, PT // P, e)


def equal_runs(values: List[int]) -> Optional[Tuple[List[int], int]]:
    """(the value of each run, the run length) when ``values`` is runs of one value, all of the same length;
    else None. [3, 3, 5, 5] -> ([3, 5], 2); [3, 5] -> ([3, 5], 1); [3, 3, 5] -> None."""
    if not values:
        return None
    P = 1
    while P < len(values) and values[P] == values[0]:
        P += 1
    if len(values) % P:
        return None
    firsts = values[::P]
    if any(v != firsts[j // P] for j, v in enumerate(values)):
        return None
    return firsts, P


def reorder_cache(buf: Tensor, spare: Optional[Tensor], order: Tensor, n: int) -> Tuple[Tensor, Tensor]:
    """A key/value buffer [B, H, capacity, d] reordered along B; returns (the reordered buffer, the next spare).
    A large buffer (a batch's beams, ``REORDER_USED_ONLY`` elements or more) is reordered into ``spare`` (the
    buffer of the previous reorder, when its shape fits), and only its n cached positions are copied: no
    allocation and less time than a fresh ``index_select`` of the whole capacity (``python -m
    benchmarks.speed.kernels --parts 2`` times both); the old buffer is the next spare. A small one (a single
    sentence's beam) takes the fresh ``index_select``, which is faster there, and keeps no spare."""
    if buf.numel() < REORDER_USED_ONLY:
        return buf.index_select(0, order), spare
    shape = (order.size(0),) + tuple(buf.shape[1:])
    if spare is None or tuple(spare.shape) != shape:
        spare = buf.new_empty(shape)
    if n < buf.size(2):
        torch.index_select(buf[:, :, :n], 0, order, out=spare[:, :, :n])
    else:
        torch.index_select(buf, 0, order, out=spare)
    return spare, buf


def causal_mask(first_query: int, num_keys: int, like: Tensor) -> Tensor:
    """Additive causal mask (0 / -inf) of query positions first_query..num_keys-1 over keys 0..num_keys-1."""
    i = torch.arange(first_query, num_keys, device=like.device).unsqueeze(1)
    j = torch.arange(num_keys, device=like.device).unsqueeze(0)
    return torch.zeros(i.size(0), num_keys, dtype=like.dtype, device=like.device).masked_fill_(j > i, float("-inf"))


def lean_applies(decoder, prev_output_tokens: Tensor, incremental_state, full_context_alignment: bool = False,
                 alignment_layer: Optional[int] = None) -> bool:
    """Whether this call of ``decoder`` (an incremental step) is one the lean step computes: outside training
    and autograd, the alignment layer (if asked for) the last, a state the lean step began (or none yet), and
    new positions that are whole groups of the decoder's K."""
    if incremental_state is None or decoder.training or full_context_alignment:
        return False
    if needs_autograd(decoder.layers[0]):
        return False
    if alignment_layer is not None and alignment_layer != decoder.num_layers - 1:
        return False
    state = incremental_state.get(STATE_KEY)
    if state is None and cached_length(decoder, incremental_state) > 0:
        return False  # a state that fairseq's path began (e.g. before lean_decoder was applied)
    n = 0 if state is None or state.get("k0") is None else state["k0"].size(2)
    new = prev_output_tokens.size(1) - n
    K = int(getattr(decoder, "group_size", 1))
    return new > 0 and new % K == 0


def lean_step(decoder, prev_output_tokens: Tensor, encoder_out, incremental_state,
              alignment_heads: Optional[int] = None):
    """The features of the uncached positions of ``prev_output_tokens`` and fairseq's extra dictionary, as the
    decoder's ``extract_features`` returns them, computed by the lean step (for a call :func:`lean_applies`
    accepts; the decoder's class is not changed)."""
    state: Dict[str, Optional[Tensor]] = incremental_state.setdefault(STATE_KEY, {})
    bsz, slen = prev_output_tokens.size()
    n = 0 if state.get("k0") is None else state["k0"].size(2)
    T = slen - n
    K = int(getattr(decoder, "group_size", 1))
    positions = None if decoder.embed_positions is None else new_positions(decoder, prev_output_tokens, n)
    x = embed_decoder_input(decoder, prev_output_tokens[:, n:], positions)
    mask: Optional[Tensor] = None
    if T > K:  # several groups at once: rows n..slen-1 of the relaxed causal mask (K = 1: the causal mask)
        own = getattr(decoder, "incremental_self_attn_mask", None)
        mask = own(n, slen, x) if own is not None else causal_mask(n, slen, x)
    return _layers(decoder, x, encoder_out, state, mask, lambda i, k, v: _lean_cache(state, i, k, v, n),
                   alignment_heads)


def _layers(decoder, x: Tensor, encoder_out, state, mask: Optional[Tensor], cache, alignment_heads: Optional[int]):
    """The decoder's layers over the embedded new positions x [T, B, C]: self-attention under ``mask`` over the
    keys and values ``cache(layer, k, v)`` returns, encoder-decoder attention, feed-forward; fairseq's output."""
    enc = encoder_out["encoder_out"][0] if encoder_out and len(encoder_out["encoder_out"]) > 0 else None
    if enc is None:
        raise FairseqExtError("lean_decoder: the decoder was called without an encoder output")
    if "cross_mask" not in state:  # first step: the source's padding as an attention mask (True: attend)
        pads = encoder_out.get("encoder_padding_mask") or []
        pad = pads[0] if len(pads) > 0 else None
        state["cross_mask"] = None if pad is None or not bool(pad.any()) else \
            (~pad.to(torch.bool)).view(pad.size(0), 1, 1, pad.size(1))
    cross_mask = state["cross_mask"]
    P = int(state.get("cross_rows", 1))  # rows per source: row r reads source r // P (see the reorder)

    attn: Optional[Tensor] = None
    inner_states: List[Optional[Tensor]] = [x]
    last = decoder.num_layers - 1
    for i, layer in enumerate(decoder.layers):
        nb = layer.normalize_before
        sa, ca = layer.self_attn, layer.encoder_attn
        # self-attention over the cache and the new positions
        residual = x
        h = layer.self_attn_layer_norm(x) if nb else x
        x = residual + self_attention(sa, h, mask, lambda k, v, i=i: cache(i, k, v))
        if not nb:
            x = layer.self_attn_layer_norm(x)
        # encoder-decoder attention: the source keys and values projected on the first step
        residual = x
        h = layer.encoder_attn_layer_norm(x) if nb else x
        ck, cv = state.get(f"ck{i}"), state.get(f"cv{i}")
        if ck is None:
            ck, cv = split_heads(ca.k_proj(enc), ca.num_heads), split_heads(ca.v_proj(enc), ca.num_heads)
            state[f"ck{i}"], state[f"cv{i}"] = ck, cv
        # the P rows that share a source (a sentence's beam) query its keys and values as one block
        q = by_source(split_heads(ca.q_proj(h), ca.num_heads), P)
        if i == last:  # the alignment layer: the weights too (fairseq's bmm / softmax in float / bmm)
            scores = torch.matmul(q * ca.scaling, ck.transpose(-1, -2))
            if cross_mask is not None:
                scores = scores.masked_fill(~cross_mask, float("-inf"))
            weights = torch.softmax(scores.float(), dim=-1).type_as(scores)
            a = torch.matmul(weights, cv)
            attn = by_row(weights, P).transpose(0, 1)  # [H, B, T, S], as fairseq's need_head_weights returns
        else:
            a = F.scaled_dot_product_attention(q, ck, cv, attn_mask=cross_mask, scale=ca.scaling)
        x = residual + ca.out_proj(merge_heads(by_row(a, P)))
        if not nb:
            x = layer.encoder_attn_layer_norm(x)
        x = feed_forward(layer, x)
        inner_states.append(x)
    if attn is not None:
        attn = attn.float().to(x)
    return decoder_output(decoder, x, attn, inner_states, alignment_heads)


def _lean_cache(state, i: int, k: Tensor, v: Tensor, n: int):
    """Appends the new keys / values [B, H, T, d] of layer i at positions n..n+T-1 of its preallocated buffers;
    returns the views of positions 0..n+T-1."""
    out = []
    for name, new in (("k", k), ("v", v)):
        buf, view = append_to_cache(state.get(f"{name}buf{i}"), state.get(f"{name}{i}"), new, n, CACHE_BLOCK)
        state[f"{name}buf{i}"], state[f"{name}{i}"] = buf, view
        out.append(view)
    return out


# -- a cached length per row, and cutting a cache back (speculative decoding: fairseq_ext/sat/speculative.py) ------
def _position_table(decoder) -> Optional[Tensor]:
    from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding

    ep = decoder.embed_positions
    if isinstance(ep, SinusoidalPositionalEmbedding):
        return ep.weights
    return ep.weight if isinstance(ep, LearnedPositionalEmbedding) else None


def rows_refusal(decoder) -> Optional[str]:
    """Why :func:`rows_step` does not compute ``decoder``'s step exactly (one line), or None."""
    why = lean_refusal(decoder)
    if why is None and decoder.embed_positions is not None and _position_table(decoder) is None:
        why = (f"lean_decoder: the positional embeddings {type(decoder.embed_positions).__name__} are neither "
               f"fairseq's learned nor its sinusoidal ones")
    return why


def rows_step(decoder, tokens: Tensor, lengths: List[int], encoder_out, incremental_state, group: int = 1,
              alignment_heads: Optional[int] = None):
    """The lean step with a cached length per row: the T inputs ``tokens[r]`` of row r sit at positions
    lengths[r]..lengths[r]+T-1, their keys and values are written there in the preallocated buffers (over what a
    cache cut back by :func:`cut_back` held beyond lengths[r]), and each new position attends the row's cached
    positions 0..lengths[r]-1 and the call's new positions up to itself, except that the call's last ``group``
    positions see each other (a SAT group; ``group=1``: causal, an autoregressive decoder). Returns what
    :func:`lean_step` returns for the T new positions. A call whose rows share one length attends as
    :func:`lean_step` does (no mask for a single group); other calls mask each row's keys. Positional embeddings
    past the table's end take its last row (a search never reads such a position: it ends at --max-len). The
    state is :func:`lean_step`'s: the key and value views end at the longest row."""
    state: Dict[str, Optional[Tensor]] = incremental_state.setdefault(STATE_KEY, {})
    B, T = tokens.shape
    n_max = max(lengths)
    uniform = min(lengths) == n_max
    dev = tokens.device
    keys = n_max + T
    positions: Optional[Tensor] = None
    table = _position_table(decoder) if decoder.embed_positions is not None else None
    first = decoder.embed_positions.padding_idx + 1 if table is not None else 0
    if uniform:  # one slice of the table and of a kept mask (T, group): no index tensors
        if table is not None and first + keys <= table.size(0):
            positions = table[first + n_max: first + keys].unsqueeze(0).expand(B, -1, -1)
        elif table is not None:
            positions = table[(torch.arange(n_max, keys, device=dev) + first).clamp_(max=table.size(0) - 1)]
            positions = positions.unsqueeze(0).expand(B, -1, -1)
        where = n_max
    else:
        starts = torch.tensor(lengths, device=dev).view(B, 1)
        new = starts + torch.arange(T, device=dev)  # [B, T] the positions of the call
        if table is not None:
            positions = table[(new + first).clamp_(max=table.size(0) - 1)]
        # key j is visible to the query at offset t when j <= that query's last key
        t = torch.arange(T, device=dev)
        last = (starts + torch.where(t >= T - group, T - 1, t)).unsqueeze(2)  # [B, T, 1]
        mask = (torch.arange(keys, device=dev).view(1, 1, keys) <= last).unsqueeze(1)  # [B, 1, T, keys]
        where = (torch.arange(B, device=dev).view(B, 1), new)
    x = embed_decoder_input(decoder, tokens, positions)
    if uniform:
        mask = None if T <= group else _group_mask(T, group, keys, x)
    return _layers(decoder, x, encoder_out, state, mask, lambda i, k, v: _rows_cache(state, i, k, v, where, keys),
                   alignment_heads)


_GROUP_MASKS: Dict[Tuple[int, int, str, torch.dtype], Tensor] = {}
_MASK_KEYS = 1024  # keys of a kept mask; longer calls make theirs


def _group_mask(T: int, group: int, keys: int, like: Tensor) -> Tensor:
    """The additive mask [1, 1, T, keys] (0 / -inf) of a call of T new positions after keys - T cached ones, the
    last ``group`` of them seeing each other: the last ``keys`` columns of a mask kept per (T, group), a view (a
    boolean mask costs the attention a conversion per call)."""
    def make(width):
        t = torch.arange(T, device=like.device)
        last = width - T + torch.where(t >= T - group, T - 1, t)
        hidden = torch.arange(width, device=like.device).view(1, -1) > last.view(-1, 1)
        return torch.zeros(T, width, dtype=like.dtype, device=like.device).masked_fill_(hidden, float("-inf"))

    if keys > _MASK_KEYS:
        return make(keys).view(1, 1, T, keys)
    key = (T, group, str(like.device), like.dtype)
    full = _GROUP_MASKS.get(key)
    if full is None:
        full = _GROUP_MASKS[key] = make(_MASK_KEYS)
    return full[:, _MASK_KEYS - keys:].view(1, 1, T, keys)


def _rows_cache(state, i: int, k: Tensor, v: Tensor, where, keys: int):
    """Writes the new keys / values [B, H, T, d] of layer i at one position for all rows (``where`` an int) or at
    each row's own (``where`` = (row index [B, 1], positions [B, T])); returns the views of positions 0..keys-1."""
    out = []
    B, H, T, d = k.shape
    for name, new in (("k", k), ("v", v)):
        buf, old = state.get(f"{name}buf{i}"), state.get(f"{name}{i}")
        if buf is None or buf.size(0) != B or keys > buf.size(2):
            # zeros: a row's masked keys and values beyond its own positions are read (with weight 0: finite only)
            grown = new.new_zeros(B, H, max(CACHE_BLOCK, 2 * keys), d)
            if old is not None and old.size(0) == B:
                kept = min(old.size(2), keys)
                grown[:, :, :kept] = old[:, :, :kept]
            buf = grown
        if isinstance(where, int):
            buf[:, :, where: where + T] = new
        else:
            buf[where[0], :, where[1]] = new.transpose(1, 2)
        state[f"{name}buf{i}"], state[f"{name}{i}"] = buf, buf[:, :, :keys]
        out.append(state[f"{name}{i}"])
    return out


def reorder_rows_state(decoder, incremental_state, order: Tensor) -> None:
    """The state of :func:`rows_step` follows ``order`` (rows of the batch): whole buffers are selected, so that
    every position a row may read masked stays finite (:func:`reorder_lean_state` copies the cached positions
    only)."""
    state = incremental_state[STATE_KEY]
    _reorder_sources(decoder, state, order)
    for i in range(decoder.num_layers):
        for name in ("k", "v"):
            if state.get(f"{name}buf{i}") is not None:
                n = state[f"{name}{i}"].size(2)
                state[f"{name}buf{i}"] = state[f"{name}buf{i}"].index_select(0, order)
                state[f"{name}{i}"] = state[f"{name}buf{i}"][:, :, :n]


def cut_back(decoder, incremental_state, length: int) -> None:
    """The lean state's cached keys and values end at position ``length`` (exclusive): a length change of the views
    of the preallocated buffers, nothing copied; the positions beyond are written over by the next call
    (:func:`lean_step` at ``length``, or :func:`rows_step`)."""
    state = incremental_state[STATE_KEY]
    for i in range(decoder.num_layers):
        for name in ("k", "v"):
            buf = state.get(f"{name}buf{i}")
            if buf is not None:
                state[f"{name}{i}"] = buf[:, :, :length]


def only_lean_state(incremental_state) -> bool:
    """The lean step's state is the only one that holds anything (fairseq's attention modules hold none: the
    lean step does not use them), so reordering it (:func:`reorder_lean_state`) is the whole reorder."""
    return incremental_state is not None and STATE_KEY in incremental_state and all(
        key == STATE_KEY or (isinstance(value, dict) and not value) for key, value in incremental_state.items())


def reorder_lean_state(decoder, incremental_state, new_order) -> None:
    """The lean step's state follows ``new_order`` (rows of the batch)."""
    state = incremental_state[STATE_KEY]
    n = state["k0"].size(2) if state.get("k0") is not None else 0
    _reorder_sources(decoder, state, new_order)
    for i in range(decoder.num_layers):
        for name in ("k", "v"):  # the preallocated buffers; k{i} / v{i} stay views of them
            buf = state.get(f"{name}buf{i}")
            if buf is not None:
                buf, state[f"{name}spare{i}"] = reorder_cache(buf, state.get(f"{name}spare{i}"), new_order, n)
                state[f"{name}buf{i}"], state[f"{name}{i}"] = buf, buf[:, :, :n]


def holds_encoder_states(decoder, incremental_state) -> bool:
    """True once the lean step has the source keys and values of every layer (and the source's padding): its
    later steps do not read the encoder output, so a generator need not reorder it."""
    state = incremental_state.get(STATE_KEY) if incremental_state is not None else None
    return state is not None and "cross_mask" in state and all(
        state.get(f"ck{i}") is not None for i in range(decoder.num_layers))


def _reorder_sources(decoder, state, new_order):
    """The source keys / values (and padding mask) are kept once per source, not per row: row r reads source
    r // P. A beam search's reorder keeps each sentence's rows together (P of them, picked among its own
    hypotheses), so only a change of the sentences (one finished, the first step's expansion to the beam)
    moves source tensors; any other order (a permutation across sentences) gives every row its own copy again
    (P = 1). One host read of the order per reorder."""
    if state.get("ck0") is None:
        return
    P = int(state.get("cross_rows", 1))
    sources = new_order if P == 1 else torch.div(new_order, P, rounding_mode="floor")
    blocks = equal_runs(sources.tolist())
    if blocks is None:
        index, state["cross_rows"] = sources, 1
    else:
        firsts, state["cross_rows"] = blocks
        index = None if firsts == list(range(state["ck0"].size(0))) else \
            torch.tensor(firsts, dtype=torch.long, device=new_order.device)
    if index is None:
        return
    if state.get("cross_mask") is not None:
        state["cross_mask"] = state["cross_mask"].index_select(0, index)
    for i in range(decoder.num_layers):
        for name in ("ck", "cv"):
            if state.get(f"{name}{i}") is not None:
                state[f"{name}{i}"] = state[f"{name}{i}"].index_select(0, index)


class LeanIncrementalDecoding:
    """Mixed into a decoder's class by :func:`lean_decoder` (before the decoder's own class): overrides
    ``extract_features_scriptable`` for incremental steps (:func:`lean_step`) and ``reorder_incremental_state``
    for its state, so that any generator (fairseq's too) decodes through the lean step."""

    supports_lean_step = True  # its extract_features_scriptable is the lean step (or the decoder's own one)

    def extract_features_scriptable(self, prev_output_tokens, encoder_out, incremental_state=None,
                                    full_context_alignment: bool = False, alignment_layer: Optional[int] = None,
                                    alignment_heads: Optional[int] = None):
        if not lean_applies(self, prev_output_tokens, incremental_state, full_context_alignment, alignment_layer):
            return super().extract_features_scriptable(
                prev_output_tokens, encoder_out, incremental_state, full_context_alignment=full_context_alignment,
                alignment_layer=alignment_layer, alignment_heads=alignment_heads)
        return lean_step(self, prev_output_tokens, encoder_out, incremental_state, alignment_heads)

    def reorder_incremental_state_scripting(self, incremental_state, new_order):
        """The entry point of fairseq's generators (and of the SAT generator): fairseq's walks every submodule and
        reorders each one's state, 97 modules of a 3-layer decoder (one ``hasattr`` each per call, once per word of
        a beam search; ``python -m benchmarks.speed.beam_parts`` times the walk). When the lean step's state is the
        only one (:func:`only_lean_state`), reordering it is the whole job; any other state (a step that fell back
        to fairseq's path) takes fairseq's walk."""
        if only_lean_state(incremental_state):
            reorder_lean_state(self, incremental_state, new_order)
            return
        super().reorder_incremental_state_scripting(incremental_state, new_order)

    def reorder_incremental_state(self, incremental_state, new_order):
        if incremental_state is None or incremental_state.get(STATE_KEY) is None:
            return super().reorder_incremental_state(incremental_state, new_order)
        reorder_lean_state(self, incremental_state, new_order)
        return incremental_state

    def holds_encoder_states(self, incremental_state) -> bool:
        return holds_encoder_states(self, incremental_state)


_LEAN_CLASSES: Dict[Tuple[type, type], type] = {}


def mix_in(module, mixin: type) -> None:
    """``module``'s class becomes a subclass of its own class with ``mixin`` first (made once per pair and kept;
    parameters and state_dict unchanged); nothing when it already has the mixin. Used by :func:`lean_decoder` and
    :func:`fairseq_ext.inference.lean_encoder.lean_encoder`."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    if (mixin, cls) not in _LEAN_CLASSES:
        _LEAN_CLASSES[mixin, cls] = type(f"Lean{cls.__name__}", (mixin, cls), {})
    module.__class__ = _LEAN_CLASSES[mixin, cls]


def needs_autograd(module) -> bool:
    """Whether a call of ``module`` now records gradients for its parameters (then the lean code steps aside)."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())


def lean_decoder(model):
    """``model.decoder`` decodes incremental steps through :class:`LeanIncrementalDecoding` (its class becomes a
    subclass of its own class with the mixin; parameters and state_dict unchanged); returns the model in eval
    mode. Raises a one-line error for a decoder the lean step does not compute exactly."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise FairseqExtError("lean_decoder: the model has no .decoder (give a fairseq encoder-decoder model)")
    if isinstance(decoder, LeanIncrementalDecoding):
        return model.eval()
    _check(decoder)
    mix_in(decoder, LeanIncrementalDecoding)
    return model.eval()

