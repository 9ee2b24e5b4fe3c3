"""python -m benchmarks.claims: the job scheduler (dependency order, resuming, re-running what changed, one-line
failures), trainings that resume or start over, and the store that carries results and kept files to a new work
directory."""

import json
import os

import pytest

from benchmarks.claims import __main__ as claims
from benchmarks.claims import report as claims_report
from benchmarks.claims.common import train_summary, update_walls
from benchmarks.claims.jobs import ClaimsError, Job, Scheduler


def _jobs(S, ran, settings_b=1):
    def make(name):
        def run(job, S):
            ran.append(name)
            return {"value": name + "".join(S.result(d)["value"] for d in job.deps)}
        return run

    S.add(Job("a", make("a"), {"x": 1}))
    S.add(Job("b", make("b"), {"x": settings_b}, ["a"]))
    S.add(Job("c", make("c"), {"x": 1}, ["b"]))
    S.add(Job("d", make("d"), {"x": 1}, ["a"]))


def test_scheduler_runs_in_order_and_resumes_only_what_changed(tmp_path):
    ran = []
    S = Scheduler(str(tmp_path), jobs=2, say=lambda m: None)
    _jobs(S, ran)
    S.run_all()
    assert sorted(ran) == ["a", "b", "c", "d"] and ran.index("a") < ran.index("b") < ran.index("c")
    assert S.result("c")["value"] == "cba" and S.result("c")["ok"]
    ran.clear()
    S = Scheduler(str(tmp_path), jobs=2, say=lambda m: None)
    _jobs(S, ran)
    S.run_all()
    assert ran == [] and S.result("c")["value"] == "cba"  # everything finished earlier: read back
    S = Scheduler(str(tmp_path), jobs=1, say=lambda m: None)
    _jobs(S, ran, settings_b=2)
    S.run_all(["c"])
    assert ran == ["b", "c"]  # b's settings changed: b and what depends on it, not a, and d was not asked for


def test_a_failed_step_is_one_line_naming_its_log_and_keeps_what_finished(tmp_path):
    S = Scheduler(str(tmp_path), jobs=1, say=lambda m: None)
    S.add(Job("ok", lambda j, S: {"v": 1}, {}))
    S.add(Job("bad", lambda j, S: 1 / 0, {}, ["ok"]))
    with pytest.raises(ClaimsError) as e:
        S.run_all()
    assert "bad: ZeroDivisionError" in str(e.value) and "bad.error" in str(e.value) and "\n" not in str(e.value)
    assert json.load(open(S.result_path("ok")))["ok"] and not os.path.exists(S.result_path("bad"))
    S2 = Scheduler(str(tmp_path), say=lambda m: None)
    S2.add(Job("x", lambda j, S: {}, {}, ["missing"]))
    with pytest.raises(ClaimsError, match="no step named missing"):
        S2.run_all()


def test_no_training_starts_after_the_start_window_and_the_same_run_goes_on(tmp_path):
    """--start-within: the training running when the window closes finishes and its evaluation still runs; no
    training starts after it; the run stops with what is left, and the same command afterwards runs only the rest."""
    import time

    from benchmarks.claims.jobs import ClaimsPaused

    def slow(job, S):
        time.sleep(0.3)
        ran.append(job.name)
        return {}

    def add(S):
        for n in ("a", "b", "c"):
            S.add(Job(n, slow, {}, training=True))
            S.add(Job(f"{n}-eval", lambda j, S: ran.append(j.name) or {}, {}, [n]))

    ran = []
    S = Scheduler(str(tmp_path), jobs=1, say=lambda m: None)
    add(S)
    S.start_by = time.time() + 0.1  # closes while "a" trains
    with pytest.raises(ClaimsPaused, match=r"4 steps left .*\(b, b-eval, c, \.\.\.\).*run the same command again"):
        S.run_all()
    assert ran == ["a", "a-eval"] and json.load(open(S.result_path("a-eval")))["ok"]
    S = Scheduler(str(tmp_path), jobs=1, say=lambda m: None)
    add(S)
    S.run_all()
    assert ran == ["a", "a-eval", "b", "b-eval", "c", "c-eval"]


