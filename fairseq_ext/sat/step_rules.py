"""fairseq's per-step rules and choices of greedy and beam search as TorchScript functions, for the searches of
:class:`fairseq_ext.sat.generator.SATSequenceGenerator` on the static decoder step.

On the static step the decoder call is one captured graph; what remains per step is the search: the
log-softmax, fairseq's rules (no padding, the unknown-word penalty, EOS only at --max-len, no EOS before
--min-len, suppressed tokens), the choice of words and the bookkeeping of the rows. Run op by op from Python
these are ~25 small operations per step, each paying the interpreter and dispatcher more than its arithmetic;
scripted, one call each (``python -m benchmarks.speed.decode`` times the searches against CTranslate2's).

fairseq's rules as one additive row per position (:func:`rule_bias`): 0 where fairseq leaves a log-probability
as it is, -inf where it sets -inf, -penalty at the unknown word. ``x + 0 == x`` and ``x + (-p) == x - p`` in
IEEE arithmetic, so the sums equal fairseq's values bit for bit; a NaN stays NaN (fairseq turns it into -inf
first): the callers check the values they select for NaN and redo the step on the corrected distributions, as
the op-by-op searches do.

Where TorchScript is gone (PyTorch marks it deprecated) the same functions run as Python, one log line.
"""

import logging
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# The scripted functions save the Python and dispatch of ~25 small operations a step, and pay one more pass over the
# [rows, V] log-probabilities (the rules as a row added): a gain at few rows (batch 1, greedy and beam 4), a loss at
# many (batch 64), measured on the Acts test with the searches' op-by-op rules as the other arm. The searches use
# them up to this many rows a step.
SCRIPTED_MAX_ROWS = 16

# Where the searches stand in for fairseq's generator (``--task translation``'s default), two candidates closer
# than this in score are a near-tie: the step's own float32 sums differ from fairseq's by ~1e-6 (more over a long
# hypothesis), enough to order them the other way, so the sentence is decoded again by fairseq's generator.
TIE_MARGIN = 2e-5


def rule_bias(base: Tensor, eos: int, step: int, K: int, max_len: int, min_len: int) -> Tensor:
    """fairseq's rules for target positions step..step+K-1 as an additive [K, V] row per position, or ``base``
    (:func:`base_bias`: padding and suppressed tokens -inf, the unknown word -penalty) where no length rule
    applies."""
    last = max(max_len - step, 0)  # positions k >= last: only EOS
    if last >= K and step >= min_len:
        return base
    b = base.expand(K, base.size(1)).clone()
    if last < K:
        b[last:, :eos] = -math.inf
        b[last:, eos + 1:] = -math.inf
    if step < min_len:
        b[: min_len - step, eos] = -math.inf
    return b


def base_bias(V: int, pad: int, unk: int, unk_penalty: float, suppress, device) -> Tensor:
    """The rules of every step as [1, V] (see :func:`rule_bias`)."""
    b = torch.zeros(1, V, device=device)
    b[0, pad] = -math.inf
    if unk_penalty != 0:
        b[0, unk] = -unk_penalty
    if suppress is not None:
        b[0, suppress] = -math.inf
    return b


TOP_K_CHUNK = 64  # words per chunk of chunked_topk: the fastest of 32 / 64 / 128 on an 8,000-word row
# The greedy choice's best two words per position go through chunked_topk (chunks of TOP_K_CHUNK words) from this
# many rows x positions on; for one, topk is faster (python -m benchmarks.speed.beam_rows: 1.3-1.6x at 2 rows, ~5x at
# 64, 0.8x at 1).
GREEDY_CHUNKED_MIN_ROWS = 2


