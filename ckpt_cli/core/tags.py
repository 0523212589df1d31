"""Which of several checkpoints a `--tag` names: its exact name, that name less its suffix (`step_100` for
`step_100.safetensors`) or, given as a number, its step (`100` for step_100, global_step100, checkpoint-100)."""

from __future__ import annotations

import re

from ckpt_cli.errors import UsageError

STEP = re.compile(r"(?:step|checkpoint)[-_=]?(\d+)", re.IGNORECASE)


def step_in(name: str) -> int | None:
    """The step a checkpoint's name (or relative path) carries, the last one it names; None without one."""
    found = STEP.findall(name)
    return int(found[-1]) if found else None


def named(tag: str, names: list[str]) -> list[str]:
    """The names `tag` names, by the first rule that matches any: exact, without suffix, by step."""
    for rule in (lambda n: n == tag, lambda n: n.split(".")[0] == tag, lambda n: tag.isdigit() and step_in(n) == int(tag)):
        found = [n for n in names if rule(n)]
        if found:
            return found
    return []


def pick(tag: str, names: list[str], where: str, kind: str) -> str:
    """The one name `tag` names; UsageError (naming `where` and what it holds) when it names none or several."""
    chosen = named(tag, names)
    if len(chosen) != 1:
        how = "no" if not chosen else "more than one"
        raise UsageError(f"{where}: {how} {kind} '{tag}' (found: {', '.join(names) or 'none'})")
    return chosen[0]
