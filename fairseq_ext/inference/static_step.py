"""The static decoder step: one captured graph per decoder computes a whole incremental call (K new positions of N
rows) with no Python per operation, over key/value caches preallocated for the whole search and written in place
(CTranslate2's design, on PyTorch's kernels).

What one call computes, for a decoder :func:`~fairseq_ext.inference.lean_decoder.lean_refusal` accepts (fairseq's
``transformer`` decoder, the SAT decoder, BERT-JAM's ``--bert-jam-decoder standard``) in float32 on the CPU: the
embedded tokens ``[N, K]`` at positions ``idx`` (K consecutive positions, the first a multiple of K), every layer's
self-attention over the cached keys and values with the new ones written at ``idx`` in place (keys at or after
``idx[-1] + 1`` masked: the causal mask for K = 1, the SAT's relaxed causal mask for a group), encoder-decoder
attention over the source keys and values projected once per search (the last layer's weights averaged over heads:
fairseq's alignment attention), the feed-forward block, the final layer norm and the output projection; it returns
the logits ``[N, K, V]`` and that attention ``[N, K, S]``.

A decoder whose layers read memories of their own declares, in the class that defines its
``extract_features_scriptable``, ``static_step_memories(encoder_out)`` -> (the memory [S, N, C] each layer's
encoder attention reads, each layer's second memory or None, the source padding): ``msc_transformer`` (block n and
its context C^n). A layer with a second memory has a ``context_attn`` over it, whose output joins the encoder
attention's through ``layer.gate(a_h, a_c)`` (summed without a gate). A decoder whose layers compute another step
names, in the same class, ``static_step_graph()``: a :class:`StepGraph` subclass that says which caches, memories
and projections it needs and computes the call (``bert_jam``'s Eq. 10 decoder: ``fairseq_ext/bert_jam/
static_step.py``).

Shapes are free: the graph reads N, K, S and the cache length from its inputs, so one graph per decoder serves
every batch size, beam, source length and length bucket (the cache is handed to it in buckets of
:data:`LENGTH_BUCKET` positions, so that early steps attend over fewer masked keys). The source keys and values
are kept once per source: the rows of a sentence's beam query them as one block, and a reorder within the beams
moves no source tensor. The weights are constants of the graph, each in the layout its few-row product is
fastest in (:func:`_layout`).

Capture: ``torch.jit.trace`` at once (tens of milliseconds), then, where a C++ compiler is there, the same module
exported by ``torch.export`` and compiled by AOTInductor in a background process, cached on disk: every search that
starts once the package is written runs its calls of up to :data:`AOT_MAX_POSITIONS` new positions (rows x K) on
it, in this process and in every later run (:mod:`fairseq_ext.inference.aot_step`; ``FAIRSEQ_EXT_STEP_CAPTURE=trace``
keeps the trace); larger calls stay traced, where the compiled graph was slower. The compiled module computes
attention in explicit operations, its products as sums, which inductor fuses (:meth:`StepGraph._attend`).
``python -m benchmarks.speed.decode --capture`` times each way at 1, 4, 16 and 64 rows. Where ``torch.jit.trace`` is
gone or fails (PyTorch 2.13 marks TorchScript deprecated), the same module runs eagerly (one log line).

Numbers: the same float32 products as fairseq's layers in another order (differences ~1e-6), so a search on it
returns fairseq's hypotheses except at near-ties; ``tests/inference/test_static_step.py`` checks incremental ==
full pass within 1e-5, reorders with permutations, and the hypotheses on the Acts test against fairseq's generator.
"""

import copy
import logging
import warnings
import weakref
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_ext.inference import aot_step, projection_kernel
from fairseq_ext.inference.lean_decoder import _DynamicQuantizedLinear as DynamicQuantizedLinear
from fairseq_ext.inference.lean_decoder import _stacked_int8 as stacked_int8
from fairseq_ext.inference.lean_decoder import equal_runs, lean_refusal

logger = logging.getLogger(__name__)

STATE_KEY = "fairseq_ext.static_step"
LENGTH_BUCKET = 32  # cache positions handed to a call: the positions so far rounded up to a multiple of this


def static_refusal(model) -> Optional[str]:
    """Why the static step does not compute the step of ``model`` (or of a decoder) exactly (one line), or None."""
    from fairseq.models import BaseFairseqModel
    from fairseq.models.transformer import TransformerModelBase

    decoder = getattr(model, "decoder", model)
    fairseqs = (BaseFairseqModel.get_normalized_probs, TransformerModelBase.get_normalized_probs)
    if decoder is not model and (type(model).get_normalized_probs not in fairseqs or type(
            model).get_normalized_probs_scriptable is not BaseFairseqModel.get_normalized_probs_scriptable):
        return "static step: the model has its own get_normalized_probs (the step computes fairseq's log-softmax)"
    return graph_class(decoder).refusal(decoder)


