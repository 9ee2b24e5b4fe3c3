"""msc_transformer decoding latency: the legacy decoding path against the current one, batch 1,
beam 4 and greedy, measured in one process with the contenders interleaved; prints ms/sentence, the ratio,
and whether the hypotheses and scores are identical.

* ``legacy``: the eager-reorder path, rebuilt on the same model by patching three methods: every step
  reorders all 2N+1 MSC encoder tensors (``msc_blocks``, ``msc_contexts``) and every cross-attention cache
  (one per hypothesis: the 2N encoder/context attentions compute their keys and values for every hypothesis).
* ``current``: fairseq's stock ``reorder_incremental_state`` (static caches stay put under beam-local
  permutations), fairseq's beamable cross attention (keys/values once per sentence; ``set_beam_size``) for
  searches over at least ``BEAMABLE_MIN_SENTENCES`` (8) sentences, and the lazy reorder of the MSC tensors
  (only a composed batch index per step). ``beamable always`` / ``beamable never`` move that threshold to 1 /
  infinity (the measurement behind it).
* ``current+fused_gate`` (``--try-fusions``): the gate of Eq. 12-13 computed as ``sigmoid(addmm(W2 a_c + b,
  a_h, W1^T))`` and ``lerp(a_c, a_h, g)`` (2 kernels fewer per gated layer): measured, not adopted unless it
  pays (see docs/msc_transformer.md).

Model: random init, ``msc_transformer_iwslt_de_en`` sizes by default (6 blocks x 1 layer, d 256, FFN 512,
4 heads, as the quickstart's d 256 / FFN 512 / 4 heads) with a 10k shared vocabulary; sources of 15-30 random
tokens; the output length is forced (``min_len = max_len = --out-len``) so that every contender does the same
number of steps.

    python -m benchmarks.speed.msc_decode [--sentences 20] [--batch 1] [--reps 3] [--out-len 25] [--threads 1]
        [--arch msc_transformer_iwslt_de_en] [--layers-per-block M] [--try-fusions] [--device cpu|cuda]

Timings on a shared machine are noisy: compare the ratios measured in one run, not absolute numbers.
"""

import argparse
import contextlib
import statistics
import sys
import time


def build(arch, layers_per_block, vocab=10000):
    import torch
    from fairseq.data import Dictionary
    from fairseq.models import ARCH_CONFIG_REGISTRY

    import fairseq_ext  # noqa: F401
    from fairseq_ext.msc.model import MSCTransformerModel

    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    p = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    MSCTransformerModel.add_args(p)
    flags = ["--share-all-embeddings"]
    if layers_per_block:
        flags += ["--encoder-layers-per-block", str(layers_per_block)]
    a = p.parse_args(flags)
    ARCH_CONFIG_REGISTRY[arch](a)

    class Task:
        source_dictionary = target_dictionary = d

    torch.manual_seed(0)
    return MSCTransformerModel.build_model(a, Task()).eval(), d


@contextlib.contextmanager
def legacy(model):
    """The legacy decoding path (eager reorders, one cross-attention cache per hypothesis)."""
    from fairseq.modules import MultiheadAttention

    enc_cls = type(model.encoder)

    def reorder_encoder_out(encoder_out, new_order):
        out = super(enc_cls, model.encoder).reorder_encoder_out(encoder_out, new_order)
        out["msc_blocks"] = [b.index_select(1, new_order) for b in encoder_out["msc_blocks"]]
        out["msc_contexts"] = [c.index_select(1, new_order) for c in encoder_out["msc_contexts"]]
        if out["msc_blocks"]:
            out["encoder_out"] = [out["msc_blocks"][-1]]
        return out

    def reorder_incremental_state_scripting(incremental_state, new_order):
        for module in model.decoder.modules():
            if isinstance(module, MultiheadAttention):
                buf = module._get_input_buffer(incremental_state)
                if buf:
                    for k in list(buf.keys()):
                        if buf[k] is not None:
                            buf[k] = buf[k].index_select(0, new_order)
                    module._set_input_buffer(incremental_state, buf)

    model.encoder.reorder_encoder_out = reorder_encoder_out
    model.decoder.reorder_incremental_state_scripting = reorder_incremental_state_scripting
    model.set_beam_size = lambda beam: None
    try:
        yield
    finally:
        for obj, name in ((model.encoder, "reorder_encoder_out"),
                          (model.decoder, "reorder_incremental_state_scripting"), (model, "set_beam_size")):
            delattr(obj, name)


@contextlib.contextmanager
def beamable_from(n):
    """The current path with fairseq's beamable cross attention from n sentences on (default: 8)."""
    from fairseq_ext.msc import model as msc_model

    orig = msc_model.BEAMABLE_MIN_SENTENCES
    msc_model.BEAMABLE_MIN_SENTENCES = n
    try:
        yield
    finally:
        msc_model.BEAMABLE_MIN_SENTENCES = orig


