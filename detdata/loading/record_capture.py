"""Capturing the sections of a run record (`detdata.loading.record`) from this process: the
code (git), lock files, installed packages, library versions, GPUs, environment variables,
execution shape, determinism flags, platform, container, parallel layout and data."""

from __future__ import annotations

import importlib.metadata
import os
import platform as _platform
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from detdata.base.canonical import canonical_json
from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError
from detdata.base.hashing import digest_bytes
from detdata.base.redact import get_logger
from detdata.loading.history import is_count
from detdata.loading.record_format import (
    EXECUTION_KEYS,
    K_DIGEST,
    K_DIRTY,
    K_DIRTY_FILES,
    K_LIST,
    K_LOADER,
    K_LOADER_STATE,
    K_NOTE,
    K_REVISION,
    K_SEEDS,
    K_SOURCE,
    LAYOUT_KEYS,
    LOADER_FIELDS,
)
from detdata.loading.state import K_MANIFESTS, K_SEED, K_STREAM_SEED, LoaderState

#: The run record's logger (its capture and its checks log under one name).
logger: Final = get_logger("detdata.loading.record")

#: Lock files hashed by default when they exist at the repository root (glob patterns).
DEFAULT_LOCK_FILES: Final = ("requirements*.txt", "poetry.lock", "uv.lock", "pyproject.toml")
#: Environment variables that change numerics or reduction order (recorded, checked).
NUMERICS_ENV: Final = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "CUDA_LAUNCH_BLOCKING",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TORCH_CUDNN_V8_API_DISABLED",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_NVLS_ENABLE",
    "NCCL_COLLNET_ENABLE",
    "NCCL_CROSS_NIC",
    "PYTHONHASHSEED",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MKL_CBWR",
    "OPENBLAS_NUM_THREADS",
)
#: Environment variables the container image and its digest are read from (first set wins).
IMAGE_ENV: Final = ("DETDATA_IMAGE", "CONTAINER_IMAGE", "IMAGE")
IMAGE_DIGEST_ENV: Final = ("DETDATA_IMAGE_DIGEST", "CONTAINER_IMAGE_DIGEST", "IMAGE_DIGEST")

_NAME_RUN: Final = re.compile(r"[-_.]+")
#: A PEP 440 version, any spelling (the pattern of PEP 440's appendix B; ASCII only).
_VERSION: Final = re.compile(
    r"""
    ^\s*v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?P<pre>[-_.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?P<post>-(?P<post_n1>[0-9]+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?)?
    (?P<dev>[-_.]?dev[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$
    """,
    re.VERBOSE | re.IGNORECASE | re.ASCII,
)
_PRE_LETTERS: Final = {"alpha": "a", "beta": "b", "c": "rc", "pre": "rc", "preview": "rc"}


