"""Write docs/models.md's family x view matrix from attnscope/models/support.py, the source the conformance tests
read (tests/test_conformance.py checks that the docs show it).

    python scripts/support_table.py    # replace the table in docs/models.md with support.markdown()
"""

from __future__ import annotations

from pathlib import Path

from attnscope.models.support import markdown

DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"
HEADER = "| family (model_type) | short |"


def main() -> None:
    text = DOCS.read_text(encoding="utf-8")
    start = text.index(HEADER)
    end = text.find("\n\n", start)
    DOCS.write_text(text[:start] + markdown() + (text[end:] if end >= 0 else "\n"), encoding="utf-8")


if __name__ == "__main__":
    main()
