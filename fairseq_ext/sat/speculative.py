"""Lossless speculative decoding: a SAT model drafts K words, the autoregressive verifier checks them in one call
(``--sat-draft-path SAT.pt`` of ``--task translation_sat``, greedy search; Stern et al. 2018, "Blockwise parallel
decoding", and Xia et al. 2023, "Speculative decoding", with a SAT drafter).

Notation: y_0 = BOS, y_1.. the words; the verifier's input at position p is y_p and its output there chooses
y_{p+1}; the SAT drafter's (group size K) input at position p is y_{p+1-K} (K-1 start symbols, then BOS).
After n accepted words the verifier's cache holds positions 0..n-1. One step of a sentence:

1. draft: one drafter call computes positions n..n+K-1 as one group over the inputs y_{n+1-K}..y_n (all
   accepted; the position n-1, when the drafter has not cached it yet, is computed in the same call, seeing the
   positions up to itself), and its argmax words there are the drafts d_1..d_K of y_{n+1}..y_{n+K};
2. verify: one verifier call over [y_n, d_1..d_K] at positions n..n+K (causal within the call) gives the
   verifier's own choices v_1..v_{K+1}, with its rules for each position (--min-len, --max-len-a/b, --unkpen, pad,
   EOS);
3. accept the longest prefix with d_i = v_i (a words), then v_{a+1}: a + 1 words, fewer where one of them is EOS
   (the sentence ends there);
4. both caches are cut back to what was accepted (:func:`fairseq_ext.inference.lean_decoder.cut_back`: a length
   change of views of the preallocated buffers, no copy); rows of a batch keep their own lengths
   (:func:`~fairseq_ext.inference.lean_decoder.rows_step`), and a finished sentence leaves the batch.

Why the output is the verifier's (exactness). Each accepted word is the verifier's choice given a prefix that is the
verifier's own (by induction: d_1..d_a equal v_1..v_a), so the search makes the verifier's greedy decisions, as
long as the verifier's log-probabilities computed here, over K + 1 positions and rows of other lengths, pick the
same word as its one-position greedy step would. In float32 they are not bit-identical (PyTorch's CPU products and
attention are not batch-invariant: sums are ordered by shape), so every decision is guarded: where the gap
between the best and the second-best (constrained) log-probability at a decided position is below ``eps``, the
sentence is decoded again by the verifier alone (our K = 1 greedy path, the sentence alone), and counted in
``stats["fallbacks"]``. A word whose gap is at least eps is the verifier's argmax in any evaluation that differs
from this one by less than eps / 2 per log-probability. ``python -m benchmarks.speed.speculative`` measures that
difference on the trained models (module :data:`EPS` gives the figures); tests/sat/test_speculative.py on random
ones. Scores are the verifier's log-probabilities of the accepted words (float noise from its own run).

Batching: a batch's rows accept different numbers of words; each call computes the same number of positions for
every row at that row's own offsets. Beam search and --nbest > 1 are refused with one line.
"""

import logging
import math
import os
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq import checkpoint_utils
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerDecoderBase

from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.inference.lean_decoder import cut_back, float32_on_cpu, reorder_rows_state, rows_refusal, rows_step
from fairseq_ext.sat.generator import SATSequenceGenerator
from fairseq_ext.sat.model import SATModel, group_size

logger = logging.getLogger(__name__)

# The guard of every decision (natural-log probability). The largest difference between a log-probability computed
# here and by the verifier's one-position step along the same prefix, over the 32,940 decided positions of the 1,003
# Acts verses with the release models, is 1.3e-5 (python -m benchmarks.speed.speculative, "noise" lines; the tests
# check the random models): a decision is trusted when its gap is 1e-3, so that a difference up to eps / 2 = 5e-4,
# 37 times the largest measured, cannot turn it.
EPS = 1e-3
# Batches of more sentences are decoded by the verifier alone: checking K + 1 positions per row and drafting them
# costs more arithmetic than it saves once a call is bound by its arithmetic rather than its fixed cost; on the
# release models every batch of 2 or more decoded slower (python -m benchmarks.speed.speculative --sweep 1 2 4 8;
# --sat-draft-max-batch).
MAX_BATCH = 1


