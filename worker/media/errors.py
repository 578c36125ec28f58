"""Errors of the media layer: each has a stable `code` for the API and the CLI, and a message a user can act on.

`BAD_INPUT_CODES` are the caller's problem (exit code 2, HTTP 4xx); everything else is ours.
"""

from __future__ import annotations

from collections.abc import Callable

from worker.errors import Cancelled, PermanentError


class InputNotFound(PermanentError):
    code = "input_not_found"


class InputEmpty(PermanentError):
    code = "input_empty"


class InputUnreadable(PermanentError):
    """Not a media file FFmpeg can open: random bytes, text, a file cut before its header or index."""

    code = "input_unreadable"


class InputNoVideo(PermanentError):
    """Audio only, a still image, or cover art without a video stream."""

    code = "input_no_video"


class InputUnsupportedCodec(PermanentError):
    code = "input_unsupported_codec"


class InputCorrupt(PermanentError):
    """Opens but cannot be decoded to the end: truncated, damaged packets, frames missing."""

    code = "input_corrupt"


class InputEncrypted(PermanentError):
    """Encrypted content (DRM: MP4's Common Encryption): decoding without its key gives noise, not its picture."""

    code = "input_encrypted"


class InputTooLarge(PermanentError):
    code = "input_too_large"


class OutputTooLarge(PermanentError):
    """The output a job asks for costs more than a limit allows (pixels per frame, megapixel-frames per job)."""

    code = "output_too_large"


class BudgetExceeded(PermanentError):
    """The key's output per hour (megapixel-frames) would pass its budget with this job."""

    code = "compute_budget_exceeded"


class InputTooShort(PermanentError):
    code = "input_too_short"


class OutputUnwritable(PermanentError):
    code = "output_unwritable"


class OutputExists(PermanentError):
    """The CLI's output path holds a file already: replaced only when asked (`--overwrite`)."""

    code = "output_exists"


class OutputMismatch(PermanentError):
    """The written file is not what was promised: our bug, never handed to the user as done."""

    code = "output_mismatch"


BAD_INPUT_CODES = frozenset(
    error.code
    for error in (
        InputNotFound,
        InputEmpty,
        InputUnreadable,
        InputNoVideo,
        InputUnsupportedCodec,
        InputCorrupt,
        InputEncrypted,
        InputTooLarge,
        InputTooShort,
        OutputTooLarge,
        BudgetExceeded,
        OutputUnwritable,
    )
)


def stop_if_asked(alive: Callable[[], bool] | None) -> None:
    """Calls a long read's `alive` (a job's heartbeat), raising `Cancelled` when it says the owner asked to cancel."""
    if alive is not None and alive():
        raise Cancelled("the job was cancelled")
