"""What an idle torch process group costs: the baseline of a rank that waits.

Run under torchrun: every rank joins a gloo process group, imports nothing of detdata and
sleeps ``SECONDS``; it prints the CPU seconds its threads spent meanwhile (from
``/proc/self/task/*/stat``), the main thread apart. `benchmarks/startup.py` reports a
waiting rank's ``open_pg_threads_cpu_s``: the same threads, while the rank waits for the
job's verifier. Measured 2026-12-04 (2 ranks, 120 s): 0.40-0.42 CPU-s of torch's threads,
0.000 s of the main thread.

    python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port 29577 benchmarks/idle_torch.py 120
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by thread id."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    dist.init_process_group("gloo")
    before, began = thread_cpu(), time.monotonic()
    time.sleep(seconds)
    after = thread_cpu()
    me = str(os.getpid())
    others = sum(cpu - before.get(tid, 0.0) for tid, cpu in after.items() if tid != me)
    print(
        f"rank {dist.get_rank()}: {time.monotonic() - began:.0f} s idle, torch threads "
        f"{others:.3f} CPU-s, main thread {after[me] - before[me]:.3f} CPU-s",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
