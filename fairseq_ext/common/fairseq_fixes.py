"""Fixes to fairseq's own behaviour, each named after the fairseq bug it fixes; installed by ``import fairseq_ext``.

They change what fairseq does for every architecture, ours and fairseq's, so each is applied only to the fairseq
versions it was checked against (:data:`CHECKED_VERSIONS`: ``fairseq-fixed`` 0.12.3.x, i.e. fairseq main with
Python 3.11 fixes); on another fairseq a warning names the fixes left out, and fairseq behaves as shipped.
"""

import functools
import glob
import logging
import math
import os
import sys

import numpy as np

from fairseq_ext.common.errors import FairseqExtError

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
        if _checks["empty_split"]:
            _refuse_empty_split(self, dataset)
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


def _interactive_modules():
    """The loaded ``fairseq_cli.interactive`` modules: as imported (the ``fairseq-interactive`` entry point) and as
    ``__main__`` (``python -m fairseq_cli.interactive``). Never imported here: importing it configures logging."""
    found = []
    for name in ("fairseq_cli.interactive", "__main__"):
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is not None and getattr(spec, "name", name) == "fairseq_cli.interactive" and \
                callable(getattr(module, "buffered_read", None)) and callable(getattr(module, "make_batches", None)):
            found.append(module)
    return found


def fix_interactive_input_lines():
    """``fairseq-interactive`` reads its input through ``fileinput`` with universal newlines: a lone ``\\r`` inside
    a line splits it in two, so the output ids no longer match the input lines; and one line longer than the model
    takes (``--max-source-positions``) ends the run with a traceback, losing the rest of the input. Input is read
    with ``newline="\\n"`` (``\\r\\n`` still ends a line; each line is stripped as before), and a line over the
    limit gets one ``error:`` line on stderr naming its line number and the flag, no output, and the run goes on:
    every other line keeps its id (its line number - 1). Applied to the ``fairseq_cli.interactive`` module that is
    running when fairseq_ext is imported (``--user-dir``)."""
    for module in _interactive_modules():
        if getattr(module.buffered_read, "_fairseq_ext_wrapped", False):
            continue
        original_make_batches = module.make_batches
        first_line = {}  # id(buffer) -> the line number of its first line

        def buffered_read(input, buffer_size):
            stream = sys.stdin.buffer if input == "-" else open(input, "rb")
            buffer, start = [], 1
            try:
                for n, raw in enumerate(stream, 1):  # a binary stream splits lines at b"\n" only
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise FairseqExtError(f"--input {input}: line {n} is not UTF-8 text ({e.reason} at byte "
                                              f"{e.start}); convert the input to UTF-8") from None
                    buffer.append(line.strip())
                    if len(buffer) >= buffer_size:
                        first_line[id(buffer)] = start
                        yield buffer
                        buffer, start = [], n + 1
                if buffer:
                    first_line[id(buffer)] = start
                    yield buffer
            finally:
                if stream is not sys.stdin.buffer:
                    stream.close()

        def make_batches(lines, cfg, task, max_positions, encode_fn, _original=original_make_batches):
            start = first_line.pop(id(lines), None)
            seen = set()
            skip = cfg.dataset.skip_invalid_size_inputs_valid_test
            cfg.dataset.skip_invalid_size_inputs_valid_test = True  # fairseq drops them, keeping the others' ids
            try:
                for batch in _original(lines, cfg, task, max_positions, encode_fn):
                    seen.update(int(i) for i in batch.ids.tolist())
                    yield batch
            finally:
                cfg.dataset.skip_invalid_size_inputs_valid_test = skip
            limit = max_positions[0] if isinstance(max_positions, (tuple, list)) else max_positions
            for i in sorted(set(range(len(lines))) - seen):
                n = (start or 1) + i
                length = int(task.get_interactive_tokens_and_lengths([lines[i]], encode_fn)[1][0])
                print(f"error: input line {n}: {length - 1} tokens and EOS are more than the model takes "
                      f"(--max-source-positions {limit}); it is not translated (no output for id {n - 1}), the run "
                      f"goes on; split it into shorter lines", file=sys.stderr, flush=True)

        buffered_read._fairseq_ext_wrapped = make_batches._fairseq_ext_wrapped = True
        module.buffered_read, module.make_batches = buffered_read, make_batches


