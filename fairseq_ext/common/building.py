"""Whether a model is being rebuilt from a checkpoint: the one mechanism by which our tasks tell our models.

fairseq's ``FairseqTask.build_model(cfg, from_checkpoint)`` knows, but the model's ``build_model(args, task)`` is
not told. Our tasks (``translation_sat``, ``translation_bert``) take :class:`RecordsCheckpointBuild` first in their
bases; a model asks :func:`building_from_checkpoint` while it is built (models never import tasks). A model built by
another task (fairseq's ``translation``) hears False.

* ``sat_transformer`` does not initialise from ``--sat-init-from`` again when rebuilt from its checkpoint;
* ``bert_jam`` phase 3 does not load BERT's weights from the directory when the checkpoint holds them.

And which checkpoint file a loaded model was built from (:func:`checkpoint_of`), recorded by the checkpoint
loaders (:mod:`fairseq_ext.checkpoints.mismatch`), so that an error about a model can name its file.
"""

import contextvars
import weakref

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


_checkpoint_of = weakref.WeakKeyDictionary()  # model -> the checkpoint file fairseq's loaders built it from


def checkpoint_of(model):
    """The checkpoint file that ``load_model_ensemble_and_task`` built ``model`` from, or None."""
    try:
        return _checkpoint_of.get(model)
    except TypeError:
        return None


def remember_checkpoint(model, path):
    """Record that ``model`` was built from the checkpoint ``path``."""
    _checkpoint_of[model] = str(path)
