"""What the cookbook examples do with a cell's figures: each PNG result saved to a file."""

import base64
from pathlib import Path
from typing import Any


def save_charts(execution: Any, folder: Path) -> None:
    """Each figure a cell drew (a result with a PNG), as ``chart-N.png`` in ``folder``."""
    for result in execution.results:
        if result.png:
            path = folder / f"chart-{len(list(folder.glob('chart-*.png')))}.png"
            path.write_bytes(base64.b64decode(result.png))
            print("saved", path)
