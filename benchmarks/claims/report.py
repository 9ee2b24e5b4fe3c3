"""docs/CLAIMS.md and docs/claims.json for python -m benchmarks.claims: one section (and one record) per paper,
replaced when that paper is run again, the others kept."""

import os
import re
import shutil
import time

from .jobs import ROOT, read_json, write_json

HEADER = """# The papers' claims, tested with their controls

Each section is written by `python -m benchmarks.claims --paper PAPER` (the command is in the section) on the
bundled Bible corpus (German -> English, 29,080 training verses, the release's sentencepiece model and dictionary),
on 2 CPU cores: the experiment each paper's claim needs, with the control of equal depth, updates and data, at the
size that fits (the sizes are flags of the same command, for a larger machine). Hyper-parameters and checkpoints are
chosen on the valid set; the test set is decoded after training and chooses nothing. Every BLEU is sacreBLEU on
detokenised text (signature in each section). `docs/claims.json` holds the same numbers and each paper's verdict.
A run longer than a machine session goes on in the next one from the finished steps' results, committed in
`benchmarks/claims/store/PAPER` (the same command skips them), with the checkpoints that a later step reads
(the SAT teacher and distilled students, for the timing and the release; without optimizer state); a larger budget
(`--msc-updates`, ...) continues each finished training from its checkpoints in the work directory.
`--start-within MINUTES` starts no training after a run's first MINUTES: the ones running finish and are evaluated,
so that a session ends with what it started stored, and the same command goes on.

One table of verdict words for all four papers:

| verdict | means |
|---|---|
| reproduced | the fair experiment ran and every target of the section is met |
| partly reproduced | the fair experiment ran and some targets are met: the section names which effects hold |
| not reproduced | the fair experiment ran and the effect is absent: no target is met |
| not tested | the experiment could not be run as designed (an arm still learning when its budget ended, or a part not \
run): the section says what would test it |

An arm is still learning when the last 20% of its updates gained 1% valid loss or more. A control that no target
reads (MSC's post-norm transformer) is named when it is still learning, without changing the verdict.
"""
VERDICTS = ("reproduced", "partly reproduced", "not reproduced", "not tested")


def verdict_of(met):
    """The verdict word of a fair experiment from ``met`` ({target: True/False}): every one, some, none."""
    if not met:
        raise ValueError("a verdict needs at least one target")
    hits = sum(bool(v) for v in met.values())
    return "reproduced" if hits == len(met) else "partly reproduced" if hits else "not reproduced"


def past_early_regime(verdict, reason, unflat, longer):
    """A verdict needs every arm trained past its early regime (the last 20% of its updates gains < 1% valid loss,
    ``common.flattened``). ``unflat``: the sentence naming the arms still falling ("" when none, and the verdict
    stands); otherwise the experiment did not run as designed, so the verdict is "not tested" and the reason says
    what the targets read as measured and what would test them (``longer``: the flag of a longer budget)."""
    if not unflat:
        return verdict, reason
    return "not tested", (f"Not tested as designed: arms were still learning when their budget ended, so the targets "
                          f"are not yet evidence about the paper (as measured they read \"{verdict}\"; a longer "
                          f"budget, {longer}, would test them). " + reason)


def provenance(results, paper):
    """The code commits and seeds the given job results were computed with and what they cost (for claims.json),
    and the sentences for the section: results of several commits are never mixed without saying so. The cost is
    each step's minutes times its threads (core-hours), summed over the steps; a training resumed across runs counts
    the minutes of every process that trained it (its ``train_minutes``), not only the last one's."""
    commits = sorted({r.get("code_commit", "unknown") for r in results})
    seeds = sorted({str(r["seed"]) for r in results if r.get("seed") is not None})
    timed = [r for r in results if r.get("minutes") is not None]
    core_hours = round(sum(max(r["minutes"], r.get("train_minutes") or 0) * r.get("threads", 1) for r in timed)
                       / 60, 2)
    line = ("All results of this section come from one version of the code" if len(commits) == 1 else
            f"**The results of this section come from {len(commits)} versions of the code**: steps finished "
            "earlier were kept when the code changed")
    cost = (f" Cost: {core_hours:.1f} core-hours of CPU over its {len(timed)} steps (each step's minutes times its "
            f"threads; `{paper}.core_hours`)." if timed else "")
    return ({"code_commits": commits, "seeds": seeds, "core_hours": core_hours if timed else None},
            f"{line} (`docs/claims.json`: `{paper}.code_commits`, `{paper}.seeds`).{cost}")


def pyplot():
    """``matplotlib.pyplot`` drawing to files only (the Agg backend), its font-search messages silenced."""
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, png):
    """Writes ``fig`` to ``png`` (tight layout, 120 dpi, its folder made) and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def begin(paper):
    return f"<!-- claims:{paper} -->"


def end(paper):
    return f"<!-- /claims:{paper} -->"


def write(docs_dir, paper, markdown, record, figures=()):
    """Replaces ``paper``'s section of CLAIMS.md and its record in claims.json; copies ``figures`` (paths) next to
    them, as ``claims_NAME``."""
    if record.get("verdict") not in VERDICTS:
        raise ValueError(f"verdict {record.get('verdict')!r} is not one of {VERDICTS}")
    if not record.get("reason"):
        raise ValueError("a verdict needs its reason")
    os.makedirs(docs_dir, exist_ok=True)
    for path in figures:
        shutil.copyfile(path, os.path.join(docs_dir, "claims_" + os.path.basename(path)))
    md_path = os.path.join(docs_dir, "CLAIMS.md")
    old = open(md_path, encoding="utf-8").read() if os.path.exists(md_path) else HEADER
    first = old.find("<!-- claims:")
    old = HEADER.rstrip("\n") + "\n\n" + (old[first:] if first >= 0 else "")  # the header as the code says
    section = f"{begin(paper)}\n{markdown.strip()}\n{end(paper)}\n"
    pat = re.compile(re.escape(begin(paper)) + r".*?" + re.escape(end(paper)) + r"\n?", re.S)
    new = pat.sub(lambda m: section, old) if pat.search(old) else old.rstrip("\n") + "\n\n" + section
    with open(md_path + ".tmp", "w", encoding="utf-8") as f:
        f.write(new)
    os.replace(md_path + ".tmp", md_path)
    json_path = os.path.join(docs_dir, "claims.json")
    records = read_json(json_path, {}) or {}
    records[paper] = {**record, "written": time.strftime("%Y-%m-%d")}
    write_json(json_path, records)
    return md_path, json_path


def command(args, paper):
    """The command that produced a section: the non-default flags of this run (paths left out)."""
    words = ["python", "-m", "benchmarks.claims", "--paper", paper]
    for k, v in sorted(vars(args).items()):
        if k in ("paper", "workdir", "docs_dir", "start_within") or v is None:
            continue
        default = args.defaults.get(k) if hasattr(args, "defaults") else None
        if v == default or k == "defaults":
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            words += [flag] if v else []
        elif isinstance(v, str) and os.path.isabs(v):
            words += [flag, os.path.relpath(v, ROOT)]
        else:
            words += [flag, str(v)]
    return " ".join(words)


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        out.append("| " + " | ".join("" if c is None else str(c) for c in r) + " |")
    return "\n".join(out)


def fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def signatures(results):
    """The distinct sacreBLEU signatures of these eval results."""
    sigs = sorted({v for r in results for k, v in r.items() if k.endswith("_signature")})
    return ", ".join(f"`{s}`" for s in sigs) or "-"
