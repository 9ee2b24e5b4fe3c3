"""A search's whole step as one compiled graph: the static decoder step, the vocabulary projection, fairseq's rules
and the choice of words (greedy, or the beam's candidates).

With the static step compiled (:mod:`fairseq_ext.inference.aot_step`), a search step at few rows still runs three
calls: the compiled decoder step, the vocabulary projection from Python (:class:`~fairseq_ext.inference.
static_step.OutputProjection`), and fairseq's rules and choice as a TorchScript function of
:mod:`fairseq_ext.sat.step_rules` (the log-softmax, the rules' row, the best words, the EOS and near-tie status:
~20 small operations through TorchScript's interpreter). :class:`GreedyGraph` is the same step module, the same
product and the same rules' code as one module, which AOTInductor compiles into one call; :class:`BeamGraph` the
beam's rules and candidates alone, after the projection (inside the graph, the product of a beam's rows was slower
than the kernel :class:`~fairseq_ext.inference.static_step.OutputProjection` picks for them), and
:class:`GroupBeamGraph` the same for the SAT's group beam (K > 1): the rules, each position's best words, the
enumerated groups and the next hypotheses, where the op path ran ~40 operations from Python a group. ``python -m
benchmarks.speed.decode`` times the searches.

Each is compiled like the step (the same cache, package key and background process), once the step's own package
is ready, and only for float32 steps; a beam graph per beam size, for the steps after the first (the first has one
row per sentence). Until a graph is ready, and where it does not apply (int8, a capture mode other than ``aot``;
greedy: a temperature other than 1 or more positions a call than
:data:`~fairseq_ext.inference.static_step.AOT_MAX_POSITIONS`; beam: more rows than the scripted rules take), the
search runs as before. The greedy graph takes the best two words as two maxima, the best and the best of the
others (inductor makes each one loop; ``topk`` took ~80 us a call over 7,840 words), where the scripted rules take
``topk`` or chunked maxima: the same values, the same word but among exactly equal values, which the near-tie margin
already sends to fairseq's generator.
"""

import math
import weakref
from typing import Optional

import torch
from torch import Tensor

from fairseq_ext.inference import aot_step
from fairseq_ext.inference.static_step import AOT_MAX_POSITIONS, Step, StaticState, call_graph, compile_example
from fairseq_ext.sat import group_step, step_rules

_TWO_MAXIMA = 0  # _greedy_pick's chunk for the best two words as two maxima (module docstring)


