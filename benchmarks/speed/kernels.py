"""The kernel choices of the opt-in decoding flags, measured:

1. int8 softmax projection (``int8-decoder`` / ``int8-output``): fbgemm (PyTorch's dynamic quantisation) against
   oneDNN's int8 kernel (AMX tiles) by row count, and the kernel that ``Int8RowsLinear`` picks for each;
2. ``lean-decoder``'s key/value cache reorder after a beam step: a fresh ``index_select`` of the whole buffer
   (what a small buffer takes) against ``reorder_cache`` (the cached positions into a reused spare buffer);
3. ``lean-decoder`` with int8 projections: the self-attention's three int8 q/k/v calls against the one call of
   ``fused_qkv`` (checked equal bit for bit);
4. ``lean-encoder``: a fairseq transformer encoder (--dim, --ffn, --heads, --layers) on one source of each of
   --src-lens tokens, fairseq's layers against the lean ones, float32 (largest difference printed) and with int8
   projections (``int8-encoder``).

    python -m benchmarks.speed.kernels [--vocab 8000] [--dim 256] [--rows 1 4 8 12 16 24 64 256 1024]
                                       [--batches 1 16 64] [--beam 4] [--cached 10 30] [--qkv-rows 1 4 16 24]
                                       [--ffn 512] [--heads 4] [--layers 3] [--src-lens 10 25 50] [--threads 1]
                                       [--parts 1 2 3 4]

Microseconds are the best of 5 timed repeats; ratios are measured in the same run. Part 1 also checks that both
kernels give the same numbers (largest difference printed) and is skipped, with a line, where this PyTorch build
or CPU has no oneDNN int8 kernel with AMX.
"""

import argparse
import copy
import time
import warnings

import torch

from fairseq_ext.inference.lean_decoder import fused_qkv, reorder_cache
from fairseq_ext.inference.lean_encoder import lean_encoder
from fairseq_ext.inference.speedups import Int8RowsLinear, quantize_encoder

from .beam_rows import best_us as best_of_5_us


def best_us(fn, budget_s: float = 0.05) -> float:
    """beam_rows' best of 5, with as many calls per repeat as fit in about ``budget_s``."""
    t0 = time.perf_counter()
    fn()
    return best_of_5_us(fn, max(3, min(2000, int(budget_s / max(time.perf_counter() - t0, 1e-7)))))


