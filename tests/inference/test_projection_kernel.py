"""The static step's vocabulary projection: MKL or oneDNN by the row count measured once per CPU, cached."""

import json
import os

import pytest
import torch

from fairseq_ext.inference import projection_kernel as pk
from fairseq_ext.inference import static_step as ss

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this PyTorch")


def times(onednn_share):
    """{rows: (MKL, oneDNN)} seconds with oneDNN at ``onednn_share[rows]`` of MKL's time (1.0 where not given)."""
    return {n: (1.0, onednn_share.get(n, 1.0)) for n in pk.ROWS}


@pytest.mark.parametrize("share, expected", [
    ({}, None),  # never faster: MKL always
    ({n: 0.5 for n in pk.ROWS if n >= 4}, 4),  # faster from 4 rows on
    ({n: 0.3 for n in pk.ROWS}, 1),  # faster everywhere
    ({2: 0.5, 4: 0.5}, None),  # faster at few rows only: not at the larger counts, so MKL (a threshold, no gaps)
    ({n: 0.95 for n in pk.ROWS}, None),  # within the margin: noise stays on MKL
    ({**{n: 0.5 for n in pk.ROWS if n >= 8}, 16: 0.95}, 32),  # one count within the margin cuts the range there
])
def test_onednn_takes_the_rows_from_which_it_is_faster_at_every_larger_count(share, expected):
    assert pk.onednn_from(times(share)) == expected


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(tmp_path))
    return tmp_path / "static_step" / pk.FILE


def measured(monkeypatch, share):
    calls = []

    def fake(mkl, onednn, width, rounds=3):
        calls.append(width)
        return times(share)

    monkeypatch.setattr(pk, "measure", fake)
    return calls


def test_the_choice_is_measured_once_and_read_back(cache, monkeypatch):
    calls = measured(monkeypatch, {n: 0.5 for n in pk.ROWS if n >= 4})
    assert pk.choose(None, None, (7840, 128)) == 4 and calls == [128]
    assert json.loads(cache.read_text()) == {f"{pk.cpu_key()}|7840x128": 4}
    assert pk.choose(None, None, (7840, 128)) == 4 and calls == [128]  # from the cache: not measured again
    assert pk.choose(None, None, (100, 64)) == 4 and calls == [128, 64]  # another shape is its own entry
    assert len(json.loads(cache.read_text())) == 2
    assert oct(os.stat(cache.parent).st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("stored", ['{"KEY": 3}', '{"KEY": "onednn"}', '{"KEY": [2]}', '{"KEY": true}', "[1, 2]",
                                    "{not json"])
def test_a_cache_entry_that_is_no_answer_is_measured_again(cache, monkeypatch, stored):
    cache.parent.mkdir(parents=True, mode=0o700)
    cache.write_text(stored.replace("KEY", f"{pk.cpu_key()}|7840x128"))
    calls = measured(monkeypatch, {})
    assert pk.choose(None, None, (7840, 128)) is None and calls == [128]
    assert json.loads(cache.read_text())[f"{pk.cpu_key()}|7840x128"] is None


def test_a_cache_others_can_write_into_is_neither_read_nor_written(cache, monkeypatch):
    cache.parent.mkdir(parents=True)
    os.chmod(cache.parent, 0o777)
    cache.write_text(json.dumps({f"{pk.cpu_key()}|7840x128": 1}))
    calls = measured(monkeypatch, {})
    assert pk.choose(None, None, (7840, 128)) is None and calls == [128]
    assert json.loads(cache.read_text()) == {f"{pk.cpu_key()}|7840x128": 1}


@needs_onednn
def test_the_projection_runs_the_chosen_kernel_by_row_count_and_both_agree(cache, monkeypatch):
    measured(monkeypatch, {n: 0.5 for n in pk.ROWS if n >= 4})
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 300, bias=False)
    proj = ss.OutputProjection(linear)
    if proj.packed is None:
        pytest.skip("this PyTorch has no oneDNN linear entry point")
    assert proj.onednn_from == 4
    ran = []
    monkeypatch.setattr(proj, "mkl", lambda x, f=proj.mkl: ran.append("mkl") or f(x))
    monkeypatch.setattr(proj, "onednn", lambda x, f=proj.onednn: ran.append("onednn") or f(x))
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(proj(x), linear(x), rtol=0, atol=1e-5)
    assert ran == ["mkl", "mkl", "onednn", "onednn"]
    for rows in (1, 2, 8):  # the two kernels give the same logits up to the order of their sums
        x = torch.randn(rows, 32)
        torch.testing.assert_close(proj.mkl(x), proj.onednn(x), rtol=0, atol=1e-5)


def test_the_real_measurement_gives_an_answer_for_every_row_count():
    linear = torch.nn.Linear(16, 64, bias=True)
    wt = linear.weight.detach().t().contiguous()
    res = pk.measure(lambda x: torch.addmm(linear.bias, x, wt), lambda x: linear(x), 16, rounds=1)
    assert sorted(res) == list(pk.ROWS) and all(m > 0 and o > 0 for m, o in res.values())
