"""Semi-autoregressive sequence generation for :mod:`fairseq_ext.sat.model` (Wang et al. 2018).

One decoder call per group of K positions (Sec. 3; Table 1: the decoder cost per sentence drops from n to
ceil(n/K) calls):

* ``--beam 1`` (greedy, the paper's fastest setting): each call yields K distributions and the K argmax
  words are appended at once; a sentence stops at the first EOS inside a group and is cut there.
* ``--beam B > 1``: exact group beam search (as in the authors' sa-nmt ``beam_search``). The per-position
  distributions of a group depend only on earlier groups, so one decoder call gives the K distributions of
  every hypothesis and K ordinary token-level beam steps reuse them. fairseq's ``SequenceGenerator._generate``
  runs those token-level steps unchanged (2B candidates, EOS handling, --lenpen, --min-len, --max-len-a/b,
  --unkpen, --nbest, attention); :class:`SATEnsembleModel` serves it the cached distribution of each step,
  composes the beam origins it is told (``reorder_incremental_state``) and reorders the decoder state by the
  composed order once, before the next call. With K = 1 this is exactly fairseq's beam search.

A plain fairseq ``transformer`` is decoded as K = 1.
"""

import math
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq import search, utils
from fairseq.tasks.translation import TranslationTask
from fairseq.sequence_generator import (
    EnsembleModelWithAlignment,
    SequenceGenerator,
    SequenceGeneratorWithAlignment,
)

from fairseq_ext.errors import FairseqExtError
from fairseq_ext.sat.model import group_size


class SATEnsembleModel(EnsembleModelWithAlignment):
    """fairseq's model wrapper for one SAT model: :meth:`decode_group` runs the decoder on the K new
    positions; :meth:`forward_decoder` (the token-level interface of ``SequenceGenerator``) calls it only
    at the first step of each group and serves the cached distributions for the other K-1 steps."""

    def __init__(self, models):
        if len(models) != 1:
            raise FairseqExtError(
                f"translation_sat decodes a single model; got an ensemble of {len(models)} (--path a.pt:b.pt). "
                f"Average the checkpoints instead (python -m fairseq_ext.average_checkpoints)")
        super().__init__(models)
        self.group_size = group_size(models[0])
        self.decoder_calls = 0
        self._group_lprobs: Optional[Tensor] = None  # [N at the last call, K, V]
        self._group_attn: Optional[Tensor] = None  # [N at the last call, K, src_len]
        self._order: Optional[Tensor] = None  # current row -> row at the last decoder call (composed)

    def decode_group(self, tokens, encoder_out, incremental_state, temperature: float = 1.0):
        """tokens: [N, n] = BOS and the n-1 words generated so far, n-1 a multiple of K. Returns the
        log-probabilities [N, K, V] of the next K words and the attention [N, K, src_len] (or None)."""
        model = self.single_model
        K = self.group_size
        if K > 1:  # K start symbols (Sec. 3.2): the decoder input is [<s>]*K + y
            start = getattr(model.decoder, "start_symbol", None)
            start = int(tokens[0, 0]) if start is None else start
            tokens = torch.cat([tokens.new_full((tokens.size(0), K - 1), start), tokens], dim=1)
        self.decoder_calls += 1
        x, extra = model.decoder.forward(tokens, encoder_out=encoder_out, incremental_state=incremental_state)
        x = x[:, -K:, :]
        if temperature != 1.0:
            x = x.div_(temperature)
        lprobs = model.get_normalized_probs((x, extra), log_probs=True, sample=None)
        attn = extra["attn"][0] if isinstance(extra, dict) and extra.get("attn") else None
        if attn is not None:
            attn = attn[:, -K:, :]
        return lprobs, attn

    def forward_decoder(self, tokens, encoder_outs, incremental_states, temperature: float = 1.0):
        step = tokens.size(1) - 1
        k = step % self.group_size
        if k == 0:
            if self._order is not None:
                self.single_model.decoder.reorder_incremental_state_scripting(incremental_states[0], self._order)
            self._order = None
            self._group_lprobs, self._group_attn = self.decode_group(
                tokens, encoder_outs[0], incremental_states[0], temperature)
        assert self._group_lprobs is not None
        lprobs = self._group_lprobs[:, k]
        attn = self._group_attn[:, k] if self._group_attn is not None else None
        if self._order is not None:
            lprobs = lprobs.index_select(0, self._order)
            attn = attn.index_select(0, self._order) if attn is not None else None
        return lprobs.contiguous(), attn

    def reorder_incremental_state(self, incremental_states, new_order):
        # compose the beam origins of the token-level steps; the decoder state is reordered once per group
        self._order = new_order if self._order is None else self._order.index_select(0, new_order)


