"""Fixes to fairseq's own behaviour, each named after the fairseq bug it fixes; installed by ``import fairseq_ext``.

They change what fairseq does for every architecture, ours and fairseq's, so each is applied only to the fairseq
versions it was checked against (:data:`CHECKED_VERSIONS`: ``fairseq-fixed`` 0.12.3.x, i.e. fairseq main with
Python 3.11 fixes); on another fairseq a warning names the fixes left out, and fairseq behaves as shipped.
"""

import functools
import logging

import numpy as np

logger = logging.getLogger(__name__)

CHECKED_VERSIONS = ("0.12.3",)  # fairseq.__version__ prefixes the fixes were written and tested against


def fix_dropped_last_batch(data_utils):
    """fairseq main (and so fairseq-fixed) drops the last batch when its size is not a multiple of
    ``--required-batch-size-multiple`` (8): ``fairseq-generate`` silently skipped up to 7 sentences of a test
    set, and validation and training lost them too (fairseq 0.12.2 kept it). Every sentence is batched again."""
    original = data_utils.batch_by_size
    if getattr(original, "_fairseq_ext_wrapped", False):
        return

    def batch_by_size(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None, max_sentences=None,
                      required_batch_size_multiple=1, fixed_shapes=None):
        batches = original(indices, num_tokens_fn, num_tokens_vec, max_tokens, max_sentences,
                           required_batch_size_multiple, fixed_shapes)
        if fixed_shapes is None:
            indices = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices), dtype=np.int64)
            covered = sum(len(b) for b in batches)
            if covered < len(indices):  # batches are consecutive slices: the dropped tail is the rest
                batches = list(batches) + [indices[covered:]]
        return batches

    batch_by_size._fairseq_ext_wrapped = True
    batch_by_size.__doc__ = original.__doc__
    data_utils.batch_by_size = batch_by_size


def fix_pytorch_ddp_device_ids_on_cpu():
    """``--ddp-backend pytorch_ddp`` (c10d) on CPU: fairseq always passes ``device_ids=[device_id]`` to torch's
    DistributedDataParallel, which torch refuses for a CPU module ("device_ids and output_device arguments only
    work with single-device/multiple-device GPU modules"); drop them when the module is on CPU."""
    from fairseq.models import distributed_fairseq_model
    from torch.nn.parallel import DistributedDataParallel

    if getattr(distributed_fairseq_model.DistributedDataParallel, "_fairseq_ext_wrapped", False):
        return

    class CpuAwareDistributedDataParallel(DistributedDataParallel):
        _fairseq_ext_wrapped = True

        def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
            if device_ids is not None and all(p.device.type == "cpu" for p in module.parameters()):
                device_ids = output_device = None
            super().__init__(module, device_ids, output_device, *args, **kwargs)

    distributed_fairseq_model.DistributedDataParallel = CpuAwareDistributedDataParallel


