"""python -m benchmarks.speed.decode on the release models (a few Acts verses) and its --capture part."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def _run(args, workdir):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.decode", "--workdir", workdir] + args,
                          capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


@pytest.mark.slow
def test_bench_decode_reports_every_contender_and_the_default_equals_fairseq(acts_bin, tmp_path):
    """Every setting and contender is in the table, the default path's hypotheses equal fairseq's (the
    benchmark's own identity figure), and BLEU is printed with its signature."""
    out = tmp_path / "decode.json"
    proc = _run(["--sentences", "4", "--batch", "4", "--batched-sentences", "8", "--no-ct2", "--json", str(out)],
                os.path.dirname(acts_bin))
    res = json.loads(out.read_text())
    rows = {(r["setting"], r["search"], r["contender"]): r for r in res["table"]}
    settings = {("batch 1", "greedy"), ("batch 1", "beam 4"), ("batch 4", "greedy"), ("batch 4", "beam 4")}
    assert {(s, b) for s, b, _ in rows} == settings
    for s, b in settings:
        sats = {f"SAT K={K}" for K in (2, 4, 6)
                if os.path.exists(f"{ROOT}/releases/bible-de-en/sat_transformer_k{K}.pt")}
        assert {c for s_, b_, c in rows if (s_, b_) == (s, b)} == {"fairseq", "default", "lean", "int8"} | sats
        assert rows[s, b, "default"]["identical_to_fairseq"] == rows[s, b, "lean"]["identical_to_fairseq"] == 1.0
        assert rows[s, b, "default"]["bleu"] == rows[s, b, "fairseq"]["bleu"]
        assert rows[s, b, "default"]["ms_per_sentence"] > 0 and rows[s, b, "default"]["x_ct2_int8"] is None
    assert rows["batch 1", "greedy", "default"]["sentences"] == 4
    assert rows["batch 4", "greedy", "default"]["sentences"] == 8
    assert "sacreBLEU: nrefs:1" in proc.stdout


@pytest.mark.slow
def test_bench_decode_capture_times_the_three_ways_and_the_layouts(acts_bin, tmp_path):
    proc = _run(["--capture", "--no-compile"], os.path.dirname(acts_bin))  # torch.compile: tens of seconds
    out = proc.stdout
    assert "torch.jit.trace" in out and "eager" in out
    assert "torch.compile left out: RuntimeError: --no-compile" in out
    assert "output 7840x128" in out and "oneDNN us" in out


@pytest.mark.slow
def test_bench_static_rows_times_both_steps_with_the_same_hypotheses(acts_bin):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.static_rows", "--workdir",
                           os.path.dirname(acts_bin), "--sentences", "8", "--batches", "1", "4", "--beams", "4",
                           "--passes", "1"], capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| beam 4 |")]
    assert [(r[1], r[2]) for r in rows] == [("1", "4"), ("4", "16")]
    assert [r[6] for r in rows] == ["8/8 |", "2/2 |"]  # identical hypotheses in every batch
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
