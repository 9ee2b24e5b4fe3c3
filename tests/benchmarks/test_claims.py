"""python -m benchmarks.claims: the report (CLAIMS.md sections replaced per paper, the command it names) and the MSC,
ConvS2S and BERT-JAM steps (pilots, verdicts, figures, the claims timing)."""

import json
import os

import pytest

from benchmarks.claims import __main__ as claims
from benchmarks.claims import bert_jam as claims_bert_jam
from benchmarks.claims import convs2s as claims_convs2s
from benchmarks.claims import msc as claims_msc
from benchmarks.claims import report as claims_report
from benchmarks.claims.common import Corpus
from benchmarks.claims.jobs import ClaimsError, Job, Scheduler
from tests.benchmarks.claims_fakes import bleu_result


def test_report_replaces_one_papers_section_and_keeps_the_others(tmp_path):
    d = str(tmp_path)
    claims_report.write(d, "sat", "## SAT\nold-section", {"verdict": "not reproduced", "reason": "r1"})
    claims_report.write(d, "msc", "## MSC\nonly", {"verdict": "reproduced", "reason": "r2"})
    claims_report.write(d, "sat", "## SAT\nsecond", {"verdict": "reproduced", "reason": "r3"})
    md = open(os.path.join(d, "CLAIMS.md")).read()
    assert md.startswith("# The papers' claims") and "old-section" not in md and md.count("## SAT\nsecond") == 1
    assert md.index("## SAT") < md.index("## MSC") and "## MSC\nonly" in md
    rec = json.load(open(os.path.join(d, "claims.json")))
    assert (rec["sat"]["verdict"], rec["sat"]["reason"], rec["msc"]["verdict"]) == ("reproduced", "r3", "reproduced")
    for bad in ({"verdict": "works", "reason": "x"}, {"verdict": "reproduced", "reason": ""}):
        with pytest.raises(ValueError):
            claims_report.write(d, "sat", "x", bad)
    assert json.load(open(os.path.join(d, "claims.json"))) == rec  # a refused record changes nothing


def test_the_command_a_report_names_has_the_non_default_flags():
    args, _ = claims.parse_args(["--paper", "sat", "--sat-ks", "1,2", "--workdir", "/tmp/w", "--jobs", "1"])
    assert claims_report.command(args, "sat") == "python -m benchmarks.claims --paper sat --jobs 1 --sat-ks 1,2"


def test_a_verdict_stands_only_when_every_arm_is_past_its_early_regime():
    assert claims_report.past_early_regime("reproduced", "R.", "", "--x") == ("reproduced", "R.")
    v, reason = claims_report.past_early_regime("not reproduced", "R. Still falling: a.", "Still falling: a.", "--x")
    assert v == "not tested" and reason.endswith('(as measured they read "not reproduced"; a longer budget, --x, '
                                                 'would test them). R. Still falling: a.')


def test_msc_verdict_follows_the_issue_targets():
    def bleu(**kw):  # VARIANTDEPTH=BLEU
        return {(k.rstrip("0123456789"), int(k.lstrip("abcdefghijklmnopqrstuvwxyz"))): v for k, v in kw.items()}

    assert claims_msc.verdict(bleu(post6=20, pre6=20, msc6=20.5, post12=15, pre12=20, msc12=21.0), [6, 12])[0] \
        == "reproduced"  # +1.0 over pre-norm-12 and above MSC-6
    v, reason = claims_msc.verdict(bleu(post6=20, pre6=20, msc6=20.5, post12=15, pre12=20.1, msc12=21.0), [6, 12])
    assert v == "partly reproduced" and "Holds: MSC-12 >= MSC-6. Missed: MSC-12 >= pre-norm-12 + 1.0" in reason
    # no encoder gains from depth: MSC failing its targets still reads "not reproduced" (the rule is not circular)
    v, reason = claims_msc.verdict(bleu(post6=20, pre6=20, msc6=21, post12=10, pre12=19, msc12=19.5), [6, 12])
    assert v == "not reproduced" and "msc -1.50" in reason


