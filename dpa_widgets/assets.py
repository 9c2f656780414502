"""The three scripts a standalone HTML page needs to render an anywidget with no kernel or network.

* ``require.js``                        npm ``requirejs``
* ``embed-amd.js``                      npm ``@jupyter-widgets/html-manager`` (dist/), the ipywidgets 8 manager
* ``anywidget/nbextension/index.js``    anywidget's AMD module, shipped in its Python wheel

The npm files are never committed. They are looked up in ``$DPA_NODE_MODULES``, then in the
repository's ``node_modules`` (the book's install step puts them there), then in
``<dpa cache>/npm/node_modules`` (``$DPA_CACHE``, default ``~/.cache/dpa``); when none has them they are fetched
once into that cache with ``npm pack`` (``python -m dpa_widgets.assets`` does it ahead of time).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

# html-manager 1.x is the ipywidgets 8 manager (ipywidgets 8.1 asks for ^1.0.1).
PACKAGES = {"requirejs": "2.3.7", "@jupyter-widgets/html-manager": "1.0.15"}
FILES = {"requirejs": "require.js", "@jupyter-widgets/html-manager": "dist/embed-amd.js"}
MAJOR = {"requirejs": "2", "@jupyter-widgets/html-manager": "1"}
NPM_INSTALL = ("npm install --no-save --no-package-lock --no-audit --no-fund "
               + " ".join(f"{name}@{version}" for name, version in PACKAGES.items()))


class AssetError(RuntimeError):
    """The offline scripts for save_html are missing and could not be fetched."""


@dataclass(frozen=True)
class Assets:
    require_js: Path
    embed_amd: Path
    anywidget_amd: Path


def cache_dir() -> Path:
    from dpa.models import cache_root  # $DPA_CACHE, else the user cache folder, as for the model

    return cache_root() / "npm"


def search_path() -> list[Path]:
    """Folders (``node_modules``) searched for the npm packages, in order."""
    out = []
    if os.environ.get("DPA_NODE_MODULES"):
        out.append(Path(os.environ["DPA_NODE_MODULES"]))
    out.append(Path(__file__).resolve().parents[1] / "node_modules")
    out.append(cache_dir() / "node_modules")
    return out


def anywidget_amd() -> Path:
    import anywidget

    path = Path(anywidget.__file__).parent / "nbextension" / "index.js"
    if not path.is_file():
        raise AssetError(f"anywidget {anywidget.__version__} has no AMD module at {path}; reinstall anywidget>=0.9")
    return path


def _usable(folder: Path, name: str) -> Path | None:
    path = folder / name / FILES[name]
    manifest = folder / name / "package.json"
    if not (path.is_file() and manifest.is_file()):
        return None
    version = str(json.loads(manifest.read_text()).get("version", ""))
    return path if version.split(".")[0] == MAJOR[name] else None


def find_assets() -> Assets | None:
    """The scripts from the first folder holding usable versions of both packages, or None."""
    for folder in search_path():
        found = {name: _usable(folder, name) for name in PACKAGES}
        if all(found.values()):
            return Assets(found["requirejs"], found["@jupyter-widgets/html-manager"], anywidget_amd())
    return None


def fetch(dest: Path | None = None) -> Path:
    """Fetch the two npm packages with ``npm pack`` and unpack the needed files under ``dest``."""
    dest = dest or cache_dir() / "node_modules"
    npm = shutil.which("npm")
    if npm is None:
        raise AssetError("save_html needs require.js and the ipywidgets html-manager from npm, and npm is not "
                         f"installed. Install Node.js/npm, or run `{NPM_INSTALL}` at the repository root "
                         "(or in a folder named by $DPA_NODE_MODULES)")
    with tempfile.TemporaryDirectory() as tmp:
        specs = [f"{name}@{version}" for name, version in PACKAGES.items()]
        done = subprocess.run([npm, "pack", "--silent", "--pack-destination", tmp, *specs],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise AssetError(f"`npm pack {' '.join(specs)}` failed:\n{done.stderr.strip()}")
        tarballs = sorted(Path(tmp).glob("*.tgz"))
        for name in PACKAGES:
            stem = name.lstrip("@").replace("/", "-")
            tgz = next((p for p in tarballs if p.name.startswith(stem + "-")), None)
            if tgz is None:
                raise AssetError(f"npm pack did not produce a tarball for {name} in {tmp}")
            with tarfile.open(tgz) as tar:
                for member in ("package.json", FILES[name]):
                    data = tar.extractfile(f"package/{member}")
                    if data is None:
                        raise AssetError(f"{tgz.name} lacks package/{member}")
                    out = dest / name / member
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(data.read())
    return dest


def ensure_assets(*, download: bool = True) -> Assets:
    """The three scripts, fetching the npm ones into the cache on first use."""
    found = find_assets()
    if found is None and download:
        fetch()
        found = find_assets()
    if found is None:
        where = ", ".join(str(p) for p in search_path())
        raise AssetError(f"require.js and @jupyter-widgets/html-manager 1.x were not found in {where}. "
                         f"Run `{NPM_INSTALL}` at the repository root, or `python -m dpa_widgets.assets`")
    return found


if __name__ == "__main__":
    assets = ensure_assets()
    print(f"require.js:   {assets.require_js}\nembed-amd.js: {assets.embed_amd}\nanywidget:    {assets.anywidget_amd}",
          file=sys.stdout)
