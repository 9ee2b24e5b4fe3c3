"""BERT inside BERT-JAM: loading a Hugging Face BERT offline (config, tokenizer, weights), the checks that its
tokenizer and prepared inputs belong to it, and the one path from fairseq source tokens to BERT ids.

A BERT directory (``--bert-model-name``, or the path a checkpoint recorded when the flag is not given) is data,
never code: every ``from_pretrained`` passes ``trust_remote_code=False`` and ``local_files_only=True`` (nothing is
downloaded), and before transformers reads it, :func:`check_bert_directory` refuses a ``config.json`` or
``tokenizer_config.json`` with an ``auto_map`` (custom classes that transformers would import from the directory
and run; without ``trust_remote_code=False`` it asks "run the custom code?" with ``input()``, which under
``fairseq-interactive`` reads the user's own sentences) and a ``model_type`` that transformers does not know. The
path in use is logged. Not covered: the weights are data a model computes with (a BERT of the right shape but
other weights changes the translations; phase 1-2 checkpoints check its sha256).

``transformers`` is imported lazily (inside functions), never at package import time.
"""

import functools
import json
import logging
import os
import re
from typing import List

import torch
from fairseq.data import data_utils

from fairseq_ext.common.errors import FairseqExtError

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------
# loading BERT's tokenizer / config / weights offline
# --------------------------------------------------------------------------------------------------------

def bert_load_error(name, what, exc):
    name_s = str(name)
    if (os.path.isabs(name_s) or name_s.startswith(".") or name_s.count("/") > 1) and not os.path.exists(name_s):
        return FairseqExtError(
            f"--bert-model-name {name}: no such directory (the flag's value, or the path recorded in the "
            "checkpoint when the flag is not given); give a local directory holding config.json, the weights and "
            "the tokenizer files of a BERT-architecture model (this runs offline, nothing is downloaded)")
    if os.path.isdir(name_s) and not os.path.isfile(os.path.join(name_s, "config.json")):
        return FairseqExtError(
            f"--bert-model-name {name}: the directory has no config.json, so it is not a saved BERT model; give "
            "a directory written by save_pretrained (config.json, the weights and the tokenizer files)")
    return FairseqExtError(
        f"--bert-model-name {name}: cannot load the BERT {what} ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else ''}); give a local directory holding config.json, the "
        "weights and the tokenizer files (this runs offline, nothing is downloaded)"
    )


# what every from_pretrained of a BERT directory gets: no code from the directory, nothing downloaded
OFFLINE_DATA_ONLY = {"trust_remote_code": False, "local_files_only": True}


