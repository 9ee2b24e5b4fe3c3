"""Semi-autoregressive sequence generation for :mod:`fairseq_ext.sat.model` (Wang et al. 2018).

One decoder call per group of K positions (Sec. 3; Table 1: the decoder cost per sentence drops from n to
ceil(n/K) calls). Under the model's group factorisation p(y|x) = prod_g p(G_g | G_<g, x) the K distributions of
a group depend only on earlier groups, and the K words of a group are independent given them, so a K-word
continuation c = (v_0..v_{K-1}) of a hypothesis h with cumulative score s(h) scores
s(h) + sum_k lp_k(v_k | h).

* ``--beam B`` (:meth:`SATSequenceGenerator._group_beam_search`, B = 1 included; ``--beam 1`` uses the
  equivalent, leaner :meth:`SATSequenceGenerator._greedy_search`): one vectorised step per group keeps the
  **exact top B K-word continuations** over all continuations of all B hypotheses of a sentence (not a
  token-level beam that prunes on partial group scores). A hypothesis may end inside a group: ending at
  position j (words v_0..v_{j-1}, none of them EOS, then EOS at j) it scores s(h) + sum_{k<=j} lp_k. It is
  finalised, as fairseq does at every step, when it is among the top B of all candidates of its length, i.e.
  of the hypotheses that end at j and the (non-EOS) prefixes v_0..v_j, over all parents; positions are taken
  in order and a sentence is done once B hypotheses are finalised or at --max-len. Scores are normalised by
  length ** --lenpen when finalised; --min-len, --max-len-a/b, --unkpen, --nbest, --temperature and
  attention (--print-alignment) as in fairseq. With K = 1 this is fairseq's beam search; with B = 1 it is
  greedy search that stops at the first EOS of a group.

  Why the per-position top B suffice, and how a group step scores them: :mod:`fairseq_ext.sat.group_step`.

A plain fairseq ``transformer`` is decoded as K = 1.

On the static decoder step (:mod:`fairseq_ext.inference.static_step`, the default on a CPU in float32) the greedy
search and the K = 1 beam search run each step's rules, choice and writes as TorchScript functions
(:mod:`fairseq_ext.sat.step_rules`), or, once compiled, as one graph with the greedy step or after the beam's
projection (:mod:`fairseq_ext.sat.search_graph`), and fairseq's own encoder runs traced
(:mod:`fairseq_ext.inference.static_encoder`); the hypotheses are the op-by-op searches'.
"""

import logging
import math
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq import search, utils
from fairseq.models import FairseqIncrementalDecoder
from fairseq.sequence_generator import (
    EnsembleModelWithAlignment,
    SequenceGenerator,
    SequenceGeneratorWithAlignment,
)

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.inference.lean_decoder import (float32_on_cpu, holds_encoder_states, lean_applies, lean_refusal,
                                               lean_step, only_lean_state, reorder_lean_state)
from fairseq_ext.inference.static_encoder import encoder_refusal, static_encode
from fairseq_ext.inference.static_step import STATE_KEY as STATIC_KEY
from fairseq_ext.inference.static_step import StaticState, static_call, static_logits, static_refusal, step_graph
from fairseq_ext.sat import search_graph, step_rules
from fairseq_ext.sat.group_step import GroupStep

_FAIRSEQ_REORDER_WALK = FairseqIncrementalDecoder.reorder_incremental_state_scripting
logger = logging.getLogger(__name__)

# Searches of more rows a decoder call (sentences x beam) take the lean step where it applies (a decoder it refuses,
# MSC's or BERT-JAM's, stays on the static step): with that many rows the products, not the Python around them,
# are the cost, and the static step's attention reads its cache in 32-position buckets (python -m
# benchmarks.speed.static_rows times both steps by rows on the Acts test).
STATIC_MAX_ROWS = 128
TOP_B_MIN_ROWS = 8  # fewer rows: topk itself is faster (python -m benchmarks.speed.beam_rows --rows 1 4 8 16)


def top_b(lprobs: Tensor, B: int, chunk: int = step_rules.TOP_K_CHUNK):
    """``lprobs.topk(B, dim=-1)`` ([..., V] -> values and indices [..., B], best first) through
    :func:`~fairseq_ext.sat.step_rules.chunked_topk` on each row: faster than ``topk`` for 16-24 rows of 8,000
    words (``python -m benchmarks.speed.beam_rows`` times both); the same values, the same indices but among equal
    values. Rows shorter than 16 chunks, and calls of fewer than :data:`TOP_B_MIN_ROWS` rows, use ``topk``."""
    V = lprobs.size(-1)
    if V // chunk < max(16, B) or lprobs.numel() < TOP_B_MIN_ROWS * V:
        return lprobs.topk(B, dim=-1)
    vals, idx = step_rules.chunked_topk(lprobs.reshape(-1, V), B, chunk)
    return vals.view(*lprobs.shape[:-1], B), idx.view(*lprobs.shape[:-1], B)


