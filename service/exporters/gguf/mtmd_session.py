"""llama.cpp's side of the VLM check: ``llama-mtmd-cli`` run as a chat over several prompts, and
``llama-tokenize`` for the text around the image.

**A session per prompt.** The tool's chat mode reads lines: ``/image <path>`` loads the
image (its media marker goes first in the next message), any other line is the user's message.
The check sends ``/image`` and one line that holds the whole sequence after BOS: the text before the image, a sentinel
where the image goes (:data:`IMAGE_SENTINEL`), the text after it; newlines, tabs, carriage
returns and spaces travel as private-use characters (the console reads one line and strips it).
The chat template the tool is given (:data:`TEMPLATE`) removes the marker ``/image`` put first,
puts it where the sentinel is and restores the escaped characters, so the tool's prompt is
exactly the check's, whatever the checkpoint's own template says (the check renders that one
itself, with transformers: ``mtmd_check.chat_prompt``). mtmd then adds BOS (the first text
part, ``add_bos``), replaces the marker with the family's image tokens, and tokenizes each text
part with special tokens parsed, as :func:`llama_ids` does.

Why a session rather than ``-p``/``--image`` (one turn, then exit): the tool prints through
llama.cpp's log thread, whose logger is never flushed at exit (llama.cpp #22142), so under load
the end of the reply was lost (16 tokens generated, 1 printed). The request for the next line
(``> ``) follows the reply in the same ordered queue, so once the last one is in the log file
every reply is whole; then stdin closes and the tool ends. The log file, not stdout: the console
echoes the lines it reads to stdout directly, out of order with the queue. Each reply follows
the line ``MTMD_TEST_RESPONSE_MARKER`` prints (the tool logs it before every message it
evaluates), so replies are found by that marker, not by guessing where a prompt ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from service.errors import VerificationFailed
from service.exporters.common.child_process import run_child
from service.shims.llama_cpp import TOOL_ENV, llama_cpp_tool

MEDIA_MARKER = "<__media__>"
"""mtmd's default media marker (``mtmd_default_marker()``)."""
IMAGE_SENTINEL = "\ue010"
ESCAPES = {"\n": "\ue011", " ": "\ue012", "\t": "\ue013", "\r": "\ue014"}
"""Characters a console line cannot carry (or ``string_strip`` would drop), as sent."""
_JINJA = {"\n": "\\n", " ": " ", "\t": "\\t", "\r": "\\r"}
TEMPLATE = (
    "{{ messages[0]['content'] | replace('" + MEDIA_MARKER + "', '') | replace('"
    + IMAGE_SENTINEL + "', '" + MEDIA_MARKER + "')"
    + "".join(f" | replace('{sent}', '{_JINJA[char]}')" for char, sent in ESCAPES.items())
    + " }}"
)
"""The chat template llama-mtmd-cli gets (see the module doc): the message's text as the check
wrote it, the media marker moved to the sentinel."""
REPLY_MARKER = "<<modelprep-mtmd-reply>>"
"""What ``MTMD_TEST_RESPONSE_MARKER`` makes the tool log before each message it evaluates."""

SESSION = r"""
log="$1"; input="$2"; want="$3"; shift 3
fifo="$log.stdin"; rm -f "$fifo" "$log" "$log.hwm"; mkfifo "$fifo" || exit 1
"$@" --log-file "$log" < "$fifo" > /dev/null &
tool=$!
exec 3> "$fifo"
cat "$input" >&3
while kill -0 "$tool" 2>/dev/null; do
  hwm=$(sed -n 's/^VmHWM:[^0-9]*\([0-9]*\) kB$/\1/p' "/proc/$tool/status" 2>/dev/null)
  [ -n "$hwm" ] && echo "$hwm" > "$log.hwm"
  case "$(tail -c 3 "$log" 2>/dev/null | od -An -c | tr -d ' ')" in
    '\n>') [ "$(grep -c '^> ' "$log")" -ge "$want" ] && break ;;
  esac
  sleep 0.1
done
exec 3>&-
wait "$tool"; status=$?
rm -f "$fifo"; exit "$status"
"""
"""Feeds llama-mtmd-cli the session's lines and ends it once the tool asks for the line after
the last, recording the tool's own peak RSS (``VmHWM`` of ``/proc/<tool>/status``, read every
0.1 s while it runs) in ``<log>.hwm``. Why there too: ``run_child`` samples its child's tree
every 0.25 s, and on a small model the tool can start and end between two looks (it then
reported the shell's 1.7 MiB)."""

LOG_LINE = re.compile(rb"^\d+\.\d{2}\.\d{3}\.\d{3} [IWED] [^\n]*\n", re.MULTILINE)
"""A log line of llama.cpp's own (``--log-prefix --log-timestamps``), not the reply's."""


def session_line(before: str, after: str) -> str:
    """The console line carrying ``before`` + image + ``after`` (see the module doc)."""
    text = before + IMAGE_SENTINEL + after
    reserved = [c for c in (MEDIA_MARKER, *ESCAPES.values()) if c in before + after]
    if reserved or after.count(IMAGE_SENTINEL) or before.count(IMAGE_SENTINEL):
        raise VerificationFailed(
            f"the check's prompt holds characters its llama-mtmd-cli session reserves: {reserved}"
        )
    for char, sent in ESCAPES.items():
        text = text.replace(char, sent)
    return text


