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


def _greedy_pick(logits: Tensor, bias: Tensor, eos: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """logits [N, K, V] -> (log-probabilities after the rules [N, K, V], the best of each position and its word
    [N, K], the first EOS among each row's K words (K where none; K + 1 where a chosen value is NaN) [N])."""
    lprobs = torch.log_softmax(logits, dim=-1).add_(bias)
    best_lp, best = lprobs.max(dim=-1)
    K = best.size(1)
    ends = torch.where(best == eos, torch.arange(K, device=best.device), K).amin(dim=1)
    ends = ends.masked_fill(best_lp.isnan().any(dim=1), K + 1)
    return lprobs, best_lp, best, ends


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
                 group_attn: Optional[Tensor], step: int) -> Tuple[Tensor, Tensor]:
    """:func:`_greedy_pick` then :func:`_greedy_advance`: (log-probabilities after the rules, the first EOS of each
    row's group, K + 1 where a chosen value is NaN: the caller then writes the corrected choice over this one)."""
    lprobs, best_lp, best, ends = _greedy_pick(logits, bias, eos)
    _greedy_advance(tokens, cum, attn, best, best_lp, group_attn, step)
    return lprobs, ends


def _top_candidates(lprobs: Tensor, scores: Tensor, n: int, P: int, k: int,
                    eos: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """fairseq's ``search.BeamSearch.step`` on log-probabilities [n * P, 1, V] of n sentences with P hypotheses each
    scoring ``scores`` [n * P]: the top k (2B) of hypothesis score plus word log-probability over P x V per
    sentence, their parents and words, and which are EOS with a finite score. Returns (cand_sc, parents, words,
    finite_eos), each [n, k]."""
    V = lprobs.size(-1)
    cand_sc, cand_i = (lprobs.view(n, P, V) + scores.view(n, P, 1)).view(n, P * V).topk(k, dim=1)
    parents = torch.div(cand_i, V, rounding_mode="floor")
    words = cand_i - parents * V
    return cand_sc, parents, words, words.eq(eos) & cand_sc.ne(-math.inf)


def _active_hypotheses(finite_eos: Tensor, B: int) -> Tensor:
    """The first B candidates of each sentence that are not a finite EOS (fairseq's active_hypos) [n, B]."""
    k = finite_eos.size(1)
    return (finite_eos.long() * k + torch.arange(k, device=finite_eos.device)).topk(B, dim=1, largest=False).indices


def _beam_candidates(logits: Tensor, bias: Tensor, scores: Tensor, n: int, P: int, k: int, B: int,
                     eos: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fairseq's beam step on logits [n * P, 1, V]: the rules, :func:`_top_candidates`,
    :func:`_active_hypotheses` and one status row to read on the host: the EOS flags of the top B [n * B] and
    whether a top-k score is NaN [1]. Returns (lprobs, cand_sc, parents, words, finite_eos, active, status)."""
    lprobs = torch.log_softmax(logits, dim=-1).add_(bias)
    cand_sc, parents, words, finite_eos = _top_candidates(lprobs, scores, n, P, k, eos)
    active = _active_hypotheses(finite_eos, B)
    status = torch.cat([finite_eos[:, :B].reshape(-1).long(), cand_sc.isnan().any().long().view(1)])
    return lprobs, cand_sc, parents, words, finite_eos, active, status


def _beam_advance(tokens: Tensor, cum: Tensor, attn: Optional[Tensor], step_attn: Optional[Tensor], cand_sc: Tensor,
                  parents: Tensor, words: Tensor, active: Tensor, base: Tensor,
                  step: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The next hypotheses of a beam step: rows ``base + parent`` of the active candidates [n', B], their scores,
    the token buffer, cumulative scores and attention reordered and written at ``step``. Returns (rows, scores,
    tokens, cum, attn)."""
    rows = (base + parents.gather(1, active)).view(-1)
    scores = cand_sc.gather(1, active).view(-1)
    tokens = tokens.index_select(0, rows)
    tokens[:, step + 1] = words.gather(1, active).view(-1)
    cum = cum.index_select(0, rows)
    cum[:, step] = scores
    if attn is not None and step_attn is not None:
        attn = attn.index_select(0, rows)
        attn[:, :, step] = step_attn[:, 0].index_select(0, rows)
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
