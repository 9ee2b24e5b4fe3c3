"""Lossless speculative decoding (``--sat-draft-path``, fairseq_ext/sat/speculative.py): the output must be the
verifier's own greedy output, token for token, with the verifier's scores (1e-4), whatever the drafter proposes;
the lean step's per-row lengths and cut-back must equal a cache built from scratch; bad input gets one line."""

import argparse
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fairseq_ext  # noqa: F401  (registers the plugin)
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerModel
from fairseq_ext.common.errors import FairseqExtError
from fairseq_ext.inference.lean_decoder import STATE_KEY, cut_back, lean_step, rows_step
from fairseq_ext.sat.generator import SATSequenceGenerator
from fairseq_ext.sat.model import SATModel
from fairseq_ext.sat.speculative import EPS, SpeculativeSATGenerator, load_drafter, same_encoder
from tests.builders import SAT_DICT as DICT
from tests.builders import SatTask, sat_args, sat_model, sat_sample
from tests.helpers import (ROOT, TINY_SHARED_CLI, USER_DIR, assert_close, create_dummy_data, hypotheses,
                           preprocess_translation_data, run_cli, train_translation_model)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _transformer(seed=0):
    torch.manual_seed(seed)
    m = TransformerModel.build_model(sat_args("transformer"), SatTask()).eval()
    with torch.no_grad():
        m.decoder.output_projection.weight[DICT.eos()] *= 2.0
    return m


def _batch(bsz, src_len, seed):
    """Random sources, left-padded to src_len (fairseq's layout), the first row full length."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(DICT.nspecial, len(DICT), (bsz, src_len), generator=g)
    lengths = torch.randint(2, src_len + 1, (bsz,), generator=g)
    lengths[0] = src_len
    for r in range(bsz):
        src[r, : src_len - int(lengths[r])] = DICT.pad()
        src[r, -1] = DICT.eos()
    return sat_sample(src, lengths)


def _same(ref, out, what, atol=1e-4):
    for s, (a, b) in enumerate(zip(ref, out)):
        assert len(a) == len(b) == 1, what
        assert a[0]["tokens"].tolist() == b[0]["tokens"].tolist(), f"{what}: sentence {s}"
        assert_close(a[0]["positional_scores"], b[0]["positional_scores"], atol, f"{what}: sentence {s}")
        assert abs(float(a[0]["score"]) - float(b[0]["score"])) <= atol, f"{what}: sentence {s} score"
        assert a[0]["attention"].shape == b[0]["attention"].shape, what


def _decode_both(verifier, drafter, sample, eps=EPS, **opts):
    opts = dict(beam_size=1, **opts)
    ref = SATSequenceGenerator([verifier], DICT, **opts).generate([verifier], sample)
    gen = SpeculativeSATGenerator([verifier], drafter, DICT, eps=eps, max_batch=64, **opts)  # ragged batches too
    return ref, gen.generate([verifier], sample), gen


# -- the lean step with a length per row, and cut-back --------------------------------------------------------------

def _encoder_out(model, sample):
    with torch.inference_mode():
        return model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])


def _rows(decoder, tokens, lengths, enc, state, group=1):
    with torch.inference_mode():
        x, extra = rows_step(decoder, tokens, lengths, enc, state, group=group)
        return decoder.output_layer(x), extra


@pytest.mark.parametrize("group", [1, 2])
def test_rows_step_with_rows_of_other_lengths_equals_each_row_alone(group):
    """Rows whose caches hold 5 and 3 positions (the 4th and 5th of the second row are stale, as after a
    cut-back): the new positions of each row equal that row decoded alone, keys written at its own offsets."""
    m = sat_model(1, seed=4)
    sample = _batch(2, 6, seed=3)
    enc = _encoder_out(m, sample)
    g = torch.Generator().manual_seed(1)
    words = torch.randint(DICT.nspecial, len(DICT), (2, 7), generator=g)
    state = {}
    _rows(m.decoder, words[:, :5], [0, 0], enc, state)
    cut_back(m.decoder, state, 5)
    got, _ = _rows(m.decoder, torch.stack([words[0, 5:7], words[1, 3:5]]), [5, 3], enc, state, group)
    for r, n in ((0, 5), (1, 3)):
        one = {}
        enc_r = _encoder_out(m, {"net_input": {k: v[r: r + 1] for k, v in sample["net_input"].items()}})
        _rows(m.decoder, words[r: r + 1, :n], [0], enc_r, one)
        want, _ = _rows(m.decoder, words[r: r + 1, n: n + 2], [n], enc_r, one, group)
        assert_close(got[r: r + 1], want, 1e-5, f"row {r}")
    assert state[STATE_KEY]["k0"].size(2) == 7


def test_rows_step_of_one_aligned_group_is_the_sat_step():
    """For a SAT decoder, a call of one group (group=K) at aligned positions is the SAT's own incremental step."""
    m = sat_model(2, seed=2)
    sample = _batch(1, 5, seed=2)
    enc = _encoder_out(m, sample)
    inp = torch.tensor([[DICT.eos(), DICT.eos(), 7, 9, 5, 11]])
    lean, rows = {}, {}
    for end in (2, 4, 6):
        with torch.inference_mode():
            want = m.decoder.output_layer(lean_step(m.decoder, inp[:, :end], enc, lean)[0])
        got, _ = _rows(m.decoder, inp[:, end - 2: end], [end - 2], enc, rows, group=2)
        assert_close(got, want, 1e-5, f"group ending at {end}")


