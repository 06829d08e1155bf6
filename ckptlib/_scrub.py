"""The one credential scrubber of every storage backend: what a message or a log line of
`ckptlib.storage` says never includes a password, key, token or signature.

Two nets, both always applied: patterns for what credentials look like wherever they come from
(a URL's `user:password@`, AWS access key ids, `key=value` credentials such as `sig=`,
`AccountKey=`, `X-Amz-Security-Token=`, bearer tokens, Google access tokens, API keys and
private keys), and the literal values of the credentials in the environment
(`AWS_SECRET_ACCESS_KEY`, `AZURE_STORAGE_CONNECTION_STRING`'s parts, an endpoint URL's
password, ...) plus those a client adds (`ObjectClient.secrets`). Exceptions are scrubbed in
place (`scrub_exception`) so a chained SDK error printed in a traceback is clean too, and
every storage module logs through `logger()`, whose filter scrubs each record.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Iterable
from urllib.parse import quote, unquote, urlsplit

REDACTED = "<redacted>"

# A literal secret shorter than this is not replaced by value (it would blank common words);
# the patterns still catch it in its usual places.
MIN_SECRET_LENGTH = 8

# The names credentials go by in query strings, connection strings, headers and JSON.
_CREDENTIAL_KEYS = (
    r"(?i)(?<![a-z0-9_\-])(?:aws_secret_access_key|secret_access_key|secretaccesskey|aws_session_token"
    r"|session_token|sessiontoken|x-amz-security-token|x-amz-signature|x-amz-credential|credential|signature"
    r"|sig|accountkey|account_key|sharedaccesssignature|sas_token|access_token|refresh_token|id_token"
    r"|client_secret|private_key_id|private_key|password|passwd|x-goog-api-key|api_key|apikey|token)"
)

# Each pattern's group "v" is the secret; the text around it stays, so a message still says
# which credential was involved.
_PATTERNS = (
    # PEM private keys (a service account JSON's "private_key"), escaped newlines or not.
    re.compile(r"(?P<v>-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----)", re.S),
    # A URL's userinfo password: scheme://user:password@host
    re.compile(r"(?i)\b[a-z][a-z0-9+.\-]*://[^\s/:@\"'<>]*:(?P<v>[^\s/\"'<>]*)@"),
    # key=value and key: value credentials (query strings, connection strings, headers, JSON).
    re.compile(_CREDENTIAL_KEYS + r"[\"']?\s*(?:[=:]|%3d)\s*[\"']?(?P<v>[^\s;&,\"'}<>]+)"),
    # HTTP authorization values (the scheme is kept: "Authorization: Bearer <redacted>").
    re.compile(
        r"(?i)\bauthorization[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|sharedkey|aws4-hmac-sha256)\s+)?"
        r"(?P<v>[^\s\"',}]+)"
    ),
    re.compile(r"(?i)\bbearer\s+(?P<v>[A-Za-z0-9\-._~+/]+=*)"),
    # AWS access key ids.
    re.compile(r"\b(?P<v>(?:AKIA|ASIA|AIDA|AROA|ABIA|ACCA|AGPA|AIPA|ANPA|ANVA|APKA|ASCA)[A-Z0-9]{12,})\b"),
    # Google: OAuth access tokens, refresh tokens, API keys.
    re.compile(r"\b(?P<v>ya29\.[A-Za-z0-9_\-.]+)"),
    re.compile(r"(?<![A-Za-z0-9])(?P<v>1//0[A-Za-z0-9_\-]{20,})"),
    re.compile(r"\b(?P<v>AIza[0-9A-Za-z_\-]{35})"),
    # An Azure storage account key on its own (64 bytes, base64).
    re.compile(r"(?<![A-Za-z0-9+/])(?P<v>[A-Za-z0-9+/]{86}==)"),
)

# Environment variables whose whole value is a credential.
_SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_SECRET",
)
# Environment variables holding URLs whose userinfo password is one.
_URL_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST", "AZURE_STORAGE_BLOB_ENDPOINT")


# For any message of ckptlib's (`scrub_message`): the patterns above, but a credential key only
# with '=' ("sig=...", "password=..."), never "key: value", which is also how a message names a
# state key ("model.token: shape (9,) in the state").
_MESSAGE_PATTERNS = tuple(p for p in _PATTERNS if not p.pattern.startswith(_CREDENTIAL_KEYS)) + (
    re.compile(_CREDENTIAL_KEYS + r"[\"']?(?:=|%3d)[\"']?(?P<v>[^\s;&,\"'}<>]+)"),
)


def _redact_group(match: re.Match) -> str:
    start, end = match.span("v")
    whole = match.group(0)
    return whole[: start - match.start()] + REDACTED + whole[end - match.start() :]


def environment_secrets() -> list[str]:
    """The credential values in this process's environment (read each time: it may change)."""
    env = os.environ
    out = [env.get(name, "") for name in _SECRET_ENV]
    for name in _URL_ENV:
        value = env.get(name, "")
        if "@" in value:
            try:
                out.append(urlsplit(value if "://" in value else f"http://{value}").password or "")
            except ValueError:
                pass
    for part in env.get("AZURE_STORAGE_CONNECTION_STRING", "").split(";"):
        name, _, value = part.partition("=")
        if name.strip().lower() in ("accountkey", "sharedaccesssignature"):
            out.append(value.strip())
    return [s for s in out if s]


