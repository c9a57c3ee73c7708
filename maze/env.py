"""The maze environment: its settings, the observation (frames and words), the action format, ``MazeEnv``.

Settings: ``EnvSettings`` is the one set of environment defaults (the tiny CPU recipe's) and the one
validation; ``conf/schema.EnvConfig`` extends it with the training distribution, so every ``env.*`` key is a
field here, and rollouts, SFT experts, scripted policies and evaluation build their ``MazeEnv`` from it.

``MazeEnv`` is a Gymnasium environment that takes the model's text and answers with an image.
Observation: ``{"image": (H, W, 3) uint8 array, "text": str}``; at reset the text is the task
prompt, afterwards the feedback on the last action. The image is a numpy array rather than a
PIL image so that the observation lies in ``observation_space`` (``Image.fromarray`` or
``maze.to_pil`` makes a PIL image; HF processors take the array as is).

Semantics (reference: ``require_stop=True``): each call to ``step`` is one *turn*, whatever the
text. A turn's moves are applied in order until one hits a wall (a *bump*: the agent stays).
With ``require_stop`` the episode succeeds only on ``stop`` at the goal, and ``stop`` anywhere
else ends it as a failure; without it, arriving at the goal succeeds. An invalid action costs a
turn and is fed back. The episode is truncated after its turn budget. The environment's own reward
is sparse (1.0 on success); shaping lives in ``rl.grpo`` and reads ``info``.

Actions: the last ``<action>...</action>`` tag wins (so a model may think aloud, mention tags in
its reasoning, and still be read by its final answer). Inside it, one move or, when
``max_moves`` > 1, several separated by commas/spaces. Moves are case-insensitive with common
synonyms (``north``, ``u``, arrows, ...). Anything else is an *invalid action*, reported with a
short reason that the environment feeds back to the model. Parsing never raises, whatever the text.

``interface`` picks the words the model reads and writes: ``vlmaze`` (the tiny CPU recipe's short
prompt, ``<action>up</action>``) or ``reference`` (the reference environment's: its task description
with the maze size, colours and numbered actions, a tuple ``('move', d)`` with d = 0 right, 1 up, 2 left,
3 down, or ``('stop', 'stop')``, read from inside the last tag or, without one, from the whole text with
``ast.literal_eval`` as the reference's parser does; its feedback lines and a remaining-steps notice), so
a checkpoint fine-tuned on the reference trains and evaluates here without translation. The semantics are
the same for both.

Frames: a vectorised numpy renderer (no per-pixel Python). The palette is the reference environment's:
white floor, gray (169,169,169) walls (``wall_gray`` sets the gray), a red goal square and a blue agent
disc. A static background is drawn once per maze; each frame copies it and stamps the agent disc. Two
views: ``global`` (the maze as drawn) and ``egocentric`` (a (2N-1)-cell window centred on the agent).
"""

from __future__ import annotations

import ast
import math
import re
import string
from dataclasses import dataclass, fields, replace

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from PIL import Image, ImageDraw

from maze.core import MAX_SIZE, MIN_SIZE, MOVES, Maze, distances_from, generate_maze

SYSTEM_PROMPT = (
    "You are an agent in a maze seen from above. Gray cells are walls, white cells are floor, "
    "the blue disc is you and the red square is the goal. Each turn, think briefly, then give "
    "one action inside <action></action>: up, down, left, right, or stop when you are on the goal."
)
TASK_PROMPT = "Here is the maze. Reach the red goal."
MULTI_MOVE_HINT = " You may give up to {k} moves in one action, separated by commas."
# The reference's task description (content and action format are the reference's, the wording is vlmaze's).
REFERENCE_SYSTEM_PROMPT = (
    "You are navigating a {size}x{size} maze. The maze consists of walls (gray) and paths (white). You are "
    "represented by a blue circle, and your goal is to reach the red target square.\n\n"
    "Available actions:\n"
    "1. 'move': Move in one of four directions. Format: `('move', direction)` where direction is an integer:\n"
    "   - 0=right, 1=up, 2=left, 3=down\n"
    "2. 'stop': End the navigation session. Format: `('stop', 'stop')`\n\n"
    "Success: you succeed only if you stop on the red target square; stopping anywhere else ends the session "
    "as a failure. Moving into a wall or an invalid action uses up a step.\n\n"
    "Think briefly, then respond with exactly one action in the specified format inside <action></action>, "
    "for example <action>('move', 1)</action> to move up or <action>('stop', 'stop')</action> to stop."
)
REFERENCE_TASK_PROMPT = "Here is the maze. You have {steps} steps."
REFERENCE_MOVED, REFERENCE_BUMP = "Action executed successfully.", "Cannot move into a wall."
MAX_TEXT = 4096
REFERENCE_TURNS, REFERENCE_SIZE = 20, 9  # the reference's budget: 20 turns at 9x9, the final stop included


