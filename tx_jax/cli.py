"""Entry-point plumbing: every bad input becomes one `error: ...` line and an exit code.

An entry point in experiments/ ends with `cli.run(main)` instead of `app.run(main)`:

- exit 0 on success (or whatever int `main` returns);
- exit 2 for usage and config errors: bad flags, unknown config fields or presets, a
  ValueError / FileNotFoundError raised while checking the inputs (`USAGE_ERRORS`);
- exit 1 for failures at run time: a damaged checkpoint, a non-finite loss, anything else.

The line is `error: <message>` on stderr, with no traceback; `--verbose` or
`TX_JAX_DEBUG=1` prints the traceback as well. Library code keeps raising ordinary
exceptions whose message names the field, the value and what is accepted; an exception
may carry an `exit_code` attribute to choose its code explicitly.

The library leaves the process alone; `run` is where the process-wide settings are made
(PROCESS_SETTINGS, also shown by every entry point's --help).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
import re
import sys
import traceback
from typing import Callable

from absl import app, flags

from tx_jax import host_memory, orbax_noise

USAGE = 2
FAILURE = 1

PROCESS_SETTINGS = """\
Process-wide settings this command makes (tx_jax.cli.run; the tx_jax library itself,
e.g. train_and_evaluate called from Python, makes none of them):
  - glibc malloc keeps freed blocks for reuse (mallopt) and XLA_FLAGS gains
    --xla_multiheap_size_constraint_per_heap, on CPU-only hosts (tx_jax.host_memory;
    TX_JAX_HOST_MALLOC=system turns it off);
  - without --verbose, what Orbax's worker threads print when a checkpoint read or write
    fails is held back (sys.unraisablehook, filters on the absl and asyncio loggers, a
    warnings filter) and written to WORKDIR/orbax_errors.log (tx_jax.orbax_noise).
