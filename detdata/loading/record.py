"""The run record: everything outside the data cursor that a resume must match (issue 15).

`RunRecord.capture` is taken at step 0 and saved with every checkpoint; before a resume the
record captured then is checked against the saved one with `RunRecord.verify`, which refuses
every difference not allowed by name. The record is plain JSON (``format_version``
`RECORD_VERSION`): JSON-plain types, keys named by the ``K_*`` constants below.

What it holds (the checked field names, as ``allow=`` takes them, in brackets):

* code: the git revision [``revision``] and whether the tree is dirty [``dirty``] (tracked
  files modified or staged: ``git status --porcelain --untracked-files=no``, as
  ``git describe --dirty`` counts; untracked files are not counted), or None with a note
  outside a git repository (or without git);
* blake3 of lock files [``lock_files``]: given paths, or by default `DEFAULT_LOCK_FILES` that
  exist at the repository root;
* installed packages [``packages``]: every ``importlib.metadata`` distribution as
  ``[normalised name (PEP 503), version]``, sorted and de-duplicated, and the blake3 of its
  canonical JSON;
* versions [``python``, ``torch``, ``cuda``, ``cudnn``, ``nccl``, ``driver``]: None where the
  build or machine has none (a CPU build of torch has no CUDA, cuDNN or NCCL);
* GPUs: names [``gpus``] and UUIDs [``gpu_uuids``] (torch device properties; the UUIDs
  change whenever the job lands on other cards, so a resume on other nodes allows
  ``gpu_uuids``);
* numerics-changing environment variables [``env.NAME``, or ``env`` for all]:
  `NUMERICS_ENV` in clear text, plus ``extra_env``, whose values are stored as their blake3
  (``b3:...``: a token named there never lands in the record) unless named in ``clear_env``;
  an unset variable is recorded as None;
* the execution shape [``execution.NAME``, or ``execution``]: ``micro_batch``,
  ``accumulation`` (global batch / (micro batch x world size)), ``workers``, ``worker_mode``
  (from the loader state's layout) and ``precision`` (given: e.g. ``"bf16-mixed"``), each
  overridable through ``execution=``;
* determinism flags [``determinism.NAME``, or ``determinism``]: torch's deterministic
  algorithms (and warn-only), cuDNN deterministic and benchmark, TF32 for matmul and cuDNN,
  the float32 matmul precision, reduced-precision fp16/bf16 reductions;
* the platform [``platform.NAME``, or ``platform``]: ``os``, ``kernel`` (release),
  ``machine`` and ``libc``;
* the container [``container.image``, ``container.image_digest``, or ``container``]: given,
  else from the environment the job sets (`IMAGE_ENV`, `IMAGE_DIGEST_ENV`, first set wins:
  ``DETDATA_IMAGE`` / ``DETDATA_IMAGE_DIGEST``, ``CONTAINER_IMAGE`` /
  ``CONTAINER_IMAGE_DIGEST``, ``IMAGE`` / ``IMAGE_DIGEST``; put the digest there in the job
  template: Kubernetes ``env:``, Slurm ``--export``, a Dockerfile ``ENV``), with ``source``
  naming where it came from;
* the parallel layout [``layout``]: ``world``, ``dp``, ``tp``, ``pp`` (given; by default
  from torch.distributed when initialised, else 1);
* the blake3 of the canonical JSON of the user's config [``config``];
* data: manifest ids [``manifests``], seeds [``seeds``] and the loader's other checked fields
  [``loader.data``, ``loader.algorithm``, ... or ``loader`` for all] from the loader state,
  which is stored too (``data.loader_state``; its position is the loader's own business:
  ``DataLoader.load_state_dict`` checks it, the record does not compare it).

Format 2 added execution, determinism, platform and container; a format-1 record is read with
those sections empty (each field then differs as absent: allow the groups by name).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform as _platform
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final

from detdata.base.canonical import canonical_json
from detdata.base.checks import check_positive_int
from detdata.base.errors import ConfigError, DetdataError, StateError
from detdata.base.hashing import digest_bytes
from detdata.base.redact import get_logger, redact_value
from detdata.loading.state import CHECKED_FIELDS, K_MANIFESTS, K_SEED, K_STREAM_SEED, LoaderState

logger = get_logger(__name__)

RECORD_VERSION: Final = 2
READABLE_VERSIONS: Final = (1, 2)
KIND: Final = "detdata.run_record"

K_KIND: Final = "kind"
K_VERSION: Final = "format_version"
K_CODE: Final = "code"
K_REVISION: Final = "revision"
K_DIRTY: Final = "dirty"
K_DIRTY_FILES: Final = "dirty_files"
K_NOTE: Final = "note"
K_LOCKS: Final = "lock_files"
K_PACKAGES: Final = "packages"
K_DIGEST: Final = "digest"
K_LIST: Final = "list"
K_VERSIONS: Final = "versions"
K_GPUS: Final = "gpus"
K_GPU_UUIDS: Final = "gpu_uuids"
K_ENV: Final = "env"
K_LAYOUT: Final = "layout"
K_CONFIG: Final = "config"
K_DATA: Final = "data"
K_SEEDS: Final = "seeds"
K_LOADER: Final = "loader"
K_LOADER_STATE: Final = "loader_state"
K_EXECUTION: Final = "execution"
K_DETERMINISM: Final = "determinism"
K_PLATFORM: Final = "platform"
K_CONTAINER: Final = "container"
#: Sections added in format 2 (empty when a format-1 record is read).
_V2: Final = (K_EXECUTION, K_DETERMINISM, K_PLATFORM, K_CONTAINER)
_TOP: Final = (
    K_KIND,
    K_VERSION,
    K_CODE,
    K_LOCKS,
    K_PACKAGES,
    K_VERSIONS,
    K_GPUS,
    K_ENV,
    K_LAYOUT,
    K_CONFIG,
    K_DATA,
    *_V2,
)

VERSION_FIELDS: Final = ("python", "torch", "cuda", "cudnn", "nccl", "driver")
LAYOUT_KEYS: Final = ("world", "dp", "tp", "pp")
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
EXECUTION_KEYS: Final = ("micro_batch", "accumulation", "workers", "worker_mode", "precision")
PLATFORM_KEYS: Final = ("os", "kernel", "machine", "libc")
CONTAINER_KEYS: Final = ("image", "image_digest")
#: Environment variables the container image and its digest are read from (first set wins).
IMAGE_ENV: Final = ("DETDATA_IMAGE", "CONTAINER_IMAGE", "IMAGE")
IMAGE_DIGEST_ENV: Final = ("DETDATA_IMAGE_DIGEST", "CONTAINER_IMAGE_DIGEST", "IMAGE_DIGEST")
#: Field groups: ``allow=("env",)`` allows every ``env.NAME``, ``("loader",)`` every ``loader.*``,
#: and so on for each sectioned field.
GROUPS: Final = (K_ENV, K_LOADER, K_EXECUTION, K_DETERMINISM, K_PLATFORM, K_CONTAINER)
_LOADER_FIELDS: Final = tuple(
    f for f in CHECKED_FIELDS if f not in (K_MANIFESTS, K_SEED, K_STREAM_SEED)
)
FIELDS: Final = (
    K_REVISION,
    K_DIRTY,
    K_LOCKS,
    K_PACKAGES,
    *VERSION_FIELDS,
    K_GPUS,
    K_GPU_UUIDS,
    K_LAYOUT,
    K_CONFIG,
    K_MANIFESTS,
    K_SEEDS,
    *(f"{K_LOADER}.{f}" for f in _LOADER_FIELDS),
    *(f"{K_EXECUTION}.{k}" for k in EXECUTION_KEYS),
    *(f"{K_PLATFORM}.{k}" for k in PLATFORM_KEYS),
    *(f"{K_CONTAINER}.{k}" for k in CONTAINER_KEYS),
)
"""Every checked field name except ``env.NAME`` and ``determinism.NAME`` (one per recorded
variable or flag)."""

_NAME_RUN: Final = re.compile(r"[-_.]+")


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One run's record; build it with `capture` (or `from_json` / `load`), never by hand."""

    #: the numerics-changing environment variables recorded in clear text
    NUMERICS_ENV: ClassVar[tuple[str, ...]] = NUMERICS_ENV

    doc: Mapping[str, Any] = field(repr=False)

    # -- capture --------------------------------------------------------------------------
    @classmethod
    def capture(
        cls,
        *,
        repo: str | os.PathLike[str] | None = None,
        allow_dirty: bool = False,
        lock_files: Sequence[str | os.PathLike[str]] | None = None,
        layout: Mapping[str, int] | None = None,
        config: Mapping[str, Any] | None = None,
        loader: Any = None,
        manifests: Iterable[Any] = (),
        seeds: Mapping[str, int | None] | None = None,
        extra_env: Iterable[str] = (),
        clear_env: Iterable[str] = (),
        execution: Mapping[str, Any] | None = None,
        image: str | None = None,
        image_digest: str | None = None,
    ) -> RunRecord:
        """Capture the record of this process (call it at step 0 and save it with checkpoints).

        ``repo``: the code's directory (default: the current directory). A dirty tree raises
        `ConfigError` naming how many files are modified unless ``allow_dirty``. ``lock_files``:
        paths to hash (relative ones under the repository root); default `DEFAULT_LOCK_FILES`
        found there. ``layout``: ``{"world", "dp", "tp", "pp"}`` (missing keys: world from
        torch.distributed when initialised, else 1; dp = world / (tp * pp); tp, pp = 1).
        ``config``: any JSON-plain mapping; its canonical JSON is hashed. ``loader``: a
        `DataLoader` (its ``state_dict()``) or a saved loader state mapping; ``manifests``:
        more `Manifest` objects or ``b3:`` ids; ``seeds``: more named seeds. ``extra_env``:
        more variables, recorded by the blake3 of their values unless also in ``clear_env``.
        ``execution``: keys of `EXECUTION_KEYS` (override what the loader state gives).
        ``image`` / ``image_digest``: the container (default: `IMAGE_ENV` / `IMAGE_DIGEST_ENV`).

        When git cannot say whether the tree is dirty (not a repository, git missing, or git
        refusing the checkout: "dubious ownership"), capture refuses unless ``allow_dirty``;
        the record's ``code.note`` says why (git's own words).
        """
        where = Path(repo if repo is not None else os.getcwd())
        code = _code(where)
        if code[K_DIRTY] is None and not allow_dirty:
            raise ConfigError(
                f"refusing to start: cannot tell whether the code is dirty: {code[K_NOTE]}; the "
                "run record could not name the code that ran; hint: fix the above, or pass "
                "RunRecord.capture(..., allow_dirty=True) (recorded as unknown)"
            )
        if code[K_DIRTY] and not allow_dirty:
            raise ConfigError(
                f"refusing to start from a dirty tree: {code[K_DIRTY_FILES]} tracked file(s) "
                f"modified in {where} (revision {code[K_REVISION]}); the run record could not "
                "name the code that ran; hint: commit the changes, or pass "
                "RunRecord.capture(..., allow_dirty=True) (recorded as dirty)"
            )
        packages = installed_packages()
        doc: dict[str, Any] = {
            K_KIND: KIND,
            K_VERSION: RECORD_VERSION,
            K_CODE: code,
            K_LOCKS: _lock_hashes(where, code.get("toplevel"), lock_files),
            K_PACKAGES: {K_DIGEST: digest_bytes(canonical_json(packages)), K_LIST: packages},
            K_VERSIONS: library_versions(),
            K_GPUS: [],
            K_ENV: _env(_names(extra_env), _names(clear_env, "clear_env")),
            K_LAYOUT: _layout(layout),
            K_CONFIG: None if config is None else digest_bytes(canonical_json(dict(config))),
            K_DATA: _data(loader, manifests, seeds),
            K_DETERMINISM: determinism_flags(),
            K_PLATFORM: platform_info(),
            K_CONTAINER: _container(image, image_digest),
        }
        doc[K_EXECUTION] = _execution(doc[K_DATA][K_LOADER_STATE], execution)
        code.pop("toplevel", None)
        doc[K_GPUS] = gpus()
        return cls(doc=redact_value(_plain(doc)))  # the redaction boundary: no secret kept

    # -- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-plain dict (a deep copy)."""
        copy: dict[str, Any] = json.loads(json.dumps(self.doc))
        return copy

    @classmethod
    def from_json(cls, doc: object, *, where: str = "run record") -> RunRecord:
        """Parse a record (a dict or its JSON text); `StateError` if it is not one."""
        if isinstance(doc, (str, bytes)):
            try:
                doc = json.loads(doc)
            except (ValueError, RecursionError) as exc:
                raise StateError(f"{where} is not valid JSON: {exc}") from None
        if not isinstance(doc, Mapping) or doc.get(K_KIND) != KIND:
            found = doc.get(K_KIND) if isinstance(doc, Mapping) else type(doc).__name__
            raise StateError(
                f"{where}: not a run record (kind {found!r}, expected {KIND!r}); hint: pass "
                "what RunRecord.to_json() or RunRecord.save wrote"
            )
        version = doc.get(K_VERSION)
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise StateError(
                f"{where}: unknown format_version {doc.get(K_VERSION)!r}; this detdata reads "
                f"versions {list(READABLE_VERSIONS)}; hint: upgrade detdata"
            )
        doc = dict(doc)
        if version == 1:
            doc.update({k: {} for k in _V2 if k not in doc})
        missing = [k for k in _TOP if k not in doc]
        if missing:
            raise StateError(f"{where}: missing fields {missing}")
        try:
            record = cls(doc=_plain(doc))
        except ConfigError as exc:
            raise StateError(f"{where}: {exc}") from None
        _check_shape(record.doc, where)
        return record

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the record as JSON, atomically (readers see the old file or the whole new one)."""
        from detdata.storage.atomic import atomic_write_bytes

        text = json.dumps(self.doc, sort_keys=True, indent=1, ensure_ascii=False) + "\n"
        atomic_write_bytes(os.fspath(path), text.encode("utf-8"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunRecord:
        """Read a record `save` wrote."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"), where=f"run record {path}")

    # -- checks ---------------------------------------------------------------------------
    def fields(self) -> dict[str, Any]:
        """The checked fields, flat: name -> value (what `verify` compares)."""
        d = self.doc
        out: dict[str, Any] = {
            K_REVISION: d[K_CODE].get(K_REVISION),
            K_DIRTY: d[K_CODE].get(K_DIRTY),
            K_LOCKS: d[K_LOCKS],
            K_PACKAGES: d[K_PACKAGES][K_DIGEST],
        }
        out.update({k: d[K_VERSIONS].get(k) for k in VERSION_FIELDS})
        out[K_GPUS] = [g.get("name") for g in d[K_GPUS]]
        out[K_GPU_UUIDS] = [g.get("uuid") for g in d[K_GPUS]]
        out[K_LAYOUT] = d[K_LAYOUT]
        out[K_CONFIG] = d[K_CONFIG]
        out[K_MANIFESTS] = d[K_DATA][K_MANIFESTS]
        out[K_SEEDS] = d[K_DATA][K_SEEDS]
        out.update({f"{K_LOADER}.{k}": v for k, v in d[K_DATA][K_LOADER].items()})
        out.update({f"{K_ENV}.{k}": v for k, v in d[K_ENV].items()})
        for section in _V2:
            out.update({f"{section}.{k}": v for k, v in d[section].items() if k != _SOURCE})
        return out

    def differences(self, saved: RunRecord) -> list[str]:
        """Names of the checked fields whose values differ from ``saved``'s (sorted)."""
        now, then = self.fields(), saved.fields()
        return sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))

    def verify(self, saved: RunRecord | Mapping[str, Any], *, allow: Iterable[str] = ()) -> None:
        """Refuse every difference from ``saved`` not allowed by name; log the allowed ones.

        ``allow`` takes field names (`FIELDS`, ``env.NAME``) and the groups ``env`` and
        ``loader``. Refused differences raise `StateError` (``.fields``) listing each as
        ``field: saved X, now Y``; each allowed one is logged (WARNING, one line per field).
        """
        old = saved if isinstance(saved, RunRecord) else RunRecord.from_json(saved)
        allowed = _check_allow(allow)
        try:
            diffs = self.differences(old)
        except DetdataError:
            raise
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            raise StateError(
                f"the saved run record cannot be compared: {type(exc).__name__}: {exc}; it was "
                "edited or corrupted; hint: compare with a record RunRecord.save wrote"
            ) from None
        _check_held(allowed, {*self.fields(), *old.fields()})
        refused = [k for k in diffs if not _is_allowed(k, allowed)]
        for k in diffs:
            if k not in refused:
                logger.warning("run record: allowed difference %s", self._describe(k, old))
        if refused:
            lines = "\n".join(f"  {self._describe(k, old)}" for k in refused)
            names = ", ".join(repr(k) for k in refused)
            raise StateError(
                f"the run record differs from the saved one in {len(refused)} field(s):\n{lines}\n"
                f"hint: if these changes are intended, pass allow=({names},) to "
                "RunRecord.verify (each allowed difference is logged)",
                fields=tuple(refused),
            )

    def _describe(self, name: str, saved: RunRecord) -> str:
        if name == K_PACKAGES:
            return f"{name}: {_package_changes(saved.doc[K_PACKAGES][K_LIST], self._packages)}"
        then, now = saved.fields().get(name), self.fields().get(name)
        return f"{name}: saved {_short(then)}, now {_short(now)}"

    @property
    def _packages(self) -> list[list[str]]:
        packages: list[list[str]] = self.doc[K_PACKAGES][K_LIST]
        return packages


