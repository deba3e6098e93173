"""`hf download REPO --local-dir DIR` as slime's launchers run it, with vime's meaning: a DIR that
already holds files is used as it is (a model or data set put there by hand, or by an earlier
run), else the repository is fetched with huggingface_hub; where it cannot be fetched (offline, an
unknown or gated repository) the launcher stops in one line naming DIR.
"""

from __future__ import annotations

import shlex
from pathlib import Path


class DownloadError(SystemExit):
    """A download a launcher needs that cannot happen: one line, the launcher's exit (code 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def hf_download(repo_id: str, local_dir: str | Path, repo_type: str = "model") -> Path:
    """`local_dir` holding `repo_id`: as it is when it holds files, else fetched."""
    local = Path(local_dir).expanduser()
    if local.is_dir() and any(local.iterdir()):
        print(f"hf download {repo_id}: {local} holds files already: using them", flush=True)
        return local
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, repo_type=repo_type, local_dir=str(local))
    except Exception as e:  # offline, unknown id, gated, no space: all end the same way for the launcher
        what = "data set" if repo_type == "dataset" else "model"
        raise DownloadError(
            f"hf download {repo_id} failed ({type(e).__name__}): offline, put the {what}'s files in {local} "
            "(an HF directory) and run the launcher again"
        ) from None
    return local


def download_command(cmd: str) -> bool:
    """Run `cmd` here if it is one `hf download REPO --local-dir DIR [--repo-type T]` (True), else
    leave it to the shell (False: other options, several commands, or not a download)."""
    try:
        words = shlex.split(cmd)
    except ValueError:
        return False
    if words[:2] != ["hf", "download"] or len(words) < 3 or words[2].startswith("-"):
        return False
    options: dict[str, str] = {}
    rest = iter(words[3:])
    for word in rest:
        key, _, value = word.partition("=")
        if key not in ("--local-dir", "--repo-type"):
            return False
        options[key] = value or next(rest, "")
    if not options.get("--local-dir") or options.get("--repo-type", "model") not in ("model", "dataset"):
        return False
    hf_download(words[2], options["--local-dir"], options.get("--repo-type", "model"))
    return True
