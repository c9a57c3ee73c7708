"""The maze environment: generators, BFS, renderer, parser, episodes, frozen sets, sampler."""

import itertools
from collections import deque
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import maze
from maze.core import MOVES, Maze, distances_from, generate_maze, optimal_steps, shortest_path
from maze.env import DEFAULT_PALETTE, MazeRenderer, parse_action

SIZES = st.sampled_from([5, 7, 9, 11, 15, 21, 31])


def floor_cells(m: Maze):
    return [(r, c) for r in range(m.size) for c in range(m.size) if m.grid[r, c] == 0]


def floor_edges(m: Maze):
    cells = set(floor_cells(m))
    return {frozenset((a, (a[0] + dr, a[1] + dc))) for a in cells for dr, dc in MOVES.values()
            if (a[0] + dr, a[1] + dc) in cells}


# ---------------------------------------------------------------- generators
@settings(max_examples=60, deadline=None)
@given(size=SIZES, seed=st.integers(0, 2**31 - 1), generator=st.sampled_from(maze.GENERATORS))
def test_generated_maze_is_perfect(size, seed, generator):
    m = generate_maze(size, seed, generator)
    cells = floor_cells(m)
    assert m.grid[0].all() and m.grid[-1].all() and m.grid[:, 0].all() and m.grid[:, -1].all()
    dist = distances_from(m.grid, m.start)
    assert all(dist[c] >= 0 for c in cells), "floor must be connected"
    assert len(floor_edges(m)) == len(cells) - 1, "a connected graph with V-1 edges is a tree"
    assert m.start == (1, 1) and m.goal == (size - 2, size - 2)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), braid=st.floats(0.3, 1.0))
def test_braided_maze_has_loops_and_fewer_dead_ends(seed, braid):
    perfect = generate_maze(11, seed, "wilson")
    braided = generate_maze(11, seed, "wilson", braid=braid)

    def dead_ends(m):
        return sum(1 for c in floor_cells(m)
                   if sum(m.is_floor((c[0] + dr, c[1] + dc)) for dr, dc in MOVES.values()) == 1)

    assert len(floor_edges(braided)) > len(floor_cells(braided)) - 1
    assert dead_ends(braided) < dead_ends(perfect)
    assert (distances_from(braided.grid, braided.start)[braided.goal]) > 0


def test_same_seed_same_maze_and_image_and_different_seeds_differ():
    a, b = generate_maze(9, 5, "prim"), generate_maze(9, 5, "prim")
    assert a == b and a.content_hash == b.content_hash
    assert np.array_equal(np.asarray(maze.render(a)), np.asarray(maze.render(b)))
    assert len({generate_maze(9, s).content_hash for s in range(20)}) == 20


def test_random_placement_respects_min_distance():
    for seed in range(20):
        m = generate_maze(11, seed, placement="random", min_distance=10)
        assert optimal_steps(m) >= 10 and m.start != m.goal


@pytest.mark.parametrize("bad", [dict(size=8), dict(size=3), dict(size=33), dict(generator="dfs"),
                                 dict(placement="middle"), dict(braid=1.5)])
def test_generator_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        generate_maze(**{"size": 9, "seed": 0, **bad})


# ---------------------------------------------------------------- BFS
def brute_force_shortest(m: Maze) -> int:
    """Iterative deepening over all move sequences: independent of the BFS code."""
    for depth in range(0, 4 * m.size * m.size):
        frontier = {m.start}
        for _ in range(depth):
            frontier = {(r + dr, c + dc) for r, c in frontier for dr, dc in MOVES.values()
                        if m.is_floor((r + dr, c + dc))}
        if m.goal in frontier:
            return depth
    return -1


@pytest.mark.parametrize("seed,generator,braid",
                         list(itertools.product(range(6), maze.GENERATORS, [0.0, 1.0])))
def test_bfs_is_optimal_against_brute_force(seed, generator, braid):
    m = generate_maze(7, seed, generator, braid=braid)
    assert optimal_steps(m) == brute_force_shortest(m)
    path = shortest_path(m)
    assert path[0] == m.start and path[-1] == m.goal and len(path) - 1 == optimal_steps(m)
    assert all(abs(a[0] - b[0]) + abs(a[1] - b[1]) == 1 and m.is_floor(b) for a, b in zip(path, path[1:]))