def scrub(text: str, secrets: Iterable[str] = (), *, patterns: tuple[re.Pattern, ...] = _PATTERNS) -> str:
    """`text` with every credential replaced by <redacted>: whatever the patterns recognise, the
    environment's credentials and `secrets` (each also in its URL-quoted and unquoted form)."""
    text = str(text)
    for pattern in patterns:
        text = pattern.sub(_redact_group, text)
    values = set()
    for secret in [*environment_secrets(), *secrets]:
        if isinstance(secret, str) and len(secret) >= MIN_SECRET_LENGTH:
            values.update({secret, quote(secret, safe=""), unquote(secret)})
    for value in sorted(values, key=len, reverse=True):  # longest first: a secret may contain another
        if len(value) >= MIN_SECRET_LENGTH:
            text = text.replace(value, REDACTED)
    return text


def scrub_message(text: str) -> str:
    """`scrub` for any message ckptlib makes (every CheckpointError's, the `ckpt` command's error
    lines): a URL's password, `key=value` credentials, tokens and keys by their shape, and the
    environment's credentials; "name: value" is left alone (it names state keys)."""
    return scrub(text, patterns=_MESSAGE_PATTERNS)


def scrub_exception(exc: BaseException | None, secrets: Iterable[str] = ()) -> None:
    """Scrub the string arguments of `exc` and of the exceptions it chains (its cause and
    context), in place: a traceback that prints them shows no credential either."""
    secrets = list(secrets)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        try:
            exc.args = tuple(scrub(a, secrets) if isinstance(a, str) else a for a in exc.args)
        except (AttributeError, TypeError):  # an exception type with read-only args
            pass
        # Where SDKs keep what their str() and repr() show: google and azure a `message` (and
        # `reason`), botocore its format fields (`kwargs`) and a ClientError's parsed `response`.
        for name in ("message", "reason", "msg"):
            value = getattr(exc, name, None)
            if isinstance(value, str):
                try:
                    setattr(exc, name, scrub(value, secrets))
                except (AttributeError, TypeError):
                    pass
        response = getattr(exc, "response", None)
        for fields in (getattr(exc, "kwargs", None), response.get("Error") if isinstance(response, dict) else None):
            if isinstance(fields, dict):
                for key, value in list(fields.items()):
                    if isinstance(value, str):
                        fields[key] = scrub(value, secrets)
        exc = exc.__cause__ or exc.__context__


class _ScrubFilter(logging.Filter):
    """Scrubs a record's message and its formatted traceback before any handler sees them."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg = scrub(record.getMessage())
            record.args = ()
            if record.exc_info and not record.exc_text:
                record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is logging's to report
            pass
        return True


_FILTER = _ScrubFilter()


def logger(name: str) -> logging.Logger:
    """The logger a storage module logs through: every record it emits is scrubbed."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log


def guard_loggers(packages: Iterable[str]) -> None:
    """Scrub the records of every logger of `packages` that exists now (an SDK's, which may
    log request URLs, headers and signatures at DEBUG or INFO: botocore, azure.core's
    http_logging_policy). A backend calls it when it makes its client, after the SDK's
    modules are imported; a filter costs nothing for records below the logger's level."""
    prefixes = tuple(packages)
    names = [name for name in list(logging.Logger.manager.loggerDict) if name.split(".")[0] in prefixes]
    for name in [*prefixes, *names]:
        logger(name)
