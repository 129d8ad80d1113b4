"""One rank of a 2-rank gloo ``loop.run`` whose peer dies or hangs (started by ``test_loop_dist_faults``).

Both ranks train the data-parallel MLP of ``_loop_worker`` (the loss all-gathers
every rank's batch, so each step is a collective). At step ``--at`` rank 1 prints
``FAULT <time>`` and then either exits at once (``--fault die``) or sleeps for
ten minutes (``--fault hang``). Rank 0 prints ``FAILED <time> <type>: <message>``
when ``run`` raises (``DONE`` if it finishes) and exits with status 3.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

sys.path.insert(0, str(Path(__file__).parent))
import _loop_worker as worker
from purestep import loop


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--fault", choices=["die", "hang"], required=True)
    ap.add_argument("--at", type=int, default=3)
    ap.add_argument("--collective-timeout", type=float, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = TCPStore(
        "127.0.0.1", args.port, 3, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    # the group's own timeout is long (as torch's default): only collective_timeout can end a hang
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=2, timeout=datetime.timedelta(seconds=600)
    )
    step, state = worker.build(20, gather=True)
    data = worker.ShuffledData(worker.make_batches()[args.rank :: 2], seed=args.rank)

    def eval_fn(s: object) -> dict[str, float]:
        if args.rank == 1 and int(s["step"]) == args.at:  # type: ignore[index]
            print(f"FAULT {time.time()}", flush=True)
            if args.fault == "die":
                os._exit(17)
            time.sleep(600)
        return {}

    try:
        loop.run(
            step,
            state,
            data,
            num_steps=20,
            checkpoint_dir=args.dir,
            save_every=2,
            eval_fn=eval_fn,
            eval_every=1,
            progress=False,
            collective_timeout=args.collective_timeout,
        )
    except Exception as e:
        msg = " ".join(str(e).split())
        print(f"FAILED {time.time()} {type(e).__name__}: {msg}", flush=True)
        os._exit(3)  # do not wait for the peer in process-group teardown
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
