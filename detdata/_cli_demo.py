"""``detdata demo`` and ``detdata replay-check``."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="build a small corpus, train a tiny GPT with interrupt/resume/reshard proof")
    p.add_argument("--out", default="demo_out", help="working directory (recreated)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stop-at", type=int, default=17)
    p.set_defaults(func=run_demo)
    r = sub.add_parser("replay-check", help="three fresh-process runs (A, B, interrupted+resumed C); "
                       "exit 1 if weights or data traces differ")
    r.add_argument("--out", default="demo_out", help="directory holding a demo corpus (built if missing)")
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--stop-at", type=int, default=17)
    r.set_defaults(func=run_replay_check)


def _print_check(check: dict[str, Any]) -> int:
    print(f"final weights blake3: A {check['weights']['A'][:16]}  B {check['weights']['B'][:16]}  "
          f"C (stopped at {check['stop_at']} on 2 ranks, resumed on 1) {check['weights']['C'][:16]}")
    for pair in ("A_B", "A_C"):
        diff = check[f"first_divergent_step_{pair}"]
        print(f"first divergent data step {pair.replace('_', ' vs ')}: "
              + ("none" if diff is None else f"step {diff['step']} ({diff['reason']})"))
    ok = check["weights_identical"] and check["first_divergent_step_A_B"] is None \
        and check["first_divergent_step_A_C"] is None
    print("replay check: " + ("PASS (bitwise identical)" if ok else "FAIL"))
    return 0 if ok else 1


def run_demo(args: argparse.Namespace) -> int:
    from detdata._demo import build_corpus, loader_throughput, replay_check
    t0 = time.perf_counter()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    ids = build_corpus(out)
    print("== detdata demo ==")
    for name, mid in ids.items():
        print(f"registered demo-{name}@v1 -> {mid}")
    check = replay_check(out, steps=args.steps, stop_at=args.stop_at)
    print(f"trained {check['steps']} steps on the mixture {json.dumps(_weights())}: "
          f"loss {check['first_loss']:.3f} -> {check['final_loss']:.3f}")
    code = _print_check(check)
    print(f"loader throughput (mixture of 3 sources, global batch 64, seq 64): "
          f"{loader_throughput(out):,.0f} samples/s")
    (out / "report.json").write_text(json.dumps({"manifests": ids, **check}, indent=1, default=str))
    print(f"report: {out / 'report.json'}  ({time.perf_counter() - t0:.0f} s)")
    return code


def _weights() -> dict[str, str]:
    from detdata._demo import WEIGHTS
    return dict(WEIGHTS)


def run_replay_check(args: argparse.Namespace) -> int:
    from detdata._demo import build_corpus, replay_check
    out = Path(args.out)
    if not (out / "registry").exists():
        build_corpus(out)
    return _print_check(replay_check(out, steps=args.steps, stop_at=args.stop_at))
