"""Secrets with a visible prefix, stored only as a SHA-256 digest.

The secrets are 256-bit random strings, so a fast hash is enough (no password stretching needed);
comparison is constant-time. Used for API tokens, node tokens and pool join tokens.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

PREFIX_LEN = 8


@dataclass(frozen=True)
class IssuedSecret:
    plaintext: str  # shown to the user once, never stored
    prefix: str
    digest: str


def digest(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def issue(kind: str) -> IssuedSecret:
    """Make a new secret like `wz_ab12cd34_<43 random chars>`; `kind` is a short tag (wz, wzn, wzj)."""
    prefix = secrets.token_hex(PREFIX_LEN // 2)
    plaintext = f"{kind}_{prefix}_{secrets.token_urlsafe(32)}"
    return IssuedSecret(plaintext=plaintext, prefix=prefix, digest=digest(plaintext))


def split_prefix(plaintext: str) -> str | None:
    """The lookup prefix of a presented secret, or None when it is not shaped like one of ours."""
    parts = plaintext.split("_", 2)
    if len(parts) != 3 or len(parts[1]) != PREFIX_LEN:
        return None
    return parts[1]


def matches(plaintext: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(plaintext), stored_digest)
