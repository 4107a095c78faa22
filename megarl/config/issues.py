"""The one error type of config loading: a list of problems, each naming the key, the value, the rule and the fix."""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.lifecycle import see


@dataclass(frozen=True)
class Issue:
    key: str  # dotted path, e.g. "rollout.temperature"
    value: object
    rule: str  # what is wrong, as a rule the value breaks
    fix: str = ""  # what to do
    keys: tuple[str, ...] = field(default=())  # every key the rule reads (to drop rules over already-bad keys)
    warning: bool = False
    # its troubleshooting entry (megarl.lifecycle.see): megarl.validate sets the id of the rule that found it
    error_id: str = ""

    def render(self) -> str:
        value = "<missing>" if self.value is _MISSING else repr(self.value)
        text = f"{self.key} = {value}: {self.rule}"
        return text + (f" -> {self.fix}" if self.fix else "")

    def line(self) -> str:
        """The console's line: render() and where its troubleshooting entry is."""
        return self.render() + (f" {see(self.error_id)}" if self.error_id else "")


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()


class ConfigError(ValueError):
    """Every problem found while loading a recipe, reported together."""

    def __init__(self, source: str, issues: list[Issue]):
        self.source = source
        self.issues = issues
        lines = [f"{source}: {len(issues)} problem{'s' if len(issues) != 1 else ''} in the configuration:"]
        lines += [f"  {i}. {issue.line()}" for i, issue in enumerate(issues, 1)]
        super().__init__("\n".join(lines))