"""
HELD_LOG = "orbax_errors.log"

_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "On an error, print the traceback too (also: TX_JAX_DEBUG=1)."
)


class UsageError(ValueError):
  """A bad flag, config value or input file: the command must change (exit 2)."""

  exit_code = USAGE


class RunError(RuntimeError):
  """The inputs were accepted but the run failed (exit 1)."""

  exit_code = FAILURE


# Raised while reading flags, configs and input files: the user must change the command.
USAGE_ERRORS = (
    app.UsageError,
    flags.Error,
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
)


def _bad_config_file(error: BaseException) -> bool:
  """config_flags defers a config file that failed to load to the first `.value` (an OSError)."""
  return isinstance(error, OSError) and "Failed loading config file" in str(error)


def exit_code(error: BaseException) -> int:
  """2 for usage / config errors, 1 for failures at run time."""
  code = getattr(error, "exit_code", None)
  if isinstance(code, int):
    return code
  return USAGE if isinstance(error, USAGE_ERRORS) or _bad_config_file(error) else FAILURE


def _debug(argv: list[str] | None = None) -> bool:
  if os.environ.get("TX_JAX_DEBUG", "") not in ("", "0"):
    return True
  if flags.FLAGS.is_parsed() and _VERBOSE.value:
    return True
  return any(a in ("--verbose", "-verbose", "--verbose=true") for a in (argv or sys.argv))


def one_line(error: BaseException) -> str:
  """The error's message on one line: absl's embedded tracebacks reduced to their last line."""
  if isinstance(error, AttributeError) and error.args and isinstance(error.args[0], KeyError):
    error = error.args[0]  # ConfigDict's unknown attribute wraps the KeyError
  if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], str):
    text = error.args[0]  # str(KeyError) would quote the message
  else:
    text = str(error)
  if "Traceback (most recent call last)" in text:
    # config_flags wraps a failing get_config(): keep "flag --config=...:" and the cause.
    head = text.split("Traceback", 1)[0].strip().rstrip(":")
    last = [line.strip() for line in text.splitlines() if line.strip()][-1]
    text = f"{head}: {last}" if head else last
  if _bad_config_file(error):  # "...; Attempted [...]:; configs/x.py; [Errno 2] No such file..."
    parts = [p.strip() for p in text.splitlines() if p.strip()]
    text = f"--config: {parts[-1]}" if parts else text
  elif isinstance(error, OSError) and error.filename and error.strerror:
    text = f"{error.filename}: {error.strerror}"
  text = re.sub(r"\s*\n\s*", "; ", text.strip())
  if not _is_ours(error) or not text:
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
  return text


def _is_ours(error: BaseException) -> bool:
  """Whether tx_jax (or absl's flag parsing) raised it on purpose, with a message for users."""
  return (
      isinstance(error, USAGE_ERRORS)
      or _bad_config_file(error)
      or type(error).__module__.startswith("tx_jax")
  )


def report(
    error: BaseException, argv: list[str] | None = None, held: pathlib.Path | None = None
) -> int:
  """Prints `error: ...` (and the traceback when debugging) to stderr; returns the exit code.

  `held`: the file holding what Orbax's worker threads printed (named on the line).
  """
  if _debug(argv):
    traceback.print_exception(error, file=sys.stderr)
  line = one_line(error)
  if not _is_ours(error) and not _debug(argv):  # an unexpected error: probably a bug
    line += " (unexpected; --verbose or TX_JAX_DEBUG=1 shows the traceback)"
  if held is not None:
    line += f" (Orbax's worker-thread tracebacks: {held})"
  print(f"error: {line}", file=sys.stderr, flush=True)
  return exit_code(error)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with bad flags and configs reported as one line, exit 2."""
  try:
    return flags.FLAGS(argv)
  # Broad on purpose: a --config file is Python that config_flags runs here, so any error
  # it raises (NameError, ImportError, ...) is the user's input, reported as one line.
  except Exception as e:  # noqa: BLE001
    if _debug(argv):
      traceback.print_exception(e, file=sys.stderr)
    print(f"error: {_flag_error(e, argv)} (--helpshort lists the flags)", file=sys.stderr)
    sys.stderr.flush()
    sys.exit(USAGE)


def _flag_error(error: Exception, argv: list[str]) -> str:
  """A flag-parsing error on one line, naming the flag (config_flags' KeyError names no flag)."""
  text = one_line(error).replace("Error whilst parsing config file: ", "")
  text = re.sub(r"^(KeyError|AttributeError): ", "", text)
  if isinstance(error, AttributeError) and error.args and isinstance(error.args[0], KeyError):
    error = error.args[0]
  if isinstance(error, KeyError) and error.args and isinstance(error.args[0], str):
    key = str(error.args[0]).splitlines()[0].strip("'\"")
    flag = next((a.split("=")[0] for a in argv if re.search(rf"\.{re.escape(key)}(\.|=|$)", a)), "")
    rest = text.split(";", 1)[1].strip() if ";" in text else ""
    text = f"{flag}: the config has no field {key!r}" + (f"; {rest}" if rest else "")
  return text


def define_config_file(name: str, **kwargs):
  """`config_flags.DEFINE_config_file` whose flag errors are one line, exit 2, like `run`'s.

  With a default file, config_flags parses the file and the command line's `--config.*`
  overrides when the flag is defined, at import, before `run` can catch a typo.
  """
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  try:
    return config_flags.DEFINE_config_file(name, **kwargs)
  except (KeyError, AttributeError, ValueError, TypeError, OSError) as e:
    if _debug(sys.argv):
      traceback.print_exception(e, file=sys.stderr)
    print(f"error: {_flag_error(e, sys.argv)} (--helpshort lists the flags)", file=sys.stderr)
    sys.exit(USAGE)


def define_compilation_cache_dir():
  """`--compilation_cache_dir`, for the entry points that compile (tx_jax.compile_cache)."""
  return flags.DEFINE_string(
      "compilation_cache_dir",
      None,
      "JAX's persistent compilation cache, so re-runs skip XLA compiles. Default: "
      "$JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/tx_jax/xla; empty: off "
      "(tx_jax.compile_cache).",
  )


def _keep_held(held: orbax_noise.HeldBack | None) -> pathlib.Path | None:
  """Writes what `held` holds to WORKDIR/orbax_errors.log (else the temp folder); its path."""
  if held is None or not held.count:
    return None
  paths = []
  if "workdir" in flags.FLAGS and flags.FLAGS["workdir"].value:
    paths.append(pathlib.Path(flags.FLAGS["workdir"].value).absolute() / HELD_LOG)
  paths.append(pathlib.Path(tempfile.gettempdir()) / f"tx_jax-{os.getpid()}-{HELD_LOG}")
  for path in paths:
    try:
      held.write(path)
      return path
    except OSError:  # no workdir yet, or a full or read-only one: the next place
      continue
  return None


def guarded(main: Callable[[list[str]], int | None]) -> Callable[[list[str]], int]:
  """`main` with every exception turned into one `error:` line and an exit code.

  Without --verbose, Orbax's worker-thread noise is held back meanwhile (PROCESS_SETTINGS).
  """

  def wrapped(argv: list[str]) -> int:
    held = None if _debug(argv) else orbax_noise.HeldBack()
    error = None
    with held if held is not None else contextlib.nullcontext():
      try:
        code = main(argv) or 0
      except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
      except SystemExit:
        raise
      except BaseException as e:  # noqa: BLE001 -- the whole point: no traceback by default
        error = e
    path = _keep_held(held)  # after the block: the late reports are in
    if error is not None:
      return report(error, argv, path)
    if path is not None:
      print(f"note: Orbax's worker threads reported errors, held back in {path}", file=sys.stderr)
    return code

  return wrapped


def run(main: Callable[[list[str]], int | None]) -> None:
  """`app.run(main)` for tx_jax entry points: one `error:` line, exit 2 (usage) or 1 (run time).

  Makes the process-wide settings of PROCESS_SETTINGS, which the library leaves to entry
  points: first, before anything can start JAX, freed host memory is kept for reuse
  (tx_jax.host_memory: XLA:CPU's per-step buffers otherwise cost a page fault per 4 KiB).
  """
  host_memory.reuse_freed_memory()
  entry = sys.modules.get("__main__")
  if entry is not None and PROCESS_SETTINGS not in (entry.__doc__ or ""):  # shown by --help
    entry.__doc__ = f"{entry.__doc__ or ''}\n{PROCESS_SETTINGS}"
  app.run(guarded(main), flags_parser=_parse_flags)
