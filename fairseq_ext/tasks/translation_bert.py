"""``--task translation_bert``: translation whose batches also carry the source sentence as BERT input.

BERT-JAM (Zhang et al. 2020) and BERT-fused NMT (Zhu et al. 2020) feed the *plain* source sentence (BPE
removed, detokenised) to a pre-trained BERT, tokenised by BERT's own tokenizer with its special tokens. This
task

* collates ``net_input["bert_input"]`` (B x T_bert, right-padded with BERT's pad id, so BERT's absolute
  positions start at 0 for every sentence) from ``{split}.{src}-{tgt}.{src}.bert.{bin,idx}``, written once by
  ``python -m fairseq_ext.scripts.bert_prepare`` beside the binarised data (see :class:`BertInputBuilder`);
* leaves ``bert_input`` out when that file is absent (e.g. ``fairseq-generate`` on a split that was not
  prepared, ``fairseq-interactive`` with ordinary one-line input): the model then derives it from
  ``src_tokens`` with the very same :class:`BertInputBuilder`, so both paths give identical BERT ids.

``transformers`` is imported lazily (inside functions), never at package import time.
"""

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from fairseq import utils
from fairseq.data import BaseWrapperDataset, ConcatDataset, data_utils
from fairseq.data import indexed_dataset
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_ext.compat import FairseqExtError

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


# --------------------------------------------------------------------------------------------------------
# loading BERT's tokenizer / config / weights offline
# --------------------------------------------------------------------------------------------------------

def _bert_load_error(name, what, exc):
    name_s = str(name)
    if (os.path.isabs(name_s) or name_s.startswith(".") or name_s.count("/") > 1) and not os.path.exists(name_s):
        return FairseqExtError(
            f"--bert-model-name {name}: no such directory; give a local directory holding config.json, the "
            "weights and the tokenizer files of a BERT-architecture model (this runs offline, nothing is "
            "downloaded)")
    if os.path.isdir(name_s) and not os.path.isfile(os.path.join(name_s, "config.json")):
        return FairseqExtError(
            f"--bert-model-name {name}: the directory has no config.json, so it is not a saved BERT model; give "
            "a directory written by save_pretrained (config.json, the weights and the tokenizer files)")
    return FairseqExtError(
        f"--bert-model-name {name}: cannot load the BERT {what} ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else ''}); give a local directory holding config.json, the "
        "weights and the tokenizer files (this runs offline, nothing is downloaded)"
    )


def load_bert_tokenizer(name):
    if not name:
        raise FairseqExtError("--bert-model-name is required with --task translation_bert / --arch bert_jam*: "
                              "give the directory (or cached name) of a BERT-architecture model")
    from transformers import AutoTokenizer  # lazy: slow import

    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - one line for the user
        raise _bert_load_error(name, "tokenizer", exc) from None
    if tok.pad_token_id is None:
        raise FairseqExtError(f"--bert-model-name {name}: its tokenizer has no pad token; BERT-JAM needs a "
                              "BERT-architecture tokenizer ([PAD]/[CLS]/[SEP])")
    return tok


def load_bert_config(name):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001
        raise _bert_load_error(name, "config", exc) from None


# --------------------------------------------------------------------------------------------------------
# source tokens -> plain sentence -> BERT ids
# --------------------------------------------------------------------------------------------------------

_MOSES_UNESCAPE = [("&bar;", "|"), ("&lt;", "<"), ("&gt;", ">"), ("&bra;", "["), ("&ket;", "]"),
                   ("&quot;", '"'), ("&apos;", "'"), ("&#91;", "["), ("&#93;", "]"), ("&amp;", "&")]


