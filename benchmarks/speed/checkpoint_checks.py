"""What the safe loader's checks of a checkpoint's contents cost (docs/RELIABILITY.md, "Untrusted inputs"): for
each release checkpoint (or the files given), the best of --repeat times of

* ``torch.load`` with ``weights_only=True`` and the loader's allow-list;
* the check of the config strings fairseq would run (:func:`fairseq_ext.checkpoints.check_config`; with the two
  above, what the loader did before the checks of the next two lines);
* the zip records' CRC-32s (:func:`fairseq_ext.checkpoints.checks.verify_zip`, ``zipfile.ZipFile.testzip``);
* the finiteness of the weights (:func:`fairseq_ext.checkpoints.checks.non_finite_weight`);
* the whole safe load (:func:`fairseq_ext.checkpoints.load_checkpoint_file`: CRCs, unpickling, config strings,
  weights, meters),

with the CRC and finiteness checks over the plain ``torch.load`` and the whole load over it as ratios measured in
the same run. The file is read once first,
so the times are those of a file in the page cache (a first read from disk adds the disk's time to every column).

    python -m benchmarks.speed.checkpoint_checks [CHECKPOINT ...] [--repeat 7] [--threads 1]
"""

import argparse
import glob
import os
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.checkpoint_checks",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="*", help="default: releases/*/*.pt")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import fairseq_ext  # noqa: F401  (installs the safe loader)
    from fairseq_ext import checkpoints
    from fairseq_ext.checkpoints.checks import non_finite_weight, verify_zip

    paths = args.checkpoints or sorted(glob.glob(os.path.join(ROOT, "releases", "*", "*.pt")))
    print(f"{'checkpoint':44s} {'MB':>5s} {'torch.load':>10s} {'config':>7s} {'CRCs':>7s} {'finite':>7s} "
          f"{'safe load':>10s} {'new/load':>9s} {'safe/load':>9s}   (ms, best of {args.repeat})")
    for path in paths:
        with open(path, "rb") as f:
            f.read()  # into the page cache

        def plain():
            with torch.serialization.safe_globals(checkpoints.SAFE_GLOBALS):
                return torch.load(path, map_location="cpu", weights_only=True)

        state = plain()
        t_plain = best(plain, args.repeat)
        t_config = best(lambda: checkpoints.check_config(state, path), args.repeat)
        t_crc = best(lambda: verify_zip(path, path), args.repeat)
        t_finite = best(lambda: non_finite_weight(state), args.repeat)
        t_safe = best(lambda: checkpoints.load_checkpoint_file(path), args.repeat)
        name = os.path.relpath(path, ROOT) if path.startswith(ROOT) else path
        print(f"{name:44s} {os.path.getsize(path) / 1e6:5.1f} {t_plain * 1e3:10.1f} {t_config * 1e3:7.1f} "
              f"{t_crc * 1e3:7.1f} {t_finite * 1e3:7.1f} {t_safe * 1e3:10.1f} {(t_crc + t_finite) / t_plain:9.2f} "
              f"{t_safe / t_plain:9.2f}")


if __name__ == "__main__":
    main()