def test_the_start_window_is_a_flag_that_stops_with_status_3_and_no_report(tmp_path, monkeypatch):
    args, _ = claims.parse_args(["--paper", "msc", "--start-within", "0", "--workdir", str(tmp_path / "w"),
                                 "--docs-dir", str(tmp_path / "docs"), "--no-store"])
    assert args.start_within == 0 and "--start-within" not in claims_report.command(args, "msc")
    monkeypatch.setattr(claims.Corpus, "job", lambda self, name="data": Job(name, lambda j, S: {}, {}))
    assert claims.main(["--paper", "msc", "--start-within", "0", "--workdir", str(tmp_path / "w"),
                        "--docs-dir", str(tmp_path / "docs"), "--no-store"]) == 3
    assert not os.path.exists(tmp_path / "docs")


def test_provenance_says_what_the_steps_cost():
    # core-hours: each step's minutes times its threads; a result without minutes is not counted
    rec, line = claims_report.provenance([{"minutes": 30.0, "threads": 1, "code_commit": "a"},
                                          {"minutes": 15.0, "threads": 2, "code_commit": "a"},
                                          {"code_commit": "a"}], "x")
    assert rec["core_hours"] == 1.0 and "Cost: 1.0 core-hours of CPU over its 2 steps" in line
    # a training resumed with a longer budget: its last process ran 10 minutes, the whole training 50
    rec, _ = claims_report.provenance([{"minutes": 10.0, "train_minutes": 50.0, "threads": 1, "code_commit": "a"},
                                       {"minutes": 10.0, "train_minutes": None, "threads": 1}], "x")
    assert rec["core_hours"] == 1.0
    rec, line = claims_report.provenance([{"code_commit": "a"}], "x")
    assert rec["core_hours"] is None and "Cost" not in line


class _FakeTraining(Scheduler):
    """A scheduler whose fairseq-train writes checkpoint_last.pt and logs its command and one record, as
    Scheduler.sh and fairseq do; ``found``: the checkpoints the training found in its directory."""

    def fairseq(self, tool, argv, log, threads=1):
        ck = argv[argv.index("--save-dir") + 1]
        self.found = sorted(f for f in os.listdir(ck) if f.endswith(".pt"))
        with open(os.path.join(ck, "checkpoint_last.pt"), "w") as f:
            f.write(" ".join(argv))
        with open(log, "a") as f:
            f.write("$ python -m fairseq_cli.train " + " ".join(argv) + "\n2026-01-01 00:00:00 | INFO | "
                    "train_inner | " + json.dumps({"num_updates": "10", "loss": "5", "wps": "100"}) + "\n")
        return 1.0

    def worker(self, fn, kwargs, log, threads=1):
        return {"averaged": ["checkpoint_last.pt"]}


def test_a_training_whose_settings_changed_does_not_resume_the_old_checkpoints(tmp_path):
    """common.train_job: fairseq resumes checkpoint_last.pt of its save dir, so a job re-run with new settings (a new
    teacher, a new lr) must not find the checkpoints of the old ones; a run of the same settings that was cut
    resumes."""
    from benchmarks.claims import common

    def run(lr, cut=False):
        sched = _FakeTraining(str(tmp_path), say=lambda m: None)
        sched.add(common.train_job("t", sched, "bin", ["--lr", lr], [], {}))
        if cut:  # a run cut before its result: only the directory and the log are there
            os.remove(sched.result_path("t"))
        sched.run_all()
        return sched

    assert run("0.1").found == []
    assert run("0.1", cut=True).found == ["checkpoint_last.pt"]  # the same settings: resumed
    sched = run("0.2")
    assert sched.found == [] and len(common.json_records(sched.log("t", "train.log"), "train_inner")) == 1
    assert run("0.2", cut=True).found == ["checkpoint_last.pt"]
    os.remove(os.path.join(str(tmp_path), "checkpoints", "t", ".settings"))  # checkpoints nothing says the settings of
    assert run("0.2", cut=True).found == []