def moses_detokenize(text):
    """Undo the Moses tokenizer's escapes, ``@-@`` joins and the spaces it puts around punctuation.

    Uses ``sacremoses`` when it is installed; otherwise this covers what matters for BERT's uncased WordPiece
    (which splits punctuation again anyway): entities, hyphen joins, spaces before ``.,!?;:%)]}`` and after
    ``([{``, and English clitics (``don 't`` -> ``don't``)."""
    try:
        from sacremoses import MosesDetokenizer  # optional
    except ImportError:
        MosesDetokenizer = None
    if MosesDetokenizer is not None:
        return MosesDetokenizer().detokenize(text.split())
    text = re.sub(r" ?@([-/.,:]|&#45;)@ ?", r"\1", text)
    for esc, ch in _MOSES_UNESCAPE:
        text = text.replace(esc, ch)
    text = re.sub(r"\s+([.,!?;:%)\]}])", r"\1", text)
    text = re.sub(r"([(\[{])\s+", r"\1", text)
    text = re.sub(r"(\w) '(s|re|ve|ll|d|m|t)\b", r"\1'\2", text)
    text = re.sub(r"(\w) n't\b", r"\1n't", text)
    return re.sub(r"\s+", " ", text).strip()


def detect_bpe(dictionary):
    """'sentencepiece' when many symbols carry the word-start mark, 'subword_nmt' when some end in '@@'."""
    symbols = dictionary.symbols[dictionary.nspecial:]
    if not symbols:
        return "none"
    spm = sum(1 for s in symbols if s.startswith("\u2581"))
    if spm >= max(1, len(symbols) // 10):
        return "sentencepiece"
    if any(s.endswith("@@") for s in symbols):
        return "subword_nmt"
    return "none"


def remove_bpe(line, bpe):
    if bpe == "sentencepiece":
        return line.replace(" ", "").replace("\u2581", " ").strip()
    if bpe == "subword_nmt":
        return (line + " ").replace("@@ ", "").rstrip()
    return line.strip()


class BertInputBuilder:
    """Turns fairseq source ids (or plain sentences) into BERT ids: remove BPE, detokenise, tokenise with the
    BERT tokenizer (fast or slow) and its special tokens, truncate to the model's limit with a warning.

    The same object serves ``bert_prepare`` (once, offline) and the model (on the fly when a batch has no
    ``bert_input``), so prepared and derived inputs are identical."""

    def __init__(self, bert_model_name, src_dict=None, remove_bpe="auto", detokenize="auto", max_length=0,
                 tokenizer=None):
        self.bert_model_name = bert_model_name
        self.tokenizer = tokenizer if tokenizer is not None else load_bert_tokenizer(bert_model_name)
        self.src_dict = src_dict
        bpe = str(remove_bpe)
        if bpe == "auto":
            bpe = detect_bpe(src_dict) if src_dict is not None else "none"
        self.bpe = bpe
        detok = str(detokenize)
        if detok == "auto":
            # sentencepiece is normally trained on raw text (nothing to detokenise); subword-nmt on Moses tokens
            detok = "none" if bpe == "sentencepiece" else "moses"
        self.detokenize = detok
        limit = getattr(self.tokenizer, "model_max_length", None) or 0
        limit = limit if 0 < limit < 100_000 else 0
        try:
            pos = int(getattr(load_bert_config(bert_model_name), "max_position_embeddings", 0) or 0)
        except FairseqExtError:
            pos = 0
        limits = [x for x in (int(max_length or 0), limit, pos) if x > 0]
        self.max_length = min(limits) if limits else 512
        self.pad_id = int(self.tokenizer.pad_token_id)
        self._template = None
        self.n_truncated = 0

    def meta(self):
        return {"bert_model_name": self.bert_model_name, "vocab_size": len(self.tokenizer),
                "pad_id": self.pad_id, "max_length": self.max_length, "remove_bpe": self.bpe,
                "detokenize": self.detokenize, "tokenizer_class": type(self.tokenizer).__name__}

    def text_from_source(self, tokens):
        """Plain sentence of one row of fairseq source ids (pads, EOS dropped; ``<unk>`` -> BERT's unk)."""
        tokens = tokens[tokens.ne(self.src_dict.pad())]
        unk = self.tokenizer.unk_token or "<unk>"
        if self.bpe == "sentencepiece":  # an unknown piece: a word of its own
            unk = "\u2581" + unk
        return self.plain_text(self.src_dict.string(tokens, unk_string=unk))

    def plain_text(self, line):
        """A line of source pieces (as given to fairseq-preprocess) -> the plain sentence BERT reads."""
        line = remove_bpe(line.strip(), self.bpe)
        if self.detokenize == "moses":
            line = moses_detokenize(line)
        return line

    def _special_template(self):
        """(ids before, ids after) the sentence in the tokenizer's single-sentence template ([CLS] .. [SEP])."""
        if self._template is None:
            content = self.tokenizer("a", add_special_tokens=False)["input_ids"]
            full = self.tokenizer("a", add_special_tokens=True)["input_ids"]
            for i in range(len(full) - len(content) + 1):
                if full[i:i + len(content)] == content:
                    self._template = (full[:i], full[i + len(content):])
                    break
            else:
                self._template = ([], [])
        return self._template

    def encode(self, texts: List[str]) -> List[List[int]]:
        """BERT ids with the special tokens, at most ``max_length`` (longer inputs lose their tail, keeping the
        closing special token, with a warning)."""
        pieces = self.tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        head, tail = self._special_template()
        room = self.max_length - len(head) - len(tail)
        out = []
        for ids in pieces:
            if len(ids) > room:
                self.n_truncated += 1
                if self.n_truncated in (1, 10, 100, 1000) or self.n_truncated % 10000 == 0:
                    logger.warning(f"BERT input longer than {self.max_length} tokens truncated "
                                   f"({self.n_truncated} sentence(s) so far)")
                ids = ids[:room]
            out.append(list(head) + list(ids) + list(tail))
        return out

    def batch_from_source(self, src_tokens):
        """B x T LongTensor of BERT ids (right-padded with BERT's pad id) for a batch of source ids."""
        texts = [self.text_from_source(row) for row in src_tokens.cpu()]
        return collate_bert([torch.tensor(ids, dtype=torch.long) for ids in self.encode(texts)],
                            self.pad_id).to(src_tokens.device)


def collate_bert(seqs, pad_id):
    return data_utils.collate_tokens([s.long() for s in seqs], pad_id, left_pad=False)


# --------------------------------------------------------------------------------------------------------
# dataset and task
# --------------------------------------------------------------------------------------------------------

class LanguagePairBertDataset(BaseWrapperDataset):
    """A :class:`~fairseq.data.LanguagePairDataset` whose batches also carry ``net_input["bert_input"]``
    (right-padded with ``bert_pad``, in the batch order of the source)."""

    def __init__(self, dataset, bert, bert_pad):
        super().__init__(dataset)
        if len(bert) != len(dataset):
            raise FairseqExtError(f"prepared BERT input has {len(bert)} sentences but the source has "
                                  f"{len(dataset)}; rerun python -m fairseq_ext.scripts.bert_prepare")
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
            split_k = split + (str(k) if k > 0 else "")
            prefix = bert_input_prefix(data_path, split_k, src, tgt)
            if not indexed_dataset.dataset_exists(prefix, impl="mmap"):
                break
            berts.append(data_utils.load_indexed_dataset(prefix, None, "mmap"))
        if not berts:
            logger.warning(
                f"no prepared BERT input for split '{split}' in {data_path}: the model derives it from the "
                "source tokens on every batch (slower in training); run python -m fairseq_ext.scripts."
                f"bert_prepare {data_path} --source-lang {src} --target-lang {tgt} --bert-model-name NAME")
            return
        meta = self._bert_meta(data_path)
        if meta is None:
            raise FairseqExtError(f"{os.path.join(data_path, META_NAME.format(lang=src))} is missing; rerun "
                                  "python -m fairseq_ext.scripts.bert_prepare")
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
        meta = getattr(self, "_prepared_meta", None) or self._bert_meta(utils.split_paths(self.cfg.data)[0])
        encoder = getattr(model, "encoder", None)
        vocab = getattr(getattr(encoder, "bert", None), "config", None)
        if meta is not None and vocab is not None and int(meta["vocab_size"]) > int(vocab.vocab_size):
            raise FairseqExtError(
                f"the BERT input in {self.cfg.data} was prepared with a tokenizer of {meta['vocab_size']} ids "
                f"({meta['bert_model_name']}) but the model's BERT has {vocab.vocab_size}; rerun "
                "python -m fairseq_ext.scripts.bert_prepare with the same --bert-model-name")
        return model
