"""fairseq's ``--task translation`` decodes with the package's generator by default.

``import fairseq_ext`` (``--user-dir fairseq_ext``) replaces ``TranslationTask.build_generator`` (and so that of
every task that inherits it) by :func:`build_generator`: for a call the fast generator serves, it returns the
generator registered with :func:`register` (the group search of ``fairseq_ext/sat/generator.py`` at K = 1 on the
static decoder step of :mod:`fairseq_ext.inference.static_step`: fairseq's greedy and beam search, same options,
same hypotheses up to the order of float32 sums, and a sentence with a near-tie decoded by fairseq's generator:
``fairseq_ext.sat.step_rules.TIE_MARGIN``); for any other call, fairseq's own generator, with one log line
that says why. fairseq-generate, fairseq-interactive and the hub (``TransformerModel.from_pretrained(...)``) take
it alike.

Served: one float32 model on the CPU whose decoder the static step computes (fairseq's transformer decoder and the
SAT's), beam and greedy search with --nbest, --lenpen, --unkpen, --min-len, --max-len-a/b, --temperature,
--no-repeat-ngram-size, --unnormalized. Left to fairseq's generator: ensembles, sampling, diverse beam search,
constraints, --prefix-size, --print-alignment, --match-source-len, --retain-dropout, --score-reference, a language
model, CUDA or half precision, any other decoder; and a call of the generator with prefix tokens or constraints
(the hub's ``inference_step_args``), with one log line.

``FAIRSEQ_EXT_STOCK_GENERATOR=1`` in the environment turns it off (fairseq's generator for every call).
"""

import logging
import os
from typing import Callable, Optional

import torch

logger = logging.getLogger("fairseq_ext")

OFF = "FAIRSEQ_EXT_STOCK_GENERATOR"
_BUILDER: Optional[Callable] = None


def register(builder: Callable) -> None:
    """``builder(task, models, args)`` returns the fast generator (a paper folder registers it: this package
    imports none)."""
    global _BUILDER
    _BUILDER = builder


def unsupported_option(args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None
                       ) -> Optional[str]:
    """The first generation option of ``args`` that the package's generator does not decode, as its flag; None."""
    checks = [
        (getattr(args, "score_reference", False), "--score-reference"),
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
        (getattr(args, "match_source_len", False), "--match-source-len"),
    ]
    return next((flag for bad, flag in checks if bad), None)


def refusal(models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None
            ) -> Optional[str]:
    """Why this call keeps fairseq's generator (one phrase), or None."""
    from fairseq_ext.inference.static_step import static_refusal

    if os.environ.get(OFF, "") not in ("", "0"):
        return f"{OFF} is set"
    if _BUILDER is None:
        return "no fast generator registered"
    flag = unsupported_option(args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
    if flag is None and getattr(args, "print_alignment", None):
        flag = "--print-alignment"
    if flag is None and getattr(args, "nbest", 1) > getattr(args, "beam", 5):
        flag = "--nbest larger than --beam"
    if flag:
        return f"{flag} is decoded by fairseq's generator only"
    if len(models) != 1:
        return f"an ensemble of {len(models)} models"
    decoder = getattr(models[0], "decoder", None)
    weight = getattr(getattr(decoder, "embed_tokens", None), "weight", None)
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        where = "none" if weight is None else f"{weight.dtype} on {weight.device.type}"
        return f"the static step is float32 on the CPU (the model's weights: {where})"
    if getattr(decoder, "group_size", 1) != 1:
        return "a SAT decoder (K > 1) is decoded by --task translation_sat"
    return static_refusal(models[0])


def build_generator(task, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
    """The package's generator where :func:`refusal` finds nothing, else fairseq's (module docstring)."""
    why = refusal(models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
    if why is None:
        gen = _BUILDER(task, models, args)
        # built now, as fairseq-generate builds its generator: it keeps the dictionary's size of this moment, and
        # fairseq-generate's post-processing (--remove-bpe) adds the words it prints to the target dictionary
        stock = _STOCK(task, models, args, seq_gen_cls=seq_gen_cls, extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                       prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        gen.stock_fallback = lambda: stock  # a callable: as an attribute, nn.Module would register it as a submodule
        logger.info(f"fairseq_ext: decoding with the static decoder step (beam {gen.beam_size}; {OFF}=1 for "
                    f"fairseq's generator)")
        return gen
    if not getattr(args, "score_reference", False):
        logger.info(f"fairseq_ext: fairseq's SequenceGenerator: {why}")
    return _STOCK(task, models, args, seq_gen_cls=seq_gen_cls, extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                  prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)


_STOCK: Optional[Callable] = None


def install() -> None:
    """``TranslationTask.build_generator`` becomes :func:`build_generator` (once)."""
    global _STOCK
    from fairseq.tasks.translation import TranslationTask

    if getattr(TranslationTask.build_generator, "_fairseq_ext_default", False):
        return
    _STOCK = TranslationTask.build_generator

    def task_build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                             prefix_allowed_tokens_fn=None):
        return build_generator(self, models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)

    task_build_generator._fairseq_ext_default = True
    task_build_generator.__doc__ = build_generator.__doc__
    TranslationTask.build_generator = task_build_generator
