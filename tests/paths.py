"""The repository root, for tests at any depth: the one place a test finds the checkout's files."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
