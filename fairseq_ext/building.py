"""Whether a model is being rebuilt from a checkpoint: the one mechanism by which our tasks tell our models.

fairseq's ``FairseqTask.build_model(cfg, from_checkpoint)`` knows, but the model's ``build_model(args, task)`` is
not told. Our tasks (``translation_sat``, ``translation_bert``) take :class:`RecordsCheckpointBuild` first in their
bases; a model asks :func:`building_from_checkpoint` while it is built (models never import tasks). A model built by
another task (fairseq's ``translation``) hears False.

* ``sat_transformer`` does not initialise from ``--sat-init-from`` again when rebuilt from its checkpoint;
* ``bert_jam`` phase 3 does not load BERT's weights from the directory when the checkpoint holds them.
"""

import contextvars

_FROM_CHECKPOINT = contextvars.ContextVar("fairseq_ext_building_from_checkpoint", default=False)


def building_from_checkpoint() -> bool:
    """True while one of our tasks builds a model from a checkpoint."""
    return _FROM_CHECKPOINT.get()


class RecordsCheckpointBuild:
    """Task mixin: ``build_model`` records ``from_checkpoint`` for :func:`building_from_checkpoint`."""

    def build_model(self, cfg, from_checkpoint=False):
        token = _FROM_CHECKPOINT.set(bool(from_checkpoint))
        try:
            return super().build_model(cfg, from_checkpoint)
        finally:
            _FROM_CHECKPOINT.reset(token)