def decoder_refusal(decoder, projections) -> Optional[str]:
    """What every graph checks beyond its layers: fairseq's embeddings (learned or sinusoidal positions), no
    quant-noise or dimension projections, fairseq's log-softmax, and ``projections`` float ``nn.Linear`` or
    PyTorch's int8 dynamic ``Linear``."""
    from fairseq.models import FairseqDecoder
    from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding

    ep = decoder.embed_positions
    if ep is not None and not isinstance(ep, (LearnedPositionalEmbedding, SinusoidalPositionalEmbedding)):
        return f"static step: positional embeddings {type(ep).__name__} are neither fairseq's learned nor sinusoidal"
    for name in ("get_normalized_probs", "get_normalized_probs_scriptable"):
        if getattr(type(decoder), name) is not getattr(FairseqDecoder, name):
            return f"static step: the decoder has its own {name} (the step computes fairseq's log-softmax)"
    for name in ("quant_noise", "project_in_dim", "project_out_dim"):
        if getattr(decoder, name, None) is not None:
            return f"static step: the decoder has {name}, which the static step does not compute"
    for m in projections:
        if type(m) is not torch.nn.Linear and not (isinstance(m, DynamicQuantizedLinear) and m.weight().dtype ==
                                                   torch.qint8):
            return (f"static step: a projection is a {type(m).__name__}, neither a float nn.Linear nor PyTorch's "
                    f"int8 dynamic Linear")
    return None


def graph_class(decoder):
    """The :class:`StepGraph` class that computes ``decoder``'s step: the one the class defining its
    ``extract_features_scriptable`` names in ``static_step_graph()`` (module docstring: a decoder whose layers
    compute another step), else :class:`StepGraph`."""
    owner = next((c for c in type(decoder).__mro__ if "extract_features_scriptable" in vars(c)), None)
    declared = vars(owner).get("static_step_graph") if owner is not None else None
    return declared.__func__() if isinstance(declared, staticmethod) else StepGraph


def declares_memories(decoder) -> bool:
    """Whether the class that defines ``decoder``'s ``extract_features_scriptable`` defines
    ``static_step_memories`` (module docstring: a decoder whose layers read memories of their own)."""
    from fairseq.models.transformer import TransformerDecoderBase

    if not isinstance(decoder, TransformerDecoderBase):
        return False
    owner = next(c for c in type(decoder).__mro__ if "extract_features_scriptable" in vars(c))
    return "static_step_memories" in vars(owner)


def _declared_refusal(decoder) -> Optional[str]:
    """:func:`~fairseq_ext.inference.lean_decoder.lean_refusal`'s checks for a decoder that declares
    ``static_step_memories``, whose layers have code of their own by design."""
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

    from fairseq_ext.inference.lean_decoder import layer_refusal

    for i, layer in enumerate(decoder.layers):
        if not isinstance(layer, TransformerDecoderLayerBase):
            why = f"a layer of class {type(layer).__name__}"
        else:
            ctx = getattr(layer, "context_attn", None)
            why = layer_refusal(layer, () if ctx is None else (ctx,))
        if why:
            return f"static step: decoder layer {i} has {why}; decode it with its own step"
    if getattr(decoder, "adaptive_softmax", None) is not None:
        return "static step: the decoder has an adaptive softmax"
    return None


def _weights_key(decoder) -> tuple:
    """What the graph copied from ``decoder`` (:meth:`StepGraph.weight_modules`: float weights by identity, data
    and version; int8 ones by their packed weight, which ``set_weight_bias`` and ``load_state_dict`` replace). A
    change (a weight updated in place, a module replaced, int8 applied after a float graph was made) makes the
    graph again."""
    key = []
    for m in graph_class(decoder).weight_modules(decoder):
        if m is None:
            key.append(None)
        elif isinstance(m, DynamicQuantizedLinear):
            key.append(id(m._packed_params._packed_params))
        else:
            key.extend((id(p), p.data_ptr(), p._version) for p in m._parameters.values() if p is not None)
    return tuple(key)


def _layout(w: Tensor) -> Tuple[Tensor, bool]:
    """A weight [out, in] in the layout of its product: ``[in, out]`` (transposed, True) when out >= in, as MKL's
    few-row product is faster so for the projections out of the model width (q/k/v, fc1, the output projection),
    kept ``[out, in]`` for the ones into it (fc2) (``python -m benchmarks.speed.decode --capture`` times both per
    shape)."""
    w = w.detach()
    return (w.t().contiguous(), True) if w.size(0) >= w.size(1) else (w.contiguous(), False)