def _state_dict_of(path: str):
    if not os.path.isfile(path):
        raise FairseqExtError(f"--sat-draft-path {path}: no such file (give a sat_transformer checkpoint)")
    return checkpoint_utils.load_checkpoint_to_cpu(path)


def _arch(state) -> str:
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        model = cfg["model"]
        return str(model.get("_name") or model.get("arch") or "") if hasattr(model, "get") else \
            str(getattr(model, "_name", None) or getattr(model, "arch", ""))
    return str(getattr(state.get("args"), "arch", ""))


def _dictionary_refusal(path: str, state, task) -> Optional[str]:
    """Why the drafter's dictionaries are not the task's (the verifier's), or None: the sizes of its embeddings,
    and the symbols of a dictionary file found with it (its training data's, or a release's dict.txt)."""
    weights = state["model"]
    for side, key, d in (("target", "decoder.embed_tokens.weight", task.target_dictionary),
                         ("source", "encoder.embed_tokens.weight", task.source_dictionary)):
        if key in weights and weights[key].size(0) != len(d):
            return (f"--sat-draft-path {path}: the drafter has a {side} dictionary of {weights[key].size(0)} "
                    f"symbols, the verifier's data {len(d)}; the drafter must be trained on the verifier's "
                    f"dictionary (fairseq-preprocess --srcdict/--tgtdict of its data)")
    cfg = state.get("cfg") or {}
    data = str((cfg.get("task") or {}).get("data", "") or "").split(os.pathsep)[0]
    tgt = getattr(getattr(task, "cfg", None), "target_lang", None)
    candidates = [os.path.join(os.path.dirname(os.path.abspath(path)), "dict.txt")]
    if data and tgt:
        candidates.append(os.path.join(data, f"dict.{tgt}.txt"))
    for f in candidates:
        if os.path.isfile(f):
            if Dictionary.load(f).symbols != task.target_dictionary.symbols:
                return (f"--sat-draft-path {path}: its dictionary {f} differs from the verifier's (same size, other "
                        f"symbols); train the drafter on the verifier's dictionary")
            break
    return None


def load_drafter(path: str, task, verifier):
    """The SAT drafter of ``path`` in eval mode, built with ``task``'s dictionaries (the verifier's); one line for
    a file that is not a SAT checkpoint or has another dictionary, and for an ensemble."""
    if os.pathsep in path and not os.path.isfile(path):
        raise FairseqExtError(f"--sat-draft-path {path}: one drafter, not an ensemble")
    state = _state_dict_of(path)
    arch = _arch(state)
    if not arch.startswith("sat_transformer"):
        raise FairseqExtError(f"--sat-draft-path {path}: the drafter must be a sat_transformer (this is "
                              f"{arch or 'an unknown model'}); train one with tools/train_drafter.py")
    why = _dictionary_refusal(path, state, task)
    if why:
        raise FairseqExtError(why)
    models, _ = checkpoint_utils.load_model_ensemble([path], task=task, state=state)
    drafter = models[0]
    if not isinstance(drafter, SATModel):
        raise FairseqExtError(f"--sat-draft-path {path}: the drafter must be a sat_transformer model")
    w = next(verifier.parameters())
    return drafter.to(device=w.device).eval()


