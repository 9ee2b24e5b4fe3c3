"""fairseq_ext.common.fairseq_fixes: each fix changes exactly what it says and nothing else.

The resume fix (``fix_resume_rebuilds_batches_with_epoch_seed``) only changes the train iterator that
``checkpoint_utils.load_checkpoint`` restores, and only for datasets whose epoch-1 batches an uninterrupted run
reuses; an uninterrupted run, and datasets that resample or rebuild their batches each epoch, get fairseq's own
batches. The end-to-end proof of the exact resume is
tests/core/test_distributed_resume.py::test_sigkill_mid_epoch_and_resume_is_exact.
"""

import argparse
import contextvars
from types import SimpleNamespace

import numpy as np
import pytest

import fairseq_ext  # noqa: F401  (installs the fixes)
from fairseq import checkpoint_utils
from fairseq.data import FairseqDataset, data_utils
from fairseq.tasks import FairseqTask


class Toy(FairseqDataset):
    """50 items; sizes 1 in epoch 1 and 100 afterwards when ``resampling`` (as a ResamplingDataset changes
    its sample each epoch); ``ordered_indices`` depends on the numpy seed, so batches show the seed used."""

    n = 50

    def __init__(self, reusable):
        self.epoch, self.reusable = 1, reusable

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __getitem__(self, i):
        return i

    def __len__(self):
        return self.n

    def size(self, i):
        return 1 if (self.epoch == 1 or self.reusable) else 100

    def num_tokens(self, i):
        return self.size(i)

    def ordered_indices(self):
        return np.random.permutation(self.n)

    @property
    def can_reuse_epoch_itr_across_epochs(self):
        return self.reusable

    def collater(self, samples):
        return samples


def fairseq_get_batch_iterator():
    """fairseq's own FairseqTask.get_batch_iterator (the closure of the wrapper)."""
    patched = FairseqTask.get_batch_iterator
    assert getattr(patched, "_fairseq_ext_wrapped", False)
    return next(c.cell_contents for c in patched.__closure__
                if getattr(c.cell_contents, "__name__", "") == "get_batch_iterator")


def batches(fn, reusable, epoch, restoring=False, **kwargs):
    task, ds = FairseqTask(argparse.Namespace(seed=1)), Toy(reusable)

    def run():
        if restoring:
            FairseqTask.get_batch_iterator.restoring.set(True)
        return fn(task, ds, max_tokens=200, seed=1, epoch=epoch, **kwargs)

    itr = contextvars.copy_context().run(run)
    return [list(b) for b in itr.frozen_batches], itr.epoch, ds.epoch


@pytest.mark.parametrize("reusable", [False, True])
@pytest.mark.parametrize("epoch", [2, 5])
def test_uninterrupted_runs_get_fairseqs_own_batches(reusable, epoch):
    """B1: a dataset that rebuilds its batches each epoch (can_reuse_epoch_itr_across_epochs False) asks for a
    new iterator every epoch of an uninterrupted run; it must be batched with that epoch's sizes and seed.
    Before the fix it got epoch-1 batches (1 batch of 5,000 tokens for max_tokens 200)."""
    ours = batches(FairseqTask.get_batch_iterator, reusable, epoch)
    theirs = batches(fairseq_get_batch_iterator(), reusable, epoch)
    assert ours == theirs
    if not reusable:
        assert len(ours[0]) == 25 and all(len(b) == 2 for b in ours[0])  # 2 x 100 tokens <= 200


def test_restored_iterator_gets_the_batches_of_epoch_1():
    """The fix: the train iterator restored in epoch 3 has the batches an uninterrupted run built in epoch 1
    (seed + 1), and is at epoch 3."""
    restored, itr_epoch, ds_epoch = batches(FairseqTask.get_batch_iterator, True, 3, restoring=True)
    epoch1, _, _ = batches(fairseq_get_batch_iterator(), True, 1)
    assert restored == epoch1 and itr_epoch == ds_epoch == 3
    assert restored != batches(fairseq_get_batch_iterator(), True, 3)[0]  # fairseq alone: seed + 3


@pytest.mark.parametrize("kwargs", [dict(reusable=False), dict(reusable=True, disable_iterator_cache=True),
                                    dict(reusable=True, update_epoch_batch_itr=True)])
def test_restored_iterator_of_rebuilt_batches_is_fairseqs(kwargs):
    """Restoring a dataset that an uninterrupted run re-batched in every epoch (resampling datasets, sharded data
    which fairseq loads with disable_iterator_cache, update_epoch_batch_itr): fairseq's own batches."""
    reusable = kwargs.pop("reusable")
    ours = batches(FairseqTask.get_batch_iterator, reusable, 3, restoring=True, **kwargs)
    assert ours == batches(fairseq_get_batch_iterator(), reusable, 3, **kwargs)


def test_load_checkpoint_marks_only_the_restored_iterator():
    """fairseq's checkpoint_utils.load_checkpoint (wrapped) is what marks the restored iterator: the iterator it
    restores from a checkpoint of epoch 3 has epoch-1 batches; after it returns, nothing is marked."""
    task = FairseqTask(argparse.Namespace(seed=1))
    ds = Toy(True)

    class Trainer:
        checkpoint_suffix = ""
        task = None

        def load_checkpoint(self, *args, **kwargs):
            return {"train_iterator": {"epoch": 3, "iterations_in_epoch": 0, "shuffle": True}}

        def get_train_iterator(self, epoch, load_dataset=True, **kwargs):
            return task.get_batch_iterator(ds, max_tokens=200, seed=1, epoch=epoch, **kwargs)

        def lr_step(self, epoch):
            pass

    cfg = SimpleNamespace(reset_optimizer=False, reset_lr_scheduler=False, optimizer_overrides="{}",
                          reset_meters=False, reset_dataloader=False, finetune_from_model=None,
                          restore_file="x.pt", save_dir=".")
    _, itr = checkpoint_utils.load_checkpoint(cfg, Trainer())
    with data_utils.numpy_seed(1 + 1):
        order = np.random.permutation(50)
    assert [list(b) for b in itr.frozen_batches] == [list(order)] and itr.epoch == 3
    assert not FairseqTask.get_batch_iterator.restoring.get()


@pytest.mark.parametrize("version,applied", [("0.12.3.1", True), ("0.12.3", True), ("0.12.30", False),
                                             ("0.12.2", False), ("0.13.0", False), ("", False)])
def test_fixes_are_applied_only_to_the_checked_fairseq_versions(version, applied, monkeypatch, caplog):
    """Q3: the fixes re-declare fairseq signatures, so on a fairseq they were not checked against none is applied
    and a warning names them (installing on the checked version again is a no-op: every fix is idempotent)."""
    import fairseq

    from fairseq_ext.common import fairseq_fixes

    before = (FairseqTask.get_batch_iterator, data_utils.batch_by_size, checkpoint_utils.load_checkpoint)
    monkeypatch.setattr(fairseq, "__version__", version)
    with caplog.at_level("WARNING", logger="fairseq_ext.common.fairseq_fixes"):
        names = fairseq_fixes.install()
    assert bool(names) == applied
    assert (FairseqTask.get_batch_iterator, data_utils.batch_by_size, checkpoint_utils.load_checkpoint) == before
    if not applied:
        assert "fix_resume_rebuilds_batches_with_epoch_seed" in caplog.text and "not applied" in caplog.text
