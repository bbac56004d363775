"""Child of tests/identity/test_verify_once.py, run under torchrun (gloo).

Every rank (or only rank WHO) initialises the process group, imports what it needs (a
warm-up open without verification), then opens ``TokenWindows(MANIFEST)`` with the
default (quick) verification, and writes to ``OUT.rank<r>`` the bytes it read meanwhile
(``rchar`` of /proc/self/io, counted by the kernel), the seconds the open took, the first
window's bytes, and the `VerificationError` it got (shard, field, message), if any.
MANIFEST may be a comma-separated list: rank r opens its r-th item (per-rank copies of a
corpus under different roots).
"""

import json
import sys
import time

import torch.distributed as dist

import detdata


def rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


manifests, out, who = sys.argv[1], sys.argv[2], sys.argv[3]  # who opens: "all" or a rank
dist.init_process_group("gloo")
rank = dist.get_rank()
mine = manifests.split(",")
manifest = mine[rank] if len(mine) > 1 else mine[0]
# imports first (a module's files are read bytes too): what is counted below is the open
detdata.TokenWindows(
    detdata.Manifest.load(manifest, verify="off"), 64, storage=detdata.Storage(verify="off")
).read([0])
import detdata.identity.receipts  # noqa: E402
import detdata.identity.verify  # noqa: E402

dist.barrier()  # every rank opens at about the same time
before = rchar()
result: dict[str, object] = {"rank": rank}
if who in ("all", str(rank)):
    start = time.monotonic()
    try:
        ds = detdata.TokenWindows(manifest, 64)
        result["first"] = ds.read([0])["tokens"].tobytes().hex()
    except detdata.VerificationError as exc:
        result["error"] = [exc.shard, exc.field]
        result["message"] = str(exc)
    result["open_s"] = time.monotonic() - start
result["read"] = rchar() - before
with open(f"{out}.rank{rank}", "w", encoding="utf-8") as fh:
    json.dump(result, fh)
dist.barrier()
dist.destroy_process_group()