class SATEnsembleModel(EnsembleModelWithAlignment):
    """fairseq's model wrapper for one SAT model; :meth:`decode_group` runs the decoder on the K new
    positions of every hypothesis (one call per group): through the lean step of
    :mod:`fairseq_ext.inference.lean_decoder` when ``lean_step`` and the decoder allows it (``uses_lean_step``: the
    decoder's structure is checked once, :func:`lean_refusal`, its dtype and device on every call, and each call
    by :func:`lean_applies`), else through the decoder's own ``forward``; on the static step
    (:mod:`fairseq_ext.inference.static_step`, ``uses_static_step``) where it applies and a search's calls have at
    most ``static_max_rows`` rows (:data:`STATIC_MAX_ROWS`). The model itself is not changed."""

    def __init__(self, models, lean_step: bool = True, static_step: bool = True):
        if len(models) != 1:
            raise FairseqExtError(
                f"translation_sat decodes a single model; got an ensemble of {len(models)} (--path a.pt:b.pt). "
                f"Average the checkpoints instead (python -m fairseq_ext.average_checkpoints)")
        super().__init__(models)
        self.group_size = int(getattr(models[0].decoder, "group_size", 1))  # K; a transformer decodes as K = 1
        self.decoder_calls = 0
        self._lean_refusal = lean_refusal(self.single_model.decoder) if lean_step else "--no-lean-step"
        self._static_refusal = (static_refusal(self.single_model) if static_step else "--no-static-step") \
            if lean_step else "--no-lean-step"
        self._encoder_refusal = encoder_refusal(self.single_model.encoder) if self._static_refusal is None else \
            self._static_refusal
        self.static_max_rows = STATIC_MAX_ROWS
        self.search_rows = 0  # rows a call of the current search (set by its start): more than static_max_rows, lean

    @property
    def uses_lean_step(self) -> bool:
        return self._lean_refusal is None and float32_on_cpu(self.single_model.decoder)

    @property
    def uses_static_step(self) -> bool:
        return self._static_refusal is None and float32_on_cpu(self.single_model.decoder) \
            and not self.single_model.decoder.training \
            and (self.search_rows <= self.static_max_rows or self._lean_refusal is not None)

    def forward_encoder(self, net_input):
        """fairseq's encoder call; with the static step, through the trace of fairseq's own encoder code
        (:mod:`fairseq_ext.inference.static_encoder`: the same output) where the encoder is fairseq's."""
        encoder = self.single_model.encoder
        if self._encoder_refusal is None and self.uses_static_step and not encoder.training \
                and float32_on_cpu(encoder) and set(net_input) <= {"src_tokens", "src_lengths", "prev_output_tokens"}:
            return [static_encode(encoder, net_input)]
        return super().forward_encoder(net_input)

    @property
    def step_name(self) -> str:
        """The decoder step that calls take now: "static", "lean" or "own"."""
        return "static" if self.uses_static_step else "lean" if self.uses_lean_step else "own"

    def static_state(self, encoder_out, incremental_state, rows: int) -> StaticState:
        """The static step's state of a search (made by its first call) and, as ``state.step``, the step."""
        state = incremental_state.get(STATIC_KEY)
        if state is None:
            state = incremental_state[STATIC_KEY] = StaticState(self.single_model.decoder, encoder_out, rows)
            state.step = step_graph(self.single_model.decoder)
        return state

    def _static_group(self, call, decoder_input, encoder_out, incremental_state, temperature: float):
        K = self.group_size
        state = self.static_state(encoder_out, incremental_state, decoder_input.size(0))
        first = decoder_input.size(1) - K
        return call(state.step, state, decoder_input[:, first:], first, temperature)

    def decode_greedy(self, graph, decoder_input, encoder_out, incremental_state, rule_bias: Tensor):
        """A greedy step on its compiled graph ``graph`` (:mod:`fairseq_ext.sat.search_graph`): the graph's
        outputs for the K uncached positions of ``decoder_input`` (as :meth:`decode_group` takes it)."""
        K = self.group_size
        self.decoder_calls += 1
        state = self.static_state(encoder_out, incremental_state, decoder_input.size(0))
        first = decoder_input.size(1) - K
        return search_graph.greedy_call(graph, state, decoder_input[:, first:], first, rule_bias)

    def decode_logits(self, decoder_input, encoder_out, incremental_state, temperature: float = 1.0):
        """:meth:`decode_group` on the static step (``uses_static_step``), returning the logits [N, K, V] (divided
        by ``temperature``) for the searches' scripted rules (:mod:`fairseq_ext.sat.step_rules`)."""
        self.decoder_calls += 1
        return self._static_group(static_logits, decoder_input, encoder_out, incremental_state, temperature)

    def decode_group(self, decoder_input, encoder_out, incremental_state, temperature: float = 1.0):
        """decoder_input: [N, n] SAT decoder input (K-1 start symbols, BOS and the words generated so far; n a
        multiple of K), a view of the search's buffer: the decoder embeds only its K uncached positions.
        Returns the log-probabilities [N, K, V] of the next K words (of the logits divided by ``temperature``) and
        the attention [N, K, src_len] or None."""
        K = self.group_size
        self.decoder_calls += 1
        decoder = self.single_model.decoder
        if STATIC_KEY in incremental_state or (not incremental_state and self.uses_static_step):
            return self._static_group(static_call, decoder_input, encoder_out, incremental_state, temperature)
        if self.uses_lean_step and lean_applies(decoder, decoder_input, incremental_state):
            x, extra = lean_step(decoder, decoder_input, encoder_out, incremental_state)
            x = decoder.output_layer(x)
        else:
            x, extra = decoder.forward(decoder_input, encoder_out=encoder_out, incremental_state=incremental_state)
        if x.size(1) != K:
            x = x[:, -K:, :]
        if temperature != 1.0:
            x = x.div_(temperature)
        attn = extra["attn"][0] if isinstance(extra, dict) and extra.get("attn") else None
        if attn is not None and attn.size(1) != K:
            attn = attn[:, -K:, :]
        return self.single_model.get_normalized_probs((x, extra), log_probs=True, sample=None), attn


