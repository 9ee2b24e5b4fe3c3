"""MSC: "Multiscale Collaborative Deep Models for Neural Machine Translation" (Wei et al., ACL 2020), as
``--arch msc_transformer*``.

Block-scale collaboration (decoder layer n attends to encoder block n), a GRU contextual state C^n fused into
every layer by a gate, L2 regularisation of deep encoders, 36/54/72-layer presets.

    model.py            the encoder blocks, the contextual cell Q, the gated fusion (Eq. 5-13), the decoder,
                        ``msc_transformer`` and its base architecture, ``--log-layer-grad-norms`` (Figure 5)
    architectures.py    the 36/54/72-layer (IWSLT) and deep/big (WMT) presets of Tables 1, 2 and 4
    criterion.py        ``--criterion label_smoothed_cross_entropy_l2`` (Table 2, lambda ||W_enc||^2)
    plot_grad_norms.py  ``python -m fairseq_ext.msc.plot_grad_norms``: Figure 5 from training logs
    degradation.py      ``python -m fairseq_ext.msc.degradation``: train/valid BLEU against depth (Figure 1)
"""

from fairseq_ext.msc import architectures, criterion, model  # noqa: F401  (registers msc_transformer, its presets, the criterion)