def test_expert_actions_solve_the_env():
    for seed in range(10):
        env = maze.MazeEnv(size=11, max_turns=30)  # maze_hard's budget
        env.reset(seed=seed)
        for a in maze.expert_actions(env.maze):
            env.step(f"<action>{a}</action>")
        _, reward, terminated, _, info = env.step("<action>stop</action>")
        assert reward == 1.0 and terminated and info["moves"] == info["optimal_steps"]
        assert info["bumps"] == info["invalid_actions"] == info["revisits"] == 0


# ---------------------------------------------------------------- renderer
@pytest.mark.parametrize("ppc,grid_lines", [(25, False), (8, True), (32, False)])
def test_renderer_pixels_at_cell_centres_match_grid(ppc, grid_lines):
    m = generate_maze(9, 3)
    agent = (3, 5) if m.grid[3, 5] == 0 else m.start
    img = MazeRenderer(m, ppc, grid_lines).frame(agent)
    assert img.shape == (9 * ppc, 9 * ppc, 3) and img.dtype == np.uint8
    half = ppc // 2
    for r in range(9):
        for c in range(9):
            px = tuple(img[r * ppc + half, c * ppc + half])
            if (r, c) == agent:
                want = DEFAULT_PALETTE.agent
            elif (r, c) == m.goal:
                want = DEFAULT_PALETTE.goal
            else:
                want = DEFAULT_PALETTE.wall if m.grid[r, c] else DEFAULT_PALETTE.floor
            assert px == want, (r, c)
    # the agent is a disc: its cell's corner keeps the floor colour
    assert tuple(img[agent[0] * ppc + 1, agent[1] * ppc + 1]) in (DEFAULT_PALETTE.floor, DEFAULT_PALETTE.grid)


def test_render_path_draws_the_path():
    m = generate_maze(9, 1)
    plain = np.asarray(maze.render(m, pixels_per_cell=20, grid_lines=True))
    drawn = np.asarray(maze.render_path(m, shortest_path(m), pixels_per_cell=20))
    path_colour = np.all(drawn == DEFAULT_PALETTE.path, axis=-1)
    assert path_colour.sum() > 100 and not np.all(plain == DEFAULT_PALETTE.path, axis=-1).any()


# ---------------------------------------------------------------- parser
@pytest.mark.parametrize("text,moves", [
    ("<action>up</action>", ("up",)),
    ("I think... <action>LEFT</action>", ("left",)),
    ("<action>up</action> no wait <action> Down. </action>", ("down",)),
    ("<Action>north</ACTION>", ("up",)),
    ("<action>→</action>", ("right",)),
    ("<action>s</action>", ("down",)),
    ("<action><action>west</action></action>", ("left",)),
    ("<action>stop</action>", ("stop",)),
])
def test_parser_reads_last_tag_and_synonyms(text, moves):
    assert parse_action(text).moves == moves


@pytest.mark.parametrize("text", ["", "up", "<action></action>", "<action>jump</action>",
                                  "<action>up</action", "</action><action>", "<action>up up</action>",
                                  "<action>" + "u" * 10_000 + "</action>", "<action>up, stop</action>"])
def test_parser_reports_invalid(text):
    parsed = parse_action(text)
    assert not parsed.valid and parsed.moves == () and parsed.error


def test_parser_multi_move():
    assert parse_action("<action>up, up, left</action>", max_moves=3).moves == ("up", "up", "left")
    assert not parse_action("<action>up, up, left</action>", max_moves=2).valid


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.binary(), st.text(alphabet="<>/actionupdwlfrgs ,", max_size=200)))
def test_parser_never_raises(text):
    parsed = parse_action(text, max_moves=3)
    assert parsed.valid == (parsed.error is None)


def test_parser_handles_megabytes_quickly():
    blob = ("<action>" * 100_000) + "x" * 3_000_000 + "<action>right</action>"
    assert parse_action(blob).moves == ("right",)


