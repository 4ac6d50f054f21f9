"""What the benchmarks share: writing their results."""

from __future__ import annotations

import json
from typing import Optional


def write_json(path: Optional[str], results) -> None:
    """Write ``results`` to ``path`` as indented JSON (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
