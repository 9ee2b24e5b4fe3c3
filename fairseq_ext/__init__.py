"""fairseq-ext: research NMT architectures as a fairseq plugin, one folder per paper.

    convs2s/    Convolutional Sequence to Sequence Learning (Gehring et al., 2017): ``fconv_glu``
    msc/        Multiscale Collaborative Deep Models for NMT (Wei et al., 2020): ``msc_transformer``
    sat/        Semi-Autoregressive NMT (Wang et al., 2018): ``sat_transformer``, task ``translation_sat``
    bert_jam/   BERT-JAM (Zhang et al., 2020): ``bert_jam``, task ``translation_bert``

Shared by all of them: :mod:`.checkpoints` (safe loading and atomic writing of checkpoints, model archives,
averaging, releases), :mod:`.common` (the error class, fairseq's fixes, what the decoders share, whether a model is
built from a checkpoint) and :mod:`.inference` (the faster CPU decoding any transformer-shaped decoder can declare
it supports). ``python -m fairseq_ext.release`` and ``python -m fairseq_ext.average_checkpoints`` are commands.

Use it with ``fairseq-train --user-dir fairseq_ext`` from the repository root, or with the absolute path that
``python -m fairseq_ext`` prints from anywhere. Importing the package (directly, or through ``--user-dir``)
registers every model, task and criterion once.
"""

__version__ = "0.1.0"

from fairseq_ext import checkpoints
from fairseq_ext.common import errors, fairseq_fixes

errors.install_excepthook()
checkpoints.install()
fairseq_fixes.install()

from fairseq_ext import bert_jam, convs2s, msc, sat  # noqa: E402,F401  (registration)
from fairseq_ext.inference import default_generator  # noqa: E402

default_generator.install()  # --task translation decodes with the static step (inference/default_generator.py)