# ---------------------------------------------------------------- episodes
def corridor_maze() -> Maze:
    return Maze.from_rows(["#####", "#S..#", "###.#", "#G..#", "#####"])


def test_episode_bump_invalid_stop_and_info():
    env = maze.MazeEnv(size=5, max_turns=20)
    obs, info = env.reset(options={"maze": corridor_maze()})
    assert obs["text"] == env.task_prompt and info["optimal_steps"] == 6
    obs, r, term, trunc, info = env.step("<action>up</action>")
    assert info["event"] == "bump" and info["bumps"] == 1 and info["position"] == (1, 1)
    assert "wall" in obs["text"] and not term and not trunc
    obs, r, term, trunc, info = env.step("no tag at all")
    assert info["event"] == "invalid" and info["invalid_actions"] == 1 and "Invalid" in obs["text"]
    env.step("<action>right</action>")
    env.step("<action>left</action>")
    _, _, _, _, info = env.step("<action>right</action>")
    assert info["revisits"] == 2 and info["visited_cells"] == 2 and info["turns"] == 5
    assert info["distance_to_goal"] == 5
    obs, r, term, trunc, info = env.step("<action>stop</action>")
    assert term and r == 0.0 and info["stopped_wrong"] and not info["success"]
    with pytest.raises(RuntimeError):
        env.step("<action>up</action>")


def test_episode_truncates_at_max_turns():
    env = maze.MazeEnv(size=5, max_turns=3)
    env.reset(options={"maze": corridor_maze()})
    results = [env.step("<action>up</action>") for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True] and not any(r[2] for r in results)
    assert results[-1][4]["bumps"] == 3


def test_arrival_succeeds_without_require_stop_and_multi_move():
    env = maze.MazeEnv(size=5, require_stop=False, max_moves_per_turn=4)
    env.reset(options={"maze": corridor_maze()})
    _, r, term, _, info = env.step("<action>right, right, down, down</action>")
    assert not term and info["position"] == (3, 3)
    _, r, term, _, info = env.step("<action>left, left</action>")
    assert term and r == 1.0 and info["success"] and info["moves"] == 6
    env.reset(options={"maze": corridor_maze()})
    _, _, _, _, info = env.step("<action>right, up, right</action>")
    assert info["event"] == "bump" and info["position"] == (1, 2)


def test_observations_lie_in_observation_space_and_gym_make_works():
    env = gym.make(maze.ENV_ID, size=7, max_turns=5, disable_env_checker=True)
    obs, _ = env.reset(seed=3)
    assert env.observation_space.contains(obs)
    obs, *_ = env.step("<action>down</action>")
    assert env.observation_space.contains(obs)
    obs2, _ = gym.make(maze.ENV_ID, size=7).reset(seed=3)
    assert np.array_equal(obs["image"].shape, obs2["image"].shape)


# ---------------------------------------------------------------- frozen sets and sampler
def test_frozen_suites_load_and_match_hashes_and_generators():
    names = maze.suite_names()
    assert names[:2] == ["fixed64", "select64"] and len(names) >= 10
    for name in names:  # every suite but fixed64 still matches the code that froze it
        if name == "fixed64":
            continue
        for m in maze.load_suite(name).mazes:
            min_distance = 9 if m.placement == "random" else None
            assert m == generate_maze(m.size, m.seed, m.generator, m.braid, m.placement, min_distance)
            assert (m.placement == "random") == (name == "random_placement")
    layouts = [m.layout_hash for s in names for m in maze.load_suite(s).mazes]
    assert len(layouts) == len(set(layouts)), "no layout appears twice across suites"
    with pytest.raises(KeyError, match="unknown eval suite 'nope'"):
        maze.load_suite("nope")


REFERENCE_JSON = Path(__file__).resolve().parents[2] / "shared" / "reference" / "maze2d_easy_seeds0-63.json"