def _bias(m) -> Optional[Tensor]:
    return m.bias.detach() if m.bias is not None else None


class Projections:
    """The projections of the graph: a float ``nn.Linear`` as (weight in its layout, transposed, bias); PyTorch's
    int8 dynamic ``Linear`` as the module itself (kept in ``modules``, so that the trace holds its packed int8
    weight). Three stacked projections (q / k / v) are one product: float weights concatenated, int8 ones fused
    by :func:`~fairseq_ext.inference.lean_decoder.fused_qkv`'s rule (the same outputs as the three calls)."""

    def __init__(self):
        self.modules = torch.nn.ModuleList()

    def __call__(self, *ms):
        if all(type(m) is torch.nn.Linear for m in ms):
            if len(ms) == 1:
                return _layout(ms[0].weight) + (_bias(ms[0]),)
            b = None
            if any(m.bias is not None for m in ms):  # a missing bias stacks as zeros
                b = torch.cat([_bias(m) if m.bias is not None else m.weight.new_zeros(m.out_features) for m in ms])
            return _layout(torch.cat([m.weight for m in ms])) + (b,)
        if len(ms) > 1:  # int8 (or a mix): one fused int8 product where the weights stack, else one each
            fused = stacked_int8(ms) if all(isinstance(m, DynamicQuantizedLinear) for m in ms) else None
            if fused is None:
                return tuple(self(m) for m in ms)
            ms = (fused,)
        module = ms[0]
        self.modules.append(module)
        return (module,)


def linear(x: Tensor, spec) -> Tensor:
    if len(spec) == 1:  # PyTorch's int8 dynamic Linear
        return spec[0](x)
    if isinstance(spec[0], tuple):  # several int8 projections that do not stack
        return torch.cat([linear(x, s) for s in spec], dim=-1)
    w, transposed, b = spec
    if not transposed:
        return F.linear(x, w, b)
    return torch.matmul(x, w) if b is None else torch.addmm(b, x, w)


def norm_of(ln):
    """(weight, bias, eps) of a fairseq LayerNorm (torch's or a fused one)."""
    return ln.weight.detach(), ln.bias.detach(), float(ln.eps)


