"""Typed user-facing errors. The CLI maps each class to its own exit code.

Exit codes (documented in README):
  0 ok, 1 internal error, 2 bad flags (Click's own usage errors too),
  3 input not found, 4 unsupported input type, 5 corrupt document,
  6 encrypted document (wrong or missing password), 7 no extractable text (scanned),
  8 empty document (blank, or tokenizes to nothing), 9 document too long for the chosen strategy,
  10 model could not be loaded, 11 malformed profile, 12 out of memory / does not fit,
  13 some documents of a batch failed, 14 a file could not be written (disk full, read-only,
  a cache folder that is not a folder), 130 interrupted (Ctrl-C).
"""
from __future__ import annotations


class SpecacheError(Exception):
    """Base class: a user-facing error with a one-line message and an exit code."""

    exit_code = 1
    code = "error"


class BadArgument(SpecacheError):
    exit_code = 2
    code = "bad_argument"


class InputNotFound(SpecacheError):
    exit_code = 3
    code = "not_found"


class UnsupportedInput(SpecacheError):
    exit_code = 4
    code = "unsupported_type"


class CorruptDocument(SpecacheError):
    exit_code = 5
    code = "corrupt_document"


class EncryptedDocument(SpecacheError):
    exit_code = 6
    code = "encrypted_document"


class NoExtractableText(SpecacheError):
    exit_code = 7
    code = "no_text"


class EmptyDocument(SpecacheError):
    exit_code = 8
    code = "empty_document"


class DocumentTooLong(SpecacheError):
    exit_code = 9
    code = "too_long"


class ModelLoadError(SpecacheError):
    exit_code = 10
    code = "model_load_error"


class UnsupportedModel(ModelLoadError):
    """A model whose attention the engine cannot reproduce (an argument it does not implement, a module
    that bypasses the attention interface, an architecture it has not been checked on): refused at load,
    with the model-error exit code, rather than giving text that differs from the model's."""

    code = "unsupported_model"


class ProfileError(SpecacheError):
    exit_code = 11
    code = "bad_profile"


class DoesNotFit(SpecacheError):
    exit_code = 12
    code = "does_not_fit"


class BatchFailures(SpecacheError):
    exit_code = 13
    code = "batch_failures"


class StorageError(SpecacheError):
    """A file specache must write (converted model, store entry, cache folder) cannot be written."""

    exit_code = 14
    code = "storage_error"


INTERRUPTED_EXIT = 130  # Ctrl-C: 128 + SIGINT, as shells report it
