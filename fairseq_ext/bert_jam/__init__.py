"""BERT-JAM: "BERT-JAM: Boosting BERT-Enhanced Neural Machine Translation with Joint Attention" (Zhang et al.,
2020), as ``--arch bert_jam*`` with ``--task translation_bert``.

A Hugging Face BERT inside the encoder, a GLU per layer over all BERT layers, joint attention, three training
phases (``--bert-jam-phase 1|2|3``).

    model.py    the layer composition (Eq. 8, 11), joint attention (Sec. 2.2), encoder and decoder layers
                (Eq. 9-10), ``bert_jam`` and its architectures, the phases
    bert.py     BERT loaded offline (config, tokenizer, weights), the checks that its tokenizer and prepared
                input belong to it, and the one path from fairseq source tokens to BERT ids
    task.py     ``--task translation_bert``: batches that also carry the BERT input
    prepare.py  ``python -m fairseq_ext.bert_jam.prepare``: BERT ids of the binarised data, once
"""

from fairseq_ext.bert_jam import model, task  # noqa: F401  (registers bert_jam and translation_bert)