def same_encoder(a, b) -> bool:
    """Whether two encoders compute the same function: the same class and configuration, equal weights, and the
    same output on a probe batch up to float noise (1e-5: PyTorch picks its attention kernel by whether the weights
    require gradients, as a frozen drafter's do not). Checked, never assumed; then the drafter reads the verifier's
    encoder output (which only changes what it drafts, never the output)."""
    if a is b:
        return True
    if type(a) is not type(b) or len(a.layers) != len(b.layers):
        return False
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k]) for k in sa):
        return False
    for name in ("embed_scale", "normalize_before", "max_source_positions", "padding_idx"):
        if getattr(a, name, None) != getattr(b, name, None):
            return False
    w = a.embed_tokens.weight
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, w.size(0), (2, 7), generator=g).to(w.device)
    src[:, -1] = 2
    src[1, :2] = a.padding_idx  # left padding, as fairseq pads sources
    lengths = src.ne(a.padding_idx).sum(1)
    with torch.inference_mode():
        oa, ob = a(src, src_lengths=lengths), b(src, src_lengths=lengths)
    return bool(torch.allclose(oa["encoder_out"][0], ob["encoder_out"][0], rtol=0, atol=1e-5))


def share_output_projection(verifier_decoder, drafter_decoder) -> bool:
    """Where the drafter's word embeddings and output projection equal the verifier's (a drafter trained with
    --sat-freeze-encoder and shared embeddings), the drafter uses the verifier's tensors: one copy in memory and
    in the cache for both (nothing changes numerically). Returns whether it does."""
    shared = False
    for name in ("output_projection", "embed_tokens"):
        mine, theirs = getattr(drafter_decoder, name, None), getattr(verifier_decoder, name, None)
        w, v = getattr(mine, "weight", None), getattr(theirs, "weight", None)
        if isinstance(w, torch.nn.Parameter) and isinstance(v, torch.nn.Parameter) and w is not v \
                and w.shape == v.shape and w.dtype == v.dtype and torch.equal(w, v):
            mine.weight = v
            shared = True
        elif w is v and w is not None:
            shared = True
    return shared


