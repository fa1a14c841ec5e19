"""Settings as they may be printed (errors, logs, /health, job records): every secret starred, by name and by shape.

    redacted({"client_options": {"url": "http://u:pw@h", "api_key": "K"}})
        -> {"client_options": {"url": "http://u:***@h", "api_key": "***"}}
    redacted("connect to postgresql://u:p@ss@db/x?password=pw failed")
        -> "connect to postgresql://u:***@db/x?password=*** failed"

By name: a mapping's key (at any depth) or a URL query parameter named like a password, API key, token, secret,
credential or auth. By shape: a URL's userinfo (its password; the whole userinfo where it has no password, which is then
often a token), and `name=value` words of a connection string (libpq's `password=...`). URLs are found word by word
and parsed (urllib.parse), never matched by a regex over the whole text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote_plus, urlsplit, urlunsplit

STARS = "***"
# anywhere in the name, its separators removed
SUBSTRINGS = ("password", "passwd", "secret", "credential", "apikey", "privatekey")
ENDINGS = ("token", "auth", "authorization", "pwd")  # a word of the name ending so (not max_tokens, author)
QUOTES = "\"'`()[]{}<>,;."  # around a name=value word in a message (and a sentence's full stop)
URL_END = "\"'`<>{}\\^|"  # what a URL does not hold unencoded: where one in a message ends
TRAILING = ".,;:)!?"  # a sentence's punctuation after a URL


def secret_name(name: str) -> bool:
    """Whether a setting called `name` holds a secret (`password`, `api_key`, `X-Auth-Token`, `clientSecret`...)."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    joined = re.sub(r"[^a-z0-9]", "", words)
    return any(s in joined for s in SUBSTRINGS) or any(
        w.endswith(ENDINGS) for w in re.split(r"[^a-z0-9]+", words) if w)


def redacted(value: Any) -> Any:
    """`value` with its secrets starred: mappings and sequences copied with each secret setting's value starred, a
    string with each URL's userinfo password and secret query parameters starred; anything else as it is."""
    if isinstance(value, Mapping):
        return {k: STARS if isinstance(k, str) and secret_name(k) and v is not None else redacted(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redacted(v) for v in value)
    if isinstance(value, str):
        return "".join(_word(w) for w in re.split(r"(\s+)", value))
    return value


def _word(word: str) -> str:
    """One whitespace-free word of a text with its secrets starred: each URL in it (from its scheme to the first
    character a URL does not hold, less a sentence's punctuation), else a `name=value`."""
    if "://" not in word:
        core = word.strip(QUOTES)
        name, equals, _ = core.partition("=")
        if not (equals and secret_name(name)):
            return word
        start = word.index(core)
        return word[:start] + f"{name}={STARS}" + word[start + len(core):]
    done, rest = "", word
    while (found := rest.find("://")) >= 0:
        start = found
        while start > 0 and (rest[start - 1].isalnum() or rest[start - 1] in "+.-"):
            start -= 1
        end = next((i for i in range(found + 3, len(rest)) if rest[i] in URL_END), len(rest))
        url = rest[start:end].rstrip(TRAILING)
        done, rest = done + rest[:start] + _url(url), rest[start + len(url):]
    return done + rest


def _url(url: str) -> str:
    """`url` with the password of its userinfo (the userinfo itself, without one) and its secret query parameters
    starred; a userinfo may hold an unencoded "@": the host follows the last one."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL after all (a bad IPv6 host): the part after :// is starred whole
        return url.partition("://")[0] + "://" + STARS
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        userinfo = f"{user}:{STARS}" if colon else STARS
    query = "&".join(_parameter(p) for p in parts.query.split("&")) if parts.query else ""
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}", query=query))


def _parameter(parameter: str) -> str:
    name, equals, _ = parameter.partition("=")
    return f"{name}={STARS}" if equals and secret_name(unquote_plus(name)) else parameter


__all__ = ["redacted", "secret_name"]