def test_a_training_given_a_larger_budget_goes_on_from_its_checkpoints(tmp_path):
    """common.train_job: a job re-run with only its --max-update raised keeps its checkpoints and its log (fairseq
    goes on to the new budget; the curve holds both processes' records); a smaller budget, or a larger one with
    another change, starts afresh."""
    from benchmarks.claims import common

    def run(max_update, lr="0.1"):
        sched = _FakeTraining(str(tmp_path), say=lambda m: None)
        sched.add(common.train_job("t", sched, "bin", ["--lr", lr, "--max-update", str(max_update)], [], {}))
        sched.run_all()
        return sched

    def records(sched):
        return len(common.json_records(sched.log("t", "train.log"), "train_inner"))

    assert run(100).found == []
    sched = run(200)
    assert sched.found == ["checkpoint_last.pt"] and records(sched) == 2  # went on from update 100
    sched = run(150)
    assert sched.found == [] and records(sched) == 1  # a smaller budget: afresh
    sched = run(300, lr="0.2")
    assert sched.found == [] and records(sched) == 1  # a larger budget and another lr: afresh
    assert run(400, lr="0.2").found == ["checkpoint_last.pt"]


def test_update_walls_counts_a_resumed_process_by_its_timestamps(tmp_path):
    """fairseq logs ``wall`` 0 throughout a process resumed from a checkpoint: the minutes of a cut-and-resumed
    training are the first process's wall plus the resumed one's time since it logged its configuration."""
    def inner(ts, updates, wall):
        return (f"2026-12-03 {ts} | INFO | train_inner | "
                f'{{"epoch": 1, "update": 1.0, "loss": "5.0", "wps": "100", "num_updates": "{updates}", '
                f'"wall": "{wall}"}}\n')

    config = "| INFO | fairseq_cli.train | {'_name': None, 'common': {}}\n"
    log = tmp_path / "train.log"
    log.write_text("2026-12-03 04:00:00 " + config + inner("04:01:00", 50, 60) + inner("04:02:00", 100, 120)
                   + "2026-12-03 06:00:00 " + config + inner("06:00:30", 100, 0) + inner("06:01:30", 150, 0))
    assert update_walls(str(log)) == [(50, 60.0), (100, 120.0), (100, 150.0), (150, 210.0)]
    assert train_summary(str(log))["train_minutes"] == 3.5
    # lines without a time: fairseq's walls, a restart found by a smaller wall
    plain = tmp_path / "plain.log"
    plain.write_text("".join(x.split(" ", 2)[2] for x in (inner("00:00:00", 50, 60), inner("00:00:00", 100, 30))))
    assert update_walls(str(plain)) == [(50, 60.0), (100, 90.0)]


def test_claims_average_keeps_the_newest_checkpoints_training_state(tmp_path):
    """The average of a training's last interval checkpoints records the update count it was trained to (the newest
    one's training state, as fairseq's average_checkpoints.py), not the oldest averaged one's."""
    import argparse

    import torch

    from benchmarks.claims import work
    from fairseq_ext import checkpoints

    for n, u in enumerate((500, 1000, 1500, 2000)):
        torch.save({"model": {"w": torch.full((2,), float(u))}, "args": argparse.Namespace(arch="x"),
                    "extra_state": {"epoch": 1}, "optimizer_history": [{"num_updates": u}]},
                   tmp_path / f"checkpoint_1_{u}.pt")
    res = work.average(str(tmp_path), str(tmp_path / "avg.pt"))
    assert res["averaged"] == ["checkpoint_1_2000.pt", "checkpoint_1_1500.pt", "checkpoint_1_1000.pt"]
    avg = checkpoints.load_checkpoint_file(str(tmp_path / "avg.pt"))
    assert avg["optimizer_history"][-1]["num_updates"] == 2000 and torch.equal(avg["model"]["w"],
                                                                                torch.full((2,), 1500.0))