def test_cut_back_state_equals_the_state_built_from_scratch():
    """Cut back after a call over 6 positions: the cached keys and values equal those of the accepted prefix
    built alone, the buffers are the same objects (no copy), and the next call gives the same outputs."""
    m = sat_model(1, seed=6)
    sample = _batch(2, 6, seed=5)
    enc = _encoder_out(m, sample)
    words = torch.randint(DICT.nspecial, len(DICT), (2, 9), generator=torch.Generator().manual_seed(2))
    spec, scratch = {}, {}
    _rows(m.decoder, words[:, :2], [0, 0], enc, spec)
    _rows(m.decoder, words[:, 2:8], [2, 2], enc, spec)  # 6 positions, 3 of them accepted
    buffers = [spec[STATE_KEY][f"kbuf{i}"] for i in range(len(m.decoder.layers))]
    cut_back(m.decoder, spec, 5)
    _rows(m.decoder, words[:, :5], [0, 0], enc, scratch)
    for i in range(len(m.decoder.layers)):
        assert spec[STATE_KEY][f"kbuf{i}"] is buffers[i]
        for name in ("k", "v"):
            assert_close(spec[STATE_KEY][f"{name}{i}"], scratch[STATE_KEY][f"{name}{i}"], 1e-5, f"{name}{i}")
    a, _ = _rows(m.decoder, words[:, 5:7], [5, 5], enc, spec)
    b, _ = _rows(m.decoder, words[:, 5:7], [5, 5], enc, scratch)
    assert_close(a, b, 1e-5, "the next call")


# -- exactness ---------------------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(K=st.integers(1, 4), bsz=st.integers(1, 5), src_len=st.integers(3, 8), seed=st.integers(0, 10 ** 6),
       min_len=st.integers(1, 3), max_len_a=st.sampled_from([0.0, 0.5, 1.5]), max_len_b=st.integers(3, 12),
       unkpen=st.sampled_from([0.0, 0.7]), verifier_kind=st.sampled_from(["transformer", "sat K=1"]))