class GreedyGraph(torch.nn.Module):
    """The static step module, the output projection and :func:`step_rules._greedy_pick` with the margin ``margin``
    and end-of-sentence word ``eos``, in one forward."""

    source_files = (step_rules.__file__,)  # code the compiled package holds beyond its classes' (aot_step key)

    def __init__(self, step_module: torch.nn.Module, weight_t: Tensor, bias: Optional[Tensor], eos: int,
                 margin: float):
        super().__init__()
        self.step = step_module
        self.weight_t, self.bias = weight_t, bias
        self.eos, self.margin = int(eos), float(margin)

    def forward(self, tokens: Tensor, idx: Tensor, k_cache: Tensor, v_cache: Tensor, src_k: Tensor, src_v: Tensor,
                src_bias: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_bias: Tensor, rule_bias: Tensor):
        """The step's inputs (:meth:`StepGraph.forward`) and the rules' row [K, V] (:func:`step_rules.rule_bias`
        for every position). Returns the log-probabilities after the rules [N, K, V], the best one and its word
        [N, K], the status [2N] of :func:`step_rules._greedy_pick` and the attention [N, K, S]."""
        x, attn = self.step(tokens, idx, k_cache, v_cache, src_k, src_v, src_bias, ctx_k, ctx_v, ctx_bias)
        N, K = tokens.shape
        logits = torch.matmul(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
        lprobs, best_lp, best, status = step_rules._greedy_pick(logits.view(N, K, -1), rule_bias, self.eos,
                                                                self.margin, 0, _TWO_MAXIMA)
        return lprobs, best_lp, best, status, attn

    @staticmethod
    def dynamic_shapes(example):
        return aot_step.dynamic_shapes(example[:-1]) + (None,)


class BeamGraph(torch.nn.Module):
    """:func:`step_rules._beam_candidates` for a beam of ``beam`` with ``beam`` rows per sentence (every step but
    the first; K = 1), on the logits, and :func:`step_rules._beam_advance` of its candidates for the case where no
    sentence is done (the search takes it then, and advances its own way when a sentence leaves). The projection
    stays outside, where it takes the faster of PyTorch's products for its row count
    (:class:`~fairseq_ext.inference.static_step.OutputProjection`; inside the graph the product of 4 rows took
    ~30-80 us more)."""

    source_files = (step_rules.__file__,)

    def __init__(self, eos: int, margin: float, beam: int, vocab: int):
        super().__init__()
        self.eos, self.margin, self.beam = int(eos), float(margin), int(beam)
        self.k = min(2 * self.beam, self.beam * int(vocab) - 1)

    def forward(self, logits: Tensor, rule_bias: Tensor, scores: Tensor, tokens: Tensor, cum: Tensor, attn: Tensor,
                step_attn: Tensor, step: Tensor):
        """logits [N, 1, V], the rules' row [1, V], each row's score [N], the search's buffers (tokens [N, W], cum
        [N, T], attn [N, S, T]), the step's attention [N, 1, S] and the step (a 0-d tensor) -> the outputs of
        :func:`step_rules._beam_candidates` (lprobs, cand_sc, parents, words, finite_eos, active, status), then
        those of :func:`step_rules._beam_advance` with every sentence kept (rows, scores, tokens, cum, attn)."""
        B = self.beam
        n = logits.size(0) // B
        out = step_rules._beam_candidates(logits, rule_bias, scores, n, B, self.k, B, self.eos, self.margin)
        _, cand_sc, parents, words, _, active, _ = out
        base = torch.arange(n, device=logits.device).unsqueeze(1) * B  # every sentence kept
        return out + step_rules._beam_advance(tokens, cum, attn, step_attn, cand_sc, parents, words, active, base,
                                              step.view(1))

    @staticmethod
    def dynamic_shapes(example):
        from torch.export import Dim

        a = Dim.AUTO
        return {0: a}, None, {0: a}, {0: a, 1: a}, {0: a, 1: a}, {0: a, 1: a, 2: a}, {0: a, 2: a}, None


class GroupBeamGraph(torch.nn.Module):
    """The SAT's group beam step (K > 1, the enumerated step of :mod:`fairseq_ext.sat.group_step`) for a beam of
    ``beam`` with ``beam`` rows per sentence and all K positions before --max-len, on the logits: fairseq's rules
    (the row of each position), the B best non-EOS words and EOS of each position, the candidates' scores and the
    ending ones among each sentence's top B per position (:func:`~fairseq_ext.sat.group_step.
    enumerated_candidates`), then the next hypotheses for the case where every sentence goes on (the search takes
    them then, and advances its own way when a sentence is done). ``slots``: the rank tuples [C, K] and the
    enumeration's slots for K positions (:meth:`GroupStep._enumerated_slots`: index, ends, W, eos position,
    length, not-full mask). The projection stays outside, as for :class:`BeamGraph`. ``topk`` here where the
    search takes :func:`~fairseq_ext.sat.generator.top_b` from 8 rows on: the same values, the same words but
    among exactly equal values."""

    source_files = (group_step.__file__,)

    def __init__(self, eos: int, beam: int, ranks: Tensor, index: Tensor, n_ends: Tensor, W: int, eos_at: Tensor,
                 length_at: Tensor, not_full: Tensor):
        super().__init__()
        self.eos, self.beam, self.W = int(eos), int(beam), int(W)
        self.K = int(ranks.size(1))
        for name, t in (("ranks", ranks), ("index", index), ("n_ends", n_ends), ("eos_at", eos_at),
                        ("length_at", length_at), ("not_full", not_full)):
            self.register_buffer(name, t.clone(), persistent=False)

    def forward(self, logits: Tensor, rule_bias: Tensor, scores: Tensor, tokens: Tensor, cum: Tensor, attn: Tensor,
                group_attn: Tensor, step: Tensor):
        """logits [N, K, V], the rules' row of each position [K, V], each row's score [N], the search's buffers
        (tokens [N, K + steps], cum [N, steps], attn [N, S, steps]), the group's attention [N, K, S] and the step
        (a 0-d tensor) -> whether a selected value is NaN [1], the ending candidates [K, n, B], each candidate's
        words [N, C, K], cumulative scores [N, C, K + 1] and score if it ends [N, C], the scores of those that
        fill the group [N, C], then the next hypotheses with every sentence kept: (rows, scores, tokens, cum,
        attn)."""
        K, B = self.K, self.beam
        lprobs = torch.log_softmax(logits, dim=-1) + rule_bias
        eos_lp = lprobs[:, :, self.eos]  # [N, K]
        vals, words = lprobs.index_fill(2, torch.tensor([self.eos]), -math.inf).topk(B, dim=2)  # [N, K, B]
        nan = (vals.isnan().any() | eos_lp.isnan().any()).view(1)
        cand_words, cand_cum, end, fin, alive = group_step.enumerated_candidates(
            scores, vals, words, eos_lp, self.ranks, self.index, self.n_ends, self.eos_at, self.length_at,
            self.not_full, B, K, self.W)
        C = alive.size(1)
        top, sel = alive.reshape(-1, B * C).topk(B, dim=1)  # [n, B]: each sentence's top B continuations
        rows = (torch.arange(top.size(0)).unsqueeze(1) * B + torch.div(sel, C, rounding_mode="floor")).view(-1)
        flat = rows * C + sel.view(-1) % C
        positions = step + torch.arange(K)
        tokens = tokens.index_select(0, rows).index_copy(1, positions + K,
                                                         cand_words.reshape(-1, K).index_select(0, flat))
        new_cum = cand_cum[:, :, 1:].reshape(-1, K).index_select(0, flat)
        cum = cum.index_select(0, rows).index_copy(1, positions, new_cum)
        attn = attn.index_select(0, rows).index_copy(2, positions, group_attn.index_select(0, rows).transpose(1, 2))
        return (nan, fin.transpose(0, 1).contiguous(), cand_words, cand_cum, end, alive, rows, top.view(-1), tokens,
                cum, attn)

    @staticmethod
    def dynamic_shapes(example):
        from torch.export import Dim

        a = Dim.AUTO
        return {0: a}, None, {0: a}, {0: a, 1: a}, {0: a, 1: a}, {0: a, 1: a, 2: a}, {0: a, 2: a}, None


_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Step -> {key: graph, Pending or None}


def ready(step: Step, decoder, eos: int, margin: float, beam: int = 0, slots=None):
    """The compiled graph for ``step``'s greedy search (``beam`` 0), a beam of ``beam`` (K = 1) or, with the
    enumeration's ``slots`` (:class:`GroupBeamGraph`), the group beam of ``beam`` (K > 1), with ``eos`` and
    ``margin``, once it is ready, else None; starts its compile (in the background, :func:`aot_step.start`) once
    the step's own compiled graph is ready."""
    if not isinstance(step.compiled, aot_step.AOTGraph) or step.output.weight_t is None:
        return None
    graphs = _GRAPHS.setdefault(step, {})
    key = (int(eos), float(margin), int(beam), slots is not None)
    g = graphs.get(key, False)
    if g is False:
        w, b = step.output.weight_t, step.output.bias
        V = w.size(1)
        K = int(getattr(decoder, "group_size", 1))
        if slots is not None:  # n sentences of ``beam`` rows, buffers of distinct sizes
            module = GroupBeamGraph(eos, beam, *slots)
            N = next(m * beam for m in (3, 5, 7, 11) if m * beam not in (4 * K + 5, 4 * K + 3, 7, K))
            example = (torch.zeros(N, K, V), torch.zeros(K, V), torch.zeros(N),
                       torch.zeros(N, 4 * K + 5, dtype=torch.long), torch.zeros(N, 4 * K + 3),
                       torch.zeros(N, 7, 4 * K + 3), torch.zeros(N, K, 7), torch.tensor(2))
        elif beam:  # three sentences of ``beam`` rows, buffers of distinct sizes (torch.export keeps them apart)
            module = BeamGraph(eos, margin, beam, V)
            N = 3 * beam
            example = (torch.zeros(N, 1, V), torch.zeros(1, V), torch.zeros(N), torch.zeros(N, 13, dtype=torch.long),
                       torch.zeros(N, 11), torch.zeros(N, 7, 11), torch.zeros(N, 1, 7), torch.tensor(5))
        else:
            module = GreedyGraph(step.module, w, b, eos, margin)
            example = compile_example(step.module, decoder) + (torch.zeros(K, V),)
        what = "group beam" if slots is not None else "beam" if beam else "greedy"
        g = graphs[key] = aot_step.start(module.eval(), example, f"the {what} search's graph",
                                         "the search runs its scripted rules")
    if isinstance(g, aot_step.Pending):
        done = g.ready()
        if done is not None or g.failed:
            g = graphs[key] = done
    return g if isinstance(g, aot_step.AOTGraph) else None


def wait(step: Step, timeout: float = 900.0) -> None:
    """Blocks until every graph of ``step`` being compiled is written (benchmarks and tests); the next
    :func:`ready` takes it."""
    for g in list(_GRAPHS.get(step, {}).values()):
        if isinstance(g, aot_step.Pending):
            g.wait(timeout)


def applies(graph, positions: int, temperature: float) -> bool:
    """Whether a call of ``positions`` new positions (rows x K) at ``temperature`` runs on ``graph`` (None: not
    ready)."""
    return graph is not None and temperature == 1.0 and positions <= AOT_MAX_POSITIONS


def greedy_call(graph, state: StaticState, tokens: Tensor, first: int, rule_bias: Tensor):
    """One greedy step on ``graph`` for the K new positions first..first+K-1 (``tokens`` [N, K]): the outputs of
    :meth:`GreedyGraph.forward`; the caches written in place as :func:`static_step.static_logits` writes them."""
    return call_graph(graph, state, tokens, first, rule_bias)