class StepGraph(torch.nn.Module):
    """The decoder's incremental call as plain tensor code (module docstring), the module that is traced. Holds
    the weights in the layout of their products (float) or PyTorch's int8 modules (after ``int8-decoder`` /
    ``int8-output``); the decoder is not changed.

    Its class methods say what :class:`StaticState` and the weights key need of a decoder; a decoder with another
    layer computation names a subclass that overrides them (:func:`graph_class`)."""

    explicit_attention = False  # True in the module AOTInductor compiles (:meth:`_attend`)
    attention_sums = False  # there, the attention's products as sums (:meth:`_scores`)

    @classmethod
    def refusal(cls, decoder) -> Optional[str]:
        """Why this graph does not compute ``decoder``'s step exactly (one line), or None."""
        why = _declared_refusal(decoder) if declares_memories(decoder) else lean_refusal(decoder)
        if why:
            return why.replace("lean_decoder", "static step").replace("without lean-decoder", "with its own step")
        return decoder_refusal(decoder, cls.projections(decoder))

    @classmethod
    def projections(cls, decoder) -> list:
        """The projections the step computes (the memories' keys and values are projected once per search by
        :class:`StaticState`, with the modules of :meth:`memory_projections`)."""
        out = [decoder.output_projection]
        for layer in decoder.layers:
            sa, ca = layer.self_attn, layer.encoder_attn
            out += [sa.q_proj, sa.k_proj, sa.v_proj, sa.out_proj, ca.q_proj, ca.out_proj, layer.fc1, layer.fc2]
            ctx = getattr(layer, "context_attn", None)
            if ctx is not None:
                out += [ctx.q_proj, ctx.out_proj]
        return out

    @classmethod
    def weight_modules(cls, decoder) -> list:
        """Every module whose weights the graph copies: projections, embeddings, and each layer's
        :meth:`layer_modules`."""
        modules = cls.projections(decoder) + [decoder.embed_tokens, decoder.embed_positions,
                                              decoder.layernorm_embedding, decoder.layer_norm]
        for layer in decoder.layers:
            modules += cls.layer_modules(layer)
        return modules

    @classmethod
    def layer_modules(cls, layer) -> list:
        """A layer's modules the graph copies besides its projections: layer norms, a gate."""
        gate = getattr(layer, "gate", None)
        return [layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm] + (
            list(gate.modules()) if gate is not None else [])

    @classmethod
    def heads(cls, decoder) -> int:
        return decoder.layers[0].self_attn.num_heads

    @classmethod
    def cache_count(cls, decoder) -> int:
        """Self-attention caches of a call: one per layer."""
        return len(decoder.layers)

    @classmethod
    def memories(cls, decoder, encoder_out):
        """(the memory [S, N, C] each layer's encoder attention reads, each layer's second memory [S2, N, C2] or
        None, the source padding [N, S] and the second memories' padding [N, S2], or None): the encoder output for
        every layer, or what the decoder's ``static_step_memories`` says (:func:`declares_memories`; its second
        memories have the source's padding)."""
        if declares_memories(decoder):
            memories, contexts, pad = decoder.static_step_memories(encoder_out)
            return memories, contexts, pad, pad
        pads = encoder_out.get("encoder_padding_mask") or []
        enc = encoder_out["encoder_out"][0]
        pad = pads[0] if len(pads) > 0 else None
        return [enc] * len(decoder.layers), [None] * len(decoder.layers), pad, None

    @classmethod
    def memory_projections(cls, decoder):
        """Per layer, the (key, value) projections of its memory and of its second memory (or None)."""
        ctx = [getattr(layer, "context_attn", None) for layer in decoder.layers]
        return ([(layer.encoder_attn.k_proj, layer.encoder_attn.v_proj) for layer in decoder.layers],
                [None if c is None else (c.k_proj, c.v_proj) for c in ctx])

    def __init__(self, decoder):
        super().__init__()
        self._embeddings(decoder)
        proj = Projections()
        self.gates = torch.nn.ModuleList()  # registered: the trace keeps their weights
        self.layers = []
        for layer in decoder.layers:
            sa, ca = layer.self_attn, layer.encoder_attn
            cx, gate = getattr(layer, "context_attn", None), getattr(layer, "gate", None)
            if gate is not None:
                self.gates.append(gate)
            self.layers.append(dict(
                ctx=None if cx is None else dict(q=proj(cx.q_proj), o=proj(cx.out_proj), scale=float(cx.scaling)),
                gate=gate,
                nb=bool(layer.normalize_before), act=layer.activation_fn, H=sa.num_heads,
                s_scale=float(sa.scaling), c_scale=float(ca.scaling),
                qkv=proj(sa.q_proj, sa.k_proj, sa.v_proj), so=proj(sa.out_proj),
                ln1=norm_of(layer.self_attn_layer_norm),
                cq=proj(ca.q_proj), co=proj(ca.out_proj), ln2=norm_of(layer.encoder_attn_layer_norm),
                fc1=proj(layer.fc1), fc2=proj(layer.fc2), ln3=norm_of(layer.final_layer_norm)))
        self.int8 = proj.modules  # registered: the trace keeps their packed weights

    @staticmethod
    def _ln(x: Tensor, p) -> Tensor:
        return F.layer_norm(x, (x.size(-1),), p[0], p[1], p[2])

    def _embeddings(self, decoder) -> None:
        """The token and positional embeddings, the embedding layer norm and the final one, and the width C."""
        from fairseq.modules import SinusoidalPositionalEmbedding

        C = decoder.embed_tokens.weight.size(1)
        self.embed = decoder.embed_tokens.weight.detach()
        self.embed_scale = float(decoder.embed_scale)
        ep = decoder.embed_positions
        if ep is None:
            self.positions = None
        else:  # the table from position 0 (fairseq's padding_idx + 1)
            if isinstance(ep, SinusoidalPositionalEmbedding):
                # made anew at a fixed length (fairseq's own table grows as longer inputs come): the same values,
                # and the same graph whatever the decoder has decoded before
                n = max(1024, int(getattr(decoder, "max_target_positions", 0) or 0))
                table = ep.get_embedding(ep.padding_idx + 1 + n, C, ep.padding_idx)
            else:
                table = ep.weight
            self.positions = table.detach()[ep.padding_idx + 1:].contiguous()
        self.emb_ln = norm_of(decoder.layernorm_embedding) if decoder.layernorm_embedding is not None else None
        self.final_ln = norm_of(decoder.layer_norm) if decoder.layer_norm is not None else None
        self.C = C

    def _embed(self, tokens: Tensor, idx: Tensor) -> Tensor:
        """The embedded tokens [N, K] at positions ``idx``: [N * K, C]."""
        N, K = tokens.shape
        x = self.embed_scale * F.embedding(tokens, self.embed)  # [N, K, C]
        if self.positions is not None:
            x = x + self.positions.index_select(0, idx)
        if self.emb_ln is not None:
            x = self._ln(x, self.emb_ln)
        return x.reshape(N * K, self.C)


    def forward(self, tokens: Tensor, idx: Tensor, k_cache: Tensor, v_cache: Tensor, src_k: Tensor,
                src_v: Tensor, src_bias: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_bias: Tensor):
        """tokens [N, K]; idx [K] their positions; k_cache / v_cache [L, N, H, T, d] (written at idx); src_k /
        src_v [L, B, H, S, d] of the B sources, row r reading source r // (N / B); src_bias [B, 1, 1, S] (0, or
        -inf at padding); ctx_k / ctx_v / ctx_bias like src_k / src_v / src_bias, of the layers' second memories
        (empty without).
        Returns the last layer's output after the final layer norm [N * K, C] (the output
        projection runs outside: :class:`OutputProjection`) and its head-averaged encoder attention [N, K, S]."""
        N, K = tokens.shape
        B = src_k.size(1)
        P = N // B  # rows per source: row r reads source r // P
        C = self.C
        x = self._embed(tokens, idx)
        T = k_cache.size(3)
        # keys after the group's last position are hidden (K = 1: causal; a SAT group: the relaxed mask)
        self_bias = torch.where(torch.arange(T, device=tokens.device) > idx[-1], float("-inf"), 0.0).view(1, T)
        attn = x.new_zeros(0)
        last = len(self.layers) - 1
        for i, p in enumerate(self.layers):
            H = p["H"]
            d = C // H
            # self-attention: one q/k/v product, the new keys / values written into the cache in place
            h = self._ln(x, p["ln1"]) if p["nb"] else x
            q, k, v = linear(h, p["qkv"]).split(C, dim=1)
            k_cache[i].index_copy_(2, idx, k.reshape(N, K, H, d).transpose(1, 2))
            v_cache[i].index_copy_(2, idx, v.reshape(N, K, H, d).transpose(1, 2))
            q = q.reshape(N, K, H, d).transpose(1, 2)
            a = self._attend(q, k_cache[i], v_cache[i], self_bias, p["s_scale"])
            x = x + linear(a.transpose(1, 2).reshape(N * K, C), p["so"])
            if not p["nb"]:
                x = self._ln(x, p["ln1"])
            # encoder-decoder attention over the source keys / values of the search, kept once per source: the
            # P rows of a source (a sentence's beam) query them as one block of P * K queries
            h = self._ln(x, p["ln2"]) if p["nb"] else x
            q = linear(h, p["cq"]).reshape(B, P * K, H, d).transpose(1, 2)  # [B, H, P*K, d]
            if i == last:  # the alignment layer: its weights too (softmax in float, as fairseq)
                w = torch.softmax(self._scores(q * p["c_scale"], src_k[i]) + src_bias, dim=-1)
                a = self._mix(w, src_v[i])
                attn = w.mean(dim=1).reshape(N, K, -1)
            else:
                a = self._attend(q, src_k[i], src_v[i], src_bias, p["c_scale"])
            a = linear(a.transpose(1, 2).reshape(N * K, C), p["co"])
            if p["ctx"] is not None:  # a second memory, fused with the gate or summed (msc_transformer's C^n)
                c = p["ctx"]
                qc = linear(h, c["q"]).reshape(B, P * K, H, d).transpose(1, 2)
                ac = self._attend(qc, ctx_k[i], ctx_v[i], ctx_bias, c["scale"])
                ac = linear(ac.transpose(1, 2).reshape(N * K, C), c["o"])
                a = a + ac if p["gate"] is None else p["gate"](a, ac)
            x = x + a
            if not p["nb"]:
                x = self._ln(x, p["ln2"])
            x = self._ffn(x, p)
        return self._final(x), attn

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
        """softmax(q k^T * scale + bias) v: PyTorch's fused attention where the graph is traced; its three
        operations where AOTInductor compiles it (``explicit_attention``), which fuses the scaling, bias and softmax
        into one loop, where the fused kernel's setup costs more than the arithmetic of a few rows (``python -m
        benchmarks.speed.decode --capture`` times both)."""
        if not self.explicit_attention:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        return self._mix(torch.softmax(self._scores(q * scale, k) + bias, dim=-1), v)

    def _scores(self, q: Tensor, k: Tensor) -> Tensor:
        """q k^T: a batched product, or products and a sum (``attention_sums``: inductor fuses them into loops; a
        batched product's setup costs more than a few queries' arithmetic; ``benchmarks.speed.decode --capture``)."""
        return (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) if self.attention_sums else q @ k.transpose(-1, -2)

    def _mix(self, w: Tensor, v: Tensor) -> Tensor:  # w v, as _scores
        return (w.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2) if self.attention_sums else w @ v

    def _ffn(self, x: Tensor, p) -> Tensor:
        """A layer's feed-forward block with its residual and layer norm (``fc1``, ``fc2``, ``ln3`` of ``p``)."""
        h = self._ln(x, p["ln3"]) if p["nb"] else x
        x = x + linear(p["act"](linear(h, p["fc1"])), p["fc2"])
        return x if p["nb"] else self._ln(x, p["ln3"])

    def _final(self, x: Tensor) -> Tensor:
        return self._ln(x, self.final_ln) if self.final_ln is not None else x