# -- capture helpers ----------------------------------------------------------------------
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


def _code(where: Path) -> dict[str, Any]:
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


def _lock_hashes(
    where: Path, toplevel: str | None, given: Sequence[str | os.PathLike[str]] | None
) -> dict[str, str]:
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


def normalise_name(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return _NAME_RUN.sub("-", name).lower()


def installed_packages() -> list[list[str]]:
    """``[[name, version], ...]`` of every installed distribution, sorted, de-duplicated."""
    found = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata is not None else None
        if name:
            found.add((normalise_name(str(name)), str(dist.version)))
    return [list(p) for p in sorted(found)]


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


def _layout(given: Mapping[str, int] | None) -> dict[str, int]:
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


def _data(loader: Any, manifests: Iterable[Any], seeds: Mapping[str, int | None] | None) -> Any:
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
        loader_fields = {k: parsed.fields[k] for k in _LOADER_FIELDS}
    for name, value in (seeds or {}).items():
        named[str(name)] = value
    return {
        K_MANIFESTS: sorted(ids),
        K_SEEDS: named,
        K_LOADER: loader_fields,
        K_LOADER_STATE: state,
    }


def _names(extra: Iterable[str], what: str = "extra_env") -> list[str]:
    if isinstance(extra, str):
        raise ConfigError(f"{what} takes a list of names, got the string {extra!r}")
    return [str(n) for n in extra]


def _env(extra: Sequence[str], clear: Sequence[str]) -> dict[str, str | None]:
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


_SOURCE: Final = "source"


def _container(image: str | None, digest: str | None) -> dict[str, str | None]:
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
    out[_SOURCE] = ", ".join(sources) or None
    return out


def _execution(state: Mapping[str, Any] | None, given: Mapping[str, Any] | None) -> dict[str, Any]:
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
        if _positive(gbs) and _positive(micro) and _positive(world):
            out["accumulation"] = gbs // (micro * world)
    unknown = sorted(set(given or {}) - set(EXECUTION_KEYS))
    if unknown:
        raise ConfigError(
            f"execution= has unknown keys {unknown}; known keys are {list(EXECUTION_KEYS)}"
        )
    out.update(dict(given or {}))
    return out


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_shape(doc: Mapping[str, Any], where: str) -> None:
    """Every section has the type `fields` reads (`StateError` naming the first that has not):
    a record edited by hand is refused here, never with a raw Python error later."""
    expected: list[tuple[str, Any, type | tuple[type, ...]]] = [
        (K_CODE, doc[K_CODE], dict),
        (K_LOCKS, doc[K_LOCKS], dict),
        (K_PACKAGES, doc[K_PACKAGES], dict),
        (K_VERSIONS, doc[K_VERSIONS], dict),
        (K_GPUS, doc[K_GPUS], list),
        (K_ENV, doc[K_ENV], dict),
        (K_LAYOUT, doc[K_LAYOUT], dict),
        (K_CONFIG, doc[K_CONFIG], (str, type(None))),
        (K_DATA, doc[K_DATA], dict),
        *((k, doc[k], dict) for k in _V2),
    ]
    for name, value, kind in expected:
        if not isinstance(value, kind):
            raise StateError(f"{where}: field {name!r} has the wrong type ({type(value).__name__})")
    packages = doc[K_PACKAGES]
    if not isinstance(packages.get(K_DIGEST), str) or not isinstance(packages.get(K_LIST), list):
        raise StateError(f"{where}: field 'packages' must hold a digest string and a list")
    if not all(isinstance(p, list) and len(p) == 2 for p in packages[K_LIST]):
        raise StateError(f"{where}: field 'packages.list' must hold [name, version] pairs")
    if not all(isinstance(g, dict) for g in doc[K_GPUS]):
        raise StateError(f"{where}: field 'gpus' must hold objects (name, uuid)")
    data = doc[K_DATA]
    for key, kind in ((K_MANIFESTS, list), (K_SEEDS, dict), (K_LOADER, dict)):
        if not isinstance(data.get(key), kind):
            raise StateError(
                f"{where}: field 'data.{key}' has the wrong type ({type(data.get(key)).__name__})"
            )


def _plain(doc: Any) -> Any:
    """A JSON round trip: tuples become lists, and anything not JSON-plain is refused."""
    try:
        return json.loads(json.dumps(doc, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"run record: a value is not JSON-plain ({exc})") from None


# -- verify helpers -----------------------------------------------------------------------
def _check_allow(allow: Iterable[str]) -> frozenset[str]:
    if isinstance(allow, (str, bytes)):
        raise ConfigError(f"allow= takes a list of field names, got the string {allow!r}")
    names = frozenset(allow)
    known = {*FIELDS, *GROUPS}
    unknown = sorted(
        str(n)
        for n in names
        if n not in known and not str(n).startswith((f"{K_ENV}.", f"{K_DETERMINISM}."))
    )
    if unknown:
        raise ConfigError(
            f"allow= names unknown run record fields {unknown}; known names are "
            f"{[*FIELDS, *GROUPS]}, env.NAME and determinism.NAME"
        )
    return names


def _check_held(allowed: frozenset[str], held: set[str]) -> None:
    """`ConfigError` for an ``env.NAME`` / ``determinism.NAME`` neither record holds: a typo
    there would allow nothing and say nothing."""
    prefixes = (f"{K_ENV}.", f"{K_DETERMINISM}.")
    unheld = sorted(n for n in allowed if n.startswith(prefixes) and n not in held)
    if unheld:
        recorded = sorted(n for n in held if n.startswith(prefixes))
        raise ConfigError(
            f"allow= names {unheld}, which neither run record holds; recorded: {recorded}; "
            "hint: check the spelling, or allow the whole group ('env', 'determinism')"
        )


def _is_allowed(name: str, allowed: frozenset[str]) -> bool:
    return name in allowed or ("." in name and name.split(".", 1)[0] in allowed)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 200 else text[:197] + "..."


def _package_changes(saved: list[list[str]], now: list[list[str]]) -> str:
    then_map, now_map = {n: v for n, v in saved}, {n: v for n, v in now}
    parts = []
    for name in sorted(set(then_map) | set(now_map)):
        a, b = then_map.get(name), now_map.get(name)
        if a != b:
            parts.append(
                f"{name} saved {'absent' if a is None else a}, now {'absent' if b is None else b}"
            )
    shown = "; ".join(parts[:20]) + (f"; and {len(parts) - 20} more" if len(parts) > 20 else "")
    return shown or "the package list digest differs"