def test_fixed64_is_the_reference_set_with_its_invariants():
    """The invariants ../shared/reference/README.md states for the reference's 64 mazes, on the frozen copy."""
    from collections import Counter

    from maze.env import EnvSettings
    from rl.policies import play

    fixed = maze.load_suite("fixed64").mazes
    assert [m.seed for m in fixed] == list(range(64)) and all(m.size == 9 for m in fixed)
    names = {(1, 1): "TL", (1, 7): "TR", (7, 1): "BL", (7, 7): "BR"}
    pairs = Counter(f"{names[m.start]}->{names[m.goal]}" for m in fixed)
    assert pairs == {"BL->TR": 20, "BR->TL": 17, "TL->BR": 11, "TR->BL": 16}
    assert Counter(maze.optimal_steps(m) for m in fixed) == {12: 50, 16: 14}
    for steps, want in [(10_000, None), (30, 0.609), (20, 0.188)]:
        follower = play("wall_follower", list(fixed), EnvSettings(max_turns=steps))
        if want is None:  # unbounded: it solves all; 27 moves on average, 48 at most
            assert all(t.success for t in follower)
            moves = [t.infos[-1]["moves"] for t in follower]
            assert round(np.mean(moves)) == 27 and max(moves) == 48
        else:
            assert round(np.mean([t.success for t in follower]), 3) == want
    oracle = play("oracle", list(fixed), EnvSettings(max_turns=20))  # 20 steps, the final stop included
    assert all(t.success for t in oracle)


@pytest.mark.skipif(not REFERENCE_JSON.is_file(), reason="../shared/reference is not beside this checkout")
def test_fixed64_equals_the_reference_file_in_seed_order():
    from maze.suites import reference_mazes

    ref = reference_mazes(REFERENCE_JSON)
    fixed = maze.load_suite("fixed64").mazes
    assert [(m.grid.tolist(), m.start, m.goal, m.seed) for m in fixed] == \
        [(m.grid.tolist(), m.start, m.goal, m.seed) for m in ref]


def test_corners4_draws_all_four_reference_corner_pairs():
    from collections import Counter

    drawn = Counter((m.start, m.goal) for m in (generate_maze(9, s, placement="corners4") for s in range(400)))
    assert set(drawn) == {((1, 1), (7, 7)), ((7, 7), (1, 1)), ((7, 1), (1, 7)), ((1, 7), (7, 1))}
    assert min(drawn.values()) > 60
    assert generate_maze(9, 5, placement="corners4") == generate_maze(9, 5, placement="corners4")
    assert (generate_maze(9, 5, placement="corners4").grid == generate_maze(9, 5).grid).all()  # same layout


def test_corrupt_frozen_file_is_detected(tmp_path):
    import json

    from maze.suites import DATA_FILE, _load_file

    raw = json.loads(DATA_FILE.read_text())
    rows = raw["suites"]["fixed64"]["mazes"][0]["rows"]
    rows[1] = rows[1][:2] + ("#" if rows[1][2] == "." else ".") + rows[1][3:]
    bad = tmp_path / "sets.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="corrupt"):
        _load_file(str(bad))


def test_train_sampler_never_yields_an_eval_layout_and_resumes():
    # 7x7 has only 192 perfect-maze layouts and size7 holds 32 of them, so a 7x7 stream draws eval
    # layouts often: the sampler must skip each one whatever its start and goal (four corner pairs).
    excluded = maze.eval_layouts()
    sampler = maze.TrainSampler(sizes=[7], seed=1)
    assert sampler.placement == "corners4"
    drawn = sampler.take(300)
    assert sampler.skipped > 0
    assert not any(m.layout_hash in excluded for m in drawn)
    # the fixed64 layouts with other corner pairs are excluded too (the same grid, another start)
    import dataclasses

    fixed = maze.load_suite("fixed64").mazes[0]
    moved = dataclasses.replace(fixed, start=fixed.goal, goal=fixed.start)
    assert moved.content_hash not in maze.eval_hashes() and moved.layout_hash in excluded
    state = sampler.state_dict()
    more = sampler.take(5)
    again = maze.TrainSampler(sizes=[7], seed=1)
    again.load_state_dict(state)
    assert again.take(5) == more


def test_train_sampler_mixes_sizes_and_fails_clearly_when_exhausted():
    sizes = {m.size for m in maze.TrainSampler(sizes=[7, 9, 11], seed=0).take(30)}
    assert sizes == {7, 9, 11}
    everything = frozenset(generate_maze(5, s).layout_hash for s in range(200))
    with pytest.raises(RuntimeError, match="too few distinct layouts"):
        maze.TrainSampler(sizes=[5], exclude=everything, max_skips=50).take(1)


