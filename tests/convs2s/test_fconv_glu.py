"""fconv_glu (ConvS2S): exact against fairseq's fconv, incremental decoding, checkpoints, and fairseq's own
fconv command-line tests (tests/test_binaries.py) through --user-dir."""

import argparse
import os
import re
import shutil
import warnings

import pytest
import torch

import fairseq_ext  # noqa: F401  (registration, safe checkpoint loading)
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.convs2s.model import FConvGluModel, upgrade_fconv_state_dict
from tests.builders import FCONV_ODD_SPEC as ODD_SPEC
from tests.builders import FconvTask as _Task
from tests.builders import fconv_args as _args
from tests.builders import fconv_pair as _pair
from tests.helpers import (
    assert_close,
    assert_one_line_error,
    create_dummy_data,
    generate_main,
    hypotheses,
    preprocess_translation_data,
    run_cli,
    run_module,
    train_translation_model,
)

ARCHS = ["", "_iwslt_de_en", "_wmt_en_ro", "_wmt_en_de", "_wmt_en_fr"]
def _batch(task, bsz=5, src_len=9, tgt_len=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    src = torch.randint(d.nspecial, len(d), (bsz, src_len), generator=g)
    for b in range(1, bsz):  # left-padded sources of different lengths, as fairseq's collater makes them
        src[b, : min(b, src_len - 1)] = d.pad()
    lengths = src.ne(d.pad()).sum(1)
    prev = torch.randint(d.nspecial, len(d), (bsz, tgt_len), generator=g)
    prev[:, 0] = d.eos()
    return src, lengths, prev


def _mapped_grads(model):
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    grads["decoder.version"] = torch.Tensor([2])  # parameters only: say it is today's layout (no version = 1)
    upgrade_fconv_state_dict(grads)
    return grads


# ------------------------------------------------------------------------------------------------------------
# registration and sizes
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ARCHS)
def test_architectures_have_fairseq_fconv_sizes(suffix):
    ref, ours = _args("fconv" + suffix), _args("fconv_glu" + suffix)
    assert ARCH_MODEL_REGISTRY["fconv_glu" + suffix] is FConvGluModel
    for k in ("encoder_embed_dim", "encoder_layers", "decoder_embed_dim", "decoder_layers",
              "decoder_out_embed_dim", "decoder_attention", "dropout", "share_input_output_embed"):
        assert getattr(ours, k) == getattr(ref, k), k


def test_parameter_count_and_names_match_fconv():
    task = _Task(100)
    ref, ours = _pair(task)
    n_ref = sum(p.numel() for p in ref.parameters())
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_ours == n_ref
    assert ours.encoder.grad_scale == 1.0 / (2 * 3)  # §3.4: 3 decoder attention layers in iwslt_de_en
    names = dict(ours.named_parameters())
    assert "decoder.layers.2.attention.in_projection.parametrizations.weight.original0" in names
    assert "encoder.layers.0.conv.parametrizations.weight.original1" in names


# ------------------------------------------------------------------------------------------------------------
# exactness against fairseq's fconv
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["iwslt", "odd_spec", "shared_embed"])
def test_logits_and_gradients_equal_fairseq_fconv(config):
    task = _Task()
    kw = {"iwslt": {}, "odd_spec": ODD_SPEC,
          "shared_embed": dict(decoder_out_embed_dim=256, share_input_output_embed=True)}[config]
    ref, ours = _pair(task, **kw)
    src, lengths, prev = _batch(task)
    ref.train()
    ours.train()  # training mode, dropout 0
    out_ref, _ = ref(src, lengths, prev)
    out_ours, _ = ours(src, lengths, prev)
    assert_close(out_ours, out_ref, 1e-5, "logits")
    w = torch.randn_like(out_ref)
    (out_ref * w).sum().backward()
    (out_ours * w).sum().backward()
    g_ref = _mapped_grads(ref)
    g_ours = {k: p.grad for k, p in ours.named_parameters()}
    assert set(g_ours) == set(g_ref)
    for k in g_ours:
        assert_close(g_ours[k], g_ref[k], 1e-5, f"grad {k}")
    # the encoder's gradient really is scaled (1/(2*3) here): not the zero or unscaled gradient
    assert g_ours["encoder.embed_tokens.weight"].abs().sum() > 0

    # eval mode: same logits and same alignment (mean attention over the layers)
    ref.eval()
    ours.eval()
    with torch.no_grad():
        (l_ref, a_ref), (l_ours, a_ours) = ref(src, lengths, prev), ours(src, lengths, prev)
    assert_close(l_ours, l_ref, 1e-5, "eval logits")
    if config != "odd_spec":  # fairseq divides the attention sum by all layers, also those without attention
        assert_close(a_ours, a_ref, 1e-6, "attention")
    else:
        assert_close(a_ours.sum(-1), torch.ones_like(a_ours.sum(-1)), 1e-5, "attention rows sum to 1")


