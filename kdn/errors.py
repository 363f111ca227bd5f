"""The one exception hierarchy of KDN.

Misses are values (``None``, a shorter prefix), not exceptions. Exceptions are
for input that is wrong, bytes that fail verification, and services that are
unreachable; each says what is wrong in one line.
"""

from __future__ import annotations


class KDNError(Exception):
    """Base of every error KDN raises on purpose."""


class InvalidInput(KDNError, ValueError):
    """A caller-supplied value (address, namespace, name, token id, URL) is malformed."""


class InvalidAddress(InvalidInput):
    """A string that should be a lowercase-hex BLAKE3 address is not one."""


# --- object format ---------------------------------------------------------


class ObjectFormatError(KDNError, ValueError):
    """A blob is not a valid KDN object. Subclasses name what is wrong."""


class TruncatedObject(ObjectFormatError):
    """The blob ends before its header or its tensor data does."""


class CorruptObject(ObjectFormatError):
    """The blob's header or layout is inconsistent (bad JSON, overlapping offsets, ...)."""


class ObjectTooLarge(ObjectFormatError):
    """The blob or its header exceeds the configured size limit."""


class UnsupportedVersion(ObjectFormatError):
    """The blob was written by a format version this code does not read."""


class TensorMismatch(ObjectFormatError):
    """A tensor's stored dtype, shape or byte length disagrees with its header."""


class DigestMismatch(ObjectFormatError):
    """The blob's BLAKE3 digest differs from the one the registry or ETag promised."""


# --- codecs ----------------------------------------------------------------


class CodecError(KDNError):
    """A codec cannot encode or decode the given bytes."""


class UnknownCodec(CodecError, LookupError):
    """No codec is registered under the requested name."""


# --- registry --------------------------------------------------------------


class RegistryError(KDNError):
    """The registry failed an operation (unreachable, transaction conflict, ...)."""


class RegistryUnavailable(RegistryError):
    """The registry cannot be reached."""


class RegistryConflict(RegistryError):
    """A transactional write lost a race (compare failed)."""


class LeaseExpired(RegistryError):
    """A node lease expired or was revoked before it could be refreshed."""


# --- models, service -------------------------------------------------------


class ModelMismatch(KDNError):
    """States were produced by a different model than the one loading them."""


class UnknownModel(KDNError, LookupError):
    """No model is known under the given name or id."""


class SourceError(KDNError):
    """A fetch source (edge, peer, origin) failed to deliver an object."""
