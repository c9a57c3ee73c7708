"""The design's promises, checked: one GRPO step stays within a few files; the packages import one way."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_STEP_FILES = 9


def test_one_default_grpo_step_runs_in_at_most_nine_project_files():
    proc = subprocess.run([sys.executable, "tests/scripts/trace_step.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    files = dict(line.split(": ", 1) for line in lines if line.endswith(".py") or ".py: " in line)
    assert lines[-1] == f"files: {len(files)}"
    # the trace saw a whole step: rollout, engine, rewards and loss, the trainer's forward
    for name, functions in {"rl/rollout.py": "rollout", "models/engines/hf.py": "generate",
                            "rl/grpo.py": "policy_loss", "models/forward.py": "token_logprobs",
                            "maze/env.py": "step"}.items():
        assert functions in files.get(name, "").split(", "), (name, files.get(name))
    assert len(files) <= MAX_STEP_FILES, "\n".join(lines)


def _imports(path: Path) -> set[str]:
    """Project modules a file imports (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.split(".")[0] in ("maze", "models", "rl", "conf")}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_packages_import_one_way_and_maze_has_no_import_cycle():
    files = {_module(p): p for pkg in ("maze", "models", "rl") for p in (ROOT / pkg).rglob("*.py")}
    deps = {mod: {m for m in _imports(p) if m in files} for mod, p in files.items()}
    # maze knows nothing of models or rl; models nothing of rl
    for mod, targets in deps.items():
        for t in targets:
            if mod.startswith("maze"):
                assert t.startswith("maze"), f"{mod} imports {t}"
            if mod.startswith("models"):
                assert not t.startswith("rl"), f"{mod} imports {t}"

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
        if mod.endswith("__init__"):
            continue
        assert cycle_from(mod) is None, f"import cycle: {' -> '.join(cycle_from(mod))}"
