"""Release checkpoints (fairseq_ext/checkpoints/release.py, releases/, tools/train_release.py): packing, the sha256
check, and that the shipped models load through the safe loader and translate."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fairseq_ext.checkpoints import load_checkpoint_file
from fairseq_ext.checkpoints.release import ReleaseError, pack, read_manifest, release_state, verify
from tests.helpers import DEMO, DEMO_MSC, DEMO_SAT_K6, ROOT, run_module

RELEASES = os.path.join(ROOT, "releases")


def _release_dirs():
    if not os.path.isdir(RELEASES):
        return []
    return sorted(os.path.join(RELEASES, d) for d in os.listdir(RELEASES)
                  if os.path.isfile(os.path.join(RELEASES, d, "MANIFEST.json")))


def _shipped():
    return [(d, name) for d in _release_dirs() for name in sorted(read_manifest(d)["models"])]


@pytest.fixture
def packed(tiny_transformer_dir, tmp_path):
    """The tiny transformer's checkpoint_last.pt packed into tmp_path/release as 'transformer'."""
    spm_model = tmp_path / "spm.model"
    spm_model.write_bytes(b"not a real sentencepiece model, hashed only")
    rel = tmp_path / "release"
    out, entry = pack(os.path.join(tiny_transformer_dir, "checkpoint_last.pt"), "transformer", str(rel),
                      os.path.join(tiny_transformer_dir, "dict.in.txt"), str(spm_model), {"summary": "tiny"})
    return tiny_transformer_dir, rel, out, entry, spm_model


def test_pack_keeps_the_weights_in_fp16_and_drops_the_optimizer_state(packed):
    data, rel, out, entry, _ = packed
    original = load_checkpoint_file(os.path.join(data, "checkpoint_last.pt"))
    state = load_checkpoint_file(out)  # the safe loader reads a release
    assert "last_optimizer_state" not in state and "last_optimizer_state" in original
    assert state["model"].keys() == original["model"].keys()
    for k, v in original["model"].items():
        if v.is_floating_point():
            assert state["model"][k].dtype == torch.float16
            assert torch.equal(state["model"][k], v.half()), k
        else:
            assert torch.equal(state["model"][k], v), k
    assert state["optimizer_history"][-1]["num_updates"] == original["optimizer_history"][-1]["num_updates"]
    assert entry["num_updates"] == original["optimizer_history"][-1]["num_updates"] > 0
    # the paths of the machine that trained it are gone, the model's config is not
    assert state["cfg"]["task"]["data"] == "" and state["cfg"]["common"]["user_dir"] is None
    assert state["cfg"]["checkpoint"]["save_dir"] == "checkpoints"
    assert state["cfg"]["model"].encoder_embed_dim == original["cfg"]["model"].encoder_embed_dim == 16
    assert original["cfg"]["task"]["data"] == data  # release_state copied the config, not changed it
    manifest = read_manifest(str(rel))
    assert manifest["models"]["transformer"]["sha256"] == entry["sha256"] and entry["summary"] == "tiny"
    assert os.path.getsize(out) < os.path.getsize(os.path.join(data, "checkpoint_last.pt")) / 2


def test_a_release_generates_like_its_checkpoint(packed):
    """fairseq-generate with the release (fp16 weights cast back to fp32) gives the hypotheses of the fp32
    checkpoint rounded to fp16."""
    from tests.helpers import generate_main, hypotheses

    data, rel, out, _, _ = packed
    rounded = os.path.join(str(rel), "rounded.pt")
    state = load_checkpoint_file(os.path.join(data, "checkpoint_last.pt"))
    state["model"] = {k: (v.half().float() if v.is_floating_point() else v) for k, v in state["model"].items()}
    torch.save(state, rounded)
    a, _ = generate_main(data, [], path=out, interactive=False)
    b, _ = generate_main(data, [], path=rounded, interactive=False)
    assert hypotheses(a) == hypotheses(b) and len(hypotheses(a)) == 100


