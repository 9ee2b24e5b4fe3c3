"""--bert-feature-cache (BERT-JAM phases 1-2): precomputed, memory-mapped BERT features give the same training
step as running BERT (eval mode), a cache of another run is refused with one line, phase 3 is refused, builds
are atomic and done once under concurrency; end to end through fairseq-train and fairseq-generate (slow)."""

import argparse
import glob
import os
import pickle
import shutil
import threading

import numpy as np
import pytest
import torch

import fairseq_ext  # noqa: F401  (registration)
from fairseq_ext.bert_jam import feature_cache
from fairseq_ext.bert_jam.task import TranslationBertConfig, TranslationBertTask
from fairseq_ext.common.errors import FairseqExtError
from tests.builders import TINY_BERT_LAYERS, write_tiny_bert
from tests.helpers import assert_close, create_dummy_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return write_tiny_bert(str(tmp_path_factory.mktemp("tinybert")))


def _binarise(d, seed):
    from fairseq import options
    from fairseq_cli import preprocess


    create_dummy_data(d, num_examples=20, maxlen=8, seed=seed)
    preprocess.main(options.get_preprocessing_parser().parse_args([
        "--source-lang", "in", "--target-lang", "out", "--trainpref", f"{d}/train", "--validpref", f"{d}/valid",
        "--testpref", f"{d}/test", "--destdir", d, "--workers", "1", "--srcdict", _letters(d),
        "--tgtdict", _letters(d)]))
    return d


def _letters(d):
    path = os.path.join(d, "letters.txt")
    with open(path, "w") as f:
        f.write("".join(f"{chr(ord('a') + i)} 1\n" for i in range(26)))
    return path


@pytest.fixture(scope="module")
def letters_bin(tiny_bert, tmp_path_factory):
    """Two binarised letter corpora (other sentences, same dictionaries), BERT-prepared in-process."""
    from fairseq_ext.bert_jam import prepare

    out = []
    for seed in (0, 3):
        d = _binarise(str(tmp_path_factory.mktemp(f"letters{seed}")), seed)
        prepare.main([d, "-s", "in", "-t", "out", "--bert-model-name", tiny_bert, "--trainpref", f"{d}/train",
                      "--validpref", f"{d}/valid", "--testpref", f"{d}/test"])
        out.append(d)
    return out


def task_for(data, bert, cache, dtype="float32", layers="auto"):
    return TranslationBertTask.setup_task(TranslationBertConfig(
        data=data, bert_model_name=bert, source_lang="in", target_lang="out", dataset_impl="mmap",
        required_seq_len_multiple=1, train_subset="train", bert_feature_cache=cache,
        bert_feature_cache_dtype=dtype, bert_feature_cache_layers=layers))


def model_args(phase, composition="glu"):
    return argparse.Namespace(arch="bert_jam", encoder_embed_dim=32, encoder_ffn_embed_dim=48,
                              encoder_attention_heads=4, encoder_layers=2, decoder_layers=2, decoder_embed_dim=32,
                              decoder_ffn_embed_dim=48, decoder_attention_heads=4, bert_jam_phase=phase,
                              bert_composition=composition, dropout=0.0, attention_dropout=0.0,
                              share_all_embeddings=True)


def build(task, phase, **kw):
    torch.manual_seed(1)
    return task.build_model(model_args(phase, **kw))


def step(model, net_input, target, pad):
    """Loss and gradients of one training step (NMT dropout 0; BERT, when it runs, in eval mode)."""
    model.zero_grad()
    model.train()
    model.encoder.bert.eval()
    out = model(**net_input)
    lprobs = model.get_normalized_probs(out, log_probs=True)
    loss = torch.nn.functional.nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1), ignore_index=pad,
                                        reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("phase", [1, 2])
