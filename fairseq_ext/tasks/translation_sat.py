"""``--task translation_sat``: fairseq's translation task whose generator decodes a Semi-Autoregressive
Transformer (:mod:`fairseq_ext.models.sat_transformer`) K words per decoder call.

Data, batching and training are those of ``--task translation`` (the SAT shift of the decoder input is done
inside the model). What changes:

* :meth:`build_generator` returns :class:`~fairseq_ext.generators.sat_generator.SATSequenceGenerator` for
  fairseq-generate, fairseq-interactive, ``--eval-bleu`` validation and the hub interface; options it cannot
  honour (sampling, diverse beam search, constraints, prefix tokens, language-model fusion, ensembles) fail
  with one clear line;
* rebuilding a trained model from its checkpoint does not re-run ``--sat-init-from``.
"""

from dataclasses import dataclass

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_ext.compat import FairseqExtError
from fairseq_ext.generators.sat_generator import SATSequenceGenerator


@dataclass
class TranslationSATConfig(TranslationConfig):
    pass


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
        from fairseq import search

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


@register_task("translation_sat", dataclass=TranslationSATConfig)
class TranslationSATTask(TranslationTask):
    """Translation with semi-autoregressive (group) decoding; see the module docstring."""

    def __init__(self, cfg, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        if getattr(cfg, "left_pad_target", False):
            raise FairseqExtError("--task translation_sat needs right-padded targets: remove --left-pad-target")
        self._sat_from_checkpoint = False

    def build_model(self, cfg, from_checkpoint=False):
        self._sat_from_checkpoint = from_checkpoint
        try:
            return super().build_model(cfg, from_checkpoint)
        finally:
            self._sat_from_checkpoint = False

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None, **kwargs):
        return build_sat_generator(self, models, args, seq_gen_cls=seq_gen_cls,
                                   extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                   prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