def turn_budget(size: int, max_turns: int = REFERENCE_TURNS, ref_size: int = REFERENCE_SIZE) -> int:
    """Turns for a maze of ``size``: ``max_turns`` at ``ref_size`` and below, scaled by area above it."""
    return max(max_turns, math.ceil(max_turns * (size / ref_size) ** 2))


def fewest_turns(moves: int, max_moves_per_turn: int = 1, require_stop: bool = True) -> int:
    """The fewest turns that walk a path of ``moves`` moves and end the episode: ``max_moves_per_turn`` moves a
    turn, plus the final ``stop`` with ``require_stop``. More than the turn budget: no policy solves the maze."""
    return -(-moves // max_moves_per_turn) + int(require_stop)


def training_sizes(env) -> list[int]:
    """The maze sizes an ``env.*`` config trains on (``conf/schema.EnvConfig``): its ``train_mix``'s, else
    ``train_sizes``, else ``size``. One answer for the sampler, the turn budget of the step and the memory plan."""
    return [int(m.size) for m in env.train_mix] or [int(s) for s in env.train_sizes] or [int(env.size)]


INTERFACES = ("vlmaze", "reference")
VIEWS = ("global", "egocentric")  # global: the maze as is; egocentric: centred on the agent
# The reference's observation: the whole maze as drawn, 25 px cells (225 px at 9x9, not padded: the processor
# resizes it as it did for the reference), gray (169) walls. ``MazeEnv(**REFERENCE_VIEW)``; +experiment=reference_8b.
REFERENCE_VIEW = dict(view="global", pixels_per_cell=25, pad_to=1, pad_before=0, wall_gray=169)


@dataclass
class EnvSettings:
    """What the model sees and how an episode runs: the one set of defaults (the tiny CPU recipe's; why:
    results/reference_task_probes.md) and, in ``check``, the one validation. ``env.*`` keys of the config are these
    fields (plus the training distribution, ``conf/schema.EnvConfig``)."""

    size: int = 9  # maze side in cells incl. the outer wall (odd, 5-31); the size ``max_turns`` is given for
    pixels_per_cell: int = 4  # 4 px: a (2N-1)-cell egocentric window of a 9x9 maze is 68 px + 12 -> 96: 9 tokens
    # (8 px: 160 px, 25 tokens; the tiny model reads dead-end pockets better at 4: results/reference_task_probes.md)
    pad_to: int = 32  # pad the image with wall to a multiple of this (patch 16 x merge 2: cells align with patches)
    wall_gray: int = 64  # gray level of walls; the reference palette is 169, which after the processor's
    # normalisation is 0.325 x white: LayerNorm cannot tell it from white without a bias. 64 is a negative multiple
    pad_before: int = 12  # global view: px of wall before the maze (top, left). Egocentric view: where the agent's
    # cell starts in its pad_to block, for every maze size (12 at 4 px/cell: 3 cells from the merged token's top and
    # left edges, 4 from the others, so every pocket up to 3 cells deep lies in the agent's own token; 8 at 8 px)
    view: str = "egocentric"  # global: the maze as drawn (reference) | egocentric: a (2N-1)-cell window centred on
    # the agent, so the whole maze stays in view and the agent's neighbours sit in fixed image tokens
    grid_lines: bool = False
    max_turns: int = 20  # turns per episode at ``size``, the final stop included (the reference: 20 at 9x9); a bump
    # or an invalid action is a turn; larger mazes get it scaled by area
    interface: str = "vlmaze"  # vlmaze: short prompt, <action>up</action> | reference: the reference's prompt,
    # ('move', d) / ('stop', 'stop') actions, its feedback lines and a remaining-steps notice
    require_stop: bool = True  # reference: success only on 'stop' at the goal
    max_moves_per_turn: int = 1
    max_images_in_context: int = 0  # keep only the newest K images (0 = all); training sees one sequence per
    # episode, so turns before the last K are then trained without the frame they were sampled from (off-policy)
    max_context_tokens: int = 8192  # an episode ends when its next turn would not fit
    history: int | None = None  # None: each episode is one growing conversation, trained as one sequence | K >= 0:
    # each turn is prompted with (and trained on) the task, the last K turns and its own frame: a bounded context

    @classmethod
    def from_config(cls, env_cfg) -> EnvSettings:
        """From ``conf/env`` (or any mapping with these keys); the training distribution's keys are not settings."""
        return cls(**{f.name: env_cfg[f.name] for f in fields(cls)})

    def check(self) -> None:
        """Raise ValueError naming the setting when a value cannot work (``conf/schema.validate`` and ``MazeEnv``)."""
        if not (MIN_SIZE <= self.size <= MAX_SIZE) or self.size % 2 == 0:
            raise ValueError(f"size={self.size} must be odd and in [{MIN_SIZE}, {MAX_SIZE}]")
        for key in ("max_turns", "pad_to", "max_moves_per_turn", "max_context_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.pixels_per_cell < 2:
            raise ValueError(f"pixels_per_cell={self.pixels_per_cell} must be >= 2")
        if self.history is not None and self.history < 0:
            raise ValueError(f"history={self.history} must be >= 0 (or null: the whole episode)")
        if self.history is not None and self.max_images_in_context:
            raise ValueError(f"history={self.history} with max_images_in_context={self.max_images_in_context}: "
                             "the history window already bounds the frames; use one of them")
        for key in ("pad_before", "max_images_in_context"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 0")
        if not 0 <= self.wall_gray <= 255:
            raise ValueError(f"wall_gray={self.wall_gray} must be in [0, 255]")
        if self.view not in VIEWS:
            raise ValueError(f"view={self.view!r} is not one of {', '.join(VIEWS)}")
        if self.interface not in INTERFACES:
            raise ValueError(f"interface={self.interface!r} is not one of {', '.join(INTERFACES)}")

    def turns_for(self, size: int) -> int:
        """Turn budget for a maze of ``size``: max_turns, scaled up by area for mazes larger than ``self.size``."""
        return turn_budget(size, self.max_turns, self.size)


# ---------------------------------------------------------------- actions
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


# ---------------------------------------------------------------- frames
@dataclass(frozen=True)
class Palette:
    floor: tuple[int, int, int] = (255, 255, 255)
    wall: tuple[int, int, int] = (169, 169, 169)
    goal: tuple[int, int, int] = (255, 0, 0)
    agent: tuple[int, int, int] = (0, 0, 255)
    grid: tuple[int, int, int] = (200, 200, 200)
    path: tuple[int, int, int] = (255, 140, 0)


DEFAULT_PALETTE = Palette()


def egocentric_offset(size: int, ppc: int, pad_to: int, pad_before: int) -> int:
    """Wall px before an egocentric window: the agent's cell then starts ``pad_before`` px into its ``pad_to``
    block for every maze size (the centre cell starts at (size-1)*ppc in the window)."""
    if pad_to <= 1:
        return int(pad_before)
    return (int(pad_before) - (size - 1) * ppc) % pad_to


def frame_side(size: int, ppc: int, pad_to: int, pad_before: int, view: str) -> tuple[int, int]:
    """(offset, side) of a frame: px of wall before the maze window, and the padded image side."""
    window = (2 * size - 1 if view == "egocentric" else size) * ppc
    offset = egocentric_offset(size, ppc, pad_to, pad_before) if view == "egocentric" else int(pad_before)
    side = window + offset
    return offset, side + (-side % pad_to if pad_to > 1 else 0)


def agent_token(size: int, ppc: int, pad_to: int, pad_before: int, token_px: int = 32) -> int:
    """The index of the merged image token that holds the agent's cell in an egocentric frame of a ``size`` maze,
    among the frame's tokens in row-major order (``token_px``: patch 16 x merge 2); the same at every position,
    since the window moves with the agent. ``pad_to`` must be a multiple of ``token_px``."""
    if pad_to % token_px:
        raise ValueError(f"pad_to={pad_to} is not a multiple of the {token_px} px image token")
    offset, side = frame_side(size, ppc, pad_to, pad_before, "egocentric")
    at = (size - 1) * ppc + offset  # the agent cell's first px, on both axes
    return (at // token_px) * (side // token_px) + at // token_px


def _disc_mask(ppc: int, radius_frac: float = 0.38) -> np.ndarray:
    """(ppc, ppc) bool mask of a disc centred in the cell."""
    centre = (ppc - 1) / 2.0
    yy, xx = np.mgrid[0:ppc, 0:ppc]
    return (yy - centre) ** 2 + (xx - centre) ** 2 <= (radius_frac * ppc) ** 2


class MazeRenderer:
    """Renders one maze at ``pixels_per_cell``; reuse it across the steps of an episode."""

    def __init__(self, maze: Maze, pixels_per_cell: int, grid_lines: bool = False,
                 palette: Palette = DEFAULT_PALETTE, pad_to: int = 1, pad_before: int = 0, view: str = "global"):
        if pixels_per_cell < 2:
            raise ValueError(f"pixels_per_cell must be >= 2, got {pixels_per_cell}")
        if view not in VIEWS:
            raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {view!r}")
        self.maze, self.ppc, self.palette, self.view = maze, int(pixels_per_cell), palette, view
        colours = np.array([palette.floor, palette.wall], dtype=np.uint8)
        cells = colours[maze.grid]  # (N, N, 3)
        cells[maze.goal] = palette.goal
        # (N, N, 3) -> (N*ppc, N*ppc, 3) by block repetition
        board = np.ascontiguousarray(np.repeat(np.repeat(cells, self.ppc, axis=0), self.ppc, axis=1))
        if grid_lines:
            board[:: self.ppc, :] = palette.grid
            board[:, :: self.ppc] = palette.grid
        wall = np.array(palette.wall, dtype=np.uint8)
        n, ppc = maze.size, self.ppc
        if view == "egocentric":
            # the board on a wall canvas of 3N-2 cells; a frame is the (2N-1)-cell window centred on the agent,
            # so the whole maze is always in view and the agent always sits in the middle cell
            self._board = np.empty(((3 * n - 2) * ppc,) * 2 + (3,), dtype=np.uint8)
            self._board[:] = wall
            self._board[(n - 1) * ppc:(2 * n - 1) * ppc, (n - 1) * ppc:(2 * n - 1) * ppc] = board
            window = (2 * n - 1) * ppc
        else:
            self._board, window = board, n * ppc
        self._window = window
        # ``pad_before`` px of wall on the top/left shift the grid against the vision patches; then wall on the
        # bottom/right makes the side a multiple of ``pad_to`` (patch alignment)
        self.offset, side = frame_side(n, ppc, pad_to, pad_before, view)
        self.background = np.empty((side, side, 3), dtype=np.uint8)
        self.background[:] = wall
        self._place(self.background, maze.start)
        self._disc = _disc_mask(self.ppc)
        self._agent = np.array(palette.agent, dtype=np.uint8)

    def _place(self, img: np.ndarray, agent: tuple[int, int] | None) -> tuple[int, int]:
        """Copy the board (the agent's window of it, egocentric) into ``img``; return the agent's pixel origin."""
        o, w = self.offset, self._window
        if self.view == "egocentric":
            r, c = agent if agent is not None else self.maze.start
            img[o:o + w, o:o + w] = self._board[r * self.ppc:r * self.ppc + w, c * self.ppc:c * self.ppc + w]
            centre = (self.maze.size - 1) * self.ppc + o
            return centre, centre
        img[o:o + w, o:o + w] = self._board
        return (0, 0)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.background.shape

    def frame(self, agent: tuple[int, int] | None) -> np.ndarray:
        """(H, W, 3) uint8 image with the agent disc at ``agent`` (row, col); None draws no agent."""
        img = self.background.copy()
        if self.view == "egocentric":
            r0, c0 = self._place(img, agent)  # the window moves with the agent
        elif agent is not None:
            r0, c0 = agent[0] * self.ppc + self.offset, agent[1] * self.ppc + self.offset
        if agent is not None:
            img[r0:r0 + self.ppc, c0:c0 + self.ppc][self._disc] = self._agent
        return img


def render(maze: Maze, agent: tuple[int, int] | None = None, pixels_per_cell: int = 25,
           grid_lines: bool = False) -> Image.Image:
    """One-off render to a PIL RGB image (agent defaults to the start cell)."""
    renderer = MazeRenderer(maze, pixels_per_cell, grid_lines)
    return Image.fromarray(renderer.frame(maze.start if agent is None else agent))


def render_path(maze: Maze, path: list[tuple[int, int]], pixels_per_cell: int = 25,
                grid_lines: bool = True, title: str | None = None) -> Image.Image:
    """Report figure: the maze with ``path`` drawn as a polyline and the agent at its end.

    Revisited segments are drawn over each other, so loops show up as thicker tangles.
    """
    renderer = MazeRenderer(maze, pixels_per_cell, grid_lines)
    img = Image.fromarray(renderer.frame(path[-1] if path else maze.start))
    draw = ImageDraw.Draw(img)
    ppc = renderer.ppc
    centres = [(c * ppc + ppc // 2, r * ppc + ppc // 2) for r, c in path]
    if len(centres) > 1:
        draw.line(centres, fill=DEFAULT_PALETTE.path, width=max(2, ppc // 6), joint="curve")
    if centres:
        x, y = centres[0]
        draw.rectangle([x - ppc // 6, y - ppc // 6, x + ppc // 6, y + ppc // 6], fill=(0, 160, 0))
    if title:
        draw.text((2, 2), title, fill=(0, 0, 0))
    return img


# ---------------------------------------------------------------- the environment
class MazeEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, settings: EnvSettings | None = None, *, generator: str = "wilson", braid: float = 0.0,
                 placement: str = "corners4", render_mode: str | None = "rgb_array", turn_limit: int | None = None,
                 **overrides):
        """``settings`` (default ``EnvSettings()``) with any of its fields overridden by keyword:
        ``MazeEnv(size=11, view="global")``. ``generator``, ``braid`` and ``placement`` draw the mazes ``reset``
        makes when it is not handed one; ``turn_limit`` fixes the budget of every episode (else
        ``settings.turns_for(maze size)``)."""
        self.settings = s = replace(settings if settings is not None else EnvSettings(), **overrides)
        s.check()
        if turn_limit is not None and turn_limit < 1:
            raise ValueError(f"turn_limit must be >= 1, got {turn_limit}")
        self.size, self.generator, self.braid, self.placement = s.size, generator, braid, placement
        self.palette = Palette(wall=(int(s.wall_gray),) * 3)
        self.turn_limit, self.render_mode = turn_limit, render_mode
        self.interface, self.require_stop, self.max_moves_per_turn = s.interface, s.require_stop, s.max_moves_per_turn
        self.action_space = spaces.Text(max_length=MAX_TEXT, charset=string.printable)
        self._set_observation_space(s.size)
        self.maze: Maze | None = None

    def _set_observation_space(self, size: int) -> None:
        self._space_size = size
        st = self.settings
        _, side = frame_side(size, st.pixels_per_cell, st.pad_to, st.pad_before, st.view)
        self.observation_space = spaces.Dict({
            "image": spaces.Box(0, 255, (side, side, 3), np.uint8),
            "text": spaces.Text(max_length=MAX_TEXT, charset=string.printable),
        })

    @property
    def max_turns(self) -> int:
        """The episode's turn budget: ``turn_limit``, or ``settings.max_turns`` scaled to the maze's size."""
        if self.turn_limit is not None:
            return self.turn_limit
        return self.settings.turns_for(self.maze.size if self.maze is not None else self.size)

    @property
    def fewest_turns(self) -> int:
        """The fewest turns that solve this episode: the BFS path's moves, ``max_moves_per_turn`` a turn, plus the
        final ``stop`` with ``require_stop``. An episode whose ``fewest_turns`` exceeds ``max_turns`` cannot be
        solved by any policy (a suite's ceiling, ``rl.evaluation``: the reference's 64 mazes all fit their 20 turns;
        other suites hold a few whose shortest path needs 20 moves or more)."""
        return fewest_turns(int(self._to_goal[self.maze.start]), self.max_moves_per_turn, self.require_stop)

    @property
    def system_prompt(self) -> str:
        """The conversation's system message (the reference's names the maze size)."""
        if self.interface == "reference":
            size = self.maze.size if self.maze is not None else self.size
            return REFERENCE_SYSTEM_PROMPT.format(size=size)
        return SYSTEM_PROMPT

    @property
    def task_prompt(self) -> str:
        if self.interface == "reference":
            return REFERENCE_TASK_PROMPT.format(steps=self.max_turns)
        hint = MULTI_MOVE_HINT.format(k=self.max_moves_per_turn) if self.max_moves_per_turn > 1 else ""
        return TASK_PROMPT + hint

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        maze = options.get("maze")
        if maze is None:
            if seed is None:
                seed = int(self.np_random.integers(2**31))
            maze = generate_maze(self.size, seed, self.generator, self.braid, self.placement)
        if maze.size != self._space_size:
            self._set_observation_space(maze.size)
        self.maze = maze
        st = self.settings
        self._renderer = MazeRenderer(maze, st.pixels_per_cell, st.grid_lines, self.palette, pad_to=st.pad_to,
                                      pad_before=st.pad_before, view=st.view)
        self._to_goal = distances_from(maze.grid, maze.goal)  # (N, N) int32
        self.position = maze.start
        self.path = [maze.start]
        self._visited = {maze.start}
        self.turns = self.moves = self.bumps = self.invalid_actions = self.revisits = 0
        self.success = self.stopped_wrong = False
        self.done = False
        return self._obs(self.task_prompt), self._info("reset")

    def step(self, action_text):
        if self.maze is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError("episode is over; call reset()")
        self.turns += 1
        reference = self.interface == "reference"
        parsed = (parse_reference_action(action_text) if reference
                  else parse_action(action_text, self.max_moves_per_turn))
        terminated = False
        if not parsed.valid:
            self.invalid_actions += 1
            event, feedback = "invalid", parsed.error if reference else f"Invalid action: {parsed.error}."
        elif parsed.moves == ("stop",):
            terminated = True
            if self.position == self.maze.goal:
                self.success, event, feedback = True, "stop_goal", "You stopped on the goal. Solved!"
            else:
                self.stopped_wrong, event = True, "stop_wrong"
                feedback = "You stopped, but you are not on the goal. Episode over."
        else:
            event, feedback = self._apply_moves(parsed.moves)
            if not self.require_stop and self.position == self.maze.goal:
                self.success, terminated = True, True
                event, feedback = "arrive_goal", feedback + " You reached the goal. Solved!"
        truncated = not terminated and self.turns >= self.max_turns
        if reference:
            feedback = self._reference_feedback(event, feedback)
        if truncated:
            feedback += " Out of turns."
        self.done = terminated or truncated
        reward = 1.0 if self.success else 0.0
        return self._obs(feedback), reward, terminated, truncated, self._info(event)

    def render(self):
        return self._renderer.frame(self.position)

    # ------------------------------------------------------------------ internals
    def _apply_moves(self, moves: tuple[str, ...]) -> tuple[str, str]:
        done = []
        for move in moves:
            dr, dc = MOVES[move]
            nxt = (self.position[0] + dr, self.position[1] + dc)
            if not self.maze.is_floor(nxt):
                self.bumps += 1
                prefix = f"You moved {', '.join(done)}, then " if done else "You "
                return "bump", prefix + f"hit a wall going {move} and did not move."
            self.position = nxt
            self.moves += 1
            self.path.append(nxt)
            if nxt in self._visited:
                self.revisits += 1
            self._visited.add(nxt)
            done.append(move)
            if not self.require_stop and nxt == self.maze.goal:
                break
        return "move", f"You moved {', '.join(done)}."

    def _reference_feedback(self, event: str, feedback: str) -> str:
        """The reference's feedback line for ``event``, then how many steps remain."""
        line = {"move": REFERENCE_MOVED, "bump": REFERENCE_BUMP, "stop_goal": REFERENCE_MOVED,
                "stop_wrong": REFERENCE_MOVED, "arrive_goal": REFERENCE_MOVED}.get(event, feedback)
        left = self.max_turns - self.turns
        return f"{line} {left} step{'s' if left != 1 else ''} remaining."

    def _obs(self, text: str) -> dict:
        return {"image": self._renderer.frame(self.position), "text": text}

    def _info(self, event: str) -> dict:
        return {
            "event": event,
            "position": self.position,
            "turns": self.turns,
            "moves": self.moves,
            "bumps": self.bumps,
            "invalid_actions": self.invalid_actions,
            "revisits": self.revisits,
            "visited_cells": len(self._visited),
            "optimal_steps": int(self._to_goal[self.maze.start]),
            "fewest_turns": self.fewest_turns,
            "turn_budget": self.max_turns,
            "distance_to_goal": int(self._to_goal[self.position]),
            "success": self.success,
            "stopped_wrong": self.stopped_wrong,
            "maze_hash": self.maze.content_hash,
        }