def test_cached_features_give_the_same_training_step_as_running_bert(letters_bin, tiny_bert, tmp_path, phase):
    task = task_for(letters_bin[0], tiny_bert, str(tmp_path / "cache"))
    model = build(task, phase)  # builds the training split's cache (fairseq-train loads it after the model)
    assert sorted(os.listdir(tmp_path / "cache")) == [".lock", "train.json", "train.npy"]
    task.load_dataset("train")
    task.load_dataset("valid")  # built when loaded
    ds = task.datasets["train"]
    sample = ds.collater([ds[i] for i in range(len(ds))])
    ni = sample["net_input"]
    feats = ni["bert_out"]
    L, C = TINY_BERT_LAYERS, 16
    assert feats.dtype == torch.float32
    assert feats.shape == ni["bert_input"].shape + ((C,) if phase == 1 else (C, L))  # phase 1: B_L only
    if phase == 2:  # non-trivial (trainable) compositions
        with torch.no_grad():
            for comp in model.compositions():
                for p in comp.parameters():
                    p.add_(torch.randn_like(p) * 0.3)
    pad = task.target_dictionary.pad()
    calls = []
    hook = model.encoder.bert.register_forward_hook(lambda *a: calls.append(1))
    loss_c, grads_c = step(model, ni, sample["target"], pad)
    assert calls == []  # BERT did not run
    live = {k: v for k, v in ni.items() if k != "bert_out"}
    loss_l, grads_l = step(model, live, sample["target"], pad)
    assert calls == [1]
    hook.remove()
    assert_close(loss_c, loss_l, atol=1e-6 * max(1.0, loss_l.abs().item()), msg="loss")
    assert grads_c.keys() == grads_l.keys() and any(".bert_composition." in n for n in grads_c) == (phase == 2)
    for n in grads_c:
        assert_close(grads_c[n], grads_l[n], atol=1e-6, msg=n)
    # the rows are BERT's eval-mode features of each sentence
    with torch.no_grad():
        enc = model.encoder
        enc.bert.eval()
        ref, mask = enc.forward_bert(ni["bert_input"])
    assert_close(feats.transpose(0, 1)[~mask.t()], ref[~mask.t()], atol=1e-5, msg="cached rows")
    # the finding: live, the frozen BERT runs in train mode, so with its dropout (the official code does the
    # same); the cache holds eval-mode features
    enc.bert.train()
    with torch.no_grad():
        noisy, _ = enc.forward_bert(ni["bert_input"])
    assert not torch.allclose(noisy, ref)
    # valid got its own cache
    assert task.datasets["valid"].collater([task.datasets["valid"][0]])["net_input"]["bert_out"].shape[-1] == \
        (C if phase == 1 else L)


def test_float16_default_and_a_stale_cache_is_refused(letters_bin, tiny_bert, tmp_path):
    cache = str(tmp_path / "p1")
    task = task_for(letters_bin[0], tiny_bert, cache, dtype="float16")
    build(task, 1)
    task.load_dataset("train")
    meta = feature_cache.np.load(os.path.join(cache, "train.npy"), mmap_mode="r")
    assert meta.dtype == np.float16 and meta.ndim == 2
    assert TranslationBertConfig().bert_feature_cache_dtype == "float16"
    # reopened by another run with the same key: used as it is (not rebuilt)
    mtime = os.path.getmtime(os.path.join(cache, "train.npy"))
    build(task_for(letters_bin[0], tiny_bert, cache, dtype="float16"), 1)
    assert os.path.getmtime(os.path.join(cache, "train.npy")) == mtime

    def refused(match, data=letters_bin[0], bert=tiny_bert, dtype="float16", phase=1):
        with pytest.raises(FairseqExtError, match=r"^--bert-feature-cache " + cache + ".*train.*" + match):
            build(task_for(data, bert, cache, dtype=dtype), phase)

    refused(r"the BERT layers stored .*: last there, all here", phase=2)
    refused(r"the dtype \(--bert-feature-cache-dtype\): float16 there, float32 here", dtype="float32")
    other_bert = write_tiny_bert(str(tmp_path / "otherbert"), seed=5)
    refused(r"the BERT weights \(sha256 of --bert-model-name\)", bert=other_bert)
    refused(r"the prepared BERT ids of the split", data=letters_bin[1])
    # a message is one line
    with pytest.raises(FairseqExtError) as e:
        build(task_for(letters_bin[1], tiny_bert, cache), 2)
    assert "\n" not in str(e.value) and "layers stored" in str(e.value) and "dtype" in str(e.value)