def _bert_file(name, filename):
    """The path of ``filename`` of the BERT ``name`` (a directory, or a name in the local Hugging Face cache), or
    None where there is none."""
    if os.path.isdir(str(name)):
        path = os.path.join(str(name), filename)
        return path if os.path.isfile(path) else None
    try:
        from transformers.utils import cached_file

        return cached_file(str(name), filename, local_files_only=True, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    except Exception:  # noqa: BLE001 - not in the cache: from_pretrained says so below
        return None


def check_bert_directory(name):
    """Refuse (one line) a BERT whose config.json or tokenizer_config.json asks transformers to run code from the
    directory (``auto_map``), or whose ``model_type`` transformers does not know (module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for filename in ("config.json", "tokenizer_config.json"):
        path = _bert_file(name, filename)
        if path is None:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                content = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FairseqExtError(f"BERT {name}: {filename} is not readable JSON ({type(exc).__name__}); give a "
                                  "directory written by save_pretrained") from None
        if not isinstance(content, dict):
            raise FairseqExtError(f"BERT {name}: {filename} is not a JSON object; give a directory written by "
                                  "save_pretrained")
        if "auto_map" in content:
            raise FairseqExtError(
                f"refusing BERT {name}: its {filename} has an auto_map, i.e. custom code that transformers would "
                "import from the directory and run; BERT-JAM loads transformers' own architectures only and never "
                "runs code from a model directory (use a BERT saved by transformers' BertModel.save_pretrained)")
        if filename == "config.json" and content.get("model_type") not in CONFIG_MAPPING:
            raise FairseqExtError(
                f"refusing BERT {name}: config.json has model_type {str(content.get('model_type'))[:40]!r}, which "
                "transformers does not know; give a BERT-architecture model (model_type 'bert' or another of "
                "transformers' own)")


def load_bert_tokenizer(name):
    if not name:
        raise FairseqExtError("--bert-model-name is required with --task translation_bert / --arch bert_jam*: "
                              "give the directory (or cached name) of a BERT-architecture model")
    from transformers import AutoTokenizer  # lazy: slow import

    check_bert_directory(name)
    try:
        tok = AutoTokenizer.from_pretrained(name, **OFFLINE_DATA_ONLY)
    except Exception as exc:  # noqa: BLE001 - one line for the user
        raise bert_load_error(name, "tokenizer", exc) from None
    if tok.pad_token_id is None:
        raise FairseqExtError(f"--bert-model-name {name}: its tokenizer has no pad token; BERT-JAM needs a "
                              "BERT-architecture tokenizer ([PAD]/[CLS]/[SEP])")
    return tok


@functools.lru_cache(maxsize=8)
def load_bert_config(name):
    """The model's config (cached: the model, the input builder and the checks read the same one)."""
    from transformers import AutoConfig

    check_bert_directory(name)
    try:
        return AutoConfig.from_pretrained(name, **OFFLINE_DATA_ONLY)
    except Exception as exc:  # noqa: BLE001
        raise bert_load_error(name, "config", exc) from None


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

    The same object serves ``python -m fairseq_ext.bert_jam.prepare`` (once, offline) and the model (on the fly when
    a batch has no ``bert_input``), so prepared and derived inputs are identical."""

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

# --------------------------------------------------------------------------------------------------------
# the BERT model and the checks that tokenizer and prepared input belong to it
# --------------------------------------------------------------------------------------------------------

def build_bert(name, from_checkpoint=False):
    """The BERT model without its pooler (never used, so never trained or synchronised). From a checkpoint
    only the architecture is built: the weights come from the checkpoint (fine-tuned in phase 3)."""
    from transformers import AutoModel  # lazy: slow import

    config = load_bert_config(name)
    where = os.path.abspath(str(name)) if os.path.isdir(str(name)) else f"{name} (local Hugging Face cache)"
    logger.info(f"BERT-JAM: BERT {'architecture' if from_checkpoint else 'weights'} from {where} (--bert-model-name, "
                "or the path recorded in the checkpoint when that flag is not given)")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the (absent) pooler weights are reported as unexpected: expected
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        try:
            bert = (AutoModel.from_config(config, add_pooling_layer=False) if from_checkpoint
                    else AutoModel.from_pretrained(name, add_pooling_layer=False, **OFFLINE_DATA_ONLY))
        except TypeError:  # a BERT-like model without a pooler argument
            bert = (AutoModel.from_config(config) if from_checkpoint
                    else AutoModel.from_pretrained(name, **OFFLINE_DATA_ONLY))
    except FairseqExtError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise bert_load_error(name, "model", exc) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    if getattr(bert, "pooler", None) is not None:
        bert.pooler = None
    return bert.float()


def check_tokenizer_fits(name, tokenizer, config):
    """The tokenizer files of --bert-model-name must belong to its model: ids within the vocabulary, same pad."""
    n_ids, vocab = len(tokenizer), int(getattr(config, "vocab_size", 0) or 0)
    if vocab and n_ids > vocab:
        raise FairseqExtError(
            f"--bert-model-name {name}: its tokenizer has {n_ids} ids but the BERT model's vocabulary has {vocab} "
            f"(config.json vocab_size): the tokenizer files do not belong to this model; put the tokenizer saved "
            f"with the model in that directory")
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and tokenizer.pad_token_id is not None and int(pad) != int(tokenizer.pad_token_id):
        raise FairseqExtError(
            f"--bert-model-name {name}: its tokenizer pads with id {tokenizer.pad_token_id} but the model's "
            f"config.json says pad_token_id {pad}: the tokenizer files do not belong to this model; put the "
            f"tokenizer saved with the model in that directory")


def check_prepared_input_fits(meta, config, data):
    """BERT input prepared by ``python -m fairseq_ext.bert_jam.prepare`` (its ``meta``) must hold ids of the
    model's BERT vocabulary (``config``)."""
    if meta is not None and config is not None and int(meta["vocab_size"]) > int(config.vocab_size):
        raise FairseqExtError(
            f"the BERT input in {data} was prepared with a tokenizer of {meta['vocab_size']} ids "
            f"({meta['bert_model_name']}) but the model's BERT has {config.vocab_size}; rerun "
            "python -m fairseq_ext.bert_jam.prepare with the same --bert-model-name")


def bert_content_sha256(bert) -> str:
    """SHA-256 of BERT's weights (names, dtypes, shapes and bytes of its state dict, sorted by name): what a phase
    1-2 checkpoint records instead of the weights, independent of the file format they were loaded from."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(bert.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# the settings of the BERT input that the prepared files and the model's own builder must share, each with the
# flag that sets it
INPUT_SETTINGS = {"remove_bpe": "--bert-remove-bpe", "detokenize": "--bert-detokenize",
                  "max_length": "--bert-max-length", "vocab_size": "--bert-model-name",
                  "pad_id": "--bert-model-name", "tokenizer_class": "--bert-model-name"}


def input_settings(meta):
    """The part of a :meth:`BertInputBuilder.meta` that decides the BERT ids (not the model's path)."""
    return {k: meta[k] for k in INPUT_SETTINGS if k in meta}


def check_input_settings(ours, theirs, ours_name, theirs_name):
    """One error line naming the flag of the first setting in which two BERT-input settings differ."""
    for k, flag in INPUT_SETTINGS.items():
        if k in ours and k in theirs and str(ours[k]) != str(theirs[k]):
            raise FairseqExtError(
                f"{flag}: {ours_name} has {k}={ours[k]} but {theirs_name} has {k}={theirs[k]}, so BERT would see "
                f"other input than in training; use the same {flag} for both (or rerun python -m "
                "fairseq_ext.bert_jam.prepare with it)")


# -- a frozen BERT in checkpoints: left out, and refilled from --bert-model-name if its hash matches --------
def leave_out_frozen_bert(module, state_dict, prefix, local_metadata):
    """State-dict post hook of the encoder: a frozen BERT is not saved (phases 1-2: it is the pre-trained one)."""
    if not module.bert_trainable:
        for k in [k for k in state_dict if k.startswith(prefix + "bert.")]:
            del state_dict[k]


def refill_frozen_bert(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs):
    """Load pre-hook of the encoder: a checkpoint without BERT (phases 1-2) gets this model's BERT, loaded from
    ``--bert-model-name``, if its weights have the content hash the checkpoint recorded."""
    key = prefix + "bert_sha256"
    if not any(k.startswith(prefix + "bert.") for k in state_dict):
        saved = state_dict.get(key)
        if saved is None:
            raise FairseqExtError("the checkpoint holds neither BERT's weights nor the hash of the pre-trained "
                                  "BERT it was trained with: it is not a bert_jam checkpoint of this version")
        saved = bytes(saved.long().tolist()).hex()
        here = module.bert_digest()
        if saved != here:
            raise FairseqExtError(
                f"--bert-model-name {module.args.bert_model_name}: its weights (sha256 {here[:16]}) are not the "
                f"pre-trained BERT this checkpoint was trained with (sha256 {saved[:16]}); phase 1-2 checkpoints do "
                "not hold BERT: give the directory of that BERT")
        for k, v in module.bert.state_dict().items():
            state_dict[prefix + "bert." + k] = v
    elif key not in state_dict:  # a checkpoint from before the hash: it holds BERT itself
        state_dict[key] = module.bert_sha256
