"""fconv_glu_iwslt_de_en against fairseq's fconv_iwslt_de_en on the bundled German-English corpus, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.speed.fconv_glu [--rounds 3] [--train-batches 8]
        [--decode-sentences 128 (0: the whole test set)] [--seed 1] [--beam 5] [--workdir /tmp/bench_fconv_glu]

Both models are built once with the same weights (fairseq's copied into ours), so they compute the same
function; the contenders alternate within each round (order flipped every round) and the script prints
per-round ratios and their median, so a loaded machine slows both alike:

* train tokens/s: forward + backward + an SGD step with Nesterov momentum 0.99 (lr 0.25, clip 0.1, as fairseq's
  IWSLT recipe; fairseq's NAG differs only by its lr correction, the same work per step) on the same
  max-tokens-4000 batches, dropout 0.2, label-smoothed cross-entropy 0.1;
* decode sentences/s: fairseq's SequenceGenerator (what fairseq-generate runs), beam 5, after
  ``prepare_for_inference_`` (BeamableMM for both), on the same test sentences: a random sample of
  --decode-sentences of the 1,000 (seed --seed), or all of them with 0, batched by length as fairseq-generate
  does (fairseq's test iterator is length-sorted, so its first batches would be the shortest sentences only,
  where per-step fixed costs dominate); the output states the sample and its lengths; hypotheses are checked
  equal;
* peak memory: bytes of the tensors autograd saves for the backward pass of one training step (activation
  memory; deterministic on CPU, where no allocator statistics exist), plus ``torch.cuda.max_memory_allocated``
  when run on a GPU.

Data: ``python tools/prepare_bundled_corpus.py`` (joint 8k BPE) and fairseq-preprocess, cached in
--workdir.
"""

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")  # fairseq's fconv raises FutureWarnings on current torch
logging.disable(logging.INFO)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prepare(workdir):
    data, bin_dir = os.path.join(workdir, "data"), os.path.join(workdir, "bin")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prepare_bundled_corpus.py"), "--out", data,
                    "--vocab-size", "8000"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    if not os.path.isfile(os.path.join(bin_dir, ".done")):
        subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en",
                        "--trainpref", f"{data}/train.spm", "--validpref", f"{data}/valid.spm",
                        "--testpref", f"{data}/test.spm", "--destdir", bin_dir, "--joined-dictionary",
                        "--workers", "1"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open(os.path.join(bin_dir, ".done"), "w").close()
    return bin_dir


def build(bin_dir, device):
    import fairseq_ext  # noqa: F401
    from fairseq.models.fconv import FConvModel
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    from fairseq_ext.convs2s.model import FConvGluModel

    task = TranslationTask.setup_task(TranslationConfig(
        data=bin_dir, source_lang="de", target_lang="en", train_subset="train", dataset_impl=None,
        required_seq_len_multiple=1))
    task.load_dataset("train")
    task.load_dataset("test")

    def args(arch):
        from fairseq.models import ARCH_CONFIG_REGISTRY

        a = argparse.Namespace(dropout=0.2, max_source_positions=1024, max_target_positions=1024)
        ARCH_CONFIG_REGISTRY[arch](a)
        return a

    torch.manual_seed(1)
    ref = FConvModel.build_model(args("fconv_iwslt_de_en"), task)
    ours = FConvGluModel.build_model(args("fconv_glu_iwslt_de_en"), task)
    ours.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()})  # fconv -> fconv_glu mapping
    return task, {"fairseq fconv": ref.to(device), "fconv_glu": ours.to(device)}


def batches(task, split, device, max_tokens=None, max_sentences=None, n=None):
    from fairseq import utils

    itr = task.get_batch_iterator(task.dataset(split), max_tokens=max_tokens, max_sentences=max_sentences,
                                  seed=1, ignore_invalid_inputs=True).next_epoch_itr(shuffle=split == "train")
    out = []
    for sample in itr:
        out.append(utils.move_to_cuda(sample, device) if device.type == "cuda" else sample)
        if n is not None and len(out) >= n:
            break
    return out


def decode_samples(task, device, n, batch_size, seed):
    """A random sample of n test sentences (all with n <= 0), in length-sorted batches as fairseq-generate forms
    them. Returns (batches, description)."""
    import numpy as np
    from fairseq import utils

    ds = task.dataset("test")
    total = len(ds)
    if 0 < n < total:
        idx = np.random.RandomState(seed).choice(total, n, replace=False)
        what = f"a random sample of {n} of the {total} test sentences (seed {seed})"
    else:
        idx = np.arange(total)
        what = f"all {total} test sentences"
    idx = idx[np.lexsort((ds.tgt_sizes[idx], ds.src_sizes[idx]))]  # by source, then target length
    lengths = ds.src_sizes[idx]
    what += (f"; source lengths mean {lengths.mean():.1f} (test set {ds.src_sizes.mean():.1f}), "
             f"{lengths.min()}-{lengths.max()} BPE tokens")
    out = []
    for i in range(0, len(idx), batch_size):
        sample = ds.collater([ds[int(j)] for j in idx[i:i + batch_size]])
        out.append(utils.move_to_cuda(sample, device) if device.type == "cuda" else sample)
    return out, what


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_round(model, criterion, optimizer, samples, device):
    model.train()
    tokens = 0
    sync(device)
    t0 = time.perf_counter()
    for sample in samples:
        optimizer.zero_grad(set_to_none=True)
        loss, _, log = criterion(model, sample)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        tokens += log["ntokens"]
    sync(device)
    return tokens / (time.perf_counter() - t0)


