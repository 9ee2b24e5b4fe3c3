"""benchmarks/compare.py --smoke end to end (issue #7): every model trained (16 updates, tiny sizes) and measured
on a 300-sentence slice of the bundled corpus, results.json / RESULTS.md / the PNG figures written, the
hand-written commentary of RESULTS.md kept, and a re-run that skips every finished model."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compare_report  # noqa: E402
import compare_specs  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "compare.py")
ALL = [s.name for s in compare_specs.model_specs()]
FIGURES = ["training_curves.png", "sat_speed_bleu.png", "msc_grad_norms.png", "sat_position_ce.png"]
MY_NOTE = "Hand-written: keep me across re-runs."


def run_compare(*args):
    proc = subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1"))
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
        # 16 updates are more than an epoch of the 300 smoke sentences (10-13 batches of 1024 tokens): the epoch
        # checkpoint and the last one are averaged; fconv_glu (4 batches of 4000 tokens per epoch) ends exactly
        # with epoch 4, whose checkpoint is then the last one and is not counted twice
        expected = ["checkpoint3.pt", "checkpoint4.pt"] if name == "fconv_glu" else ["checkpoint1.pt", "checkpoint_last.pt"]
        assert r["averaged_checkpoints"] == expected, name
        for key in compare_specs.RESULT_KEYS:
            if not key.startswith("bleu"):
                assert r[key] > 0, (name, key)
        assert 0 <= r["bleu_beam4"] <= 100 and 0 <= r["bleu_greedy"] <= 100
        assert r["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
        assert r["test_sentences"] == compare_specs.SMOKE_LINES["test"] and r["latency_sentences"] == 5
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
    # BERT-JAM counts its (frozen in phase 1) MiniLM: far more parameters than trainable ones
    assert models["bert_jam"]["params_trainable"] < models["bert_jam"]["params"]


def test_results_md_and_figures(smoke):
    text = (smoke["docs"] / "RESULTS.md").read_text()
    res = json.loads((smoke["docs"] / "results.json").read_text())
    for r in res["models"].values():
        assert f"| {r['label']} | {r['direction']} | 16 |" in text
    assert "smoke mode" in text and "## The papers' claims at this scale" in text
    assert "test sentences scored: 20; distilling the training set for the SAT students took" in text
    assert "**SAT K=2**" in text and "**BERT-JAM (phase 1) vs its transformer baseline" in text
    for fig in FIGURES:
        with open(smoke["docs"] / fig, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", fig
        assert f"]({fig})" in text


def test_progress_display(smoke):
    out = smoke["first"].stdout
    for i in range(len(ALL)):
        assert f"[compare] {i}/{len(ALL)} models done | {ALL[i]}: decoding the test set, update 16 |" in out
    assert "sat: distilling the training set with the averaged baseline (beam 4)" in out


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
        "compare.py: error: --only: unknown model(s) nonsense; choose from " + ", ".join(ALL)]


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
