"""``--task translation_sat``: fairseq's translation task whose generator decodes a Semi-Autoregressive
Transformer (:mod:`fairseq_ext.sat.model`) K words per decoder call.

Data, batching and training are those of ``--task translation`` (the SAT shift of the decoder input is done
inside the model). What changes:

* :meth:`build_generator` returns :class:`~fairseq_ext.sat.generator.SATSequenceGenerator` (built by
  :func:`~fairseq_ext.sat.generator.build_sat_generator`) for
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

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_ext.building import RecordsCheckpointBuild
from fairseq_ext.errors import FairseqExtError
from fairseq_ext.inference.speedups import apply_speedups
from fairseq_ext.sat.generator import build_sat_generator
from fairseq_ext.sat.speculative import MAX_BATCH

logger = logging.getLogger(__name__)


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
                          "arithmetic: python benchmarks/bench_speculative.py --sweep)"})
    sat_draft_speedups: str = field(
        default="",
        metadata={"help": "with --sat-draft-path: speed-ups of --inference-speedups for the drafter alone (int8 ones "
                          "too: the drafter's arithmetic does not change the output)"})


@register_task("translation_sat", dataclass=TranslationSATConfig)
class TranslationSATTask(RecordsCheckpointBuild, TranslationTask):
    """Translation with semi-autoregressive (group) decoding; see the module docstring."""

    builds_sat_generator = True  # read by SATModel.from_pretrained (models never import tasks)

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