class _GroupSearch(GroupStep, SequenceGenerator):
    """The group-level searches; ``SequenceGeneratorWithAlignment.generate`` reaches :meth:`_generate` through
    ``super()`` (see the class order of :class:`SATSequenceGenerator`), so --print-alignment uses them too."""

    def _generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None):
        if prefix_tokens is not None:
            raise FairseqExtError("translation_sat does not support --prefix-size (prefix tokens)")
        if constraints is not None:
            raise FairseqExtError("translation_sat does not support --constraints")
        if self.beam_size == 1 and self.repeat_ngram_blocker is None:
            return self._greedy_search(sample, bos_token)
        if self.group_size == 1:
            return self._beam_search(sample, bos_token)
        return self._group_beam_search(sample, bos_token)

    # -- shared pieces ------------------------------------------------------------------------------------
    def _start(self, sample, bos_token):
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz, src_len = src_tokens.size()[:2]
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
        K = self.group_size
        n_steps = (max_len + 1 + K - 1) // K * K  # positions 0..max_len, rounded up to whole groups
        # the SAT decoder input of every row: K-1 start symbols, BOS, then the words; tokens[:, K-1:] is
        # fairseq's layout (BOS + words), tokens[:, K:] the hypothesis
        tokens = src_tokens.new_full((bsz, K + n_steps), self.pad)
        start = getattr(self.model.single_model.decoder, "start_symbol", None)
        bos = self.eos if bos_token is None else bos_token
        tokens[:, : K - 1] = bos if start is None else start
        tokens[:, K - 1] = bos
        self.model.search_rows = bsz * self.beam_size  # the widest call of this search picks the step
        encoder_outs = self.model.forward_encoder(net_input)
        self._reorder_modules = None  # found again for every search (see _reorder)
        return bsz, src_len, max_len, n_steps, tokens, encoder_outs

    def _beam_start(self, sample, bos_token):
        """:meth:`_start`, and what both beam searches keep: the cumulative score at each position of each row, the
        score s(h) of each row, the sentence of each block of rows, the finalised hypotheses of each sentence."""
        bsz, src_len, max_len, n_steps, tokens, encoder_outs = self._start(sample, bos_token)
        cum = torch.zeros(bsz, n_steps, dtype=torch.float, device=tokens.device)
        scores = torch.zeros(bsz, dtype=torch.float, device=tokens.device)
        sents: List[int] = list(range(bsz))
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        return src_len, max_len, n_steps, tokens, encoder_outs, cum, scores, sents, finalized

    def _constrain(self, lprobs: Tensor, step: int, max_len: int) -> Tensor:
        """fairseq's per-step rules on the K distributions [N, K, V] of target positions step..step+K-1. On a CPU
        its NaN -> -inf is left to the callers, which apply it only when a value they select is NaN
        (:meth:`_selected_nan`); on other devices it is one kernel here, cheaper than a host read per step."""
        lprobs = lprobs.float() if lprobs.dtype != torch.float else lprobs
        if not lprobs.is_cpu:
            self._nan_to_neg_inf(lprobs)
        lprobs[:, :, self.pad] = -math.inf
        if self.unk_penalty != 0:
            lprobs[:, :, self.unk] -= self.unk_penalty
        # positions k with step + k >= max_len: only EOS; with step + k < min_len: no EOS (contiguous ranges of k)
        last = max(max_len - step, 0)
        if last < lprobs.size(1):
            lprobs[:, last:, : self.eos] = -math.inf
            lprobs[:, last:, self.eos + 1:] = -math.inf
        if step < self.min_len:
            lprobs[:, : self.min_len - step, self.eos] = -math.inf
        if self.token_indices_to_suppress is not None:
            lprobs[:, :, self.token_indices_to_suppress] = -math.inf
        return lprobs

    def _scripted_rules(self, device):
        """:mod:`fairseq_ext.sat.step_rules`' scripted functions where the search runs on the static step (its
        logits: :meth:`SATEnsembleModel.decode_logits`), else None; keeps fairseq's rules of every step as a row
        for :meth:`_rule_bias`."""
        if not self.model.uses_static_step:
            return None
        self._base_bias = step_rules.base_bias(self.vocab_size, self.pad, self.unk, self.unk_penalty,
                                               self.token_indices_to_suppress, device)
        return step_rules.scripted()

    def _rule_bias(self, step: int, max_len: int) -> Tensor:
        """fairseq's rules of :meth:`_constrain` for positions step..step+K-1 as an additive row per position."""
        return step_rules.rule_bias(self._base_bias, self.eos, step, self.group_size, max_len, self.min_len)

    def _reorder(self, state, encoder_outs, rows: Tensor, same_sources: bool = False):
        """The decoder's state follows ``rows``; so does the encoder output, unless the decoder no longer reads it
        (the lean step keeps the source keys and values itself: ``holds_encoder_states``). fairseq's
        ``reorder_incremental_state_scripting`` asks every submodule for ``reorder_incremental_state`` on every
        call (97 ``hasattr`` for the quickstart decoder; ``python -m benchmarks.speed.beam_parts`` times both
        walks); the same calls in the same order here, with the modules that have it found once per search.
        ``same_sources``: every row of ``rows`` reads the source it read before (a beam reordered within its
        sentences), which the static step then need not check."""
        decoder = self.model.single_model.decoder
        if STATIC_KEY in state:  # the static step holds the source keys and values too
            state[STATIC_KEY].reorder(rows, same_sources)
            return encoder_outs
        if only_lean_state(state):  # the lean step's state is all there is
            reorder_lean_state(decoder, state, rows)
        elif type(decoder).reorder_incremental_state_scripting is not _FAIRSEQ_REORDER_WALK:
            decoder.reorder_incremental_state_scripting(state, rows)  # the decoder's own
        else:
            if self._reorder_modules is None:
                self._reorder_modules = [m for m in decoder.modules() if hasattr(m, "reorder_incremental_state")]
            incremental_state = state
            for module in self._reorder_modules:
                result = module.reorder_incremental_state(incremental_state, rows)
                if result is not None:
                    incremental_state = result
        if holds_encoder_states(decoder, state):
            return encoder_outs
        return self.model.reorder_encoder_out(encoder_outs, rows)

    @staticmethod
    def _nan_to_neg_inf(lprobs: Tensor) -> Tensor:
        """fairseq's rule that a NaN log-probability is -inf, in place. Looking for NaN over [N, K, V] every step
        costs more than the log-softmax (``python -m benchmarks.speed.beam_rows`` times the full pass against the
        check on the selected values), so the searches apply it only when a value they selected is NaN: ``max``,
        ``topk`` and :func:`top_b` rank NaN above every number, so a row with a NaN anywhere selects one, and the
        rest of the step is then redone on the corrected distributions: the same result as filling first."""
        return lprobs.masked_fill_(lprobs.isnan(), -math.inf)

    @staticmethod
    def _selected_nan(*selected: Tensor) -> bool:
        """Whether a selected value is NaN, so that :meth:`_nan_to_neg_inf` must run (CPU only: elsewhere
        :meth:`_constrain` has applied it)."""
        return selected[0].is_cpu and any(bool(t.isnan().any()) for t in selected)

    def _hypothesis(self, tokens: Tensor, cum: Tensor, attn: Optional[Tensor]) -> Dict[str, Tensor]:
        """A finished hypothesis from its words (ending in EOS), cumulative scores per position (as fairseq
        keeps them; the positional scores are their differences) and attention [src_len, len] or None."""
        length = tokens.numel()
        pos = cum.clone()
        pos[1:] = cum[1:] - cum[:-1]
        score = cum[-1]
        if self.normalize_scores:
            score = score / length ** self.len_penalty
        return {"tokens": tokens, "score": score, "attention": attn if attn is not None else torch.empty(0),
                "alignment": torch.empty(0), "positional_scores": pos}

    @staticmethod
    def _sorted(finalized):
        return [sorted(hs, key=lambda h: -float(h["score"])) for hs in finalized]

    # -- greedy: K argmax words per call ---------------------------------------------------------------------
    def _greedy_search(self, sample, bos_token: Optional[int] = None):
        """The group search with B = 1: the K argmax words per decoder call, cut at the first EOS of the group
        (a word that ends the hypothesis at j is kept when EOS is the argmax at j). One host read per group."""
        K = self.group_size
        bsz, src_len, max_len, n_steps, tokens, encoder_outs = self._start(sample, bos_token)
        state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        cum = torch.zeros(bsz, n_steps, dtype=torch.float, device=tokens.device)
        attn: Optional[Tensor] = None
        alive: List[int] = list(range(bsz))  # row -> sentence
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        k_index = torch.arange(K, device=tokens.device)
        rules = self._scripted_rules(tokens.device)
        fused = None  # the compiled greedy graph, where it is ready (fairseq_ext.sat.search_graph)
        if rules is not None:
            step_of = self.model.static_state(encoder_outs[0], state, bsz).step
            fused = search_graph.ready(step_of, self.model.single_model.decoder, self.eos, self._tie_margin)
            every_bias = self._base_bias.expand(K, self.vocab_size).contiguous()  # the rules' row at each position
        for step in range(0, n_steps, K):
            if search_graph.applies(fused, tokens.size(0) * K, self.temperature):
                # the decoder step, the projection, the rules and the choice in one compiled call
                bias = self._rule_bias(step, max_len)
                lprobs, best_lp, best, status, group_attn = self.model.decode_greedy(
                    fused, tokens[:, : step + K], encoder_outs[0], state, bias if bias.size(0) == K else every_bias)
                if attn is None:
                    attn = torch.zeros(bsz, src_len, n_steps, dtype=torch.float, device=tokens.device)
                step_rules._greedy_advance(tokens, cum, attn, best, best_lp, group_attn, step)
            else:
                # the static step at few rows: logits, then the rules, the choice and the writes in one scripted call
                scripted = rules is not None and tokens.size(0) <= step_rules.SCRIPTED_MAX_ROWS
                decode = self.model.decode_logits if scripted else self.model.decode_group
                out, group_attn = decode(tokens[:, : step + K], encoder_outs[0], state, self.temperature)
                if group_attn is not None and attn is None:
                    attn = torch.zeros(bsz, src_len, n_steps, dtype=torch.float, device=tokens.device)
                if scripted:
                    lprobs, status = rules[0](out, self._rule_bias(step, max_len), self.eos, tokens, cum, attn,
                                              group_attn, step, self._tie_margin)
                else:
                    lprobs = self._constrain(out, step, max_len)
                    best_lp, best, near = step_rules._greedy_choice(lprobs, self._tie_margin)  # [n, K], [n]
                    # the first EOS of each row's group (K if none), K + 1 where a selected value is NaN (CPU: see
                    # _constrain)
                    first_eos = torch.where(best.eq(self.eos), k_index, K).amin(dim=1)
                    if best_lp.is_cpu:
                        first_eos.masked_fill_(best_lp.isnan().any(dim=1), K + 1)
                    step_rules._greedy_advance(tokens, cum, attn, best, best_lp, group_attn, step)
                    status = torch.cat([first_eos, near.long()])
            status = status.tolist()  # the only host read of the step
            ends = status[: len(alive)]
            self._near_ties.update(alive[row] for row, v in enumerate(status[len(alive):]) if v)
            if max(ends) > K:  # a NaN chosen: the choice on the corrected distributions, written over
                best_lp, best = self._nan_to_neg_inf(lprobs).max(dim=-1)
                ends = torch.where(best.eq(self.eos), k_index, K).amin(dim=1).tolist()
                step_rules._greedy_advance(tokens, cum, attn, best, best_lp, group_attn, step)
            done = [row for row, j in enumerate(ends) if j < K]
            if not done:
                continue
            for row in done:
                length = step + ends[row] + 1
                finalized[alive[row]].append(self._hypothesis(
                    tokens[row, K: K + length].clone(), cum[row, :length],
                    attn[row, :, :length].clone() if attn is not None else None))
            keep_rows = [row for row, j in enumerate(ends) if j == K]
            if not keep_rows:
                break
            keep = torch.tensor(keep_rows, device=tokens.device)
            alive = [alive[row] for row in keep_rows]
            tokens, cum = tokens.index_select(0, keep), cum.index_select(0, keep)
            if attn is not None:
                attn = attn.index_select(0, keep)
            encoder_outs = self._reorder(state, encoder_outs, keep)
        return finalized

    def _beam_search(self, sample, bos_token: Optional[int] = None):
        """K = 1: fairseq's beam search (``search.BeamSearch.step`` and ``SequenceGenerator``'s finalisation) in
        fewer operations per step: the top 2B of every sentence's hypothesis scores plus next-word
        log-probabilities (``topk`` over [P x V], as fairseq's), its EOS candidates among the top B finalised in
        rank order (up to B per sentence; a sentence with B is done), the first B candidates that are not a finite
        EOS continued. One host read per step (which of the top B are EOS). Rows are ``sentence * P + parent``."""
        B, eos = self.beam_size, self.eos
        src_len, max_len, n_steps, tokens, encoder_outs, cum, scores, sents, finalized = self._beam_start(
            sample, bos_token)
        dev = tokens.device
        state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        attn: Optional[Tensor] = None
        P = 1
        # on the static step (and without n-gram blocking), at few rows, the step's rules, choice and bookkeeping
        # are scripted
        rules = self._scripted_rules(dev) if self.repeat_ngram_blocker is None else None
        fused = None  # the compiled beam graph (rows of B parents), where it is ready
        if rules is not None:
            step_of = self.model.static_state(encoder_outs[0], state, tokens.size(0)).step
            fused = search_graph.ready(step_of, self.model.single_model.decoder, eos, self._tie_margin, beam=B)
        for step in range(n_steps):
            n = len(sents)
            k = min(2 * B, P * self.vocab_size - 1)
            status = advanced = None
            scripted = rules is not None and n * P <= step_rules.SCRIPTED_MAX_ROWS
            if scripted:
                logits, step_attn = self.model.decode_logits(tokens[:, : step + 1], encoder_outs[0], state,
                                                             self.temperature)
                # the rules and the candidates: compiled (rows of B parents, where ready, with the advance for
                # when no sentence is done) or scripted
                if fused is not None and P == B and attn is not None and step_attn is not None:
                    out = fused.run(logits, self._rule_bias(step, max_len), scores, tokens, cum, attn, step_attn,
                                    torch.tensor(step))
                    (lprobs, cand_sc, parents, words, finite_eos, active, status), advanced = out[:7], out[7:]
                else:
                    lprobs, cand_sc, parents, words, finite_eos, active, status = rules[1](
                        logits, self._rule_bias(step, max_len), scores, n, P, k, B, eos, self._tie_margin)
                status = status.tolist()  # the host read of the step
                if status[n * B]:  # a NaN among the top k: the step again on the corrected distributions
                    status = advanced = None
            else:
                lprobs, step_attn = self.model.decode_group(tokens[:, : step + 1], encoder_outs[0], state,
                                                            self.temperature)
                lprobs = self._constrain(lprobs, step, max_len)
                if self.repeat_ngram_blocker is not None:  # tokens is fairseq's buffer exactly for K = 1
                    lprobs[:, 0] = self.repeat_ngram_blocker(tokens, lprobs[:, 0], n, P, step)
            if status is None:
                k = min(2 * B, P * lprobs.size(-1) - 1)
                cand_sc, parents, words, finite_eos, near = step_rules._top_candidates(lprobs, scores, n, P, k, B,
                                                                                       eos, self._tie_margin)
                if self._selected_nan(cand_sc):
                    lprobs = self._nan_to_neg_inf(lprobs)
                    cand_sc, parents, words, finite_eos, near = step_rules._top_candidates(
                        lprobs, scores, n, P, k, B, eos, self._tie_margin)
                active = None
                # the host read of the step (NaN: already turned into -inf above)
                status = step_rules._beam_status(finite_eos, B, near.new_zeros(()), near).tolist()
            self._near_ties.update(sents[s_] for s_, v in enumerate(status[n * B + 1:]) if v)
            if step_attn is not None and attn is None:
                attn = torch.zeros(tokens.size(0), src_len, n_steps, dtype=torch.float, device=dev)
            done = [False] * n
            for s_ in range(n):
                flags = status[s_ * B: (s_ + 1) * B]
                if not any(flags):
                    continue
                hyps = finalized[sents[s_]]
                for c, is_eos in enumerate(flags):
                    if is_eos and len(hyps) < B:
                        row = s_ * P + int(parents[s_, c])
                        a = None
                        if attn is not None:
                            a = torch.cat([attn[row, :, :step], step_attn[row, :1].transpose(0, 1).float()], 1)
                        hyps.append(self._hypothesis(
                            torch.cat([tokens[row, 1: 1 + step], tokens.new_full((1,), eos)]),
                            torch.cat([cum[row, :step], cand_sc[s_, c: c + 1]]), a))
                done[s_] = len(hyps) >= B
            if step >= max_len:  # every candidate was EOS: every sentence is done
                break
            keep_sents = [s_ for s_ in range(n) if not done[s_]]
            if not keep_sents:
                break
            # the first B candidates of each remaining sentence that are not a finite EOS (fairseq's active_hypos)
            if active is None:
                active = step_rules._active_hypotheses(finite_eos, B)
            keep = torch.tensor(keep_sents, device=dev) if len(keep_sents) < n else None
            if keep is None and advanced is not None:  # the compiled graph's advance: every sentence kept
                rows, scores, tokens, cum, attn = advanced
            else:
                if keep is not None:
                    active, cand_sc = active.index_select(0, keep), cand_sc.index_select(0, keep)
                    parents, words = parents.index_select(0, keep), words.index_select(0, keep)
                base = (keep if keep is not None else torch.arange(n, device=dev)).unsqueeze(1) * P
                advance = rules[2] if scripted else step_rules._beam_advance
                rows, scores, tokens, cum, attn = advance(tokens, cum, attn, step_attn, cand_sc, parents, words,
                                                          active, base, torch.tensor([step], device=dev))
            sents = [sents[s_] for s_ in keep_sents]
            # the rows of a sentence stay together: the sources move only when the beam opens or sentences leave
            encoder_outs = self._reorder(state, encoder_outs, rows, same_sources=P == B and keep is None)
            P = B
        return self._sorted(finalized)

    def _group_beam_search(self, sample, bos_token: Optional[int] = None):
        """One vectorised step per group (see the module docstring for the rule and the proof of exactness).
        Rows are ``sentence * P + parent``; P = 1 at the first group (every hypothesis is the empty one), then B.
        The enumerated step of a group of B parents runs as one compiled call where its graph is ready
        (:class:`~fairseq_ext.sat.search_graph.GroupBeamGraph`, the same tensors)."""
        K, B, eos = self.group_size, self.beam_size, self.eos
        src_len, max_len, n_steps, tokens, encoder_outs, cum, scores, sents, finalized = self._beam_start(
            sample, bos_token)
        dev = tokens.device
        state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        attn: Optional[Tensor] = None
        P = 1
        # the group step, chosen once per search: the enumeration; K = 1 (one position, fairseq's beam) prunes with
        # a single top B, fewer ops than the enumeration; so does a beam with too many rank tuples
        cands = self._rank_tuples(B, K, dev) if K > 1 else None
        enumerate_ = cands is not None and cands[0].size(0) <= self.ENUMERATE_MAX_CANDIDATES
        group_step = self._enumerated_group if enumerate_ else self._pruned_group
        fused = None  # the compiled group step (rows of B parents, K positions before --max-len), where ready
        if enumerate_ and self._scripted_rules(dev) is not None:
            step_of = self.model.static_state(encoder_outs[0], state, tokens.size(0)).step
            fused = search_graph.ready(step_of, self.model.single_model.decoder, eos, self._tie_margin, beam=B,
                                       slots=self._group_slots(cands, K))
            every_bias = self._base_bias.expand(K, self.vocab_size).contiguous()  # the rules' row at each position
        for step in range(0, n_steps, K):
            n = len(sents)
            last = min(K - 1, max_len - step)  # positions after --max-len are never reached
            done_by_graph = advanced = None
            if fused is not None and P == B and last == K - 1 and attn is not None and self.temperature == 1.0 \
                    and n * P <= step_rules.SCRIPTED_MAX_ROWS:
                lprobs, group_attn = self.model.decode_logits(tokens[:, : step + K], encoder_outs[0], state)
                bias = self._rule_bias(step, max_len)
                done_by_graph = self._fused_group(fused, lprobs, bias if bias.size(0) == K else every_bias, scores,
                                                  tokens, cum, attn, group_attn, step, cands, P)
                if done_by_graph is None:  # a NaN selected: the step below on the corrected distributions
                    lprobs = torch.log_softmax(lprobs, dim=-1)
            else:
                lprobs, group_attn = self.model.decode_group(tokens[:, : step + K], encoder_outs[0], state,
                                                             self.temperature)
            if done_by_graph is not None:
                (fin_list, ended, alive, X, chosen), advanced = done_by_graph
            else:
                # per position, the B best non-EOS words [N, K, B] and EOS [N, K]
                lprobs = self._constrain(lprobs, step, max_len)
                if self.repeat_ngram_blocker is not None:  # K = 1 only: then `tokens` is fairseq's buffer exactly
                    lprobs[:, 0] = self.repeat_ngram_blocker(tokens, lprobs[:, 0], n, P, step)
                eos_lp = lprobs[:, :, eos].clone()  # [N, K]
                lprobs[:, :, eos] = -math.inf
                vals, words = top_b(lprobs, B)
                if self._selected_nan(vals, eos_lp):
                    self._nan_to_neg_inf(eos_lp)
                    vals, words = top_b(self._nan_to_neg_inf(lprobs), B)
                if group_attn is not None and attn is None:
                    attn = torch.zeros(tokens.size(0), src_len, n_steps, dtype=torch.float, device=dev)
                fin_list, ended, alive, X, chosen = group_step(scores, vals, words, eos_lp, n, P, last, cands)

            # the host needs which hypotheses end (in rank order, per position): one read per group
            done = [False] * n
            for j in range(last + 1):
                for s in range(n):
                    if done[s]:
                        continue
                    hyps = finalized[sents[s]]
                    for c in fin_list[j][s]:
                        if c < 0 or len(hyps) >= B:
                            continue
                        row, tail_words, tail_cum = ended(j, s, c)
                        words_ = torch.cat([tokens[row, K: K + step], tail_words, tokens.new_full((1,), eos)])
                        cums = torch.cat([cum[row, :step], tail_cum])
                        a = None
                        if attn is not None:
                            a = torch.cat([attn[row, :, :step], group_attn[row, : j + 1].transpose(0, 1).float()], 1)
                        hyps.append(self._hypothesis(words_, cums, a))
                    if len(hyps) >= B:
                        done[s] = True
            if step + K > max_len:  # the group reached --max-len: every sentence is done
                break
            keep_sents = [s for s in range(n) if not done[s]]
            if not keep_sents:
                break

            # the next hypotheses: the exact top B K-word continuations of each remaining sentence
            if advanced is not None and len(keep_sents) == n:  # the compiled step's, every sentence kept
                rows, scores, tokens, cum, attn = advanced
            else:
                keep = torch.tensor(keep_sents, device=dev)
                scores, sel = alive.reshape(n, P * X).index_select(0, keep).topk(B, dim=1)  # [n', B]
                rows = (keep.unsqueeze(1) * P + torch.div(sel, X, rounding_mode="floor")).view(-1)
                new_words, new_cum = chosen(rows * X + sel.view(-1) % X)  # [n' * B, K] each
                tokens = tokens.index_select(0, rows)
                tokens[:, K + step: 2 * K + step] = new_words
                cum = cum.index_select(0, rows)
                cum[:, step: step + K] = new_cum
                if attn is not None:
                    attn = attn.index_select(0, rows)
                    attn[:, :, step: step + K] = group_attn.index_select(0, rows).transpose(1, 2)
                scores = scores.view(-1)
            sents = [sents[s] for s in keep_sents]
            P = B
            encoder_outs = self._reorder(state, encoder_outs, rows)
        return self._sorted(finalized)