def test_a_new_work_directory_takes_results_from_the_store_and_remakes_only_the_files_a_step_reads(tmp_path):
    """A run in one work directory with a store; then a new work directory with the same store: nothing runs again;
    a new step that reads a file of a finished step runs that step again first, and what it depends on (a corpus
    whose files its result does not name), while the steps that need only results do not run."""
    store = str(tmp_path / "store")

    def jobs(S, ran, extra=False):
        def make_corpus(job, S):
            ran.append("corpus")
            with open(os.path.join(S.dir("files"), "corpus.txt"), "w") as f:
                f.write("weights")
            return {}

        def make_file(job, S):
            ran.append("a")
            with open(os.path.join(S.W, "files", "corpus.txt")) as f:
                text = f.read()
            path = os.path.join(S.dir("files"), "a.txt")
            with open(path, "w") as f:
                f.write(text)
            return {"file": path}

        def read_file(job, S):
            ran.append(job.name)
            with open(S.result("a")["file"]) as f:
                return {"value": f.read()}

        S.add(Job("corpus", make_corpus, {"x": 1}))
        S.add(Job("a", make_file, {"x": 1}, ["corpus"]))
        S.add(Job("b", read_file, {"x": 1}, ["a"]))
        S.add(Job("c", lambda job, S: ran.append("c") or {"value": S.result("b")["value"] + "!"}, {"x": 1}, ["b"]))
        if extra:
            S.add(Job("d", read_file, {"x": 1}, ["a"]))

    ran = []
    S = Scheduler(str(tmp_path / "w1"), say=lambda m: None, store=store)
    jobs(S, ran)
    S.run_all()
    assert ran == ["corpus", "a", "b", "c"]
    assert sorted(os.listdir(store)) == ["a.json", "b.json", "c.json", "corpus.json"]
    ran.clear()
    S = Scheduler(str(tmp_path / "w2"), say=lambda m: None, store=store)  # a fresh machine, the store committed
    jobs(S, ran)
    S.run_all()
    assert ran == [] and S.result("c")["value"] == "weights!"
    said = []
    S = Scheduler(str(tmp_path / "w3"), say=said.append, store=store)
    jobs(S, ran, extra=True)
    S.run_all()
    assert ran == ["corpus", "a", "d"] and S.result("d")["value"] == "weights"  # b and c not
    assert any("run again to remake the files" in m and ": corpus, a" in m for m in said)
    ran.clear()
    S = Scheduler(str(tmp_path / "w3"), say=lambda m: None, store=store)  # the same directory again: all here
    jobs(S, ran, extra=True)
    S.run_all()
    assert ran == []
    S = Scheduler(str(tmp_path / "w4"), say=lambda m: None)  # no store: everything runs
    jobs(S, ran)
    S.run_all()
    assert ran == ["corpus", "a", "b", "c"]


