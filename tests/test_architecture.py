"""The design's promises, checked on the source: which package may import which, the algorithm knows nothing of
mazes, imports sit at the top of a file unless a reason is written beside them. (What one step runs is a report,
``tests/scripts/trace_step.py``, not a cap: a split that makes the step easier to read must not fail a test.)"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("maze", "models", "rl", "conf")
SCRIPTS = ("train.py", "evaluate.py", "launch.py")

# Which project packages each package may import (its own always): maze and conf are the ground, models builds
# on the maze's text (the tiny tokenizer's corpus, the turn budget its memory plan needs), rl on everything below.
MAY_IMPORT = {"maze": {"maze"}, "conf": {"conf", "maze"}, "models": {"models", "maze.env"},
              "rl": {"rl", "models", "maze", "conf"}}
# The algorithm: pure GRPO, the update, the step's metrics, ranks. Nothing of the maze, the SFT recipe or its data.
ALGORITHM = ("rl.grpo", "rl.update", "rl.metrics", "rl.dist", "rl.faults")
NOT_FOR_THE_ALGORITHM = ("maze", "rl.sft", "rl.experts", "rl.policies", "rl.run", "rl.evaluation")


def _files() -> dict[str, Path]:
    out = {".".join(p.relative_to(ROOT).with_suffix("").parts): p
           for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    out.update({Path(s).stem: ROOT / s for s in SCRIPTS})
    for folder in ("bench", "sweeps"):
        out.update({f"{folder}.{p.stem}": p for p in (ROOT / folder).glob("*.py")})
    return out


def _imports(path: Path) -> set[str]:
    """Project modules a file imports (top level or inside functions), as dotted names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    roots = (*PACKAGES, *(Path(s).stem for s in SCRIPTS), "bench", "sweeps", "tests")
    return {m for m in out if m.split(".")[0] in roots}


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_packages_import_only_what_lies_below_them():
    bad = []
    for mod, path in _files().items():
        pkg = mod.split(".")[0]
        for target in _imports(path):
            if pkg in MAY_IMPORT and not _under(target, MAY_IMPORT[pkg]):
                bad.append(f"{mod} imports {target}")  # e.g. conf.schema imported rl.checkpoint
            if pkg in (*PACKAGES, "train", "evaluate", "launch") and _under(target, ("bench", "sweeps", "tests")):
                bad.append(f"{mod} imports the probe or test module {target}")
            if pkg in PACKAGES and _under(target, [Path(s).stem for s in SCRIPTS]):
                bad.append(f"{mod} imports the script {target}")
    assert not bad, "\n".join(sorted(bad))


def test_the_algorithm_imports_nothing_of_the_maze_or_the_sft_recipe():
    files = _files()
    bad = [f"{mod} imports {t}" for mod in ALGORITHM for t in _imports(files[mod])
           if _under(t, NOT_FOR_THE_ALGORITHM)]
    assert not bad, "\n".join(sorted(bad))  # e.g. rl.grpo imported maze.env and rl.sft for its rewards


def test_imports_sit_at_the_top_unless_a_reason_is_written_beside_them():
    """A function-level import needs a comment on its line, on a line of its import block, or just above the block
    (an optional dependency, or a heavy one kept off the fast config-validation path)."""
    bad = []
    for mod, path in _files().items():
        if mod.split(".")[0] in ("bench", "sweeps"):
            continue  # probes: sys.path set-up before their imports
        src = path.read_text().splitlines()
        tree = ast.parse("\n".join(src))
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top:
                continue
            first = node.lineno - 1
            while first > 0 and (src[first - 1].strip().startswith(("from ", "import "))
                                 or (not src[first - 1].strip() and first > 1
                                     and src[first - 2].strip().startswith(("from ", "import ")))):
                first -= 1  # the import block this one belongs to (its sections apart by blank lines)
            block = src[max(first - 1, 0):node.end_lineno]
            if not any("#" in line for line in block):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {src[node.lineno - 1].strip()}")
    assert not bad, f"{len(bad)} function-level imports without a reason:\n" + "\n".join(bad)


def test_no_import_cycle():
    files = _files()
    deps = {mod: {m for m in _imports(p) if m in files} for mod, p in files.items()}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in deps.get(node, ()):
                if nxt == start:
                    return path + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    for mod in files:
        if mod.endswith("__init__") or mod == "train":  # train.py imports itself as a module on purpose
            continue
        assert cycle_from(mod) is None, f"import cycle: {' -> '.join(cycle_from(mod))}"


def test_the_step_trace_reports_a_whole_step():
    """The trace (a report of which files one GRPO step runs, and how often it enters each) sees the rollout, the
    engine, the maze's rewards, the loss and the trainer's forward; its numbers are for reading, not a cap."""
    proc = subprocess.run([sys.executable, "tests/scripts/trace_step.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(line.split(": ", 1) for line in proc.stdout.strip().splitlines() if ".py: " in line)
    for name, function in {"rl/rollout.py": "rollout", "models/engines/hf.py": "generate",
                           "maze/rewards.py": "episode_reward", "rl/grpo.py": "policy_loss",
                           "rl/update.py": "accumulate", "models/forward.py": "token_logprobs",
                           "maze/env.py": "step"}.items():
        assert function in rows.get(name, ""), (name, rows.get(name))
