"""Report of python -m benchmarks.compare: fairseq's json training logs parsed, ratios to the baselines, the markdown
table, the figures drawn here, one measured sentence per claim of the papers, and RESULTS.md (whose hand-written
commentary block is kept on a re-run)."""

import json
import os
import platform
import statistics

from .runner import CompareError
from .specs import (CORPUS_DESCRIPTION, EXTRA_REFS_DESCRIPTION, RESULT_KEYS, SMOKE_LINES, SMOKE_MAX_WORDS,
                    SMOKE_VOCAB_SIZE, VOCAB_SIZE)

EQUAL_WALL_CLOCK = ("Every model trains for the same wall-clock minutes on 2 CPU cores: a model slower per update "
                    "trains fewer updates, so a column ranks the models at that budget, not at convergence.")
PAPERS_CLAIMS = ("Each paper's own claim is tested with the control it needs (equal depth, equal updates, equal data) "
                 "in [CLAIMS.md](CLAIMS.md) (`python -m benchmarks.claims --paper sat|msc|bert_jam|convs2s`); a "
                 "wall-clock race is not what any of the papers claims.")


def json_records(log, kind):
    """The json records of fairseq's log lines ``| INFO | <kind> | {...}``."""
    out = []
    if not log or not os.path.exists(log):
        return out
    tag = f"| {kind} | "
    with open(log, errors="replace") as f:
        for line in f:
            i = line.find(tag)
            if i >= 0:
                try:
                    out.append(json.loads(line[i + len(tag):]))
                except ValueError:
                    pass
    return out


def last_update(log):
    recs = json_records(log, "train_inner")
    return int(float(recs[-1]["num_updates"])) if recs else None


def parse_train_log(log):
    inner = json_records(log, "train_inner")
    if not inner:
        raise CompareError(f"{log}: no train_inner records (was it trained with --log-format json?)")
    wps = [float(r["wps"]) for r in inner[1:] or inner]  # the first interval includes the warm-up
    valid = json_records(log, "valid")
    return {"train_updates": int(float(inner[-1]["num_updates"])), "train_tokens_per_s": statistics.median(wps),
            "train_loss_last": float(inner[-1]["loss"]),
            "valid_loss_last": float(valid[-1]["valid_loss"]) if valid else None}


def fmt_minutes(seconds):
    m = int(round(seconds / 60))
    return f"{m // 60}h{m % 60:02d}" if m >= 60 else f"{max(seconds, 0) / 60:.1f} min"


def machine():
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        cpu = platform.processor()
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "fairseq-fixed", "sacrebleu"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), **versions,
            "load_average": os.getloadavg()[0]}


RATIO_KEYS = [k for k in RESULT_KEYS if k != "train_updates"]


def ratios(results):
    out = {}
    for name, r in results.items():
        base = results.get(r["baseline"])
        if base is None:
            continue
        out[name] = {k: (r[k] / base[k] if base.get(k) else None) for k in RATIO_KEYS}
    return out


COLUMNS = [("params", "params (M)", 1e-6, 2), ("train_tokens_per_s", "train tok/s", 1, 0),
           ("peak_rss_mb", "peak MB", 1, 0), ("bleu_valid_greedy", "valid BLEU greedy", 1, 2),
           ("bleu_beam4", "BLEU beam 4", 1, 2), ("bleu_greedy", "BLEU greedy", 1, 2),
           ("bleu_beam4_multiref", "BLEU beam 4, 3 refs", 1, 2),
           ("latency_b1_ms_greedy", "ms/sent b1 greedy", 1, 1), ("latency_b1_ms_beam4", "ms/sent b1 beam 4", 1, 1),
           ("throughput_b64_sent_s_greedy", "sent/s b64 greedy", 1, 1),
           ("throughput_b64_sent_s_beam4", "sent/s b64 beam 4", 1, 1)]