class SpeculativeSATGenerator(SATSequenceGenerator):
    """Greedy search of the verifier ``models[0]`` (``transformer`` or ``sat_transformer`` with K = 1) with the
    drafts of the SAT ``drafter`` (module docstring). ``stats`` counts, over every :meth:`generate` since it was
    made: sentences, verifier and drafter calls, drafted and accepted words, fallbacks (sentences decoded by the
    verifier alone because a decision was within ``eps``). Where the lean step cannot run the verifier and the
    drafter (a model that is not float32 on the CPU, ``--no-lean-step``, a decoder :func:`rows_refusal` names)
    every sentence is decoded by the verifier alone through the K = 1 greedy search (its own step where the lean
    one cannot run), said once in the log."""

    def __init__(self, models, drafter, tgt_dict, eps: float = EPS, max_batch: int = MAX_BATCH, **kwargs):
        super().__init__(models, tgt_dict, **kwargs)
        self.max_batch = int(max_batch)
        if self.group_size != 1:
            raise FairseqExtError(f"--sat-draft-path: --path must be the autoregressive verifier (a transformer or a "
                                  f"sat_transformer with K=1); this one has K={self.group_size}")
        if self.beam_size != 1:
            raise FairseqExtError("--sat-draft-path decodes greedily (its output is the verifier's greedy output): "
                                  "use --beam 1")
        if self.repeat_ngram_blocker is not None:
            raise FairseqExtError("--no-repeat-ngram-size is not supported with --sat-draft-path; remove it")
        self.drafter = drafter
        self.K = group_size(drafter)
        self.eps = float(eps)
        self.shares_encoder = same_encoder(self.model.single_model.encoder, drafter.encoder)
        self.shares_output = share_output_projection(self.model.single_model.decoder, drafter.decoder)
        self._transposed: Dict[tuple, Tensor] = {}
        self._lean = bool(kwargs.get("lean_step", True))
        self._said = False
        self.stats = dict(sentences=0, verifier_calls=0, drafter_calls=0, drafted=0, accepted=0, fallbacks=0,
                          sentences_alone=0)
        self.record = None  # a list: (sentence id, step, constrained log-probabilities) of each decided position

    def refusal(self) -> Optional[str]:
        """Why the speculative search does not run now (then the verifier decodes alone), or None."""
        if not self._lean:
            return "--no-lean-step"
        for who, model in (("verifier", self.model.single_model), ("drafter", self.drafter)):
            why = rows_refusal(model.decoder)
            if why:
                return f"the {who}: {why}"
            if not float32_on_cpu(model.decoder):
                return f"the {who} is not float32 on the CPU"
        return None

    def _greedy_search(self, sample, bos_token: Optional[int] = None):
        """The greedy search (reached by generate, --print-alignment's too): speculative where :meth:`refusal`
        allows it, else the verifier alone."""
        why = self.refusal()
        if why is None:
            if sample["net_input"]["src_tokens"].size(0) > self.max_batch:  # compute-bound: the verifier alone
                self.stats["sentences_alone"] += sample["net_input"]["src_tokens"].size(0)
                return super()._greedy_search(sample, bos_token)
            return self._speculative_search(sample, bos_token)
        if not self._said:
            logger.warning(f"--sat-draft-path: no drafts ({why}); the verifier decodes alone through the K=1 "
                           f"greedy search ({'lean' if self.uses_lean_step else 'its own'} step)")
            self._said = True
        return super()._greedy_search(sample, bos_token)

    # -- the verifier's rules, per row and position --------------------------------------------------------
    def _constrain_rows(self, scores: Tensor, n: List[int], max_len: int) -> Tensor:
        """fairseq's per-step rules (:meth:`_constrain`) on scores [B, T, V] whose position (r, t) decides the word
        n[r] + t (0-based); in place."""
        B, T = scores.shape[:2]
        scores[:, :, self.pad] = -math.inf
        if self.unk_penalty != 0:
            scores[:, :, self.unk] -= self.unk_penalty
        over_max, under_min = max(n) + T - 1 >= max_len, min(n) < self.min_len
        if over_max or under_min:
            steps = torch.tensor(n, device=scores.device).view(B, 1) + torch.arange(T, device=scores.device)
            if over_max:  # positions at --max-len: only EOS
                over = steps >= max_len
                eos = scores[:, :, self.eos].clone()
                scores.masked_fill_(over.unsqueeze(2), -math.inf)
                scores[:, :, self.eos] = torch.where(over, eos, scores[:, :, self.eos])
            if under_min:  # positions before --min-len: no EOS
                scores[:, :, self.eos] = scores[:, :, self.eos].masked_fill(steps < self.min_len, -math.inf)
        if self.token_indices_to_suppress is not None:
            scores[:, :, self.token_indices_to_suppress] = -math.inf
        return scores

    def _verifier_choices(self, x: Tensor, extra, n: List[int], max_len: int):
        """The verifier's word and its log-probability at each position [B, T], whether the gap to the second best
        is below eps, and the constrained log-probabilities."""
        if self.temperature != 1.0:
            x = x.div_(self.temperature)
        lprobs = self.model.single_model.get_normalized_probs((x, extra), log_probs=True, sample=None)
        lprobs = self._constrain_rows(lprobs.float() if lprobs.dtype != torch.float else lprobs, n, max_len)
        top, words = lprobs.topk(2, dim=-1)
        if self._selected_nan(top):  # fairseq's rule: NaN is -inf
            top, words = self._nan_to_neg_inf(lprobs).topk(2, dim=-1)
        # a single finite word (forced EOS) is clear
        unclear = (top[:, :, 0] - top[:, :, 1] < self.eps) & top[:, :, 1].ne(-math.inf)
        return words[:, :, 0], top[:, :, 0], unclear, lprobs

    def _output(self, decoder, x: Tensor) -> Tensor:
        """``decoder.output_layer(x)``: a float32 projection without bias as one product with the weight transposed
        (kept, one copy per weight: the same products, and faster for a few rows when the weight is not in the
        cache, as here where two models take turns: python -m benchmarks.speed.speculative)."""
        proj = getattr(decoder, "output_projection", None)
        if (type(proj) is not torch.nn.Linear or proj.bias is not None or decoder.adaptive_softmax is not None
                or type(decoder).output_layer is not TransformerDecoderBase.output_layer
                or x.dtype != torch.float32 or not x.is_cpu or proj.weight.dtype != torch.float32):
            return decoder.output_layer(x)
        w = proj.weight
        key = (w.data_ptr(), w._version)
        wt = self._transposed.get(key)
        if wt is None:
            wt = self._transposed[key] = w.detach().t().contiguous()
        return torch.mm(x.reshape(-1, x.size(-1)), wt).view(*x.shape[:-1], wt.size(1))

    # -- the search ------------------------------------------------------------------------------------------
    def _speculative_search(self, sample, bos_token: Optional[int] = None):
        verifier, drafter, K, eos = self.model.single_model, self.drafter, self.K, self.eos
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz, src_len = src_tokens.size()[:2]
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
        dev = src_tokens.device
        enc_v = self.model.forward_encoder(net_input)[0]
        enc_d = enc_v if self.shares_encoder else drafter.encoder.forward_torchscript(net_input)
        width = max_len + 2 * K + 2
        # z[:, p]: the drafter's input at position p; z[:, K - 1 + p]: the verifier's (y_p)
        z = src_tokens.new_full((bsz, K - 1 + width), self.pad)
        z[:, : K - 1] = drafter.decoder.start_symbol
        z[:, K - 1] = eos if bos_token is None else bos_token
        lp = torch.zeros(bsz, width, device=dev)  # the verifier's log-probability of each word
        attn: Optional[Tensor] = None
        n = [0] * bsz  # accepted words (the verifier's cached positions)
        c = [0] * bsz  # the drafter's cached positions
        alive = list(range(bsz))  # row -> sentence
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        redo: List[int] = []
        state_v: Dict[str, Dict[str, Optional[Tensor]]] = {}
        state_d: Dict[str, Dict[str, Optional[Tensor]]] = {}
        ids = sample.get("id")
        while alive:
            B = len(alive)
            # 1. draft y_{n+1}..y_{n+K}: positions n..n+K-1 (and n-1 when not cached) as one group
            T = max(n[r] + K - c[r] for r in range(B))
            first = [n[r] + K - T for r in range(B)]
            h, _ = rows_step(drafter.decoder, _window(z, first, T), first, enc_d, state_d, group=K)
            guess = self._constrain_rows(self._output(drafter.decoder, h[:, -K:]), n, max_len)
            drafts = guess.argmax(dim=-1)  # [B, K]
            # 2. verify: [y_n, d_1..d_K] at positions n..n+K
            v_in = torch.cat([_window(z, [m + K - 1 for m in n], 1), drafts], 1)
            h, extra = rows_step(verifier.decoder, v_in, n, enc_v, state_v)
            v, v_lp, unclear, lprobs = self._verifier_choices(self._output(verifier.decoder, h), extra, n, max_len)
            _put(z, [m + K for m in n], v)
            _put(lp, n, v_lp)
            a_attn = extra["attn"][0] if isinstance(extra, dict) and extra.get("attn") else None
            if a_attn is not None:
                if attn is None:
                    attn = torch.zeros(bsz, enc_v["encoder_out"][0].size(0), width, device=dev)
                _put(attn, n, a_attn.transpose(1, 2).float())
            # 3. accept the a drafts equal to the verifier's choices, then v_{a+1}; a sentence ends at a decided EOS
            drafts_h, v_h, unclear_h = drafts.tolist(), v.tolist(), unclear.tolist()
            self.stats["verifier_calls"] += 1
            self.stats["drafter_calls"] += 1
            self.stats["drafted"] += B * K
            keep = []
            for r in range(B):
                d_r, v_r = drafts_h[r], v_h[r]
                a = 0
                while a < K and d_r[a] == v_r[a] and v_r[a] != eos:
                    a += 1
                m = a + 1  # the decided words v_1..v_{a+1}
                if any(unclear_h[r][:m]):
                    redo.append(alive[r])  # a decision within eps of a tie: the verifier alone decides
                    continue
                self.stats["accepted"] += a + (v_r[a] == eos and a < K and d_r[a] == eos)
                if self.record is not None:
                    self.record.extend((_id(ids, alive[r]), n[r] + t, lprobs[r, t].clone()) for t in range(m))
                c[r] = min(n[r] + K, n[r] + m)  # 4. cut back: what the drafter computed from accepted words
                n[r] += m
                if v_r[a] == eos:
                    finalized[alive[r]].append(self._hypothesis(
                        z[r, K: K + n[r]].clone(), lp[r, : n[r]].cumsum(0),
                        attn[r, :, : n[r]].clone() if attn is not None else None))
                else:
                    keep.append(r)
            if not keep:
                break
            if len(keep) < B:  # finished rows leave
                rows = torch.tensor(keep, device=dev)
                z, lp = z.index_select(0, rows), lp.index_select(0, rows)
                attn = attn.index_select(0, rows) if attn is not None else None
                alive, n, c = [alive[r] for r in keep], [n[r] for r in keep], [c[r] for r in keep]
            cut_back(verifier.decoder, state_v, max(n))
            cut_back(drafter.decoder, state_d, max(c))
            if len(keep) < B:
                reorder_rows_state(verifier.decoder, state_v, rows)
                reorder_rows_state(drafter.decoder, state_d, rows)
        self.stats["sentences"] += bsz
        for i in redo:
            self.stats["fallbacks"] += 1
            row = {k: (t[i: i + 1] if isinstance(t, Tensor) and t.size(0) == bsz else t) for k, t in net_input.items()}
            logger.info(f"--sat-draft-path: sentence {_id(ids, i)} decoded by the verifier alone (a decision within "
                        f"{self.eps:g} of a tie)")
            finalized[i] = super()._greedy_search({"net_input": row}, bos_token)[0]
        return finalized


