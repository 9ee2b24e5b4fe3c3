"""``label_smoothed_cross_entropy_l2``: label-smoothed cross-entropy plus L2 regularisation of the encoder
weight matrices, as used for the 72-layer MSC nets on IWSLT (Wei et al., 2020, Table 2 row 6, lambda = 1e-5).

The optimised objective per target token (what the gradient step sees, fairseq dividing the summed loss by
the sample size) is::

    mean label-smoothed CE  +  lambda * ||W_enc||^2,     ||W_enc||^2 = sum of squares of every encoder
                                                          parameter with >= 2 dims, except the embeddings

i.e. ``lambda * sample_size * ||W_enc||^2`` is added to the summed loss, which keeps the strength of the
penalty independent of the batch size, ``--update-freq`` and the number of workers. Only weight *matrices*
are penalised (no biases, no LayerNorm gains); the token embeddings are excluded because with
``--share-all-embeddings`` they are also the decoder's input and output matrix. The term is added in training
only (validation loss stays comparable with the plain criterion).

Logged separately: ``loss`` and ``nll_loss`` exactly as ``label_smoothed_cross_entropy`` (without the
penalty), ``l2`` = lambda * ||W_enc||^2 in the same units as ``loss`` (bits per token), so loss + l2 is the
training objective, and ``enc_wnorm`` = ||W_enc||.
"""

import math
from dataclasses import dataclass, field

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics

from fairseq_ext.errors import FairseqExtError


@dataclass
class LabelSmoothedCrossEntropyL2Config(LabelSmoothedCrossEntropyCriterionConfig):
    l2_lambda: float = field(
        default=1e-5,
        metadata={"help": "weight lambda of the L2 penalty lambda * ||W_enc||^2 on the encoder weight matrices "
                          "(MSC paper: 1e-5 for the 72-layer IWSLT nets)"},
    )


def _unwrap(model):
    while not hasattr(model, "encoder") and hasattr(model, "module"):
        model = model.module
    return model


def encoder_weight_matrices(model):
    """The penalised parameters: encoder parameters with >= 2 dims, excluding embeddings."""
    model = _unwrap(model)
    if not hasattr(model, "encoder"):
        raise FairseqExtError("--criterion label_smoothed_cross_entropy_l2 needs an encoder-decoder model "
                              "(one with .encoder); use label_smoothed_cross_entropy for this --arch")
    out = []
    for name, p in model.encoder.named_parameters():
        if p.dim() >= 2 and p.requires_grad and not name.startswith(("embed_tokens", "embed_positions")):
            out.append(p)
    return out


def encoder_l2(model):
    """||W_enc||^2 (a scalar tensor that carries gradients)."""
    ws = encoder_weight_matrices(model)
    if not ws:
        return torch.zeros(())
    return torch.stack([w.float().pow(2).sum() for w in ws]).sum()


@register_criterion("label_smoothed_cross_entropy_l2", dataclass=LabelSmoothedCrossEntropyL2Config)
class LabelSmoothedCrossEntropyL2Criterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 l2_lambda=1e-5):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if l2_lambda < 0:
            raise FairseqExtError(f"--l2-lambda {l2_lambda}: must be >= 0")
        self.l2_lambda = float(l2_lambda)

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        if self.l2_lambda > 0:
            sq = encoder_l2(model).to(loss.device)
            penalty = self.l2_lambda * sample_size * sq  # summed-loss units: / sample_size -> lambda ||W||^2
            if model.training:
                loss = loss + penalty.to(loss.dtype)
            logging_output["l2"] = penalty.data
            logging_output["enc_wsq"] = (sq * sample_size).data
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        if sample_size > 0 and any("l2" in log for log in logging_outputs):
            l2_sum = sum(log.get("l2", 0) for log in logging_outputs)
            wsq_sum = sum(log.get("enc_wsq", 0) for log in logging_outputs)
            metrics.log_scalar("l2", l2_sum / sample_size / math.log(2), sample_size, round=5)
            metrics.log_scalar("enc_wnorm", float(wsq_sum / sample_size) ** 0.5, sample_size, round=3)
