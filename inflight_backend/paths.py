"""Where the project and its generated outputs live."""
import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = Path(os.environ.get("INFLIGHT_BUILD_DIR", PROJECT_ROOT / "build"))
LIB_DIR = BUILD_DIR / "lib"