def table(results, rat):
    """Markdown table: absolute numbers, with the ratio to the baseline of the same direction beside them."""
    head = "| model | dir | updates | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for name, r in results.items():
        cells = []
        for key, _, scale, digits in COLUMNS:
            v = r.get(key)
            cell = "-" if v is None else f"{v * scale:.{digits}f}"
            q = rat.get(name, {}).get(key)
            if q is not None and name != r["baseline"]:
                cell += f" ({q:.2f}x)"
            cells.append(cell)
        lines.append(f"| {r['label']} | {r['direction']} | {r['train_updates']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_training_curves(path, logs, results):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    drawn = 0
    for name, log in logs.items():
        recs = json_records(log, "train_inner")
        if not recs:
            continue
        ax.plot([float(r["wall"]) / 60 for r in recs], [float(r["loss"]) for r in recs], label=results[name]["label"],
                linewidth=1)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("wall-clock minutes of training")
    ax.set_ylabel("train loss (label-smoothed CE, bits/token)")
    ax.set_title("training curves (SAT students: loss on the distilled data)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def sat_points(results):
    """{beam name: [(K, BLEU, batch-1 speed-up over the baseline)]} for K = 1 (the baseline) and the students."""
    base = results.get("transformer")
    if base is None:
        return {}
    pts = {}
    for mode in ("greedy", "beam4"):
        pts[mode] = [(1, base[f"bleu_{mode}"], 1.0)]
        for k in (2, 4, 6):
            r = results.get(f"sat_k{k}")
            if r:
                pts[mode].append((k, r[f"bleu_{mode}"], base[f"latency_b1_ms_{mode}"] / r[f"latency_b1_ms_{mode}"]))
    return pts


def plot_sat_tradeoff(path, results):
    import matplotlib.pyplot as plt

    pts = sat_points(results)
    if not pts or len(pts["greedy"]) < 2:
        return False
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for mode, marker in (("greedy", "o"), ("beam4", "s")):
        ks, bleu, speed = zip(*pts[mode])
        ax.plot(speed, bleu, marker=marker, label="beam 1 (greedy)" if mode == "greedy" else "beam 4")
        for k, b, s in pts[mode]:
            ax.annotate(f"K={k}", (s, b), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("batch-1 decoding speed-up over the transformer (K=1)")
    ax.set_ylabel("sacreBLEU (test)")
    ax.set_title("SAT: speed vs quality (cf. the paper's Table 3)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def multiref(r, key="bleu_beam4"):
    """' (X against the three English translations)' when the model was scored against them."""
    v = r.get(f"{key}_multiref")
    return f" ({v:.2f} against the three English translations)" if v is not None else ""


COMMENTARY_BEGIN = "<!-- commentary:begin (hand-written; python -m benchmarks.compare keeps this block) -->"
COMMENTARY_END = "<!-- commentary:end -->"
DEFAULT_COMMENTARY = ("_No hand-written commentary yet: add it here after a full run; the measured comparisons above "
                      "are regenerated on every run._")


def kept_commentary(path):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return DEFAULT_COMMENTARY
    i, j = text.find(COMMENTARY_BEGIN), text.find(COMMENTARY_END)
    return text[i + len(COMMENTARY_BEGIN): j].strip("\n") if 0 <= i < j else DEFAULT_COMMENTARY


def write_results_md(path, out, figures):
    meta, results = out["meta"], out["models"]
    m = meta["machine"]
    sig = next((r["bleu_signature"] for r in results.values()), "")
    sig3 = next((r["bleu_signature_multiref"] for r in results.values() if r.get("bleu_signature_multiref")), None)
    test_n = ", ".join(sorted({str(r["test_sentences"]) for r in results.values()}))
    base = results.get("transformer")
    lines = [
        "# Results: every architecture on the bundled German-English Bible corpus",
        "",
        "Generated by `python -m benchmarks.compare` (" + ("**smoke mode: tiny models, meaningless numbers**; "
                                                           if meta["smoke"] else "") +
        f"{meta['date']}). Re-run it to regenerate this page; the commentary block at the end is kept.",
        "",
        "## Setup",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, fairseq-fixed "
        f"{m['fairseq-fixed']}, sacreBLEU {m['sacrebleu']} (load average {m['load_average']:.1f} at the end).",
        f"- Data: {CORPUS_DESCRIPTION}, joint sentencepiece BPE {VOCAB_SIZE // 1000}k, as `examples/quickstart.sh`"
        + (f" (smoke: the first {'/'.join(map(str, SMOKE_LINES.values()))} verses of at most {SMOKE_MAX_WORDS} words, "
           f"BPE {SMOKE_VOCAB_SIZE})"
           if meta["smoke"] else "")
        + f"; test sentences scored: {test_n}; De->En also scored against {EXTRA_REFS_DESCRIPTION} at once "
        "(multi-reference BLEU, the '3 refs' column)"
        + (f"; distilling the training set for the SAT students took {meta['kd_minutes']:.1f} minutes"
           if meta["kd_minutes"] else "") + ".",
        f"- Budget: {meta['minutes_per_model']} wall-clock minutes of `fairseq-train` per model (`--stop-time-hours`)"
        + (f", at most {meta['max_update']} updates" if meta["max_update"] else "")
        + f", torch threads: {meta['train_threads']}"
        + (f"; planned total {fmt_minutes(60 * meta['planned_minutes'])}" if meta.get("planned_minutes") else "")
        + "; the SAT students train on the training set distilled (greedy) by the teacher, the De->En model with "
        "the best greedy valid BLEU" + (f" ({meta['sat_teacher']})" if meta.get("sat_teacher") else "")
        + ", and start from it" + (f" (from {meta['sat_init_from']}: the teacher's layout is not a transformer's)"
                                   if meta.get("sat_init_from") and meta.get("sat_init_from") != meta.get("sat_teacher")
                                   else "")
        + "; BERT-JAM runs its phases 1, 2 and 3 in sequence within its budget (phases 1-2 on precomputed MiniLM "
        "features, --bert-feature-cache). Each model is evaluated with the average of its newest two epoch "
        "checkpoints and its last checkpoint.",
        f"- Measurements (torch threads: {meta['eval_threads']}): sacreBLEU of the detokenised test output with "
        f"beam 4 and greedy (outputs bounded to 1.2 x source + 10 tokens), `{sig}`"
        + (f" (3 refs: `{sig3}`)" if sig3 else "") + "; valid BLEU: greedy, single "
        f"reference (what the SAT teacher is chosen by); latency at batch 1 over the "
        f"first {meta['latency_sentences']} test sentences; throughput at batch 64 over the test set (sorted by "
        "length); each model decodes with its task's generator (the SAT students with the package's "
        "semi-autoregressive generator, the others with fairseq's `SequenceGenerator`); train tokens/s = median of "
        "fairseq's `wps` (target tokens); peak memory = maximum RSS of the training process (which includes the "
        "~350 MB of an interpreter with torch and fairseq imported, as any `fairseq-train` has); parameters count "
        "every parameter (BERT-JAM's MiniLM included, fine-tuned in phase 3; `params_trainable` in results.json)."
        " Ratios in parentheses are model / transformer baseline of the same direction (for latency "
        "and memory, above 1 is worse; for the others, above 1 is more).",
        "",
        "## Numbers (equal wall clock on 2 cores)",
        "",
        EQUAL_WALL_CLOCK,
        "",
        table(results, out["ratios"]),
        "",
    ]
    if base:
        lines += [f"The De->En transformer baseline reaches **{base['bleu_beam4']:.2f} BLEU** (beam 4, test)"
                  f"{multiref(base)} after {base['train_updates']} updates in {meta['minutes_per_model']} minutes.",
                  ""]
    lines += ["## The papers' claims", "", PAPERS_CLAIMS]
    lines += ["", "## Figures", ""]
    for title, fig in figures.items():
        lines += [f"### {title}", "", f"![{title}]({os.path.basename(fig)})", ""]
    lines += ["## Commentary", "", COMMENTARY_BEGIN, kept_commentary(path), COMMENTARY_END, ""]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    os.replace(path + ".tmp", path)