def _git(where: Path, *args: str) -> tuple[str | None, str]:
    """(stdout, or None when git failed; git's stderr or why it could not run)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(where), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"git could not run ({exc})"
    return (done.stdout if done.returncode == 0 else None), done.stderr.strip()


def code_section(where: Path) -> dict[str, Any]:
    """Revision, dirty flag and count, or Nones and a note saying why they are unknown (not a
    repository, no git, no commit, or git refusing the checkout in its own words)."""
    toplevel, err = _git(where, "rev-parse", "--show-toplevel")
    revision, status = None, None
    if toplevel is not None:
        revision, err = _git(where, "rev-parse", "--verify", "HEAD")
    if revision is not None:
        status, err = _git(where, "status", "--porcelain", "--untracked-files=no")
    if toplevel is None or revision is None or status is None:
        note = _unknown_code_note(where, toplevel, revision, err)
        logger.warning("run record: %s", note)
        return {K_REVISION: None, K_DIRTY: None, K_DIRTY_FILES: None, K_NOTE: note}
    count = len([line for line in status.splitlines() if line.strip()])
    return {
        K_REVISION: revision.strip(),
        K_DIRTY: count > 0,
        K_DIRTY_FILES: count,
        K_NOTE: None,
        "toplevel": toplevel.strip(),
    }


def _unknown_code_note(where: Path, toplevel: str | None, revision: str | None, err: str) -> str:
    said = " ".join(err.split())[:300]
    if "dubious ownership" in err or "safe.directory" in err:
        return (
            f"git refused the checkout {where} (dubious ownership: the repository belongs to "
            f"another user; git said: {said}): revision and dirty are unknown; hint: git config "
            f"--global --add safe.directory {where}"
        )
    if said.startswith("git could not run"):
        return f"{said}: revision and dirty of {where} are unknown"
    if toplevel is None and "not a git repository" in err:
        return f"{where} is not in a git repository: revision and dirty are unknown"
    if toplevel is not None and revision is None:
        return f"the git repository at {where} has no commit: revision and dirty are unknown"
    return f"git failed in {where} ({said or 'no message'}): revision and dirty are unknown"


def lock_hashes(
    where: Path, toplevel: str | None, given: Sequence[str | os.PathLike[str]] | None
) -> dict[str, str]:
    """blake3 of each lock file (``given``, else `DEFAULT_LOCK_FILES` found at the root)."""
    root = Path(toplevel) if toplevel else where
    if given is None:
        paths = sorted({p for pattern in DEFAULT_LOCK_FILES for p in root.glob(pattern)})
    else:
        paths = [Path(p) if Path(p).is_absolute() else root / p for p in given]
    out = {}
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"lock file {path} cannot be read ({exc.strerror or exc}); hint: pass existing "
                "files as lock_files="
            ) from None
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        out[name] = digest_bytes(data)
    return out


def normalise_version(version: str) -> str:
    """``version`` in PEP 440 normal form (``1.0RC1``, ``v1.0-rc.1`` -> ``1.0rc1``;
    ``1.0-1`` -> ``1.0.post1``; ``01.2`` -> ``1.2``; ``0!1.0`` -> ``1.0``; ``1.0+Ubuntu-01``
    -> ``1.0+ubuntu.1``), as ``str(packaging.version.Version(version))`` gives it. A version
    PEP 440 cannot parse (``2.0-custom``, a date, a commit) is returned unchanged: it still
    names what was installed, spelt as its metadata spells it."""
    m = _VERSION.match(version)
    if m is None:
        return version
    parts = [] if _number(m["epoch"]) == "0" else [f"{_number(m['epoch'])}!"]
    parts.append(".".join(map(_number, m["release"].split("."))))
    if m["pre"]:
        letter = m["pre_l"].lower()
        parts.append(_PRE_LETTERS.get(letter, letter) + _number(m["pre_n"]))
    if m["post"]:
        parts.append(".post" + _number(m["post_n1"] or m["post_n2"]))
    if m["dev"]:
        parts.append(".dev" + _number(m["dev_n"]))
    if m["local"]:
        local = _NAME_RUN.split(m["local"].lower())
        parts.append("+" + ".".join(_number(p) if p.isdigit() else p for p in local))
    return "".join(parts)


def _number(digits: str | None) -> str:
    """A PEP 440 number without its leading zeros (absent: ``0``); text, never `int` (no
    limit on its length)."""
    return (digits or "0").lstrip("0") or "0"


def package_list(pairs: Iterable[tuple[str, str]]) -> list[list[str]]:
    """``[[name, version], ...]`` of ``(name, version)`` pairs: names PEP 503 normalised, versions
    in PEP 440 normal form (`normalise_version`), sorted and de-duplicated: two spellings of
    one version record alike."""
    found = {
        (_NAME_RUN.sub("-", name).lower(), normalise_version(version)) for name, version in pairs
    }
    return [list(p) for p in sorted(found)]


def installed_packages() -> list[list[str]]:
    """`package_list` of every installed distribution (``importlib.metadata``)."""
    dists = [d for d in importlib.metadata.distributions() if d.metadata is not None]
    return package_list(
        (str(d.metadata["Name"]), str(d.version)) for d in dists if d.metadata["Name"]
    )


def packages_section(packages: list[list[str]]) -> dict[str, Any]:
    """The record's ``packages`` section of a `package_list`: the list and the blake3 of its
    canonical JSON (the checked field)."""
    return {K_DIGEST: digest_bytes(canonical_json(packages)), K_LIST: packages}


def _driver() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9][0-9.]*)", text)
    return match.group(1) if match else text.splitlines()[0].strip() or None


def library_versions() -> dict[str, str | None]:
    """Python, torch, CUDA, cuDNN, NCCL and driver versions (None where absent)."""
    import torch

    backend: Any = torch.backends.cudnn  # untyped in torch's stubs
    cudnn = backend.version() if backend.is_available() else None
    nccl: str | None = None
    if torch.cuda.is_available():
        try:
            nccl_mod: Any = torch.cuda.nccl
            raw = nccl_mod.version()
            nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        "python": sys.version.split()[0],
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "cudnn": None if cudnn is None else str(cudnn),
        "nccl": nccl,
        "driver": _driver(),
    }


def gpus() -> list[dict[str, str | None]]:
    """Name and UUID of every visible CUDA device (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        uuid = getattr(props, "uuid", None)
        out.append({"name": str(props.name), "uuid": None if uuid is None else str(uuid)})
    return out


def determinism_flags() -> dict[str, Any]:
    """torch's determinism and TF32 / reduced-precision switches of this process."""
    import torch

    cudnn: Any = torch.backends.cudnn
    matmul: Any = torch.backends.cuda.matmul
    return {
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": bool(torch.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "cuda_matmul_allow_tf32": bool(matmul.allow_tf32),
        "float32_matmul_precision": str(torch.get_float32_matmul_precision()),
        "fp16_reduced_precision_reduction": bool(matmul.allow_fp16_reduced_precision_reduction),
        "bf16_reduced_precision_reduction": bool(matmul.allow_bf16_reduced_precision_reduction),
    }


def platform_info() -> dict[str, str | None]:
    """Operating system, kernel release, machine and C library of this process."""
    libc, version = _platform.libc_ver()
    return {
        "os": _platform.system() or None,
        "kernel": _platform.release() or None,
        "machine": _platform.machine() or None,
        "libc": f"{libc} {version}".strip() or None,
    }


def container_section(image: str | None, digest: str | None) -> dict[str, str | None]:
    """The container image and its digest: given, else from `IMAGE_ENV` / `IMAGE_DIGEST_ENV`."""
    out: dict[str, str | None] = {}
    sources = []
    for key, given, names in (
        ("image", image, IMAGE_ENV),
        ("image_digest", digest, IMAGE_DIGEST_ENV),
    ):
        if given is not None:
            if not isinstance(given, str) or not given:
                raise ConfigError(f"{key}= must be a non-empty string, got {given!r:.80}")
            out[key] = given
            sources.append(f"{key}=")
            continue
        found = next((n for n in names if os.environ.get(n)), None)
        out[key] = None if found is None else os.environ[found]
        if found is not None:
            sources.append(found)
    out[K_SOURCE] = ", ".join(sources) or None
    return out


def layout_section(given: Mapping[str, int] | None) -> dict[str, int]:
    """``{"world", "dp", "tp", "pp"}``: given keys, world from torch.distributed (else 1),
    tp = pp = 1 and dp = world / (tp * pp) by default."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(LAYOUT_KEYS))
    if unknown:
        raise ConfigError(f"layout has unknown keys {unknown}; known keys are {list(LAYOUT_KEYS)}")
    vals = {k: check_positive_int(v, f"layout[{k!r}]") for k, v in given.items()}
    if "world" not in vals:
        vals["world"] = _world()
    vals.setdefault("tp", 1)
    vals.setdefault("pp", 1)
    vals.setdefault("dp", max(1, vals["world"] // (vals["tp"] * vals["pp"])))
    return {k: vals[k] for k in LAYOUT_KEYS}


def _world() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def data_section(
    loader: Any, manifests: Iterable[Any], seeds: Mapping[str, int | None] | None
) -> dict[str, Any]:
    """Manifest ids, named seeds, the loader's other checked fields and its state."""
    ids = {m if isinstance(m, str) else str(m.id) for m in manifests}
    named: dict[str, int | None] = {}
    loader_fields: dict[str, Any] = {}
    state = None
    if loader is not None:
        state = dict(loader) if isinstance(loader, Mapping) else loader.state_dict()
        parsed = LoaderState.from_json(state)
        ids.update(parsed.fields[K_MANIFESTS])
        named[K_SEED] = parsed.fields[K_SEED]
        named[K_STREAM_SEED] = parsed.fields[K_STREAM_SEED]
        loader_fields = {k: parsed.fields[k] for k in LOADER_FIELDS}
    for name, value in (seeds or {}).items():
        named[str(name)] = value
    return {
        K_MANIFESTS: sorted(ids),
        K_SEEDS: named,
        K_LOADER: loader_fields,
        K_LOADER_STATE: state,
    }


def env_names(extra: Iterable[str], what: str = "extra_env") -> list[str]:
    """``extra`` as a list of names (a single string is refused)."""
    if isinstance(extra, str):
        raise ConfigError(f"{what} takes a list of names, got the string {extra!r}")
    return [str(n) for n in extra]


def env_section(extra: Sequence[str], clear: Sequence[str]) -> dict[str, str | None]:
    """`NUMERICS_ENV` in clear text; ``extra`` names by the blake3 of their values, unless also
    in ``clear`` (None: unset)."""
    unknown = sorted(set(clear) - set(extra) - set(NUMERICS_ENV))
    if unknown:
        raise ConfigError(
            f"clear_env names {unknown}, which are not recorded; hint: name them in extra_env too"
        )
    out: dict[str, str | None] = {}
    for name in sorted({*NUMERICS_ENV, *extra}):
        value = os.environ.get(name)
        if value is not None and name not in NUMERICS_ENV and name not in clear:
            value = digest_bytes(value.encode("utf-8", "surrogatepass"))
        out[name] = value
    return out


def execution_section(
    state: Mapping[str, Any] | None, given: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The execution shape: from the loader state's layout and global batch, then ``given``."""
    out: dict[str, Any] = dict.fromkeys(EXECUTION_KEYS)
    if state is not None:
        layout = state.get("layout") or {}
        micro: Any = layout.get("micro_batch_size")
        world: Any = layout.get("world_size")
        out["micro_batch"] = micro
        out["workers"] = layout.get("num_workers")
        out["worker_mode"] = layout.get("worker_mode")
        gbs: Any = state.get("global_batch_size")
        if is_count(gbs, 1) and is_count(micro, 1) and is_count(world, 1):
            out["accumulation"] = gbs // (micro * world)
    unknown = sorted(set(given or {}) - set(EXECUTION_KEYS))
    if unknown:
        raise ConfigError(
            f"execution= has unknown keys {unknown}; known keys are {list(EXECUTION_KEYS)}"
        )
    out.update(dict(given or {}))
    return out