def _greedy_choice(lprobs: Tensor, margin: float, chunk: int = TOP_K_CHUNK,
                   min_rows: int = GREEDY_CHUNKED_MIN_ROWS) -> Tuple[Tensor, Tensor, Tensor]:
    """The best log-probability and word of each position [N, K] (``max``), and [N] whether a row's best and
    second best are closer than ``margin`` at a position (a near-tie: :data:`TIE_MARGIN`; never with 0). The two
    best by ``topk``, by :func:`chunked_topk` from ``min_rows`` rows, or (``chunk`` 0) as two maxima: the same
    values; among exactly equal values another word, which is a near-tie."""
    if margin <= 0.0:
        best_lp, best = lprobs.max(dim=-1)
        return best_lp, best, torch.zeros(lprobs.size(0), dtype=torch.bool, device=lprobs.device)
    N, K, V = lprobs.size(0), lprobs.size(1), lprobs.size(2)
    flat = lprobs.reshape(N * K, V)
    if chunk == 0:  # two maxima, the best and the best of the others: one loop each in a compiled graph
        best_lp, best = flat.max(dim=1)
        others = torch.where(torch.arange(V, device=flat.device) == best.unsqueeze(1), float("-inf"), flat)
        second = others.amax(dim=1)
        return best_lp.view(N, K), best.view(N, K), (best_lp - second < margin).view(N, K).any(dim=1)
    if N * K >= min_rows and V >= 2 * chunk:
        values, index = chunked_topk(flat, 2, chunk)
    else:
        values, index = flat.topk(2, dim=1)
    values, index = values.view(N, K, 2), index.view(N, K, 2)
    best_lp, best = values[..., 0], index[..., 0]
    return best_lp, best, (best_lp - values[..., 1] < margin).any(dim=1)


def _greedy_pick(logits: Tensor, bias: Tensor, eos: int, margin: float, min_rows: int = GREEDY_CHUNKED_MIN_ROWS,
                 chunk: int = TOP_K_CHUNK) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """logits [N, K, V] -> (log-probabilities after the rules [N, K, V], the best of each position and its word
    [N, K], and a status [2N]: the first EOS among each row's K words (K where none; K + 1 where a chosen value is
    NaN), then each row's near-tie flag (:func:`_greedy_choice`, chunked maxima from ``min_rows`` rows))."""
    lprobs = torch.log_softmax(logits, dim=-1).add_(bias)
    best_lp, best, near = _greedy_choice(lprobs, margin, chunk, min_rows)
    K = best.size(1)
    ends = torch.where(best == eos, torch.arange(K, device=best.device), K).amin(dim=1)
    ends = ends.masked_fill(best_lp.isnan().any(dim=1), K + 1)
    return lprobs, best_lp, best, torch.cat([ends, near.long()])


def _greedy_advance(tokens: Tensor, cum: Tensor, attn: Optional[Tensor], best: Tensor, best_lp: Tensor,
                    group_attn: Optional[Tensor], step: int) -> None:
    """Writes a greedy group's K words at positions step..step+K-1 (after the K - 1 start symbols and BOS of
    ``tokens``), their cumulative scores (fairseq's running float sum for K = 1; cumsum for a group) and their
    attention, in place."""
    K = best.size(1)
    tokens[:, K + step: 2 * K + step] = best
    if K == 1:
        if step == 0:
            cum[:, 0:1] = best_lp
        else:
            cum[:, step: step + 1] = cum[:, step - 1: step] + best_lp
    else:
        if step == 0:
            prev = torch.zeros(cum.size(0), 1, dtype=cum.dtype, device=cum.device)
        else:
            prev = cum[:, step - 1: step]
        cum[:, step: step + K] = torch.cat([prev, best_lp], 1).cumsum(1)[:, 1:]
    if attn is not None and group_attn is not None:
        attn[:, :, step: step + K] = group_attn.transpose(1, 2)


def _greedy_step(logits: Tensor, bias: Tensor, eos: int, tokens: Tensor, cum: Tensor, attn: Optional[Tensor],
                 group_attn: Optional[Tensor], step: int, margin: float) -> Tuple[Tensor, Tensor]:
    """:func:`_greedy_pick` then :func:`_greedy_advance`: (log-probabilities after the rules, the status of
    :func:`_greedy_pick`; where a chosen value is NaN the caller writes the corrected choice over this one)."""
    lprobs, best_lp, best, status = _greedy_pick(logits, bias, eos, margin)
    _greedy_advance(tokens, cum, attn, best, best_lp, group_attn, step)
    return lprobs, status


