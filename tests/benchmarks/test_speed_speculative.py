"""python -m benchmarks.speed.speculative on the release models (a few Acts verses)."""

import json
import os
import subprocess
import sys

import pytest

from fairseq_ext.sat.speculative import EPS
from tests.helpers import ROOT

RELEASE = os.path.join(ROOT, "releases", "bible-de-en")


@pytest.fixture(scope="module")
def data(acts_bin):
    return acts_bin


@pytest.mark.slow
def test_bench_speculative_runs_and_reports_every_figure(data, tmp_path):
    """A small run of the benchmark: every contender's outputs equal the verifier's, and the JSON holds the
    latency, acceptance, throughput, sweep and noise figures the docs quote."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.speculative", "--workdir",
                           os.path.dirname(data), "--sentences", "6", "--block", "3", "--batch", "4",
                           "--throughput-sentences", "16", "--noise-sentences", "4", "--sweep", "2",
                           "--sweep-sentences", "8", "--no-ct2",
                           "--drafter", f"k2={os.path.join(RELEASE, 'sat_transformer_k2.pt')}", "--json", str(out)],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    spec = res["results"]["speculative k2 (K=2)"]
    assert spec["identical"] == 6 and spec["batch_identical"] == 16 and spec["words_per_call"] >= 1
    assert res["results"]["greedy K=1"]["ms_per_sentence"] > 0 and set(res["sweep"]) == {"2"}
    assert res["noise"]["1"][0] < EPS / 10 and res["noise"]["1"][1] > 0 and res["noise"]["4"][1] > 0
    assert "noise (batch 1): largest |difference|" in proc.stdout
