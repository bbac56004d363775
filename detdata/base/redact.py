"""Keeping credentials out of messages, logs, records, CLI output and saved files: the one
redaction home, and the boundary every output passes (docs/design.md, "Scale: identity and
secrets"): `DetdataError` text (`redact_args`), storage clients' exceptions
(`scrub_exception`), CLI output (`redacted_output`), records (`redact_value`) and logs
(`get_logger`, `install_log_redaction`).

Secrets ride in URLs as user info (``http://alice:TOKEN@host``) and as query parameters
named in `SECRET_PARAMS` or containing one of `SECRET_WORDS` (case-insensitive).
`redact_url` masks them with ``***`` (parameter names stay); `strip_credentials` removes them
(the form a root is persisted in). Everything else in a URL is kept byte for byte.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any, Final, TextIO, TypeVar

T = TypeVar("T")

MASK: Final = "***"

#: credential parameter names that contain none of `SECRET_WORDS` (which catch the rest:
#: ``x-amz-signature``, ``access_token``, ``client_secret``, ``awsaccesskeyid``...)
SECRET_PARAMS: Final = frozenset({"sig", "key", "pwd", "auth", "authorization", "googleaccessid"})
SECRET_WORDS: Final = (
    "token",
    "secret",
    "signature",
    "password",
    "passwd",
    "credential",
    "apikey",
    "api_key",
    "api-key",
    "access_key",
    "accesskey",
)

# scheme :// userinfo @ (userinfo: anything up to the last '@' before the path starts)
_USERINFO: Final = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*@)")
_PARAM: Final = re.compile(r"(^|[&;])([^&;=#]+)=([^&;#]*)")
# a URL inside free text: up to whitespace, a quote or a bracket
_URL_IN_TEXT: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{}]+")


def _split(url: str) -> tuple[str, str, str, str]:
    """``(before userinfo, userinfo with '@' or '', rest up to '?', query with '?' or '')``."""
    m = _USERINFO.match(url)
    head, userinfo = (m.group(1), m.group(2)) if m else ("", "")
    rest = url[len(head) + len(userinfo) :]
    path, sep, query = rest.partition("?")
    return head, userinfo, path, sep + query


def _query_secrets(query: str, replace: str | None) -> str:
    """``query`` (without '?') with credential values replaced (or, None, parameters dropped)."""
    fragment = ""
    if "#" in query:
        query, fragment = query.split("#", 1)
        fragment = "#" + fragment

    def sub(m: re.Match[str]) -> str:
        lead, name, _ = m.groups()
        low = name.strip().lower()
        if low not in SECRET_PARAMS and not any(word in low for word in SECRET_WORDS):
            return m.group(0)  # not a credential (see the module docstring)
        return "" if replace is None else f"{lead}{name}={replace}"

    out = _PARAM.sub(sub, query)
    if replace is None:
        out = re.sub(r"[&;]{2,}", "&", out).strip("&;")
    return out + fragment


def redact_url(url: str) -> str:
    """``url`` with user info and credential query values replaced by ``***``:
    ``http://alice:T@host/d?sig=abc&part=1`` -> ``http://***@host/d?sig=***&part=1``."""
    return _rewrite(url, MASK)


def strip_credentials(url: str) -> str:
    """``url`` without user info and credential query parameters (what is persisted):
    ``http://alice:T@host/d?sig=abc&part=1`` -> ``http://host/d?part=1``."""
    return _rewrite(url, None)


