"""Scene packs: data files (YAML) that the procedural builder samples layouts and tasks from."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import ValidationError

from sandbox.schema import ScenePack

SCENE_DIR = Path(__file__).with_name("scenes")


class SceneError(ValueError):
    pass


def scene_ids() -> list[str]:
    return sorted(p.stem for p in SCENE_DIR.glob("*.yaml"))


@lru_cache(maxsize=None)
def load_scene(scene_id: str) -> ScenePack:
    path = SCENE_DIR / f"{scene_id}.yaml"
    if not path.exists():
        raise SceneError(f"unknown scene {scene_id!r}; known scenes: {', '.join(scene_ids())}")
    return load_scene_file(path)


def load_scene_file(path: Path) -> ScenePack:
    try:
        data = yaml.safe_load(path.read_text())
        return ScenePack.model_validate(data)
    except yaml.YAMLError as e:
        raise SceneError(f"{path}: not valid YAML: {e}") from e
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise SceneError(f"{path}: {field}: {err['msg']}") from e