def test_output_is_the_verifiers_with_random_drafters(K, bsz, src_len, seed, min_len, max_len_a, max_len_b, unkpen,
                                                      verifier_kind):
    """Random tiny models: the drafter (another random SAT) is almost never right, so nearly every word is the
    verifier's correction; the output equals the verifier decoding alone, batch for batch, whatever K, the batch
    composition and --min-len / --max-len-a/b / --unkpen."""
    verifier = _transformer(seed % 7) if verifier_kind == "transformer" else sat_model(1, seed=seed % 7)
    drafter = sat_model(K, seed=seed % 11 + 20)
    sample = _batch(bsz, src_len, seed)
    ref, out, gen = _decode_both(verifier, drafter, sample, min_len=min_len, max_len_a=max_len_a,
                                 max_len_b=max_len_b, unk_penalty=unkpen)
    _same(ref, out, f"K={K} bsz={bsz}")
    assert gen.stats["sentences"] == bsz and gen.stats["verifier_calls"] >= 1


def test_random_drafters_are_almost_never_right():
    """What the property test above exercises: a random drafter's words are mostly rejected, so nearly every word
    of the output is a correction by the verifier."""
    accepted = drafted = 0
    for seed in range(6):
        _, _, gen = _decode_both(sat_model(1, seed=seed), sat_model(3, seed=seed + 20), _batch(4, 7, seed), max_len_b=9)
        accepted, drafted = accepted + gen.stats["accepted"], drafted + gen.stats["drafted"]
    assert accepted < drafted / 5, (accepted, drafted)


@pytest.mark.parametrize("bsz", [1, 4])
def test_the_verifier_as_its_own_drafter_accepts_every_draft(bsz):
    """A sat_transformer K=1 as verifier and drafter: every draft is accepted, so each verifier call decides two
    words (ceil(length / 2) calls a sentence alone), and the output is the verifier's."""
    m = sat_model(1, seed=8)
    sample = _batch(bsz, 7, seed=bsz)
    ref, out, gen = _decode_both(m, m, sample, max_len_a=1.0, max_len_b=6, min_len=2, unk_penalty=0.3)
    _same(ref, out, "verifier as drafter")
    assert gen.shares_encoder and gen.stats["fallbacks"] == 0
    lengths = [len(h[0]["tokens"]) for h in ref]
    assert gen.stats["verifier_calls"] == max(math.ceil(n / 2) for n in lengths)
    assert gen.stats["accepted"] == sum(math.ceil(n / 2) for n in lengths)


def test_near_ties_are_decided_by_the_verifier_alone():
    """Two words with the same output row tie exactly wherever they lead: such decisions are within eps, so their
    sentences are decoded by the verifier alone (counted), and the tie is broken as the verifier breaks it."""
    v = sat_model(1, seed=9)
    with torch.no_grad():
        w = v.decoder.output_projection.weight
        w[6] = w[5] = 4 * w[5]
    sample = _batch(5, 6, seed=9)
    ref, out, gen = _decode_both(v, sat_model(2, seed=30), sample, max_len_b=8)
    _same(ref, out, "ties")
    assert gen.stats["fallbacks"] >= 1 and any(5 in h[0]["tokens"].tolist() for h in ref)
    ref, out, gen = _decode_both(v, sat_model(2, seed=30), sample, max_len_b=8, eps=50.0)  # every choice unclear
    _same(ref, out, "eps 50")
    assert gen.stats["fallbacks"] == 5


