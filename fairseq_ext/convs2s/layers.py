"""Weight-normalised building blocks of ConvS2S (Gehring et al., 2017, §3.4-3.5), for ``fconv_glu``.

All use ``torch.nn.utils.parametrizations.weight_norm`` (w = g * v / ||v||; state-dict keys
``parametrizations.weight.original0`` = g and ``original1`` = v), not the deprecated
``torch.nn.utils.weight_norm`` hooks (keys ``weight_g`` / ``weight_v``) that fairseq's ``fconv`` uses;
``fairseq_ext.convs2s.model.upgrade_fconv_state_dict`` maps the old keys.

Inference speed: a parametrised weight is recomputed from (g, v) at every access. In training that is
needed (g and v change each step), but in generation fairseq's ``fconv`` recomputes every weight norm,
including the one of the |V| x d output projection, at every decoding step. :func:`normed_weight` instead
caches w while ``torch.is_grad_enabled()`` is False and the module is in eval mode, keyed by the version
counters and storage of g and v. What invalidates it:

* an in-place operation on g or v themselves (``p.mul_()``, ``load_state_dict``, torch optimizers that update
  the parameters in place), which bumps their version counter, and ``.to()`` / ``.half()`` (new storage);
* any ``train()`` / ``eval()`` call on the model (``fairseq-generate``, ``fairseq-interactive`` and the hub
  call ``eval()`` before decoding), and every forward in training mode or with autograd enabled, which also
  frees the copy (none is held during training).

What does not: a write through ``.data`` (``p.data.mul_()``, ``p.data.copy_()``), which bypasses the version
counter. fairseq's own optimizers (NAG, Adam) update through ``.data``; inside ``fairseq-train`` that is safe,
since each step follows a forward with autograd, which drops the cache. Code that changes the weights through
``.data`` between two inference forwards must call ``model.eval()`` again or :func:`clear_weight_cache`.
"""

import math
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.parametrizations import weight_norm

from fairseq import utils
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules import ConvTBC


def _wn_key(module):
    p = module.parametrizations.weight
    g, v = p.original0, p.original1
    return (g._version, v._version, g.data_ptr(), v.data_ptr(), g.dtype, g.device)


def normed_weight(module, transform=None, tag="w"):
    """``module.weight`` (= g * v / ||v||); cached across calls in eval mode without autograd.
    ``transform`` (e.g. the linearised layout of a causal conv) is applied before caching under ``tag``."""
    if module.training or torch.is_grad_enabled():
        if "_wn_cache" in module.__dict__:  # back to training: free the copy kept for inference
            del module.__dict__["_wn_cache"]
        w = module.weight
        return w if transform is None else transform(w)
    cache = module.__dict__.setdefault("_wn_cache", {})
    key = _wn_key(module)
    hit = cache.get(tag)
    if hit is None or hit[0] != key:
        w = module.weight.detach()
        hit = (key, (w if transform is None else transform(w)).contiguous())
        cache[tag] = hit
    return hit[1]


def clear_weight_cache(model):
    """Drop the inference copies of every weight-normalised layer in ``model`` (after writes through ``.data``)."""
    for m in model.modules():
        m.__dict__.pop("_wn_cache", None)


class _WeightCache:
    """Mixin: ``train()`` / ``eval()`` start from the current weights (drop the inference copy)."""

    def train(self, mode=True):
        self.__dict__.pop("_wn_cache", None)
        return super().train(mode)


class _WNLinear(_WeightCache, nn.Linear):
    def forward(self, x):
        return F.linear(x, normed_weight(self), self.bias)


def WNLinear(in_features, out_features, dropout=0.0):
    """Weight-normalised linear layer, §3.5: w ~ N(0, sqrt((1 - p) / n_in)), b = 0, g = ||w|| (per row)."""
    m = _WNLinear(in_features, out_features)
    nn.init.normal_(m.weight, mean=0, std=math.sqrt((1 - dropout) / in_features))
    nn.init.constant_(m.bias, 0)
    return weight_norm(m, name="weight", dim=0)


class _WNConvTBC(_WeightCache, ConvTBC):
    """fairseq's ConvTBC (time x batch x channel, weight kw x in x out) with a weight-normalised kernel."""

    def forward(self, x):
        return torch.conv_tbc(x.contiguous(), normed_weight(self), self.bias, self.padding[0])


def _conv_init(m, in_channels, dropout):
    # §3.5: the GLU halves the variance, hence 4 (1 - p) / (kw * n_in)
    std = math.sqrt((4 * (1.0 - dropout)) / (m.kernel_size[0] * in_channels))
    nn.init.normal_(m.weight, mean=0, std=std)
    nn.init.constant_(m.bias, 0)
    return weight_norm(m, name="weight", dim=2)  # dim 2 = output channel of the (kw, in, out) kernel


def WNConvTBC(in_channels, out_channels, kernel_size, dropout=0.0, padding=0):
    """Encoder convolution (non-causal, ``padding`` frames on both sides)."""
    return _conv_init(_WNConvTBC(in_channels, out_channels, kernel_size, padding=padding), in_channels, dropout)


@with_incremental_state
class _CausalConvTBC(_WeightCache, ConvTBC):
    """Causal 1-D convolution of the decoder: output i sees inputs i-k+1..i only.

    Full pass (time x batch x channel): ``conv_tbc`` with k-1 frames of padding on both sides, then the
    last k-1 outputs (which would see the future) are dropped. Incremental pass (batch x 1 x channel): the
    last k inputs are kept in a buffer in ``incremental_state`` and the convolution becomes one matrix
    product with the kernel laid out as (out, k * in). Same arithmetic as fairseq's
    ``LinearizedConvolution``, which is not reused because it raises two FutureWarnings on current torch
    (non-full backward hook, positional ``state_dict`` args) and recomputes the weight at every step.
    """

    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__(in_channels, out_channels, kernel_size, padding=kernel_size - 1)

    def _linearize(self, w):
        kw, cin, cout = w.shape
        return w.permute(2, 0, 1).reshape(cout, kw * cin)

    def forward(self, x, incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None):
        k = self.kernel_size[0]
        if incremental_state is None:
            out = torch.conv_tbc(x.contiguous(), normed_weight(self), self.bias, self.padding[0])
            return out[: out.size(0) - (k - 1)] if k > 1 else out
        bsz = x.size(0)
        frame = x[:, -1:, :]
        if k > 1:
            buf = self._get_input_buffer(incremental_state)
            if buf is None:
                buf = x.new_zeros(bsz, k - 1, x.size(2))
            window = torch.cat([buf, frame], dim=1)  # bsz x k x C: inputs i-k+1..i
            self._set_input_buffer(incremental_state, window[:, 1:])
        else:
            window = frame
        out = F.linear(window.reshape(bsz, -1), normed_weight(self, self._linearize, "lin"), self.bias)
        return out.view(bsz, 1, -1)

    def reorder_incremental_state(self, incremental_state, new_order):
        buf = self._get_input_buffer(incremental_state)
        if buf is not None:
            self._set_input_buffer(incremental_state, buf.index_select(0, new_order))

    def _get_input_buffer(self, incremental_state):
        return utils.get_incremental_state(self, incremental_state, "input_buffer")

    def _set_input_buffer(self, incremental_state, buf):
        return utils.set_incremental_state(self, incremental_state, "input_buffer", buf)


def CausalConvTBC(in_channels, out_channels, kernel_size, dropout=0.0):
    """Decoder convolution (causal, incremental)."""
    return _conv_init(_CausalConvTBC(in_channels, out_channels, kernel_size), in_channels, dropout)
