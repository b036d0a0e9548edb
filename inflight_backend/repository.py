"""Writing Triton model repositories whose models use the inflight backend (tests, benchmarks, deployments)."""
from __future__ import annotations

import re
from pathlib import Path

from .paths import PROJECT_ROOT

TEMPLATE = PROJECT_ROOT / "model_repository" / "llm" / "config.pbtxt"


def model_config(checkpoint: str, name: str, **params) -> str:
    """The shipped model_repository/llm/config.pbtxt with its name, checkpoint (made absolute: relative paths
    would be read from the model's directory) and the given parameters set."""
    text = TEMPLATE.read_text().replace('name: "llm"', f'name: "{name}"')
    for key, value in {"checkpoint": Path(checkpoint).resolve(), **params}.items():
        line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        pattern = rf'parameters \{{ key: "{key}" value: \{{ string_value: "[^"]*" \}} \}}'
        text, count = re.subn(pattern, line.replace("\\", "\\\\"), text)
        if not count:
            text += line + "\n"
    return text


def write_repository(root: str | Path, models: dict[str, str]) -> Path:
    """Create `root/<name>/config.pbtxt` (and the version folder) for each model config text."""
    root = Path(root)
    for name, config in models.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(config)
    return root
