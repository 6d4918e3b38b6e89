"""Release: push a validated local dataset artifact to the Hugging Face Hub.

    embodistill push-dataset outputs/tiny/distill/dataset --repo ORG/NAME [--private]

The folder is checked offline first (`distill.card.validate_artifact`) and the repo id is checked, then each
config goes up with `DatasetDict.push_to_hub(repo, config_name=...)` and the card last (so its metadata and
prose replace what `push_to_hub` writes). The token comes from the environment (`HF_TOKEN`); it is never
printed, logged or written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from distill.card import validate_artifact

TOKEN_ENV = "HF_TOKEN"


class PushError(ValueError):
    """The push cannot start or failed; the message names what is wrong (never the token)."""


def check_repo_id(repo: str) -> str:
    """`ORG/NAME` as the Hub accepts it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    if not isinstance(repo, str) or repo.count("/") != 1 or not all(repo.split("/")):
        raise PushError(f"--repo must be ORG/NAME (a namespace and a dataset name), not {repo!r}")
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise PushError(f"--repo {repo!r} is not a valid Hub repo id: {e}") from e
    return repo


def read_token(env: str = TOKEN_ENV) -> str:
    token = os.environ.get(env, "").strip()
    if not token:
        raise PushError(f"the environment variable {env} is not set: it must hold a Hugging Face token with write "
                        f"access to the target namespace (e.g. `export {env}=hf_...`)")
    return token


def push_dataset(folder: str | Path, repo: str, private: bool = False, token_env: str = TOKEN_ENV) -> dict:
    """Validate `folder` and `repo`, read the token, push every config and then the card."""
    from datasets import load_dataset
    from huggingface_hub import DatasetCard

    folder = Path(folder)
    repo = check_repo_id(repo)
    meta = validate_artifact(folder)
    token = read_token(token_env)
    pushed = {}
    try:
        for entry in meta.configs:
            with tempfile.TemporaryDirectory(prefix="embodistill-datasets-") as cache:  # no copy left in ~/.cache
                ds = load_dataset(str(folder), entry.config_name, cache_dir=cache, keep_in_memory=True)
            ds.push_to_hub(repo, config_name=entry.config_name, token=token, private=private,
                           commit_message=f"embodistill: {entry.config_name} config")
            pushed[entry.config_name] = {split: len(d) for split, d in ds.items()}
        DatasetCard((folder / "README.md").read_text()).push_to_hub(repo, token=token, repo_type="dataset",
                                                                    commit_message="embodistill: dataset card")
    except Exception as e:  # the Hub's errors, with the token scrubbed should a server ever echo it
        raise PushError(f"pushing {folder} to {repo} failed: {type(e).__name__}: "
                        f"{str(e).replace(token, '***')[:500]}") from None
    return {"repo": repo, "url": f"https://huggingface.co/datasets/{repo}", "private": private, "configs": pushed}
