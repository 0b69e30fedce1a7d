"""Fixtures for the boogu-data tests."""

from __future__ import annotations

from pathlib import Path

import pytest

# shared/ is a sibling of the repository checkout (repo_root.parent / "shared"), here and in CI.
SHARED_DIR = Path(__file__).resolve().parents[2].parent / "shared"
OCR_PROMPTS = SHARED_DIR / "data" / "ocr" / "prompts.txt"


@pytest.fixture(scope="session")
def ocr_prompts() -> Path:
    """The 300 real Flow-GRPO OCR prompts from shared/data/ocr/prompts.txt."""
    if not OCR_PROMPTS.is_file():
        pytest.skip(f"{OCR_PROMPTS} is absent: shared/ must sit beside the repository checkout")
    return OCR_PROMPTS
