"""Eq. 8 and Eq. 11 of BERT-JAM (Zhang et al. 2020): how each encoder and decoder layer composes BERT's L hidden
layers B_1..B_L, the GLU of the paper and its ablations M1 (linear) and M2 (last layer)."""

import torch
import torch.nn as nn
from torch import Tensor

from fairseq_ext.common.errors import FairseqExtError

COMPOSITIONS = ("glu", "linear", "last")


class BertLayerComposition(nn.Module):
    """B = g * sum_i alpha_i B_i with g = sigmoid(sum_i beta_i B_i)  (Eq. 8), one per encoder/decoder layer.

    Initialised as Eq. 11 (alpha_L = 1, other alpha = 0, beta = 0), which gives g = 1/2 and B = B_L / 2; the
    output is multiplied by ``scale`` = 2 in phase 1 only (the paper's compensation), so phase 1 sees exactly
    B_L. ``mode='linear'`` (ablation M1) drops the gate: B = sum_i alpha_i B_i; ``mode='last'`` (M2) is B_L
    with no parameter. :meth:`start_at` moves Eq. 11 to another layer (``--bert-jam-init-layer``, not in the
    paper: which of BERT's layers phase 1 reads)."""

    def __init__(self, num_bert_layers, mode="glu"):
        super().__init__()
        if mode not in COMPOSITIONS:
            raise FairseqExtError(f"--bert-composition {mode}: choose one of {', '.join(COMPOSITIONS)}")
        self.mode = mode
        self.num_bert_layers = num_bert_layers
        self.scale = 1.0
        if mode in ("glu", "linear"):
            alpha = torch.zeros(num_bert_layers)
            alpha[-1] = 1.0  # Eq. 11
            self.alpha = nn.Parameter(alpha)
        if mode == "glu":
            self.beta = nn.Parameter(torch.zeros(num_bert_layers))  # Eq. 11

    def start_at(self, layer: int):
        """Eq. 11 at B_layer (1..L) instead of B_L: alpha_layer = 1, every other alpha and beta 0, so phase 1
        reads exactly B_layer."""
        if self.mode == "last":
            raise FairseqExtError("--bert-jam-init-layer needs --bert-composition glu or linear: last (ablation "
                                  "M2) has no weights to start at another layer")
        if not 1 <= layer <= self.num_bert_layers:
            raise FairseqExtError(f"--bert-jam-init-layer {layer}: BERT has layers 1..{self.num_bert_layers}")
        with torch.no_grad():
            self.alpha.zero_()[layer - 1] = 1.0
            if self.mode == "glu":
                self.beta.zero_()

    def selects_last_layer(self) -> bool:
        """True when the output is exactly B_L and cannot change while training: M2, or the composition frozen
        at its Eq. 11 initialisation (phase 1: g = 1/2 and the x2 cancel exactly)."""
        if self.mode == "last":
            return True
        if any(p.requires_grad for p in self.parameters()):
            return False
        at_init = torch.zeros(self.num_bert_layers)
        at_init[-1] = 1.0
        if not torch.equal(self.alpha.detach().cpu().float(), at_init):
            return False
        if self.mode == "linear":
            return True
        return self.scale == 2.0 and not bool(self.beta.detach().ne(0).any())

    def forward(self, bert_layers: Tensor) -> Tensor:
        """bert_layers: (T, B, C, L) -> (T, B, C); a (T, B, C) input is B_L alone, given when every composition
        of the model selects it (:meth:`selects_last_layer`), and is returned as it is."""
        if bert_layers.dim() == 3:
            return bert_layers
        if self.mode == "last":
            return bert_layers[..., -1]
        if self.mode == "linear":
            return torch.matmul(bert_layers, self.alpha.to(bert_layers))
        ab = torch.matmul(bert_layers, torch.stack([self.alpha, self.beta], dim=1).to(bert_layers))  # (T,B,C,2)
        B = ab[..., 0] * torch.sigmoid(ab[..., 1])
        return B * self.scale if self.scale != 1.0 else B