def test_numeric_difference_from_the_one_position_step_is_far_below_eps():
    """The guard's premise: a log-probability computed by the speculative calls (K + 1 positions, rows of other
    lengths) differs from the verifier's one-position step along the same prefix by far less than eps / 2."""
    v, d = _transformer(3), sat_model(3, seed=12)
    sample = _batch(4, 7, seed=4)
    gen = SpeculativeSATGenerator([v], d, DICT, beam_size=1, max_len_b=10, max_batch=4)
    gen.record = []
    out = gen.generate([v], sample)
    worst = 0.0
    for r, hyp in enumerate(out):
        tokens = torch.cat([torch.tensor([DICT.eos()]), hyp[0]["tokens"]]).unsqueeze(0)
        row = {"net_input": {k: t[r: r + 1] for k, t in sample["net_input"].items()}}
        enc, state = _encoder_out(v, row), {}
        for t in range(tokens.size(1) - 1):  # the verifier one position at a time, batch 1
            with torch.inference_mode():
                x, extra = lean_step(v.decoder, tokens[:, : t + 1], enc, state)
                lp = v.get_normalized_probs((v.decoder.output_layer(x), extra), log_probs=True)[0, -1].clone()
                lp[DICT.pad()] = -math.inf
            rec = [p for s, step, p in gen.record if s == r and step == t]
            assert len(rec) == 1
            finite = lp.isfinite() & rec[0].isfinite()
            worst = max(worst, float((lp[finite] - rec[0][finite]).abs().max()))
    assert worst < EPS / 100, worst


# -- where speculation does not run, and bad input --------------------------------------------------------------

def test_without_the_lean_step_the_verifier_decodes_alone(caplog):
    v, d = sat_model(1, seed=1), sat_model(2, seed=2)
    sample = _batch(3, 6, seed=1)
    ref = SATSequenceGenerator([v], DICT, beam_size=1, max_len_b=7, lean_step=False).generate([v], sample)
    gen = SpeculativeSATGenerator([v], d, DICT, beam_size=1, max_len_b=7, lean_step=False)
    with caplog.at_level("WARNING"):
        _same(ref, gen.generate([v], sample), "--no-lean-step", atol=0)
    assert gen.stats["verifier_calls"] == 0 and gen.refusal() == "--no-lean-step"
    assert any("no drafts (--no-lean-step); the verifier decodes alone" in r.message for r in caplog.records)


def test_batches_over_max_batch_are_decoded_by_the_verifier_alone():
    v, d = sat_model(1, seed=1), sat_model(2, seed=2)
    sample = _batch(5, 6, seed=3)
    ref = SATSequenceGenerator([v], DICT, beam_size=1, max_len_b=7).generate([v], sample)
    gen = SpeculativeSATGenerator([v], d, DICT, beam_size=1, max_len_b=7, max_batch=4)
    _same(ref, gen.generate([v], sample), "batch 5 over 4", atol=0)
    assert gen.stats["verifier_calls"] == 0 and gen.stats["sentences_alone"] == 5
    gen.generate([v], _batch(4, 6, seed=3))
    assert gen.stats["verifier_calls"] > 0 and gen.stats["sentences"] == 4


def test_refusals_in_one_line():
    v, d = sat_model(1, seed=1), sat_model(2, seed=2)
    with pytest.raises(FairseqExtError, match="decodes greedily .*use --beam 1"):
        SpeculativeSATGenerator([v], d, DICT, beam_size=4)
    with pytest.raises(FairseqExtError, match="must be the autoregressive verifier .* K=2"):
        SpeculativeSATGenerator([sat_model(2, seed=3)], d, DICT, beam_size=1)
    with pytest.raises(FairseqExtError, match="--no-repeat-ngram-size is not supported with --sat-draft-path"):
        SpeculativeSATGenerator([v], d, DICT, beam_size=1, no_repeat_ngram_size=2)
    with pytest.raises(FairseqExtError, match="--sat-freeze-encoder keeps the encoder of --sat-init-from"):
        SATModel.build_model(sat_args("sat_transformer", 2, sat_freeze_encoder=True), SatTask())


def test_the_encoder_is_shared_only_when_it_computes_the_same():
    v = sat_model(1, seed=5)
    d = sat_model(2, seed=6)
    assert not same_encoder(v.encoder, d.encoder)
    d.encoder.load_state_dict(v.encoder.state_dict())
    assert same_encoder(v.encoder, d.encoder)
    d.encoder.embed_scale = 1.0  # the same weights, another function (--no-scale-embedding)
    assert not same_encoder(v.encoder, d.encoder)