_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # decoder -> (weights key, step)


def step_graph(decoder) -> "Step":
    """The static step of ``decoder`` (its captured graph and output projection), made once per decoder and kept
    while the decoder lives; made again when what it copied changes (:func:`_weights_key`). It takes the compiled
    graph once that is ready (:meth:`Step.refresh`)."""
    key = _weights_key(decoder)
    cached = _GRAPHS.get(decoder)
    if cached is not None and cached[0] == key:
        cached[1].refresh()
        return cached[1]
    module = graph_class(decoder)(decoder).eval()
    step = Step(capture(module, decoder), OutputProjection(decoder.output_projection))
    # compiled ahead of time where it can be (module docstring)
    step.module = aot_module(module)  # what AOTInductor compiles (and fairseq_ext.sat.search_graph)
    step.compiled = aot_step.start(step.module, compile_example(module, decoder))
    step.refresh()
    _GRAPHS[decoder] = (key, step)
    return step


def aot_module(module: StepGraph, explicit_attention: bool = True, attention_sums: bool = True) -> StepGraph:
    """The module AOTInductor compiles: ``module``'s weights, its attention in explicit operations
    (:meth:`StepGraph._attend`), its two products as sums (:meth:`StepGraph._scores`) or batched products."""
    compiled = copy.copy(module)
    compiled.explicit_attention, compiled.attention_sums = explicit_attention, attention_sums
    return compiled


