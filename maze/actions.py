"""Parse the model's text into moves. Never raises, whatever the text.

Rules: the last ``<action>...</action>`` tag wins (so a model may think aloud, mention tags in
its reasoning, and still be read by its final answer). Inside it, one move or, when
``max_moves`` > 1, several separated by commas/spaces. Moves are case-insensitive with common
synonyms (``north``, ``u``, arrows, ...). Anything else is an *invalid action*, reported with a
short reason that the environment feeds back to the model.

The reference interface (``interface="reference"``) reads the reference's format instead: a tuple
``('move', d)`` with d = 0 right, 1 up, 2 left, 3 down, or ``('stop', 'stop')``, taken from inside the
last ``<action>...</action>`` tag or, without a tag, from the whole text (backticks stripped), and read
with ``ast.literal_eval`` as the reference's parser does. ``format_action`` writes either format.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

OPEN, CLOSE = "<action>", "</action>"
MAX_ACTION_CHARS = 200  # longer tag contents are rejected without being parsed

SYNONYMS = {
    "up": "up", "u": "up", "north": "up", "n": "up", "↑": "up", "^": "up",
    "down": "down", "d": "down", "south": "down", "s": "down", "↓": "down", "v": "down",
    "left": "left", "l": "left", "west": "left", "←": "left", "<": "left", "w": "left",
    "right": "right", "r": "right", "east": "right", "e": "right", "→": "right", ">": "right",
    "stop": "stop", "done": "stop", "finish": "stop", "end": "stop", "halt": "stop",
}
# Single letters: u/d/l/r and the compass n/s/e/w.
_SPLIT = re.compile(r"[\s,;|]+")
_STRIP = ".!?'\"`*()[]{}:"
INTERFACES = ("vlmaze", "reference")
# The reference's move numbering: ('move', d) with d = 0 right, 1 up, 2 left, 3 down.
REFERENCE_DIRECTIONS = ("right", "up", "left", "down")


@dataclass(frozen=True)
class ParsedAction:
    moves: tuple[str, ...]  # e.g. ("up",) or ("up", "up", "left") or ("stop",); () when invalid
    error: str | None = None  # why the action is invalid; None when valid

    @property
    def valid(self) -> bool:
        return self.error is None


def _as_text(text) -> str:
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text).decode("utf-8", errors="replace")
    return "" if text is None else str(text)


def extract_action(text) -> str | None:
    """Content of the last complete ``<action>...</action>`` tag (case-insensitive), or None."""
    low = _as_text(text).lower()
    last_close = low.rfind(CLOSE)
    if last_close < 0:
        return None
    begin = low.rfind(OPEN, 0, last_close)  # the last opening tag that some closing tag follows
    if begin < 0:
        return None
    begin += len(OPEN)
    return low[begin:low.find(CLOSE, begin)]  # up to its own closing tag (innermost when nested)


def parse_action(text, max_moves: int = 1) -> ParsedAction:
    """Parse model text into moves; see the module docstring for the rules."""
    try:
        content = extract_action(text)
        if content is None:
            return ParsedAction((), "no <action>...</action> tag found")
        if len(content) > MAX_ACTION_CHARS:
            return ParsedAction((), f"action longer than {MAX_ACTION_CHARS} characters")
        words = [w.strip(_STRIP) for w in _SPLIT.split(content.strip())]
        words = [w for w in words if w]
        if not words:
            return ParsedAction((), "empty action")
        moves = []
        for w in words:
            move = SYNONYMS.get(w)
            if move is None:
                shown = w[:20].encode("ascii", "replace").decode()
                return ParsedAction((), f"unknown action '{shown}'; use up, down, left, right or stop")
            moves.append(move)
        if "stop" in moves and len(moves) > 1:
            return ParsedAction((), "'stop' must be the only action in its turn")
        if len(moves) > max_moves:
            return ParsedAction((), f"{len(moves)} moves given, at most {max_moves} per turn")
        return ParsedAction(tuple(moves))
    except Exception as exc:  # a parser must never take a rollout down
        return ParsedAction((), f"unparseable action ({type(exc).__name__})")


def parse_reference_action(text) -> ParsedAction:
    """Parse the reference's tuple format (module docstring); ``error`` holds the reference's feedback line."""
    try:
        content = extract_action(text)
        content = (_as_text(text) if content is None else content).strip().strip("`").strip()
        if len(content) > MAX_ACTION_CHARS:
            return ParsedAction((), f"Cannot parse action string: longer than {MAX_ACTION_CHARS} characters, "
                                    "so the action is invalid.")
        try:
            parsed = ast.literal_eval(content)
        except Exception as exc:  # SyntaxError, ValueError, MemoryError, RecursionError, ...
            shown = content[:40].encode("ascii", "replace").decode()
            return ParsedAction((), f"Cannot parse action string {shown!r}: {type(exc).__name__}, "
                                    "so the action is invalid.")
        if not isinstance(parsed, tuple) or len(parsed) != 2:
            return ParsedAction((), "The action format is invalid. The action should be a tuple of two elements "
                                    "with the first element being the action name and the second element being "
                                    "the action payload.")
        branch, payload = parsed
        if branch == "move":
            if isinstance(payload, int) and not isinstance(payload, bool) and 0 <= payload < 4:
                return ParsedAction((REFERENCE_DIRECTIONS[payload],))
            return ParsedAction((), f"The action {str(payload)[:20]} is not in the valid action space of move "
                                    "so nothing is executed.")
        if branch == "stop":
            if isinstance(payload, str) and 1 <= len(payload) <= 4 and payload.isalnum():
                return ParsedAction(("stop",))
            return ParsedAction((), f"The action {str(payload)[:20]} is not in the valid action space of stop "
                                    "so nothing is executed.")
        return ParsedAction((), f"The action name '{str(branch)[:20]}' is not recognized in the available "
                                "action space.")
    except Exception as exc:  # a parser must never take a rollout down
        return ParsedAction((), f"unparseable action ({type(exc).__name__})")


def format_action(move: str, interface: str = "vlmaze") -> str:
    """The action text a scripted policy or an SFT expert writes for ``move`` (up/down/left/right/stop)."""
    if interface == "reference":
        inner = "('stop', 'stop')" if move == "stop" else f"('move', {REFERENCE_DIRECTIONS.index(move)})"
        return f"{OPEN}{inner}{CLOSE}"
    return f"{OPEN}{move}{CLOSE}"