# The beam's top 2B over a sentence's P x V scores goes through chunked_topk from this many chunks on (beam 4 over
# 8,000 words: 500 chunks, faster than topk; the first step's single row of 8,000: topk is faster), and never with
# fewer chunks than candidates. python -m benchmarks.speed.beam_rows times both.
FLAT_CHUNKS_MIN = 256


def chunked_topk(rows: Tensor, k: int, chunk: int = TOP_K_CHUNK) -> Tuple[Tensor, Tensor]:
    """``rows.topk(k, dim=1)`` ([R, V] -> values and indices [R, k], best first) through chunk maxima. Each row is
    cut into chunks of ``chunk`` words; its k best words lie in the k chunks with the largest maxima (a word in
    another chunk has k chunk maxima, k distinct words, at least as large), so one top-k over the chunk maxima and
    one over the k chosen chunks (and the V mod ``chunk`` tail words) give the same values as a top-k over the
    row; indices equal too but among equal values. NaN ranks first, as in ``topk`` (a chunk with a NaN has a NaN
    maximum). Needs at least k chunks."""
    R, V = rows.size(0), rows.size(1)
    n = V // chunk
    chunks = rows[:, : n * chunk].view(R, n, chunk)
    best_chunks = chunks.amax(dim=2).topk(k, dim=1).indices  # [R, k]
    cand = chunks.gather(1, best_chunks.unsqueeze(2).expand(-1, -1, chunk)).reshape(R, k * chunk)
    cand_index = (best_chunks.unsqueeze(2) * chunk + torch.arange(chunk, device=rows.device)).view(R, k * chunk)
    if n * chunk < V:  # the tail words are candidates too
        cand = torch.cat([cand, rows[:, n * chunk:]], 1)
        tail = torch.arange(n * chunk, V, device=rows.device).expand(R, V - n * chunk)
        cand_index = torch.cat([cand_index, tail], 1)
    vals, i = cand.topk(k, dim=1)
    return vals, cand_index.gather(1, i)


