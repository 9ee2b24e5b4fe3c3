"""benchmarks.speed.int8_linear --quick, in process: every contender that can run here is built, its output
checked against float32 (int8 rounding only), and the table, the decision lines and the JSON have the shape the
docstring describes. Speed itself is not asserted (timed tests are not speed claims). torchao is optional (CI does
not install it): one run hides it and expects the skip line, another runs it where it is installed."""

import importlib.util
import json
import sys

import pytest
import torch

from benchmarks.speed import int8_linear as bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HAS_ONEDNN = "onednn" in torch.backends.quantized.supported_engines and hasattr(torch.ops.onednn,
                                                                               "qlinear_pointwise")


def _quick(tmp_path, capsys):
    out = tmp_path / "int8.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def _check_run(res, stdout, with_torchao):
    optional = {"onednn": HAS_ONEDNN, "torchao": with_torchao}
    expected = {"float32", "fbgemm"} | {k for k, there in optional.items() if there}
    assert res["settings"]["quick"] and res["settings"]["rows"] == [1, 8] and res["settings"]["dims"] == [128]
    points = [(r["shape"], r["N"], r["K"], r["rows"]) for r in res["results"]]
    assert points == [("QKV", 384, 128, 1), ("QKV", 384, 128, 8), ("softmax", 8000, 128, 1),
                      ("softmax", 8000, 128, 8)]
    for r in res["results"]:
        assert set(r["us"]) == set(r["err"]) == set(r["x_float32"]) == expected, r
        assert all(t > 0 for t in r["us"].values())
        # the reference against itself is exact; an int8 path changes the numbers by rounding only
        assert r["err"]["float32"] == 0.0 and r["x_float32"]["float32"] == 1.0
        for k, e in r["err"].items():
            assert k == "float32" or 0 < e < 0.05, (k, e, r)
            assert r["x_float32"][k] == pytest.approx(r["us"]["float32"] / r["us"][k])
        assert r["us"][r["fastest"]] == min(r["us"].values())
    assert [(d["d"], d["shape"]) for d in res["decisions"]] == [(128, "QKV"), (128, "softmax")]
    for d in res["decisions"]:
        assert d["line"] in stdout
        group = [r for r in res["results"] if r["shape"] == d["shape"]]
        assert set(d["x_float32"]) == expected - {"float32"}
        for k, v in d["x_float32"].items():  # the geometric mean over the row counts
            assert v == pytest.approx((group[0]["x_float32"][k] * group[1]["x_float32"][k]) ** 0.5)
        assert d["fastest_int8"] == max(d["x_float32"], key=d["x_float32"].get)
        assert f"fastest int8: {bench.CONTENDERS[d['fastest_int8']]} " in d["line"]
    if HAS_ONEDNN:  # the implementation oneDNN picked, read from its verbose line
        assert "implementation " in res["cpu"]["onednn"] and res["cpu"]["onednn"] in stdout
    for title in ("microseconds per call", "largest error against float32", "decision per shape"):
        assert title in stdout
    header = next(line for line in stdout.splitlines() if line.lstrip().startswith("d shape"))
    assert "float32 us" in header and "fbgemm us" in header and "fastest" in header
    assert ("torchao us" in header) == with_torchao
    assert "torchao+compile" not in header  # --quick does not compile


def test_quick_run_without_torchao(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` fails as where it is not installed
    res, stdout = _quick(tmp_path, capsys)
    _check_run(res, stdout, with_torchao=False)
    assert f"torchao skipped: not installed; `{bench.TORCHAO_PIP}`" in stdout
    assert any(n.startswith("torchao skipped: not installed") for n in res["notes"])


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_quick_run_with_torchao(tmp_path, capsys):
    res, stdout = _quick(tmp_path, capsys)
    _check_run(res, stdout, with_torchao=True)
    assert "torchao+compile skipped (--no-compile, implied by --quick)" in stdout


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--dims", "-128"], ["--budget", "0"], ["--threads", "0"]])
def test_bad_settings_are_refused_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --dims, --rows, --vocab, --threads, --passes, --budget and --compile-limit must be positive" in err