# -- through fairseq-generate, fairseq-interactive and the hub ------------------------------------------------------

TINY = TINY_SHARED_CLI  # tests/helpers.py


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fairseq transformer (the verifier), and a SAT K=2 drafter initialised from it with its encoder frozen."""
    d = str(tmp_path_factory.mktemp("speculative"))
    create_dummy_data(d, num_examples=80, maxlen=12)
    preprocess_translation_data(d, ["--joined-dictionary"])
    train_translation_model(d, "transformer", TINY + ["--save-dir", os.path.join(d, "verifier")], max_epoch=3)
    verifier = os.path.join(d, "verifier", "checkpoint_last.pt")
    train_translation_model(d, "sat_transformer", TINY + [
        "--save-dir", os.path.join(d, "drafter"), "--sat-group-size", "2", "--sat-init-from", verifier,
        "--sat-init-decoder", "--sat-freeze-encoder"], task="translation_sat", max_epoch=2)
    return {"data": d, "verifier": verifier, "drafter": os.path.join(d, "drafter", "checkpoint_last.pt")}


def _cli(tool, trained, *extra, input=None, check=True):
    d = trained["data"]
    return run_cli(tool, [d, "--user-dir", USER_DIR, "--task", "translation_sat", "--path", trained["verifier"],
                          "--beam", "1", "--max-len-b", "8", "--no-progress-bar", "--num-workers", "0",
                          "--source-lang", "in", "--target-lang", "out", *extra], input=input, check=check)


def _positional(stdout):
    return {int(m.group(1)): [float(x) for x in m.group(2).split()]
            for m in re.finditer(r"^P-(\d+)\t(.*)$", stdout, re.M)}


def test_cli_generate_and_interactive_print_the_verifiers_output(trained):
    alone = _cli("generate", trained, "--batch-size", "16", "--gen-subset", "valid").stdout
    spec = _cli("generate", trained, "--batch-size", "16", "--gen-subset", "valid",
                "--sat-draft-path", trained["drafter"], "--sat-draft-max-batch", "16")
    assert "speculative greedy search" in spec.stderr and "encoder shared" in spec.stderr
    ha, hs = hypotheses(alone), hypotheses(spec.stdout)
    assert len(ha) == 80 and [t for _, (_, t) in sorted(ha.items())] == [t for _, (_, t) in sorted(hs.items())]
    assert all(abs(ha[i][0] - hs[i][0]) <= 1e-4 for i in ha)
    pa, ps = _positional(alone), _positional(spec.stdout)  # printed to 4 decimals: one unit of the last apart
    assert all(max(abs(x - y) for x, y in zip(pa[i], ps[i])) <= 1.01e-4 for i in pa)
    lines = "h e l l o\na b c\n"
    a = _cli("interactive", trained, "--buffer-size", "0", input=lines).stdout
    b = _cli("interactive", trained, "--buffer-size", "0", "--sat-draft-path", trained["drafter"], input=lines).stdout
    assert re.findall(r"^H-\d+\t\S+\t(.*)$", a, re.M) == re.findall(r"^H-\d+\t\S+\t(.*)$", b, re.M) != []


def test_cli_refuses_bad_input_in_one_line(trained, tmp_path):
    cases = [(("--sat-draft-path", trained["verifier"]), "the drafter must be a sat_transformer (this is transformer)"),
             (("--sat-draft-path", trained["drafter"], "--beam", "2"), "--sat-draft-path decodes greedily"),
             (("--sat-draft-path", str(tmp_path / "none.pt")), "no such file"),
             (("--sat-draft-path", trained["drafter"], "--inference-speedups", "int8-decoder"),
              "quantises the verifier"),
             (("--sat-draft-path", trained["drafter"], "--path", f"{trained['verifier']}:{trained['verifier']}"),
              "decodes one model")]
    for extra, message in cases:
        proc = _cli("generate", trained, "--gen-subset", "valid", *extra, check=False)
        assert proc.returncode != 0 and message in proc.stderr, (extra, proc.stderr[-1500:])
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    # a dictionary of the same size with other symbols, found beside the drafter
    other = tmp_path / "other"
    other.mkdir()
    shutil.copyfile(trained["drafter"], other / "drafter.pt")
    d = Dictionary.load(os.path.join(trained["data"], "dict.out.txt"))
    with open(other / "dict.txt", "w") as f:
        f.writelines(f"{s}x 1\n" for s in d.symbols[d.nspecial:])
    proc = _cli("generate", trained, "--gen-subset", "valid", "--sat-draft-path", str(other / "drafter.pt"),
                check=False)
    assert "differs from the verifier's (same size, other symbols)" in proc.stderr, proc.stderr[-1500:]


def test_drafter_of_another_dictionary_size_is_refused(trained):
    from fairseq import checkpoint_utils

    verifier = checkpoint_utils.load_model_ensemble([trained["verifier"]])[0][0]
    with pytest.raises(FairseqExtError, match=r"target dictionary of \d+ symbols, the verifier's data 20"):
        load_drafter(trained["drafter"], SatTask(), verifier)


def test_hub_decodes_with_the_drafter(trained):
    kw = dict(checkpoint_file=os.path.basename(trained["verifier"]), data_name_or_path=trained["data"])
    alone = SATModel.from_pretrained(os.path.dirname(trained["verifier"]), **kw)
    spec = SATModel.from_pretrained(os.path.dirname(trained["verifier"]), sat_draft_path=trained["drafter"], **kw)
    for line in ("h e l l o", "a b c d e f"):
        assert spec.translate(line, beam=1, max_len_b=8) == alone.translate(line, beam=1, max_len_b=8)
    gen = spec.task.build_generator(spec.models, argparse.Namespace(beam=1))
    assert isinstance(gen, SpeculativeSATGenerator) and gen.shares_encoder and gen.shares_output
    # --sat-freeze-encoder kept the verifier's encoder (and the embeddings it shares) through training
    from fairseq import checkpoint_utils

    v, d = (checkpoint_utils.load_checkpoint_to_cpu(trained[k])["model"] for k in ("verifier", "drafter"))
    assert all(torch.equal(v[k], d[k]) for k in v if k.startswith("encoder."))
    assert not torch.equal(v["decoder.layers.0.fc1.weight"], d["decoder.layers.0.fc1.weight"])


# -- the trained Bible models on every Acts test verse -------------------------------------------------------------

RELEASE = os.path.join(ROOT, "releases", "bible-de-en")


@pytest.fixture(scope="module")
def data(acts_bin):
    return acts_bin


def test_every_acts_test_verse_is_the_release_transformers_greedy_output(data):
    """The release transformer as verifier, its greedy-distilled SAT K=2 as drafter: fairseq-generate prints the
    same 1,003 translations (batch 64), with the verifier's scores."""
    common = [data, "--user-dir", USER_DIR, "--task", "translation_sat",
              "--path", os.path.join(RELEASE, "transformer.pt"),
              "--gen-subset", "test", "--beam", "1", "--max-len-a", "1.2", "--max-len-b", "10", "--batch-size", "64",
              "--num-workers", "0", "--source-lang", "de", "--target-lang", "en"]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    alone = run_cli("generate", common, env=env, timeout=1800).stdout
    spec = run_cli("generate", common + ["--sat-draft-path", os.path.join(RELEASE, "sat_transformer_k2.pt"),
                                         "--sat-draft-max-batch", "64"], env=env, timeout=1800).stdout
    ha, hs = hypotheses(alone), hypotheses(spec)
    assert len(ha) == len(hs) == 1003
    differ = [i for i in ha if ha[i][1] != hs[i][1]]
    assert differ == [], f"{len(differ)} verses differ, e.g. {differ[:5]}"
    assert max(abs(ha[i][0] - hs[i][0]) for i in ha) <= 1e-4
    pa, ps = _positional(alone), _positional(spec)  # printed to 4 decimals: one unit of the last apart
    assert max(max(abs(x - y) for x, y in zip(pa[i], ps[i])) for i in pa) <= 1.01e-4