def _tensors(output, depth=0):
    import torch

    if torch.is_tensor(output):
        yield output
    elif depth < 3 and isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o, depth + 1)
    elif depth < 3 and isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o, depth + 1)


def _first_non_finite_output(models, rerun):
    """(model, module name) of the first module whose output holds a NaN or an infinity while ``rerun()`` runs, or
    None (``rerun`` failing otherwise, or not at all)."""

    class Found(Exception):
        pass

    def hook_for(model, name):
        def hook(module, inputs, output):
            for t in _tensors(output):
                if t.is_floating_point() and t.numel() and not bool(t.isfinite().all()):
                    raise Found(model, name)
        return hook

    handles = []
    try:
        for model in models:
            for name, module in model.named_modules():
                handles.append(module.register_forward_hook(hook_for(model, name or type(model).__name__)))
        rerun()
    except Found as found:
        return found.args
    except Exception:  # noqa: BLE001 - the failure was something else: the caller re-raises its own
        return None
    finally:
        for h in handles:
            h.remove()
    return None


def _without_hypotheses_or_finite_scores(hypos):
    """Whether a sentence of fairseq's generator output has no hypothesis or one whose score is not finite."""
    try:
        return any(len(hs) == 0 or any(not math.isfinite(float(h["score"])) for h in hs) for hs in hypos)
    except (TypeError, KeyError, ValueError, RuntimeError):  # not a generator's hypotheses (e.g. a scorer's)
        return False


def fix_non_finite_scores_crash():
    """A model whose outputs are not finite (weights changed on disk or by a diverged training; finite weights of
    1e30 are enough) ends fairseq's beam search in ``AssertionError: 200 < 200``, and the SAT generator's in an
    ``IndexError`` or with no hypothesis at all. When ``task.inference_step`` (fairseq-generate, -interactive, the
    hub) fails with one of the errors such a model causes, or returns a sentence without hypotheses or with a score
    that is not finite, the batch is decoded again with a forward hook on every module; if a module's output holds
    a NaN or an infinity, one line names the checkpoint and the module. Anything else is raised or returned as it
    was (a batch that decodes normally costs one look at its scores)."""
    from fairseq.tasks import FairseqTask

    from fairseq_ext.common.building import checkpoint_of

    original = FairseqTask.inference_step
    if getattr(original, "_fairseq_ext_wrapped", False):
        return

    def diagnose(self, generator, models, sample, args, kwargs):
        return _first_non_finite_output(models, lambda: original(self, generator, models, sample, *args, **kwargs))

    @functools.wraps(original)
    def inference_step(self, generator, models, sample, *args, **kwargs):
        try:
            hypos = original(self, generator, models, sample, *args, **kwargs)
        except (AssertionError, IndexError, RuntimeError):
            found = diagnose(self, generator, models, sample, args, kwargs)
            if found is None:
                raise
        else:
            if not _without_hypotheses_or_finite_scores(hypos):
                return hypos
            found = diagnose(self, generator, models, sample, args, kwargs)
            if found is None:
                return hypos
        model, where = found
        path = checkpoint_of(model)
        raise FairseqExtError(
            f"{f'checkpoint {path}' if path else 'the model'} gives values that are not finite (NaN or inf in the "
            f"output of {where}) while translating: its weights are damaged or its training diverged; use another "
            "checkpoint (e.g. checkpoint_best.pt or an earlier epoch)")

    inference_step._fairseq_ext_wrapped = True
    FairseqTask.inference_step = inference_step


class DictionaryFormatError(FairseqExtError, ValueError):
    """A dictionary file fairseq cannot read: one line, and the ValueError fairseq raised."""


