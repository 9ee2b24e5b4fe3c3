"""fairseq-ext: research NMT architectures as a fairseq plugin, one folder per paper.

    convs2s/    Convolutional Sequence to Sequence Learning (Gehring et al., 2017): ``fconv_glu``
    msc/        Multiscale Collaborative Deep Models for NMT (Wei et al., 2020): ``msc_transformer``
    sat/        Semi-Autoregressive NMT (Wang et al., 2018): ``sat_transformer``, task ``translation_sat``
    bert_jam/   BERT-JAM (Zhang et al., 2020): ``bert_jam``, task ``translation_bert``

Shared by all of them: :mod:`.errors` (the error class and the one place that prints it),
:mod:`.checkpoint_io` (safe loading and atomic writing of checkpoints under torch >= 2.6) with
:mod:`.checkpoint_checks` (CRCs, weights, scores) and :mod:`.checkpoint_config` (the config strings fairseq
evaluates, registry names), :mod:`.archives` (model archives extracted without leaving their directory),
:mod:`.fairseq_fixes` (fixes to fairseq's own behaviour), :mod:`.building` (a model built from a checkpoint),
:mod:`.release` (packing and verifying releases), :mod:`.average_checkpoints`, :mod:`.decoder_features` (the first
and last lines of the MSC, SAT and BERT-JAM decoders) and :mod:`.long_run_check`; :mod:`.inference` is the faster
CPU decoding any transformer-shaped decoder can declare it supports.

Use it with ``fairseq-train --user-dir fairseq_ext`` from the repository root, or with the absolute path that
``python -m fairseq_ext`` prints from anywhere. Importing the package (directly, or through ``--user-dir``)
registers every model, task and criterion once.
"""

__version__ = "0.1.0"

from fairseq_ext import checkpoint_io, errors, fairseq_fixes

errors.install_excepthook()
checkpoint_io.install()
fairseq_fixes.install()

from fairseq_ext import bert_jam, convs2s, msc, sat  # noqa: E402,F401  (registration)
