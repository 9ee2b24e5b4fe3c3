"""``--task translation_bert``: translation whose batches also carry the source sentence as BERT input.

BERT-JAM (Zhang et al. 2020) and BERT-fused NMT (Zhu et al. 2020) feed the *plain* source sentence (BPE
removed, detokenised) to a pre-trained BERT, tokenised by BERT's own tokenizer with its special tokens. This
task

* collates ``net_input["bert_input"]`` (B x T_bert, right-padded with BERT's pad id, so BERT's absolute
  positions start at 0 for every sentence) from ``{split}.{src}-{tgt}.{src}.bert.{bin,idx}``, written once by
  ``python -m fairseq_ext.bert_jam.prepare`` beside the binarised data (see :class:`fairseq_ext.bert_jam.bert.BertInputBuilder`);
* leaves ``bert_input`` out when that file is absent (e.g. ``fairseq-generate`` on a split that was not
  prepared, ``fairseq-interactive`` with ordinary one-line input): the model then derives it from
  ``src_tokens`` with the very same builder, so both paths give identical BERT ids.

``transformers`` is imported lazily (inside functions), never at package import time.
"""

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

from fairseq import utils
from fairseq.data import BaseWrapperDataset, ConcatDataset, data_utils
from fairseq.data import indexed_dataset
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_ext.bert_jam.bert import check_input_settings, check_prepared_input_fits, collate_bert, input_settings
from fairseq_ext.errors import FairseqExtError

logger = logging.getLogger(__name__)

REMOVE_BPE_CHOICES = ChoiceEnum(["auto", "sentencepiece", "subword_nmt", "none"])
DETOKENIZE_CHOICES = ChoiceEnum(["auto", "moses", "none"])
META_NAME = "bert_input.{lang}.json"


def bert_input_prefix(data_path, split, src, tgt):
    """Prefix of the prepared BERT ids of ``split``, beside fairseq's own source file (either direction)."""
    for a, b in ((src, tgt), (tgt, src)):
        base = os.path.join(data_path, f"{split}.{a}-{b}.{src}")
        if indexed_dataset.dataset_exists(base, impl=None) or os.path.exists(base + ".idx"):
            return base + ".bert"
    return os.path.join(data_path, f"{split}.{src}-{tgt}.{src}.bert")


class LanguagePairBertDataset(BaseWrapperDataset):
    """A :class:`~fairseq.data.LanguagePairDataset` whose batches also carry ``net_input["bert_input"]``
    (right-padded with ``bert_pad``, in the batch order of the source)."""

    def __init__(self, dataset, bert, bert_pad):
        super().__init__(dataset)
        if len(bert) != len(dataset):
            raise FairseqExtError(f"prepared BERT input has {len(bert)} sentences but the source has "
                                  f"{len(dataset)}; rerun python -m fairseq_ext.bert_jam.prepare")
        self.bert = bert
        self.bert_pad = bert_pad

    def __getitem__(self, index):
        item = self.dataset[index]
        item["bert"] = self.bert[index]
        return item

    def collater(self, samples):
        batch = self.dataset.collater(samples)
        if len(samples) == 0 or "net_input" not in batch:
            return batch
        by_id = {s["id"]: s["bert"] for s in samples}
        batch["net_input"]["bert_input"] = collate_bert([by_id[int(i)] for i in batch["id"]], self.bert_pad)
        return batch


@dataclass
class TranslationBertConfig(TranslationConfig):
    bert_model_name: Optional[str] = field(default=None, metadata={
        "help": "BERT-architecture model to use: a local directory (config.json, weights, tokenizer files) or "
                "a name in the local Hugging Face cache; loaded offline with AutoModel/AutoTokenizer. At "
                "generation time it defaults to the one saved in the checkpoint"})
    bert_remove_bpe: REMOVE_BPE_CHOICES = field(default="auto", metadata={
        "help": "how to undo the source BPE before BERT tokenisation (auto: detected from the source "
                "dictionary)"})
    bert_detokenize: DETOKENIZE_CHOICES = field(default="auto", metadata={
        "help": "detokenise the source before BERT (auto: moses unless the BPE is sentencepiece)"})
    bert_max_length: int = field(default=0, metadata={
        "help": "truncate BERT inputs to this many tokens (0: the model's limit, e.g. 512)"})