def _msc_report(tmp_path, test, flat=True, flags=(), best=None, falling=()):
    """The MSC report from fabricated results: (variant, depth) -> test BLEU of the last-3 average (valid: test + 5,
    train: test + 10); ``best``: (variant, depth) -> test BLEU of the checkpoint of the best valid loss (valid: test +
    5; default: the average's - 1); ``falling``: the (variant, depth) whose curve still falls (all: not ``flat``)."""
    args, _ = claims.parse_args(["--paper", "msc", "--docs-dir", str(tmp_path / "docs"),
                                 "--workdir", str(tmp_path / "w"), *flags])
    S = Scheduler(str(tmp_path / "w"), say=lambda m: None)
    curve = [(500, 6.0), (4000, 4.6), (6000, 4.52), (8000, 4.50)]
    names = []
    for (variant, depth), b in test.items():
        n = f"msc-{variant}{depth}"
        names.append(n)
        down = not flat or (variant, depth) in falling
        S.results[n] = {"updates": 8000, "minutes": 60.0 * depth / 6, "checkpoint": "x", "valid_loss_best": 4.5,
                        "train_loss_last": 4.4, "valid_curve": curve[:-1] + [(8000, 4.3 if down else 4.5)],
                        "seed": "1"}
        S.results[f"{n}-eval"] = {k: v for k, v in bleu_result(b).items() if "greedy" not in k} | {
            "bleu_valid_beam4": b + 5.0}
        bb = (best or {}).get((variant, depth), b - 1.0)
        S.results[f"{n}-best-eval"] = {k: v for k, v in bleu_result(bb).items() if "greedy" not in k} | {
            "bleu_valid_beam4": bb + 5.0}
        S.results[f"{n}-train-bleu"] = {"variant": variant, "depth": depth, "train_bleu": b + 10.0,
                                        "valid_bleu": b + 5.0}
    outcome = {"models": names, "chosen": {f"{v}{d}": {"lr": 0.001, "warmup": 500} for v, d in test},
               "pilots": {"msc-pilot-msc6-lr0.001-w1000": 5.0}}
    claims_msc.report(type("Ctx", (), {"S": S, "args": args})(), outcome)
    docs = tmp_path / "docs"
    return json.load(open(docs / "claims.json"))["msc"], (docs / "CLAIMS.md").read_text()


def test_msc_report_orders_rows_by_depth_names_its_training_set_and_what_did_not_fit(tmp_path):
    test = {("msc", 12): 24.0, ("pre", 12): 21.0, ("post", 12): 1.0, ("msc", 6): 23.0, ("pre", 6): 22.0,
            ("post", 6): 21.5}  # in the order the run trains them: deepest first
    rec, md = _msc_report(tmp_path / "met", test)
    assert rec["verdict"] == "reproduced" and rec["train_verses"] == 8000
    rows = [line.split(" | ")[:2] for line in md.splitlines()
            if line.startswith("| ") and (" | 6 | " in line or " | 12 | " in line)]
    assert rows == [["| post-norm transformer", "6"], ["| pre-norm transformer", "6"], ["| MSC", "6"],
                    ["| post-norm transformer", "12"], ["| pre-norm transformer", "12"], ["| MSC", "12"]]
    assert "on the first 8,000 training verses of one shuffled order" in md
    assert "A 24-layer MSC would train about 4.0 h on one core" in md  # twice the 12-layer model's 120 min
    assert "The post-norm control did not train at 12 layers" in rec["reason"]
    assert "Figure 2 (BLEU on training pairs, 6 -> 12 layers): post 31.50 -> 11.00" in rec["reason"]

    assert rec["models"]["msc12"]["checkpoint"] == "last 3 averaged"
    assert rec["models"]["msc12"]["valid_beam4_by_checkpoint"] == {"last3_average": 29.0, "best_valid_loss": 28.0}

    rec, _ = _msc_report(tmp_path / "missed", test | {("msc", 12): 21.5, ("msc", 6): 21.0})  # +0.5 over pre-12
    assert rec["verdict"] == "partly reproduced" and "Missed: MSC-12 >= pre-norm-12 + 1.0" in rec["reason"]
    # the checkpoint of the best valid loss wins on valid: its test BLEU is the model's, and meets the target
    rec, md = _msc_report(tmp_path / "best", test | {("msc", 12): 21.5, ("msc", 6): 21.0}, best={("msc", 12): 22.5})
    assert rec["verdict"] == "reproduced" and rec["models"]["msc12"]["test_beam4"] == 22.5
    assert rec["models"]["msc12"]["checkpoint"] == "best valid loss (8000)"
    assert "| MSC | 12 | best valid loss (8000) | 27.50 | 22.50 |" in md
    assert rec["models"]["msc6"]["checkpoint"] == "last 3 averaged"
    rec, _ = _msc_report(tmp_path / "falling", test, flat=False)
    assert rec["verdict"] == "not tested" and "still" in rec["reason"].lower()
    rec, _ = _msc_report(tmp_path / "msc6-falling", test, falling={("msc", 6)})  # an arm a target compares
    assert rec["verdict"] == "not tested" and "(>= 1% valid loss): msc6." in rec["reason"]
    rec, _ = _msc_report(tmp_path / "control-falling", test, falling={("post", 6), ("pre", 6)})  # no target reads
    assert rec["verdict"] == "reproduced"
    assert "(>= 1% valid loss): post6, pre6; no target reads them." in rec["reason"]
    rec, md = _msc_report(tmp_path / "all", test, flags=("--msc-train-verses", "0"))
    assert rec["train_verses"] is None and "updates (no early stopping), one thread each, on all training verses" in md


