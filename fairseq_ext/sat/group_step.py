"""The step of the SAT's exact group beam search (:class:`fairseq_ext.sat.generator.SATSequenceGenerator`): from
the B best words of each of the K positions of a group, the exact top B K-word continuations of every sentence.

Why the per-position top B suffice (exactness). Let L_k be the B best non-EOS words at position k. (i) A
continuation c in the top B of its parent uses only words of L_k at every position k: if c_k were not in
L_k, replacing c_k by each of the B words of L_k would give B other continuations of the same parent,
each scoring >= c (the score is a sum over positions, and every word of L_k scores >= c_k at k), so c
would not be needed in a top B. (ii) The same argument on prefixes: the top B prefixes of length j+1 are
extensions of the top B prefixes of length j by words of L_j, so pruning the B x B sums to the best B
after each position is exact (a prefix outside the top B at length j has B better ones, and extending
each of them by the same later words keeps them better). (iii) Globally, the top B of a sentence over all
parents is contained in the union of the parents' top B: a continuation outside its parent's top B has B
better ones. The hypotheses that end at j extend the top B prefixes of length j by EOS, so they are exact
too. (iv) Fewer candidates still: write a prefix over the L_k as its ranks r_k (0 = best). Every tuple
r' <= r (element-wise) scores >= r, and there are prod_k (r_k + 1) of them, so a prefix with
prod_k (r_k + 1) > B has B others of its parent at least as good: the tuples with prod_k (r_k + 1) <= B
(for B = 4, K = 6: 105 of all lengths 0..6, against 4^6 = 4,096 continuations) hold every top B.
The step scores them all at once, with one top-B per position for the whole group
(:meth:`GroupStep._enumerated_group`); K = 1 and a beam too wide for that (over
``ENUMERATE_MAX_CANDIDATES`` tuples) prune position by position as in (ii)
(:meth:`GroupStep._pruned_group`). ``tests/sat/`` checks both against brute-force
enumeration of every continuation.
"""

import math

import torch


