"""What a policy was trained with: the resolved config its run recorded beside it (``policy/vlmaze_config.yaml``,
written by ``rl.checkpoint.save_checkpoint``). One reader for every use: the trainer refuses a start whose
observation differs from the run's (``conf.schema``), ``evaluate.py`` adopts the run's settings, and the probes
in ``sweeps/`` play a policy on the observation it was trained on.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

RUN_CONFIG = "vlmaze_config.yaml"  # in policy/: the resolved config of the run that wrote it


class RecordError(ValueError):
    """A recorded run config that exists but cannot be read."""


def run_config(policy_dir: str | Path) -> dict | None:
    """The resolved config recorded beside a policy, or None (no record: an older run or a hub model). A record
    that cannot be read raises ``RecordError`` naming the file and the cause."""
    path = Path(policy_dir) / RUN_CONFIG
    if not path.is_file():
        return None
    try:
        out = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as err:  # yaml or omegaconf: one line naming it
        first = str(err).splitlines()[0] if str(err) else ""
        raise RecordError(f"{path}: its recorded run config cannot be read ({type(err).__name__}: {first})") from None
    if not isinstance(out, dict):
        raise RecordError(f"{path}: its recorded run config is not a mapping")
    return out


def recorded(policy_dir: str | Path, group: str) -> dict:
    """One group of the recorded config (``env``, ``model``, ``algo``, ...); empty without a record."""
    return ((run_config(policy_dir) if Path(str(policy_dir)).is_dir() else None) or {}).get(group) or {}