def fix_resume_rebuilds_batches_with_epoch_seed():
    """Exact resume after epoch 1. fairseq-fixed (fairseq main) builds the batches of a new batch iterator from
    ``ordered_indices()`` under ``numpy_seed(seed + epoch)`` and, for a dataset whose iterator it caches, reuses
    them for every later epoch. An uninterrupted run builds them in epoch 1; a run resumed in epoch e built them
    with seed + e: other batches (length ties broken by another permutation), so the resumed run trained on
    other batches than the run it continues, and a mid-epoch resume skipped the wrong ones (fairseq 0.12.2 used
    ``numpy_seed(seed)`` whatever the epoch).

    Only the train iterator that ``checkpoint_utils.load_checkpoint`` restores is changed, and only when an
    uninterrupted run would have reused its epoch-1 batches: the task can reuse the dataset's iterator
    (``can_reuse_epoch_itr``), the caller did not disable the cache (``disable_iterator_cache``: sharded data,
    ``update_epoch_batch_itr``) and the task does not ``--rebuild-batches``. Its batches are then those of epoch
    1 and the iterator is moved to its epoch. Every other iterator (an uninterrupted run, datasets that resample
    or rebuild their batches each epoch such as ResamplingDataset, SampledMultiDataset, MultiCorpusDataset,
    sharded data) is fairseq's own."""
    import contextvars
    import inspect

    from fairseq import checkpoint_utils
    from fairseq.tasks import FairseqTask

    original = FairseqTask.get_batch_iterator
    if getattr(original, "_fairseq_ext_wrapped", False):
        return
    signature = inspect.signature(original)
    restoring = contextvars.ContextVar("fairseq_ext_restoring_train_iterator", default=False)

    def get_batch_iterator(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        epoch, dataset = a["epoch"], a["dataset"]
        reused_in_epoch_1 = (not a["disable_iterator_cache"] and not a.get("update_epoch_batch_itr", False)
                             and not getattr(getattr(self, "cfg", None), "rebuild_batches", False)
                             and self.can_reuse_epoch_itr(dataset))
        if not restoring.get() or epoch <= 1 or not reused_in_epoch_1 or \
                dataset in getattr(self, "dataset_to_epoch_iter", {}):
            return original(*bound.args, **bound.kwargs)
        a["epoch"] = 1
        itr = original(*bound.args, **bound.kwargs)
        dataset.set_epoch(epoch)
        itr.epoch = epoch
        return itr

    original_load_checkpoint = checkpoint_utils.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        token = restoring.set(True)
        try:
            return original_load_checkpoint(*args, **kwargs)
        finally:
            restoring.reset(token)

    get_batch_iterator._fairseq_ext_wrapped = True
    get_batch_iterator.__doc__ = original.__doc__
    get_batch_iterator.restoring = restoring  # for the tests
    load_checkpoint._fairseq_ext_wrapped = True
    load_checkpoint.__doc__ = original_load_checkpoint.__doc__
    FairseqTask.get_batch_iterator = get_batch_iterator
    if not getattr(original_load_checkpoint, "_fairseq_ext_wrapped", False):
        checkpoint_utils.load_checkpoint = load_checkpoint


def fix_load_error_hides_cause():
    """``Trainer.load_checkpoint`` turns every error of loading the model's weights into "Cannot load model
    parameters from checkpoint ..." with a traceback; when the cause is one of our one-line errors (e.g. a BERT
    directory whose weights do not match the checkpoint), that error is shown instead."""
    from fairseq.trainer import Trainer

    from fairseq_ext.errors import FairseqExtError

    original = Trainer.load_checkpoint
    if getattr(original, "_fairseq_ext_shows_cause", False):
        return

    @functools.wraps(original)
    def load_checkpoint(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc.__context__, FairseqExtError) and not isinstance(exc, FairseqExtError):
                raise exc.__context__ from None
            raise

    load_checkpoint._fairseq_ext_shows_cause = True
    Trainer.load_checkpoint = load_checkpoint


def fix_reset_optimizer_restarts_schedule():
    """``fairseq-train --restore-file PREV.pt --reset-optimizer`` restarts the update counter and the LR schedule
    with the optimizer (inverse_sqrt then warms up to its peak again). For a task that sets
    ``continues_schedule_after_reset_optimizer`` (``translation_bert``: the next BERT-JAM phase, whose trainable
    parameters differ, as in the official code) the optimizer state is reset and the update counter and the LR
    scheduler's state continue from the checkpoint; ``--reset-lr-scheduler`` (and ``--finetune-from-model``, which
    implies it) restarts them as fairseq does. Every other task is left as fairseq ships it."""
    from fairseq.trainer import Trainer

    original = Trainer.load_checkpoint
    if getattr(original, "_fairseq_ext_continues_schedule", False):
        return

    @functools.wraps(original)
    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False, *args, **kwargs):
        extra_state = original(self, filename, reset_optimizer, reset_lr_scheduler, *args, **kwargs)
        history = self._optim_history or []
        if (getattr(self.task, "continues_schedule_after_reset_optimizer", False) and extra_state is not None
                and reset_optimizer and not reset_lr_scheduler and history and "num_updates" in history[-1]):
            last = history[-1]
            if "lr_scheduler_state" in last:
                try:
                    self.lr_scheduler.load_state_dict(last["lr_scheduler_state"])
                except Exception:  # noqa: BLE001 - another scheduler: its num_updates-driven schedule only
                    pass
            self.set_num_updates(last["num_updates"])
            logger.info(f"--reset-optimizer reset the optimizer state; the update counter and LR schedule continue "
                        f"from {filename} at {last['num_updates']} updates (lr {self.get_lr():g}); "
                        f"--reset-lr-scheduler would restart them")
        return extra_state

    load_checkpoint._fairseq_ext_continues_schedule = True
    Trainer.load_checkpoint = load_checkpoint


def install():
    """Idempotent; called by ``import fairseq_ext``. Returns the names of the fixes applied."""
    import fairseq
    from fairseq.data import data_utils

    fixes = {
        "fix_dropped_last_batch": lambda: fix_dropped_last_batch(data_utils),
        "fix_pytorch_ddp_device_ids_on_cpu": fix_pytorch_ddp_device_ids_on_cpu,
        "fix_resume_rebuilds_batches_with_epoch_seed": fix_resume_rebuilds_batches_with_epoch_seed,
        "fix_load_error_hides_cause": fix_load_error_hides_cause,
        "fix_reset_optimizer_restarts_schedule": fix_reset_optimizer_restarts_schedule,
    }
    version = getattr(fairseq, "__version__", "")
    if not any(version == v or version.startswith(v + ".") for v in CHECKED_VERSIONS):  # 0.12.3, 0.12.3.1; not 0.12.30
        logger.warning(f"fairseq {version} is not one fairseq_ext's fixes were checked against "
                       f"({', '.join(CHECKED_VERSIONS)}); not applied: {', '.join(fixes)}")
        return []
    for apply in fixes.values():
        apply()
    return list(fixes)
