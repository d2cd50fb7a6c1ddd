"""Host time of cutting a packed batch into micro-batches (``TokenBatch.select``, what the training
backend does before every micro-batch): 64 sequences of 128-512 tokens, 4 micro-batches.

    python bench/select_overhead.py 1      # torch intra-op threads
"""

import random
import sys
import time

import torch

sys.path.insert(0, ".")
from areno.types import TokenBatch, Trajectory

torch.set_num_threads(int(sys.argv[1]))
rng = random.Random(0)
trajs = []
for i in range(64):
    n = rng.randint(64, 448)
    trajs.append(
        Trajectory(prompt_ids=[1] * 64, completion_ids=[2] * n, logprobs=[0.0] * n, versions=[0] * n, reward=1.0)
    )
b = TokenBatch.from_trajectories(trajs)
b.extra["prox_logprobs_T"] = torch.zeros(b.num_tokens)
b.extra["policy_version_B"] = torch.zeros(b.num_seqs, dtype=torch.long)
groups = [list(range(i, 64, 4)) for i in range(4)]
for _ in range(20):
    [b.select(g) for g in groups]
t = time.perf_counter()
for _ in range(200):
    [b.select(g) for g in groups]
print(f"threads={sys.argv[1]} tokens={b.num_tokens} select x4: {(time.perf_counter() - t) / 200 * 1e3:.3f} ms")