def _rewrite(url: str, mask: str | None) -> str:
    """``url`` with its credentials masked with ``mask`` (None: removed)."""
    if not isinstance(url, str) or "://" not in url:
        return url
    head, userinfo, path, query = _split(url)
    out = head + (f"{mask}@" if userinfo and mask else "") + path
    if query:
        kept = _query_secrets(query[1:], mask)
        out += kept if mask is None and (not kept or kept.startswith("#")) else "?" + kept
    return out


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through `redact_url` (messages, log lines)."""
    if "://" not in text:
        return text

    def one(m: re.Match[str]) -> str:
        url = m.group(0)
        body = url.rstrip(".,;:!?")  # sentence punctuation after a URL is not part of it
        return redact_url(body) + url[len(body) :]

    return _URL_IN_TEXT.sub(one, text)


def scrub_exception(exc: BaseException) -> BaseException:
    """Redact the URLs in ``exc``'s text and its chain's, in place (``args``, an OSError's file
    names, aiohttp's ``request_info``), before a client's error is re-raised, chained or
    kept. Returns ``exc``; its type and other attributes are unchanged."""
    for current in exception_chain(exc):
        _scrub_one(current)
    return exc


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then its ``__cause__`` (else ``__context__``), and so on, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _scrub_one(exc: BaseException) -> None:
    with contextlib.suppress(AttributeError, TypeError):  # exotic exception types
        exc.args = redact_args(exc.args)
    if isinstance(exc, OSError):
        for attr in ("strerror", "filename", "filename2"):
            value = getattr(exc, attr, None)
            if isinstance(value, str):
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, attr, redact_text(value))
    # aiohttp's ClientResponseError renders request_info.real_url, not args
    info = getattr(exc, "request_info", None)
    if info is not None and hasattr(info, "real_url"):
        _scrub_request_info(exc, info)


def _scrub_request_info(exc: BaseException, info: object) -> None:
    try:
        import yarl

        real = str(getattr(info, "real_url"))  # noqa: B009
        if redact_url(real) == real:
            return
        safe_url = yarl.URL(redact_url(real), encoded=True)
        replace = getattr(type(info), "_replace", None)
        if replace is not None:  # a NamedTuple in older aiohttp
            new_info = replace(info, url=safe_url, real_url=safe_url)
        else:
            import dataclasses

            new_info = dataclasses.replace(info, url=safe_url, real_url=safe_url)  # type: ignore[type-var]
        exc.request_info = new_info  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover - never let redaction itself fail a read
        pass


#: third-party loggers whose records quote the URLs they were given
CLIENT_LOGGERS: Final = (
    "fsspec",
    "fsspec.http",
    "fsspec.asyn",
    "fsspec.local",
    "fsspec.cached",
    "fsspec.reference",
    "s3fs",
    "gcsfs",
    "gcsfs.core",
    "adlfs",
    "aiohttp.client",
)


class RedactingFilter(logging.Filter):
    """A logging filter that passes every record with the URLs in its message redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own error path
            return True
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            scrub_exception(record.exc_info[1])  # and its chain: formatters render them
            record.exc_text = redact_text(_FORMATTER.formatException(record.exc_info))
        return True


_FORMATTER: Final = logging.Formatter()


_FILTER: Final = RedactingFilter()


def install_log_redaction(names: tuple[str, ...] = CLIENT_LOGGERS) -> None:
    """Attach the (one) `RedactingFilter` to each named logger; idempotent."""
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` with the (one) `RedactingFilter` attached: every detdata logger."""
    install_log_redaction((name,))
    return logging.getLogger(name)


def redact_args(args: tuple[object, ...]) -> tuple[object, ...]:
    """Exception arguments with every string passed through `redact_text`."""
    return tuple(redact_text(a) if isinstance(a, str) else a for a in args)


def redact_value(value: T) -> T:
    """A JSON-like ``value`` (dicts, lists, tuples, strings, numbers) with every string in it,
    dict keys included, passed through `redact_text`; containers are copied, other values
    returned as they are."""
    out: Any
    if isinstance(value, str):
        out = redact_text(value)
    elif isinstance(value, dict):
        out = {redact_value(k): redact_value(v) for k, v in value.items()}
    elif isinstance(value, list):
        out = [redact_value(v) for v in value]
    elif isinstance(value, tuple) and not hasattr(value, "_fields"):
        out = tuple(redact_value(v) for v in value)
    else:
        out = value
    return out  # type: ignore[no-any-return]


class RedactingWriter(io.TextIOBase):
    """A text stream that writes ``target`` each whole line (a URL never spans a line end)
    through `redact_text`, the unfinished line on `flush`; other attributes are the target's."""

    def __init__(self, target: TextIO) -> None:
        super().__init__()
        self.target = target
        self._pending = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            data = self._pending + text
            cut = max(data.rfind("\n"), data.rfind("\r")) + 1
            self._pending = data[cut:]
            if cut:
                self.target.write(redact_text(data[:cut]))
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self.target.write(redact_text(self._pending))
                self._pending = ""
        self.target.flush()

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """Run the body with ``sys.stdout`` and ``sys.stderr`` behind `RedactingWriter`s (the CLI
    boundary); flushed and restored on the way out, whatever happens."""
    saved = sys.stdout, sys.stderr
    out, err = RedactingWriter(saved[0]), RedactingWriter(saved[1])
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        try:
            for stream in (out, err):
                with contextlib.suppress(ValueError):  # a closed target
                    stream.flush()
        finally:
            sys.stdout, sys.stderr = saved
