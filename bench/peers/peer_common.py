# SPDX-License-Identifier: Apache-2.0
"""What the PyTorch peers in bench/peers/ share: logging to stderr and timing with CUDA events.

It imports torch: a peer that sets environment variables torch must see imports this module after
setting them.
"""
import statistics
import sys

import torch

WARMUPS = 2
REPS = 10


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def median_ms(fn):
    """Median milliseconds of fn() on the current stream, timed with CUDA events."""
    for _ in range(WARMUPS):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(REPS)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events)
