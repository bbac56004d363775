"""Per-step model digests: the optional half of the ``replay-check`` protocol (README, "Your
own script"): `report_model_step` prints ``detdata-model step=<t> b3:<hex>`` per global step
and ``detdata replay-check`` names the first step where two runs' models differ.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Final, TextIO

import blake3

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError

#: A digest line as `report_model_step` prints it (``replay-check`` parses stdout with it).
LINE: Final = re.compile(r"^detdata-model step=(\d+) (b3:[0-9a-f]{64})\s*$")


def model_digest(model: Any) -> str:
    """``b3:<hex>`` of a module's ``state_dict()`` (or of a mapping name -> tensor)."""
    import torch

    state = model.state_dict() if hasattr(model, "state_dict") else model
    if not hasattr(state, "items"):
        raise ConfigError(
            f"model_digest takes a torch module or a mapping of name -> tensor, got "
            f"{type(model).__name__}"
        )
    hasher = blake3.blake3(b"detdata-model-v1\0")
    for name in sorted(state):
        value = state[name]
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"model_digest: entry {name!r} is a {type(value).__name__}, not a tensor"
            )
        t = value.detach().cpu().contiguous()
        head = f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode()
        hasher.update(len(head).to_bytes(8, "little") + head)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        hasher.update(len(raw).to_bytes(8, "little") + raw)
    return "b3:" + hasher.hexdigest()


def report_model_step(step: int, model: Any, *, file: TextIO | None = None) -> str:
    """Print ``detdata-model step=<step> b3:<hex>`` (one line, flushed) and return the digest;
    call it after ``optimizer.step()`` of global step ``step``."""
    step = check_count(step, "step", minimum=0)
    digest = model_digest(model)
    out = sys.stdout if file is None else file
    print(f"detdata-model step={step} {digest}", file=out, flush=True)
    return digest


def parse_model_steps(stdout: str) -> dict[int, str]:
    """step -> digest of every `report_model_step` line in ``stdout`` (a later line for a step
    replaces an earlier one: a resumed process repeats the steps after its checkpoint)."""
    matches = (LINE.match(line) for line in stdout.splitlines())
    return {int(m.group(1)): m.group(2) for m in matches if m}