def _top_candidates(lprobs: Tensor, scores: Tensor, n: int, P: int, k: int, B: int, eos: int, margin: float,
                    chunk: int = TOP_K_CHUNK, chunks_min: int = FLAT_CHUNKS_MIN
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fairseq's ``search.BeamSearch.step`` on log-probabilities [n * P, 1, V] of n sentences with P hypotheses each
    scoring ``scores`` [n * P]: the top k (2B) of hypothesis score plus word log-probability over P x V per
    sentence (:func:`chunked_topk` for long rows: the values of ``topk``, its indices but among equal values, which
    the near-tie check sees), their parents and words, which are EOS with a finite score, and whether a sentence
    has a near-tie (:func:`_near_ties`; never with ``margin`` 0). Returns (cand_sc, parents, words, finite_eos,
    near), each [n, k] but near [n]."""
    V = lprobs.size(-1)
    flat = (lprobs.view(n, P, V) + scores.view(n, P, 1)).view(n, P * V)
    kk = k + 1 if margin > 0.0 else k  # the (k + 1)-th for the near-ties only
    if flat.size(1) // chunk >= max(chunks_min, kk):  # (TorchScript reads module constants as default arguments)
        values, cand_i = chunked_topk(flat, kk, chunk)
    else:
        values, cand_i = flat.topk(kk, dim=1)
    cand_sc, cand_i = values[:, :k].contiguous(), cand_i[:, :k].contiguous()
    parents = torch.div(cand_i, V, rounding_mode="floor")
    words = cand_i - parents * V
    finite_eos = words.eq(eos) & cand_sc.ne(-math.inf)
    if margin <= 0.0:
        return cand_sc, parents, words, finite_eos, torch.zeros(n, dtype=torch.bool, device=flat.device)
    return cand_sc, parents, words, finite_eos, _near_ties(values, finite_eos, B, margin)


def _near_ties(values: Tensor, finite_eos: Tensor, B: int, margin: float) -> Tensor:
    """[n]: whether two neighbours of a sentence's sorted top k + 1 ``values`` whose order decides the step are
    closer than ``margin``: any two of the first B + 1 (which EOS are finalised, and in which order) and the B-th
    candidate that is not a finite EOS with the next one (which hypotheses go on). Others may swap freely."""
    k = finite_eos.size(1)
    gaps = values[:, :-1] - values[:, 1:]  # [n, k]: candidate i against i + 1
    pos = torch.arange(k, device=values.device)
    last_active = (torch.cumsum((~finite_eos).long(), dim=1) >= B).long().argmax(dim=1, keepdim=True)
    decides = (pos < B).unsqueeze(0) | (pos.unsqueeze(0) == last_active)
    return ((gaps < margin) & decides).any(dim=1)


def _active_hypotheses(finite_eos: Tensor, B: int) -> Tensor:
    """The first B candidates of each sentence that are not a finite EOS (fairseq's active_hypos) [n, B]."""
    k = finite_eos.size(1)
    return (finite_eos.long() * k + torch.arange(k, device=finite_eos.device)).topk(B, dim=1, largest=False).indices


def _beam_candidates(logits: Tensor, bias: Tensor, scores: Tensor, n: int, P: int, k: int, B: int,
                     eos: int, margin: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fairseq's beam step on logits [n * P, 1, V]: the rules, :func:`_top_candidates`,
    :func:`_active_hypotheses` and one status row to read on the host: the EOS flags of the top B [n * B], whether
    a top-k score is NaN [1] and each sentence's near-tie flag [n]. Returns (lprobs, cand_sc, parents, words,
    finite_eos, active, status)."""
    lprobs = torch.log_softmax(logits, dim=-1).add_(bias)
    cand_sc, parents, words, finite_eos, near = _top_candidates(lprobs, scores, n, P, k, B, eos, margin)
    active = _active_hypotheses(finite_eos, B)
    return lprobs, cand_sc, parents, words, finite_eos, active, _beam_status(finite_eos, B, cand_sc.isnan().any(),
                                                                            near)


def _beam_status(finite_eos: Tensor, B: int, nan: Tensor, near: Tensor) -> Tensor:
    """The beam step's one host read: the EOS flags of each sentence's top B [n * B], whether a top-k score is NaN
    [1] (``nan``, a bool scalar), each sentence's near-tie flag [n]."""
    return torch.cat([finite_eos[:, :B].reshape(-1).long(), nan.long().view(1), near.long()])


def _beam_advance(tokens: Tensor, cum: Tensor, attn: Optional[Tensor], step_attn: Optional[Tensor], cand_sc: Tensor,
                  parents: Tensor, words: Tensor, active: Tensor, base: Tensor,
                  step: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The next hypotheses of a beam step: rows ``base + parent`` of the active candidates [n', B], their scores,
    the token buffer, cumulative scores and attention reordered and written at ``step`` (a one-element tensor, so
    that a compiled graph takes it as an input: :class:`~fairseq_ext.sat.search_graph.BeamGraph`). Returns (rows,
    scores, tokens, cum, attn)."""
    rows = (base + parents.gather(1, active)).view(-1)
    scores = cand_sc.gather(1, active).view(-1)
    tokens = tokens.index_select(0, rows).index_copy_(1, step + 1, words.gather(1, active).view(-1, 1))
    cum = cum.index_select(0, rows).index_copy_(1, step, scores.view(-1, 1).to(cum.dtype))
    if attn is not None and step_attn is not None:
        attn = attn.index_select(0, rows).index_copy_(
            2, step, step_attn[:, 0].index_select(0, rows).unsqueeze(2).to(attn.dtype))
    return rows, scores, tokens, cum, attn


def _script(fn):
    try:
        return torch.jit.script(fn)
    except Exception as e:  # a PyTorch without TorchScript: the same function as Python
        logger.info(f"step rules: torch.jit.script is not available ({type(e).__name__}); {fn.__name__} runs as "
                    f"Python (the same numbers, slower)")
        return fn


_SCRIPTED: List = []


def scripted():
    """(greedy_step, beam_candidates, beam_advance), scripted once per process."""
    if not _SCRIPTED:
        _SCRIPTED.extend(_script(f) for f in (_greedy_step, _beam_candidates, _beam_advance))
    return tuple(_SCRIPTED)