def test_msc_names_a_post_norm_control_that_did_not_train():
    valid = {("post", 6): 4.9, ("pre", 6): 10.0, ("msc", 6): 11.0, ("post", 12): 1.7, ("pre", 12): 9.0,
             ("msc", 12): 12.0}
    said = claims_msc.untrained_controls(valid, [6, 12])
    assert "did not train at 6 / 12 layers" in said and "4.90 against 10.00 at 6" in said
    valid[("post", 6)] = 5.0  # half the pre-norm model's: trained (at 12 it still did not)
    assert "did not train at 12 layers" in claims_msc.untrained_controls(valid, [6, 12])
    valid[("post", 12)] = 8.0
    assert claims_msc.untrained_controls(valid, [6, 12]) == ""


def test_convs2s_verdict_needs_every_control_beaten():
    assert claims_convs2s.verdict(20.0, 18.0, 19.0, (19.5, 17.0), speedup=6.0)[0] == "reproduced"
    v, reason = claims_convs2s.verdict(20.0, 18.0, 20.5, (19.5, 17.0), speedup=3.0)
    assert v == "partly reproduced" and "Missed: ConvS2S >= 5x the LSTM's CPU translation speed" in reason
    assert "multi-step attention: -0.50" in reason and "equal minutes: +2.50" in reason
    v, reason = claims_convs2s.verdict(20.0, 21.0, 19.0, None)
    assert v == "not reproduced" and reason.startswith("Missed: ConvS2S >= LSTM at equal updates")


def _bert_jam_report(tmp_path, bleus, std=None):
    """The BERT-JAM report from fabricated results: size -> (test BLEU of the two baselines by dropout, of phase 1 at
    dropout 0.1 and 0.3, phases 2, 3 and the control); valid BLEU is test + 1, so the better test is chosen; the
    standard-decoder phase 1 scores ``std`` (default: phase 1's chosen - 0.5), phase 1 reading e5's layer 6 phase 1's
    chosen + 0.25."""
    args, _ = claims.parse_args(["--paper", "bert_jam", "--bj-sizes", ",".join(map(str, bleus)),
                                 "--docs-dir", str(tmp_path / "docs"), "--workdir", str(tmp_path / "w")])
    S = Scheduler(str(tmp_path / "w"), say=lambda m: None)
    outcome = {"sizes": list(bleus), "chains": {}, "bases": {}, "p1_by_dropout": {}, "controls": {}}
    curve = [(100, 8.0), (400, 7.5), (800, 7.45)]
    for n, (base, p1, phases) in bleus.items():
        outcome["bases"][n] = [f"bj-{n}-base-d{d}" for d in base]
        outcome["p1_by_dropout"][n] = [f"bj-{n}-p1-d{d}" for d in p1]
        chosen_p1 = f"bj-{n}-p1-d{max(p1, key=p1.get)}"
        outcome["chains"][n] = {"p1": chosen_p1, **{k: f"bj-{n}-{k}" for k in ("p2", "p3", "ctrl")}}
        outcome["controls"][n] = {"zeros": f"bj-{n}-p1-zeros", "std": f"bj-{n}-p1-std", "layer": f"bj-{n}-p1-layer6"}
        named = [*zip(outcome["bases"][n], base.values()), *zip(outcome["p1_by_dropout"][n], p1.values()),
                 *zip([f"bj-{n}-{k}" for k in ("p2", "p3", "ctrl")], phases),
                 (f"bj-{n}-p1-std", std if std is not None else max(p1.values()) - 0.5),
                 (f"bj-{n}-p1-layer6", max(p1.values()) + 0.25)]
        for name, b in named:
            S.results[name] = {"updates": 500, "minutes": 5.0, "s_per_update": 0.6, "cache_minutes": 0.0,
                               "checkpoint": "x", "valid_loss_best": 8.0 - b / 10, "valid_curve": curve}
            S.results[f"{name}-eval"] = {k: v for k, v in bleu_result(b).items() if "greedy" not in k} | {
                "bleu_valid_beam4": b + 1.0}
        S.results[f"bj-{n}-p1-zeros"] = {"updates": 400, "minutes": 4.0, "s_per_update": 0.6, "cache_minutes": 0.0,
                                         "checkpoint": "x", "valid_loss_best": 7.125, "valid_curve": curve}
        chosen = max(base, key=base.get)
        S.results[f"bj-{n}-base-test"] = {"bleu_test_beam4": base[chosen], "chosen": f"bj-{n}-base-d{chosen}",
                                          "dropout": float(chosen)}
    S.results["bj-e5"] = {"pruned_vocab_size": 25000, "layers": 12, "hidden": 384}
    ctx = type("Ctx", (), {"S": S, "args": args})()
    claims_bert_jam.report(ctx, outcome)
    docs = tmp_path / "docs"
    assert (docs / "claims_bert_jam_bleu_by_size.png").read_bytes()[:4] == b"\x89PNG"
    return json.load(open(docs / "claims.json"))["bert_jam"], (docs / "CLAIMS.md").read_text()


