"""The static decoder step against the lean step by rows a call, the measurement behind STATIC_MAX_ROWS.

    OMP_NUM_THREADS=1 python -m benchmarks.speed.static_rows [--batches 1 4 16 32 64] [--sentences 0]
                                                            [--workdir work/bench-decode]

The release transformer over the Acts test (the first --sentences verses, 0: all), batched as fairseq-generate
batches them (sorted by source length), greedy and beam 4; per batch size the searches' rows a call (sentences x
beam), ms per sentence of the static step (held on it at every size) and of the lean step, interleaved batch by
batch in a new random order, two passes; their ratio and the share of batches with identical hypotheses. The
default generator takes the lean step above ``fairseq_ext.sat.generator.STATIC_MAX_ROWS`` rows.
"""

import argparse
import os
import random

from .decode import acts_test_bin, batches, compiled_step, gen_args, load, run_setting
from .sat_contenders import ROOT, Contender
from .speculative import RELEASE


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.static_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(ROOT, "work", "bench-decode"))
    p.add_argument("--release", default=RELEASE, help="the release directory (transformer.pt, dict.txt)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64], help="batch sizes (sentences)")
    p.add_argument("--sentences", type=int, default=0, help="the first N test verses (default 0: all)")
    p.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch

    import fairseq_ext  # noqa: F401  (registers the default generator)
    from fairseq_ext.sat.generator import STATIC_MAX_ROWS, SATSequenceGenerator

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, task = load(os.path.join(args.release, "transformer.pt"), acts_test_bin(args.workdir))
    task.load_dataset("test")
    compiled_step("static step", model)
    rng = random.Random(args.seed)
    D = task.target_dictionary
    print(f"threads {torch.get_num_threads()}; the default takes the lean step above {STATIC_MAX_ROWS} rows a call")
    print("| search | batch | rows a call | static ms/sent | lean ms/sent | static / lean | identical batches |")
    print("|---|---|---|---|---|---|---|")
    def static_gen(beam):
        gen = task.build_generator([model], gen_args(beam))
        gen.model.static_max_rows = 10 ** 9  # on the static step at every size
        return gen

    cs = [Contender("static", 1, "ours", model=model, make_gen=static_gen),
          Contender("lean", 1, "ours", model=model, make_gen=lambda beam: SATSequenceGenerator(
              [model], D, beam_size=beam, max_len_b=200, static_step=False))]
    for beam in args.beams:
        for bsz in args.batches:
            samples = batches(task, args.sentences, bsz)
            secs, same = {c.name: 0.0 for c in cs}, 0
            for _ in range(args.passes):
                res = run_setting(cs, samples, beam, rng, block=1)  # a new random order for every batch
                for name, (dt, _) in res.items():
                    secs[name] += dt
                same += sum(all(res["static"][1][i] == res["lean"][1][i] for i in s["id"].tolist()) for s in samples)
            n = args.passes * sum(int(s["nsentences"]) for s in samples)
            print(f"| {'greedy' if beam == 1 else f'beam {beam}'} | {bsz} | {bsz * beam} | "
                  f"{1e3 * secs['static'] / n:.2f} | {1e3 * secs['lean'] / n:.2f} | "
                  f"{secs['static'] / secs['lean']:.2f} | {same}/{args.passes * len(samples)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
