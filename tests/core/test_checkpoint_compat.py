"""Checkpoints written before the one-folder-per-paper layout still load and decode identically.

fairseq checkpoints name architectures and tasks, not module paths, so moving the code must not matter; this
proves it for every architecture of the package: tests/fixtures/pre_layout/ holds a tiny checkpoint of each
(written by the last code before that layout with tests/fixtures/pre_layout/make.py, which names its revision) and
what that code's fairseq-generate printed for it; today's fairseq-generate must print the same hypotheses with the
same scores."""

import os
import re

import pytest

from tests.helpers import ROOT, USER_DIR, run_cli

pytestmark = pytest.mark.slow  # each test runs fairseq-generate in a fresh process

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "pre_layout")
TASKS = {"fconv_glu": "translation", "msc_transformer": "translation", "sat_transformer": "translation_sat",
         "bert_jam": "translation_bert"}


def _hyps(text):
    out = {}
    for line in text.splitlines():
        m = re.match(r"^H-(\d+)\t(\S+)\t(.*)$", line)
        if m:
            out[int(m.group(1))] = (float(m.group(2)), m.group(3))
    return out


@pytest.mark.parametrize("arch", list(TASKS))
def test_pre_layout_checkpoint_decodes_as_before(arch):
    args = [os.path.join(FIXTURES, "data"), "--task", TASKS[arch], "--path", os.path.join(FIXTURES, f"{arch}.pt"),
            "--beam", "2", "--max-len-b", "5", "--gen-subset", "test", "--batch-size", "8", "--no-progress-bar",
            "--num-workers", "0", "--source-lang", "in", "--target-lang", "out", "--user-dir", USER_DIR]
    if arch == "bert_jam":  # the checkpoint names the tiny BERT by the absolute path it was made at
        args += ["--model-overrides", repr({"bert_model_name": os.path.join(FIXTURES, "tiny_bert")})]
    got = _hyps(run_cli("generate", args).stdout)
    expected = _hyps(open(os.path.join(FIXTURES, f"expected.{arch}.txt")).read())
    assert len(expected) == 40 and set(got) == set(expected)
    for i, (score, hyp) in expected.items():
        assert got[i][1] == hyp, (i, got[i], hyp)
        assert abs(got[i][0] - score) < 1e-5, (i, got[i][0], score)
