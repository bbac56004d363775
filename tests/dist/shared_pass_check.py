"""Child of tests/identity/test_shared_first_start.py, run under torchrun (gloo).

Every rank initialises the process group, then loads MANIFEST with the default (quick)
verification. Counted meanwhile, by wrapping the real functions (nothing is replaced):
each ``os.stat`` of a ``.npy`` file (the path) and each entry a fast form decodes
(``ShardTable.entries_between``). Written to ``OUT.rank<r>``: the paths stat'ed, the
entries decoded, and the `DetdataError` got (class, shard, message), if any. With a third
argument ``alone``, every rank reads the manifest itself (``LOCAL_WORLD_SIZE=1``, as with one
rank a node: no node copy of the fast form, whose file identity a receipt records).
"""

import json
import os
import sys
import time

import torch.distributed as dist

import detdata
from detdata.identity.columns import ShardTable

manifest, out = sys.argv[1], sys.argv[2]
if sys.argv[3:] == ["alone"]:
    os.environ["LOCAL_WORLD_SIZE"] = "1"
dist.init_process_group("gloo")
rank = dist.get_rank()
stated: list[str] = []
decoded = [0]
real_stat = os.stat
real_between = ShardTable.entries_between


def counted_stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
    if str(path).endswith(".npy"):
        stated.append(os.path.basename(str(path)))
    return real_stat(path, *args, **kwargs)


def counted_between(self, lo, hi):  # type: ignore[no-untyped-def]
    decoded[0] += hi - lo
    # a slice takes a while, as a real shard's check does: a rank the OS starts late from the
    # barrier below still finds slices left (the test's "nobody took all" is about sharing,
    # not about which rank the scheduler runs first)
    time.sleep(0.1)
    return real_between(self, lo, hi)


dist.barrier()
os.stat = counted_stat
ShardTable.entries_between = counted_between  # type: ignore[method-assign]
result: dict[str, object] = {"rank": rank}
try:
    detdata.Manifest.load(manifest)
except detdata.DetdataError as exc:
    result["error"] = [type(exc).__name__, getattr(exc, "shard", None), str(exc)]
os.stat = real_stat
ShardTable.entries_between = real_between  # type: ignore[method-assign]
result["stated"] = stated
result["decoded"] = decoded[0]
with open(f"{out}.rank{rank}", "w", encoding="utf-8") as fh:
    json.dump(result, fh)
dist.barrier()
dist.destroy_process_group()
