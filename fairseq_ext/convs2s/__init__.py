"""ConvS2S: "Convolutional Sequence to Sequence Learning" (Gehring et al., ICML 2017), as ``--arch fconv_glu*``.

A re-implementation of fairseq's ``fconv``, numerically equal to it, with current weight normalisation and
an inference weight cache.

    model.py    the encoder, the decoder with multi-step attention, ``fconv_glu`` and its architectures
                (IWSLT De-En, WMT En-De/En-Fr/En-Ro), the fconv -> fconv_glu state-dict mapping
    layers.py   weight-normalised linear and convolution layers (TBC layout), causal convolution
    convert.py  ``python -m fairseq_ext.convs2s.convert --convert-from-fconv IN.pt OUT.pt``
"""

from fairseq_ext.convs2s import model  # noqa: F401  (registers fconv_glu)
