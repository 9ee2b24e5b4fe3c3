"""fairseq-ext: research NMT architectures as a fairseq plugin.

Use it with ``fairseq-train --user-dir fairseq_ext`` from the repository root, or with the absolute path that
``python -m fairseq_ext`` prints from anywhere. Importing the package (directly, or through ``--user-dir``)
registers every model, task and criterion once and makes ``torch.load`` accept fairseq checkpoints safely
(see :mod:`fairseq_ext.compat`).
"""

__version__ = "0.1.0"

from fairseq_ext import compat

compat.install()

from fairseq_ext import criterions, models, modules, tasks  # noqa: E402,F401  (registration)