def test_bfs_distances_match_a_reference_bfs():
    m = generate_maze(15, 11, braid=0.5)
    ref = {m.start: 0}
    q = deque([m.start])
    while q:
        r, c = q.popleft()
        for dr, dc in MOVES.values():
            n = (r + dr, c + dc)
            if m.is_floor(n) and n not in ref:
                ref[n] = ref[(r, c)] + 1
                q.append(n)
    dist = distances_from(m.grid, m.start)
    assert all(dist[p] == d for p, d in ref.items()) and (dist >= 0).sum() == len(ref)


def test_pad_to_aligns_cells_with_patches_and_pads_with_wall():
    from maze.env import DEFAULT_PALETTE, MazeRenderer

    m = maze.generate_maze(9, seed=4)
    plain = MazeRenderer(m, 16).frame(m.start)
    padded = MazeRenderer(m, 16, pad_to=32).frame(m.start)
    assert plain.shape == (144, 144, 3) and padded.shape == (160, 160, 3)
    assert (padded[:144, :144] == plain).all()  # cells keep their pixels: cell (r, c) is patch (r, c)
    assert (padded[144:] == DEFAULT_PALETTE.wall).all() and (padded[:, 144:] == DEFAULT_PALETTE.wall).all()
    env = maze.MazeEnv(size=9, view="global", pixels_per_cell=16, pad_to=32, pad_before=0)
    obs, _ = env.reset(seed=1)
    assert obs["image"].shape == env.observation_space["image"].shape == (160, 160, 3)
    assert env.observation_space.contains(obs)


def test_pad_before_centres_every_room_cell_in_one_merged_token():
    """At 16 px/cell with 32 px merged tokens, 24 px of wall before the maze puts each room cell (odd row and
    column) in the middle of one token, which then shows the room and the inner half of its four neighbours."""
    from maze.env import DEFAULT_PALETTE, MazeRenderer

    m = maze.generate_maze(9, seed=4)
    plain = MazeRenderer(m, 16).frame(m.start)
    framed = MazeRenderer(m, 16, pad_to=32, pad_before=24).frame(m.start)
    assert framed.shape == (192, 192, 3)
    assert (framed[24:168, 24:168] == plain).all()
    assert (framed[:24] == DEFAULT_PALETTE.wall).all() and (framed[:, :24] == DEFAULT_PALETTE.wall).all()
    for r in range(1, 9, 2):
        for c in range(1, 9, 2):
            tr, tc = (24 + 16 * r) // 32, (24 + 16 * c) // 32
            token = framed[32 * tr:32 * tr + 32, 32 * tc:32 * tc + 32]
            assert (token[8:24, 8:24] == plain[16 * r:16 * r + 16, 16 * c:16 * c + 16]).all()  # the room
            halves = {(-1, 0): (slice(0, 8), slice(8, 24)), (1, 0): (slice(24, 32), slice(8, 24)),
                      (0, -1): (slice(8, 24), slice(0, 8)), (0, 1): (slice(8, 24), slice(24, 32))}
            for (dr, dc), (rows, cols) in halves.items():
                expected = DEFAULT_PALETTE.wall if not m.is_floor((r + dr, c + dc)) else None
                if expected is not None:
                    assert (token[rows, cols] == expected).all()
                else:
                    assert not (token[rows, cols] == DEFAULT_PALETTE.wall).all(axis=-1).any()
    env = maze.MazeEnv(size=9, view="global", pixels_per_cell=16, pad_to=32, pad_before=24)
    obs, _ = env.reset(seed=1)
    assert obs["image"].shape == env.observation_space["image"].shape == (192, 192, 3)
    assert env.observation_space.contains(obs)