def _dictionary_problem(path):
    """(line number, what is wrong) of the first line of dictionary ``path`` that fairseq's format refuses."""
    try:
        with open(path, "rb") as f:
            raw = f.read().split(b"\n")
    except OSError as e:
        return 0, str(e)
    words = set()
    for n, line in enumerate(raw, 1):
        try:
            text = line.decode("utf-8").rstrip()
        except UnicodeDecodeError:
            return n, "not UTF-8 text"
        if not text and n == len(raw):
            break
        if n == 1 and text.startswith("# "):  # fairseq's meta line
            continue
        parts = text.rsplit(" ", 1)
        overwrite = len(parts) == 2 and parts[1] == "#fairseq:overwrite"
        if overwrite:
            parts = parts[0].rsplit(" ", 1)
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            return n, f"{text[:60]!r} is not '<token> <count>'"
        if parts[0] in words and not overwrite:
            return n, f"{parts[0][:60]!r} is there twice"
        words.add(parts[0])
    return None, None


def fix_malformed_dictionary_traceback():
    """A dictionary file fairseq cannot read (a line without a count, a word twice, not UTF-8) stops
    fairseq-generate/-interactive/-train with a traceback whose message may span lines; it becomes one
    ``error:`` line naming the file and the line (a :class:`FairseqExtError` that is also the ValueError fairseq
    raised)."""
    from fairseq.data import Dictionary

    original = Dictionary.add_from_file
    if getattr(original, "_fairseq_ext_wrapped", False):
        return

    @functools.wraps(original)
    def add_from_file(self, f):
        if not isinstance(f, str):
            return original(self, f)
        try:
            return original(self, f)
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001 - ValueError, RuntimeError or Exception("Incorrect encoding ...")
            n, what = _dictionary_problem(f)
            where = f" at line {n}" if n else ""
            raise DictionaryFormatError(
                f"dictionary {f} is malformed{where} ({what or type(exc).__name__}): each line must be '<token> "
                "<count>' as fairseq-preprocess writes it; use the dictionary the model was trained with") from None

    add_from_file._fairseq_ext_wrapped = True
    Dictionary.add_from_file = add_from_file


def _split_of(task, dataset):
    """The name under which ``task`` loaded ``dataset`` (``test``, ``valid``), or None."""
    return next((k for k, v in (getattr(task, "datasets", None) or {}).items() if v is dataset), None)


def _data_dirs(task):
    data = getattr(getattr(task, "cfg", None), "data", None) or getattr(getattr(task, "args", None), "data", None)
    return [d for d in str(data).split(os.pathsep) if d] if data else []


def _split_files(task, split):
    """The files of ``split`` in the task's data directories (at most 4)."""
    found = [f for d in _data_dirs(task)
             for f in sorted(glob.glob(os.path.join(glob.escape(d), glob.escape(split) + ".*")))]
    return found[:4]


_checks = {"empty_split": False}  # checks of fix_resume_rebuilds_batches_with_epoch_seed's wrapper, when applied


def _refuse_empty_split(task, dataset):
    try:
        empty = len(dataset) == 0
    except TypeError:  # a dataset without a length: fairseq's business
        return
    split = _split_of(task, dataset) if empty else None
    if split is not None:
        files = _split_files(task, split)
        where = f" ({', '.join(files)})" if files else f" (data {', '.join(_data_dirs(task)) or '?'})"
        raise FairseqExtError(
            f"split '{split}'{where} holds no sentences: fill its files (or re-run fairseq-preprocess on non-empty "
            "text), or give another split (--gen-subset, --valid-subset, --train-subset)")


def fix_empty_split_traceback():
    """A split without a sentence (empty ``--dataset-impl raw`` files, an empty text given to fairseq-preprocess)
    ends fairseq-generate (and validation, training) in ``IndexError`` inside ``data_utils.batch_by_size``; it
    becomes one line naming the split and its files. Checked by the one wrapper of ``get_batch_iterator``."""
    fix_resume_rebuilds_batches_with_epoch_seed()
    _checks["empty_split"] = True


def _too_long(size, max_positions):
    """"source 41 > 30" for each side of ``size`` over ``max_positions``."""
    sides = ("source", "target")
    if isinstance(size, (tuple, list)) and isinstance(max_positions, (tuple, list)):
        return ", ".join(f"{sides[i] if i < 2 else i} {int(a)} > {int(b)}" for i, (a, b) in
                         enumerate(zip(size, max_positions)) if a is not None and b is not None and a > b)
    return f"{size} > {max_positions}"