AOT_MAX_POSITIONS = 16  # new positions a call (rows x K) up to which the compiled graph runs (module docstring)


class Step:
    """A decoder's static step: its traced (or eager) graph, its output projection, and ``compiled``: the graph
    compiled ahead of time, pending or ready (:mod:`fairseq_ext.inference.aot_step`), or None."""

    def __init__(self, graph, output: "OutputProjection"):
        self.graph, self.output = graph, output
        self.compiled = self.module = None

    def refresh(self) -> None:
        """Takes the compiled graph once its package is ready (checked once per search)."""
        c = self.compiled
        if isinstance(c, aot_step.Pending):
            ready = c.ready()
            if ready is not None or c.failed:
                self.compiled = ready

    def graph_for(self, positions: int):
        """The graph a call of ``positions`` new positions (rows x K) runs on: the compiled one up to
        :data:`AOT_MAX_POSITIONS`, where it is the faster, else the traced one."""
        c = self.compiled
        return c if positions <= AOT_MAX_POSITIONS and isinstance(c, aot_step.AOTGraph) else self.graph

    @property
    def capture(self) -> str:
        """How a call of few rows runs now: "aot", "trace" or "eager"."""
        return "aot" if isinstance(self.graph_for(1), aot_step.AOTGraph) else \
            "trace" if isinstance(self.graph, torch.jit.ScriptModule) else "eager"


