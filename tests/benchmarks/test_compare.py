"""python -m benchmarks.compare --smoke end to end: every model trained (16 updates, tiny sizes) and
measured on a slice of the bundled Bible corpus (BERT-JAM through its three phases, the SAT students distilled from
the best De->En model by valid BLEU), results.json / RESULTS.md / the PNG figures written, the hand-written
commentary of RESULTS.md kept, and a re-run that skips every finished model; the teacher selection rule and the
default budget plan without a run."""

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.compare import __main__ as compare
from benchmarks.compare import report as compare_report
from benchmarks.compare import specs as compare_specs
from tests.helpers import ROOT

ALL = [s.name for s in compare_specs.model_specs()]
FIGURES = ["training_curves.png", "sat_speed_bleu.png", "msc_grad_norms.png", "sat_position_ce.png"]
MY_NOTE = "Hand-written: keep me across re-runs."


def run_compare(*args):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compare", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    work, docs = tmp / "work", tmp / "docs"
    first = run_compare("--smoke", "--workdir", work, "--docs-dir", docs)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    results_md = docs / "RESULTS.md"
    text = results_md.read_text()
    begin, end = text.index(compare_report.COMMENTARY_BEGIN), text.index(compare_report.COMMENTARY_END)
    results_md.write_text(text[:begin + len(compare_report.COMMENTARY_BEGIN)] + "\n" + MY_NOTE + "\n" + text[end:])
    ckpt = work / "compare" / "checkpoints" / "transformer" / "checkpoint_avg.pt"
    mtime = ckpt.stat().st_mtime_ns
    results_first = json.loads((docs / "results.json").read_text())
    second = run_compare("--smoke", "--workdir", work, "--docs-dir", docs)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return dict(work=work, docs=docs, first=first, second=second, results_first=results_first,
                ckpt_mtime_changed=ckpt.stat().st_mtime_ns != mtime)