def test_grad_scale_only_changes_backward():
    task = _Task()
    _, ours = _pair(task, **ODD_SPEC)
    src, lengths, prev = _batch(task)
    out = ours.encoder(src, lengths)["encoder_out"][0]
    z = out.detach().requires_grad_()
    w = torch.randn_like(out)
    (out * w).sum().backward()
    g_scaled = ours.encoder.fc2.parametrizations.weight.original1.grad.clone()
    ours.zero_grad()
    ours.encoder.grad_scale = 1.0
    (ours.encoder(src, lengths)["encoder_out"][0] * w).sum().backward()
    g_full = ours.encoder.fc2.parametrizations.weight.original1.grad
    assert_close(g_scaled, g_full / (2 * 3), 1e-6, "encoder grad scaled by 1/(2 * 3 attention layers)")
    assert z.shape == out.shape


# ------------------------------------------------------------------------------------------------------------
# incremental decoding
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["iwslt", "odd_spec"])
def test_incremental_decoding_equals_full_pass_and_reorders(config):
    task = _Task()
    _, model = _pair(task, **({} if config == "iwslt" else ODD_SPEC))
    model.eval()
    src, lengths, prev = _batch(task, tgt_len=8)
    bsz, T = prev.shape
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        full, full_attn = model.decoder(prev, enc)
        inc = {}
        for t in range(T):
            step, attn = model.decoder(prev[:, : t + 1], enc, incremental_state=inc)
            assert step.shape == (bsz, 1, full.size(-1))
            assert_close(step[:, 0], full[:, t], 1e-5, f"step {t}")
            assert_close(attn[:, 0], full_attn[:, t], 1e-5, f"attention step {t}")

        # reorder after 4 steps with a permutation (with a repeated row, as in beam search), then continue
        perm = torch.tensor([3, 0, 4, 4, 1])
        inc = {}
        for t in range(4):
            model.decoder(prev[:, : t + 1], enc, incremental_state=inc)
        model.decoder.reorder_incremental_state_scripting(inc, perm)  # what SequenceGenerator calls
        enc_p = model.encoder.reorder_encoder_out(enc, perm)
        prev_p = prev.index_select(0, perm)
        full_p, _ = model.decoder(prev_p, enc_p)
        for t in range(4, T):
            step, _ = model.decoder(prev_p[:, : t + 1], enc_p, incremental_state=inc)
            assert_close(step[:, 0], full_p[:, t], 1e-5, f"reordered step {t}")

        # the same through reorder_incremental_state called directly (each cache reordered exactly once)
        inc = {}
        for t in range(4):
            model.decoder(prev[:, : t + 1], enc, incremental_state=inc)
        model.decoder.reorder_incremental_state(inc, perm)
        step, _ = model.decoder(prev_p[:, :5], enc_p, incremental_state=inc)
        assert_close(step[:, 0], full_p[:, 4], 1e-5, "direct reorder")


def test_inference_weight_cache_follows_parameter_updates():
    task = _Task()
    ref, ours = _pair(task)
    ref.eval()
    ours.eval()
    src, lengths, prev = _batch(task)
    with torch.no_grad():
        before = ours(src, lengths, prev)[0]
        assert_close(before, ref(src, lengths, prev)[0], 1e-5, "eval")
        for m in (ref, ours):  # an in-place update as an optimizer step makes it
            for p in m.parameters():
                p.mul_(1.01)
        after = ours(src, lengths, prev)[0]
        assert (after - before).abs().max() > 1e-3
        assert_close(after, ref(src, lengths, prev)[0], 1e-5, "after update")
    ours.load_state_dict(ref.state_dict())  # load_state_dict also invalidates (copy_ bumps the version)
    with torch.no_grad():
        assert_close(ours(src, lengths, prev)[0], ref(src, lengths, prev)[0], 1e-5, "after load")
    assert "_wn_cache" in ours.decoder.fc3.__dict__
    ours.train()
    ours(src, lengths, prev)  # a training forward frees the inference copies
    assert not any("_wn_cache" in m.__dict__ for m in ours.modules())