class SATSequenceGenerator(SequenceGeneratorWithAlignment):
    """Generator returned by ``--task translation_sat``: same constructor arguments and hypothesis
    dictionaries (tokens, score, positional_scores, attention, alignment) as fairseq's SequenceGenerator.

    ``decoder_calls`` counts the decoder calls of the last :meth:`generate` (for tests and benchmarks)."""

    def __init__(self, models, tgt_dict, print_alignment=None, greedy_fast_path=True, **kwargs):
        SequenceGenerator.__init__(self, SATEnsembleModel(models), tgt_dict, **kwargs)
        self.group_size = self.model.group_size
        self.left_pad_target = False
        self.print_alignment = print_alignment
        if print_alignment == "soft":
            self.extract_alignment = utils.extract_soft_alignment
        else:
            self.extract_alignment = utils.extract_hard_alignment
        # the dedicated greedy loop serves --beam 1 unless a feature only the token-level loop has is on
        self.greedy_fast_path = bool(
            greedy_fast_path and self.beam_size == 1 and self.repeat_ngram_blocker is None
            and self.lm_model is None and not self.match_source_len
            and type(self.search) is search.BeamSearch
        )
        self.decoder_calls = 0

    @torch.no_grad()
    def generate(self, models, sample: Dict[str, Dict[str, Tensor]], **kwargs) -> List[List[Dict[str, Tensor]]]:
        if kwargs.get("prefix_tokens") is not None:
            raise FairseqExtError("translation_sat does not support --prefix-size (prefix tokens)")
        if kwargs.get("constraints") is not None:
            raise FairseqExtError("translation_sat does not support --constraints")
        self.model.decoder_calls = 0
        self.model._order = None
        # the encoder-attention caches hold one row per sentence when beam > 1; set it for every call, as
        # the same model may have been used by a generator with another beam size
        if hasattr(self.model.single_model, "set_beam_size"):
            self.model.single_model.set_beam_size(self.beam_size)
        if self.print_alignment:
            out = SequenceGeneratorWithAlignment.generate(self, models, sample, **kwargs)
        else:
            out = self._generate(sample, **kwargs)
        self.decoder_calls = self.model.decoder_calls
        return out

    def _generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None):
        if self.greedy_fast_path and prefix_tokens is None and constraints is None:
            return self._generate_greedy(sample, bos_token)
        return super()._generate(sample, prefix_tokens=prefix_tokens, constraints=constraints, bos_token=bos_token)

    def _generate_greedy(self, sample, bos_token: Optional[int] = None):
        """Greedy search, K argmax words per decoder call. Same scores and hypothesis layout as
        fairseq's beam search with --beam 1 (cumulative scores, normalised by length ** lenpen)."""
        K = self.group_size
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        if "src_lengths" in net_input:
            src_lengths = net_input["src_lengths"]
        else:
            src_lengths = (src_tokens.ne(self.eos) & src_tokens.ne(self.pad)).long().sum(dim=1)
        bsz, src_len = src_tokens.size()[:2]
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"

        encoder_outs = self.model.forward_encoder(net_input)
        incremental_states = [{}]
        n_steps = (max_len + 1 + K - 1) // K * K  # positions 0..max_len, rounded up to whole groups
        tokens = src_tokens.new_full((bsz, n_steps + 1), self.pad)
        tokens[:, 0] = self.eos if bos_token is None else bos_token
        pos_scores = torch.zeros(bsz, n_steps, dtype=torch.float, device=src_tokens.device)
        attn: Optional[Tensor] = None
        alive = torch.arange(bsz, device=src_tokens.device)  # row -> sentence
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        step = 0
        while alive.numel() > 0:
            lprobs, group_attn = self.model.decode_group(
                tokens[:, : step + 1], encoder_outs[0], incremental_states[0], self.temperature)
            lprobs = lprobs.float()
            lprobs[lprobs != lprobs] = -math.inf
            lprobs[:, :, self.pad] = -math.inf
            lprobs[:, :, self.unk] -= self.unk_penalty
            for k in range(K):  # length constraints on target positions step..step+K-1
                t = step + k
                if t >= max_len:
                    lprobs[:, k, : self.eos] = -math.inf
                    lprobs[:, k, self.eos + 1:] = -math.inf
                elif t < self.min_len:
                    lprobs[:, k, self.eos] = -math.inf
                if t < max_len and self.token_indices_to_suppress is not None:
                    lprobs[:, k, self.token_indices_to_suppress] = -math.inf
            best_lp, best = lprobs.max(dim=-1)  # [n, K]
            tokens[:, step + 1: step + 1 + K] = best
            pos_scores[:, step: step + K] = best_lp
            if group_attn is not None:
                if attn is None:
                    attn = torch.zeros(bsz, src_len, n_steps, dtype=torch.float, device=src_tokens.device)
                attn[:, :, step: step + K] = group_attn.transpose(1, 2).float()

            is_eos = best.eq(self.eos)
            done = is_eos.any(dim=1)
            if bool(done.any()):
                first_eos = torch.where(is_eos, torch.arange(K, device=best.device), K).min(dim=1).values
                for row in done.nonzero().view(-1).tolist():
                    length = step + int(first_eos[row]) + 1
                    cum = pos_scores[row, :length].cumsum(0)
                    pos = cum.clone()
                    pos[1:] = cum[1:] - cum[:-1]
                    score = cum[-1]
                    if self.normalize_scores:
                        score = score / length ** self.len_penalty
                    finalized[int(alive[row])].append({
                        "tokens": tokens[row, 1: length + 1].clone(),
                        "score": score,
                        "attention": attn[row, :, :length].clone() if attn is not None else torch.empty(0),
                        "alignment": torch.empty(0),
                        "positional_scores": pos,
                    })
                keep = (~done).nonzero().view(-1)
                if keep.numel() == 0:
                    break
                alive = alive.index_select(0, keep)
                tokens = tokens.index_select(0, keep)
                pos_scores = pos_scores.index_select(0, keep)
                if attn is not None:
                    attn = attn.index_select(0, keep)
                self.model.single_model.decoder.reorder_incremental_state_scripting(incremental_states[0], keep)
                encoder_outs = self.model.reorder_encoder_out(encoder_outs, keep)
            step += K
            assert step <= max_len + K, "greedy SAT search ran past --max-len (no EOS forced?)"
        return finalized