def test_phase_3_is_refused_and_features_must_fit_the_model(letters_bin, tiny_bert, tmp_path):
    with pytest.raises(FairseqExtError, match=r"--bert-feature-cache .*phase 3"):
        build(task_for(letters_bin[0], tiny_bert, str(tmp_path / "c")), 3)
    assert not os.path.exists(tmp_path / "c" / "train.npy")
    # the encoder itself: no precomputed features in phase 3, and B_L alone does not feed phase 2
    task = task_for(letters_bin[0], tiny_bert, None)
    task.load_dataset("valid")
    ds = task.datasets["valid"]
    ni = ds.collater([ds[i] for i in range(3)])["net_input"]
    B, T = ni["bert_input"].shape
    for phase, feats, match in ((3, torch.zeros(B, T, 16), "phase 3"),
                                (2, torch.zeros(B, T, 16), "--bert-feature-cache-layers all")):
        model = build(task, phase)
        with pytest.raises(FairseqExtError, match=match):
            model.encoder(ni["src_tokens"], bert_input=ni["bert_input"], bert_out=feats)
    # every layer feeds phase 1 too (its last one is taken)
    model = build(task, 1)
    model.eval()
    with torch.no_grad():
        every = torch.randn(B, T, 16, TINY_BERT_LAYERS)
        a = model.encoder(ni["src_tokens"], bert_input=ni["bert_input"], bert_out=every)["encoder_out"][0]
        b = model.encoder(ni["src_tokens"], bert_input=ni["bert_input"], bert_out=every[..., -1])["encoder_out"][0]
    assert torch.equal(a, b)


def test_build_is_atomic_and_done_once_when_two_start_at_once(letters_bin, tiny_bert, tmp_path, monkeypatch):
    cache = str(tmp_path / "c")
    task = task_for(letters_bin[0], tiny_bert, cache)
    original = feature_cache.compute

    def killed(*a, **k):
        original(*a, **k)
        raise KeyboardInterrupt  # the run is killed after writing the features, before the rename
    monkeypatch.setattr(feature_cache, "compute", killed)
    with pytest.raises(KeyboardInterrupt):
        build(task, 1)
    assert sorted(os.listdir(cache)) == [".lock"]  # no half cache, no temporary file
    open(os.path.join(cache, ".train.999999.tmp.npy"), "w").close()  # what a SIGKILLed build leaves
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return original(*a, **k)
    monkeypatch.setattr(feature_cache, "compute", counted)
    model = build(task, 1)
    task.load_dataset("train")  # fairseq's order: the model first, then the training split
    encoder, layers = task._feature_source
    ids = task.datasets["train"].bert
    key = feature_cache.make_key(encoder.bert_digest(), layers, "float32", 16, TINY_BERT_LAYERS,
                                 encoder.bert_pad_id, ids.sizes, task.datasets["train"].cache_shards[2])
    calls.clear()
    out, errors = [], []

    def rank():
        try:
            out.append(feature_cache.open_or_build(cache, "valid_twice", key, model.encoder.bert, ids, ids.sizes))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=rank) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(out) == 2 and len(calls) == 1
    assert np.array_equal(out[0].rows(3), out[1].rows(3))
    copy = pickle.loads(pickle.dumps(out[0]))  # as sent to a data-loader worker: reopens the memory map
    assert copy._mm is None and np.array_equal(copy.rows(3), out[0].rows(3))
    assert not glob.glob(os.path.join(cache, "*tmp*"))


