"""Console view of a fairseq-train run for examples/quickstart.sh (not an arch: the quickstart's helper).

    fairseq-train ... --log-format simple 2>&1 | python progress.py --log FILE --max-update N

Every line goes to ``--log``; the console gets the model size once, then a progress line (updated in place on
a terminal, a new line about every 10% otherwise) with the updates done, epoch, train loss, last valid loss and
elapsed time, and a summary at the end. Exits 1 when the input has no "done training" line (fairseq failed).
"""

import argparse
import re
import sys
import time

_INNER = re.compile(r"\| train_inner \| epoch (\d+):\s+(\d+) / (\d+) loss=([\d.]+),.*?num_updates=(\d+)")
_VALID = re.compile(r"\| valid \| epoch (\d+) \| valid on '\w+' subset \| loss ([\d.]+) \| nll_loss ([\d.]+)"
                    r" \| ppl ([\d.]+).*?\| num_updates (\d+)")
_PARAMS = re.compile(r"num\. (?:shared )?model params: ([\d,]+)")
_DONE = re.compile(r"done training in ([\d.]+) seconds")


def fmt_time(seconds):
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--log", required=True)
    p.add_argument("--max-update", type=int, required=True)
    p.add_argument("--indent", default="      ")
    args = p.parse_args(argv)
    tty = sys.stdout.isatty()
    start = time.time()
    state = dict(epoch=1, epochs=0.0, updates=0, loss=None, valid=None, params=None, done=None)
    next_report = args.max_update / 10
    shown = False

    def line():
        s = f"{args.indent}updates {state['updates']}/{args.max_update}  epoch {state['epoch']}"
        if state["loss"] is not None:
            s += f"  train loss {state['loss']:.2f}"
        if state["valid"] is not None:
            s += f"  valid loss {state['valid'][0]:.2f}"
        return s + f"  {fmt_time(time.time() - start)}"

    with open(args.log, "w", encoding="utf-8") as log:
        for raw in sys.stdin:
            log.write(raw)
            log.flush()
            m = _PARAMS.search(raw)
            if m and state["params"] is None:
                state["params"] = int(m.group(1).replace(",", ""))
                print(f"{args.indent}model: {state['params'] / 1e6:.2f}M parameters; full log: {args.log}", flush=True)
            m = _INNER.search(raw)
            if m:
                state.update(epoch=int(m.group(1)), loss=float(m.group(4)), updates=int(m.group(5)),
                             epochs=int(m.group(1)) - 1 + int(m.group(2)) / int(m.group(3)))
            m = _VALID.search(raw)
            if m:
                state.update(epoch=int(m.group(1)), updates=int(m.group(5)),
                             valid=(float(m.group(2)), float(m.group(3)), float(m.group(4))))
            m = _DONE.search(raw)
            if m:
                state["done"] = float(m.group(1))
            if not (m or _INNER.search(raw) or _VALID.search(raw)):
                continue
            if tty:
                print("\r" + line() + "   ", end="", flush=True)
                shown = True
            elif state["updates"] >= next_report or _VALID.search(raw):
                print(line(), flush=True)
                while next_report <= state["updates"]:
                    next_report += args.max_update / 10
    if shown:
        print()
    if state["done"] is None:
        print(f"{args.indent}fairseq-train failed; the end of {args.log}:", file=sys.stderr)
        with open(args.log, encoding="utf-8") as f:
            sys.stderr.writelines(f.readlines()[-25:])
        return 1
    summary = (f"{args.indent}trained {state['updates']} updates (~{state['epochs']:.1f} epochs) "
               f"in {fmt_time(state['done'])}")
    if state["valid"] is not None:
        loss, nll, ppl = state["valid"]
        summary += f"; valid loss {loss:.3f} (nll {nll:.3f}, perplexity {ppl:.2f})"
    if state["updates"] < args.max_update:
        summary += f"; stopped before --max-update {args.max_update} by the --minutes cap"
    print(summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
