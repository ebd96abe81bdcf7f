"""PyTorch's own backward pass of an nn.LSTM on a padded batch and on the same batch packed with per-example
lengths, side by side: the cost a lengths-aware gradient is compared with (issue 32; PyTorch's packed backward
is known to be slower than its padded one, pytorch/pytorch#149194).

Dev-only: it needs torch, which lstmgrad never does; the package and the tests never import it. Run it with
the throw-away PyTorch environment:

    /work/main/.venv-torch/bin/python benchmarks/torch_packed_backward.py [--T 200 --B 64 --I 256 --C 256]

For each round, (a) padded: out = lstm(x) over all T steps; (b) packed:
out = pad_packed_sequence(lstm(pack_padded_sequence(x, lengths, enforce_sorted=False)), total_length=T).
The forward runs outside the timing; what is timed is loss.backward() with loss = sum(out * G) for one fixed
random G [T,B,D*C] (x requires grad, so x's gradient is computed too, as lstmgrad computes it). The two
alternate, in the opposite order every other round. lengths are drawn uniformly in [T/2, T] (integers,
seeded). Prints one JSON line with the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=200, help="time steps (default 200)")
    p.add_argument("--B", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--I", type=int, default=256, help="input size (default 256)")
    p.add_argument("--C", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--layers", type=int, default=1, help="num_layers (default 1)")
    p.add_argument("--bidirectional", action="store_true", help="a bidirectional LSTM (default: one direction)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, each times both (default 7)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of x, G, the weights and the lengths (default 0)")
    args = p.parse_args()
    if min(args.T, args.B, args.I, args.C, args.layers, args.rounds, args.threads) < 1:
        p.error("every size, --rounds and --threads must be at least 1")
    return args


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    T, B, I, C = args.T, args.B, args.I, args.C
    D = 2 if args.bidirectional else 1
    lstm = nn.LSTM(I, C, num_layers=args.layers, bidirectional=args.bidirectional)
    x = torch.from_numpy(rng.normal(0.0, 1.0, (T, B, I)).astype(np.float32)).requires_grad_(True)
    G = torch.from_numpy(rng.normal(0.0, 1.0, (T, B, D * C)).astype(np.float32))
    lengths = torch.from_numpy(rng.integers(max(1, T // 2), T, size=B, endpoint=True))

    def padded():
        out, _ = lstm(x)
        return (out * G).sum()

    def packed():
        y, _ = lstm(pack_padded_sequence(x, lengths, enforce_sorted=False))
        out, _ = pad_packed_sequence(y, total_length=T)
        return (out * G).sum()

    def time_backward(forward):
        lstm.zero_grad(set_to_none=True)
        x.grad = None
        loss = forward()
        start = time.perf_counter()
        loss.backward()
        return time.perf_counter() - start

    contenders = {"padded": padded, "packed": packed}
    for forward in contenders.values():  # warm-up, untimed
        time_backward(forward)
    times = {name: [] for name in contenders}
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            times[name].append(time_backward(contenders[name]))

    padded_s, packed_s = statistics.median(times["padded"]), statistics.median(times["packed"])
    print(json.dumps({
        "padded_s": round(padded_s, 6),
        "packed_s": round(packed_s, 6),
        "ratio": round(packed_s / padded_s, 3),
        "shape": {"T": T, "B": B, "I": I, "C": C, "layers": args.layers, "bidirectional": args.bidirectional,
                  "dtype": "float32", "lengths": f"uniform integers in [{max(1, T // 2)}, {T}]",
                  "mean_length": round(float(lengths.double().mean()), 1)},
        "rounds": args.rounds,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
