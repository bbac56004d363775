"""Retries for storage reads: exponential backoff, deterministic jitter, a deadline.

`RetryPolicy.run(fn, ...)` calls ``fn(attempt_timeout)`` until it returns, a *permanent*
error is raised (re-raised unchanged; HTTP 401/403 is a `StorageError` at once), or
``deadline_s`` passes: then `RetriesExhausted` names the operation, shard, URL (redacted),
attempts, time spent and last error. ``deadline_s`` bounds one operation (a batch of range
reads, one chunk of a fill, one manifest read); ``attempt_timeout_s`` cancels one stalled
attempt (enforced on fsspec's asynchronous file systems).

Backoff before attempt ``n + 1`` is ``min(max_delay_s, base_delay_s * 2**n)`` times a jitter
factor in ``[0.5, 1)`` taken from blake3 of ``(key, n)`` (the key: the URL read), so no
random generator is consumed and retries never change which bytes are delivered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import blake3

from detdata.base.errors import ConfigError, DetdataError, RetriesExhausted, ShortRead, StorageError
from detdata.base.redact import (
    exception_chain,
    get_logger,
    redact_text,
    redact_url,
    scrub_exception,
)

T = TypeVar("T")
log: Final = get_logger("detdata.retry")
JITTER_ALGORITHM: Final = "detdata:retry-jitter-v1"

# Errors that say "this will not get better by waiting" (re-raised at once).
_PERMANENT: Final = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)
_RETRY_STATUS: Final = frozenset({408, 425, 429, 500, 502, 503, 504})
_BOTO_TRANSIENT: Final = frozenset(
    {
        "HTTPClientError",
        "ConnectionError",
        "EndpointConnectionError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ConnectionClosedError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "ProxyConnectionError",
    }
)
_BOTO_CODES: Final = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "RequestTimeTooSkewed",
    }
)


#: S3-style error codes that mean "these credentials may not read this" (HTTP 401/403)
_DENIED_CODES: Final = frozenset(
    {
        "AccessDenied",
        "Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidToken",
        "AllAccessDisabled",
        "AuthorizationHeaderMalformed",
        "AuthFailure",
        "AuthenticationFailed",
        "Unauthorized",
        "401",
        "403",
    }
)


def denied_status(exc: BaseException) -> int | None:
    """401 or 403 when ``exc`` (or an error in its chain) is a storage server refusing the
    request's credentials: aiohttp's ``status``, botocore's HTTP status or error code,
    gcsfs's ``code``; else None. (fsspec's HTTP ``info`` raises `FileNotFoundError` *from*
    the real error, so the chain is followed.)"""
    for current in exception_chain(exc):
        for attr in ("status", "code"):
            value = getattr(current, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value in (401, 403):
                return value
        code, http = _boto_response(current)
        if http in (401, 403):
            return int(http)
        if code in _DENIED_CODES:
            return 403
    return None


def _boto_response(exc: BaseException) -> tuple[str, Any]:
    """``(error code, HTTP status)`` of botocore's ``response`` dict (``("", None)`` without)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", None
    code = str(response.get("Error", {}).get("Code", ""))
    return code, response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def is_transient(exc: BaseException) -> bool:
    """Whether waiting and reading again may succeed (network, timeouts, 5xx, short reads)."""
    if isinstance(exc, DetdataError):
        return isinstance(exc, ShortRead)
    if isinstance(exc, FileNotFoundError) and exc.__cause__ is not None:
        # fsspec's HTTP info() reports *any* failure of its HEAD/GET as FileNotFoundError
        # raised from the real error: a reset connection is not a missing file
        return not isinstance(exc.__cause__, FileNotFoundError) and is_transient(exc.__cause__)
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ConnectionError, ShortRead)):
        return True
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 400 <= status < 600:  # aiohttp ClientResponseError
        return status in _RETRY_STATUS
    module = type(exc).__module__ or ""
    if module.startswith("aiohttp"):
        return True  # ClientPayloadError, ServerDisconnectedError, ClientOSError, ...
    if module.startswith("botocore") or module.startswith("aiobotocore"):
        name = type(exc).__name__
        if name in _BOTO_TRANSIENT:
            return True
        code, http = _boto_response(exc)
        return code in _BOTO_CODES or (isinstance(http, int) and http in _RETRY_STATUS)
    # EIO-style errors from fsspec back ends, pyarrow's ArrowIOError
    return isinstance(exc, OSError)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How storage reads retry (the module docstring). ``attempt_timeout_s`` None: only the
    client's own timeouts apply; ``max_attempts`` None: until the deadline."""

    deadline_s: float = 120.0
    attempt_timeout_s: float | None = 30.0
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        for name in ("deadline_s", "base_delay_s", "max_delay_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"RetryPolicy.{name} must be a number >= 0, got {value!r}")
        t = self.attempt_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ConfigError(f"RetryPolicy.attempt_timeout_s must be > 0 or None, got {t!r}")
        m = self.max_attempts
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ConfigError(
                f"RetryPolicy.max_attempts must be an integer >= 1 or None, got {m!r}"
            )
        if self.max_delay_s < self.base_delay_s:
            raise ConfigError(
                f"RetryPolicy.max_delay_s ({self.max_delay_s}) must be >= "
                f"base_delay_s ({self.base_delay_s})"
            )

    def delay(self, key: str, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based) of the read named ``key``."""
        cap = min(self.max_delay_s, self.base_delay_s * (2.0 ** min(attempt, 60)))
        digest = blake3.blake3(f"{JITTER_ALGORITHM}|{key}|{attempt}".encode()).digest()
        fraction = int.from_bytes(digest[:8], "little") / 2.0**64
        return cap * (0.5 + 0.5 * fraction)

    def run(
        self,
        fn: Callable[[float | None], T],
        *,
        what: str,
        shard: str | Callable[[], str],
        url: str | Callable[[], str],
    ) -> T:
        """``fn(attempt_timeout)`` with retries. ``shard`` and ``url`` name what is read in
        messages (callables: asked at each failure); the URL at the first failure seeds the
        jitter."""
        start = time.monotonic()
        attempt = 0
        key = ""
        while True:
            remaining = self.deadline_s - (time.monotonic() - start)
            timeout = self.attempt_timeout_s
            if timeout is not None:
                timeout = max(0.05, min(timeout, remaining))
            try:
                return fn(timeout)
            except Exception as exc:  # not KeyboardInterrupt, SystemExit: they pass at once
                scrub_exception(exc)  # client errors quote the URL, credentials included
                status = denied_status(exc)
                if status is not None:  # a retry cannot renew a signature: at once
                    raise _denied(what, shard, url, status) from exc
                if not is_transient(exc):
                    raise
                last = exc
            attempt += 1
            elapsed = time.monotonic() - start
            shard_now, url_now = _now(shard), _now(url)
            key = key or url_now
            url_now = redact_url(url_now)
            wait = self.delay(key, attempt - 1)
            out_of_time = elapsed + wait >= self.deadline_s
            if out_of_time or (self.max_attempts is not None and attempt >= self.max_attempts):
                raise RetriesExhausted(  # its text is redacted when it is made (DetdataError)
                    f"{what} failed for shard {shard_now} at {url_now}: {attempt} attempt(s) "
                    f"in {elapsed:.2f}s (deadline {self.deadline_s:g}s); last error: "
                    f"{type(last).__name__}: {last}; hint: check that the store is "
                    "reachable and the object exists; a slow store may need a longer "
                    "RetryPolicy(deadline_s=..., attempt_timeout_s=...)",
                    shard=shard_now,
                    url=url_now,
                    attempts=attempt,
                    last_error=last,
                ) from last
            log.warning(
                "detdata: %s (shard %s, %s) failed on attempt %d: %s: %s; retrying in %.3fs",
                what,
                shard_now,
                url_now,
                attempt,
                type(last).__name__,
                redact_text(str(last)),
                wait,
            )
            time.sleep(wait)


def _denied(
    what: str, shard: str | Callable[[], str], url: str | Callable[[], str], status: int
) -> StorageError:
    shard_now, url_now = _now(shard), redact_url(_now(url))
    meaning = "unauthorized" if status == 401 else "forbidden"
    return StorageError(
        f"{what} failed for shard {shard_now} at {url_now}: HTTP {status} ({meaning}: the "
        "store refused these credentials); hint: renew the token or presigned URL (an "
        "expired signature gives 403), or check the storage_options credentials"
    )


def _now(name: str | Callable[[], str]) -> str:
    return name() if callable(name) else name


DEFAULT_RETRY: Final = RetryPolicy()


def check_policy(policy: RetryPolicy | None) -> RetryPolicy:
    """``policy`` or the default; `ConfigError` for anything else."""
    if policy is None:
        return DEFAULT_RETRY
    if not isinstance(policy, RetryPolicy):
        raise ConfigError(f"retry must be a detdata RetryPolicy, got {type(policy).__name__}")
    return policy