def test_wall_gray_sets_the_wall_colour_and_is_validated():
    m = maze.generate_maze(9, seed=4)
    env = maze.MazeEnv(size=9, view="global", pixels_per_cell=16, pad_to=32, pad_before=0, wall_gray=64)
    obs, _ = env.reset(options={"maze": m})
    img = obs["image"]
    assert (img[0, 0] == 64).all() and (img[-1, -1] == 64).all()  # outer wall and the padding
    assert (img[16 * 1 + 8, 16 * 1 + 8] == (0, 0, 255)).all()  # the agent on its start cell (1, 1)
    with pytest.raises(ValueError, match="wall_gray"):
        maze.MazeEnv(wall_gray=300)


@pytest.mark.parametrize("seed", [0, 5])
def test_egocentric_view_keeps_the_agent_centred_and_the_whole_maze_in_view(seed):
    """Each egocentric frame is the global board shifted so the agent sits in the centre cell; every cell of the
    maze stays in the window, and what lies outside the maze is wall."""
    m = maze.generate_maze(9, seed=seed)
    ppc, n, pad = 8, 9, 8
    glob = MazeRenderer(m, ppc)
    ego = MazeRenderer(m, ppc, pad_to=32, pad_before=pad, view="egocentric")
    assert ego.shape == (160, 160, 3)  # (2N-1) * 8 + 8 = 144 -> 160
    centre = pad + (n - 1) * ppc
    rng = np.random.default_rng(seed)
    cells = floor_cells(m)
    for k in rng.choice(len(cells), 6, replace=False):
        r, c = cells[k]
        img, board = ego.frame((r, c)), glob.frame((r, c))
        # the maze, moved so that cell (r, c) lands on the centre cell
        top, left = centre - r * ppc, centre - c * ppc
        assert (img[top:top + n * ppc, left:left + n * ppc] == board).all()
        outside = np.ones(img.shape[:2], bool)
        outside[top:top + n * ppc, left:left + n * ppc] = False
        assert (img[outside] == DEFAULT_PALETTE.wall).all()
        # the agent disc is in the centre cell; its four neighbours are where the grid says
        assert (img[centre + ppc // 2, centre + ppc // 2] == DEFAULT_PALETTE.agent).all()
        for dr, dc in MOVES.values():
            px = img[centre + dr * ppc + ppc // 2, centre + dc * ppc + ppc // 2]
            wall = m.grid[r + dr, c + dc] == 1
            assert (px == DEFAULT_PALETTE.wall).all() == wall
    env = maze.MazeEnv(size=9, pixels_per_cell=8, pad_to=32, pad_before=8, view="egocentric", wall_gray=169)
    obs, _ = env.reset(options={"maze": m})
    assert obs["image"].shape == env.observation_space["image"].shape == (160, 160, 3)
    assert (obs["image"] == ego.frame(m.start)).all()
    with pytest.raises(ValueError, match="view"):
        maze.MazeEnv(view="top_down")


@pytest.mark.parametrize("size", [5, 7, 11, 15])
def test_egocentric_agent_sits_at_the_same_place_in_its_token_for_every_size(size):
    m = maze.generate_maze(size, seed=1)
    img = MazeRenderer(m, 8, pad_to=32, pad_before=8, view="egocentric").frame(m.start)
    assert img.shape[0] % 32 == 0 and img.shape[0] >= (2 * size - 1) * 8
    blue = np.argwhere((img == DEFAULT_PALETTE.agent).all(-1))
    top, left = blue.min(0)
    assert (top - 1) % 32 // 8 == 1 and (left - 1) % 32 // 8 == 1  # the disc lies in the second 8 px cell
    env = maze.MazeEnv(size=size, pixels_per_cell=8, pad_to=32, pad_before=8, view="egocentric")
    obs, _ = env.reset(options={"maze": m})
    assert obs["image"].shape == env.observation_space["image"].shape == img.shape


# ---------------------------------------------------------------- the reference's interface
def reference_env(**kw):
    return maze.MazeEnv(size=9, interface="reference", max_turns=20, **{**maze.REFERENCE_VIEW, **kw})


def test_reference_interface_reads_tuple_actions_bare_and_tagged():
    from maze.env import format_action, parse_reference_action

    assert parse_reference_action("('move', 1)").moves == ("up",)
    assert parse_reference_action("I go left. <action>('move', 2)</action>").moves == ("left",)
    assert parse_reference_action("`('move', 0)`").moves == ("right",)
    assert parse_reference_action("<action>('stop', 'stop')</action>").moves == ("stop",)
    assert parse_reference_action("('stop','stop')").moves == ("stop",)
    for bad, why in [("('move', 4)", "not in the valid action space of move"),
                     ("('move', True)", "not in the valid action space of move"),
                     ("('jump', 1)", "'jump' is not recognized"),
                     ("('move', 1, 2)", "tuple of two elements"),
                     ("up", "Cannot parse action string"),
                     ("<action>up</action>", "Cannot parse action string"),
                     ("(" * 5000, "longer than")]:
        parsed = parse_reference_action(bad)
        assert not parsed.valid and why in parsed.error, (bad, parsed.error)
    for move in ["up", "down", "left", "right", "stop"]:
        assert parse_reference_action(format_action(move, "reference")).moves == (move,)


def test_reference_interface_episode_feedback_and_remaining_steps():
    m = maze.load_suite("fixed64").mazes[3]  # TL -> BR
    env = reference_env()
    obs, _ = env.reset(options={"maze": m})
    assert "9x9 maze" in env.system_prompt and "('move', direction)" in env.system_prompt
    assert "0=right, 1=up, 2=left, 3=down" in env.system_prompt and "('stop', 'stop')" in env.system_prompt
    assert "20 steps" in obs["text"]
    assert obs["image"].shape == (225, 225, 3)  # 25 px cells, not padded
    assert tuple(obs["image"][12, 12]) == (169, 169, 169) and tuple(obs["image"][37, 37]) == (0, 0, 255)
    obs, _, _, _, info = env.step("('move', 1)")  # up from (1, 1): a wall
    assert obs["text"] == "Cannot move into a wall. 19 steps remaining." and info["bumps"] == 1
    obs, _, _, _, info = env.step("<action>('move', 0)</action>")
    assert obs["text"] == "Action executed successfully. 18 steps remaining." and info["position"] == (1, 2)
    obs, _, _, _, info = env.step("<action>move right</action>")
    assert obs["text"].startswith("Cannot parse action string") and obs["text"].endswith("17 steps remaining.")
    assert info["invalid_actions"] == 1
    _, reward, terminated, _, info = env.step("('stop', 'stop')")  # not on the goal
    assert terminated and reward == 0.0 and info["stopped_wrong"]


def test_reference_interface_oracle_solves_fixed64_in_20_steps():
    from maze.env import EnvSettings
    from rl.policies import play

    trajs = play("oracle", list(maze.load_suite("fixed64").mazes), EnvSettings(max_turns=20, interface="reference"))
    assert all(t.success for t in trajs)
    assert trajs[0].actions[-1] == "<action>('stop', 'stop')</action>"
    assert all(a.startswith("<action>('move', ") for a in trajs[0].actions[:-1])


def test_train_mix_draws_its_kinds_by_weight_and_never_an_eval_layout():
    from maze.sampler import MixItem

    mix = [MixItem(7), MixItem(11, "prim", placement="random"), MixItem(9, "kruskal", braid=0.5, weight=3)]
    drawn = maze.TrainSampler(mix=mix, seed=3).take(400)
    kinds = [(m.size, m.generator, m.braid, m.placement) for m in drawn]
    counts = {k: kinds.count(k) for k in set(kinds)}
    assert set(counts) == {(7, "wilson", 0.0, "corners4"), (11, "prim", 0.0, "random"), (9, "kruskal", 0.5, "corners4")}
    assert 0.5 < counts[(9, "kruskal", 0.5, "corners4")] / 400 < 0.7  # weight 3 of 5
    assert not any(m.layout_hash in maze.eval_layouts() for m in drawn)


def test_size_curriculum_unlocks_sizes_smallest_first():
    from maze.sampler import MixItem

    s = maze.TrainSampler(mix=[MixItem(7), MixItem(11), MixItem(15)], curriculum="size")
    s.set_progress(0.0)
    assert {m.size for m in s.take(40)} == {7}
    s.set_progress(0.5)
    assert {m.size for m in s.take(60)} == {7, 11}
    s.set_progress(1.0)
    assert {m.size for m in s.take(60)} == {7, 11, 15}


def test_reverse_curriculum_starts_on_the_shortest_path_moving_out_from_the_goal():
    from maze.core import optimal_steps, shortest_path

    s = maze.TrainSampler(curriculum="reverse", seed=4)
    full = maze.TrainSampler(seed=4).take(12)
    s.set_progress(0.0)
    near = s.take(12)
    assert [optimal_steps(m) for m in near] == [2] * 12
    for moved, real in zip(near, full):
        assert moved.layout_hash == real.layout_hash and moved.goal == real.goal
        assert moved.start in shortest_path(real)  # on the real route, two cells before the goal
    s.set_progress(0.5)
    half = s.take(12)
    real = maze.TrainSampler(seed=4).take(24)[12:]
    for moved, r in zip(half, real):
        assert optimal_steps(moved) == max(2, round(0.5 * optimal_steps(r)))
    s.set_progress(1.0)
    assert s.take(3) == maze.TrainSampler(seed=4).take(27)[24:]


def test_replay_redraws_failed_mazes_by_weight_and_resumes_its_buffer():
    s = maze.TrainSampler(curriculum="replay", replay_fraction=0.5, seed=5)
    first = s.take(8)
    stats = s.record(first, [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    assert stats["replay/buffer"] == 8 and stats["replay/unsolved_share"] == 0.25
    state = s.state_dict()
    nxt = s.take(4)
    # half of the draw is replayed; with weights (1 - success) + 1e-3 the two unsolved mazes come first
    assert {m.content_hash for m in nxt[:2]} == {first[0].content_hash, first[7].content_hash}
    assert all(m.content_hash not in {f.content_hash for f in first} for m in nxt[2:])
    again = maze.TrainSampler(curriculum="replay", replay_fraction=0.5, seed=5)
    again.load_state_dict(state)
    assert again.take(4) == nxt
    s.record(nxt[:1], [1.0])  # a replayed maze's entry is refreshed, not duplicated
    assert len(s.replay) == 8 and s.replay[-1][1] == 1.0


def test_new_held_out_suites_are_what_they_say():
    from maze.core import GENERATORS

    for name, size in (("select7", 7), ("select11", 11)):  # selection suites at other sizes
        assert all(m.size == size and m.generator == "wilson" for m in maze.load_suite(name).mazes)
    assert all(m.size == 17 for m in maze.load_suite("size17").mazes)
    side = maze.load_suite("gen_sidewinder").mazes
    assert "sidewinder" in GENERATORS and all(m.generator == "sidewinder" for m in side)
    assert all(set(m.to_rows()[1][1:-1]) <= set(".SG") for m in side)  # sidewinder: the top row is one corridor
    for name, size in (("braided11", 11), ("braided13", 13)):
        mazes = maze.load_suite(name).mazes
        assert all(m.size == size and m.braid == 0.5 for m in mazes)
        # several routes: more open cells than a tree has (a perfect maze has exactly rooms - 1 corridors)
        n = (size - 1) // 2
        assert all(int((m.grid == 0).sum()) > n * n + n * n - 1 for m in mazes)


# from S: up a pocket 2 cells deep, right one 6 cells deep, down the route to the goal (8 moves)
POCKETS = ["#######",
           "#.#...#",
           "#.#.###",
           "#S..#G#",
           "#.###.#",
           "#.....#",
           "#######"]


def test_dead_ends_are_the_goalless_pockets_within_the_lookahead():
    from maze.core import Maze, dead_ends
    from maze.thought import thought

    m = Maze.from_rows(POCKETS)
    # from S: up is a pocket 2 cells deep, right one 6 cells deep, down leads to the goal
    assert dead_ends(m, m.start, 8) == ["up", "right"]
    assert dead_ends(m, m.start, 5) == ["up"]
    assert dead_ends(m, m.start, 1) == []
    assert dead_ends(m, (5, 3), 20) == ["left"]  # the way back to the start, and the start's pockets, hold no goal
    assert thought(m, m.start, "up", 8) == "<think>open up down right; not up right</think>"
    assert thought(m, m.start, "up", 0) == "<think>facing up; open up down right</think>"
    assert thought(m, m.goal, "up", 8) == "<think>on the goal</think>"