@pytest.mark.slow
@pytest.mark.parametrize("decoder, init_layer", [("joint", 0), ("standard", 0), ("joint", 1)])
def test_fairseq_train_with_the_cache_then_generate(letters_bin, tiny_bert, tmp_path, decoder, init_layer):
    """Phase 1 on the feature cache through fairseq-train, then fairseq-generate; with the paper's decoder and with
    fairseq's (--bert-jam-decoder standard), which the checkpoint records; and reading BERT's first layer
    (--bert-jam-init-layer 1), for which the cache holds every layer."""
    from fairseq_ext.checkpoints import load_checkpoint_file
    from tests.helpers import ROOT, hypotheses, run_cli, train_args

    d = str(tmp_path / "bin")
    shutil.copytree(letters_bin[0], d)
    cache = str(tmp_path / "cache")
    model = ["--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "48",
             "--decoder-ffn-embed-dim", "48", "--encoder-layers", "2", "--decoder-layers", "2",
             "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings"]
    train = run_cli("train", train_args(d, "bert_jam", model + [
        "--bert-model-name", tiny_bert, "--bert-jam-phase", "1", "--bert-feature-cache", cache,
        "--max-update", "3", "--max-epoch", "3", "--save-dir", f"{d}/ckpt", "--no-epoch-checkpoints",
        "--optimizer", "adam", "--lr", "0.001", "--bert-jam-decoder", decoder]
        + (["--bert-jam-init-layer", str(init_layer)] if init_layer else []), task="translation_bert")).stdout
    assert f"BERT feature cache: computing {'all' if init_layer else 'last'} layer(s)" in train
    assert sorted(f for f in os.listdir(cache) if not f.startswith(".")) == [
        "train.json", "train.npy", "valid.json", "valid.npy"]
    gen = run_cli("generate", [d, "--task", "translation_bert", "--user-dir", os.path.join(ROOT, "fairseq_ext"),
                               "--source-lang", "in", "--target-lang", "out", "--path", f"{d}/ckpt/checkpoint_last.pt",
                               "--gen-subset", "test", "--beam", "2", "--max-len-b", "5", "--batch-size", "8",
                               "--num-workers", "0"]).stdout
    assert len(hypotheses(gen)) == 20
    state = load_checkpoint_file(f"{d}/ckpt/checkpoint_last.pt")
    assert state["cfg"]["model"].bert_jam_decoder == decoder
    assert state["cfg"]["model"].bert_jam_init_layer == init_layer
    alpha = state["model"]["encoder.layers.0.bert_composition.alpha"].tolist()
    assert alpha.index(1.0) == (init_layer or len(alpha)) - 1 and sum(alpha) == 1.0  # phase 1: frozen at Eq. 11
    layer_keys = [k for k in state["model"] if k.startswith("decoder.layers.0.")]
    # the paper's layer: composed BERT layers and a joint attention over them; fairseq's: self-attention
    assert any(".bert_attn." in k for k in layer_keys) == (decoder == "joint")
    assert any(".self_attn." in k for k in layer_keys) == (decoder == "standard")


@pytest.mark.parametrize("recipe", ["iwslt14_de_en", "wmt14_en_de"])
def test_recipes_use_the_cache_in_phases_1_and_2_when_asked(recipe, tmp_path):
    import shlex
    import subprocess

    from fairseq import options

    from tests.helpers import ROOT

    def phases(env):
        out = subprocess.run(["bash", os.path.join(ROOT, "recipes", "bert_jam", f"{recipe}.sh"), "--dry-run"],
                             capture_output=True, text=True, check=True, cwd=ROOT, env=dict(os.environ, **env)).stdout
        lines = [shlex.split(x) for x in out.splitlines() if x.startswith("fairseq-train")]
        return [options.parse_args_and_arch(options.get_training_parser(), x[1:]).bert_feature_cache for x in lines]

    assert phases({"BERT_FEATURE_CACHE": ""}) == [None, None, None]  # opt-in
    cache = str(tmp_path / "feats")
    assert phases({"BERT_FEATURE_CACHE": cache}) == [f"{cache}/phase1", f"{cache}/phase2", None]