def test_inference_weight_cache_after_writes_through_data():
    """Writes through ``.data`` (fairseq's NAG and Adam update that way) bypass the version counters the cache
    is keyed on: ``model.eval()`` (what fairseq-generate/-interactive and the hub call
    before decoding) and ``clear_weight_cache`` start again from the current weights."""
    from fairseq_ext.convs2s.layers import clear_weight_cache

    task = _Task()
    ref, ours = _pair(task)
    ref.eval()
    ours.eval()
    src, lengths, prev = _batch(task)
    for reset in (lambda m: m.eval(), clear_weight_cache):
        with torch.no_grad():
            before = ours(src, lengths, prev)[0]
            for m in (ref, ours):
                for p in m.parameters():
                    p.data.mul_(1.1)
        reset(ours)
        with torch.no_grad():
            after = ours(src, lengths, prev)[0]
            assert (after - before).abs().max() > 1e-3
            assert_close(after, ref(src, lengths, prev)[0], 1e-5, "after .data update")


# ------------------------------------------------------------------------------------------------------------
# weight norm: no deprecation warnings, old checkpoints load
# ------------------------------------------------------------------------------------------------------------


def test_no_deprecation_warnings():
    task = _Task()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FConvGluModel.build_model(_args("fconv_glu_iwslt_de_en"), task)
        src, lengths, prev = _batch(task)
        model(src, lengths, prev)[0].sum().backward()
        model.state_dict()
        model.eval()
        with torch.no_grad():
            model.decoder(prev[:, :1], model.encoder(src, lengths), incremental_state={})
    bad = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))
           and "jit" not in str(w.message)]
    assert not bad, [str(w.message) for w in bad]


@pytest.mark.parametrize("version_key", [True, False])
def test_old_weight_norm_keys_and_version1_decoder_load(version_key):
    """Version-1 fconv state dicts load, with their ``decoder.version`` buffer or without it (fairseq: missing
    means version 1; the odd spec's 1x1 decoder conv has a (1, 1, 1) g in both layouts, which was read as
    version 2: size mismatch)."""
    task = _Task()
    ref, ours = _pair(task, **ODD_SPEC)
    old = ref.state_dict()
    assert any(k.endswith("weight_g") for k in old)
    # version-1 fconv checkpoints normalised the decoder convolutions over dim 0 (fairseq's old bug)
    v1 = {}
    for k, v in old.items():
        v1[k] = v.clone()
    for k in list(v1):
        if k.startswith("decoder.convolutions.") and k.endswith("weight_g"):
            w = torch._weight_norm(v1[k[:-1] + "v"], v1[k], 2)
            v1[k] = torch.norm_except_dim(w, 2, 0)
            v1[k[:-1] + "v"] = w * 3.0  # any scale of v gives the same w
    if version_key:
        v1["decoder.version"] = torch.Tensor([1])
    else:
        del v1["decoder.version"]
    fresh = FConvGluModel.build_model(_args("fconv_glu", **ODD_SPEC), task)
    fresh.load_state_dict(v1, strict=True)
    for name, m in ours.named_modules():
        if hasattr(m, "parametrizations"):
            assert_close(dict(fresh.named_modules())[name].weight, m.weight, 1e-6, name)


def test_bad_layer_specs_raise_clear_errors():
    task = _Task()
    for kw, needle in [(dict(encoder_layers="[(16, 3)] * x"), "--encoder-layers"),
                       (dict(decoder_layers="[(16,)]"), "--decoder-layers"),
                       (dict(decoder_attention="[True, False]"), "--decoder-attention"),
                       (dict(encoder_layers="__import__('os')"), "--encoder-layers"),
                       (dict(share_input_output_embed=True, decoder_out_embed_dim=64),
                        "--share-input-output-embed")]:
        with pytest.raises(FairseqExtError, match=re.escape(needle)):
            FConvGluModel.build_model(_args("fconv_glu_iwslt_de_en", **kw), task)


# ------------------------------------------------------------------------------------------------------------
# command line (fairseq's tests/test_binaries.py for fconv), through --user-dir
# ------------------------------------------------------------------------------------------------------------

