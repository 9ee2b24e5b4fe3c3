"""Hostile and wrong inputs through the real command-line tools (``python -m fairseq_cli.<tool> --user-dir``):
each fails with exit != 0 and one clear last line ``error: ...`` naming the flag or file and
what to do (no traceback), and nothing is written over good files; inputs that are merely unusual (empty and
whitespace-only lines, a sentence longer than BERT's positions) are processed with every line kept.

Already covered elsewhere, not repeated here: a SAT checkpoint decoded with ``--task translation``
(test_sat.py::test_cli_generate_and_interactive), a checkpoint that pickles code and a truncated checkpoint
under fairseq-generate (test_checkpoints.py), and the in-process flag checks of each model.

All CLI runs are prepared first and run two at a time in one module fixture (each costs a Python start-up).
"""

import hashlib
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import TINY_TRANSFORMER
from tests.helpers import USER_DIR, assert_one_line_error, create_dummy_data, run_cli

TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "8", "--decoder-embed-dim", "8",
        "--encoder-ffn-embed-dim", "8", "--decoder-ffn-embed-dim", "8", "--encoder-attention-heads", "1",
        "--decoder-attention-heads", "1"]
COMMON = ["--optimizer", "adam", "--lr", "0.001", "--max-tokens", "300", "--max-update", "2", "--no-progress-bar",
          "--num-workers", "0", "--user-dir", USER_DIR, "--source-lang", "in", "--target-lang", "out",
          "--disable-validation", "--seed", "1"]
LANG = ["--source-lang", "in", "--target-lang", "out", "--user-dir", USER_DIR, "--num-workers", "0"]
# line 1 empty, lines 2 and 3 whitespace only
INTERACTIVE_INPUT = "h e l l o\n\n   \n\t \na b c\n"


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _tree(directory):
    """{relative path: sha256} of every file under directory (empty if it does not exist)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            p = os.path.join(root, name)
            out[os.path.relpath(p, directory)] = _digest(p)
    return out


def _write_tokenizer_mismatch(good, bad):
    """A copy of the tiny BERT whose tokenizer files belong to another model (100 more WordPiece ids)."""
    shutil.copytree(good, bad)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(bad, name)):
            os.remove(os.path.join(bad, name))
    with open(os.path.join(bad, "vocab.txt"), "a") as f:
        f.write("\n".join(f"extra{i}" for i in range(100)) + "\n")


def write_short_bert(path):
    """tests/bert_jam/test_bert_jam.py's tiny random BERT with 12 positions (many dummy sentences are longer)."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    from tests.builders import BERT_LETTERS as LETTERS

    os.makedirs(path)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(LETTERS) + ["##" + c for c in LETTERS]
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=16, max_position_embeddings=12)).save_pretrained(path)
    BertTokenizer(os.path.join(path, "vocab.txt"), do_lower_case=True).save_pretrained(path)
    return path


def _raw_training_data(directory):
    """Dummy letters data as fairseq-preprocess --dataset-impl raw writes it (the text files and the
    dictionaries), written here: the runs that need no trained checkpoint start at once."""
    from fairseq.data import Dictionary

    os.makedirs(directory)
    create_dummy_data(directory, num_examples=40, maxlen=20, splits=("train", "valid"))
    d = Dictionary()
    for c in "abcdefghijklmnopqrstuvwxyz":
        d.add_symbol(c)
    for lang in ("in", "out"):
        d.save(os.path.join(directory, f"dict.{lang}.txt"))
        for split in ("train", "valid"):
            os.rename(os.path.join(directory, f"{split}.{lang}"), os.path.join(directory, f"{split}.in-out.{lang}"))
    return directory