def test_training_continues_from_a_release_under_a_time_cap(tiny_transformer_dir, tmp_path):
    """fairseq counts a checkpoint's "previous_training_time" against --stop-time-hours even with
    --finetune-from-model: a release that kept it (here 1e6 s) would stop the quickstart's continuation before its
    first update."""
    from tests.helpers import train_args, run_cli
    from tests.conftest import TINY_TRANSFORMER

    state = load_checkpoint_file(os.path.join(tiny_transformer_dir, "checkpoint_last.pt"))
    state["extra_state"]["previous_training_time"] = 1e6
    long_trained = tmp_path / "long.pt"
    torch.save(state, long_trained)
    spm_model = tmp_path / "spm.model"
    spm_model.write_bytes(b"hashed only")
    out, _ = pack(str(long_trained), "transformer", str(tmp_path / "rel"),
                  os.path.join(tiny_transformer_dir, "dict.in.txt"), str(spm_model))
    assert "previous_training_time" not in load_checkpoint_file(out)["extra_state"]
    args = train_args(tiny_transformer_dir, "transformer_iwslt_de_en", TINY_TRANSFORMER + [
        "--finetune-from-model", out, "--stop-time-hours", "1", "--max-update", "5", "--max-epoch", "0"])
    args[args.index("--save-dir") + 1] = str(tmp_path / "ckpt")
    proc = run_cli("train", args)
    assert '"num_updates": "5"' in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]