def test_a_kept_checkpoint_comes_back_in_a_new_work_directory_and_a_step_made_again_keeps_its_result(tmp_path):
    """A step that keeps its checkpoint (Job.keep) copies it into the store without the optimizer's state; a new
    work directory puts it back instead of training again; where the kept copy is gone or altered, the step runs
    again to make its file, and its recorded result (what later steps used) stands, the new run's under
    ``remade``."""
    import torch

    store = str(tmp_path / "store")
    trained = []

    def jobs(S, ran, readers=("r",)):
        def train(job, S):
            trained.append(len(trained))
            path = os.path.join(S.dir("checkpoints", "t"), "checkpoint_avg.pt")
            embed = torch.arange(6.0)  # averaging unties the shared embeddings: equal tensors, saved once
            torch.save({"model": {"w": torch.full((3,), float(len(trained))), "embed": embed, "out": embed.clone()},
                        "last_optimizer_state": {"exp_avg": torch.ones(1000)}}, path)
            return {"checkpoint": path, "loss": float(len(trained)), "summary": f"run {len(trained)}"}

        def read(job, S):
            ran.append(job.name)
            return {"w": torch.load(S.result("t")["checkpoint"], weights_only=False)["model"]["w"].tolist()}

        S.add(Job("t", train, {"x": 1}, keep=["checkpoint"]))
        for name in readers:
            S.add(Job(name, read, {"x": 1}, ["t"]))

    ran = []
    S = Scheduler(str(tmp_path / "w1"), say=lambda m: None, store=store)
    jobs(S, ran)
    S.run_all()
    kept = os.path.join(store, "files", "t.checkpoint.pt")
    state = torch.load(kept, weights_only=False)
    assert state["last_optimizer_state"] is None and state["model"]["w"].tolist() == [1.0, 1.0, 1.0]
    assert state["model"]["out"].tolist() == list(range(6)) and state["model"]["out"].untyped_storage().data_ptr() \
        == state["model"]["embed"].untyped_storage().data_ptr()
    assert json.load(open(os.path.join(store, "t.json")))["kept"]["checkpoint"]["file"] == "files/t.checkpoint.pt"
    said = []
    S = Scheduler(str(tmp_path / "w2"), say=said.append, store=store)  # a new machine: the file comes back
    jobs(S, ran, readers=("r", "r2"))
    S.run_all()
    assert trained == [0] and ran == ["r", "r2"] and S.result("r2")["w"] == [1.0, 1.0, 1.0]
    assert os.path.isfile(tmp_path / "w2" / "checkpoints" / "t" / "checkpoint_avg.pt")
    assert any("restored t's checkpoint" in m for m in said)
    torch.save({"model": {"w": torch.zeros(3)}}, kept)  # not the file kept: the step runs again
    said.clear()
    S = Scheduler(str(tmp_path / "w3"), say=said.append, store=store)
    jobs(S, ran, readers=("r", "r3"))
    S.run_all()
    t = S.result("t")
    assert trained == [0, 1] and S.result("r3")["w"] == [2.0, 2.0, 2.0]
    assert t["loss"] == 1.0 and t["summary"] == "run 1" and t["remade"]["loss"] == 2.0
    assert t["checkpoint"].startswith(str(tmp_path / "w3"))
    assert any("not the file kept" in m for m in said) and any("made again" in m for m in said)
    assert torch.load(kept, weights_only=False)["model"]["w"].tolist() == [2.0, 2.0, 2.0]  # the new file kept
    assert json.load(open(os.path.join(store, "t.json")))["remade"]["summary"] == "run 2"


def test_a_step_that_reads_only_results_does_not_make_its_deps_files_again(tmp_path):
    """In a new work directory, a new step that reads only its dep's result (``reads_files=False``: the SAT
    teacher's scores copied from its round's evaluation) runs without training the dep again."""
    store, ran = str(tmp_path / "store"), []

    def jobs(S, extra):
        S.add(Job("a", lambda job, S: ran.append("a") or {"file": os.path.join(S.dir("f"), "a.pt"), "v": 1}, {}))
        if extra:
            S.add(Job("copy", lambda job, S: ran.append("copy") or {"v": S.result("a")["v"]}, {}, ["a"],
                      reads_files=False))
            S.add(Job("read", lambda job, S: ran.append("read") or {}, {}, ["a"]))

    S = Scheduler(str(tmp_path / "w1"), say=lambda m: None, store=store)
    jobs(S, False)
    S.run_all()
    S = Scheduler(str(tmp_path / "w2"), say=lambda m: None, store=store)
    jobs(S, True)
    S.run_all(["copy"])
    assert ran == ["a", "copy"] and S.result("copy")["v"] == 1
    S.run_all(["read"])  # a step that reads the file: the dep runs again first
    assert ran == ["a", "copy", "a", "read"]
