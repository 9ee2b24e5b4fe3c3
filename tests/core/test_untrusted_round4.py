"""Untrusted inputs, round 4: the last tracebacks become one ``error:`` line, two trainings cannot share a save
directory, a malformed sentencepiece model is named, and ``release verify`` loads the bytes it hashed.

Through the real entry points: ``python -m fairseq_ext.release``, ``fairseq-generate`` / ``-interactive`` /
``-train`` (``python -m fairseq_cli.<tool> --user-dir fairseq_ext``), and the experiment driver's scheduler
(benchmarks/claims/jobs.py). The command lines without a training run two at a time in one module fixture, on the
shipped release releases/bible-de-en; the two-trainings test trains a tiny model and is slow.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from benchmarks.claims import jobs as claims_jobs
from tests.helpers import ROOT, USER_DIR, assert_one_line_error, run_cli, run_module, run_parallel

DE_EN = os.path.join(ROOT, "releases", "bible-de-en")
LOCK = ".fairseq-train.lock"  # fairseq_ext/checkpoints/save_dir_lock.py
if not os.path.isfile(os.path.join(DE_EN, "transformer.pt")):
    pytest.skip("no release in releases/bible-de-en", allow_module_level=True)


def _raw_data(directory, src_lines, tgt_lines):
    """A ``--dataset-impl raw`` data directory for the release (its dictionary on both sides), split ``test``."""
    os.makedirs(directory)
    for lang, lines in (("de", src_lines), ("en", tgt_lines)):
        shutil.copyfile(os.path.join(DE_EN, "dict.txt"), os.path.join(directory, f"dict.{lang}.txt"))
        with open(os.path.join(directory, f"test.de-en.{lang}"), "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
    return directory


def _generate(data, *flags):
    return lambda: run_cli("generate", [data, "--path", os.path.join(DE_EN, "transformer.pt"), "--dataset-impl", "raw",
                                        "--gen-subset", "test", "--source-lang", "de", "--target-lang", "en",
                                        "--beam", "2", "--max-len-b", "4", "--num-workers", "0",
                                        "--user-dir", USER_DIR, *flags], check=False)


def _interactive(data, spm_model):
    return lambda: run_cli("interactive", [data, "--path", os.path.join(DE_EN, "transformer.pt"), "--source-lang",
                                           "de", "--target-lang", "en", "--bpe", "sentencepiece",
                                           "--sentencepiece-model", spm_model, "--beam", "2", "--max-len-b", "4",
                                           "--num-workers", "0", "--user-dir", USER_DIR],
                           input="Der Herr.\n", check=False)


def _hold_lock(save_dir):
    """A process that holds the save directory's lock (as a running fairseq-train does) until its stdin closes."""
    code = ("import fcntl, os, sys\nf = open(sys.argv[1], 'a+')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
            "f.seek(0); f.truncate(); f.write(str(os.getpid())); f.flush()\n"
            "print('held', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, os.path.join(save_dir, LOCK)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Every command line of the fast tests, run two at a time: {name: CompletedProcess} and the paths used."""
    w = tmp_path_factory.mktemp("round4")
    empty = _raw_data(str(w / "empty"), [], [])
    long_src = ["Der Herr .", " ".join(["König"] * 40), "Und er sprach ."]  # line 2: 40 tokens
    long = _raw_data(str(w / "long"), long_src, ["The Lord .", "king", "And he said ."])
    spm_dir = _raw_data(str(w / "spm"), [], [])
    good = open(os.path.join(DE_EN, "spm.model"), "rb").read()
    (w / "cut.model").write_bytes(good[: len(good) // 3])
    deep = w / "deep"
    deep.mkdir()
    (deep / "MANIFEST.json").write_text("[" * 100_000)
    save = w / "save"  # held by another process: fairseq-train must refuse it before writing anything
    save.mkdir()
    holder = _hold_lock(str(save))

    def train():
        data = _raw_data(str(w / "train_data"), [], [])
        return run_cli("train", [data, "--arch", "transformer_iwslt_de_en", "--save-dir", str(save), "--dataset-impl",
                                 "raw", "--source-lang", "de", "--target-lang", "en", "--optimizer", "adam", "--lr",
                                 "0.001", "--max-tokens", "300", "--max-update", "2", "--no-progress-bar",
                                 "--num-workers", "0", "--user-dir", USER_DIR], check=False)

    jobs = {
        "empty": _generate(empty),
        "long": _generate(long, "--max-source-positions", "30"),
        "spm_cut": _interactive(spm_dir, str(w / "cut.model")),
        "spm_missing": _interactive(spm_dir, str(w / "missing.model")),
        "deep": lambda: run_module("fairseq_ext.release", ["verify", "--release-dir", deep, "--name", "transformer"],
                                   check=False),
        "train_locked": train,
    }
    try:
        results = run_parallel(jobs)
    finally:
        holder.stdin.close()
        holder.wait()
    return {"w": w, "results": results, "holder": holder.pid}


# ---------------------------------------------------------------------------------------------- one line

def test_release_verify_of_a_manifest_nested_too_deep_for_json_is_one_line(cli):
    """100,000 ``[`` (RecursionError in Python's json) name the manifest."""
    proc = cli["results"]["deep"]
    assert proc.returncode == 1 and proc.stdout == ""
    assert_one_line_error(proc, f"{cli['w'] / 'deep' / 'MANIFEST.json'} is not readable JSON", "git checkout --")
    assert proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("text, why", [('{"files": {}, "models": {}, "n": ' + "1" * 5000 + "}", "is not readable JSON"),
                                       ('{"files": {}, "models": {"t": ' + '{"a": ' * 40 + "1" + "}" * 41 + "}",
                                        "nests deeper than 16 levels")])
def test_release_verify_of_a_huge_number_or_a_deep_entry_is_one_line(tmp_path, capsys, text, why):
    """(``main``, what ``python -m fairseq_ext.release`` runs) a 5000-digit number (ValueError of int(), not a
    JSONDecodeError) and an entry nested 40 deep name the manifest."""
    from fairseq_ext.checkpoints.release import main

    (tmp_path / "MANIFEST.json").write_text(text)
    assert main(["verify", "--release-dir", str(tmp_path), "--name", "t"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: {tmp_path / 'MANIFEST.json'} "), err
    assert why in err


def test_generate_on_empty_raw_test_files_is_one_line_naming_the_split_and_its_files(cli):
    proc = cli["results"]["empty"]
    data = str(cli["w"] / "empty")
    assert_one_line_error(proc, "split 'test'", "holds no sentences", os.path.join(data, "test.de-en.de"),
                          "--gen-subset")


def test_generate_on_a_source_longer_than_max_source_positions_names_the_sentence_and_the_flags(cli):
    """Refused (not skipped: a test set scored without some sentences is another test set), naming sentence id 1
    (line 2 of the split), its length and both flags."""
    assert_one_line_error(cli["results"]["long"], "split 'test'", "sentence id 1 (line 2)", "source 41 > 30",
                          "--max-source-positions", "--skip-invalid-size-inputs-valid-test")


@pytest.mark.parametrize("name", ["spm_cut", "spm_missing"])
def test_a_malformed_or_missing_sentencepiece_model_is_one_line_naming_the_file(cli, name):
    model = str(cli["w"] / {"spm_cut": "cut.model", "spm_missing": "missing.model"}[name])
    line = assert_one_line_error(cli["results"][name], f"--sentencepiece-model {model}")
    assert ("does not exist" if name == "spm_missing" else "is not a sentencepiece model") in line


# ---------------------------------------------------------------------------------------------- save directory

def test_fairseq_train_refuses_a_save_dir_another_process_holds(cli):
    """The lock file is held (as by a running training): fairseq-train refuses in one line naming the save
    directory and the holder, and writes nothing there (the lock file is the holder's, unchanged)."""
    save = cli["w"] / "save"
    assert_one_line_error(cli["results"]["train_locked"], f"--save-dir {save} is in use", f"pid {cli['holder']}")
    assert sorted(os.listdir(save)) == [LOCK] and (save / LOCK).read_text() == str(cli["holder"])


def _tiny_training(data, save, seed, stop_hours):
    from tests.conftest import TINY_TRANSFORMER

    return [sys.executable, "-m", "fairseq_cli.train", data, "--arch", "transformer_iwslt_de_en", *TINY_TRANSFORMER,
            "--save-dir", save, "--dataset-impl", "raw", "--source-lang", "in", "--target-lang", "out",
            "--optimizer", "adam", "--lr", "0.001", "--max-tokens", "300", "--max-epoch", "100000",
            "--stop-time-hours", str(stop_hours), "--no-progress-bar", "--num-workers", "0", "--seed", str(seed),
            "--user-dir", USER_DIR, "--no-epoch-checkpoints"]


@pytest.mark.slow
def test_two_trainings_with_one_save_dir_the_second_refuses_and_the_first_finishes(tmp_path):
    """A lock left by a killed training does not block; while a real fairseq-train runs, a second one given the
    same --save-dir refuses in one line naming it and the first's pid, before it writes or loads anything; the
    first finishes normally and every checkpoint there is the first's."""
    from tests.core.test_hostile_inputs import _raw_training_data

    data = _raw_training_data(str(tmp_path / "data"))
    save = tmp_path / "save"
    save.mkdir()
    killed = _hold_lock(str(save))  # a training killed while it held the lock
    killed.kill()
    killed.wait()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = tmp_path / "first.log"
    with open(log, "w") as out_file:
        first = subprocess.Popen(_tiny_training(data, str(save), 1, 0.01), cwd=ROOT, env=env, text=True,
                                 stdout=out_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while "begin training epoch 1" not in log.read_text():
            assert first.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        second = run_cli("train", _tiny_training(data, str(save), 2, 0.01)[3:], check=False)
        assert first.poll() is None, "the first training ended before the second started: not a concurrent test"
        assert_one_line_error(second, f"--save-dir {save} is in use", f"pid {first.pid}")
        assert (save / LOCK).read_text() == str(first.pid)
        assert "Saving checkpoint" not in second.stdout + second.stderr and "loaded checkpoint" not in second.stdout
        first.wait(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    out = log.read_text()
    assert first.returncode == 0, out[-3000:]
    assert "Saving checkpoint" in out and "Traceback" not in out
    assert not (save / LOCK).exists()  # removed at exit
    from fairseq_ext.checkpoints import load_checkpoint_file

    assert load_checkpoint_file(str(save / "checkpoint_last.pt"))["cfg"]["common"]["seed"] == 1


# ---------------------------------------------------------------------------------------------- release verify

def test_release_verify_loads_the_bytes_it_hashed(tmp_path, monkeypatch, capsys):
    """Right after verify has hashed the model, the file on disk is replaced by a damaged copy: verify still
    loads (and accepts) the bytes it hashed, never the file's new content, and prints the path."""
    from fairseq_ext.checkpoints import release
    from fairseq_ext.checkpoints.release import main, read_manifest

    rel = tmp_path / "rel"
    rel.mkdir()
    manifest = read_manifest(DE_EN)
    manifest["models"] = {"transformer": manifest["models"]["transformer"]}
    for f in ("spm.model", "dict.txt", "transformer.pt"):
        shutil.copyfile(os.path.join(DE_EN, f), rel / f)
    (rel / "MANIFEST.json").write_text(json.dumps(manifest))
    model = rel / "transformer.pt"
    good = model.read_bytes()
    swapped = []

    class Sha256:  # hashlib.sha256, and the swap once the model's digest is known
        def __init__(self, data=b""):
            self.h = hashlib.sha256(data)

        def update(self, data):
            self.h.update(data)

        def hexdigest(self):
            digest = self.h.hexdigest()
            if digest == manifest["models"]["transformer"]["sha256"] and not swapped:
                damaged = tmp_path / "damaged.pt"
                damaged.write_bytes(good[: len(good) // 2])
                os.replace(damaged, model)
                swapped.append(True)
            return digest

    monkeypatch.setattr(release, "hashlib", type("hashlib", (), {"sha256": Sha256}))
    assert main(["verify", "--release-dir", str(rel), "--name", "transformer"]) == 0, capsys.readouterr().err
    assert swapped and model.read_bytes() != good
    out, err = capsys.readouterr()
    assert out == f"{model}\n" and err == ""


# ---------------------------------------------------------------------------------------------- claims driver

@pytest.mark.parametrize("content", ["[1]", "[" * 100_000, '{"ok": true, "settings_hash"', "1" * 5000])
def test_a_damaged_results_file_is_named_in_one_warning_and_the_step_runs_again(tmp_path, content):
    said, ran = [], []
    S = claims_jobs.Scheduler(str(tmp_path), jobs=1, say=said.append)
    S.add(claims_jobs.Job("a", lambda job, S: ran.append("a") or {"value": 1}, {"x": 1}))
    os.makedirs(os.path.dirname(S.result_path("a")))
    with open(S.result_path("a"), "w") as f:
        f.write(content)
    assert S.done("a") is None
    S.run_all()
    assert ran == ["a"] and S.result("a")["value"] == 1
    warnings = [m for m in said if S.result_path("a") in m]
    assert len(warnings) >= 1 and "damaged" in warnings[0] and "runs again" in warnings[0] and "\n" not in warnings[0]
    assert json.load(open(S.result_path("a")))["ok"]  # replaced by the new result
    S2 = claims_jobs.Scheduler(str(tmp_path), jobs=1, say=said.append)
    S2.add(claims_jobs.Job("a", lambda job, S: ran.append("again"), {"x": 1}))
    S2.run_all()
    assert ran == ["a"]  # done now: skipped


def test_a_worker_result_that_is_not_an_object_fails_the_step_naming_the_file(tmp_path, monkeypatch):
    S = claims_jobs.Scheduler(str(tmp_path), jobs=1, say=lambda m: None)

    def sh(cmd, log, threads=1, what=""):
        with open(cmd[-1], "w") as f:  # benchmarks.claims.work SPEC OUT
            f.write("[1]")
        return 0.0

    monkeypatch.setattr(S, "sh", sh)
    with pytest.raises(claims_jobs.ClaimsError) as e:
        S.worker("evaluate", {}, S.log("w"))
    assert "evaluate wrote no result object" in str(e.value) and ".json.out" in str(e.value)
