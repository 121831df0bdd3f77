"""How the command line reports a failure: one line, on a line of its own. Bad-input errors say what is
wrong themselves (cut to a bounded length), anything else is named as an internal error; a progress bar
left open by the failure is ended first. Apart from cli.py, which builds the commands."""

from __future__ import annotations

import sys

from dynamicrubric.infra.artifact_kinds import ArtifactError
from dynamicrubric.infra.config import ConfigError
from dynamicrubric.localrun.launch import LaunchError
from dynamicrubric.stages.rerun import RerunError
from dynamicrubric.store import StoreError

MAX_ERROR_CHARS = 300  # an error echoes user data (an id, a path): a 4 MB id must not flood the terminal
# A model server's failure is built from bounded parts (roles, URLs, counts, where calls.json is): the
# line is printed whole up to this, so the place it names is never cut off.
MAX_SERVED_ERROR_CHARS = 4000

# Errors that describe bad input or an unusable store/config: their message is the whole story.
USER_ERRORS = (ArtifactError, ConfigError, StoreError, LaunchError, RerunError, ValueError, OSError)


def one_line(message: object, limit: int = MAX_ERROR_CHARS) -> str:
    """`message` on one line (whitespace collapsed), cut to `limit` characters in the middle with a
    note of how many were left out: the start names what failed (a path), the end says why, and a long
    path or id between them must not push the reason off the line."""
    text = " ".join(str(message).split())
    if len(text) <= limit:
        return text
    keep = limit - len(f" ... ({len(text)} more chars) ... ")  # the count's width is at most this
    tail = keep // 3
    return f"{text[: keep - tail]} ... ({len(text) - keep} more chars) ... {text[len(text) - tail :]}"


def describe_error(err: BaseException) -> str:
    """One line for the user. Bad-input errors say what is wrong themselves; anything else is named by
    its type, since it is a bug to report rather than an input to fix."""
    from dynamicrubric.engines import EngineError, ServedError
    from dynamicrubric.infra.models import ModelError

    if isinstance(err, ServedError):  # names a server, its counts and its record's place: all of it
        return one_line(err, limit=MAX_SERVED_ERROR_CHARS)
    if isinstance(err, USER_ERRORS + (EngineError, ModelError)) and str(err):
        return one_line(err)
    return one_line(f"{type(err).__name__}: {err} (an internal error: rerun with -v for the traceback)")


def _end_progress_bars() -> None:
    """A stage stopped or failed while a progress bar was open (a model's loading bar, say) left that
    bar's line unfinished: closing the bars ends it, so the one error line starts a line of its own."""
    import contextlib

    with contextlib.suppress(Exception):
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()


class LineEnds:
    """sys.stderr, remembering whether what was written last ended its line: a stop can come while a
    progress bar writes (inside tqdm's close, between its last frame and its newline), and the one error
    line must still start a line of its own."""

    def __init__(self, stream) -> None:
        self._stream, self.at_line_start = stream, True

    def write(self, text: str) -> int:
        if text:
            self.at_line_start = text.endswith(("\n", "\r"))
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def error_line(text: str, stderr: LineEnds) -> None:
    """Print the command's one error line, on a line of its own."""
    _end_progress_bars()
    print(("" if stderr.at_line_start else "\n") + text, file=sys.stderr)