def _id(ids, row: int) -> int:
    return int(ids[row]) if ids is not None else row


def _window(z: Tensor, first: List[int], T: int) -> Tensor:
    """z[r, first[r]: first[r] + T] of every row r: a view when the rows share the offset."""
    if min(first) == max(first):
        return z[:, first[0]: first[0] + T]
    return z.gather(1, torch.tensor(first, device=z.device).view(-1, 1) + torch.arange(T, device=z.device))


def _put(buf: Tensor, first: List[int], values: Tensor) -> None:
    """buf[r, ..., first[r]: first[r] + W] = values[r] (W = values.size(-1)), a slice when the rows share it."""
    W = values.size(-1)
    if min(first) == max(first):
        buf[..., first[0]: first[0] + W] = values
        return
    index = torch.tensor(first, device=buf.device).view(-1, *([1] * (buf.dim() - 1))) + \
        torch.arange(W, device=buf.device)
    buf.scatter_(buf.dim() - 1, index.expand(*values.shape), values)


def build_speculative(task, models, draft_path: str, speedups: str = "", max_batch: int = MAX_BATCH,
                      **kwargs) -> SpeculativeSATGenerator:
    """The speculative generator of :func:`fairseq_ext.sat.task.build_sat_generator` (``--sat-draft-path``;
    ``--sat-draft-speedups``: the opt-in speed-ups of :mod:`fairseq_ext.inference.speedups` for the drafter alone)."""
    if kwargs.get("beam_size", 1) != 1:
        raise FairseqExtError("--sat-draft-path decodes greedily (its output is the verifier's greedy output): "
                              "use --beam 1")
    drafter = load_drafter(draft_path, task, models[0])
    if speedups:
        from fairseq_ext.inference.speedups import apply_speedups

        apply_speedups(drafter, speedups, flag="--sat-draft-speedups")
    return SpeculativeSATGenerator(models, drafter, task.target_dictionary, max_batch=max_batch, **kwargs)