def test_bert_jam_report_gaps_and_verdict_follow_the_results(tmp_path):
    base = {"0.1": 5.0, "0.3": 6.0}
    p1 = {"0.1": 7.5, "0.3": 7.0}  # BERT-JAM's dropout chosen like the baseline's: 0.1 here, 0.3 for the baseline
    rec, md = _bert_jam_report(tmp_path / "met", {2000: (base, p1, [8.0, 9.5, 8.5]),
                                                  8000: ({"0.1": 12.0, "0.3": 11.0}, p1, [13.0, 14.0, 13.5])})
    assert rec["gap_test"] == {"2000": 3.5, "8000": 2.0} and rec["phase3_minus_control_test"]["2000"] == 1.0
    assert rec["verdict"] == "reproduced" and "Every size run meets its target" in rec["reason"]
    assert rec["not_run"] == [] and rec["targets"] == {"2000": 1.0, "8000": 1.0}
    assert rec["sizes"]["8000"]["baseline"] == {"dropout": 0.1, "valid_beam4": 13.0, "test_beam4": 12.0,
                                                "valid_by_dropout": {"0.1": 13.0, "0.3": 12.0}}
    assert rec["sizes"]["2000"]["dropout"] == 0.1 and rec["sizes"]["2000"]["p1_valid_by_dropout"] == {
        "0.1": 8.5, "0.3": 8.0}
    assert "phase 3 9.50 (dropout 0.1) vs baseline 6.00 (dropout 0.3), +3.50" in rec["reason"]
    assert "| Transformer (chosen on valid) | 0.3 | 7.400 | 7.00 | 6.00 | 500 | 0.7% | 5 | 0.60 | 0 |" in md
    assert "| Transformer | 0.1 | 7.500 | 6.00 | - |" in md  # the other dropout is never decoded on test
    assert "| BERT-JAM phase 1 (chosen on valid) | 0.1 | 7.250 | 8.50 | 7.50 |" in md
    assert "| BERT-JAM phase 1 | 0.3 | 7.300 | 8.00 | - |" in md
    assert "| BERT-JAM phase 3 | 0.1 | 7.050 | 10.50 | 9.50 | 500 |" in md
    # the two controls of phase 1 at every size: e5's features set to zero, fairseq's standard decoder
    assert "| phase 1, every e5 feature set to zero | 0.1 | 7.125 | - | - | 400 |" in md
    assert rec["standard_decoder_minus_joint_test"] == {"2000": -0.5, "8000": -0.5}
    assert "2000 verses: 7.125 on zeros, 7.250 with e5, 7.400 for the baseline" in rec["reason"]
    assert rec["sizes"]["2000"]["p1_zero_features"]["valid_loss_best"] == 7.125
    # the layer choice: phase 1 reading e5's middle layer, beside the last
    assert "| phase 1 reading e5's layer 6, not the last | 0.1 | 7.225 | 8.75 | 7.75 | 500 |" in md
    assert "(valid BLEU, beam 4): +0.25 at 2000 (layer 6), +0.25 at 8000 (layer 6)." in rec["reason"]
    assert rec["sizes"]["8000"]["p1_middle_layer"]["layer"] == 6
    assert rec["sizes"]["8000"]["p1_middle_layer"]["valid_beam4"] == 8.75
    rec, _ = _bert_jam_report(tmp_path / "part", {2000: (base, p1, [8.0, 9.0, 8.5])}, std=8.0)
    assert rec["verdict"] == "partly reproduced" and rec["not_run"] == [8000]
    assert "Every size run meets its target" in rec["reason"] and "8000 verses (target +1.0)" in rec["reason"]
    assert rec["standard_decoder_minus_joint_test"] == {"2000": 0.5}
    rec, _ = _bert_jam_report(tmp_path / "miss", {2000: (base, p1, [8.0, 6.5, 8.5]),
                                                  8000: (base, p1, [8.0, 9.0, 8.5])})
    assert rec["verdict"] == "partly reproduced" and "Missed at 2000 verses" in rec["reason"]
    rec, _ = _bert_jam_report(tmp_path / "none", {2000: (base, p1, [8.0, 6.5, 8.5]),
                                                  8000: (base, p1, [8.0, 6.0, 8.5])})
    assert rec["verdict"] == "not reproduced"


