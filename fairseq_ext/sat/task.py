"""``--task translation_sat``: fairseq's translation task whose generator decodes a Semi-Autoregressive
Transformer (:mod:`fairseq_ext.sat.model`) K words per decoder call.

Data, batching and training are those of ``--task translation`` (the SAT shift of the decoder input is done
inside the model). What changes:

* :meth:`build_generator` returns :class:`~fairseq_ext.sat.generator.SATSequenceGenerator` (built by
  :func:`build_sat_generator`, which the SAT hub also calls for checkpoints of other tasks) for
  fairseq-generate, fairseq-interactive, ``--eval-bleu`` validation and the hub interface; options it cannot
  honour (sampling, diverse beam search, constraints, prefix tokens, language-model fusion, ensembles) fail
  with one clear line;
* rebuilding a trained model from its checkpoint does not re-run ``--sat-init-from``;
* ``--sat-draft-path SAT.pt``: lossless speculative greedy decoding of the ``--path`` model with that SAT drafter
  (:mod:`fairseq_ext.sat.speculative`); ``--sat-draft-speedups LIST`` speeds up the drafter alone;
* ``--inference-speedups LIST`` applies :mod:`fairseq_ext.inference.speedups`' opt-in CPU decoding speed-ups to
  the loaded models before decoding (fairseq-generate, fairseq-interactive);
* the generator runs the decoder's incremental steps through the lean step of
  :mod:`fairseq_ext.inference.lean_decoder` where it computes the decoder exactly (float32 on the CPU; the model is
  not changed); ``--no-lean-step`` runs the decoder's own step.
"""

import logging
from dataclasses import dataclass, field
from typing import Optional

from fairseq.models.transformer import TransformerDecoderBase
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_ext.common.building import RecordsCheckpointBuild
from fairseq_ext.common.building import checkpoint_of
from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.inference import default_generator
from fairseq_ext.inference.default_generator import unsupported_option
from fairseq_ext.inference.speedups import apply_speedups
from fairseq_ext.sat.generator import SATSequenceGenerator
from fairseq_ext.sat.speculative import MAX_BATCH, build_speculative

logger = logging.getLogger(__name__)


