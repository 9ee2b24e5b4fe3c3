"""``--task translation_bert``: translation whose batches also carry the source sentence as BERT input.

BERT-JAM (Zhang et al. 2020) and BERT-fused NMT (Zhu et al. 2020) feed the *plain* source sentence (BPE
removed, detokenised) to a pre-trained BERT, tokenised by BERT's own tokenizer with its special tokens. This
task

* collates ``net_input["bert_input"]`` (B x T_bert, right-padded with BERT's pad id, so BERT's absolute
  positions start at 0 for every sentence) from ``{split}.{src}-{tgt}.{src}.bert.{bin,idx}``, written once by
  ``python -m fairseq_ext.bert_jam.prepare`` beside the binarised data (see
  :class:`fairseq_ext.bert_jam.bert.BertInputBuilder`);
* leaves ``bert_input`` out when that file is absent (e.g. ``fairseq-generate`` on a split that was not
  prepared, ``fairseq-interactive`` with ordinary one-line input): the model then derives it from
  ``src_tokens`` with the very same builder, so both paths give identical BERT ids;
* with ``--bert-feature-cache DIR`` (training and validation while BERT is frozen) also collates
  ``net_input["bert_out"]``, BERT's precomputed features, from a memory map written once per split (see
  :mod:`fairseq_ext.bert_jam.feature_cache`); generation always runs BERT live.

``transformers`` is imported lazily (inside functions), never at package import time.
"""

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
from fairseq_ext.common.building import RecordsCheckpointBuild
from fairseq_ext.common.errors import FairseqExtError

logger = logging.getLogger(__name__)