def _dependent_inputs(w, data, ckpt, before):
    """Inputs made from the trained transformer's data directory and checkpoint."""
    # a data directory whose source dictionary is not the checkpoint's (fewer symbols)
    other = os.path.join(w, "other_dict")
    os.makedirs(other)
    for name in os.listdir(data):
        if name.startswith("valid.") or name == "dict.out.txt":
            shutil.copy(os.path.join(data, name), other)
    with open(os.path.join(data, "dict.in.txt")) as f, open(os.path.join(other, "dict.in.txt"), "w") as g:
        g.writelines(f.readlines()[:10])
    before["other"] = _tree(other)

    # raw text with empty and whitespace-only lines (same line numbers on both sides, and one-sided ones)
    raw = os.path.join(w, "raw")
    os.makedirs(raw)
    src = ["h e l l o", "", "   ", "a b c", "\t", "d e f", "x y"]
    tgt = ["i f m m p", "", " ", "b c d", "e", "", "y z"]
    open(os.path.join(raw, "test.in"), "w").write("\n".join(src) + "\n")
    open(os.path.join(raw, "test.out"), "w").write("\n".join(tgt) + "\n")
    # what fairseq-preprocess --dataset-impl raw --srcdict/--tgtdict writes (copies of the text files and of
    # the dictionaries), written here to save one start-up
    os.makedirs(os.path.join(raw, "bin"))
    for lang in ("in", "out"):
        shutil.copy(os.path.join(raw, f"test.{lang}"), os.path.join(raw, "bin", f"test.in-out.{lang}"))
        shutil.copy(os.path.join(data, f"dict.{lang}.txt"), os.path.join(raw, "bin"))

    # a save directory whose checkpoint_last.pt is corrupted: training must not resume from it nor replace it
    resume = os.path.join(w, "resume")
    os.makedirs(resume)
    good = open(ckpt, "rb").read()
    open(os.path.join(resume, "checkpoint_last.pt"), "wb").write(good[: len(good) // 3])
    before["resume"] = _tree(resume)

    return other, raw, resume, src


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    w = str(tmp_path_factory.mktemp("hostile"))
    text = _raw_training_data(os.path.join(w, "text"))
    before = {"text": _tree(text)}

    # BERT directories: a real tiny BERT (12 positions: many dummy sentences are longer), a missing one, one
    # that is not a saved model, one whose tokenizer does not belong to the model
    bert = write_short_bert(os.path.join(w, "bert"))
    not_bert = os.path.join(w, "not_bert")
    os.makedirs(not_bert)
    open(os.path.join(not_bert, "README"), "w").write("not a model\n")
    bert_mismatch = os.path.join(w, "bert_mismatch")
    _write_tokenizer_mismatch(bert, bert_mismatch)

    def train(save, flags, task="translation"):
        return lambda: run_cli("train", [text, "--task", task, "--save-dir", os.path.join(w, save), "--dataset-impl",
                                         "raw"] + COMMON + flags, check=False)

    bert_flags = ["--arch", "bert_jam", "--bert-jam-phase", "1"] + TINY
    independent = {
        "bert_long": train("bert_long", bert_flags + ["--bert-model-name", bert, "--max-update", "1"],
                           "translation_bert"),
        "sat_k0": train("sat_k0", ["--arch", "sat_transformer", "--sat-group-size", "0"] + TINY, "translation_sat"),
        "sat_k_big": train("sat_k_big", ["--arch", "sat_transformer", "--sat-group-size", "9",
                                         "--max-target-positions", "8"] + TINY, "translation_sat"),
        "msc": train("msc", ["--arch", "msc_transformer_iwslt_de_en", "--encoder-blocks", "3", "--encoder-layers", "7",
                             "--encoder-embed-dim", "8", "--decoder-embed-dim", "8"]),
        "bert_missing": train("bert_missing", bert_flags + ["--bert-model-name", os.path.join(w, "missing")],
                              "translation_bert"),
        "bert_not_bert": train("bert_not_bert", bert_flags + ["--bert-model-name", not_bert], "translation_bert"),
        "bert_tokenizer": train("bert_tokenizer", bert_flags + ["--bert-model-name", bert_mismatch],
                                "translation_bert"),
    }
    pool = ThreadPoolExecutor(2)
    try:
        futures = {name: pool.submit(job) for name, job in independent.items()}
        # meanwhile (in this thread): the trained transformer shared with other test modules
        data = request.getfixturevalue("tiny_transformer_dir")  # dummy data, binarised, and a checkpoint
        ckpt = os.path.join(data, "checkpoint_last.pt")
        before["data"] = _tree(data)
        other, raw, resume, src = _dependent_inputs(w, data, ckpt, before)
        dependent = {
            "raw": lambda: run_cli("generate", [os.path.join(raw, "bin"), "--path", ckpt, "--dataset-impl", "raw",
                                                "--gen-subset", "test", "--beam", "2", "--max-len-b", "4",
                                                "--batch-size", "3"] + LANG, check=False),
            "interactive": lambda: run_cli("interactive", [data, "--path", ckpt, "--beam", "2", "--max-len-b", "4",
                                                           "--buffer-size", "2"] + LANG, input=INTERACTIVE_INPUT,
                                           check=False),
            "dict": lambda: run_cli("generate", [other, "--path", ckpt, "--gen-subset", "valid", "--beam", "2"] + LANG,
                                    check=False),
            "resume": lambda: run_cli("train", [data, "--arch", "transformer_iwslt_de_en", "--save-dir", resume]
                                      + TINY + COMMON, check=False),
            "resume_dict": lambda: run_cli("train", [other, "--arch", "transformer_iwslt_de_en", "--save-dir",
                                                     os.path.join(w, "resume_dict"), "--restore-file", ckpt]
                                           + TINY_TRANSFORMER + COMMON, check=False),
        }
        futures.update({name: pool.submit(job) for name, job in dependent.items()})
        results = {name: f.result() for name, f in futures.items()}
    finally:
        pool.shutdown(wait=True)
    return {"w": w, "data": data, "ckpt": ckpt, "before": before, "results": results, "raw_src": src}


def assert_nothing_written(runs, save):
    """The run wrote no checkpoint (its save directory holds no file) and its data directory is unchanged."""
    assert _tree(os.path.join(runs["w"], save)) == {}
    assert _tree(os.path.join(runs["w"], "text")) == runs["before"]["text"]


# ------------------------------------------------------------------------------------------------ SAT

def test_sat_group_size_below_one(runs):
    assert_one_line_error(runs["results"]["sat_k0"], "--sat-group-size must be a positive integer (got 0)")
    assert_nothing_written(runs, "sat_k0")


def test_sat_group_size_larger_than_max_target_positions(runs):
    assert_one_line_error(runs["results"]["sat_k_big"], "--sat-group-size 9 is larger than --max-target-positions 8",
                          "use a smaller K")
    assert_nothing_written(runs, "sat_k_big")


# ------------------------------------------------------------------------------------------------ MSC

def test_msc_layer_count_that_does_not_split_into_the_blocks(runs):
    assert_one_line_error(runs["results"]["msc"], "--encoder-layers 7 disagrees with --encoder-blocks 3",
                          "set the depth with the block flags only")
    assert_nothing_written(runs, "msc")


# ------------------------------------------------------------------------------------------------ BERT-JAM

def test_bert_jam_missing_model_directory(runs):
    missing = os.path.join(runs["w"], "missing")
    assert_one_line_error(runs["results"]["bert_missing"], f"--bert-model-name {missing}: no such directory",
                          "config.json")
    assert_nothing_written(runs, "bert_missing")


def test_bert_jam_directory_that_is_not_a_bert_model(runs):
    assert_one_line_error(runs["results"]["bert_not_bert"], "--bert-model-name", "has no config.json",
                          "save_pretrained")
    assert_nothing_written(runs, "bert_not_bert")


def test_bert_jam_tokenizer_that_does_not_match_the_model(runs):
    # the fast tokenizer file removed: the slow one reads the extended vocab.txt (157 ids, model: 57)
    assert_one_line_error(runs["results"]["bert_tokenizer"], "--bert-model-name", "its tokenizer has 157 ids",
                          "vocabulary has 57", "do not belong to this model")
    assert_nothing_written(runs, "bert_tokenizer")


def test_bert_jam_sentences_longer_than_bert_are_truncated_with_a_warning(runs):
    """Training on sentences longer than BERT's 12 positions: BERT's input is cut to its limit (keeping the
    closing [SEP]) with a warning, and training goes on."""
    train = runs["results"]["bert_long"]
    assert train.returncode == 0 and "Traceback" not in train.stderr, train.stderr[-3000:]
    log = train.stdout + train.stderr
    assert re.search(r"BERT input longer than 12 tokens truncated \(\d+ sentence\(s\) so far\)", log), log[-2000:]
    assert re.search(r"num_updates 1\b|\"num_updates\": \"1\"", log), log[-2000:]
    assert os.path.isfile(os.path.join(runs["w"], "bert_long", "checkpoint_last.pt"))


# ------------------------------------------------------------------------------------------------ empty lines

def _assert_every_interactive_line_translated(stdout, n_lines):
    """fairseq-interactive translates an empty or whitespace-only line as a sentence of no words (source =
    EOS alone): one S/H/P triple per input line, in order, ids aligned with the input lines."""
    sources = {int(m.group(1)): m.group(2) for m in re.finditer(r"^S-(\d+)\t?(.*)$", stdout, re.M)}
    hyps = {int(m.group(1)) for m in re.finditer(r"^H-(\d+)\t-?[0-9.]+\t", stdout, re.M)}
    assert sorted(sources) == list(range(n_lines)) and sorted(hyps) == list(range(n_lines)), stdout[-2000:]
    assert sources[0] == "h e l l o" and sources[1] == sources[2] == sources[3] == ""


def test_interactive_empty_and_whitespace_only_lines(runs):
    proc = runs["results"]["interactive"]
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    _assert_every_interactive_line_translated(proc.stdout, 5)
    assert re.search(r"^S-4\ta b c$", proc.stdout, re.M)


def test_raw_text_with_empty_and_whitespace_only_lines(runs):
    """A --dataset-impl raw test set keeps empty and whitespace-only lines as empty sentences (line numbers
    stay aligned on both sides), and fairseq-generate translates every one of them."""
    gen = runs["results"]["raw"]
    assert gen.returncode == 0 and "Traceback" not in gen.stderr, gen.stderr[-3000:]
    src = runs["raw_src"]
    sources = {int(m.group(1)): m.group(2) for m in re.finditer(r"^S-(\d+)\t?(.*)$", gen.stdout, re.M)}
    hyps = {int(m.group(1)) for m in re.finditer(r"^H-(\d+)\t", gen.stdout, re.M)}
    assert sorted(sources) == sorted(hyps) == list(range(len(src)))
    assert {i: s for i, s in sources.items()} == {i: " ".join(line.split()) for i, line in enumerate(src)}
    assert re.search(rf"Translated {len(src)} sentences", gen.stdout + gen.stderr)


# ------------------------------------------------------------------------------------------------ checkpoints

def test_dictionary_that_does_not_match_the_checkpoint(runs):
    other = os.path.join(runs["w"], "other_dict")
    assert_one_line_error(runs["results"]["dict"],
                          f"source dictionary {os.path.join(other, 'dict.in.txt')} (14 symbols)",
                          f"does not match checkpoint {runs['ckpt']}", "encoder.embed_tokens.weight has 32 rows",
                          "--srcdict/--tgtdict")
    assert _tree(other) == runs["before"]["other"]
    assert _tree(runs["data"]) == runs["before"]["data"]  # the checkpoint is untouched


def test_training_does_not_resume_from_or_replace_a_corrupted_checkpoint(runs):
    path = os.path.join(runs["w"], "resume", "checkpoint_last.pt")
    assert_one_line_error(runs["results"]["resume"], f"checkpoint {path} is truncated or corrupted",
                          "use another checkpoint")
    assert _tree(os.path.join(runs["w"], "resume")) == runs["before"]["resume"]  # same bytes, nothing new


def test_training_resumed_with_a_dictionary_that_does_not_match_the_checkpoint(runs):
    other = os.path.join(runs["w"], "other_dict")
    assert_one_line_error(runs["results"]["resume_dict"],
                          f"source dictionary {os.path.join(other, 'dict.in.txt')} (14 symbols)",
                          f"does not match checkpoint {runs['ckpt']}", "--srcdict/--tgtdict")
    assert _tree(os.path.join(runs["w"], "resume_dict")) == {}  # nothing saved
    assert _tree(runs["data"]) == runs["before"]["data"]