def quantize_linears(module):
    """Every nn.Linear of ``module`` as PyTorch's dynamically quantised int8 Linear, in place (what the int8
    speed-ups of fairseq_ext.inference.speedups do to the model's layers)."""
    from torch.ao.quantization import quantize_dynamic

    quantize_dynamic(module, qconfig_spec={torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def int8_rows(a):
    print(f"1. int8 softmax projection {a.vocab} x {a.dim}: fbgemm against oneDNN, {a.threads} thread(s)")
    g = torch.Generator().manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(a.dim, a.vocab))
    with torch.no_grad():
        seq[0].weight.normal_(0, 0.05, generator=g)
    quantize_linears(seq)
    proj = seq[0]
    proj.__class__ = Int8RowsLinear
    saved = Int8RowsLinear.MIN_ROWS
    Int8RowsLinear.MIN_ROWS = 1
    amx = proj.kernel(1) == "onednn"  # what a call of any row count would run with the threshold at 1 row
    Int8RowsLinear.MIN_ROWS = saved
    if not amx:
        print("   skipped: no oneDNN int8 kernel with AMX here (Int8RowsLinear keeps fbgemm for every call)")
        return
    print(f"{'rows':>6} {'fbgemm us':>10} {'oneDNN us':>10} {'fbgemm/oneDNN':>14} {'max |diff|':>11} {'picked':>7}")
    try:
        with torch.inference_mode():
            for R in a.rows:
                x = torch.randn(R, a.dim, generator=g)
                Int8RowsLinear.MIN_ROWS = 1 << 62  # fbgemm for every call
                y_f = proj(x)
                t_f = best_us(lambda: proj(x))
                Int8RowsLinear.MIN_ROWS = 1  # oneDNN for every call
                y_o = proj(x)
                t_o = best_us(lambda: proj(x))
                Int8RowsLinear.MIN_ROWS = saved
                print(f"{R:>6} {t_f:>10.1f} {t_o:>10.1f} {t_f / t_o:>13.2f}x {(y_f - y_o).abs().max().item():>11.2e} "
                      f"{proj.kernel(R):>7}")
    finally:
        Int8RowsLinear.MIN_ROWS = saved


def reorders(a):
    print(f"2. key/value buffer reorder (4 heads x 64, capacity 2n; rows = batch x beam {a.beam}): "
          f"a fresh index_select of the buffer against reorder_cache")
    print(f"{'rows':>6} {'cached n':>9} {'index_select us':>16} {'reorder_cache us':>17} {'x':>6}")
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for bsz in a.batches:
            rows = bsz * a.beam
            for n in a.cached:
                buf = torch.randn(rows, 4, 2 * n, 64, generator=g)
                order = (torch.arange(rows) // a.beam * a.beam + torch.randint(0, a.beam, (rows,), generator=g))
                want = buf.index_select(0, order)[:, :, :n]
                state = {"buf": buf, "spare": None}

                def ours():
                    state["buf"], state["spare"] = reorder_cache(state["buf"], state["spare"], order, n)

                ours()
                if not torch.equal(state["buf"][:, :, :n], want):
                    raise SystemExit(f"reorder_cache differs from index_select for {rows} rows")  # pragma: no cover
                t_old = best_us(lambda: buf.index_select(0, order))
                t_new = best_us(ours)
                print(f"{rows:>6} {n:>9} {t_old:>16.1f} {t_new:>17.1f} {t_old / t_new:>5.2f}x")


def int8_qkv(a):
    print(f"3. int8 q/k/v projections ({a.dim} x {a.dim} each): three calls against one fused call")
    print(f"{'rows':>6} {'three us':>9} {'fused us':>9} {'x':>6}")
    torch.manual_seed(2)
    att = torch.nn.Module()
    att.q_proj, att.k_proj, att.v_proj = (torch.nn.Linear(a.dim, a.dim) for _ in range(3))
    quantize_linears(att)
    with torch.inference_mode():
        for R in a.qkv_rows:
            x = torch.randn(R, 1, a.dim)
            fused = fused_qkv(att)
            if not all(torch.equal(f, m(x)) for f, m in zip(fused(x).chunk(3, dim=-1),
                                                             (att.q_proj, att.k_proj, att.v_proj))):
                raise SystemExit(f"fused int8 q/k/v differ from the three calls for {R} rows")  # pragma: no cover
            t_three = best_us(lambda: (att.q_proj(x), att.k_proj(x), att.v_proj(x)))
            t_fused = best_us(lambda: fused(x).chunk(3, dim=-1))
            print(f"{R:>6} {t_three:>9.1f} {t_fused:>9.1f} {t_three / t_fused:>5.2f}x")


def encoder_layers(a):
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerEncoder, base_architecture

    print(f"4. encoder of {a.layers} layers (d {a.dim}, FFN {a.ffn}, {a.heads} heads), one source: fairseq's layers "
          f"against lean_encoder")
    args = argparse.Namespace(encoder_embed_dim=a.dim, encoder_ffn_embed_dim=a.ffn, encoder_attention_heads=a.heads,
                              encoder_layers=a.layers, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    base_architecture(args)
    d = Dictionary()
    for i in range(a.vocab - len(d)):
        d.add_symbol(f"w{i}")
    torch.manual_seed(3)
    plain = torch.nn.Module()
    plain.encoder = TransformerEncoder(args, d, torch.nn.Embedding(len(d), a.dim, d.pad()))
    plain.eval()
    models = {"float": (plain, lean_encoder(copy.deepcopy(plain)))}
    int8 = quantize_encoder(copy.deepcopy(plain))
    models["int8"] = (int8, lean_encoder(copy.deepcopy(int8)))
    print(f"{'tokens':>7} {'':>6} {'fairseq us':>11} {'lean us':>8} {'x':>6} {'max |diff|':>11}")
    with torch.inference_mode():
        for L in a.src_lens:
            src = torch.randint(d.nspecial, len(d), (1, L))
            src[0, -1] = d.eos()
            lengths = torch.tensor([L])
            for kind, (fairseq_model, lean_model) in models.items():
                def run(m):
                    return m.encoder(src, src_lengths=lengths)["encoder_out"][0]

                diff = (run(fairseq_model) - run(lean_model)).abs().max().item()
                t_fairseq, t_lean = best_us(lambda: run(fairseq_model)), best_us(lambda: run(lean_model))
                print(f"{L:>7} {kind:>6} {t_fairseq:>11.1f} {t_lean:>8.1f} {t_fairseq / t_lean:>5.2f}x {diff:>11.2e}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 24, 64, 256, 1024])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--cached", type=int, nargs="+", default=[10, 30])
    p.add_argument("--qkv-rows", type=int, nargs="+", default=[1, 4, 16, 24])
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--src-lens", type=int, nargs="+", default=[10, 25, 50])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parts", type=int, nargs="+", choices=range(1, 5), default=list(range(1, 5)),
                   help="which parts to run (default all)")
    a = p.parse_args(argv)
    if min([a.vocab, a.dim, a.beam, a.threads, a.ffn, a.heads, a.layers] + a.rows + a.batches + a.cached
           + a.qkv_rows + a.src_lens) < 1:
        p.error("--vocab, --dim, --rows, --batches, --beam, --cached, --qkv-rows, --ffn, --heads, --layers, "
                "--src-lens and --threads must be positive")
    if a.dim % a.heads:
        p.error(f"--dim {a.dim} is not a multiple of --heads {a.heads}")
    torch.set_num_threads(a.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices
        for i, part in enumerate((int8_rows, reorders, int8_qkv, encoder_layers)):
            if i + 1 in a.parts:
                part(a)


if __name__ == "__main__":
    main()
