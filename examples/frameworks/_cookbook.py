"""What the two cookbook examples share: the data they give the model, and what they do
with the figures its cells draw."""

import base64
from pathlib import Path
from typing import Any

SALES = "month,revenue\nJan,120\nFeb,95\nMar,210\nApr,160\n"
DATA = "/home/user/sales.csv"  # where the sandbox holds it
TASK = f"{DATA} holds monthly revenue. Plot it as a bar chart and tell me the best month."


def save_charts(execution: Any, folder: Path) -> None:
    """Each figure a cell drew (a result with a PNG), as ``chart-N.png`` in ``folder``."""
    for result in execution.results:
        if result.png:
            path = folder / f"chart-{len(list(folder.glob('chart-*.png')))}.png"
            path.write_bytes(base64.b64decode(result.png))
            print("saved", path)