ARCH = "fconv_glu_iwslt_de_en"
# smaller than the arch's 256 units for speed, with a width change (residual projection) and an even kernel
TINY = ["--encoder-embed-dim", "32", "--encoder-layers", "[(32, 3), (48, 2)]", "--decoder-embed-dim", "32",
        "--decoder-layers", "[(32, 3), (48, 3)]", "--decoder-out-embed-dim", "32"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fconv_glu_data"))
    create_dummy_data(d)
    preprocess_translation_data(d)
    return d


def _copy_data(src_dir, tmp_path):
    d = str(tmp_path / "data")
    shutil.copytree(src_dir, d, ignore=shutil.ignore_patterns("*.pt"))
    return d


@pytest.fixture(scope="module")
def trained(data_dir):
    train_translation_model(data_dir, ARCH, TINY, run_validation=True)
    return data_dir


def _sources(gen):
    ids = sorted(int(i) for i in re.findall(r"^S-(\d+)\t", gen, re.M))
    assert ids == list(range(100))  # every valid sentence (fairseq_ext.common.fairseq_fixes keeps fairseq's last batch)
    return ids


def test_train_validate_generate_interactive(trained):
    gen, inter = generate_main(trained)  # beam 3, --print-alignment, then interactive on "h e l l o"
    hyps = hypotheses(gen)
    assert sorted(hyps) == _sources(gen)
    assert len(re.findall(r"^A-\d+\t", gen, re.M)) == len(hyps)  # alignments printed
    assert re.search(r"^H-0\t", inter, re.M) and re.search(r"^A-0\t", inter, re.M)


GENERATION_OPTIONS = [  # fairseq's test_generation for fconv
    ["--sampling", "--temperature", "2", "--sampling-topk", "3", "--beam", "2", "--nbest", "2"],
    ["--sampling", "--sampling-topp", "0.2", "--beam", "2", "--nbest", "2"],
    ["--diversity-rate", "0.5", "--beam", "6", "--prefix-size", "2"],
]


def test_generation_options(trained):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # two fairseq-generate processes at a time
        outputs = list(pool.map(lambda flags: generate_main(trained, flags, interactive=False)[0],
                                GENERATION_OPTIONS))
    for flags, gen in zip(GENERATION_OPTIONS, outputs):
        hyps = hypotheses(gen)
        assert sorted(hyps) == _sources(gen), flags
        if "--nbest" in flags:
            for i in hyps:
                assert len(re.findall(rf"^H-{i}\t", gen, re.M)) == 2, flags
        if "--prefix-size" in flags:  # the first two target tokens are forced
            targets = {int(m.group(1)): m.group(2).split() for m in re.finditer(r"^T-(\d+)\t(.*)$", gen, re.M)}
            for i, (_, h) in hyps.items():
                if len(targets[i]) >= 2:
                    assert h.split()[:2] == targets[i][:2], (flags, i, h, targets[i])


@pytest.mark.slow
def test_update_freq_with_raw_dataset(tmp_path):
    raw = str(tmp_path / "raw")
    os.makedirs(raw)
    create_dummy_data(raw)
    preprocess_translation_data(raw, ["--dataset-impl", "raw"])
    proc = train_translation_model(raw, ARCH, TINY + ["--dataset-impl", "raw", "--update-freq", "3"])
    # 100 sentences in batches of max-tokens 500, accumulated 3 at a time: a few updates, not one per batch
    updates = [int(m) for m in re.findall(r'"num_updates": "(\d+)"', proc.stdout + proc.stderr)]
    assert updates and 1 <= max(updates) <= 3
    gen, _ = generate_main(raw, ["--dataset-impl", "raw"], interactive=False)
    assert sorted(hypotheses(gen)) == _sources(gen)


def test_max_positions_message(data_dir, tmp_path):
    d = _copy_data(data_dir, tmp_path)
    proc = run_cli("train", _train_args(d, TINY + ["--max-target-positions", "5"]), check=False)
    assert_one_line_error(proc, "is longer than allowed", "--max-target-positions",
                          "--skip-invalid-size-inputs-valid-test to leave them out of this split")


def _train_args(d, extra):
    from tests.helpers import train_args

    return train_args(d, ARCH, extra)


def test_beam_hypotheses_equal_fairseq_fconv(data_dir, tmp_path):
    """Train fairseq's fconv_iwslt_de_en, convert the checkpoint, and decode with both: identical output."""
    d = _copy_data(data_dir, tmp_path)
    train_translation_model(d, "fconv_iwslt_de_en", ["--dropout", "0.2"])
    ref_ckpt = os.path.join(d, "checkpoint_last.pt")
    ours_ckpt = os.path.join(d, "converted.pt")
    out = run_module("fairseq_ext.convs2s.convert", ["--convert-from-fconv", ref_ckpt, ours_ckpt]).stdout
    assert "wrote" in out
    from fairseq_ext.checkpoints import load_checkpoint_file  # plain torch.load refuses Namespace (S2)

    state = load_checkpoint_file(ours_ckpt)
    assert state["cfg"]["model"].arch == ARCH
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        gen_ref, gen_ours = pool.map(
            lambda p: generate_main(d, ["--print-alignment", "--nbest", "2"], path=p, interactive=False)[0],
            [ref_ckpt, ours_ckpt])

    def lines(text):
        return sorted(line for line in text.splitlines() if re.match(r"^[HPAD]-\d+\t", line))

    assert len(lines(gen_ours)) == 4 * 2 * len(_sources(gen_ours))
    assert lines(gen_ours) == lines(gen_ref)  # same hypotheses, scores, positional scores, alignments
    # B4: fconv's optimizer state is positional in fconv's parameter order, which is not fconv_glu's: it is
    # dropped, and training continues from the converted checkpoint without --reset-optimizer (it used to fail
    # on the NAG momentum's shapes, or silently give layers another layer's momentum)
    assert "last_optimizer_state" in load_checkpoint_file(ref_ckpt)
    assert "last_optimizer_state" not in state and "optimizer state is not converted" in out
    save = str(tmp_path / "continued")
    train = run_cli("train", _train_args(d, ["--restore-file", ours_ckpt, "--save-dir", save, "--max-epoch", "2",
                                             "--dropout", "0.2"]))
    assert "| epoch 002" in train.stdout + train.stderr or '"epoch": 2' in train.stdout + train.stderr
    assert os.path.exists(os.path.join(save, "checkpoint2.pt"))



def test_converter_refuses_what_is_not_an_fconv_checkpoint(tmp_path, capsys):
    from fairseq_ext.convs2s.convert import main

    missing = str(tmp_path / "missing.pt")
    assert main(["--convert-from-fconv", missing, str(tmp_path / "out.pt")]) == 1
    assert f"checkpoint {missing} does not exist" in capsys.readouterr().err
    not_fconv = str(tmp_path / "transformer.pt")
    torch.save({"model": {}, "args": argparse.Namespace(arch="transformer"), "cfg": None}, not_fconv)
    assert main(["--convert-from-fconv", not_fconv, str(tmp_path / "out.pt")]) == 1
    assert "not a fairseq fconv checkpoint (architecture 'transformer')" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


# ------------------------------------------------------------------------------------------------------------
# recipes (--dry-run only: the real ones download data)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe,expect", [
    ("iwslt14_de_en.sh", ["--arch fconv_glu_iwslt_de_en", "--optimizer nag", "--lr 0.25", "--clip-norm 0.1",
                          "--dropout 0.2", "--max-tokens 4000", "learn_bpe.py' -s 10000", "de-en.tgz"]),
    ("wmt14_en_de.sh", ["--arch fconv_glu_wmt_en_de", "--optimizer nag", "--lr 0.5", "--clip-norm 0.1",
                        "--dropout 0.2", "--label-smoothing 0.1", "--force-anneal 50", "learn_bpe.py' -s 40000",
                        "newstest2014", "##AT##", "--thresholdsrc 0 --thresholdtgt 0"]),
])
def test_recipe_dry_run_prints_the_commands(recipe, expect, tmp_path):
    import subprocess

    from tests.helpers import ROOT

    work = tmp_path / "work"
    proc = subprocess.run(["bash", os.path.join(ROOT, "recipes", "convs2s", recipe), "--dry-run", "--workdir",
                           str(work), "--", "--max-epoch", "3", "--encoder-layers", "[(64, 3)] * 2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    steps = re.findall(r"^==> (\w+)", out, re.M)
    assert steps == ["tools", "download", "prepare", "binarize", "train", "evaluate"]
    for e in expect:
        assert e in out, e
    train = [line for line in out.splitlines() if line.startswith("fairseq-train")]
    assert len(train) == 1 and f"--user-dir '{ROOT}/fairseq_ext'" in train[0]
    assert train[0].endswith(r"--max-epoch 3 --encoder-layers \[\(64\,\ 3\)\]\ \*\ 2")  # extra flags, quoted
    gen = [line for line in out.splitlines() if line.startswith("fairseq-generate")]
    assert len(gen) == 1 and "--beam 5" in gen[0] and "--remove-bpe" in gen[0]
    assert not work.exists()  # nothing downloaded or written
    bad = subprocess.run(["bash", os.path.join(ROOT, "recipes", "convs2s", recipe), "--bogus"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown option '--bogus'" in bad.stderr