def test_every_model_has_every_metric(smoke):
    res = json.loads((smoke["docs"] / "results.json").read_text())
    assert res == json.loads((smoke["work"] / "results.json").read_text())
    assert list(res["models"]) == ALL
    assert res["meta"]["smoke"] is True and res["meta"]["max_update"] == 16
    for name, r in res["models"].items():
        for key in compare_specs.RESULT_KEYS:
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (name, key, r.get(key))
        assert r["train_updates"] == 16, name  # --max-update 16 binds before the smoke time budget
        # 16 updates are more than an epoch of the 300 smoke verses (~10-13 batches of 1024 tokens): the epoch
        # checkpoint and the last one are averaged; fconv_glu (--max-tokens 2048, ~6-7 batches per epoch) averages
        # its two epoch checkpoints and the last one; BERT-JAM averages the checkpoints of its phase 3 alone (its
        # epoch counter continues across the phases, and epoch 1 ends in phase 2)
        expected = {"fconv_glu": ["checkpoint1.pt", "checkpoint2.pt", "checkpoint_last.pt"],
                    "bert_jam": ["checkpoint_last.pt"]}.get(name, ["checkpoint1.pt", "checkpoint_last.pt"])
        assert r["averaged_checkpoints"] == expected, name
        for key in compare_specs.RESULT_KEYS:
            if not key.startswith("bleu"):
                assert r[key] > 0, (name, key)
        assert 0 <= r["bleu_beam4"] <= 100 and 0 <= r["bleu_greedy"] <= 100
        assert r["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
        assert r["test_sentences"] == compare_specs.SMOKE_LINES["test"] and r["latency_sentences"] == 5
        assert r["valid_sentences"] == compare_specs.SMOKE_LINES["valid"]
        if r["direction"] == "de-en":  # WEB + KJV + BBE
            assert r["bleu_signature_multiref"].startswith("nrefs:3|")
            assert 0 <= r["bleu_beam4_multiref"] <= 100 and 0 <= r["bleu_valid_greedy_multiref"] <= 100
        else:  # German has one translation
            assert "bleu_beam4_multiref" not in r
    # ratios are against the baseline of the same direction, so a baseline's own ratios are exactly 1
    models, ratios = res["models"], res["ratios"]
    assert models["bert_jam"]["baseline"] == "transformer_en_de" and models["sat_k4"]["baseline"] == "transformer"
    for name, base in (("transformer", "transformer"), ("sat_k2", "transformer"), ("bert_jam", "transformer_en_de"),
                       ("transformer_en_de", "transformer_en_de")):
        for key in compare_report.RATIO_KEYS:
            if models[base][key] == 0:  # BLEU 0 after 16 updates: no ratio
                assert ratios[name][key] is None
            else:
                assert ratios[name][key] == pytest.approx(models[name][key] / models[base][key])
                assert name != base or ratios[name][key] == 1.0
    # BERT-JAM counts its MiniLM: far more parameters than the NMT model (phase 3 fine-tunes it, so all train)
    assert models["bert_jam"]["params"] > 100 * models["transformer_en_de"]["params"]
    # its phases ran in sequence, each ending at its cumulative share of --max-update 16 (40/30/30%)
    assert [(p["phase"], p["updates"]) for p in models["bert_jam"]["phases"]] == [(1, 6), (2, 11)]
    for p in models["bert_jam"]["phases"]:
        assert 0 <= p["bleu_valid_greedy"] <= 100 and math.isfinite(p["valid_loss"])
    cache = smoke["work"] / "compare" / "bert-feature-cache"
    assert sorted(os.listdir(cache)) == ["phase1", "phase2"]  # one directory per frozen-BERT phase, none for 3
    for phase in ("phase1", "phase2"):
        assert (cache / phase / "train.json").is_file() and (cache / phase / "valid.json").is_file()
    logs = smoke["work"] / "compare" / "logs"
    phase2, phase3 = (logs / "bert_jam.train-phase2.log").read_text(), (logs / "bert_jam.train.log").read_text()
    assert "bert_jam_phase1/checkpoint_last.pt" in phase2 and "bert_jam_phase2/checkpoint_last.pt" in phase3
    assert f"'bert_feature_cache': '{cache / 'phase2'}'" in phase2 and "'bert_feature_cache': None" in phase3
    # --reset-optimizer, with the update counter and LR schedule continuing (translation_bert), as the recipes
    assert "the update counter and LR schedule continue from" in phase3 and "'reset_optimizer': True" in phase3
    # the SAT students: distilled from and initialised by the chosen teacher, the best De->En model on valid
    teacher = compare.choose_teacher(models, {s.name: s for s in compare_specs.model_specs()})
    assert res["meta"]["sat_teacher"] == teacher and res["meta"]["corpus"] == "bible"
    for k in (2, 4, 6):
        assert models[f"sat_k{k}"]["teacher"] == teacher
        assert models[f"sat_k{k}"]["init_from"] == compare.init_source(teacher, {s.name: s for s in
                                                                                compare_specs.model_specs()})


def test_results_md_and_figures(smoke):
    text = (smoke["docs"] / "RESULTS.md").read_text()
    res = json.loads((smoke["docs"] / "results.json").read_text())
    for r in res["models"].values():
        assert f"| {r['label']} | {r['direction']} | 16 |" in text
    assert "smoke mode" in text and "## Numbers (equal wall clock on 2 cores)" in text
    assert "## The papers' claims\n\nEach paper's own claim is tested" in text and "(CLAIMS.md)" in text
    assert "test sentences scored: 20; De->En also scored against the World English Bible" in text
    assert "distilling the training set for the SAT students took" in text
    assert "**SAT K=2**" not in text  # the claims are judged in CLAIMS.md, not on a wall-clock race
    assert "| BLEU beam 4, 3 refs |" in text
    for fig in FIGURES:
        with open(smoke["docs"] / fig, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", fig
        assert f"]({fig})" in text


def test_progress_display(smoke):
    out = smoke["first"].stdout
    for i in range(len(ALL)):
        assert f"[compare] {i}/{len(ALL)} models done | {ALL[i]}: decoding the test set, update 16 |" in out
    assert "sat: distilling the training set with the teacher, the averaged " in out
    assert out.splitlines()[0].startswith("[compare] plan: 9 models x 2 min of training; planned total ")
    for phase in (1, 2, 3):
        assert f"bert_jam: training phase {phase}" in out


def test_rerun_skips_finished_models_and_keeps_commentary(smoke):
    out = smoke["second"].stdout
    for i, name in enumerate(ALL, 1):
        assert f"[{i}/{len(ALL)}] {name}: finished earlier with the same settings, skipped" in out
    assert "models done" not in out and "distilling" not in out
    assert not smoke["ckpt_mtime_changed"]
    res = json.loads((smoke["docs"] / "results.json").read_text())
    assert res["models"] == smoke["results_first"]["models"]
    text = (smoke["docs"] / "RESULTS.md").read_text()
    assert text.count(MY_NOTE) == 1 and compare_report.DEFAULT_COMMENTARY not in text


def test_unknown_model_is_a_one_line_error(tmp_path):
    proc = run_compare("--smoke", "--only", "transformer,nonsense", "--workdir", tmp_path / "w",
                       "--docs-dir", tmp_path / "d")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "python -m benchmarks.compare: error: --only: unknown model(s) nonsense; choose from " + ", ".join(ALL)]


def test_only_runs_a_subset_and_reports_all_finished_models(smoke):
    proc = run_compare("--smoke", "--only", "sat_k2,fconv_glu", "--workdir", smoke["work"], "--docs-dir", smoke["docs"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "the SAT students need their teacher: 'transformer' added to the run" in out
    for i, name in enumerate(["transformer", "fconv_glu", "sat_k2"], 1):
        assert f"[{i}/3] {name}: finished earlier with the same settings, skipped" in out
    res = json.loads((smoke["docs"] / "results.json").read_text())
    assert res["meta"]["models_run_now"] == ["transformer", "fconv_glu", "sat_k2"]
    assert list(res["models"]) == ALL  # the other finished models stay in the report


# ---------------------------------------------------------------------------------------------------------
# without a run: the teacher rule and the default budget
# ---------------------------------------------------------------------------------------------------------
class _ValidOnly(dict):
    """A result whose test-set numbers may not be read."""

    def __getitem__(self, key):
        assert "valid" in key, f"the teacher choice read {key}"
        return super().__getitem__(key)

    def get(self, key, default=None):
        assert "valid" in key, f"the teacher choice read {key}"
        return super().get(key, default)


def test_teacher_is_the_best_de_en_model_on_valid_never_test():
    specs = {s.name: s for s in compare_specs.model_specs()}

    def res(valid, test):
        return _ValidOnly(bleu_valid_greedy=valid, bleu_beam4=test, bleu_greedy=test, bleu_beam4_multiref=test)

    # msc6 is best on valid although the transformer is far better on test; students and En->De never count
    results = {"transformer": res(20.0, 30.0), "fconv_glu": res(15.0, 40.0), "msc6": res(21.0, 10.0),
               "msc12": res(19.0, 50.0), "sat_k2": res(60.0, 60.0), "transformer_en_de": res(70.0, 70.0),
               "bert_jam": res(80.0, 80.0)}
    assert compare.choose_teacher(results, specs) == "msc6"
    # msc6 distils, but --sat-init-from reads only a transformer: the students start from the baseline
    assert compare.init_source("msc6", specs) == "transformer"
    assert compare.init_source("transformer", specs) == "transformer"
    results["transformer"] = res(21.5, 1.0)
    assert compare.choose_teacher(results, specs) == "transformer"
    # a tie goes to the baseline, whatever the order; only finished candidates count
    assert compare.choose_teacher({"fconv_glu": res(5.0, 9.0), "transformer": res(5.0, 1.0)}, specs) == "transformer"
    assert compare.choose_teacher({"fconv_glu": res(5.0, 9.0), "sat_k2": res(9.0, 9.0)}, specs) == "fconv_glu"
    assert compare.choose_teacher({"transformer_en_de": res(9.0, 9.0)}, specs) is None


def test_default_run_is_planned_within_three_hours():
    args = compare.parse_args([])
    assert args.minutes_per_model == compare_specs.DEFAULT_MINUTES_PER_MODEL and args.max_update is None
    names = [s.name for s in compare_specs.model_specs()]
    plan = compare_specs.budget_plan(args.minutes_per_model, names)
    total = sum(m for _, m in plan)
    assert total <= compare_specs.MAX_TOTAL_MINUTES == 180
    steps = dict(plan)
    # every model trains for the budget; the distillation decode, BERT-JAM's two feature caches and the
    # evaluations are planned too
    for name in names:
        assert steps[f"{name}: training"] >= args.minutes_per_model and steps[f"{name}: evaluation"] > 0
    assert steps["SAT distillation of the training set (greedy)"] >= 10
    assert steps["bert_jam: BERT feature caches (2)"] == 2 * compare_specs.PLAN_BERT_CACHE_MINUTES
    assert sum(compare_specs.BERT_JAM_PHASE_SHARES) == pytest.approx(1.0)
    # without SAT students there is no distillation step
    assert "SAT distillation of the training set (greedy)" not in dict(compare_specs.budget_plan(11, ["transformer"]))


def test_bible_settings_of_the_baselines():
    specs = {s.name: s for s in compare_specs.model_specs()}
    for name in ("transformer", "transformer_en_de", "sat_k2"):
        a = specs[name].train_args(smoke=False)
        assert "--encoder-normalize-before" in a and "--decoder-normalize-before" in a
        for flag, value in (("--lr", "0.003"), ("--dropout", "0.0"), ("--attention-dropout", "0.0"),
                            ("--warmup-updates", "200"), ("--max-tokens", "1024"), ("--encoder-embed-dim", "128")):
            assert a[a.index(flag) + 1] == value, (name, flag)
    assert compare_specs.CORPUS_DIR.endswith(os.path.join("data", "bible-de-en"))
    assert compare_specs.CORPUS_NAME == "bible"
    assert specs["bert_jam"].phases == (1, 2, 3) and "--bert-jam-phase" not in specs["bert_jam"].train_args(False)
