"""Vectorised numpy renderer: maze + agent -> RGB image. No per-pixel Python, no pygame.

The default palette is the reference environment's: white floor, gray (169,169,169) walls, a
red goal square and a blue agent disc. A static background (walls, floor, goal, optional grid
lines) is drawn once per maze; each frame copies it and stamps the agent disc, so a step costs
one memcpy of the image plus a (ppc, ppc) patch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from maze.core import Maze


@dataclass(frozen=True)
class Palette:
    floor: tuple[int, int, int] = (255, 255, 255)
    wall: tuple[int, int, int] = (169, 169, 169)
    goal: tuple[int, int, int] = (255, 0, 0)
    agent: tuple[int, int, int] = (0, 0, 255)
    grid: tuple[int, int, int] = (200, 200, 200)
    path: tuple[int, int, int] = (255, 140, 0)


DEFAULT_PALETTE = Palette()
VIEWS = ("global", "egocentric")  # global: the maze as is; egocentric: centred on the agent


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


def _disc_mask(ppc: int, radius_frac: float = 0.38) -> np.ndarray:
    """(ppc, ppc) bool mask of a disc centred in the cell."""
    centre = (ppc - 1) / 2.0
    yy, xx = np.mgrid[0:ppc, 0:ppc]
    return (yy - centre) ** 2 + (xx - centre) ** 2 <= (radius_frac * ppc) ** 2


class MazeRenderer:
    """Renders one maze at ``pixels_per_cell``; reuse it across the steps of an episode."""

    def __init__(self, maze: Maze, pixels_per_cell: int = 25, grid_lines: bool = False,
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
