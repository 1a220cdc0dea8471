"""Two gloo ranks meter a step whose collective's memory the worker thread frees late, on purpose
(NOTE [ frees on a collective's thread ], runtime/measure/released.py). Run by tests/test_meter.py:

    python tests/late_free_worker.py PORT OUT.json

The step all-reduces a fresh tensor x of N floats asynchronously, drops its work, waits on the
work's future and drops x, then makes y of 2N floats and sums it: the step's thread lets go of x
before y exists, so the step's peak is y and its sum, 8N + 4 bytes. A callback on the future sleeps
DELAY seconds on the worker thread, which runs it after the future's waiters are woken and before
it drops the work: x, which only the work then holds, is freed there, DELAY after y was made (rank 1
joins the collective DELAY late, so that rank 0's callback is added before the future is done).
Each rank meters the step REPS times with `peak_memory` and with `allocator_peak`; OUT.json maps
"ranks" to each rank's {"meter": [bytes per run], "allocator": [...]}, or "error" to a traceback.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remat import peak_memory                                   # noqa: E402
from remat.runtime.measure import allocator_peak                # noqa: E402
from meter_worker import write_result                           # noqa: E402  (this folder: sys.path[0])

N, DELAY, REPS = 250_000, 0.2, 2


def step(rank: int) -> None:
    if rank:
        time.sleep(DELAY)
    x = torch.ones(N)
    work = dist.all_reduce(x, async_op=True)
    fut = work.get_future()
    fut.then(lambda _: time.sleep(DELAY))          # on the worker, holding the work
    del work
    fut.wait()
    del fut, x
    torch.ones(2 * N).sum()


def metered(rank: int) -> dict:
    out = {"meter": [], "allocator": []}
    for _ in range(REPS):
        for name, meter in (("meter", peak_memory), ("allocator", allocator_peak)):
            out[name].append(meter(lambda: step(rank)))
            time.sleep(DELAY)                      # the worker is done with this step's work
            dist.barrier()
    return out


def rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    write_result(os.path.join(out_dir, f"late-{rank}.json"), lambda: metered(rank))
    dist.destroy_process_group()


def main(port: int, out: str) -> int:
    out_dir = os.path.dirname(os.path.abspath(out))
    status = 0
    try:
        mp.spawn(rank_main, args=(port, out_dir), nprocs=2)
    except Exception:
        traceback.print_exc()
        status = 1
    paths = [os.path.join(out_dir, f"late-{r}.json") for r in range(2)]
    ranks = [json.load(open(p)) for p in paths if os.path.exists(p)]
    errors = [r["error"] for r in ranks if "error" in r]
    with open(out, "w") as f:
        json.dump({"error": "\n".join(errors)} if errors else {"ranks": ranks}, f)
    return status


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
