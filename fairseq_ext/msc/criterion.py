"""``label_smoothed_cross_entropy_l2``: label-smoothed cross-entropy plus L2 regularisation of the encoder
weight matrices, as used for the 72-layer MSC nets on IWSLT (Wei et al., 2020, Table 2 row 6, lambda = 1e-5).

What lambda means. fairseq's criteria return the loss *summed* over the target tokens and the trainer divides
the gradient by the sample size (the number of target tokens of the update, over all workers and
``--update-freq`` steps). This criterion adds ``lambda * sample_size * ||W_enc||^2`` to that sum, so the
objective per target token, the one the optimiser sees, is::

    mean label-smoothed CE  +  lambda * ||W_enc||^2,     ||W_enc||^2 = sum of squares of every encoder
                                                          parameter with >= 2 dims, except the embeddings

whatever the batch size, ``--update-freq`` or the number of workers. The paper does not say which of two
readings its lambda = 1e-5 has; this is the first. The other one, adding ``lambda * ||W_enc||^2`` once to
the summed loss (as a term in a fairseq criterion written without the ``sample_size`` factor would do), is a
per-token penalty ``lambda / sample_size * ||W||^2``: about 16,000 times weaker with the recipes' 16k-token
IWSLT updates, and varying with the batch. To train under that reading, divide lambda by the tokens per
update (``--l2-lambda 6e-10`` for 1e-5 at 16k tokens). Two consequences of the chosen reading:

* it is coupled L2, not weight decay: under Adam the penalty's gradient ``2 lambda W`` is normalised with the
  cross-entropy gradient, so matrices with small CE gradients get decay steps of about the learning rate;
  ``--weight-decay`` of fairseq's AdamW (decoupled, on every parameter) is a different regulariser;
* at initialisation the 72-layer net has ``lambda ||W_enc||^2`` = 1.78 bits per token (logged as ``l2``), a
  large share of the label-smoothed loss at the start of training.

Only weight *matrices* are penalised (no biases, no LayerNorm gains); the token embeddings are excluded
because with ``--share-all-embeddings`` they are also the decoder's input and output matrix. The term is
computed in training only: validation and inference neither add nor compute it (validation loss stays
comparable with the plain criterion).

``--ddp-backend fully_sharded`` is refused: FSDP flattens each wrapped layer's parameters into 1-D shards, so
"the encoder's weight matrices" are no longer parameters of the model (the penalty would silently be 0, or
fall on biases and LayerNorms through the flat shards).

Logged separately (training only): ``loss`` and ``nll_loss`` exactly as ``label_smoothed_cross_entropy``
(without the penalty), ``l2`` = lambda * ||W_enc||^2 in the same units as ``loss`` (bits per token), so
loss + l2 is the training objective, and ``enc_wnorm`` = ||W_enc||.
"""

import math
import weakref
from dataclasses import dataclass, field

import torch
from omegaconf import II
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics

from fairseq_ext.common.errors import FairseqExtError


@dataclass
class LabelSmoothedCrossEntropyL2Config(LabelSmoothedCrossEntropyCriterionConfig):
    l2_lambda: float = field(
        default=1e-5,
        metadata={"help": "weight lambda of the L2 penalty lambda * ||W_enc||^2 on the encoder weight matrices "
                          "(MSC paper: 1e-5 for the 72-layer IWSLT nets); per target token, see the docs"},
    )
    ddp_backend: str = II("distributed_training.ddp_backend")


def _unwrap(model):
    while not hasattr(model, "encoder") and hasattr(model, "module"):
        model = model.module
    return model


FSDP_REFUSED = ("--criterion label_smoothed_cross_entropy_l2 does not support --ddp-backend fully_sharded "
                "(FSDP flattens the encoder's weight matrices into 1-D shards, so the L2 term cannot find them); "
                "use --ddp-backend legacy_ddp or c10d, or --l2-lambda 0")


def _is_sharded(model):
    """FSDP (fairscale's, as fairseq uses, or torch's) anywhere in the model, or its flattened parameters."""
    return (any("FullyShardedDataParallel" in type(m).__name__ for m in model.modules())
            or any("flat_param" in name for name, _ in model.named_parameters()))


def encoder_weight_matrices(model):
    """The penalised parameters: encoder parameters with >= 2 dims, excluding embeddings."""
    if _is_sharded(model):
        raise FairseqExtError(FSDP_REFUSED)
    model = _unwrap(model)
    if not hasattr(model, "encoder"):
        raise FairseqExtError("--criterion label_smoothed_cross_entropy_l2 needs an encoder-decoder model "
                              "(one with .encoder); use label_smoothed_cross_entropy for this --arch")
    out = []
    for name, p in model.encoder.named_parameters():
        if p.dim() >= 2 and p.requires_grad and not name.startswith(("embed_tokens", "embed_positions")):
            out.append(p)
    return out


def encoder_l2(model, ws=None):
    """||W_enc||^2 (a scalar tensor that carries gradients); ``ws``: the matrices, if already listed."""
    ws = encoder_weight_matrices(model) if ws is None else ws
    if not ws:
        return torch.zeros(())
    return torch.stack([w.float().pow(2).sum() for w in ws]).sum()


@register_criterion("label_smoothed_cross_entropy_l2", dataclass=LabelSmoothedCrossEntropyL2Config)
class LabelSmoothedCrossEntropyL2Criterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 l2_lambda=1e-5, ddp_backend=None):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if l2_lambda < 0:
            raise FairseqExtError(f"--l2-lambda {l2_lambda}: must be >= 0")
        self.l2_lambda = float(l2_lambda)
        if self.l2_lambda > 0 and str(ddp_backend) == "fully_sharded":
            raise FairseqExtError(FSDP_REFUSED)
        self._weights = None  # (weakref to the model, its encoder weight matrices)

    def _encoder_matrices(self, model):
        if self._weights is None or self._weights[0]() is not model:
            self._weights = (weakref.ref(model), encoder_weight_matrices(model))
        return self._weights[1]

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        if self.l2_lambda > 0 and model.training:  # training only: never computed in validation or inference
            sq = encoder_l2(model, self._encoder_matrices(model)).to(loss.device)
            penalty = self.l2_lambda * sample_size * sq  # summed-loss units: / sample_size -> lambda ||W||^2
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