REMOVE_BPE_CHOICES = ChoiceEnum(["auto", "sentencepiece", "subword_nmt", "none"])
DETOKENIZE_CHOICES = ChoiceEnum(["auto", "moses", "none"])
FEATURE_DTYPE_CHOICES = ChoiceEnum(["float16", "float32"])
FEATURE_LAYERS_CHOICES = ChoiceEnum(["auto", "last", "all"])
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
    (right-padded with ``bert_pad``, in the batch order of the source) and, when ``features`` (a
    :class:`~fairseq_ext.bert_jam.feature_cache.FeatureCache`) is set, ``net_input["bert_out"]``: BERT's
    precomputed features, B x T_bert x C (x L)."""

    def __init__(self, dataset, bert, bert_pad, features=None):
        super().__init__(dataset)
        if len(bert) != len(dataset):
            raise FairseqExtError(f"prepared BERT input has {len(bert)} sentences but the source has "
                                  f"{len(dataset)}; rerun python -m fairseq_ext.bert_jam.prepare")
        self.bert = bert
        self.bert_pad = bert_pad
        self.features = features

    def __getitem__(self, index):
        item = self.dataset[index]
        item["bert"] = self.bert[index]
        return item

    def collater(self, samples):
        batch = self.dataset.collater(samples)
        if len(samples) == 0 or "net_input" not in batch:
            return batch
        by_id = {s["id"]: s["bert"] for s in samples}
        bert_input = collate_bert([by_id[int(i)] for i in batch["id"]], self.bert_pad)
        batch["net_input"]["bert_input"] = bert_input
        if self.features is not None:
            batch["net_input"]["bert_out"] = self.features.batch(batch["id"].tolist(), bert_input.size(1))
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
    bert_feature_cache: Optional[str] = field(default=None, metadata={
        "help": "while BERT is frozen (--bert-jam-phase 1 or 2): compute BERT's outputs (eval mode, no dropout) "
                "for every sentence of a split once, keep them in this directory (one memory map per split, keyed "
                "by the BERT weights, the layers, the dtype and the prepared BERT ids; a mismatch is refused) and "
                "train/validate on them instead of running BERT on every batch; refused in phase 3; generation "
                "runs BERT live. Needs the prepared BERT input (python -m fairseq_ext.bert_jam.prepare)"})
    bert_feature_cache_dtype: FEATURE_DTYPE_CHOICES = field(default="float16", metadata={
        "help": "dtype of the cached BERT features (float32: twice the size, exactly the live features)"})
    bert_feature_cache_layers: FEATURE_LAYERS_CHOICES = field(default="auto", metadata={
        "help": "BERT layers to cache: last (B_L, phase 1 at Eq. 11 / --bert-composition last), all (phase 2), "
                "auto: what the model's layer compositions read when it is built"})


@register_task("translation_bert", dataclass=TranslationBertConfig)
class TranslationBertTask(RecordsCheckpointBuild, TranslationTask):
    """Translation with a BERT view of the source (``net_input["bert_input"]``) for ``--arch bert_jam*``."""

    cfg: TranslationBertConfig
    # fairseq-train --restore-file PREV.pt --reset-optimizer (the next BERT-JAM phase) continues the update counter
    # and the LR schedule (fairseq_ext.common.fairseq_fixes.fix_reset_optimizer_restarts_schedule)
    continues_schedule_after_reset_optimizer = True

    def __init__(self, cfg, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self._feature_source = None  # (encoder, layers) once build_model has set up --bert-feature-cache

    def _bert_meta(self, data_path):
        path = os.path.join(data_path, META_NAME.format(lang=self.cfg.source_lang))
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def _bert_shards(self, split, epoch=1, combine=False):
        """(data path, its index, the prefixes of the prepared BERT ids of ``split``) as fairseq loads the split."""
        paths = utils.split_paths(self.cfg.data)
        if split != self.cfg.train_subset:
            paths = paths[:1]
        k_path = (epoch - 1) % len(paths)
        data_path = paths[k_path]
        src, tgt = self.cfg.source_lang, self.cfg.target_lang
        prefixes = []
        for k in range(10_000):
            if k > 0 and not combine:  # as fairseq: valid1, test1 are subsets of their own, not shards
                break
            split_k = split + (str(k) if k > 0 else "")
            prefix = bert_input_prefix(data_path, split_k, src, tgt)
            if not indexed_dataset.dataset_exists(prefix, impl="mmap"):
                break
            prefixes.append(prefix)
        return data_path, k_path, prefixes

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        data_path, k_path, prefixes = self._bert_shards(split, epoch, combine)
        src = self.cfg.source_lang
        berts = [data_utils.load_indexed_dataset(p, None, "mmap") for p in prefixes]
        if not berts:
            if self._feature_source is not None:
                raise FairseqExtError(
                    f"--bert-feature-cache: no prepared BERT input for split '{split}' in {data_path}; the cache is "
                    f"computed from it: run python -m fairseq_ext.bert_jam.prepare {data_path} --source-lang {src} "
                    f"--target-lang {self.cfg.target_lang} --bert-model-name NAME")
            logger.warning(
                f"no prepared BERT input for split '{split}' in {data_path}: the model derives it from the "
                "source tokens on every batch (slower in training); run python -m fairseq_ext.bert_jam."
                f"prepare {data_path} --source-lang {src} --target-lang {self.cfg.target_lang} --bert-model-name NAME")
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
        ds = LanguagePairBertDataset(self.datasets[split], bert, int(meta["pad_id"]))
        ds.cache_shards = (split, k_path, prefixes)
        self.datasets[split] = ds
        if self._feature_source is not None:
            ds.features = self._features(split, k_path, prefixes, bert)

    # -- --bert-feature-cache
    def _features(self, split, k_path, prefixes, ids_dataset=None):
        """The feature cache of a split (built once, under a lock; refused when it belongs to another run)."""
        from fairseq_ext.bert_jam import feature_cache

        encoder, layers = self._feature_source
        if ids_dataset is None:
            ds = [data_utils.load_indexed_dataset(p, None, "mmap") for p in prefixes]
            ids_dataset = ds[0] if len(ds) == 1 else ConcatDataset(ds)
        sizes = ids_dataset.sizes
        hidden, n_layers = encoder._bert_dims
        key = feature_cache.make_key(encoder.bert_digest(), layers, str(self.cfg.bert_feature_cache_dtype), hidden,
                                     n_layers, encoder.bert_pad_id, sizes, prefixes)
        name = split if len(utils.split_paths(self.cfg.data)) == 1 or split != self.cfg.train_subset \
            else f"{split}.path{k_path}"
        return feature_cache.open_or_build(str(self.cfg.bert_feature_cache), name, key, encoder.bert, ids_dataset,
                                           sizes)

    def _setup_feature_cache(self, model):
        encoder = getattr(model, "encoder", None)
        if encoder is None or not hasattr(encoder, "bert_trainable"):
            raise FairseqExtError("--bert-feature-cache works with --arch bert_jam* only")
        if encoder.bert_trainable:
            raise FairseqExtError(
                f"--bert-feature-cache {self.cfg.bert_feature_cache}: BERT is fine-tuned in phase 3 "
                "(--bert-jam-phase 3), so its features change at every update and cannot be cached; drop "
                "--bert-feature-cache in phase 3")
        layers = str(self.cfg.bert_feature_cache_layers)
        if layers == "auto":
            layers = "last" if encoder.bert_last_only else "all"
        self._feature_source = (encoder, layers)
        logger.info(f"--bert-feature-cache {self.cfg.bert_feature_cache}: BERT's {layers} layer(s), "
                    f"{self.cfg.bert_feature_cache_dtype}, eval mode (no dropout); training and validation use "
                    "them instead of running BERT")
        # the training split first, while the model is still float32 (before the trainer casts or moves it)
        train = str(getattr(self.cfg, "train_subset", "train") or "train")
        if train.startswith("${"):  # a config built outside fairseq's CLI
            train = "train"
        if train not in self.datasets:
            _, k_path, prefixes = self._bert_shards(train, epoch=1, combine=True)
            if prefixes:
                self._features(train, k_path, prefixes)
        for ds in self.datasets.values():  # splits loaded before the model
            if isinstance(ds, LanguagePairBertDataset) and ds.features is None and hasattr(ds, "cache_shards"):
                split, k_path, prefixes = ds.cache_shards
                ds.features = self._features(split, k_path, prefixes, ds.bert)

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)  # RecordsCheckpointBuild tells the model
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
        if self.cfg.bert_feature_cache:
            if from_checkpoint:  # fairseq-generate/-interactive, the hub: BERT runs live
                logger.info("--bert-feature-cache is for training: generation runs BERT live")
            else:
                self._setup_feature_cache(model)
        return model