class SATSequenceGenerator(SequenceGeneratorWithAlignment, _GroupSearch):
    """Generator returned by ``--task translation_sat``: same constructor arguments and hypothesis
    dictionaries (tokens, score, positional_scores, attention, alignment) as fairseq's SequenceGenerator.

    ``decoder_calls`` counts the decoder calls of the last :meth:`generate` (for tests and benchmarks).
    ``lean_step`` (default True): decoder calls go through the lean step of :mod:`fairseq_ext.inference.lean_decoder`
    (the same float32 products as fairseq's layers, summed in another order: ~1e-6) where
    :func:`~fairseq_ext.inference.lean_decoder.lean_refusal` finds nothing against the decoder, ``float32_on_cpu``
    and :func:`~fairseq_ext.inference.lean_decoder.lean_applies` allow (fairseq's and the SAT's transformer
    decoders, float32 on the CPU); ``lean_step=False``
    (``--no-lean-step``) runs the decoder's own step. ``uses_lean_step`` says which it is. The search runs on
    PyTorch's ops (the log-softmax, fairseq's rules, :func:`top_b` and the group steps of
    :mod:`fairseq_ext.sat.group_step`).
    Refused with one line: ``--match-source-len``, and ``--no-repeat-ngram-size`` with K > 1 (the words of a
    group are chosen together, so an n-gram cannot be blocked by the group's own words)."""

    def __init__(self, models, tgt_dict, print_alignment=None, lean_step: bool = True, static_step: bool = True,
                 **kwargs):
        if kwargs.get("match_source_len"):
            raise FairseqExtError("--match-source-len is not supported by --task translation_sat; remove it")
        SequenceGenerator.__init__(self, SATEnsembleModel(models, lean_step=lean_step, static_step=static_step),
                                   tgt_dict, **kwargs)
        self.group_size = self.model.group_size
        if self.repeat_ngram_blocker is not None and self.group_size > 1:
            raise FairseqExtError(
                f"--no-repeat-ngram-size is not supported by --task translation_sat with --sat-group-size "
                f"{self.group_size} (the K words of a group are chosen at once); remove it")
        if type(self.search) is not search.BeamSearch:
            raise FairseqExtError("translation_sat supports beam search and greedy search only")
        self.left_pad_target = False
        self.print_alignment = print_alignment
        self._reorder_modules = None
        self._near_ties = set()  # sentences of the call with a near-tie (_redo_near_ties)
        if print_alignment == "soft":
            self.extract_alignment = utils.extract_soft_alignment
        else:
            self.extract_alignment = utils.extract_hard_alignment
        self.decoder_calls = 0

    @property
    def uses_lean_step(self) -> bool:
        """Whether decoder calls take the lean step now (see the class docstring)."""
        return self.model.uses_lean_step

    # set by --task translation's default generator (fairseq_ext/inference/default_generator.py): builds fairseq's
    # generator for a call with prefix tokens or constraints (the hub's inference_step_args) and for the sentences
    # with a near-tie (_redo_near_ties)
    stock_fallback = None
    _tie_margin = 0.0
    near_tie_sentences = 0  # sentences decoded again by fairseq's generator, over this generator's life

    def _redo_near_ties(self, models, sample, out):
        """The sentences where two candidates of a step, or two finished hypotheses, were closer in score than
        :data:`~fairseq_ext.sat.step_rules.TIE_MARGIN` decoded again by fairseq's generator (their rows of the
        batch, with the batch's padding), so that float32 sums ordered differently from fairseq's never pick
        another hypothesis than fairseq's."""
        ties = self._near_ties
        ties.update(i for i, hs in enumerate(out) if any(float(a["score"]) - float(b["score"]) < self._tie_margin
                                                         for a, b in zip(hs, hs[1:])))
        if not ties:
            return out
        ids = sorted(ties)
        net = sample["net_input"]
        bsz = net["src_tokens"].size(0)
        index = torch.tensor(ids, device=net["src_tokens"].device)
        rows = {k: v.index_select(0, index) if isinstance(v, Tensor) and v.dim() > 0 and v.size(0) == bsz else v
                for k, v in net.items()}
        for i, hyps in zip(ids, self.stock_fallback().generate(models, {"net_input": rows})):
            out[i] = hyps
        self.near_tie_sentences += len(ids)
        logger.debug(f"fairseq_ext: {len(ids)} sentence(s) with a near-tie decoded by fairseq's SequenceGenerator")
        return out

    def generate(self, models, sample: Dict[str, Dict[str, Tensor]], **kwargs) -> List[List[Dict[str, Tensor]]]:
        if self.stock_fallback is not None and (kwargs.get("prefix_tokens") is not None
                                                or kwargs.get("constraints") is not None):
            logger.info("fairseq_ext: prefix tokens / constraints: this call is decoded by fairseq's "
                        "SequenceGenerator")
            return self.stock_fallback().generate(models, sample, **kwargs)
        if kwargs.get("prefix_tokens") is not None:
            raise FairseqExtError("translation_sat does not support --prefix-size (prefix tokens)")
        if kwargs.get("constraints") is not None:
            raise FairseqExtError("translation_sat does not support --constraints")
        self.model.decoder_calls = 0
        # standing in for fairseq's generator (K = 1), a sentence with a near-tie is decoded again by it
        self._tie_margin = step_rules.TIE_MARGIN if self.stock_fallback is not None and self.group_size == 1 else 0.0
        self._near_ties = set()
        with torch.inference_mode():
            if self.print_alignment:  # fairseq's alignment code around our _generate
                out = SequenceGeneratorWithAlignment.generate(self, models, sample, **kwargs)
            else:
                out = self._generate(sample, **kwargs)
        self.decoder_calls = self.model.decoder_calls
        if self._tie_margin:
            out = self._redo_near_ties(models, sample, out)
        # callers update the hypotheses in place (fairseq-generate divides positional_scores by log 2), which
        # inference tensors do not allow outside inference mode: hand back ordinary copies
        return [[{k: v.clone() if isinstance(v, Tensor) else v for k, v in h.items()} for h in hs] for hs in out]