class GroupStep:
    """The group steps, mixed into the generator (they read the generator's caches)."""

    # A group step returns (fin_list, ended, alive, X, chosen) for rows ``sentence * P + parent``:
    #   fin_list[j][s]: the candidates that end at position j among sentence s's top B at that length, in rank
    #     order (-1: not an ending one); ended(j, s, c) -> (row, its words in the group, its cumulative scores
    #     in the group, EOS included); alive [N, X]: the scores of the X continuations of each row that fill
    #     the group (-inf where a candidate does not); chosen(flat indices row * X + x) -> (words, cumulative
    #     scores) [M, K] of those continuations.
    ENUMERATE_MAX_CANDIDATES = 256  # rank tuples per parent up to which _enumerated_group is used

    def _rank_tuples(self, B: int, K: int, device):
        """The rank tuples (r_0..r_{L-1}), L = 0..K, with prod_k (r_k + 1) <= B, as ranks [C, K] (padded with 0)
        and lengths [C] / list. A prefix whose ranks (indices into the per-position top B, best first) have a
        larger product has at least B others of its parent scoring >= it (every tuple r' <= r element-wise;
        there are prod (r_k + 1) of them), so it is never needed in a top B: these C tuples hold every parent's
        top B prefixes of every length, and the empty prefix (L = 0), which ends at position 0."""
        cache = self.__dict__.setdefault("_rank_tuple_cache", {})
        key = (B, K, str(device), self.ENUMERATE_MAX_CANDIDATES)
        if key not in cache:
            tuples = []

            def grow(prefix, prod, L):
                if len(prefix) == L:
                    tuples.append(prefix)
                    return
                for r in range(B):
                    if prod * (r + 1) > B:
                        break
                    grow(prefix + (r,), prod * (r + 1), L)

            for L in range(K + 1):
                grow((), 1, L)
                if len(tuples) > self.ENUMERATE_MAX_CANDIDATES:  # too many: the pruned step is used
                    break
            ranks = torch.tensor([t + (0,) * (K - len(t)) for t in tuples], dtype=torch.long, device=device)
            lengths = [len(t) for t in tuples]
            cache[key] = (ranks, torch.tensor(lengths, device=device), lengths)
        return cache[key]

    def _enumerated_slots(self, cands, J: int):
        """What the enumerated step ranks at each position j < J, fixed per (rank tuples, J) and cached: the
        candidates that end at j (length j), then the prefixes of length j + 1, padded to W slots per position.
        Returns (index [J * W] into ``cat([end, prefix, -inf])`` of [N, 2C + 1], ends [1, J, 1] (slots below
        it end at j), slot_candidate[j][w] (the candidate of each slot), W) and, per candidate, the eos
        position [1, C] and the length [1, C, 1] and full-length mask [1, C] used by the step."""
        cache = self.__dict__.setdefault("_enumerated_slot_cache", {})
        key = (id(cands[0]), J)
        if key not in cache:
            ranks, lengths, length_list = cands
            C, K = ranks.size(0), ranks.size(1)
            index, slot_candidate, n_ends = [], [], []
            for j in range(J):
                ending = [c for c in range(C) if length_list[c] == j]
                growing = [c for c in range(C) if length_list[c] == j + 1]
                slot_candidate.append(ending + growing)
                index.append(ending + [C + c for c in growing])
                n_ends.append(len(ending))
            W = max(len(slots) for slots in index)
            index = torch.tensor([slots + [2 * C] * (W - len(slots)) for slots in index], device=lengths.device)
            cache[key] = (cands[0], index.view(-1), torch.tensor(n_ends, device=lengths.device).view(1, J, 1),
                          slot_candidate, W, lengths.clamp(max=K - 1).view(1, C), lengths.view(1, C, 1),
                          (lengths != K).view(1, C))
        return cache[key][1:]

    def _enumerated_group(self, scores, vals, words, eos_lp, n, P, last, cands):
        """The group step over every parent's candidate prefixes at once (:meth:`_rank_tuples`): one gather,
        one cumulative sum and one top-B for all positions, instead of a prune per position."""
        J = last + 1
        index, n_ends, slot_candidate, W, eos_at, length_at, not_full = self._enumerated_slots(cands, J)
        cand_words, cand_cum, end, fin, alive = enumerated_candidates(
            scores, vals, words, eos_lp, cands[0], index, n_ends, eos_at, length_at, not_full, P, J, W)
        return self._group_outputs(cands, J, P, cand_words, cand_cum, end, fin.transpose(0, 1).tolist(), alive)

    def _group_outputs(self, cands, J: int, P: int, cand_words, cand_cum, end, fin_list, alive):
        """(fin_list, ended, alive, X, chosen) of an enumerated group step (see above) from the tensors of
        :func:`enumerated_candidates` (computed by :meth:`_enumerated_group`, or by the compiled graph of
        :class:`~fairseq_ext.sat.search_graph.GroupBeamGraph`) and ``fin_list`` [J, n, B] read on the host."""
        length_list = cands[2]
        _index, _n_ends, slot_candidate, W = self._enumerated_slots(cands, J)[:4]
        K = cand_words.size(2)

        def ended(j, s, i):
            row, c = s * P + i // W, slot_candidate[j][i % W]
            L = length_list[c]
            return row, cand_words[row, c, :L], torch.cat([cand_cum[row, c, 1: L + 1], end[row, c: c + 1]])

        def chosen(flat):
            return (cand_words.reshape(-1, K).index_select(0, flat),
                    cand_cum[:, :, 1:].reshape(-1, K).index_select(0, flat))

        return fin_list, ended, alive, alive.size(1), chosen

    def _group_slots(self, cands, K: int):
        """The enumeration's constants for a step of K positions, as :class:`~fairseq_ext.sat.search_graph.
        GroupBeamGraph` takes them."""
        index, n_ends, _slot_candidate, W, eos_at, length_at, not_full = self._enumerated_slots(cands, K)
        return cands[0], index, n_ends, W, eos_at, length_at, not_full

    def _fused_group(self, graph, logits, bias, scores, tokens, cum, attn, group_attn, step: int, cands, P: int):
        """The enumerated group step of K positions on its compiled graph (:class:`~fairseq_ext.sat.search_graph.
        GroupBeamGraph`): (the group step's outputs, the next (rows, scores, tokens, cum, attn) with every sentence
        kept), or None where a selected value is NaN (the search then takes its own step on the corrected
        distributions)."""
        out = graph.run(logits, bias, scores, tokens, cum, attn, group_attn, torch.tensor(step))
        if bool(out[0]):
            return None
        return self._group_outputs(cands, logits.size(1), P, out[2], out[3], out[4], out[1].tolist(), out[5]), out[6:]

    def _pruned_group(self, scores, vals, words, eos_lp, n, P, last, cands):
        """The group step position by position: the top-B prefixes of length j + 1 from those of length j and
        the B best words at j (exact, see the module docstring); for K = 1 (a single top B) and for a beam too wide
        for the enumeration (``cands`` is then unused)."""
        B = vals.size(2)
        K = vals.size(1)
        pre_cum = (scores.unsqueeze(1) + vals[:, 0]).unsqueeze(2)  # [N, B, 1]
        pre_words = words[:, 0].unsqueeze(2)  # [N, B, 1]
        ended_at = []  # per position j: (cumulative scores [N, F, j+1], words [N, F, j]) of hypotheses ending at j
        ranked = []  # per position j: top B (score, index) per sentence over the ending ones and the prefixes
        prev_cum, prev_words = pre_cum, pre_words  # the prefixes of length j, read from j = 1 on
        for j in range(last + 1):
            if j == 0:
                end_cum = (scores + eos_lp[:, 0]).view(-1, 1, 1)
                end_words = pre_words[:, :1, :0]
            else:
                end_cum = torch.cat([prev_cum, (prev_cum[:, :, -1] + eos_lp[:, j: j + 1]).unsqueeze(2)], 2)
                end_words = prev_words
                # the B x B sums of the top-B prefixes of length j and the B best words at j -> best B
                ext = prev_cum[:, :, -1:] + vals[:, j].unsqueeze(1)  # [N, B, B]
                top, flat = ext.reshape(ext.size(0), -1).topk(B, dim=1)
                parent = torch.div(flat, B, rounding_mode="floor").unsqueeze(2).expand(-1, -1, j)
                pre_cum = torch.cat([prev_cum.gather(1, parent), top.unsqueeze(2)], 2)
                pre_words = torch.cat([prev_words.gather(1, parent),
                                       words[:, j].gather(1, flat % B).unsqueeze(2)], 2)
            F = end_cum.size(1)
            both = torch.cat([end_cum[:, :, -1].reshape(n, P * F), pre_cum[:, :, -1].reshape(n, P * B)], 1)
            ranked.append(both.topk(B, dim=1))
            ended_at.append((end_cum, end_words))
            prev_cum, prev_words = pre_cum, pre_words
        fin = torch.stack([torch.where((top_i < e_cum.size(1) * P) & top_sc.ne(-math.inf), top_i, -1)
                           for (top_sc, top_i), (e_cum, _) in zip(ranked, ended_at)])
        fin_list = fin.tolist()  # [last+1, n, B]

        def ended(j, s, c):
            end_cum, end_words = ended_at[j]
            F = end_cum.size(1)
            row, r = s * P + c // F, c % F
            return row, end_words[row, r], end_cum[row, r]

        def chosen(flat):
            return pre_words.reshape(-1, K).index_select(0, flat), pre_cum.reshape(-1, K).index_select(0, flat)

        return fin_list, ended, pre_cum[:, :, -1], B, chosen