def build_sat_generator(task, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None, draft_path: Optional[str] = None,
                        draft_speedups: Optional[str] = None, **unused):
    """The semi-autoregressive generator for ``models`` (one SAT or transformer model) and generation
    options ``args`` (fairseq's GenerationConfig or a Namespace); with a drafter (``draft_path``, else the task's
    ``--sat-draft-path``) the speculative greedy search of :mod:`fairseq_ext.sat.speculative`."""
    if getattr(args, "score_reference", False):
        return TranslationTask.build_generator(task, models, args)
    flag = unsupported_option(args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
    if flag:
        raise FairseqExtError(
            f"{flag} is not supported by --task translation_sat (semi-autoregressive group decoding "
            f"supports beam search and greedy search); remove it")
    if len(models) != 1:
        raise FairseqExtError(
            f"--task translation_sat decodes one model, got {len(models)} (--path a.pt:b.pt); average "
            f"checkpoints with python -m fairseq_ext.average_checkpoints instead")
    _check_decodable(models[0])
    beam = getattr(args, "beam", 5)
    nbest = getattr(args, "nbest", 1)
    if nbest > beam:
        raise FairseqExtError(f"--nbest ({nbest}) cannot exceed --beam ({beam})")
    opts = generator_options(task, args)
    cfg = getattr(task, "cfg", None)
    draft_path = draft_path or getattr(cfg, "sat_draft_path", None) or getattr(args, "sat_draft_path", None)
    if draft_path:
        speedups = draft_speedups or getattr(cfg, "sat_draft_speedups", "") or ""
        max_batch = getattr(cfg, "sat_draft_max_batch", None)
        gen = build_speculative(task, models, draft_path, speedups, **opts,
                                **({} if max_batch is None else {"max_batch": max_batch}))
        logger.info(f"SAT generator: speculative greedy search, verifier {type(models[0]).__name__} (K=1), drafter "
                    f"K={gen.K} ({draft_path}; encoder {'shared' if gen.shares_encoder else 'its own'}); "
                    + (f"no drafts: {gen.refusal()}" if gen.refusal() else
                       f"decoder steps: lean, cached length per row; batches over {gen.max_batch} decoded alone"))
        return gen
    gen = SATSequenceGenerator(models, task.target_dictionary, **opts)
    logger.info(f"SAT generator: K={gen.group_size}, beam {beam}; decoder step: {gen.model.step_name}")
    return gen


def generator_options(task, args) -> dict:
    """The keyword arguments of :class:`SATSequenceGenerator` from fairseq's generation options ``args`` and the
    task's step flags (``--no-lean-step``, ``--no-static-step``; absent from other tasks' configurations)."""
    cfg = getattr(task, "cfg", None)
    return dict(
        print_alignment=getattr(args, "print_alignment", None) or None,
        lean_step=not getattr(cfg, "no_lean_step", False),
        static_step=not getattr(cfg, "no_static_step", False),
        beam_size=getattr(args, "beam", 5),
        max_len_a=getattr(args, "max_len_a", 0),
        max_len_b=getattr(args, "max_len_b", 200),
        min_len=getattr(args, "min_len", 1),
        normalize_scores=(not getattr(args, "unnormalized", False)),
        len_penalty=getattr(args, "lenpen", 1),
        unk_penalty=getattr(args, "unkpen", 0),
        temperature=getattr(args, "temperature", 1.0),
        no_repeat_ngram_size=getattr(args, "no_repeat_ngram_size", 0),
    )


def build_translation_generator(task, models, args):
    """``--task translation``'s generator where :mod:`fairseq_ext.inference.default_generator` serves the call:
    the group search at K = 1 (fairseq's greedy and beam search) on the static decoder step."""
    return SATSequenceGenerator(models, task.target_dictionary, **generator_options(task, args))


default_generator.register(build_translation_generator)


def _check_decodable(model):
    """The group search reads a transformer-shaped decoder (a SAT's, or fairseq's transformer as K = 1); any other
    (fconv's beamable attention, an LSTM) is refused with one line naming the checkpoint and the task that decodes
    it."""
    decoder = getattr(model, "decoder", None)
    if isinstance(decoder, TransformerDecoderBase):
        return
    where = checkpoint_of(model) or f"the {type(model).__name__} model"
    raise FairseqExtError(
        f"{where}: --task translation_sat decodes a sat_transformer or a fairseq transformer, not a "
        f"{type(model).__name__} ({type(decoder).__name__}); decode it with --task translation")


@dataclass
class TranslationSATConfig(TranslationConfig):
    inference_speedups: str = field(
        default="",
        metadata={"help": "comma-separated CPU decoding speed-ups applied to the loaded models (fairseq_ext."
                          "inference.speedups): prepack, lean-decoder and lean-encoder keep float32 "
                          "(sums reordered, ~1e-6); int8-output, int8-decoder, int8-encoder quantise the softmax "
                          "projection / every decoder / every encoder nn.Linear (outputs change a little). Inference "
                          "only."})
    no_lean_step: bool = field(
        default=False,
        metadata={"help": "decode with the decoder's own incremental step (fairseq's layers) instead of the lean "
                          "step (fairseq_ext/inference/lean_decoder.py: the same float32 products, summed in "
                          "another order, ~1e-6) that the generator uses by default for fairseq's and the SAT's "
                          "transformer decoders in float32 on the CPU (after --inference-speedups lean-decoder the "
                          "decoder's own step is the lean one)"})
    no_static_step: bool = field(
        default=False,
        metadata={"help": "decode with the lean step instead of the static decoder step (fairseq_ext/inference/"
                          "static_step.py: one captured graph per decoder call, caches preallocated; the same "
                          "float32 products, summed in another order, ~1e-6) that the generator uses by default "
                          "where it computes the decoder exactly (float32 on the CPU, no --inference-speedups)"})
    sat_draft_path: Optional[str] = field(
        default=None,
        metadata={"help": "lossless speculative greedy decoding: this sat_transformer checkpoint drafts K words (its "
                          "own K) and --path, the autoregressive verifier (transformer, or sat_transformer with K=1), "
                          "checks them in one call; the output is the verifier's greedy output "
                          "(fairseq_ext/sat/speculative.py). --beam 1 only"})
    sat_draft_max_batch: int = field(
        default=MAX_BATCH,
        metadata={"help": "with --sat-draft-path: batches of more sentences are decoded by the verifier alone "
                          "(the same output; speculation pays while a call costs its fixed overhead rather than its "
                          "arithmetic: python -m benchmarks.speed.speculative --sweep)"})
    sat_draft_speedups: str = field(
        default="",
        metadata={"help": "with --sat-draft-path: speed-ups of --inference-speedups for the drafter alone (int8 ones "
                          "too: the drafter's arithmetic does not change the output)"})


@register_task("translation_sat", dataclass=TranslationSATConfig)
class TranslationSATTask(RecordsCheckpointBuild, TranslationTask):
    """Translation with semi-autoregressive (group) decoding; see the module docstring."""

    builds_sat_generator = True  # read by SATModel.from_pretrained (models never import tasks)
    sat_generator = staticmethod(build_sat_generator)  # the hub's, for a checkpoint of any task

    def __init__(self, cfg, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        if getattr(cfg, "left_pad_target", False):
            raise FairseqExtError("--task translation_sat needs right-padded targets: remove --left-pad-target")

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None, **kwargs):
        if self.cfg.inference_speedups:
            if self.cfg.sat_draft_path:
                quantised = [n for n in self.cfg.inference_speedups.split(",") if "int8" in n]
                if quantised:
                    raise FairseqExtError(
                        f"--inference-speedups {quantised[0]} quantises the verifier, whose float32 numbers "
                        f"--sat-draft-path keeps; give it to the drafter with --sat-draft-speedups {quantised[0]}")
            for model in models:
                if model.training:  # fairseq-train's --eval-bleu generator: the model in training stays as it is
                    logger.warning("--inference-speedups is for decoding; not applied to a model in training")
                    continue
                apply_speedups(model, self.cfg.inference_speedups, flag="--inference-speedups")
        return build_sat_generator(self, models, args, seq_gen_cls=seq_gen_cls,
                                   extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                   prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                                   draft_path=kwargs.get("draft_path"), draft_speedups=kwargs.get("draft_speedups"))
