"""Keeping credentials out of messages, logs, reprs and saved files: the one redaction home.

Two kinds of secrets ride in URLs:

* **user info**: ``http://alice:TOKEN@host/data``, ``s3://KEY:SECRET@bucket`` (and a
  bare ``https://TOKEN@host``): everything between ``://`` and the ``@`` that ends
  the authority;
* **credential-bearing query parameters**, as in presigned or SAS URLs. A
  parameter is a credential when its name, compared case-insensitively, is one of
  `SECRET_PARAMS` (``X-Amz-Signature``, ``X-Amz-Credential``,
  ``X-Amz-Security-Token``, ``X-Goog-Signature``, ``X-Goog-Credential``,
  ``Signature``, ``sig``, ``token``, ``access_token``, ``key``, ``api_key``,
  ``password``, ``secret``, ``client_secret``, ``auth``, ...) or contains one of
  `SECRET_WORDS` (``token``, ``secret``, ``signature``, ``password``,
  ``credential``, ``apikey``, ``api_key``, ``access_key``, ...).

`redact_url` replaces them with ``***`` (parameter names stay, so a reader sees
*which* credentials a URL carried); `redact_text` does that for every URL inside
a message. `strip_credentials` removes them (no ``***`` left behind that a later
reader would send as a credential): the form in which a root is persisted.
`scrub_exception` redacts an exception's text in place before detdata re-raises
or chains it. `RedactingFilter` redacts log records; `install_log_redaction`
puts one on the loggers of the fsspec back ends detdata reads through (their
DEBUG lines quote every URL), once, when `detdata.storage.fs` is imported.
Everything else in a URL (host, path, other parameters, a ``?`` or ``#`` in a
shard name) is kept byte for byte.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Final

MASK: Final = "***"

SECRET_PARAMS: Final = frozenset(
    {
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "x-goog-signature",
        "x-goog-credential",
        "x-goog-security-token",
        "signature",
        "sig",
        "token",
        "access_token",
        "id_token",
        "refresh_token",
        "key",
        "api_key",
        "apikey",
        "access_key",
        "password",
        "passwd",
        "pwd",
        "secret",
        "client_secret",
        "awsaccesskeyid",
        "googleaccessid",
        "auth",
        "authorization",
    }
)
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


def is_secret_param(name: str) -> bool:
    """Whether a query parameter named ``name`` carries a credential (see the module doc)."""
    low = name.strip().lower()
    return low in SECRET_PARAMS or any(word in low for word in SECRET_WORDS)


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
        if not is_secret_param(name):
            return m.group(0)
        return "" if replace is None else f"{lead}{name}={replace}"

    out = _PARAM.sub(sub, query)
    if replace is None:
        out = re.sub(r"[&;]{2,}", "&", out).strip("&;")
    return out + fragment


def redact_url(url: str) -> str:
    """``url`` with user info and credential query values replaced by ``***``.

    ``http://alice:TOKEN@host/d?X-Amz-Signature=abc&part=1`` ->
    ``http://***@host/d?X-Amz-Signature=***&part=1``. Strings without either are
    returned unchanged (local paths, ``s3://bucket/key``).
    """
    if not isinstance(url, str) or "://" not in url:
        return url
    head, userinfo, path, query = _split(url)
    shown = head + (f"{MASK}@" if userinfo else "") + path
    if query:
        shown += "?" + _query_secrets(query[1:], MASK)
    return shown


def strip_credentials(url: str) -> str:
    """``url`` without user info and without credential query parameters (what is persisted).

    ``http://alice:TOKEN@host/d?sig=abc&part=1`` -> ``http://host/d?part=1``. The
    credentials stay runtime arguments (a ``root=`` or ``storage_options``).
    """
    if not isinstance(url, str) or "://" not in url:
        return url
    head, _, path, query = _split(url)
    out = head + path
    if query:
        kept = _query_secrets(query[1:], None)
        if kept and not kept.startswith("#"):
            out += "?" + kept
        elif kept:
            out += kept
    return out


def has_credentials(url: str) -> bool:
    """Whether `strip_credentials` would change ``url``."""
    return strip_credentials(url) != url


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
    """Redact the URLs in ``exc``'s text in place (its ``args``, and an OSError's file names).

    Used before an exception from a storage client is re-raised, chained or
    kept (``RetriesExhausted.last_error``): fsspec and aiohttp put the URL they
    were given, credentials included, in their messages. Returns ``exc``. The
    type and every other attribute are unchanged (so ``FileNotFoundError`` still
    means "absent").
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        _scrub_one(current)
        current = current.__cause__ or current.__context__
    return exc


def _scrub_one(exc: BaseException) -> None:
    with contextlib.suppress(AttributeError, TypeError):  # exotic exception types
        exc.args = tuple(redact_text(a) if isinstance(a, str) else a for a in exc.args)
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
