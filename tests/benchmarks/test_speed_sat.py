"""python -m benchmarks.speed.sat --random-init at a tiny size (and speed.beam_rows, speed.kernels,
speed.beam_parts), and the opt-in int8 decoder of fairseq_ext.inference.speedups. Speed itself is not asserted (timed
tests are not speed claims): the run must build every contender, force every output to exactly N words + EOS, and
write the JSON its docstring describes."""

import json
import math
import os
import subprocess
import sys

import pytest

import fairseq_ext  # noqa: F401  (registers the plugin)
from tests.helpers import ROOT

BENCH = ["-m", "benchmarks.speed.sat"]
N = 5  # --fixed-length of the tiny runs


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny --random-init run with every contender: the anchors (CTranslate2 when installed), K = 2, 4, 6,
    the 6+1 family, the int8-output variant, the float32 opt-ins (prepack + fast attention) and the decoder's own
    step instead of the generator's default lean one."""
    out = tmp_path_factory.mktemp("bench_sat") / "bench.json"
    cmd = [sys.executable, *BENCH, "--random-init", "--tiny", "--fixed-length", str(N), "--sentences", "3",
           "--block", "2", "--repeat", "2", "--no-throughput", "--json", str(out), "--quantize", "output",
           "--float-opt", "lean-prepack", "--float-opt", "own-step"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    # exit 1 = a speed target missed (meaningless at this size); anything else is a failure
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_random_init_tiny_writes_the_issue_json(tiny_run):
    res, stdout = tiny_run
    ms = res["ms_per_sentence"]
    expected = ["fairseq SequenceGenerator (transformer)", "ours K=1 (transformer)", "ours SAT K=2",
                "ours SAT K=4", "ours SAT K=6", "ours K=1 (transformer 6+1)", "ours SAT K=2 (6+1)",
                "ours SAT K=4 (6+1)", "ours SAT K=6 (6+1)", "ours K=1 (transformer) [int8 output]",
                "ours SAT K=4 [int8 output]"]
    for name in expected:
        assert name in ms, (name, sorted(ms))
    for name, r in ms.items():
        for mode in ("greedy", "beam4"):
            assert math.isfinite(r[mode]) and r[mode] > 0, (name, mode, r)
            # one time per sentence and contender (the fastest of --repeat 2), blocks of 2 and 1 (--sentences 3)
            assert len(res["results"][name][f"{mode}_b1_ms_per_sentence"]) == 3, (name, mode)
    assert res["settings"]["block"] == 2 and res["settings"]["repeat"] == 2
    assert "fastest of 2 passes" in stdout
    # the speed-ups are our K=1's time over each SAT's, in the same run, for K = 2, 4, 6
    sp = res["speedup_vs_k1"]
    assert set(sp) == {"greedy", "beam4"}
    for mode in ("greedy", "beam4"):
        assert set(sp[mode]) == {"2", "4", "6"}
        for k, v in sp[mode].items():
            assert v == pytest.approx(ms["ours K=1 (transformer)"][mode] / ms[f"ours SAT K={k}"][mode])
    spread = res["speedup_vs_k1_per_sentence_p10_p50_p90"]["3+3"]
    for mode in ("greedy", "beam4"):
        for k in ("2", "4", "6"):
            p10, p50, p90 = spread[mode][k]
            assert 0 < p10 <= p50 <= p90
    assert res["targets"]["greedy"] == {"2": 1.5, "4": 2.7, "6": 3.4}
    assert res["targets"]["beam4"] == {"2": 1.8, "4": 3.0, "6": 3.6}
    # every contender decoded exactly N words + EOS in both modes (the lengths are forced for all)
    for name, r in res["results"].items():
        assert r["greedy_b1_len"] == N + 1 and r["beam4_b1_len"] == N + 1, name
    # SAT K needs ceil((N+1)/K) decoder calls, K=1 needs N+1
    assert res["results"]["ours K=1 (transformer)"]["greedy_b1_calls"] == N + 1
    assert res["results"]["ours SAT K=4"]["greedy_b1_calls"] == math.ceil((N + 1) / 4)
    assert res["results"]["ours SAT K=4 (6+1)"]["greedy_b1_calls"] == math.ceil((N + 1) / 4)
    agr = res["results"]["ours SAT K=4 [int8 output]"]["greedy_b1_agreement"]
    assert 0 <= agr["tokens_identical"] <= 1
    # the float32 opt-ins (the lean step mixed in, prepack_output) decode the float model's tokens (sums
    # reordered: only a near-tie could flip one; tests/inference checks equal hypotheses exactly)
    for mode in ("greedy", "beam4"):
        assert res["results"]["ours SAT K=4 [float lean-prepack]"][f"{mode}_b1_agreement"]["tokens_identical"] >= 0.95
    assert set(res["speedup_vs_k1_by_family"]["float lean-prepack"]["greedy"]) == {"2", "4", "6"}
    # our generator's default lean decoder step, and the decoder's own step (--float-opt own-step): same tokens
    for name in ("ours K=1 (transformer)", "ours SAT K=4"):
        assert res["results"][name]["decoder_step"] == "lean"
        assert res["results"][f"{name} [float own-step]"]["decoder_step"] == "own"
        for mode in ("greedy", "beam4"):
            assert res["results"][f"{name} [float own-step]"][f"{mode}_b1_agreement"]["tokens_identical"] >= 0.95
    assert res["results"]["ours SAT K=4 [float lean-prepack]"]["decoder_step"] == "lean"  # the mixed-in step
    assert "decoder_step" not in res["results"]["fairseq SequenceGenerator (transformer)"]
    assert res["code"]["fairseq_ext/sat/generator.py"]["sha1"]
    assert "speed-up K=4" in stdout


def test_ctranslate2_anchor_decodes_the_same_model(tiny_run):
    pytest.importorskip("ctranslate2")
    res, _ = tiny_run
    ms = res["ms_per_sentence"]
    for name in ("CTranslate2 int8 (transformer)", "CTranslate2 float32 (transformer)",
                 "CTranslate2 int8 (transformer 6+1)"):
        assert name in ms and ms[name]["greedy"] > 0 and ms[name]["beam4"] > 0
        assert res["results"][name]["greedy_b1_len"] == N + 1
    # the converted float32 model is the same transformer: greedy search gives our K=1's words
    agr = res["results"]["CTranslate2 float32 (transformer)"]["greedy_b1_agreement"]
    assert agr["sentences_identical"] == 1.0, agr


def test_random_init_needs_fixed_length():
    proc = subprocess.run([sys.executable, *BENCH, "--random-init", "--tiny"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "--random-init needs --fixed-length" in proc.stderr
    proc = subprocess.run([sys.executable, *BENCH, "--random-init", "--tiny", "--fixed-length", "5", "--repeat", "0"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--repeat must be at least 1" in proc.stderr


def test_bench_beam_rows_runs_and_checks_top_b():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.beam_rows", "--vocab", "2048", "--rows", "2", "8",
                           "--greedy-rows", "1", "3", "--iters", "3"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    flat = next(i for i, line in enumerate(lines) if line.startswith("K = 1 beam"))
    greedy = next(i for i, line in enumerate(lines) if line.startswith("greedy:"))
    rows = [line.split() for line in lines[2:flat]]
    assert [r[0] for r in rows] == ["2", "8"] and all(len(r) == 6 for r in rows)
    rows = [line.split() for line in lines[flat + 2:greedy]]  # 2048 words: 32 chunks of a row, 128 of a beam of 4
    assert [r[0] for r in rows] == ["1", "4"] and all(len(r) == 4 for r in rows)
    rows = [line.split() for line in lines[greedy + 2:]]  # topk, then chunks of 16 / 32 / 64: "us (ratio)" each
    assert [r[0] for r in rows] == ["1", "3"] and all(len(r) == 2 + 2 * 3 for r in rows)


def test_bench_kernels_runs_every_part():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.kernels", "--vocab", "600",
                           "--dim", "32", "--rows", "2", "16", "--batches", "1", "2", "--cached", "3",
                           "--qkv-rows", "3", "--ffn", "48", "--heads", "2", "--layers", "2", "--src-lens", "5"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    part2 = lines.index(next(x for x in lines if x.startswith("2. ")))
    if "skipped" not in lines[1]:  # a CPU with AMX: fbgemm / oneDNN per row count, the same numbers
        rows = [x.split() for x in lines[2:part2]]
        assert [r[0] for r in rows] == ["2", "16"] and all(float(r[4]) < 1e-5 for r in rows)
        assert [r[5] for r in rows] == ["fbgemm", "onednn"]
    part3 = lines.index(next(x for x in lines if x.startswith("3. ")))
    rows = [x.split() for x in lines[part2 + 2: part3]]
    assert [(r[0], r[1]) for r in rows] == [("4", "3"), ("8", "3")]
    part4 = lines.index(next(x for x in lines if x.startswith("4. ")))
    assert [x.split()[0] for x in lines[part3 + 2: part4]] == ["3"]  # fused int8 q/k/v (checked equal in the script)
    rows = [x.split() for x in lines[part4 + 2:]]  # lean encoder: float32 gives fairseq's, int8 close to it
    assert [(r[0], r[1]) for r in rows] == [("5", "float"), ("5", "int8")]
    assert float(rows[0][5]) < 1e-6 and float(rows[1][5]) < 0.1


def test_bench_beam_parts_runs_and_accounts_for_every_part():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.beam_parts", "--tiny",
                           "--sentences", "2", "--repeat", "1", "--length", "8",
                           "--speedups", "int8-decoder,lean-decoder", "--profile", "4"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    calls = next(x for x in lines if x.startswith("decoder calls per sentence")).split()[-4:]
    assert calls == ["9.0", "5.0", "3.0", "2.0"]  # ceil(9 / K) calls for 8 words + EOS
    for label in ("decoder call", "group step", "reorder", "fairseq's rules", "the rest of the search"):
        row = next(x for x in lines if x.startswith(label)).split()[-4:]
        if label == "group step":  # K = 1: fairseq's beam step, inside _beam_search (in "the rest")
            assert row[0] == "-", row
            row = row[1:]
        assert all(float(v) > 0 for v in row), label
    assert any("the generator's _reorder" in x for x in lines)
    top = lines.index(next(x for x in lines if x.startswith("operator self time per decoder call")))
    assert len(lines[top + 1:]) == 12 and all(len(x.split()) >= 4 for x in lines[top + 1:])
