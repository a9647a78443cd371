"""The framework versions this runtime supports, and the one line that says so.

Each adapter builds on extension points of its framework that older releases do not have
(Pydantic AI's durable-execution capability API, the Agents SDK's runner and MCP server
hooks), and this runtime's own ``mcp>=2`` rules out older Agents SDK releases. The ranges
below are the ``frameworks`` extra's in ``pyproject.toml`` (a test keeps them the same); CI
runs the adapters' tests at both ends of each.

An installed version outside its range is refused when an adapter is imported or an agent
registered, with one line naming the range (web and workers print it as their "cannot start"
line), not a traceback from deep inside the framework.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from importlib import metadata

from runtime.durable.errors import DurableConfigError


class FrameworkVersionError(DurableConfigError):
    """The installed framework is missing, or outside the range this runtime supports."""


def release(version: str) -> tuple[int, ...]:
    """``"2.62.0"`` -> ``(2, 62, 0)``: the release numbers of a version (a pre-release or a
    local part counts as its release)."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(n) for n in found.group(0).split(".")) if found else ()


@dataclass(frozen=True)
class Supported:
    """One framework's supported range: ``oldest`` <= version < ``below``."""

    framework: str
    """As users name it: "Pydantic AI"."""
    distribution: str
    """The package that carries its version ("pydantic-ai-slim"; ``pydantic-ai`` pins it)."""
    module: str
    """What it is imported as (its ``__version__``, for a copy installed without metadata)."""
    oldest: str
    below: str

    @property
    def spec(self) -> str:
        """The requirement users install: ``pydantic-ai-slim>=2.62,<3``."""
        return f"{self.distribution}>={self.oldest},<{self.below}"

    def installed(self) -> str | None:
        """The installed version (``None``: not installed)."""
        try:
            return metadata.version(self.distribution)
        except metadata.PackageNotFoundError:
            pass
        try:
            found = getattr(importlib.import_module(self.module), "__version__", None)
        except ImportError:
            return None
        return found if isinstance(found, str) else None

    def problem(self) -> str | None:
        """What is wrong with the installed version, in one line (``None``: it is supported)."""
        found = self.installed()
        if found is None:
            return (
                f"{self.framework} is not installed; this runtime supports {self.spec} "
                f"(pip install '{self.spec}')"
            )
        if release(self.oldest) <= release(found) < release(self.below):
            return None
        return (
            f"{self.distribution} {found} is installed; this runtime supports {self.spec} "
            f"for {self.framework} agents (pip install '{self.spec}')"
        )

    def require(self) -> None:
        """Raise :class:`FrameworkVersionError` (one line naming the range) unless the
        installed version is supported."""
        problem = self.problem()
        if problem is not None:
            raise FrameworkVersionError(problem)


PYDANTIC_AI = Supported("Pydantic AI", "pydantic-ai-slim", "pydantic_ai", oldest="2.62", below="3")
"""2.62: the first release with ``conversation_id_from_run_id`` and the rest of the durability
capability API the adapter implements. Below 3: Pydantic AI breaks APIs only in a major."""

OPENAI_AGENTS = Supported(
    "the OpenAI Agents SDK", "openai-agents", "agents", oldest="0.20", below="0.25"
)
"""0.20: the first release that allows ``mcp`` 2 (this runtime's core dependency). Below
0.25: the SDK's minor releases may break its API; a new one is added once CI passes on it."""

SUPPORTED = {"pydantic_ai": PYDANTIC_AI, "openai_agents": OPENAI_AGENTS}
"""By :func:`runtime.frameworks.framework_of`'s names."""