class OutputProjection:
    """The vocabulary projection of a static call, outside the graph, each call through the faster of PyTorch's
    products for its row count on this CPU: MKL's (weight ``[in, out]``) or oneDNN's prepacked product, from the
    row count :mod:`fairseq_ext.inference.projection_kernel` measured once per CPU (``onednn_from``; None: MKL
    always), PyTorch's int8 module as it is. oneDNN's packed weight cannot live in a traced graph, hence outside.
    The sums are ordered differently by the two kernels (~1e-6)."""

    def __init__(self, linear):
        self.module = None if type(linear) is torch.nn.Linear else linear  # int8 (static_refusal allows no other)
        self.bias = _bias(linear) if self.module is None else None
        self.weight_t = linear.weight.detach().t().contiguous() if self.module is None else None
        self.packed = None
        if self.module is None and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
            except (RuntimeError, AttributeError):  # a PyTorch without this oneDNN entry point: MKL's only
                self.packed = None
        self.onednn_from = None if self.packed is None else projection_kernel.choose(
            self.mkl, self.onednn, tuple(linear.weight.shape))

    def mkl(self, x: Tensor) -> Tensor:
        return torch.matmul(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)

    def onednn(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __call__(self, x: Tensor) -> Tensor:
        if self.module is not None:
            return self.module(x)
        if self.onednn_from is not None and x.size(0) >= self.onednn_from:
            return self.onednn(x)
        return self.mkl(x)


def example_inputs(module: StepGraph, decoder, N: int = 2, B: int = 2, S: int = 5, T: int = LENGTH_BUCKET):
    """Inputs of a call of ``module`` (N rows reading B sources of S positions, caches of T positions) to capture
    it with."""
    cls = type(module)
    L, H, caches = len(decoder.layers), cls.heads(decoder), cls.cache_count(decoder)
    d = module.C // H
    K = int(getattr(decoder, "group_size", 1))
    seconds = any(p is not None for p in cls.memory_projections(decoder)[1])
    S2 = S + 4  # a second memory of its own length
    ctx, ctx_bias = ((L, B, H, S2, d), (B, 1, 1, S2)) if seconds else ((0,), (0,))
    return (torch.full((N, K), decoder.dictionary.eos(), dtype=torch.long), torch.arange(K),
            torch.zeros(caches, N, H, T, d), torch.zeros(caches, N, H, T, d), torch.zeros(L, B, H, S, d),
            torch.zeros(L, B, H, S, d), torch.zeros(B, 1, 1, S), torch.zeros(ctx), torch.zeros(ctx),
            torch.zeros(ctx_bias))


def compile_example(module: StepGraph, decoder):
    """The inputs AOTInductor compiles the step with: distinct sizes for rows, sources, memory and cache lengths,
    none of them 1, so that torch.export keeps each dynamic and apart."""
    return example_inputs(module, decoder, N=6, B=3, S=7, T=3 * LENGTH_BUCKET)


def capture(module: StepGraph, decoder):
    """``module`` traced by ``torch.jit.trace``, or itself (``FAIRSEQ_EXT_STEP_CAPTURE=eager``, or no trace)."""
    if aot_step.mode() == "eager":
        return module
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTorch 2.13 announces TorchScript's end (module docstring)
            return torch.jit.trace(module, example_inputs(module, decoder), check_trace=False)
    except Exception as e:  # a PyTorch without TorchScript: the same code, one Python call per operation
        logger.info(f"static step: no torch.jit.trace ({type(e).__name__}: {e}); the step runs eagerly (slower)")
        return module


class StaticState:
    """The caches of one search: self-attention keys / values [L, N, H, capacity, d], the source keys / values
    [L, N, H, S, d] projected once and the source padding as an additive bias [N, 1, 1, S]. The capacity grows by
    :data:`LENGTH_BUCKET` positions as the search goes (the calls read the cache up to the bucket of their last
    position: masked positions are read with weight 0, zeros). :meth:`reorder` follows a search's row order, copying
    the cached positions only, into the buffer the previous reorder freed (CTranslate2's in-place reorder)."""

    def __init__(self, decoder, encoder_out, rows: int):
        graph = graph_class(decoder)
        self.L = graph.cache_count(decoder)
        self.H = graph.heads(decoder)
        self.d = decoder.embed_tokens.weight.size(1) // self.H
        memories, contexts, pad, ctx_pad = graph.memories(decoder, encoder_out)
        projections, ctx_projections = graph.memory_projections(decoder)
        enc = memories[0]  # [S, N0, C]
        N0 = enc.size(1)
        with torch.no_grad():
            self.src_k, self.src_v = self._project(projections, memories, enc)
            self.src_bias = self._bias(pad, enc)
            self.ctx_k = self.ctx_v = self.ctx_bias = enc.new_zeros(0)
            second = next((c for c in contexts if c is not None), None)
            if second is not None:
                self.ctx_k, self.ctx_v = self._project(ctx_projections, contexts, second)
                self.ctx_bias = self._bias(ctx_pad, second)
        if rows % N0:
            raise ValueError(f"static step: {rows} rows for {N0} sources (a whole number of rows per source)")
        self.rows_per_source = rows // N0
        self.k = self.v = self._spare_k = self._spare_v = None
        self.length = 0
        self._zeros(rows, LENGTH_BUCKET, enc)

    @staticmethod
    def _bias(pad: Optional[Tensor], memory: Tensor) -> Tensor:
        """A memory's padding [N0, S] (or None) as an additive bias [N0, 1, 1, S]: 0, or -inf at padding."""
        S, N0 = memory.shape[:2]
        bias = memory.new_zeros(N0, 1, 1, S)
        if pad is not None:
            bias.masked_fill_(pad.view(N0, 1, 1, S), float("-inf"))
        return bias

    def _project(self, projections, memories, like: Tensor):
        """The keys and values [L, N0, H, S, d] of each layer's memory [S, N0, C] through its (key, value)
        projections (zeros for a layer without that memory, shaped like ``like``: never read)."""
        ks, vs = [], []
        S, N0 = like.shape[:2]
        for proj, mem in zip(projections, memories):
            if proj is None or mem is None:
                ks.append(like.new_zeros(N0, self.H, S, self.d))
                vs.append(ks[-1])
                continue
            S_, N_ = mem.shape[:2]
            ks.append(proj[0](mem).view(S_, N_, self.H, self.d).permute(1, 2, 0, 3))
            vs.append(proj[1](mem).view(S_, N_, self.H, self.d).permute(1, 2, 0, 3))
        return torch.stack(ks), torch.stack(vs)

    def _zeros(self, rows: int, capacity: int, like: Tensor) -> None:
        shape = (self.L, rows, self.H, capacity, self.d)
        k, v = like.new_zeros(shape), like.new_zeros(shape)
        if self.k is not None and self.length:
            k[:, :, :, : self.length] = self.k[:, :, :, : self.length]
            v[:, :, :, : self.length] = self.v[:, :, :, : self.length]
        self.k, self.v = k, v
        self._spare_k = self._spare_v = None

    @property
    def capacity(self) -> int:
        return self.k.size(3)

    def reserve(self, end: int) -> None:
        """Room for positions up to ``end`` (exclusive): the caches grow to the bucket of ``end``, so that a call
        reads them whole (contiguous, as the compiled graph takes them)."""
        if end > self.capacity:
            self._zeros(self.k.size(1), -(-end // LENGTH_BUCKET) * LENGTH_BUCKET, self.k)

    def reorder(self, order: Tensor, same_sources: bool = False) -> None:
        """The rows follow ``order``; ``same_sources``: every new row reads the source its old row read (a beam
        reordered within its sentences): the source tensors stay as they are, unchecked."""
        n = self.length
        shape = (self.L, order.size(0)) + tuple(self.k.shape[2:])
        if self._spare_k is None or tuple(self._spare_k.shape) != shape:  # a new row count: fresh zeros
            self._spare_k, self._spare_v = self.k.new_zeros(shape), self.v.new_zeros(shape)
        torch.index_select(self.k[:, :, :, :n], 1, order, out=self._spare_k[:, :, :, :n])
        torch.index_select(self.v[:, :, :, :n], 1, order, out=self._spare_v[:, :, :, :n])
        (self.k, self._spare_k), (self.v, self._spare_v) = (self._spare_k, self.k), (self._spare_v, self.v)
        if tuple(self._spare_k.shape) != shape:
            self._spare_k = self._spare_v = None
        if not same_sources:
            self._reorder_sources(order)

    def _reorder_sources(self, order: Tensor) -> None:
        """The source tensors follow the sources of the new rows: kept when a beam search reorders within each
        sentence (the rows of a source stay together, P of them), selected when sentences leave or the rows are
        expanded (one host read of the order); an order that mixes sources gives every row its own copy."""
        P = self.rows_per_source
        sources = order if P == 1 else torch.div(order, P, rounding_mode="floor")
        blocks = equal_runs(sources.tolist())
        if blocks is None:
            index, self.rows_per_source = sources, 1
        else:
            firsts, self.rows_per_source = blocks
            if firsts == list(range(self.src_k.size(1))):
                return
            index = torch.tensor(firsts, dtype=torch.long, device=order.device)
        self.src_k, self.src_v = self.src_k.index_select(1, index), self.src_v.index_select(1, index)
        if self.ctx_k.numel():
            self.ctx_k, self.ctx_v = self.ctx_k.index_select(1, index), self.ctx_v.index_select(1, index)
            self.ctx_bias = self.ctx_bias.index_select(0, index)
        self.src_bias = self.src_bias.index_select(0, index)


def call_graph(graph, state: StaticState, tokens: Tensor, first: int, *extra: Tensor):
    """``graph`` (the step's, or one that takes the step's inputs and then ``extra``) on the K new positions
    first..first+K-1 (``tokens`` [N, K]) and the state's caches, written in place; returns the graph's outputs."""
    end = first + tokens.size(1)
    state.reserve(end)  # the caches are read whole: their length is the bucket of ``end``
    out = graph.forward(tokens.contiguous(), torch.arange(first, end), state.k, state.v, state.src_k, state.src_v,
                        state.src_bias, state.ctx_k, state.ctx_v, state.ctx_bias, *extra)
    state.length = end
    return out


def static_logits(step: Step, state: StaticState, tokens: Tensor, first: int, temperature: float = 1.0):
    """Logits [N, K, V] (divided by ``temperature``) and attention [N, K, S] of the K new positions
    first..first+K-1 (``tokens`` [N, K])."""
    N, K = tokens.shape
    x, attn = call_graph(step.graph_for(N * K), state, tokens, first)
    logits = step.output(x).view(N, K, -1)
    if temperature != 1.0:
        logits = logits.div_(temperature)
    return logits, attn


def static_call(step: Step, state: StaticState, tokens: Tensor, first: int, temperature: float = 1.0):
    """Log-probabilities [N, K, V] (fairseq's get_normalized_probs of :func:`static_logits`) and attention."""
    logits, attn = static_logits(step, state, tokens, first, temperature)
    return torch.log_softmax(logits, dim=-1), attn