@register_task("translation_bert", dataclass=TranslationBertConfig)
class TranslationBertTask(TranslationTask):
    """Translation with a BERT view of the source (``net_input["bert_input"]``) for ``--arch bert_jam*``."""

    cfg: TranslationBertConfig

    def __init__(self, cfg, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self.building_from_checkpoint = False

    def _bert_meta(self, data_path):
        path = os.path.join(data_path, META_NAME.format(lang=self.cfg.source_lang))
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        paths = utils.split_paths(self.cfg.data)
        if split != self.cfg.train_subset:
            paths = paths[:1]
        data_path = paths[(epoch - 1) % len(paths)]
        src, tgt = self.cfg.source_lang, self.cfg.target_lang
        berts = []
        for k in range(10_000):
            if k > 0 and not combine:  # as fairseq: valid1, test1 are subsets of their own, not shards
                break
            split_k = split + (str(k) if k > 0 else "")
            prefix = bert_input_prefix(data_path, split_k, src, tgt)
            if not indexed_dataset.dataset_exists(prefix, impl="mmap"):
                break
            berts.append(data_utils.load_indexed_dataset(prefix, None, "mmap"))
        if not berts:
            logger.warning(
                f"no prepared BERT input for split '{split}' in {data_path}: the model derives it from the "
                "source tokens on every batch (slower in training); run python -m fairseq_ext.bert_jam."
                f"prepare {data_path} --source-lang {src} --target-lang {tgt} --bert-model-name NAME")
            return
        meta = self._bert_meta(data_path)
        if meta is None:
            raise FairseqExtError(f"{os.path.join(data_path, META_NAME.format(lang=src))} is missing; rerun "
                                  "python -m fairseq_ext.bert_jam.prepare")
        if self.cfg.bert_model_name and os.path.abspath(str(self.cfg.bert_model_name)) != os.path.abspath(
                str(meta["bert_model_name"])) and os.path.basename(os.path.normpath(str(self.cfg.bert_model_name))) \
                != os.path.basename(os.path.normpath(str(meta["bert_model_name"]))):
            logger.warning(f"BERT input in {data_path} was prepared with {meta['bert_model_name']} but "
                           f"--bert-model-name is {self.cfg.bert_model_name}; the vocabulary sizes are checked")
        self._prepared_meta = meta
        bert = berts[0] if len(berts) == 1 else ConcatDataset(berts)
        self.datasets[split] = LanguagePairBertDataset(self.datasets[split], bert, int(meta["pad_id"]))

    def build_model(self, cfg, from_checkpoint=False):
        self.building_from_checkpoint = from_checkpoint
        try:
            model = super().build_model(cfg, from_checkpoint)
        finally:
            self.building_from_checkpoint = False
        data_path = utils.split_paths(self.cfg.data)[0]
        meta = getattr(self, "_prepared_meta", None) or self._bert_meta(data_path)
        config = getattr(getattr(getattr(model, "encoder", None), "bert", None), "config", None)
        check_prepared_input_fits(meta, config, self.cfg.data)
        derived = getattr(getattr(model, "args", None), "bert_input_meta", None)
        if meta is not None and derived:
            where = "the checkpoint" if from_checkpoint else "the model's flags"
            check_input_settings(input_settings(meta), derived,
                                 os.path.join(data_path, META_NAME.format(lang=self.cfg.source_lang)),
                                 f"the BERT input that {where} derive(s)")
        return model


def continue_schedule_across_phases():
    """``fairseq-train --restore-file PREV.pt --reset-optimizer`` with ``--task translation_bert`` (moving to the
    next BERT-JAM phase, whose trainable parameters differ): the optimizer state is reset, but the update
    counter and the LR scheduler's state continue from the checkpoint, as in the official code (fairseq would
    restart them, so inverse_sqrt would warm up to its peak again). ``--reset-lr-scheduler`` (and
    ``--finetune-from-model``, which implies it) restarts them as fairseq does. Also shows the one-line
    FairseqExtError of loading (e.g. a BERT directory whose weights do not match the checkpoint) instead of
    fairseq's "Cannot load model parameters"."""
    from fairseq.trainer import Trainer

    original = Trainer.load_checkpoint
    if getattr(original, "_bert_jam_wrapped", False):
        return

    @functools.wraps(original)
    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False, *args, **kwargs):
        try:
            extra_state = original(self, filename, reset_optimizer, reset_lr_scheduler, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc.__context__, FairseqExtError) and not isinstance(exc, FairseqExtError):
                raise exc.__context__ from None
            raise
        history = self._optim_history or []
        if (isinstance(self.task, TranslationBertTask) and extra_state is not None and reset_optimizer
                and not reset_lr_scheduler and history and "num_updates" in history[-1]):
            last = history[-1]
            if "lr_scheduler_state" in last:
                try:
                    self.lr_scheduler.load_state_dict(last["lr_scheduler_state"])
                except Exception:  # noqa: BLE001 - another scheduler: its num_updates-driven schedule only
                    pass
            self.set_num_updates(last["num_updates"])
            logger.info(f"translation_bert: --reset-optimizer reset the optimizer state; the update counter and "
                        f"LR schedule continue from {filename} at {last['num_updates']} updates (lr "
                        f"{self.get_lr():g}); --reset-lr-scheduler would restart them")
        return extra_state

    load_checkpoint._bert_jam_wrapped = True
    Trainer.load_checkpoint = load_checkpoint


continue_schedule_across_phases()
