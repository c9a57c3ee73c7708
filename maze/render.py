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


def _disc_mask(ppc: int, radius_frac: float = 0.38) -> np.ndarray:
    """(ppc, ppc) bool mask of a disc centred in the cell."""
    centre = (ppc - 1) / 2.0
    yy, xx = np.mgrid[0:ppc, 0:ppc]
    return (yy - centre) ** 2 + (xx - centre) ** 2 <= (radius_frac * ppc) ** 2


class MazeRenderer:
    """Renders one maze at ``pixels_per_cell``; reuse it across the steps of an episode."""

    def __init__(self, maze: Maze, pixels_per_cell: int = 25, grid_lines: bool = False,
                 palette: Palette = DEFAULT_PALETTE, pad_to: int = 1, pad_before: int = 0):
        if pixels_per_cell < 2:
            raise ValueError(f"pixels_per_cell must be >= 2, got {pixels_per_cell}")
        self.maze, self.ppc, self.palette = maze, int(pixels_per_cell), palette
        colours = np.array([palette.floor, palette.wall], dtype=np.uint8)
        cells = colours[maze.grid]  # (N, N, 3)
        cells[maze.goal] = palette.goal
        # (N, N, 3) -> (N*ppc, N*ppc, 3) by block repetition
        self.background = np.ascontiguousarray(
            np.repeat(np.repeat(cells, self.ppc, axis=0), self.ppc, axis=1))
        if grid_lines:
            self.background[:: self.ppc, :] = palette.grid
            self.background[:, :: self.ppc] = palette.grid
        # ``pad_before`` px of wall on the top/left shift the grid against the vision patches; then wall on the
        # bottom/right makes the side a multiple of ``pad_to`` (patch alignment)
        self.offset = int(pad_before)
        side = self.background.shape[0] + self.offset
        extra = -side % pad_to if pad_to > 1 else 0
        if self.offset or extra:
            wall = np.array(palette.wall, dtype=np.uint8)
            framed = np.empty((side + extra, side + extra, 3), dtype=np.uint8)
            framed[:] = wall
            framed[self.offset:side, self.offset:side] = self.background
            self.background = framed
        self._disc = _disc_mask(self.ppc)
        self._agent = np.array(palette.agent, dtype=np.uint8)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.background.shape

    def frame(self, agent: tuple[int, int] | None) -> np.ndarray:
        """(H, W, 3) uint8 image with the agent disc at ``agent`` (row, col); None draws no agent."""
        img = self.background.copy()
        if agent is not None:
            r0, c0 = agent[0] * self.ppc + self.offset, agent[1] * self.ppc + self.offset
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
