"""The sandbox's public value types: limits of a call, its result, its error."""

from __future__ import annotations

from dataclasses import dataclass, field


class SandboxError(RuntimeError):
    """The sandbox itself failed (a host problem, not something the policy did)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox call. ``memory_mb`` and ``max_processes`` bound each process
    and, where a cgroup is available (root), the call's whole process tree. ``max_disk_mb`` and
    ``max_files`` bound everything the call writes: its private tmpfs's size and inode count in
    namespaces mode, the parent's watch of the working directory in process mode (see sandbox.py)."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024
    max_processes: int = 16
    max_output_bytes: int = 16_384
    max_file_mb: int = 16
    max_disk_mb: int = 64
    max_files: int = 4096  # files, directories and links the call may create (tmpfs inodes)
    max_open_files: int = 64
    allow_site_packages: bool = False  # False: stdlib only (python -S)

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes",
                     "max_output_bytes", "max_file_mb", "max_disk_mb", "max_files", "max_open_files"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {v!r}")
        if not isinstance(self.cpu_time_s, int):
            raise ValueError(f"SandboxLimits.cpu_time_s must be an int (seconds), got {self.cpu_time_s!r}")


@dataclass
class SandboxResult:
    """What one call produced. ``exit_code`` is negative for a signal, None if never started."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    killed_reason: str | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time_s: float = 0.0
    isolation: tuple[str, ...] = field(default_factory=tuple)
    leftover_processes: int = 0  # still running when the program ended; killed then

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None

    def as_observation(self, max_chars: int = 4000) -> str:
        """Text shown to the policy: output, then bracketed notes on errors and limits."""
        parts: list[str] = []
        if self.stdout:
            parts.append(_clip(self.stdout, max_chars))
        if self.stderr:
            parts.append("[stderr]\n" + _clip(self.stderr, max_chars))
        if self.stdout_truncated or self.stderr_truncated:
            parts.append("[output truncated: the output size limit was reached]")
        if self.killed_reason is not None:
            parts.append(f"[killed: {self.killed_reason}]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit status {self.exit_code}]")
        if self.leftover_processes:
            parts.append(f"[{self.leftover_processes} background process(es) still running when the program "
                         "ended were killed]")
        if not parts:
            parts.append("[no output]")
        return "\n".join(parts)


def _clip(text: str, max_chars: int) -> str:
    text = text.rstrip("\n")
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n...[{len(text) - max_chars} chars omitted]...\n{text[-half:]}"