def decode_round(generator, model, samples, device):
    model.eval()
    n, hyps = 0, []
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for sample in samples:
            out = generator.generate([model], sample)
            n += len(out)
            hyps.extend(h[0]["tokens"].tolist() for h in out)
    sync(device)
    return n / (time.perf_counter() - t0), hyps


def saved_activation_bytes(model, criterion, sample):
    """Bytes of distinct storages autograd saves during one training forward (activation memory)."""
    seen, total = set(), [0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        key = s.data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            total[0] += s.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _, _ = criterion(model, sample)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total[0]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed.fconv_glu", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/bench_fconv_glu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-batches", type=int, default=8)
    p.add_argument("--decode-sentences", type=int, default=128, help="random test sentences (0: all 1,000)")
    p.add_argument("--seed", type=int, default=1, help="of the random test sample")
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def memory(models, criterion, sample, device):
    """Activation bytes saved for backward of one training step per model (fresh models), and the CUDA peak."""
    mem = {k: saved_activation_bytes(m, criterion, sample) for k, m in models.items()}
    cuda_mem = {}
    if device.type == "cuda":
        for k, m in models.items():
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss, _, _ = criterion(m, sample)
            loss.backward()
            m.zero_grad(set_to_none=True)
            cuda_mem[k] = torch.cuda.max_memory_allocated() - base
    return mem, cuda_mem


def train_rounds(a, models, criterion, samples, device):
    """Training tokens per second of each model per round, the models' order alternating by round."""
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.25, momentum=0.99, nesterov=True)
                  for k, m in models.items()}
    train_tps = {k: [] for k in models}
    names = list(models)
    for k in names:  # warm-up, not timed
        train_round(models[k], criterion, optimizers[k], samples[:1], device)
    for r in range(a.rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            train_tps[k].append(train_round(models[k], criterion, optimizers[k], samples, device))
    return train_tps


def decode_rounds(a, models, task, samples, device):
    """Decoding sentences per second of each model per round (the same weights), and the last round's hypotheses."""
    from fairseq.sequence_generator import SequenceGenerator

    # decode with the same (trained a little, identical-start) weights: copy fairseq's into ours again
    models["fconv_glu"].load_state_dict({k: v.clone() for k, v in models["fairseq fconv"].state_dict().items()})
    gens = {}
    for k, m in models.items():
        cfg = argparse.Namespace(generation=argparse.Namespace(beam=a.beam, print_alignment=False))
        m.prepare_for_inference_(cfg)
        gens[k] = SequenceGenerator([m], task.target_dictionary, beam_size=a.beam, max_len_a=1.2, max_len_b=10)
    names = list(models)
    dec_sps = {k: [] for k in models}
    hyps = {}
    for k in names:  # warm-up, not timed
        decode_round(gens[k], models[k], samples[:1], device)
    for r in range(a.rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            sps, hyps[k] = decode_round(gens[k], models[k], samples, device)
            dec_sps[k].append(sps)
    return dec_sps, hyps


def print_report(a, names, train_tps, dec_sps, mem, cuda_mem, hyps):
    ref, ours = names
    print("\nround  train tok/s (fairseq | ours | ratio)     decode sent/s (fairseq | ours | ratio)")
    t_ratios = [o / f for f, o in zip(train_tps[ref], train_tps[ours])]
    d_ratios = [o / f for f, o in zip(dec_sps[ref], dec_sps[ours])]
    for r in range(a.rounds):
        print(f"{r + 1:5d}  {train_tps[ref][r]:9.0f} | {train_tps[ours][r]:9.0f} | {t_ratios[r]:5.2f}x"
              f"        {dec_sps[ref][r]:7.1f} | {dec_sps[ours][r]:7.1f} | {d_ratios[r]:5.2f}x")
    print(f"\nmedian ratio ours/fairseq: train tokens/s {statistics.median(t_ratios):.2f}x, "
          f"decode sentences/s {statistics.median(d_ratios):.2f}x")
    print(f"activation memory of one training step: fairseq {mem[ref] / 2**20:.1f} MiB, "
          f"ours {mem[ours] / 2**20:.1f} MiB, ratio ours/fairseq {mem[ours] / mem[ref]:.2f}x")
    if cuda_mem:
        print(f"CUDA peak memory of one training step: fairseq {cuda_mem[ref] / 2**20:.1f} MiB, "
              f"ours {cuda_mem[ours] / 2**20:.1f} MiB, ratio {cuda_mem[ours] / cuda_mem[ref]:.2f}x")
    same = sum(h1 == h2 for h1, h2 in zip(hyps[ref], hyps[ours]))
    print(f"identical beam hypotheses: {same}/{len(hyps[ref])}")
    print("(timings on a shared machine are noisy: compare the ratios, measured interleaved in this run)")


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    bin_dir = prepare(a.workdir)
    task, models = build(bin_dir, device)

    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    criterion = LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)
    train_samples = batches(task, "train", device, max_tokens=4000, n=a.train_batches)
    test_samples, test_what = decode_samples(task, device, a.decode_sentences, a.decode_batch, a.seed)
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    print(f"device {device}, torch threads {torch.get_num_threads()}, parameters: "
          + ", ".join(f"{k} {v:,}" for k, v in n_params.items()))
    print(f"train: {len(train_samples)} batches of max-tokens 4000 per round; decode: beam {a.beam}, per round, "
          f"{test_what}")
    mem, cuda_mem = memory(models, criterion, train_samples[0], device)  # memory first (fresh models), then speed
    train_tps = train_rounds(a, models, criterion, train_samples, device)
    dec_sps, hyps = decode_rounds(a, models, task, test_samples, device)
    print_report(a, list(models), train_tps, dec_sps, mem, cuda_mem, hyps)


if __name__ == "__main__":
    main()