@pytest.mark.slow
def test_train_drafter_smoke_packs_a_release(tmp_path):
    """tools/train_drafter.py --smoke on the bundled corpus with a copy of the release: every step (data with the
    release's BPE and dictionary, greedy distillation of 1/50 of the training set, 20 updates from the verifier
    with its encoder frozen, acceptance on valid, packing) and a manifest entry that records how it was made."""
    if not os.path.isfile(os.path.join(RELEASE, "transformer.pt")):
        pytest.skip("no releases/bible-de-en/transformer.pt")
    rel = tmp_path / "release"
    rel.mkdir()
    for f in ("transformer.pt", "dict.txt", "spm.model", "MANIFEST.json"):
        shutil.copyfile(os.path.join(RELEASE, f), rel / f)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_drafter.py"), "--verifier",
                           str(rel / "transformer.pt"), "--k", "2", "--decoder-layers", "1", "--init-decoder",
                           "--freeze-encoder", "--smoke", "--workdir", str(tmp_path / "work"), "--pack", "sat_drafter"],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"train_drafter: K=2, 1 decoder layer\(s\), 20 updates: [0-9.]+ accepted drafts per verifier "
                     r"call on 20 valid sentences \(20 identical", proc.stdout), proc.stdout[-2000:]
    from fairseq_ext.checkpoints.release import read_manifest, verify

    entry = read_manifest(str(rel))["models"]["sat_drafter"]
    assert entry["updates_trained"] == 20 and entry["threads"] == 1 and entry["command"].startswith(
        "python tools/train_drafter.py --verifier")
    assert re.match(r"[0-9a-f]{40}", entry["code_commit"]) and entry["valid_acceptance"]["shares_encoder"]
    assert entry["valid_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert read_manifest(str(rel))["models"]["transformer"] == read_manifest(RELEASE)["models"]["transformer"]
    path = verify(str(rel), "sat_drafter")
    out = run_cli("interactive", [str(tmp_path / "work" / "bin"), "--user-dir", USER_DIR, "--task", "translation_sat",
                              "--path", str(rel / "transformer.pt"), "--sat-draft-path", path, "--beam", "1",
                              "--bpe", "sentencepiece", "--sentencepiece-model", str(rel / "spm.model"),
                              "--source-lang", "de", "--target-lang", "en", "--num-workers", "0"],
                  input="Fürchtet euch nicht, denn der Herr ist mit euch.\n", env={"OMP_NUM_THREADS": "1"})
    assert "encoder shared" in out.stderr and re.search(r"^D-0\t\S+\t.*Lord", out.stdout, re.M), out.stdout


def test_recipe_dry_run_prints_every_step(tmp_path):
    """recipes/sat/speculative.sh --dry-run: the drafter's training, both decodes (the second with
    --sat-draft-path), the comparison and the benchmark, in order; nothing is written."""
    work = tmp_path / "work"
    proc = subprocess.run(["bash", os.path.join(ROOT, "recipes", "sat", "speculative.sh"), "--dry-run", "--workdir",
                           str(work), "--k", "3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not work.exists()
    cmds = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert "tools/train_drafter.py" in cmds[0] and "--k 3" in cmds[0] and "--freeze-encoder" in cmds[0]
    gens = [c for c in cmds if c.startswith("fairseq-generate")]
    assert len(gens) == 2 and "--sat-draft-path" not in gens[0]
    assert f"--sat-draft-path {work}/drafter/checkpoints/checkpoint_avg.pt" in gens[1]
    assert all("--beam 1" in g and "--gen-subset test" in g for g in gens)
    assert "python -m benchmarks.speed.speculative" in cmds[-1]