def test_convs2s_arms_are_tuned_and_annealed_alike():
    """Both arms: the same number of pilots, x2 apart, and the paper's schedule as fairseq parses it (lr / 10 at the
    end of an epoch not 1% below the best valid loss, validated at every epoch's end); the LSTM keeps its warmup."""
    import argparse

    from fairseq import options

    import fairseq_ext  # noqa: F401  (registers fconv_glu, as --user-dir does)

    a = argparse.Namespace(dim=128, smoke=False)
    c = claims_convs2s.ConvS2S(type("Ctx", (), {"S": None, "args": a, "corpus": None})())
    assert len(claims_convs2s.LRS["fconv"]) == len(claims_convs2s.LRS["lstm"])
    for lrs in claims_convs2s.LRS.values():
        assert all(b == 2 * x for x, b in zip(lrs, lrs[1:]))
    parsed = {}
    for kind, lr in (("fconv", 0.5), ("lstm", 0.003)):
        argv = ["data-bin", *c.model(kind, lr), *c.common(1000)]
        parsed[kind] = options.parse_args_and_arch(options.get_training_parser(), argv)
    for p in parsed.values():
        assert (p.lr_scheduler, p.lr_shrink, p.lr_patience, p.lr_threshold) == ("reduce_lr_on_plateau", 0.1, 0, 0.01)
        assert p.validate_interval == 1 and p.validate_interval_updates == 250 and p.patience == -1
        assert p.max_update == 1000 and p.max_tokens == 1024
    assert (parsed["fconv"].optimizer, parsed["fconv"].warmup_updates) == ("nag", 0)
    assert (parsed["lstm"].optimizer, parsed["lstm"].warmup_updates) == ("adam", 200)


class _FakePilots:
    """A scheduler whose pilots score ``score(kind, lr)`` (their eval jobs are never run)."""

    def __init__(self, score):
        self.jobs, self.results, self.score = {}, {}, score

    def add(self, job):
        assert job.name not in self.jobs
        self.jobs[job.name] = job

    def run_all(self, names):
        for n in names:
            kind, lr = n.split("-")[1], float(n.split("-lr")[1][: -len("-eval")])
            self.results[n] = {"bleu_valid_greedy": self.score(kind, lr)}

    def result(self, n):
        return self.results[n]


def _convs2s_pilots(score):
    import argparse

    a = argparse.Namespace(dim=128, smoke=False, convs2s_pilot_updates=800)
    S = _FakePilots(score)
    ctx = type("Ctx", (), {"S": S, "args": a, "corpus": type("C", (), {"bin": "bin"})(),
                            "say": staticmethod(lambda m: None)})()
    chosen, scored = claims_convs2s.ConvS2S(ctx).pilots()
    tried = {k: sorted(float(n.split("-lr")[1]) for n in scored if n.startswith(f"convs2s-{k}-")) for k in chosen}
    return chosen, tried