def enumerated_candidates(scores, vals, words, eos_lp, ranks, index, n_ends, eos_at, length_at, not_full, P: int,
                          J: int, W: int):
    """The enumerated group step's tensors (:meth:`GroupStep._enumerated_group`; its cached slots
    :meth:`GroupStep._enumerated_slots` for J positions): rows ``sentence * P + parent`` of scores [N], the B best
    non-EOS words' log-probabilities and words per position ``vals``, ``words`` [N, K, B] and EOS's [N, K], and the
    rank tuples ``ranks`` [C, K]. Returns each candidate's words [N, C, K], cumulative scores [N, C, K + 1] (s(h)
    first) and score if it ends [N, C], the ending ones among each sentence's top B per position [n, J, B] (an
    index into that position's slots, -1 where none) and the scores of the candidates that fill the group [N, C]
    (-inf for the others). Plain tensor code, also compiled into the beam's graph."""
    N, K, B = vals.shape
    C = ranks.size(0)
    idx = ranks.t().unsqueeze(0).expand(N, K, C)
    cand_words = words.gather(2, idx).transpose(1, 2)  # [N, C, K]
    # cumulative scores along each candidate: s(h), then + lp_k(v_k) per position (cumsum accumulates in
    # double on a CPU: the same float as fairseq's running sum for K = 1, within an ulp per position beyond)
    cand_vals = vals.gather(2, idx).transpose(1, 2)  # [N, C, K]
    cand_cum = torch.cat([scores.view(N, 1, 1).expand(N, C, 1), cand_vals], 2).cumsum(2)  # [N, C, K + 1]
    prefix = cand_cum.gather(2, length_at.expand(N, C, 1)).squeeze(2)  # [N, C]
    # ending at position L: the prefix of length L, then EOS there (none for L = K: the group is full)
    end = prefix + eos_lp.gather(1, eos_at.expand(N, C))
    # per position j, the candidates of length j + 1: those ending at j and the prefixes of length j + 1
    ranked = torch.cat([end, prefix, end.new_full((N, 1), -math.inf)], 1).index_select(1, index)
    ranked = ranked.view(-1, P, J, W).transpose(1, 2).reshape(-1, J, P * W)
    top_sc, top_i = ranked.topk(B, dim=2)  # per sentence and position, the top B of that length
    fin = torch.where((top_i % W < n_ends) & top_sc.ne(-math.inf), top_i, -1)
    return cand_words, cand_cum, end, fin, prefix.masked_fill(not_full, -math.inf)