@contextlib.contextmanager
def fused_gate():
    import torch

    from fairseq_ext.msc.model import MSCGate

    def forward(self, a_h, a_c):
        z = self.W2(a_c)
        g = torch.sigmoid(torch.addmm(z.reshape(-1, z.size(-1)), a_h.reshape(-1, a_h.size(-1)),
                                      self.W1.weight.t()).view_as(z))
        return torch.lerp(a_c, a_h, g)

    orig = MSCGate.forward
    MSCGate.forward = forward
    try:
        yield
    finally:
        MSCGate.forward = orig


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speed.msc_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="msc_transformer_iwslt_de_en")
    ap.add_argument("--layers-per-block", type=int, default=None)
    ap.add_argument("--sentences", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out-len", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1, help="sentences per batch (same length within a batch)")
    ap.add_argument("--try-fusions", action="store_true")
    ap.add_argument("--device", default="cpu")
    return ap.parse_args(argv)


def random_sources(args, d, dev):
    """--sentences random sources of 15-30 tokens, in batches of --batch sources of one length."""
    import torch

    g = torch.Generator().manual_seed(0)
    sources = []
    for _ in range(0, args.sentences, args.batch):
        n = int(torch.randint(15, 31, (1,), generator=g))
        src = torch.randint(d.nspecial, len(d), (args.batch, n), generator=g)
        src[:, -1] = d.eos()
        lengths = torch.full((args.batch,), n, device=dev)
        sources.append({"net_input": {"src_tokens": src.to(dev), "src_lengths": lengths}})
    return sources


def time_contenders(args, model, d, sources, contenders):
    """Milliseconds per batch (one list of --reps per batch) and the hypotheses of every (beam, contender)."""
    import torch
    from fairseq.sequence_generator import SequenceGenerator

    gens = {beam: SequenceGenerator([model], d, beam_size=beam, max_len_a=0, max_len_b=args.out_len,
                                    min_len=args.out_len) for beam in (4, 1)}

    def decode(beam, sample):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = gens[beam].generate([model], sample)
        ms = (time.perf_counter() - t0) * 1000
        return ms, [[(h["tokens"].tolist(), h["score"].item(), h["positional_scores"].tolist()) for h in hyps]
                    for hyps in out]

    # interleaved per batch (every contender decodes the same batch back to back), so that the load of a shared
    # machine drifts over all contenders alike; per batch the median over --reps
    times = {(beam, c): [[] for _ in sources] for beam in (4, 1) for c in contenders}
    outputs = {(beam, c): [None] * len(sources) for beam in (4, 1) for c in contenders}
    for _ in range(args.reps):
        for i, sample in enumerate(sources):
            for beam in (4, 1):
                for name, ctx in contenders.items():
                    with ctx():
                        ms, out = decode(beam, sample)
                    times[(beam, name)][i].append(ms)
                    outputs[(beam, name)][i] = out
    return times, outputs


def print_table(contenders, times, outputs, n_sent):
    print("\n| search | contender | ms/sentence | x legacy | hypotheses | scores |")
    print("|---|---|---|---|---|---|")
    for beam in (4, 1):
        base = sum(statistics.median(t) for t in times[(beam, "legacy")]) / n_sent
        ref = [h for batch in outputs[(beam, "legacy")] for h in batch]
        for name in contenders:
            ms = sum(statistics.median(t) for t in times[(beam, name)]) / n_sent
            out = [h for batch in outputs[(beam, name)] for h in batch]
            same_tokens = all([h[0] for h in a] == [h[0] for h in b] for a, b in zip(out, ref))
            diffs = [abs(x - y) for a, b in zip(out, ref) for ha, hb in zip(a, b)
                     for x, y in zip([ha[1]] + ha[2], [hb[1]] + hb[2])]
            same = "identical" if max(diffs) == 0 else f"max abs diff {max(diffs):.2e}"
            print(f"| {'beam 4' if beam > 1 else 'greedy'} | {name} | {ms:.1f} | {ms / base:.3f} | "
                  f"{'identical' if same_tokens else 'DIFFERENT'} | {same} |")


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    model, d = build(args.arch, args.layers_per_block)
    model.to(dev)
    n_enc, n_dec = len(model.encoder.layers), len(model.decoder.layers)
    print(f"{args.arch}: {n_enc} encoder layers, {n_dec} decoder layers, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; {args.sentences} sentences, "
          f"batch {args.batch}, output length {args.out_len}, {args.threads} thread(s), {args.device}", flush=True)
    sources = random_sources(args, d, dev)
    contenders = {"legacy": lambda: legacy(model), "current": contextlib.nullcontext,
                  "current, beamable always": lambda: beamable_from(1),
                  "current, beamable never": lambda: beamable_from(10 ** 9)}
    if args.try_fusions:
        contenders["current+fused_gate"] = fused_gate
    times, outputs = time_contenders(args, model, d, sources, contenders)
    print_table(contenders, times, outputs, len(sources) * args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
