"""Writing Triton model repositories whose models use the inflight backend (tests, benchmarks, deployments)."""
from __future__ import annotations

import re
from pathlib import Path

from .paths import PROJECT_ROOT

TEMPLATE = PROJECT_ROOT / "model_repository" / "llm" / "config.pbtxt"


def model_config(checkpoint: str, name: str, triton_max_batch_size: int = 0, decoupled: bool = True,
                 dynamic_batching: str | None = None, instances: int = 1, **params) -> str:
    """The shipped model_repository/llm/config.pbtxt with its name, checkpoint (made absolute: relative paths
    would be read from the model's directory) and the given parameters set. `triton_max_batch_size` > 0:
    TensorRT-LLM's batched request layout; `decoupled` False: a model for unary calls; `dynamic_batching`: the
    body of a `dynamic_batching { ... }` block ("" for Triton's defaults), None for none; `instances`: how many
    processes Triton starts for the model (`instance_group`'s count)."""
    text = TEMPLATE.read_text().replace('name: "llm"', f'name: "{name}"')
    text = text.replace("max_batch_size: 0", f"max_batch_size: {triton_max_batch_size}")
    text = text.replace("decoupled: true", f"decoupled: {str(decoupled).lower()}")
    text = text.replace("instance_group [ { count: 1,", f"instance_group [ {{ count: {instances},")
    for key, value in {"checkpoint": Path(checkpoint).resolve(), **params}.items():
        line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        pattern = rf'parameters \{{ key: "{key}" value: \{{ string_value: "[^"]*" \}} \}}'
        text, count = re.subn(pattern, line.replace("\\", "\\\\"), text)
        if not count:
            text += line + "\n"
    if dynamic_batching is not None:
        text += f"dynamic_batching {{ {dynamic_batching} }}\n"
    return text


def write_repository(root: str | Path, models: dict[str, str]) -> Path:
    """Create `root/<name>/config.pbtxt` (and the version folder) for each model config text."""
    root = Path(root)
    for name, config in models.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(config)
    return root


_PARAMETER = re.compile(r'parameters \{ key: "([^"]+)" value: \{ string_value: "([^"]*)" \} \}')


def check_repository(root: str | Path) -> list[str]:
    """Problems that would stop the inflight models in `root` from loading, each a sentence for the user."""
    from .config import EngineConfig

    root = Path(root)
    if not root.is_dir():
        return [f"model repository {root} does not exist"]
    problems = []
    for config_file in sorted(root.glob("*/config.pbtxt")):
        text = config_file.read_text()
        if 'backend: "inflight"' not in text:
            continue
        name = config_file.parent.name
        try:
            config = EngineConfig.from_parameters(dict(_PARAMETER.findall(text)), base_dir=str(config_file.parent))
        except ValueError as exc:
            problems.append(f"model {name}: {exc}")
            continue
        if not (Path(config.checkpoint) / "config.json").is_file():
            problems.append(f"model {name}: checkpoint {config.checkpoint} has no config.json (run `make model` "
                            "for the default one, or point `checkpoint` at a Hugging Face Llama directory)")
    return problems
