"""Per-row work of the SAT beam step: what one step of the group beam search spends on each distribution row
besides the decoder, with ``topk`` and with ``fairseq_ext.sat.generator``'s ``top_b``, and with a full NaN pass and
with the generator's check on the selected values only; and the K = 1 beam's top 2B + 1 over a sentence's B x V
scores, with ``topk`` and with ``fairseq_ext.sat.step_rules``' ``chunked_topk``; and the greedy choice's best two
words of each row (sentences x K), with ``topk`` and with ``chunked_topk`` in chunks of 16, 32 and 64 words.

    python -m benchmarks.speed.beam_rows [--vocab 8000] [--beam 4] [--rows 4 16 24] [--greedy-rows 1 2 3 4 16 64]
                                         [--threads 1]

For each row count (beam 4: K=1 -> 4 rows, K=4 -> 16, K=6 -> 24) it times, on log-probabilities of random
scores, ``topk`` against ``top_b`` (checking equal values), and fairseq's full ``isnan`` -> -inf pass (which the
search makes on a GPU) against the check on the selected values (which it makes on a CPU). Microseconds are the
best of 5 timed repeats; the ratios are measured in the same run.
"""

import argparse
import math
import time

import torch

from fairseq_ext.sat.generator import top_b
from fairseq_ext.sat.step_rules import FLAT_CHUNKS_MIN, GREEDY_CHUNKED_MIN_ROWS, TOP_K_CHUNK, chunked_topk


def best_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return min(times)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.beam_rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--rows", type=int, nargs="+", default=[4, 16, 24])
    p.add_argument("--greedy-rows", type=int, nargs="+", default=[1, 2, 3, 4, 16, 64])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=500)
    a = p.parse_args(argv)
    if a.vocab < 1 or a.beam < 1 or a.beam > a.vocab or any(r < 1 for r in a.rows + a.greedy_rows):
        p.error("--vocab, --beam and --rows / --greedy-rows must be positive, and --beam at most --vocab")
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"per-row beam work: vocabulary {a.vocab}, beam {a.beam}, {a.threads} thread(s), best of 5 x {a.iters}")
    print(f"{'rows':>5} {'topk us':>9} {'top_b us':>9} {'x':>6} {'isnan pass us':>14} {'selected check us':>18}")
    with torch.inference_mode():
        for R in a.rows:
            lprobs = torch.log_softmax(torch.randn(R, 1, a.vocab, generator=g) * 3, dim=-1)
            vals, _ = top_b(lprobs, a.beam)
            if not torch.equal(vals, lprobs.topk(a.beam, dim=-1).values):
                raise SystemExit(f"top_b and topk disagree for {R} rows")  # pragma: no cover
            t_topk = best_us(lambda: lprobs.topk(a.beam, dim=-1), a.iters)
            t_top_b = best_us(lambda: top_b(lprobs, a.beam), a.iters)
            eos = lprobs[:, :, 2].clone()
            t_fill = best_us(lambda: lprobs.masked_fill_(lprobs.isnan(), -math.inf), a.iters)
            t_check = best_us(lambda: bool(vals.isnan().any()) or bool(eos.isnan().any()), a.iters)
            print(f"{R:>5} {t_topk:>9.1f} {t_top_b:>9.1f} {t_topk / t_top_b:>5.2f}x {t_fill:>14.1f} {t_check:>18.1f}")
        k = 2 * a.beam + 1
        print(f"K = 1 beam: top {k} of a sentence's P x {a.vocab} scores (chunked from {FLAT_CHUNKS_MIN} chunks of "
              f"{TOP_K_CHUNK})")
        print(f"{'P':>5} {'topk us':>9} {'chunked us':>11} {'x':>6}")
        for P in sorted({1, a.beam}):
            flat = torch.log_softmax(torch.randn(P, a.vocab, generator=g) * 3, dim=-1).view(1, -1)
            if flat.size(1) // TOP_K_CHUNK < k:
                continue
            if not torch.equal(chunked_topk(flat, k)[0], flat.topk(k, dim=1).values):
                raise SystemExit(f"chunked_topk and topk disagree for P = {P}")  # pragma: no cover
            t_topk = best_us(lambda: flat.topk(k, dim=1), a.iters)
            t_chunked = best_us(lambda: chunked_topk(flat, k), a.iters)
            print(f"{P:>5} {t_topk:>9.1f} {t_chunked:>11.1f} {t_topk / t_chunked:>5.2f}x")
        chunks = [c for c in (16, 32, 64) if a.vocab >= 2 * c]
        print(f"greedy: the best two words of each row (chunked in {TOP_K_CHUNK}s from {GREEDY_CHUNKED_MIN_ROWS} "
              f"rows on)")
        print(f"{'rows':>5} {'topk us':>9} " + " ".join(f"{f'chunks of {c} us':>17}" for c in chunks))
        for R in a.greedy_rows:
            rows = torch.log_softmax(torch.randn(R, a.vocab, generator=g) * 3, dim=-1)
            ref = rows.topk(2, dim=1).values
            if any(not torch.equal(chunked_topk(rows, 2, c)[0], ref) for c in chunks):
                raise SystemExit(f"chunked_topk and topk disagree for {R} rows")  # pragma: no cover
            t_topk = best_us(lambda: rows.topk(2, dim=1), a.iters)
            print(f"{R:>5} {t_topk:>9.1f} " + " ".join(
                f"{(t := best_us(lambda c=c: chunked_topk(rows, 2, c), a.iters)):>9.1f} ({t_topk / t:.2f}x)"
                for c in chunks))


if __name__ == "__main__":
    main()
