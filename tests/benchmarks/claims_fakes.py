"""Fabricated results for the claims report tests."""


def bleu_result(v):
    sig = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"
    return {f"bleu_{s}_{d}": v for s in ("valid", "test") for d in ("greedy", "beam4")} | {
        f"bleu_{s}_{d}_signature": sig for s in ("valid", "test") for d in ("greedy", "beam4")}