def test_verify_refuses_a_changed_file_with_one_line(packed):
    _, rel, out, _, spm_model = packed
    assert verify(str(rel), "transformer") == out
    for name in ("transformer.pt", "spm.model", "dict.txt"):
        path = rel / name
        good = path.read_bytes()
        path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        with pytest.raises(ReleaseError, match=f"{name} does not match its sha256") as exc:
            verify(str(rel), "transformer")
        assert "\n" not in str(exc.value) and "--from-scratch" in str(exc.value)
        path.write_bytes(good)
    assert verify(str(rel), "transformer") == out
    with pytest.raises(ReleaseError, match="has no release of 'fconv_glu' \\(it has: transformer\\)"):
        verify(str(rel), "fconv_glu")
    assert verify(str(rel), "fconv_glu", if_present=True) is None  # the quickstart's check: none, no error
    assert verify(str(rel), "transformer", if_present=True) == out
    os.remove(rel / "dict.txt")
    with pytest.raises(ReleaseError, match="dict.txt is missing"):
        verify(str(rel), "transformer")
    proc = run_module("fairseq_ext.release", ["verify", "--release-dir", rel, "--name", "transformer"], check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "dict.txt is missing" in proc.stderr


def test_models_of_one_release_share_its_bpe_and_dictionary(packed, tmp_path):
    data, rel, _, _, spm_model = packed
    other = tmp_path / "other.model"
    other.write_bytes(b"another model")
    with pytest.raises(ReleaseError, match="differs from the release's"):
        pack(os.path.join(data, "checkpoint_last.pt"), "fconv_glu", str(rel), os.path.join(data, "dict.in.txt"),
             str(other))
    assert "fconv_glu" not in read_manifest(str(rel))["models"]


def test_release_state_of_a_checkpoint_without_history():
    state = {"model": {"w": torch.ones(2, dtype=torch.float32), "step": torch.tensor(3)}, "cfg": None}
    out = release_state(state)
    assert out["model"]["w"].dtype == torch.float16 and out["model"]["step"].dtype == torch.int64
    assert out["release"]["num_updates"] == 0 and state["model"]["w"].dtype == torch.float32


@pytest.mark.parametrize("release_dir,name", _shipped() or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no release in releases/"))])
def test_shipped_release_matches_its_manifest_and_loads_safely(release_dir, name):
    path = verify(release_dir, name)
    entry = read_manifest(release_dir)["models"][name]
    state = load_checkpoint_file(path)
    assert "last_optimizer_state" not in state
    assert all(v.dtype == torch.float16 for v in state["model"].values() if v.is_floating_point())
    for field in ("command", "updates_trained", "wall_seconds", "cpu_seconds", "valid_bleu", "valid_signature",
                  "summary"):
        assert field in entry, field
    assert entry["valid_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert os.path.getsize(path) == entry["bytes"] < 20 * 2**20  # small enough to live in git


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformer", "fconv_glu", "msc_transformer", "sat_transformer_k2",
                                  "sat_transformer_k4", "sat_transformer_k6"])
def test_the_shipped_de_en_releases_translate_the_demo_sentences(name, tmp_path):
    """The releases the quickstart starts from, through fairseq-interactive with --user-dir: the meaning of the
    demo sentences is there."""
    release_dir = os.path.join(RELEASES, "bible-de-en")
    if name not in read_manifest(release_dir)["models"]:
        pytest.skip(f"no {name} in releases/bible-de-en")
    path = verify(release_dir, name)
    for lang in ("de", "en"):
        shutil.copyfile(os.path.join(release_dir, "dict.txt"), tmp_path / f"dict.{lang}.txt")
    task = "translation_sat" if name.startswith("sat_") else "translation"
    cmd = [sys.executable, "-m", "fairseq_cli.interactive", str(tmp_path), "--user-dir",
           os.path.join(ROOT, "fairseq_ext"), "--path", path, "--task", task,
           "--source-lang", "de", "--target-lang", "en",
           "--bpe", "sentencepiece", "--sentencepiece-model", os.path.join(release_dir, "spm.model"),
           "--beam", "5", "--max-len-a", "1.2", "--max-len-b", "10", "--num-workers", "0"]
    proc = subprocess.run(cmd, input="\n".join(DEMO) + "\n", capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = [line.split("\t")[2] for line in proc.stdout.splitlines() if line.startswith("D-")]
    assert len(outs) == len(DEMO)
    expected = {"msc_transformer": DEMO_MSC, "sat_transformer_k6": DEMO_SAT_K6}.get(name, DEMO.values())
    for out, words in zip(outs, expected):
        for w in words:
            assert w in out, (w, out)


def test_quickstart_refuses_a_release_that_does_not_match_its_manifest(tmp_path):
    """The quickstart checks the release before it uses it: a changed model stops it with the one line of
    fairseq_ext.release (run on a copy of the script's directory layout with a damaged release)."""
    if not _shipped():
        pytest.skip("no release in releases/")
    fake = tmp_path / "checkout"
    (fake / "examples").mkdir(parents=True)
    shutil.copytree(os.path.join(ROOT, "examples", "quickstart"), fake / "examples" / "quickstart")
    shutil.copyfile(os.path.join(ROOT, "examples", "quickstart.sh"), fake / "examples" / "quickstart.sh")
    rel = fake / "releases" / "bible-de-en"
    rel.mkdir(parents=True)
    src = os.path.join(RELEASES, "bible-de-en")
    for f in os.listdir(src):
        shutil.copyfile(os.path.join(src, f), rel / f)
    with open(rel / "transformer.pt", "ab") as f:
        f.write(b"\0")
    # this Python's environment first on PATH, as `source .venv/bin/activate` would (the copy has no .venv)
    env = dict(os.environ, PYTHONPATH=ROOT,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", str(fake / "examples" / "quickstart.sh"), "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "transformer.pt does not match its sha256" in proc.stderr and proc.stderr.count("\n") == 1
    assert "1/6" not in proc.stdout  # nothing ran
    manifest = json.load(open(rel / "MANIFEST.json"))
    assert "transformer" in manifest["models"]


@pytest.mark.slow
def test_train_release_trains_scores_and_packs_with_the_shared_bpe(tmp_path):
    """tools/train_release.py end to end (--smoke: 20 updates): the model is packed into --release-root with a
    manifest that records how it was trained, and the run encoded the corpus with the BPE the corpus's releases
    share (here the shipped bible-de-en one), so the packed spm.model is that file."""
    root = tmp_path / "releases"
    shipped_spm = os.path.join(RELEASES, "bible-de-en", "spm.model")
    if os.path.isfile(shipped_spm):  # the BPE of the shipped releases of the corpus is found under --release-root
        (root / "bible-x").mkdir(parents=True)
        shutil.copyfile(shipped_spm, root / "bible-x" / "spm.model")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_release.py"), "--arch", "transformer",
                           "--smoke", "--workdir", str(tmp_path / "w"), "--release-root", str(root)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rel = root / "bible-de-en"
    path = verify(str(rel), "transformer")
    entry = read_manifest(str(rel))["models"]["transformer"]
    assert entry["updates_trained"] == entry["num_updates"] == 20
    assert entry["command"].startswith("python tools/train_release.py --arch transformer")
    assert "--from-scratch" in entry["quickstart_command"] and entry["wall_seconds"] > 0 and entry["cpu_seconds"] > 0
    assert entry["valid_signature"].startswith("nrefs:1|") and entry["test_signature"].startswith("nrefs:1|")
    assert entry["summary"].startswith("transformer trained 20 updates from scratch in ")
    assert load_checkpoint_file(path)["model"]["encoder.embed_tokens.weight"].dtype == torch.float16
    if os.path.isfile(shipped_spm):
        assert (rel / "spm.model").read_bytes() == open(shipped_spm, "rb").read()
        assert "with the sentencepiece model" in proc.stdout
    # a SAT student distilled from that release, in the same work directory: its own training log (two students
    # of one work directory once wrote one log, and the manifest took another run's training time)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_release.py"), "--arch",
                           "sat_transformer", "--sat-k", "4", "--smoke", "--workdir", str(tmp_path / "w"),
                           "--release-root", str(root)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    log = tmp_path / "w" / "logs" / "train-sat_transformer-de-en-k4.log"
    assert "sat_group_size=4" in log.read_text()
    entry = read_manifest(str(rel))["models"]["sat_transformer_k4"]
    assert entry["updates_trained"] == 20 and entry["train_seconds"] is not None
    assert "SAT_TEACHER" in entry["quickstart_environment"] and "distilled from" in entry["summary"]


# ---- releases carry no path of the machine that built them; malformed manifests are refused ----

def _copy_release(tmp_path, name="bible-de-en", models=("transformer",)):
    """A copy of a shipped release directory with only ``models`` in it."""
    src, rel = os.path.join(RELEASES, name), tmp_path / name
    rel.mkdir(parents=True)
    manifest = read_manifest(src)
    manifest["models"] = {m: manifest["models"][m] for m in models}
    for f in list(SHARED) + [manifest["models"][m]["file"] for m in models]:
        shutil.copyfile(os.path.join(src, f), rel / f)
    json.dump(manifest, open(rel / "MANIFEST.json", "w"))
    return rel


SHARED = ("spm.model", "dict.txt")


@pytest.mark.parametrize("release_dir,name", _shipped() or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no release in releases/"))])
def test_shipped_releases_carry_no_path_of_the_machine_that_built_them(release_dir, name):
    from fairseq_ext.checkpoints.release import machine_paths

    path = verify(release_dir, name)  # which checks it too
    assert machine_paths(load_checkpoint_file(path)) == []
    entry = read_manifest(release_dir)["models"][name]
    assert "/work/" not in json.dumps(entry) and "/tmp/" not in json.dumps(entry)


def test_pack_writes_no_path_of_the_machine_anywhere_in_the_config(packed):
    from fairseq_ext.checkpoints.release import machine_paths

    data, rel, out, _, _ = packed
    original = load_checkpoint_file(os.path.join(data, "checkpoint_last.pt"))
    assert ("cfg.model.save_dir", data) in machine_paths(original)  # fairseq copies every flag into cfg.model
    state = load_checkpoint_file(out)
    assert machine_paths(state) == []
    assert state["cfg"]["model"].save_dir == "checkpoints" and state["cfg"]["model"].data == ""
    assert state["cfg"]["common"]["plasma_path"] == "/tmp/plasma"  # fairseq's default, not this machine's


def test_verify_refuses_a_release_with_a_machine_path_and_scrub_paths_rewrites_it(tmp_path):
    """``python -m fairseq_ext.release verify`` refuses a release whose config names a directory of the machine
    that built it with one line; ``scrub-paths`` rewrites it (weights unchanged) and records its sha256; a second
    run gives the same bytes."""
    from fairseq_ext.checkpoints import atomic_torch_save
    from fairseq_ext.checkpoints.release import sha256

    rel = _copy_release(tmp_path)
    path = rel / "transformer.pt"
    state = load_checkpoint_file(str(path))
    state["cfg"]["model"].data = "/home/builder/bin-de-en"
    state["cfg"]["model"].sat_initialised_from = "/home/builder/releases/transformer.pt"
    atomic_torch_save(state, str(path))
    manifest = read_manifest(str(rel))
    manifest["models"]["transformer"]["sha256"] = sha256(str(path))
    manifest["models"]["transformer"]["command"] = "python tools/train_release.py --workdir /home/builder/w"
    json.dump(manifest, open(rel / "MANIFEST.json", "w"))
    proc = run_module("fairseq_ext.release", ["verify", "--release-dir", rel, "--name", "transformer"], check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: release {path} carries a path of the machine that built it "
                                  "(models.transformer.command = '/home/builder/w')")
    from fairseq_ext.checkpoints.release import main

    assert main(["scrub-paths", "--release-dir", str(rel)]) == 0  # what python -m fairseq_ext.release runs
    assert verify(str(rel), "transformer") == str(path)
    fixed = load_checkpoint_file(str(path))
    assert fixed["cfg"]["model"].data == "" and fixed["cfg"]["model"].sat_initialised_from == "transformer.pt"
    assert all(torch.equal(fixed["model"][k], v) for k, v in state["model"].items())
    assert read_manifest(str(rel))["models"]["transformer"]["command"] == \
        "python tools/train_release.py --workdir DIR"
    digest = sha256(str(path))
    from fairseq_ext.checkpoints.release import scrub_paths

    assert scrub_paths(str(rel)) == {"transformer": (digest, digest)} and sha256(str(path)) == digest


@pytest.mark.parametrize("case", ["no files", "truncated", "file outside", "absolute file"])
def test_verify_refuses_a_malformed_manifest_with_one_line(tmp_path, case, capsys):
    """``python -m fairseq_ext.release verify`` (its main): a manifest without ``files``, cut JSON, or a model
    ``file`` that is not a file of the release directory (with the sha256 of the file it names, so that only the
    name gives it away) is refused with one ``error:`` line; it never returns a path outside the directory."""
    from fairseq_ext.checkpoints.release import main, sha256

    rel = _copy_release(tmp_path)
    text = (rel / "MANIFEST.json").read_text()
    manifest = json.loads(text)
    outside = tmp_path / "elsewhere.pt"
    shutil.copyfile(rel / "transformer.pt", outside)
    if case == "no files":
        del manifest["files"]
    elif case in ("file outside", "absolute file"):
        manifest["models"]["transformer"]["file"] = "../elsewhere.pt" if case == "file outside" else str(outside)
        manifest["models"]["transformer"]["sha256"] = sha256(str(outside))
    (rel / "MANIFEST.json").write_text(text[: len(text) // 2] if case == "truncated" else json.dumps(manifest))
    assert main(["verify", "--release-dir", str(rel), "--name", "transformer"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: {rel / 'MANIFEST.json'} is "), err
    assert {"no files": "it has no 'files' object", "truncated": "is not readable JSON",
            "file outside": "is not the name of a file in the release directory",
            "absolute file": "is not the name of a file in the release directory"}[case] in err
