"""Every recipe under recipes/ with --dry-run: it runs nothing, writes nothing, and prints every step of the real run
in order (data preparation or distillation where the recipe has one, fairseq-preprocess with its dictionary flags,
fairseq-train with the paper's flags, checkpoint averaging, fairseq-generate, and the scoring step), with the
settings checked against the papers, fairseq's recipes and the authors' configs. Fast: bash only, no fairseq
import."""

import os
import re
import shlex
import subprocess

import pytest

from tests.helpers import ROOT


def dry_run(recipe, *args, env=None, tmp_path=None):
    work = tmp_path / "work"
    extra = []
    if recipe.startswith(("convs2s/", "msc/", "sat/")):
        extra = ["--workdir", str(work)]
    if recipe.startswith("msc/"):
        extra += ["--data-dir", "/nonexistent"]
    if recipe.startswith("bert_jam/"):
        env = dict(os.environ, SAVE=str(work / "ckpt"), **(env or {}))
    proc = subprocess.run(["bash", os.path.join(ROOT, "recipes", recipe), "--dry-run", *extra, *args],
                          capture_output=True, text=True, timeout=60, env=env or os.environ.copy(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not work.exists(), "a dry run wrote files"
    return proc.stdout


def commands(out):
    """The printed command lines, without the recipes' '+ ' / 'score: ' prefixes."""
    cmds = []
    for line in out.splitlines():
        line = re.sub(r"^(\+ |score: )", "", line.strip())
        if re.match(r"^(fairseq-|python|grep|perl|sacrebleu|cat|mkdir|awk|wget|git|\[|for |cp |rm )", line):
            cmds.append(line)
    return cmds


def in_order(cmds, patterns):
    """Each pattern matches some command, in this order; returns the matched commands."""
    found, start = [], 0
    for p in patterns:
        hit = next((i for i in range(start, len(cmds)) if re.search(p, cmds[i])), None)
        assert hit is not None, f"no command matching {p!r} after position {start}:\n" + "\n".join(cmds)
        found.append(cmds[hit])
        start = hit + 1
    return found


def flags(cmd):
    """{--flag: value or True} of a printed command (shell-unquoted)."""
    argv = shlex.split(cmd.split(" > ")[0])
    out = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a] = nxt if nxt is not None and not nxt.startswith("--") else True
    return out


# ---------------------------------------------------------------------------------------------------- ConvS2S

def test_convs2s_iwslt14(tmp_path):
    out = dry_run("convs2s/iwslt14_de_en.sh", tmp_path=tmp_path)
    download, bpe, prep, train, gen = in_order(commands(out), [
        r"wget .*de-en\.tgz", r"learn_bpe\.py' -s 10000", r"^fairseq-preprocess", r"^fairseq-train",
        r"^fairseq-generate .*tail -1"])  # fairseq-generate prints BLEU4 (tokenised, lowercased) last
    # B3: an archive already present is used; the download is grouped, so mv only follows a wget
    assert "[ -f de-en.tgz ] || { wget" in download and "mv de-en.tgz.part de-en.tgz; }; }" in download
    t = flags(train)
    assert (t["--arch"], t["--optimizer"], t["--lr"], t["--clip-norm"], t["--dropout"], t["--max-tokens"],
            t["--lr-scheduler"], t["--lr-shrink"], t["--stop-min-lr"]) == (
        "fconv_glu_iwslt_de_en", "nag", "0.25", "0.1", "0.2", "4000", "reduce_lr_on_plateau", "0.1", "1e-4")
    g = flags(gen)
    assert (g["--beam"], g["--remove-bpe"], g["--gen-subset"]) == ("5", True, "test")
    assert "fairseq's fconv_iwslt_de_en recipe" in open(os.path.join(ROOT, "recipes/convs2s/iwslt14_de_en.sh")).read()


def test_convs2s_iwslt14_download_resumes_with_the_archive_present(tmp_path):
    """B3, run for real: with de-en.tgz already there (an interrupted extraction, or an offline machine) the
    download step only extracts it (it used to fail on `mv de-en.tgz.part`)."""
    out = dry_run("convs2s/iwslt14_de_en.sh", tmp_path=tmp_path)
    download = next(c for c in commands(out) if "de-en.tgz" in c)
    orig = tmp_path / "work" / "orig"
    (tmp_path / "payload" / "de-en").mkdir(parents=True)
    (tmp_path / "payload" / "de-en" / "train.tags.de-en.de").write_text("x\n")
    orig.mkdir(parents=True)
    subprocess.run(["tar", "czf", str(orig / "de-en.tgz"), "-C", str(tmp_path / "payload"), "de-en"], check=True)
    proc = subprocess.run(["bash", "-c", "set -euo pipefail; " + download.replace("wget", "false")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (orig / "de-en" / "train.tags.de-en.de").read_text() == "x\n"


def test_convs2s_wmt14(tmp_path):
    out = dry_run("convs2s/wmt14_en_de.sh", tmp_path=tmp_path)
    bpe, clean, prep, train, gen, hyp, ref, score = in_order(commands(out), [
        r"learn_bpe\.py' -s 40000", r"clean-corpus-n\.perl.* 1 250", r"^fairseq-preprocess", r"^fairseq-train",
        r"^fairseq-generate", r"^grep \^H.*##AT##", r"^grep \^T.*##AT##", r"^fairseq-score"])
    p = flags(prep)
    # D1: separate dictionaries as fairseq's ConvS2S WMT'14 recipe (fconv shares no embeddings)
    assert "--joined-dictionary" not in p and (p["--thresholdsrc"], p["--thresholdtgt"]) == ("0", "0")
    t = flags(train)
    assert (t["--arch"], t["--optimizer"], t["--lr"], t["--clip-norm"], t["--dropout"], t["--label-smoothing"],
            t["--lr-scheduler"], t["--force-anneal"], t["--max-tokens"]) == (
        "fconv_glu_wmt_en_de", "nag", "0.5", "0.1", "0.2", "0.1", "fixed", "50", "4000")
    assert flags(gen)["--beam"] == "5" and "newstest2014" in out
    header = open(os.path.join(ROOT, "recipes/convs2s/wmt14_en_de.sh")).read()
    assert "every 100th training pair" in header and "40k merges" in header


# ---------------------------------------------------------------------------------------------------- MSC

@pytest.mark.parametrize("recipe,src,tgt", [("msc/iwslt14_de_en.sh", "de", "en"), ("msc/iwslt14_en_de.sh", "en", "de"),
                                            ("msc/iwslt17_en_fr.sh", "en", "fr")])
def test_msc_iwslt(recipe, src, tgt, tmp_path):
    out = dry_run(recipe, "--depth", "72", "--gpus", "2", tmp_path=tmp_path)
    spm, prep, train, avg, gen, hyp, score = in_order(commands(out), [
        r"vocab_size=10000", r"^fairseq-preprocess", r"^fairseq-train", r"average_checkpoints", r"^fairseq-generate",
        r"^grep .*\^D-", r"^sacrebleu .*--tokenize none -lc"])
    assert "--joined-dictionary" in flags(prep) and flags(prep)["--source-lang"] == src
    t = flags(train)
    assert (t["--arch"], t["--lr"], t["--warmup-updates"], t["--criterion"], t["--l2-lambda"], t["--max-tokens"],
            t["--update-freq"], t["--distributed-world-size"], t["--max-update"], t["--target-lang"]) == (
        "msc_transformer_iwslt_de_en_72l", "0.000699", "8000", "label_smoothed_cross_entropy_l2", "1e-5", "4096",
        "2", "2", "15000", tgt)  # 2 GPUs x 4096 x 2 = 16k tokens per update, on exactly 2 GPUs
    assert flags(avg)["--num-epoch-checkpoints"] == "5"
    g = flags(gen)
    assert (g["--beam"], g["--lenpen"], g["--remove-bpe"]) == ("5", "1.0", "sentencepiece")
    header = open(os.path.join(ROOT, "recipes/msc/iwslt.sh")).read()
    assert "the paper averages only for WMT" in header


@pytest.mark.parametrize("size,depth,gpus,expect", [
    ("base", "48", "8", dict(arch="msc_transformer_wmt_en_de_48l", betas="(0.9, 0.98)", warmup="8000",
                             update_freq="2", max_update="100000", avg="5")),
    ("big", "18", "1", dict(arch="msc_transformer_wmt_en_de_big_18l", betas="(0.9, 0.998)", warmup="16000",
                            update_freq="16", max_update="300000", avg="20")),
])
def test_msc_wmt14(size, depth, gpus, expect, tmp_path):
    out = dry_run("msc/wmt14_en_de.sh", "--size", size, "--depth", depth, "--gpus", gpus, tmp_path=tmp_path)
    spm, prep, train, avg, gen, hyp, ref, score = in_order(commands(out), [
        r"vocab_size=32000", r"^fairseq-preprocess", r"^fairseq-train", r"average_checkpoints", r"^fairseq-generate",
        r"^grep .*##AT##", r"^perl .*##AT##", r"^sacrebleu .*--tokenize none"])
    t = flags(train)
    assert (t["--arch"], t["--adam-betas"], t["--warmup-updates"], t["--max-tokens"], t["--update-freq"],
            t["--distributed-world-size"], t["--max-update"]) == (
        expect["arch"], expect["betas"], expect["warmup"], "4096", expect["update_freq"], gpus,
        expect["max_update"])
    assert int(gpus) * 4096 * int(expect["update_freq"]) == 65536  # the paper's 65k tokens per update
    assert flags(avg)["--num-epoch-checkpoints"] == expect["avg"]
    g = flags(gen)
    assert (g["--beam"], g["--lenpen"]) == ("4", "0.6")
    header = open(os.path.join(ROOT, "recipes/msc/wmt14_en_de.sh")).read()
    assert "about 37k tokens" in header and "every 100th training pair" in header


# ---------------------------------------------------------------------------------------------------- SAT

@pytest.mark.parametrize("recipe", ["sat/wmt14_en_de.sh", "sat/iwslt14_de_en.sh"])
def test_sat(recipe, tmp_path):
    wmt = "wmt" in recipe
    out = dry_run(recipe, *(["--gpus", "2"] if wmt else []), tmp_path=tmp_path)
    cmds = commands(out)
    teacher, avg, kd, distill, prep = in_order(cmds, [
        r"^fairseq-train .*--task translation --arch transformer_", r"average_checkpoints", r"--gen-subset train",
        r"fairseq_ext\.sat\.distill", r"^fairseq-preprocess"])
    students = [c for c in cmds if c.startswith("fairseq-train") and "translation_sat" in c]
    tests = [c for c in cmds if c.startswith("fairseq-generate") and "--gen-subset test" in c]
    scores = [c for c in cmds if c.startswith("grep -oP")]
    assert len(students) == 3 and len(tests) == 16 and len(scores) == 16  # Q6: the summary is printed too
    assert "--srcdict" in flags(prep) and "--tgtdict" in flags(prep)
    for c in [teacher] + students:
        t = flags(c)
        assert t["--optimizer"] == "adam" and t["--adam-betas"] == "(0.9, 0.98)"
        if wmt:  # the authors' config: eps 1e-9, ~30k tokens per update (8 x 3750)
            assert (t["--adam-eps"], t["--max-tokens"], t["--update-freq"], t["--distributed-world-size"],
                    t["--lr"], t["--warmup-updates"], t["--max-update"], t["--encoder-ffn-embed-dim"],
                    t["--max-source-positions"]) == ("1e-09", "3750", "4", "2", "0.0007", "4000", "100000", "1024",
                                                     "150")
    if wmt:  # the 150-position models must not crash on longer training pairs or test sentences
        assert "--skip-invalid-size-inputs-valid-test" in flags(kd)
        for c in tests:
            assert flags(c)["--model-overrides"] == "{'max_source_positions': 1024, 'max_target_positions': 1024}"
    assert sum(flags(c)["--beam"] == "4" for c in tests) == 8 and sum(flags(c)["--beam"] == "1" for c in tests) == 8


# ---------------------------------------------------------------------------------------------------- BERT-JAM

@pytest.mark.parametrize("recipe,split", [("bert_jam/iwslt14_de_en.sh", False), ("bert_jam/wmt14_en_de.sh", True)])
def test_bert_jam(recipe, split, tmp_path):
    out = dry_run(recipe, tmp_path=tmp_path)
    cmds = commands(out)
    patterns = [r"fairseq_ext\.bert_jam\.prepare", r"--bert-jam-phase 1", r"--bert-jam-phase 2",
                r"--bert-jam-phase 3", r"average_checkpoints .*--num-epoch-checkpoints 10",
                r"^fairseq-generate .* > .*generate-test\.txt", r"^grep -P '\^H-", r"^grep -P '\^T-"]
    if split:
        patterns += [r"^perl .*##AT##.*test\.hyp", r"^perl .*##AT##.*test\.ref"]
    patterns += [r"^fairseq-score --sys .*test\.hyp" + (r"\.cs" if split else r" ")]
    found = in_order(cmds, patterns)
    t = flags(found[3])
    assert (t["--lr"], t["--warmup-updates"], t["--max-tokens"], t["--dropout"], t["--label-smoothing"]) == (
        "0.0005", "4000", "4000", "0.3", "0.1")
    g = flags(found[5])
    assert (g["--beam"], g["--lenpen"]) == (("4", "0.6") if split else ("5", "1.0"))
    if split:
        assert "40k joint BPE merges" in open(os.path.join(ROOT, "recipes", recipe)).read()  # D2


def test_bert_jam_ding(tmp_path):
    """recipes/bert_jam/ding_de_en.sh replays the measured Ding chain (docs/quickstart.md): every stage starts
    from the one before, the caches serve only the frozen-BERT phases, valid picks, and the test split is
    translated once, last."""
    work = str(tmp_path / "work")
    out = dry_run("bert_jam/ding_de_en.sh", env={"WORK": work}, tmp_path=tmp_path)
    cmds = commands(out)
    # e5 is pruned to the German training texts only: never valid or test text
    prune = [x for x in out.splitlines() if x.startswith("zcat ")]
    assert len(prune) == 1
    assert [f[len(ROOT) + 1:] for f in shlex.split(prune[0].split(" > ")[0])[1:]] == [
        f"data/{c}/train.de.gz" for c in ("ding-de-en", "ding-lexicon-de-en", "libreoffice-help-de-en", "bible-de-en")]
    in_order(cmds, [r"prepare_bundled_corpus\.py --corpus ding --vocab-size 8000",
                    r"^fairseq-preprocess .*--joined-dictionary",
                    r"e5_convert .*--prune-to-corpus .*prune_de\.txt", r"fairseq_ext\.bert_jam\.prepare"])
    train = [flags(c) for c in cmds if c.startswith("fairseq-train")]
    stages = ["p1a", "p1b", "p2a", "p2b", "p3a", "p3b", "p3c", "p3d", "p3e"]
    assert [os.path.basename(t["--save-dir"]) for t in train] == stages
    assert [t["--bert-jam-phase"] for t in train] == ["1", "1", "2", "2", "3", "3", "3", "3", "3"]
    assert [t["--max-update"] for t in train] == ["3499", "2292", "1856", "2192", "621", "828", "500", "1600", "1600"]
    assert [t["--lr"] for t in train] == ["0.003"] * 2 + ["0.001"] * 2 + ["0.0003"] * 5
    inits = [t.get("--finetune-from-model") for t in train]
    assert inits == [None] + [f"{work}/{s}/checkpoint_last.pt" for s in stages[:3]] + [
        f"{work}/p2b_best.pt"] + [f"{work}/{s}/checkpoint_last.pt" for s in stages[4:6]] + [
        f"{work}/avg4.pt", f"{work}/p3d_best.pt"]
    assert [t.get("--bert-feature-cache") for t in train] == [f"{work}/cache_phase1"] * 2 + [
        f"{work}/cache_phase2"] * 2 + [None] * 5
    assert all(t["--encoder-embed-dim"] == "128" and t["--dropout"] == "0.3" and t["--max-tokens"] == "1024"
               and "--share-all-embeddings" in t for t in train)
    for d in train[-2:]:
        assert (d["--lr-scheduler"], d["--total-num-update"], d["--end-learning-rate"]) == ("polynomial_decay", "1600",
                                                                                            "0.0")
    # p2b's pick and the final pick score on valid; the test split is generated once, after the last training
    gens = [c for c in cmds if c.startswith("fairseq-generate")]
    subsets = [flags(c)["--gen-subset"] for c in gens]
    assert subsets[-1] == "test" and subsets.count("test") == 1 and flags(gens[-1])["--path"] == f"{work}/final.pt"
    assert cmds.index(gens[-1]) > max(i for i, c in enumerate(cmds) if c.startswith("fairseq-train"))
    avg = [c for c in cmds if "average_checkpoints" in c]
    assert f"--output {work}/avg4.pt" in avg[0] and len(avg) == 15
    # p3d's pick (p3d_best.pt) is made before p3e trains from it, on valid
    cp = [c for c in cmds if c.startswith("cp ")]
    assert [c.split()[-1] for c in cp] == [f"{work}/p2b_best.pt", f"{work}/p3d_best.pt", f"{work}/final.pt"]
    assert cmds.index(cp[1]) < next(i for i, c in enumerate(cmds) if "--save-dir " + f"{work}/p3e" in c)