def fix_invalid_size_traceback():
    """A sentence longer than the model or the flags allow ends fairseq-generate (and validation) with a traceback
    ending in "Size of sample #N is invalid ..." unless ``--skip-invalid-size-inputs-valid-test`` is given; it
    becomes one line naming the split, the sentence id (and its line), the sizes and both ways out. The sentences are
    not skipped silently: a test set scored without some of its sentences is another test set."""
    from fairseq.tasks import FairseqTask

    original = FairseqTask.filter_indices_by_size
    if getattr(original, "_fairseq_ext_wrapped", False):
        return

    @functools.wraps(original)
    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        try:
            return original(self, indices, dataset, max_positions, ignore_invalid_inputs)
        except Exception as exc:  # noqa: BLE001 - fairseq raises a bare Exception
            if ignore_invalid_inputs or type(exc) is not Exception or "Size of sample #" not in str(exc):
                raise
            try:
                _, ignored = dataset.filter_indices_by_size(indices, max_positions)
                first = int(ignored[0])
                size = dataset.size(first)
            except Exception:  # noqa: BLE001 - a dataset that cannot say more: fairseq's error as it was
                raise exc from None
            split = _split_of(self, dataset)
            files = _split_files(self, split) if split else []
            more = f" (and {len(ignored) - 1} more)" if len(ignored) > 1 else ""
            raise FairseqExtError(
                f"split '{split or '?'}'{' (' + files[0] + ', ...)' if files else ''}: sentence id {first} (line "
                f"{first + 1}) is longer than allowed ({_too_long(size, max_positions)} tokens with EOS){more}: "
                "shorten or remove it, raise --max-source-positions / "
                "--max-target-positions (up to the model's own limit), or pass "
                "--skip-invalid-size-inputs-valid-test to leave them out of this split"
            ) from None

    filter_indices_by_size._fairseq_ext_wrapped = True
    FairseqTask.filter_indices_by_size = filter_indices_by_size


class SentencepieceModelError(FairseqExtError, RuntimeError):
    """A --sentencepiece-model that is missing or not a sentencepiece model (also the error fairseq raised)."""


def fix_malformed_sentencepiece_model_traceback():
    """``--bpe sentencepiece --sentencepiece-model FILE`` (fairseq-interactive, -generate, the hub) with a FILE that
    does not exist or is not a sentencepiece model ends in an ``OSError`` / ``RuntimeError: INTERNAL: could not
    parse ModelProto`` traceback; it becomes one line naming the file."""
    from fairseq.data.encoders import sentencepiece_bpe

    cls = sentencepiece_bpe.SentencepieceBPE
    original = cls.__init__
    if getattr(original, "_fairseq_ext_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self, cfg):
        try:
            original(self, cfg)
        except (OSError, RuntimeError) as exc:
            model = getattr(cfg, "sentencepiece_model", "?")
            if "://" not in str(model) and not os.path.exists(str(model)):
                what = "does not exist"
            else:
                why = str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__
                what = f"is not a sentencepiece model ({why})"
            raise SentencepieceModelError(f"--sentencepiece-model {model} {what}; give the spm.model the model was "
                                          "trained with") from None

    __init__._fairseq_ext_wrapped = True
    cls.__init__ = __init__


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
        "fix_interactive_input_lines": fix_interactive_input_lines,
        "fix_non_finite_scores_crash": fix_non_finite_scores_crash,
        "fix_malformed_dictionary_traceback": fix_malformed_dictionary_traceback,
        "fix_empty_split_traceback": fix_empty_split_traceback,
        "fix_invalid_size_traceback": fix_invalid_size_traceback,
        "fix_malformed_sentencepiece_model_traceback": fix_malformed_sentencepiece_model_traceback,
    }
    version = getattr(fairseq, "__version__", "")
    if not any(version == v or version.startswith(v + ".") for v in CHECKED_VERSIONS):  # 0.12.3, 0.12.3.1; not 0.12.30
        logger.warning(f"fairseq {version} is not one fairseq_ext's fixes were checked against "
                       f"({', '.join(CHECKED_VERSIONS)}); not applied: {', '.join(fixes)}")
        return []
    for apply in fixes.values():
        apply()
    return list(fixes)