def build_sat_generator(task, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None, **unused):
    """The semi-autoregressive generator for ``models`` (one SAT or transformer model) and generation
    options ``args`` (fairseq's GenerationConfig or a Namespace)."""
    if getattr(args, "score_reference", False):
        return TranslationTask.build_generator(task, models, args)
    unsupported = [
        (getattr(args, "sampling", False), "--sampling"),
        (getattr(args, "diverse_beam_groups", -1) > 0, "--diverse-beam-groups"),
        (getattr(args, "diversity_rate", -1) > -1, "--diversity-rate"),
        (bool(getattr(args, "constraints", False)), "--constraints"),
        (getattr(args, "prefix_size", 0) > 0, "--prefix-size"),
        (prefix_allowed_tokens_fn is not None or getattr(args, "prefix_allowed_tokens_fn", None) is not None,
         "prefix_allowed_tokens_fn"),
        (bool(extra_gen_cls_kwargs and extra_gen_cls_kwargs.get("lm_model") is not None), "--lm-path"),
        (seq_gen_cls is not None, "a custom seq_gen_cls"),
        (getattr(args, "retain_dropout", False), "--retain-dropout"),
    ]
    for bad, flag in unsupported:
        if bad:
            raise FairseqExtError(
                f"{flag} is not supported by --task translation_sat (semi-autoregressive group decoding "
                f"supports beam search and greedy search); remove it")
    if len(models) != 1:
        raise FairseqExtError(
            f"--task translation_sat decodes one model, got {len(models)} (--path a.pt:b.pt); average "
            f"checkpoints with python -m fairseq_ext.average_checkpoints instead")
    beam = getattr(args, "beam", 5)
    nbest = getattr(args, "nbest", 1)
    if nbest > beam:
        raise FairseqExtError(f"--nbest ({nbest}) cannot exceed --beam ({beam})")
    match_source_len = getattr(args, "match_source_len", False)
    search_strategy = None
    if match_source_len:
        search_strategy = search.LengthConstrainedBeamSearch(
            task.target_dictionary, min_len_a=1, min_len_b=0, max_len_a=1, max_len_b=0)
    return SATSequenceGenerator(
        models,
        task.target_dictionary,
        print_alignment=getattr(args, "print_alignment", None) or None,
        beam_size=beam,
        max_len_a=getattr(args, "max_len_a", 0),
        max_len_b=getattr(args, "max_len_b", 200),
        min_len=getattr(args, "min_len", 1),
        normalize_scores=(not getattr(args, "unnormalized", False)),
        len_penalty=getattr(args, "lenpen", 1),
        unk_penalty=getattr(args, "unkpen", 0),
        temperature=getattr(args, "temperature", 1.0),
        match_source_len=match_source_len,
        no_repeat_ngram_size=getattr(args, "no_repeat_ngram_size", 0),
        search_strategy=search_strategy,
    )