def run_session(
    text_gguf: Path,
    mmproj: Path,
    image: Path,
    prompts: Sequence[tuple[str, str]],
    tokens: int,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
) -> tuple[list[bytes], int]:
    """llama-mtmd-cli's greedy reply (bytes, as printed; at most ``tokens`` tokens) to each
    ``(before, after)`` prompt around the image, each in a session of its own, and the largest
    peak RSS. Why not one session with ``/clear`` between prompts: the pinned tool keeps its
    last media batch across messages and reads its freed chunks at the next image
    (``GGML_ABORT("invalid chunk type")`` in ``mtmd_input_chunk_get_n_tokens``)."""
    out: list[bytes] = []
    peak = 0
    for before, after in prompts:
        reply, rss = _one_session(
            text_gguf, mmproj, image, session_line(before, after), tokens, work, check_abort,
            bin_dir,
        )  # fmt: skip
        out.append(reply)
        peak = max(peak, rss)
    return out, peak


def _one_session(
    text_gguf: Path,
    mmproj: Path,
    image: Path,
    line: str,
    tokens: int,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None,
) -> tuple[bytes, int]:
    log = work / "mtmd-session.log"
    feed = work / "mtmd-session.in"
    feed.write_text(f"/image {image}\n{line}\n", encoding="utf-8")
    tool = str(llama_cpp_tool("llama-mtmd-cli", bin_dir))
    argv = [
        tool, "-m", str(text_gguf), "--mmproj", str(mmproj), "--jinja",
        "--chat-template", TEMPLATE, "-n", str(tokens), "--temp", "0",
        "--seed", "0", "-t", "1", "-c", "1024", "--no-warmup", "--log-prefix",
        "--log-timestamps", "--log-colors", "off",
    ]  # fmt: skip
    # run_child's peak is the largest of the shell's tree it saw; the session's record is the
    # tool's own whenever it ran (see SESSION)
    shell = ["/bin/sh", "-c", SESSION, "sh", str(log), str(feed), "3", *argv]
    env = TOOL_ENV | {"MTMD_TEST_RESPONSE_MARKER": REPLY_MARKER}
    peak = run_child(shell, work, "llama-mtmd-cli", check_abort, env, timeout=1800.0).rss
    (reply,) = replies(log.read_bytes(), 1)
    return reply, max(peak, tool_peak(log))


def tool_peak(log: Path) -> int:
    """llama-mtmd-cli's own peak RSS in bytes, as the session recorded it."""
    try:
        return int((log.parent / (log.name + ".hwm")).read_text().strip()) * 1024
    except (OSError, ValueError):
        raise VerificationFailed(
            "llama-mtmd-cli's peak RSS was not recorded (no VmHWM in /proc/<pid>/status)"
        ) from None


def replies(session: bytes, count: int) -> list[bytes]:
    """The ``count`` replies in a session's log: each after its :data:`REPLY_MARKER` line, up
    to the request for the next line (``> ``), without llama.cpp's own log lines. After a reply
    but the last come three requests (for ``/clear``, ``/image`` and the next prompt: the
    format of a session of several prompts, kept for when the tool no longer aborts on one)."""
    parts = session.split(REPLY_MARKER.encode() + b"\n")[1:]
    if len(parts) != count:
        raise VerificationFailed(
            f"llama-mtmd-cli answered {len(parts)} of {count} prompts: {session[-300:]!r}"
        )
    out = []
    for i, part in enumerate(parts):
        requests = 3 if i < count - 1 else 1
        pieces = part.rsplit(b"\n> ", requests)
        if len(pieces) <= requests:
            raise VerificationFailed(
                f"llama-mtmd-cli ended before replying to prompt {i}: {part[-300:]!r}"
            )
        out.append(LOG_LINE.sub(b"", pieces[0]))
    return out


def llama_ids(
    gguf_path: Path,
    texts: Sequence[str],
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
) -> list[list[int]]:
    """The ids llama.cpp gives each text as mtmd tokenizes a text part after the first: no BOS,
    special tokens parsed (``<start_of_turn>`` is one token)."""
    tool = str(llama_cpp_tool("llama-tokenize", bin_dir))
    out: list[list[int]] = []
    for i, text in enumerate(texts):
        if not text:
            out.append([])
            continue
        prompt = work / f"mtmd-text-{i}.txt"
        prompt.write_text(text, encoding="utf-8")
        log = work / "llama-tokenize.log"
        argv = [tool, "-m", str(gguf_path), "-f", str(prompt), "--ids", "--no-bos",
                "--log-disable"]  # fmt: skip
        run_child(argv, work, "llama-tokenize", check_abort, TOOL_ENV, log=log, timeout=600.0)
        lines = [ln for ln in log.read_text("utf-8", "replace").splitlines() if ln.startswith("[")]
        if not lines:
            raise VerificationFailed(f"llama-tokenize printed no ids for {text[:80]!r}")
        out.append([int(x) for x in json.loads(lines[-1])])
    return out