def test_convs2s_pilots_go_past_a_grid_edge_by_one_rule_for_both_arms():
    # fconv's best is past its grid's top (2.0, then 4.0 falls): two more pilots; the LSTM's is inside: none
    chosen, tried = _convs2s_pilots(lambda k, lr: -abs(lr - 2.0) if k == "fconv" else -abs(lr - 0.003))
    assert chosen == {"fconv": 2.0, "lstm": 0.003}
    assert tried == {"fconv": [0.25, 0.5, 1.0, 2.0, 4.0], "lstm": [0.0015, 0.003, 0.006]}
    # still rising at the last extension: the edge is taken (the report says so through the pilot table)
    chosen, tried = _convs2s_pilots(lambda k, lr: lr)
    assert chosen == {"fconv": 4.0, "lstm": 0.024} and len(tried["fconv"]) == len(tried["lstm"]) == 5
    # best below the grid: extended downwards
    chosen, tried = _convs2s_pilots(lambda k, lr: -lr)
    assert chosen == {"fconv": 0.0625, "lstm": 0.000375} and tried["fconv"][:2] == [0.0625, 0.125]


def test_msc_pilots_go_past_the_grid_edge_with_the_edges_warmup_at_every_depth():
    """Every encoder at every depth gets the grid's four (lr, warm-up) pilots; one whose best is the highest rate gets
    pilots at x2 (warm-up 500) while that stays best, at most two, one whose best is the lowest at /2 (warm-up
    1000); a best inside the grid ends its pilots. Each depth keeps its own choice."""
    import argparse

    best = {("post", 12): 0.012, ("pre", 12): 0.0015, ("msc", 12): 0.006,  # past twice; inside; past once
            ("post", 6): 0.00025, ("pre", 6): 0.001, ("msc", 6): 0.003}  # below once; inside; the top edge holds

    class S:
        results, jobs = {}, {}

        @classmethod
        def run_all(cls, names):
            for n in names:
                arm, lr = n[len("msc-pilot-"):].split("-lr")
                v, d, lr = arm.rstrip("0123456789"), int(arm.lstrip("postremc")), float(lr.split("-w")[0])
                cls.results[n] = {"bleu_valid_greedy": 20.0 - abs(lr - best[(v, d)]) * 1000}

        @classmethod
        def result(cls, n):
            return cls.results[n]

    msc = object.__new__(claims_msc.MSC)
    msc.S, msc.depths = S, [6, 12]
    msc.a = argparse.Namespace(msc_pilot_updates=2000)
    msc.ctx = type("Ctx", (), {"say": lambda self, m: None})()
    msc.pilot = lambda arm, lr: f"msc-pilot-{arm[0]}{arm[1]}-lr{lr}-w{claims_msc.warmup_of(lr)}-eval"
    chosen, scored = msc.pilots()
    assert chosen == {("post", 12): (0.012, 500), ("pre", 12): (0.0015, 500), ("msc", 12): (0.006, 500),
                      ("post", 6): (0.00025, 1000), ("pre", 6): (0.001, 1000), ("msc", 6): (0.003, 500)}
    grid = [0.0005, 0.001, 0.0015, 0.003]
    tried = {arm: sorted(float(n.split("-lr")[1].split("-w")[0]) for n in scored
                         if n.startswith(f"msc-pilot-{arm[0]}{arm[1]}-")) for arm in best}
    assert tried == {("post", 12): grid + [0.006, 0.012], ("pre", 12): grid, ("msc", 12): grid + [0.006, 0.012],
                     ("post", 6): [0.000125, 0.00025] + grid, ("pre", 6): grid, ("msc", 6): grid + [0.006]}
    assert "msc-pilot-pre12-lr0.0005-w1000" in scored and claims_msc.warmup_of(0.00025) == 1000
    # a pilot reaches every peak rate it scores: each warm-up ends by half the pilot
    assert all(w <= 2000 // 2 for _, w in claims_msc.PILOTS)


def test_msc_models_train_at_their_own_depths_choice(tmp_path):
    """MSC.run: each (encoder, depth) model trains at the rate and warm-up its own depth's pilots chose, all at the
    same budget, and the outcome names each choice by encoder and depth."""
    import argparse

    S = Scheduler(str(tmp_path / "w"), say=lambda m: None)
    S.run_all = lambda names=None: None
    a = argparse.Namespace(dim=128, smoke=False, msc_depths="6,12", msc_updates=12000, msc_pilot_updates=2000,
                           msc_dropout=0.1, msc_train_sample=1000, msc_train_verses=8000)
    ctx = type("Ctx", (), {"S": S, "args": a, "corpus": Corpus(S)})()
    msc = claims_msc.MSC(ctx)
    chosen = {(v, d): (lr, w) for (v, lr, w) in (("post", 0.0005, 1000), ("pre", 0.0015, 500), ("msc", 0.003, 500))
              for d in (6, 12)}
    chosen[("post", 12)] = (0.003, 500)
    msc.pilots = lambda: (chosen, {})
    outcome = msc.run()

    def arg(name, flag):
        argv = S.jobs[name].settings["argv"]
        return argv[argv.index(flag) + 1]

    assert (arg("msc-post6", "--lr"), arg("msc-post6", "--warmup-updates")) == ("0.0005", "1000")
    assert (arg("msc-post12", "--lr"), arg("msc-post12", "--warmup-updates")) == ("0.003", "500")
    assert {arg(f"msc-{v}{d}", "--max-update") for v in claims_msc.VARIANTS for d in (6, 12)} == {"12000"}
    assert outcome["chosen"]["post6"] == {"lr": 0.0005, "warmup": 1000}
    assert outcome["chosen"]["post12"] == {"lr": 0.003, "warmup": 500}
    # the compared models train (and are scored on training pairs) on the subset; deepest first
    finals = [n for n in S.jobs if n.startswith("msc-") and n[4:].rstrip("0123456789") in claims_msc.VARIANTS]
    assert finals == ["msc-msc12", "msc-pre12", "msc-post12", "msc-msc6", "msc-pre6", "msc-post6"]
    assert {S.jobs[n].settings["bin"] for n in finals} == {"bin-de-en-8000"}
    assert all(S.jobs[n].deps == ["msc-data-8000"] for n in finals)
    assert all(S.jobs[f"{n}-train-bleu"].deps == [n, "msc-data-8000"] for n in finals)
    assert all(S.jobs[f"{n}-best-eval"].deps == [n] for n in finals)  # the other candidate checkpoint, on valid
    assert S.jobs["msc-data-8000"].settings == {"n": 8000, "seed": 1}

    a.msc_train_verses = 0  # all verses: the pilots' data
    S2 = Scheduler(str(tmp_path / "w2"), say=lambda m: None)
    S2.run_all = lambda names=None: None
    msc = claims_msc.MSC(type("Ctx", (), {"S": S2, "args": a, "corpus": Corpus(S2)})())
    msc.pilots = lambda: (chosen, {})
    msc.run()
    assert S2.jobs["msc-msc6"].settings["bin"] == "bin-de-en" and S2.jobs["msc-msc6"].deps == ["data"]


def test_a_training_subset_is_the_head_of_one_shuffled_order_so_smaller_sets_nest(tmp_path, monkeypatch):
    """Corpus.subset_job: the first N verses of one seeded order, source and target still aligned, in corpus order,
    binarised with the full valid and test sets; a smaller N gives a subset of a larger one."""
    S = Scheduler(str(tmp_path / "w"), say=lambda m: None)
    corpus = Corpus(S)
    os.makedirs(corpus.data)
    for lang in ("de", "en"):
        with open(os.path.join(corpus.data, f"train.spm.{lang}"), "w", encoding="utf-8") as f:
            f.writelines(f"{lang} {i}\n" for i in range(50))
    calls = []
    monkeypatch.setattr(S, "fairseq", lambda tool, argv, log, threads=1: calls.append(argv) or 0.0)
    kept = {}
    for n in (10, 30):
        job = corpus.subset_job(n, f"d-{n}", f"text-{n}")
        assert job.run(job, S)["verses"] == n
        text = {lang: open(os.path.join(S.W, f"text-{n}", f"train.spm.{lang}"), encoding="utf-8").read().split("\n")
                for lang in ("de", "en")}
        ids = [int(line.split()[1]) for line in text["de"] if line]
        assert ids == sorted(ids) and len(set(ids)) == n
        assert [line.replace("de", "en", 1) for line in text["de"]] == text["en"]
        kept[n] = set(ids)
        argv = calls[-1]
        assert argv[argv.index("--destdir") + 1] == corpus.subset_bin(n)
        assert argv[argv.index("--validpref") + 1] == f"{corpus.data}/valid.spm"
    assert kept[10] < kept[30] and kept[30] != set(range(30))


def test_convs2s_pilot_that_diverges_scores_zero_and_other_failures_stop(tmp_path, monkeypatch):
    import argparse

    S = Scheduler(str(tmp_path / "w"), say=lambda m: None)
    a = argparse.Namespace(dim=128, smoke=False, convs2s_pilot_updates=800)
    c = claims_convs2s.ConvS2S(type("Ctx", (), {"S": S, "args": a, "corpus": type("C", (), {"bin": "b"})()})())

    def failing(text):
        def train_job(name, S, *args, **kw):
            def run(job, S):
                open(S.log(name, "train.log"), "w").write(text)
                raise ClaimsError(f"{name} failed (exit 1)")
            return Job(name, run, {}, [])
        return train_job

    monkeypatch.setattr(claims_convs2s, "train_job", failing("FloatingPointError: gradients are Nan/Inf\n"))
    name = c.pilot("fconv", 2.0)
    S.results[name] = S.jobs[name].run(S.jobs[name], S)
    assert S.results[name]["diverged"] is True
    assert S.jobs[f"{name}-eval"].run(S.jobs[f"{name}-eval"], S)["bleu_valid_greedy"] == 0.0
    monkeypatch.setattr(claims_convs2s, "train_job", failing("FileNotFoundError: data-bin\n"))
    name = c.pilot("lstm", 0.012)
    with pytest.raises(ClaimsError):
        S.jobs[name].run(S.jobs[name], S)


def test_convs2s_figure_plots_valid_loss_by_update_and_by_minute(tmp_path):
    """The ConvS2S figure reads each training's log: its valid-loss curve and the minutes of each update."""
    S = Scheduler(str(tmp_path / "w"), say=lambda m: None)
    labels = {"convs2s-fconv": "fconv", "convs2s-lstm": "lstm"}
    for name, per_update in (("convs2s-fconv", 1), ("convs2s-lstm", 3)):
        S.results[name] = {"updates": 200, "minutes": 1.0}
        lines = ["2026-12-03 04:00:00 | INFO | fairseq_cli.train | {'_name': None}\n"]
        for u in (100, 200):
            lines.append(f'2026-12-03 04:00:00 | INFO | train_inner | {{"loss": "5.0", "wps": "100", '
                         f'"num_updates": "{u}", "wall": "{u * per_update}"}}\n')
            lines.append(f'2026-12-03 04:00:00 | INFO | valid | {{"valid_loss": "{9 - u / 100}", '
                         f'"valid_num_updates": "{u}"}}\n')
        open(S.log(name, "train.log"), "w").writelines(lines)
    png = tmp_path / "fig.png"
    claims_convs2s.plot(S, labels, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert claims_convs2s.trained(S, "convs2s-lstm")["valid_curve"] == [(100, 8.0), (200, 7.0)]


def test_the_claims_timing_waits_for_each_models_compiled_step_before_timing_any(monkeypatch):
    """The static step and the search graphs compile in a background process on a model's first run: a timing
    that did not wait for them timed some models on the traced step, beside another model's compile (SAT K=4 and
    K=6 read slower than K=1). Every model decoded by our generator is waited for before the first timed pass."""
    from benchmarks.claims import work

    events = []

    class DS(list):
        def collater(self, items):
            return items

    class Task:
        def build_generator(self, models, args):
            return args.beam

        def load_dataset(self, split):
            pass

        def dataset(self, split):
            return DS([1, 2, 3])

        def inference_step(self, gen, models, sample):
            events.append(("decode", models[0], gen))

    monkeypatch.setattr(work, "_load", lambda ckpt, *a: (ckpt, Task(), None))
    def compiled_searches(c, sample):  # benchmarks.speed.decode's: it starts both searches' compiles, then waits
        events.append(("compiled", c.model))
        for beam in (1, 4):
            c.decode(sample, beam, {})

    monkeypatch.setattr("benchmarks.speed.decode.compiled_searches", compiled_searches)
    models = [{"label": "fairseq", "ckpt": "t", "task": "translation"},
              {"label": "K=1", "ckpt": "k1", "task": "translation_sat"},
              {"label": "K=4", "ckpt": "k4", "task": "translation_sat"}]
    out = work.speed(models, "bin", "de", "en", sentences=3, repeat=1)
    assert [e for e in events if e[0] == "compiled"] == [("compiled", "k1"), ("compiled", "k4")]
    first_timed = len(events) - 3 * 3 * 2 - 3 * 2  # 3 models x 2 beams: a warm-up and 3 sentences each
    assert all(e[0] == "decode" for e in events[first_timed:]) and events.index(("compiled", "k4")) < first_timed
    assert len(out["ms"]) == 6
